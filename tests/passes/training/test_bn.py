"""The portable (standard-ONNX) BN training / grad subgraphs against bnfuse's float64 reference kernels."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import helper

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


def _lowered(config: BatchNormConfig, shape: tuple[int, ...], dtype: type = np.float32) -> onnx.ModelProto:
    pshape = list(param_shape(config, shape))
    nodes = [
        bn.training_node(["x", "s", "b", "m", "v"], ["y", "rm", "rv", "sm", "si"], config, "bn"),
        bn.grad_node(["dy", "x", "s", "sm", "si"], ["dx", "ds", "db"], config, "bn_grad"),
    ]
    inits: list[onnx.TensorProto] = []
    nodes = bn.lower_portable(nodes, lambda name: shape, inits, dtype)
    f = helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
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


# momenta exact in binary: the float64 graph's expected value is then exact up to its own rounding
UNBIASED_CASES = [
    (BatchNormConfig(momentum=0.75, momentum_convention="pytorch", unbiased_running_var=True), (2, 3)),  # M = 2
    (BatchNormConfig(momentum=0.75, momentum_convention="pytorch", unbiased_running_var=True), (16, 7)),
    (BatchNormConfig(momentum=0.75, momentum_convention="pytorch", unbiased_running_var=True), (4, 3, 5, 6)),
    (BatchNormConfig(momentum=0.5, unbiased_running_var=True), (8, 4, 16, 16)),  # onnx convention, M = 2048
    (BatchNormConfig(momentum=0.75, momentum_convention="pytorch", unbiased_running_var=True, axis=-1), (3, 5, 2, 4)),
    (BatchNormConfig(mode="per_activation", momentum=0.25, unbiased_running_var=True), (5, 3, 4)),
    (BatchNormConfig(mode="per_activation", momentum=0.25, unbiased_running_var=True), (3, 6)),
    (BatchNormConfig(momentum=0.75, momentum_convention="pytorch", unbiased_running_var=True), (1, 3)),  # M = 1
]


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize(("config", "shape"), UNBIASED_CASES, ids=lambda c: str(c) if isinstance(c, tuple) else None)
def test_portable_running_variance_uses_exactly_m_over_m_minus_1(config: BatchNormConfig, shape: tuple, dtype) -> None:  # noqa: ANN001
    """The unbiased running variance at the graph's precision, per layout and M from 1 to 2048: the factor M / (M - 1)
    differs from a wrong (M + 1) / M by 1 / (M^2 - 1), 2.4e-7 at M = 2048, so the tolerance is the running update's
    own rounding (float32: 2e-6, which kills that mutant up to M ~ 500; float64 graphs, which bnfuse builds from
    float64 models: 1e-12, every M), not the 2e-4 of the other outputs (which let it through at M = 120). M = 1
    leaves the variance as is (it is 0)."""
    rng = np.random.default_rng(5)
    pshape = param_shape(config, shape)
    x = (rng.standard_normal(shape) * 2 + 0.5).astype(dtype)
    s, b = np.ones(pshape, dtype), np.zeros(pshape, dtype)
    m, v = np.zeros(pshape, dtype), (0.5 + rng.random(pshape)).astype(dtype)
    model = _lowered(config, shape, dtype)
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    feeds = {"x": x, "dy": np.zeros(shape, dtype), "s": s, "b": b, "m": m, "v": v}
    rv = sess.run(["rv"], feeds)[0]
    xf = x.astype(np.float64)
    channel = config.axis % x.ndim
    axes = (0,) if config.mode.value == "per_activation" else tuple(a for a in range(x.ndim) if a != channel)
    count = int(np.prod([shape[a] for a in axes]))
    factor = count / (count - 1) if count > 1 else 1.0
    weight = config.momentum if config.momentum_convention.value == "pytorch" else 1.0 - config.momentum
    want = v.astype(np.float64) * (1 - weight) + weight * factor * xf.var(axis=axes).reshape(pshape)
    assert rv.dtype == dtype
    np.testing.assert_allclose(rv, want, rtol=2e-6 if dtype == np.float32 else 1e-12, atol=0)
