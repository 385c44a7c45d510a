"""The portable (standard-ONNX) BN training / grad subgraphs against bnfuse's float64 reference kernels."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from bnfuse.passes.training import bn
from bnfuse.runtime import reference
from bnfuse.runtime.semantics import BatchNormConfig, param_shape

CONFIGS = [
    BatchNormConfig(momentum=0.9),
    BatchNormConfig(momentum=0.3, momentum_convention="pytorch", unbiased_running_var=True),
    BatchNormConfig(fix_gamma=True, epsilon=1e-3),
    BatchNormConfig(use_global_stats=True),
    BatchNormConfig(mode="per_activation", momentum=0.8),
    BatchNormConfig(axis=-1, momentum=0.7),
]


def _lowered(config: BatchNormConfig, shape: tuple[int, ...]) -> onnx.ModelProto:
    pshape = list(param_shape(config, shape))
    nodes = [
        bn.training_node(["x", "s", "b", "m", "v"], ["y", "rm", "rv", "sm", "si"], config, "bn"),
        bn.grad_node(["dy", "x", "s", "sm", "si"], ["dx", "ds", "db"], config, "bn_grad"),
    ]
    inits: list[onnx.TensorProto] = []
    nodes = bn.lower_portable(nodes, lambda name: shape, inits)
    f = TensorProto.FLOAT
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info(n, f, list(shape)) for n in ("x", "dy")]
        + [helper.make_tensor_value_info(n, f, pshape) for n in ("s", "b", "m", "v")],
        [helper.make_tensor_value_info(n, f, list(shape)) for n in ("y", "dx")]
        + [helper.make_tensor_value_info(n, f, pshape) for n in ("rm", "rv", "sm", "si", "ds", "db")],
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    model.ir_version = 9
    onnx.checker.check_model(model)
    assert all(node.domain == "" for node in model.graph.node)
    return model


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: f"{c.mode.value}-axis{c.axis}-{c.momentum_convention.value}")
@pytest.mark.parametrize("shape", [(4, 3, 5, 6), (16, 7)])
def test_portable_bn_matches_reference(config: BatchNormConfig, shape: tuple[int, ...]) -> None:
    rng = np.random.default_rng(0)
    pshape = param_shape(config, shape)
    x = rng.standard_normal(shape).astype(np.float32) * 2 + 0.5
    dy = rng.standard_normal(shape).astype(np.float32)
    s = (0.5 + rng.random(pshape)).astype(np.float32)
    b = rng.standard_normal(pshape).astype(np.float32)
    m = (0.1 * rng.standard_normal(pshape)).astype(np.float32)
    v = (0.5 + rng.random(pshape)).astype(np.float32)
    sess = ort.InferenceSession(_lowered(config, shape).SerializeToString(), providers=["CPUExecutionProvider"])
    y, dx, rm, rv, sm, si, ds, db = sess.run(None, {"x": x, "dy": dy, "s": s, "b": b, "m": m, "v": v})
    f64 = {k: a.astype(np.float64) for k, a in {"x": x, "dy": dy, "s": s, "b": b, "m": m, "v": v}.items()}
    fwd = reference.forward_training(f64["x"], f64["s"], f64["b"], f64["m"], f64["v"], config)
    grad = reference.backward(f64["dy"], f64["x"], f64["s"], fwd.saved_mean, fwd.saved_inv_std, config)
    for got, want in [
        (y, fwd.y),
        (rm, fwd.running_mean),
        (rv, fwd.running_var),
        (sm, fwd.saved_mean),
        (si, fwd.saved_inv_std),
        (dx, grad.dx),
        (ds, grad.dscale),
        (db, grad.dbias),
    ]:
        np.testing.assert_allclose(got, want, rtol=2e-4, atol=2e-5)
