"""Backward folds (fold/backward.py): BatchNormalization and trailing per-channel Mul / Add / Sub / Div folded into
the Conv, ConvTranspose, Gemm or MatMul that produces their input, proven in onnxruntime.

Every test builds a small graph with onnx.helper (tests/passes/fold/test_graph.py's helpers), optimizes it, and compares
the original and optimized outputs on the same random inputs (onnxruntime; onnx's reference evaluator only for
dtypes or ops onnxruntime's CPU build lacks: bfloat16, float64 Conv).
"""

from __future__ import annotations

from pathlib import Path

import ml_dtypes
import numpy as np
import onnx
import pytest
from onnx import helper

from bnfuse.passes.optimize import optimize
from tests.loaders import load_file

_fold_tests = load_file(Path(__file__).with_name("test_graph.py"), "bnfuse_test_fold_graph")
assert_clean, assert_equivalent, feed = _fold_tests.assert_clean, _fold_tests.assert_equivalent, _fold_tests.feed
bn_inits, bn_node, init = _fold_tests.bn_inits, _fold_tests.bn_node, _fold_tests.init
make_model, ops, conv_bn_model = _fold_tests.make_model, _fold_tests.ops, _fold_tests.conv_bn_model
NEWEST, ELEM, RTOL = _fold_tests.NEWEST, _fold_tests.ELEM, _fold_tests.RTOL


# ----- Conv -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("rank", [1, 2, 3])
@pytest.mark.parametrize(("group", "c_in", "c_out"), [(1, 4, 6), (2, 4, 6), (4, 4, 4), (4, 4, 8)])
@pytest.mark.parametrize("bias", [False, True])
def test_conv_bn_folds_any_rank_and_group(rank: int, group: int, c_in: int, c_out: int, bias: bool) -> None:
    model, feeds = conv_bn_model(rank, group, bias, c_in=c_in, c_out=c_out)
    optimized, report = optimize(model)
    assert ops(optimized) == ["Conv"]
    assert [(r.status, r.into) for r in report.batchnorms] == [("folded", "conv")]
    assert [o.name for o in optimized.graph.output] == ["y"]
    assert_clean(optimized)
    assert_equivalent(model, optimized, feeds)


@pytest.mark.parametrize("opset", [7, 9, 13, 15, 26, NEWEST])
def test_conv_bn_folds_across_opsets(opset: int) -> None:
    model, feeds = conv_bn_model(2, 1, True, opset=opset)
    optimized, report = optimize(model)
    assert ops(optimized) == ["Conv"] and report.count("folded") == 1
    assert optimized.opset_import[0].version == opset
    # onnxruntime 1.31 refuses opsets newer than 26; onnx's reference evaluator runs the newest.
    assert_equivalent(model, optimized, feeds, reference=opset > 26)


@pytest.mark.parametrize("dtype", [np.float16, np.float64, ml_dtypes.bfloat16])
def test_conv_bn_folds_other_float_types(dtype: type) -> None:
    model, feeds = conv_bn_model(2, 2, True, dtype=dtype, opset=22)  # Conv takes bfloat16 from opset 22
    optimized, _ = optimize(model)
    assert ops(optimized) == ["Conv"]
    weight = next(t for t in optimized.graph.initializer if t.name == "w")
    assert weight.data_type == ELEM[np.dtype(dtype)]  # computed in float64, cast back
    # onnxruntime's CPU build has no bfloat16 / float64 Conv: onnx's reference evaluator runs those.
    assert_equivalent(model, optimized, feeds, rtol=RTOL[dtype], reference=dtype is not np.float16)


def test_float16_overflow_skips_the_fold_with_a_reason() -> None:
    c = 3
    inits = [
        init("w", np.full((c, 2, 1, 1), 60000, dtype=np.float16)),
        init("bn_scale", np.array([1, 100, 1], dtype=np.float16)),
        init("bn_bias", np.zeros(c, dtype=np.float16)),
        init("bn_mean", np.zeros(c, dtype=np.float16)),
        init("bn_var", np.full(c, 0.5, dtype=np.float16)),
    ]
    nodes = [helper.make_node("Conv", ["x", "w"], ["c"], name="conv"), bn_node("c", "y")]
    model = make_model(nodes, [("x", np.float16, [1, 2, 2, 2])], [("y", np.float16)], inits)
    optimized, report = optimize(model)
    assert ops(optimized) == ["Conv", "BatchNormalization"]
    (record,) = report.batchnorms
    assert record.status == "skipped" and "overflow float16" in record.reason


