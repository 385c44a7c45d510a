"""bnfuse's Conv / GlobalAveragePool rules in onnx-ad's table: same gradients as PyTorch and as onnx-ad's own."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx_ad import rules

from bnfuse.passes.training import SGD, autodiff, build_training_graph, fast_rules

torch = pytest.importorskip("torch")
spec = importlib.util.spec_from_file_location("bnfuse_test_torch_nets", Path(__file__).with_name("torch_nets.py"))
nets = importlib.util.module_from_spec(spec)
spec.loader.exec_module(nets)
build_tests = importlib.util.spec_from_file_location("bnfuse_test_build", Path(__file__).with_name("test_build.py"))
helpers = importlib.util.module_from_spec(build_tests)
build_tests.loader.exec_module(helpers)


@pytest.mark.parametrize("portable", [False, True], ids=["custom-ops", "portable"])
@pytest.mark.parametrize("kind", ["convzoo", "conv1d", "conv3d"])
def test_conv_variants_match_torch(kind: str, portable: bool) -> None:
    """Depthwise and grouped convolutions and ConvTranspose (onnx-ad refuses their weight gradients),
    dilation, 1-D to 3-D."""
    helpers.CLASSES[kind] = 4
    helpers.compare_with_torch(
        kind,
        portable=portable,
        optimizer=SGD(momentum=0.9, weight_decay=1e-3),
        torch_kwargs={"lr": 0.05, "momentum": 0.9, "weight_decay": 1e-3},
    )


def test_fast_rules_give_onnx_ads_gradients(monkeypatch: pytest.MonkeyPatch) -> None:
    net, shape = nets.make("resnet", seed=21)
    model = nets.export(net, torch.randn(*shape))
    data = nets.batches(shape, 10, 3, seed=22)
    fast, fast_report = build_training_graph(model, portable=True)
    original = autodiff.reverse
    monkeypatch.setattr(autodiff, "reverse", lambda *a, **k: original(*a, **k, fast=False))
    slow, slow_report = build_training_graph(model, portable=True)
    fast_losses, fast_state, _ = helpers.run_steps(fast, data, lr=0.1)
    slow_losses, slow_state, _ = helpers.run_steps(slow, data, lr=0.1)
    np.testing.assert_allclose(fast_losses, slow_losses, rtol=1e-5)
    for name, value in slow_state.items():
        helpers.assert_close_relative(fast_state[name], value, name)
    assert fast_report.op_counts.get("Transpose", 0) < slow_report.op_counts.get("Transpose", 0)


def test_rule_table_is_restored() -> None:
    before = dict(rules.REVERSE)
    with fast_rules.installed():
        assert rules.REVERSE["Conv"] is not before["Conv"]
        assert "BatchNormalizationTraining" in rules.REVERSE
    assert rules.REVERSE == before


def _gemm_chain(trans_a: int, trans_b: int, alpha: float, beta: float, c_shape: list[int]) -> onnx.ModelProto:
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(trans_a * 2 + trans_b)
    n, f, h, o = 6, 4, 5, 3
    w1 = rng.standard_normal((h, f) if trans_b else (f, h)).astype(np.float32)
    w2 = rng.standard_normal((n, o)).astype(np.float32)  # second Gemm: y = alpha * A' @ W2 + beta * C
    first = "h"
    nodes = [helper.make_node("Gemm", ["x", "w1", "b1"], ["h"], transB=trans_b)]
    if not trans_a:
        nodes.append(helper.make_node("Transpose", ["h"], ["ht"], perm=[1, 0]))
        first = "ht"
    nodes += [
        helper.make_node("Gemm", [first, "w2", "c2"], ["z"], transA=trans_a, alpha=alpha, beta=beta),
        helper.make_node("MatMul", ["z", "w3"], ["y"]),
    ]
    inits = [
        numpy_helper.from_array(w1, "w1"),
        numpy_helper.from_array(rng.standard_normal(h).astype(np.float32), "b1"),
        numpy_helper.from_array(w2, "w2"),
        numpy_helper.from_array(rng.standard_normal(c_shape).astype(np.float32), "c2"),
        numpy_helper.from_array(rng.standard_normal((o, 2)).astype(np.float32), "w3"),
    ]
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [n, f])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [h, 2])],
        inits,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


@pytest.mark.parametrize("trans_a", [0, 1])
@pytest.mark.parametrize("trans_b", [0, 1])
@pytest.mark.parametrize(("alpha", "beta", "c_shape"), [(1.0, 1.0, [3]), (0.5, 2.0, [5, 1]), (1.5, 0.3, [5, 3])])
def test_gemm_and_matmul_rules_give_onnx_ads_gradients(
    monkeypatch: pytest.MonkeyPatch, trans_a: int, trans_b: int, alpha: float, beta: float, c_shape: list[int]
) -> None:
    model = _gemm_chain(trans_a, trans_b, alpha, beta, c_shape)
    rng = np.random.default_rng(5)
    data = [(rng.standard_normal((6, 4)).astype(np.float32), rng.standard_normal((5, 2)).astype(np.float32))]
    fast, _ = build_training_graph(model, loss="mse", trainable=["w*", "b1", "c2"])
    original = autodiff.reverse
    monkeypatch.setattr(autodiff, "reverse", lambda *a, **k: original(*a, **k, fast=False))
    slow, _ = build_training_graph(model, loss="mse", trainable=["w*", "b1", "c2"])
    _, fast_state, _ = helpers.run_steps(fast, data, lr=0.1)
    _, slow_state, _ = helpers.run_steps(slow, data, lr=0.1)
    assert {n.op_type for n in fast.graph.node} >= {"Gemm"}
    for name, value in slow_state.items():
        np.testing.assert_allclose(fast_state[name], value, rtol=1e-5, atol=1e-6, err_msg=name)
