"""bnfuse's Conv / GlobalAveragePool rules in onnx-ad's table: same gradients as PyTorch and as onnx-ad's own."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx_ad import rules

from bnfuse.passes.training import SGD, autodiff, build_training_graph, fast_rules
from tests.loaders import load_file, torch_nets

torch = pytest.importorskip("torch")
nets = torch_nets()
helpers = load_file(Path(__file__).with_name("test_build.py"), "bnfuse_test_build")


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
    fast, _ = build_training_graph(model, loss="mse", trainable=["w*", "b1", "c2"], require_batchnorm=False)
    original = autodiff.reverse
    monkeypatch.setattr(autodiff, "reverse", lambda *a, **k: original(*a, **k, fast=False))
    slow, _ = build_training_graph(model, loss="mse", trainable=["w*", "b1", "c2"], require_batchnorm=False)
    _, fast_state, _ = helpers.run_steps(fast, data, lr=0.1)
    _, slow_state, _ = helpers.run_steps(slow, data, lr=0.1)
    assert {n.op_type for n in fast.graph.node} >= {"Gemm"}
    for name, value in slow_state.items():
        np.testing.assert_allclose(fast_state[name], value, rtol=1e-5, atol=1e-6, err_msg=name)


def _token_linears(x_shape: list[int]) -> onnx.ModelProto:
    """Linear layers over tokens (transformer blocks): a batched input [..., T, F] times 2-D weights."""
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(len(x_shape))
    f, h, o = x_shape[-1], 7, 3
    nodes = [
        helper.make_node("MatMul", ["x", "w1"], ["m"]),
        helper.make_node("Add", ["m", "b1"], ["a"]),
        helper.make_node("Tanh", ["a"], ["t"]),
        helper.make_node("MatMul", ["t", "w2"], ["y"]),
    ]
    inits = [
        numpy_helper.from_array(rng.standard_normal((f, h)).astype(np.float32), "w1"),
        numpy_helper.from_array(rng.standard_normal(h).astype(np.float32), "b1"),
        numpy_helper.from_array(rng.standard_normal((h, o)).astype(np.float32), "w2"),
    ]
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, x_shape)],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [*x_shape[:-1], o])],
        inits,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


@pytest.mark.parametrize("x_shape", [[4, 5, 6], [2, 3, 5, 6]], ids=["rank3", "rank4"])
def test_batched_matmul_by_a_matrix_gives_onnx_ads_gradients(
    monkeypatch: pytest.MonkeyPatch, x_shape: list[int]
) -> None:
    """dW of a token Linear as one Gemm over the stacked rows, where onnx-ad's rule takes a batched MatMul and a
    ReduceSum over the batch axes; dX (the first MatMul's input adjoint) through it too."""
    model = _token_linears(x_shape)
    rng = np.random.default_rng(7)
    data = [
        (rng.standard_normal(x_shape).astype(np.float32), rng.standard_normal([*x_shape[:-1], 3]).astype(np.float32))
        for _ in range(2)
    ]
    fast, fast_report = build_training_graph(model, loss="mse", trainable=["w*", "b1"], require_batchnorm=False)
    original = autodiff.reverse
    monkeypatch.setattr(autodiff, "reverse", lambda *a, **k: original(*a, **k, fast=False))
    slow, slow_report = build_training_graph(model, loss="mse", trainable=["w*", "b1"], require_batchnorm=False)
    fast_losses, fast_state, _ = helpers.run_steps(fast, data, lr=0.1)
    slow_losses, slow_state, _ = helpers.run_steps(slow, data, lr=0.1)
    np.testing.assert_allclose(fast_losses, slow_losses, rtol=1e-5)
    for name, value in slow_state.items():
        np.testing.assert_allclose(fast_state[name], value, rtol=1e-5, atol=1e-6, err_msg=name)
    # onnx-ad: a batched MatMul and a ReduceSum per weight (some become column-sum Gemms: simplify); here no
    # MatMul in the backward and only the bias's ReduceSum (7 columns: left as it is)
    assert fast_report.op_counts.get("ReduceSum", 0) == 1 and fast_report.op_counts["MatMul"] == 2
    assert slow_report.op_counts["MatMul"] > 2


def _conv_model(op: str, x_shape: list[int], w_shape: list[int], attrs: dict) -> onnx.ModelProto:
    from onnx import TensorProto, helper

    node = helper.make_node(op, ["x", "w", "b"], ["y"], **attrs)
    bias = w_shape[0] if op == "Conv" else w_shape[1] * attrs.get("group", 1)
    inputs = [("x", x_shape), ("w", w_shape), ("b", [bias])]
    graph = helper.make_graph(
        [node],
        "g",
        [helper.make_tensor_value_info(name, TensorProto.FLOAT, shape) for name, shape in inputs],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    return onnx.shape_inference.infer_shapes(model)


_CONV_CASES = {
    # stride 1 wide maps: weight gradient with the leading offsets on the adjoint side (split), dX as a Conv
    "2d-split": ("Conv", [2, 3, 9, 17], [4, 3, 3, 3], {"pads": [1, 1, 1, 1]}),
    "2d-split-grouped-dilated-asym": (
        "Conv",
        [2, 4, 10, 18],
        [6, 2, 3, 2],
        {"group": 2, "dilations": [2, 3], "pads": [2, 0, 1, 3]},
    ),
    "2d-depthwise": ("Conv", [2, 4, 7, 6], [4, 1, 3, 3], {"group": 4, "pads": [1, 1, 1, 1]}),
    "2d-flat-unpadded": ("Conv", [3, 5, 6, 7], [2, 5, 2, 3], {}),
    "2d-pad-beyond-reach": ("Conv", [2, 3, 6, 6], [4, 3, 3, 3], {"pads": [3, 1, 0, 2]}),  # dX falls back
    "2d-strided": ("Conv", [2, 3, 9, 9], [4, 3, 3, 3], {"strides": [2, 1], "pads": [1, 1, 1, 1]}),
    "1d-dilated": ("Conv", [2, 3, 20], [4, 3, 3], {"dilations": [2], "pads": [1, 3]}),
    "3d-split": ("Conv", [2, 2, 3, 4, 16], [4, 2, 2, 3, 3], {"pads": [1, 0, 1, 0, 1, 1]}),
    "convT-stride1-dilated": (
        "ConvTranspose",
        [2, 4, 6, 17],
        [4, 3, 3, 3],
        {"dilations": [2, 2], "pads": [1, 1, 1, 1]},
    ),
    "convT-strided-output-padding": (
        "ConvTranspose",
        [2, 4, 5, 6],
        [4, 3, 3, 3],
        {"strides": [2, 2], "pads": [1, 1, 1, 1], "output_padding": [1, 0]},
    ),
    "convT-grouped": ("ConvTranspose", [2, 4, 5, 16], [4, 2, 3, 3], {"group": 2, "pads": [1, 0, 1, 2]}),
}


@pytest.mark.parametrize("weight_grad_op", [False, True], ids=["graph-rule", "ConvWeightGrad"])
@pytest.mark.parametrize("case", list(_CONV_CASES))
@pytest.mark.parametrize("flip_min", [0, None], ids=["flipped-dX", "default"])
def test_conv_rules_match_torch_autograd(
    case: str, weight_grad_op: bool, flip_min: int | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The Conv / ConvTranspose rules' dX, dW, dB for one node against torch.autograd: the stride-1 paths (dX as a
    Conv of the flipped weight, forced with flip_min 0 on these small maps, or by default a ConvTranspose below
    FLIP_MIN_PIXELS; the flattened-patches weight gradient with and without the split) and fallbacks; and dW as
    one bnfuse.ConvWeightGrad node and a Conv's dX as one bnfuse.ConvInputGrad node (oneDNN)."""
    import onnxruntime

    from bnfuse.runtime import conv_grad, conv_input_grad, session_options

    if weight_grad_op and not conv_grad.available():
        pytest.skip("oneDNN (onednn-cpu-gomp) is not installed")
    op, x_shape, w_shape, attrs = _CONV_CASES[case]
    if flip_min is not None:
        monkeypatch.setattr(fast_rules, "FLIP_MIN_PIXELS", flip_min)
    model = _conv_model(op, x_shape, w_shape, attrs)
    grads = autodiff.reverse(model, ["x", "w", "b"], "y", weight_grad_op=weight_grad_op)
    uses_op = [n for n in grads.graph.node if n.op_type == conv_grad.OP]
    assert len(uses_op) == int(weight_grad_op)
    input_grads = [n for n in grads.graph.node if n.op_type == conv_input_grad.OP]
    assert len(input_grads) == int(weight_grad_op and op == "Conv"), case  # with oneDNN: every Conv's dX
    if input_grads:
        assert not [n for n in grads.graph.node if n.op_type in ("Slice", "ConvTranspose")]  # no weight flips
    elif op == "Conv" and set(attrs.get("strides", [1])) == {1} and case != "2d-pad-beyond-reach":
        flips = [n for n in grads.graph.node if n.op_type == "Slice" and n.output[0].startswith("flipped_")]
        flipped = flip_min == 0 or int(np.prod(x_shape[2:])) >= fast_rules.FLIP_MIN_PIXELS
        assert len(flips) == int(flipped), case  # by default: 2d-split, 2d-grouped-dilated, 3d-split flipped
    if weight_grad_op:
        grads.opset_import.append(onnx.helper.make_opsetid(conv_grad.DOMAIN, 1))
    rng = np.random.default_rng(len(case))
    y_shape = [d.dim_value for d in model.graph.output[0].type.tensor_type.shape.dim]
    feeds = {
        i.name: rng.standard_normal([d.dim_value for d in i.type.tensor_type.shape.dim]).astype(np.float32)
        for i in model.graph.input
    }
    seed = rng.standard_normal(y_shape).astype(np.float32)
    options = session_options() if weight_grad_op else None
    session = onnxruntime.InferenceSession(grads.SerializeToString(), options, providers=["CPUExecutionProvider"])
    got = dict(
        zip(
            [o.name for o in session.get_outputs()], session.run(None, {**feeds, "adj.y": seed[..., None]}), strict=True
        )
    )

    tensors = {k: torch.tensor(v, requires_grad=True) for k, v in feeds.items()}
    spatial = len(x_shape) - 2
    pads = attrs.get("pads", [0] * 2 * spatial)
    padded = torch.nn.functional.pad(
        tensors["x"], [p for i in reversed(range(spatial)) for p in (pads[i], pads[i + spatial])]
    )
    common = {"groups": attrs.get("group", 1), "stride": attrs.get("strides", 1), "dilation": attrs.get("dilations", 1)}
    if op == "Conv":
        fn = getattr(torch.nn.functional, f"conv{spatial}d")
        y = fn(padded, tensors["w"], tensors["b"], **common)
    else:
        fn = getattr(torch.nn.functional, f"conv_transpose{spatial}d")
        y = fn(
            tensors["x"], tensors["w"], tensors["b"], padding=0, output_padding=attrs.get("output_padding", 0), **common
        )
        crop = tuple(slice(None) for _ in range(2)) + tuple(
            slice(pads[i], y.shape[2 + i] - pads[i + spatial]) for i in range(spatial)
        )
        y = y[crop]
    assert list(y.shape) == y_shape
    (y * torch.tensor(seed)).sum().backward()
    for name in ("x", "w", "b"):
        np.testing.assert_allclose(
            got[f"adj.{name}"][..., 0], tensors[name].grad.numpy(), rtol=1e-4, atol=1e-4, err_msg=name
        )