# ----- ConvTranspose --------------------------------------------------------------------------------


@pytest.mark.parametrize("rank", [1, 2])
@pytest.mark.parametrize(("group", "c_in", "per_group"), [(1, 4, 3), (2, 4, 3), (4, 4, 1), (4, 8, 2)])
@pytest.mark.parametrize("bias", [False, True])
def test_conv_transpose_bn_folds(rank: int, group: int, c_in: int, per_group: int, bias: bool) -> None:
    rng = np.random.default_rng(3)
    c_out = per_group * group
    inits = [init("w", rng.normal(0, 0.5, [c_in, per_group, *([3] * rank)]).astype(np.float32))]
    inits += bn_inits("bn", c_out)
    inputs = ["x", "w"]
    if bias:
        inits.append(init("b", rng.normal(0, 1, c_out).astype(np.float32)))
        inputs.append("b")
    nodes = [
        helper.make_node("ConvTranspose", inputs, ["c"], name="deconv", group=group, strides=[2] * rank),
        bn_node("c", "y"),
    ]
    shape = [1, c_in, *([4] * rank)]
    model = make_model(nodes, [("x", np.float32, shape)], [("y", np.float32)], inits)
    optimized, report = optimize(model)
    assert ops(optimized) == ["ConvTranspose"] and report.batchnorms[0].into == "deconv"
    assert_clean(optimized)
    assert_equivalent(model, optimized, feed(shape))


# ----- Gemm / MatMul --------------------------------------------------------------------------------


@pytest.mark.parametrize("trans_a", [0, 1])
@pytest.mark.parametrize("trans_b", [0, 1])
@pytest.mark.parametrize("c_shape", [None, (), (1,), (5,), (1, 5), (3, 5), (3, 1)])
@pytest.mark.parametrize(("alpha", "beta"), [(1.0, 1.0), (0.5, -2.0), (1.5, 0.0)])
def test_gemm_bn_folds(trans_a: int, trans_b: int, c_shape: tuple[int, ...] | None, alpha: float, beta: float) -> None:
    rng = np.random.default_rng(5)
    m, k, n = 3, 4, 5
    inits = [init("b", rng.normal(0, 1, (n, k) if trans_b else (k, n)).astype(np.float32)), *bn_inits("bn", n)]
    inputs = ["a", "b"]
    if c_shape is not None:
        inits.append(init("c", rng.normal(0, 1, c_shape).astype(np.float32)))
        inputs.append("c")
    gemm = helper.make_node("Gemm", inputs, ["g"], name="gemm", transA=trans_a, transB=trans_b, alpha=alpha, beta=beta)
    a_shape = [k, m] if trans_a else [m, k]
    model = make_model([gemm, bn_node("g", "y")], [("a", np.float32, a_shape)], [("y", np.float32)], inits)
    optimized, report = optimize(model)
    assert ops(optimized) == ["Gemm"] and report.count("folded") == 1
    assert_clean(optimized)
    assert_equivalent(model, optimized, feed(a_shape, name="a"))


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.float16])
def test_gemm_bn_folds_in_other_dtypes_at_opset_7(dtype: type) -> None:
    rng = np.random.default_rng(2)
    inits = [init("b", rng.normal(0, 1, (4, 6)).astype(dtype)), init("c", rng.normal(0, 1, 6).astype(dtype))]
    inits += bn_inits("bn", 6, dtype)
    nodes = [helper.make_node("Gemm", ["a", "b", "c"], ["g"], name="gemm"), bn_node("g", "y")]
    model = make_model(nodes, [("a", dtype, [2, 4])], [("y", dtype)], inits, opset=7)
    optimized, _ = optimize(model)
    assert ops(optimized) == ["Gemm"]
    assert_equivalent(model, optimized, feed([2, 4], dtype, name="a"), rtol=RTOL[dtype])


