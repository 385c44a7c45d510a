"""Quantized graphs (bnfuse.passes.fold.qdq): a BN after a Conv / Gemm whose weight is dequantized per output
channel folds into the DequantizeLinear's scale, proven in onnxruntime; everything else stays with its reason."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import helper, numpy_helper

from bnfuse.passes.optimize import optimize
from tests.loaders import bench_module, load_file

_fold_tests = load_file(Path(__file__).with_name("test_graph.py"), "bnfuse_test_fold_graph")
assert_equivalent, feed = _fold_tests.assert_equivalent, _fold_tests.feed
bn_inits, bn_node, init = _fold_tests.bn_inits, _fold_tests.bn_node, _fold_tests.init
make_model, ops = _fold_tests.make_model, _fold_tests.ops

RNG = np.random.default_rng(36)
C_IN, C_OUT = 3, 4


def values(model: onnx.ModelProto, name: str) -> np.ndarray:
    return numpy_helper.to_array(next(t for t in model.graph.initializer if t.name == name))


def qdq_conv(bias: str, *, per_tensor: bool = False, op: str = "Conv") -> tuple[onnx.ModelProto, dict]:
    """x -> op(x, DequantizeLinear(int8 weight, per-channel scale)) [+ bias] -> BN -> y."""
    if op == "Conv":
        shape, axis = (C_OUT, C_IN, 3, 3), 0
    else:  # Gemm with transB: B is (N, K), output channels on axis 0
        shape, axis = (C_OUT, C_IN * 4), 0
    w_q = RNG.integers(-100, 100, shape).astype(np.int8)
    w_s = RNG.uniform(0.002, 0.01, 1 if per_tensor else C_OUT).astype(np.float32)
    w_z = np.zeros(1 if per_tensor else C_OUT, np.int8)
    if per_tensor:
        w_s, w_z = w_s.reshape(()), w_z.reshape(())
    inits = [*bn_inits("bn", C_OUT), init("w_q", w_q), init("w_s", w_s), init("w_z", w_z)]
    nodes = [helper.make_node("DequantizeLinear", ["w_q", "w_s", "w_z"], ["w"], name="dq_w", axis=axis)]
    inputs = ["x", "w"]
    if bias == "float":
        inits.append(init("b", RNG.normal(0, 0.1, C_OUT).astype(np.float32)))
        inputs.append("b")
    elif bias in ("int32", "int32_whole"):
        b_s = (0.05 * w_s).astype(np.float32)
        inits += [init("b_q", RNG.integers(-50, 50, C_OUT).astype(np.int32)), init("b_s", b_s)]
        nodes.append(helper.make_node("DequantizeLinear", ["b_q", "b_s"], ["b"], name="dq_b", axis=0))
        inputs.append("b")
        if bias == "int32_whole":  # BN with a = 2 exactly and a shift of 3 bias steps per channel
            inits[:4] = [
                init("bn_scale", np.full(C_OUT, 2.0, np.float32)),
                init("bn_bias", (3 * 2 * b_s).astype(np.float32)),
                init("bn_mean", np.zeros(C_OUT, np.float32)),
                init("bn_var", np.full(C_OUT, 1.0 - 1e-3, np.float32)),
            ]
    attrs = {"pads": [1, 1, 1, 1]} if op == "Conv" else {"transB": 1}
    nodes += [helper.make_node(op, inputs, ["c"], name="layer", **attrs), bn_node("c", "y")]
    shape_x = [2, C_IN, 6, 6] if op == "Conv" else [2, C_IN * 4]
    return make_model(nodes, [("x", np.float32, shape_x)], [("y", np.float32)], inits, 21), feed(shape_x)


@pytest.mark.parametrize("bias", ["none", "float", "int32_whole"])
@pytest.mark.parametrize("op", ["Conv", "Gemm"])
def test_bn_folds_into_the_per_channel_weight_scale(bias: str, op: str) -> None:
    model, feeds = qdq_conv(bias, op=op)
    optimized, report = optimize(model, check=True)
    assert "BatchNormalization" not in ops(optimized)
    assert report.batchnorms[0].into == "layer (weight through dq_w)"
    assert report.check.passed
    np.testing.assert_array_equal(values(optimized, "w_q"), values(model, "w_q"))  # the integers stay
    np.testing.assert_array_equal(values(optimized, "w_z"), values(model, "w_z"))
    assert not np.array_equal(values(optimized, "w_s"), values(model, "w_s"))
    if bias == "int32_whole":
        assert values(optimized, "b_q").dtype == np.int32
        np.testing.assert_array_equal(values(optimized, "b_q"), values(model, "b_q") + 3)
    assert_equivalent(model, optimized, feeds)


@pytest.mark.parametrize(
    ("case", "reason"),
    [
        ("int32", "not a whole number: the integer bias cannot hold it exactly"),
        ("per_tensor", "the weight scale is not per output channel"),
        ("negative", "a quantization scale must stay positive"),
    ],
)
def test_inexact_quantized_folds_stay_with_the_reason(case: str, reason: str) -> None:
    model, feeds = qdq_conv("int32" if case == "int32" else "float", per_tensor=case == "per_tensor")
    if case == "negative":
        index = next(i for i, t in enumerate(model.graph.initializer) if t.name == "bn_scale")
        model.graph.initializer[index].CopyFrom(init("bn_scale", np.array([1.0, -1.0, 1.0, 1.0], np.float32)))
    optimized, report = optimize(model)
    assert "BatchNormalization" in ops(optimized)
    assert (
        reason in report.batchnorms[0].reason
        and "quantized: layer (weight through dq_w)" in report.batchnorms[0].reason
    )
    assert_equivalent(model, optimized, feeds)


def test_bn_reading_a_dequantized_activation_stays_with_the_reason() -> None:
    model, feeds = qdq_conv("float")
    inits = [init("c_s", np.array(0.05, np.float32)), init("c_z", np.array(0, np.int8))]
    model.graph.initializer.extend(inits)
    bn = model.graph.node[-1]
    bn.input[0] = "c_dq"
    model.graph.node.insert(
        len(model.graph.node) - 1, helper.make_node("QuantizeLinear", ["c", "c_s", "c_z"], ["c_q"], name="q_c")
    )
    model.graph.node.insert(
        len(model.graph.node) - 1, helper.make_node("DequantizeLinear", ["c_q", "c_s", "c_z"], ["c_dq"], name="dq_c")
    )
    optimized, report = optimize(model)
    assert "BatchNormalization" in ops(optimized)
    assert "quantized: reads dq_c (DequantizeLinear): the producer's output is quantized before the BN" in (
        report.batchnorms[0].reason
    )
    assert_equivalent(model, optimized, feeds)


@pytest.mark.parametrize(
    ("variant", "left", "reason"),
    [
        ("qdq", 1, "(a quantized parameter: DequantizeLinear is not folded)"),
        ("qdq_int_bias", 1, "not a whole number: the integer bias cannot hold it exactly"),
        ("qdq_weights", 0, None),
    ],
)
def test_models_quantized_by_onnxruntime(variant: str, left: int, reason: str | None) -> None:
    """onnxruntime.quantization.quantize_static's QDQ model of Conv -> BN -> Relu -> Conv (bench/bn_left_peers.py),
    as written and with the BN's input left float: only a float bias lets the BN fold."""
    peers = bench_module("bn_left_peers", "bnfuse_bn_left_peers")
    model, x, _ = peers.qdq_model(variant)
    optimized, report = optimize(model, check=True)
    assert ops(optimized).count("BatchNormalization") == left
    assert report.check.passed
    if reason is not None:
        assert reason in report.batchnorms[0].reason
    assert_equivalent(model, optimized, {"x": x})