@pytest.mark.parametrize("bias_shape", [None, (6,), (1, 6)])
@pytest.mark.parametrize("bias_first", [False, True])
def test_matmul_bn_folds_with_optional_bias_add(bias_shape: tuple[int, ...] | None, bias_first: bool) -> None:
    rng = np.random.default_rng(4)
    inits = [init("w", rng.normal(0, 1, (4, 6)).astype(np.float32)), *bn_inits("bn", 6)]
    nodes = [helper.make_node("MatMul", ["x", "w"], ["m"], name="matmul")]
    last = "m"
    if bias_shape is not None:
        inits.append(init("bias", rng.normal(0, 1, bias_shape).astype(np.float32)))
        add_inputs = ["bias", "m"] if bias_first else ["m", "bias"]
        nodes.append(helper.make_node("Add", add_inputs, ["mb"], name="bias_add"))
        last = "mb"
    nodes.append(bn_node(last, "y"))
    model = make_model(nodes, [("x", np.float32, ["n", 4])], [("y", np.float32)], inits)
    optimized, report = optimize(model)
    assert ops(optimized) == ["MatMul", "Add"]
    assert report.batchnorms[0].into == "matmul"
    assert_clean(optimized)
    assert_equivalent(model, optimized, feed([3, 4]))


def test_matmul_on_3d_input_is_not_folded() -> None:
    """BN's channel axis 1 is not the MatMul's feature axis for a (N, L, K) input."""
    rng = np.random.default_rng(4)
    inits = [init("w", rng.normal(0, 1, (4, 5)).astype(np.float32)), *bn_inits("bn", 5)]
    nodes = [helper.make_node("MatMul", ["x", "w"], ["m"], name="matmul"), bn_node("m", "y")]
    model = make_model(nodes, [("x", np.float32, [2, 5, 4])], [("y", np.float32)], inits)
    optimized, report = optimize(model)
    assert "BatchNormalization" in ops(optimized)
    assert "not known to be 2-D" in report.batchnorms[0].reason
    assert_equivalent(model, optimized, feed([2, 5, 4]))


# ----- trailing per-channel ops ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("op", "constant_first"),
    [("Mul", False), ("Mul", True), ("Add", False), ("Add", True), ("Sub", False), ("Sub", True), ("Div", False)],
)
@pytest.mark.parametrize("after_bn", [False, True])
@pytest.mark.parametrize("shape", [(6, 1, 1), (1, 6, 1, 1), (1,), ()])
def test_trailing_per_channel_op_is_absorbed(op: str, constant_first: bool, after_bn: bool, shape: tuple) -> None:
    rng = np.random.default_rng(8)
    inits = [init("w", rng.normal(0, 1, (6, 3, 3, 3)).astype(np.float32))]
    inits.append(init("k", rng.uniform(0.5, 2.0, shape).astype(np.float32)))
    nodes = [helper.make_node("Conv", ["x", "w"], ["c"], name="conv")]
    last = "c"
    if after_bn:
        inits += bn_inits("bn", 6)
        nodes.append(bn_node("c", "b"))
        last = "b"
    nodes.append(helper.make_node(op, ["k", last] if constant_first else [last, "k"], ["y"], name="tail"))
    model = make_model(nodes, [("x", np.float32, [1, 3, 6, 6])], [("y", np.float32)], inits)
    optimized, report = optimize(model)
    assert ops(optimized) == ["Conv"]
    assert [(a.op, a.into) for a in report.absorbed] == [(op, "conv")]
    assert_clean(optimized)
    assert_equivalent(model, optimized, feed([1, 3, 6, 6]))


def test_constant_divided_by_tensor_and_non_per_channel_constants_stay() -> None:
    rng = np.random.default_rng(8)
    inits = [
        init("w", rng.normal(0, 1, (6, 3, 1, 1)).astype(np.float32)),
        init("k", rng.uniform(1, 2, (6, 1, 1)).astype(np.float32)),
        init("spatial", rng.uniform(1, 2, (1, 1, 4, 4)).astype(np.float32)),
    ]
    nodes = [
        helper.make_node("Conv", ["x", "w"], ["c"], name="conv"),
        helper.make_node("Div", ["k", "c"], ["d"], name="div"),
        helper.make_node("Conv", ["d", "w2"], ["c2"], name="conv2"),
        helper.make_node("Mul", ["c2", "spatial"], ["y"], name="mul"),
    ]
    inits.append(init("w2", rng.normal(0, 1, (6, 6, 1, 1)).astype(np.float32)))
    model = make_model(nodes, [("x", np.float32, [1, 3, 4, 4])], [("y", np.float32)], inits)
    optimized, report = optimize(model)
    assert ops(optimized) == ["Conv", "Div", "Conv", "Mul"] and report.absorbed == []


def test_chain_conv_bn_mul_add_from_unsqueezed_constants_folds_completely() -> None:
    """The inception_v2 pattern: BN -> Mul(Unsqueeze(w)) -> Add(Unsqueeze(b)), weights from ConstantOfShape."""
    rng = np.random.default_rng(9)
    nodes = [
        helper.make_node("ConstantOfShape", ["wshape"], ["w"], value=helper.make_tensor("v", 1, [1], [0.05])),
        helper.make_node("Conv", ["x", "w"], ["c"], name="conv"),
        bn_node("c", "b"),
        helper.make_node("Unsqueeze", ["sc_w"], ["sw"], axes=[1, 2]),
        helper.make_node("Mul", ["b", "sw"], ["m"], name="mul"),
        helper.make_node("Unsqueeze", ["sc_b"], ["sb"], axes=[1, 2]),
        helper.make_node("Add", ["m", "sb"], ["a"], name="add"),
        helper.make_node("Relu", ["a"], ["y"], name="relu"),
    ]
    inits = [
        init("wshape", np.array([6, 3, 3, 3], dtype=np.int64)),
        init("sc_w", rng.uniform(0.5, 2, 6).astype(np.float32)),
        init("sc_b", rng.normal(0, 1, 6).astype(np.float32)),
        *bn_inits("bn", 6),
    ]
    model = make_model(nodes, [("x", np.float32, [1, 3, 8, 8])], [("y", np.float32)], inits, opset=9)
    optimized, report = optimize(model)
    assert ops(optimized) == ["Conv", "Relu"]
    assert report.count("folded") == 1 and [a.op for a in report.absorbed] == ["Mul", "Add"]
    assert_clean(optimized)
    assert_equivalent(model, optimized, feed([1, 3, 8, 8]))


def concat_mul_add_model(read_twice: bool = False, scale_shape: tuple[int, ...] = (1, 8, 1, 1)) -> onnx.ModelProto:
    """Keras 3's BN after a Concat (NASNet's adjust blocks through tf2onnx): Conv, Conv -> Concat -> Mul -> Add."""
    rng = np.random.default_rng(12)
    inits = [
        init("w1", rng.normal(0, 0.5, (3, 4, 3, 3)).astype(np.float32)),
        init("b1", rng.normal(0, 0.5, 3).astype(np.float32)),
        init("w2", rng.normal(0, 0.5, (5, 4, 1, 1)).astype(np.float32)),
        init("scale", rng.uniform(0.5, 2.0, scale_shape).astype(np.float32)),
        init("shift", rng.normal(0, 1, (1, 8, 1, 1)).astype(np.float32)),
    ]
    nodes = [
        helper.make_node("Conv", ["x", "w1", "b1"], ["c1"], name="conv1", pads=[1, 1, 1, 1]),
        helper.make_node("Conv", ["x", "w2"], ["c2"], name="conv2"),
        helper.make_node("Concat", ["c1", "c2"], ["cat"], name="concat", axis=1),
        helper.make_node("Mul", ["cat", "scale"], ["m"], name="mul"),
        helper.make_node("Add", ["shift", "m"], ["a"], name="add"),
        helper.make_node("Relu", ["a"], ["y"], name="relu"),
    ]
    outputs = [("y", np.float32)]
    if read_twice:
        nodes.append(helper.make_node("Sigmoid", ["cat"], ["z"], name="other_reader"))
        outputs.append(("z", np.float32))
    return make_model(nodes, [("x", np.float32, [2, 4, 6, 6])], outputs, inits)


def test_trailing_mul_add_after_a_channel_concat_split_into_its_producers() -> None:
    model = concat_mul_add_model()
    optimized, report = optimize(model, check=True)
    assert ops(optimized) == ["Conv", "Conv", "Concat", "Relu"]
    assert [a.op for a in report.absorbed] == ["Mul", "Add"]
    assert all("concat inputs (conv1, conv2)" in a.into for a in report.absorbed), report.absorbed
    assert report.check is not None and report.check.passed
    assert_clean(optimized)
    assert_equivalent(model, optimized, feed([2, 4, 6, 6]))


@pytest.mark.parametrize(("read_twice", "scale_shape"), [(True, (1, 8, 1, 1)), (False, (1, 1, 6, 1))])
def test_trailing_op_after_a_concat_read_elsewhere_or_not_per_channel_stays(
    read_twice: bool, scale_shape: tuple[int, ...]
) -> None:
    model = concat_mul_add_model(read_twice, scale_shape)
    optimized, report = optimize(model, check=True)
    assert "Mul" in ops(optimized) and all(a.op != "Mul" for a in report.absorbed)
    assert_equivalent(model, optimized, feed([2, 4, 6, 6]))


@pytest.mark.parametrize("axis", [3, -1])
@pytest.mark.parametrize("second", ["t2", "nhwc"])
def test_trailing_mul_add_after_an_nhwc_concat_of_transposed_convs(axis: int, second: str) -> None:
    """tf2onnx with its optimizers off on Keras 3: Conv -> Transpose (NHWC) -> Concat(axis 3) -> Mul(c[C]) -> Add: the
    map's axis is where the Transposes put the channels. With an input that is no Transpose of a Conv, it stays."""
    rng = np.random.default_rng(13)
    inits = [
        init("w1", rng.normal(0, 0.5, (3, 4, 3, 3)).astype(np.float32)),
        init("w2", rng.normal(0, 0.5, (5, 4, 1, 1)).astype(np.float32)),
        init("scale", rng.uniform(0.5, 2.0, 8).astype(np.float32)),
        init("shift", rng.normal(0, 1, (1, 1, 1, 8)).astype(np.float32)),
    ]
    nodes = [
        helper.make_node("Conv", ["x", "w1"], ["c1"], name="conv1", pads=[1, 1, 1, 1]),
        helper.make_node("Transpose", ["c1"], ["t1"], name="nhwc1", perm=[0, 2, 3, 1]),
        helper.make_node("Conv", ["x", "w2"], ["c2"], name="conv2"),
        helper.make_node("Transpose", ["c2"], ["t2"], name="nhwc2", perm=[0, 2, 3, 1]),
        helper.make_node("Concat", ["t1", second], ["cat"], name="concat", axis=axis),
        helper.make_node("Mul", ["cat", "scale"], ["m"], name="mul"),
        helper.make_node("Add", ["m", "shift"], ["y"], name="add"),
    ]
    inputs = [("x", np.float32, [2, 4, 6, 6]), ("nhwc", np.float32, [2, 6, 6, 5])]
    model = make_model(nodes, inputs, [("y", np.float32)], inits)
    optimized, report = optimize(model, check=True)
    if second == "t2":
        assert sorted(ops(optimized)) == ["Concat", "Conv", "Conv", "Transpose", "Transpose"]
        assert [a.op for a in report.absorbed] == ["Mul", "Add"]
    else:
        assert "Mul" in ops(optimized) and "Add" in ops(optimized) and report.absorbed == []
    assert report.check is not None and report.check.passed
    assert_clean(optimized)
    assert_equivalent(model, optimized, {**feed([2, 4, 6, 6]), **feed([2, 6, 6, 5], name="nhwc", seed=1)})
