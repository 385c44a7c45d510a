"""The moved folds (bnfuse.passes.fold.moves), proven in onnxruntime: BN after an N-D MatMul through Flatten /
Reshape, BN before a padded Conv with a border bias map, and a BN's scale moved through a Relu-like activation.

Graphs are built with onnx.helper; every rewrite runs with check=True and is compared with the original on random
inputs. The negative cases must keep the BN and say why.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import helper

from bnfuse.passes.optimize import optimize
from tests.loaders import load_file

_fold_tests = load_file(Path(__file__).with_name("test_graph.py"), "bnfuse_test_fold_graph")
assert_equivalent, feed = _fold_tests.assert_equivalent, _fold_tests.feed
bn_inits, bn_node, init = _fold_tests.bn_inits, _fold_tests.bn_node, _fold_tests.init
make_model, ops = _fold_tests.make_model, _fold_tests.ops

RNG = np.random.default_rng(35)


def weight(*shape: int) -> np.ndarray:
    return RNG.normal(0, 0.5, shape).astype(np.float32)


def record(report):  # noqa: ANN001, ANN201
    assert len(report.batchnorms) == 1
    return report.batchnorms[0]


# ----- MatMul [B, N, C] -> Flatten / Reshape -> BN (LeViT) ------------------------------------------


def token_model(*, bias: bool, shape_reader: bool, flatten: str = "Flatten") -> tuple[onnx.ModelProto, dict]:
    c_in, c = 8, 6
    inits = [*bn_inits("bn", c), init("w", weight(c_in, c)), init("back", np.array([2, 5, c], np.int64))]
    nodes = [helper.make_node("MatMul", ["x", "w"], ["m"], name="matmul")]
    product = "m"
    if bias:
        inits.append(init("b", weight(c)))
        nodes.append(helper.make_node("Add", ["m", "b"], ["mb"], name="bias_add"))
        product = "mb"
    if flatten == "Flatten":
        nodes.append(helper.make_node("Flatten", [product], ["f"], name="flatten", axis=2))
    else:
        inits.append(init("flat", np.array([-1, c], np.int64)))
        nodes.append(helper.make_node("Reshape", [product, "flat"], ["f"], name="flatten"))
    nodes += [bn_node("f", "n"), helper.make_node("Reshape", ["n", "back"], ["y"], name="unflatten")]
    outputs = [("y", np.float32)]
    if shape_reader:  # reshape_as(x): reads only the shape of the MatMul's output
        nodes.append(helper.make_node("Shape", [product], ["s"], name="shape"))
        nodes.append(helper.make_node("Cast", ["s"], ["sf"], name="cast", to=onnx.TensorProto.FLOAT))
        outputs.append(("sf", np.float32))
    return make_model(nodes, [("x", np.float32, [2, 5, c_in])], outputs, inits), feed([2, 5, c_in])


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("shape_reader", [False, True])
@pytest.mark.parametrize("flatten", ["Flatten", "Reshape"])
def test_bn_after_an_nd_matmul_folds_through_the_flatten(bias: bool, shape_reader: bool, flatten: str) -> None:
    model, feeds = token_model(bias=bias, shape_reader=shape_reader, flatten=flatten)
    optimized, report = optimize(model, check=True)
    assert "BatchNormalization" not in ops(optimized)
    assert ops(optimized).count("Add") == 1  # the bias: kept, or new for the BN's shift
    bn = record(report)
    assert (bn.status, bn.direction, bn.into) == ("folded", "backward", "matmul (through flatten)")
    assert report.check.passed
    assert_equivalent(model, optimized, feeds)


def test_bn_on_a_flatten_that_does_not_keep_channels_last_stays() -> None:
    # Flatten(axis=1) of [2, 5, 6] gives [2, 30]: its axis 1 is not the MatMul's columns
    model, feeds = token_model(bias=False, shape_reader=False)
    model.graph.node[1].attribute[0].i = 1
    for name, values in (("bn_scale", 1.5), ("bn_bias", 0.1), ("bn_mean", 0.2), ("bn_var", 1.0)):
        index = next(i for i, t in enumerate(model.graph.initializer) if t.name == name)
        model.graph.initializer[index].CopyFrom(init(name, np.full(30, values, np.float32)))
    model.graph.node[-1].input[1] = "back30"
    model.graph.initializer.append(init("back30", np.array([2, 5, 6], np.int64)))
    optimized, report = optimize(model)
    assert "BatchNormalization" in ops(optimized)
    assert "is not known to keep the 30 channels as its last axis" in record(report).reason
    assert_equivalent(model, optimized, feeds)


# ----- BN -> padded Conv ----------------------------------------------------------------------------


def bn_conv(c_in: int, c_out: int, group: int, size: list[int], **attrs: object) -> tuple[onnx.ModelProto, dict]:
    rank = len(size)
    inits = [*bn_inits("bn", c_in), init("w", weight(c_out, c_in // group, *([3] * rank))), init("b", weight(c_out))]
    nodes = [bn_node("x", "n"), helper.make_node("Conv", ["n", "w", "b"], ["y"], name="conv", group=group, **attrs)]
    shape = [2, c_in, *size]
    return make_model(nodes, [("x", np.float32, shape)], [("y", np.float32)], inits), feed(shape)


@pytest.mark.parametrize(
    ("size", "group", "attrs"),
    [
        ([7, 6], 1, {"pads": [1, 1, 1, 1]}),
        ([7, 6], 2, {"pads": [2, 0, 1, 2], "strides": [2, 1], "dilations": [1, 2]}),
        ([9], 4, {"pads": [1, 2], "strides": [2]}),
        ([4, 5, 3], 1, {"pads": [1, 1, 0, 0, 1, 1]}),
        ([7, 6], 1, {"auto_pad": "SAME_LOWER", "strides": [2, 2]}),
    ],
)
def test_bn_before_a_padded_conv_folds_exactly_with_a_border_map(size, group, attrs) -> None:  # noqa: ANN001
    model, feeds = bn_conv(4, 4, group, size, **attrs)
    optimized, report = optimize(model, check=True)
    assert ops(optimized) == ["Conv", "Add"]
    bn = record(report)
    assert bn.direction == "forward" and bn.into.startswith("conv (+ a ") and "border bias map" in bn.into
    assert report.check.passed
    assert_equivalent(model, optimized, feeds)


def test_border_map_costlier_than_the_bn_is_refused() -> None:
    model, feeds = bn_conv(2, 16, 1, [6, 6], pads=[1, 1, 1, 1])  # 16 x 36 map against 2 x 36 BN inputs
    optimized, report = optimize(model)
    assert ops(optimized) == ["BatchNormalization", "Conv"]
    assert "would cost more than the BN" in record(report).reason
    assert_equivalent(model, optimized, feeds)


def test_border_map_refused_where_a_bn_after_the_conv_folds_into_it() -> None:
    model, feeds = bn_conv(4, 4, 1, [6, 6], pads=[1, 1, 1, 1])
    model.graph.initializer.extend(bn_inits("bn2", 4, seed=2))
    model.graph.node[1].output[0] = "c"
    model.graph.node.append(bn_node("c", "y", prefix="bn2", name="bn2"))
    optimized, report = optimize(model, check=True)
    assert ops(optimized) == ["BatchNormalization", "Conv"]
    assert "a BN after it folds into it" in report.batchnorms[0].reason
    assert report.batchnorms[1].status == "folded"
    assert_equivalent(model, optimized, feeds)


# ----- BN -> Relu-like -> Conv / pools / Gemm -----------------------------------------------------


def preact(activation: str, tail: str, c: int = 4) -> tuple[onnx.ModelProto, dict]:
    inits = [*bn_inits("bn", c), init("w", weight(6, c, 3, 3))]
    act_inputs = ["n"]
    attrs: dict[str, object] = {}
    if activation == "PRelu":
        inits.append(init("slope", RNG.uniform(0.05, 0.3, (c, 1, 1)).astype(np.float32)))
        act_inputs.append("slope")
    elif activation == "LeakyRelu":
        attrs["alpha"] = 0.2
    nodes = [bn_node("x", "n"), helper.make_node(activation, act_inputs, ["a"], name="act", **attrs)]
    outputs = [("y", np.float32)]
    if tail == "conv":
        nodes.append(helper.make_node("Conv", ["a", "w"], ["y"], name="conv", pads=[1, 1, 1, 1]))
    elif tail == "two_convs":
        inits.append(init("w2", weight(3, c, 1, 1)))
        nodes.append(helper.make_node("Conv", ["a", "w"], ["y"], name="conv", pads=[1, 1, 1, 1]))
        nodes.append(helper.make_node("Conv", ["a", "w2"], ["y2"], name="conv2", strides=[2, 2]))
        outputs.append(("y2", np.float32))
    elif tail == "maxpool":
        nodes.append(helper.make_node("MaxPool", ["a"], ["p"], name="pool", kernel_shape=[3, 3], pads=[1, 1, 1, 1]))
        nodes.append(helper.make_node("Conv", ["p", "w"], ["y"], name="conv"))
    elif tail == "head":
        inits.append(init("fc", weight(5, c)))
        nodes += [
            helper.make_node("GlobalAveragePool", ["a"], ["g"], name="gap"),
            helper.make_node("Flatten", ["g"], ["f"], name="flatten"),
            helper.make_node("Gemm", ["f", "fc"], ["y"], name="fc", transB=1),
        ]
    elif tail == "sigmoid":
        nodes.append(helper.make_node("Sigmoid", ["a"], ["y"], name="sigmoid"))
    shape = [2, c, 6, 6]
    return make_model(nodes, [("x", np.float32, shape)], outputs, inits), feed(shape)


@pytest.mark.parametrize("activation", ["Relu", "LeakyRelu", "PRelu"])
@pytest.mark.parametrize("tail", ["conv", "two_convs", "maxpool", "head"])
def test_pre_activation_scale_moves_into_the_readers(activation: str, tail: str) -> None:
    model, feeds = preact(activation, tail)
    optimized, report = optimize(model, check=True)
    assert "BatchNormalization" not in ops(optimized)
    assert ops(optimized)[:2] == ["Add", activation]
    bn = record(report)
    assert (bn.status, bn.direction) == ("folded", "moved")
    assert "shift kept as an Add before it" in bn.into and "through act" in bn.into
    assert "moved      bn: scale into " in report.format_text(verbose=True)
    assert "1 folded (0 forward, 1 moved through an activation)" in report.format_text()
    data = report.to_dict()
    assert data["summary"]["folded_moved"] == 1 and data["batchnorms"][0]["direction"] == "moved"
    assert report.check.passed
    assert_equivalent(model, optimized, feeds)


def test_pre_activation_with_a_negative_scale_stays() -> None:
    model, feeds = preact("Relu", "conv")
    index = next(i for i, t in enumerate(model.graph.initializer) if t.name == "bn_scale")
    model.graph.initializer[index].CopyFrom(init("bn_scale", np.array([1.0, -0.5, 2.0, 1.0], np.float32)))
    optimized, report = optimize(model)
    assert ops(optimized)[0] == "BatchNormalization"
    assert "pre-activation: through act (Relu): channel 1 has scale -" in record(report).reason
    assert "only a positive scale commutes with the activation" in record(report).reason
    assert_equivalent(model, optimized, feeds)


def test_pre_activation_read_by_a_nonlinear_op_stays() -> None:
    model, feeds = preact("Relu", "sigmoid")
    optimized, report = optimize(model)
    assert ops(optimized)[0] == "BatchNormalization"
    assert "sigmoid (Sigmoid) reads it and cannot absorb the scale" in record(report).reason
    assert_equivalent(model, optimized, feeds)


# ----- Conv -> pool -> BN ---------------------------------------------------------------------------


def conv_pool_bn(pool: str, **attrs: object) -> tuple[onnx.ModelProto, dict]:
    inits = [*bn_inits("bn", 6), init("w", weight(6, 4, 3, 3))]
    out_shape = "p"
    nodes = [
        helper.make_node("Conv", ["x", "w"], ["c"], name="conv", pads=[1, 1, 1, 1]),
        helper.make_node(pool, ["c"], [out_shape], name="pool", **attrs),
        bn_node("p", "y"),
    ]
    shape = [2, 4, 7, 7]
    return make_model(nodes, [("x", np.float32, shape)], [("y", np.float32)], inits), feed(shape)


@pytest.mark.parametrize(
    ("pool", "attrs"),
    [
        ("MaxPool", {"kernel_shape": [3, 3], "pads": [1, 1, 1, 1], "strides": [2, 2]}),
        ("AveragePool", {"kernel_shape": [3, 3], "pads": [1, 1, 1, 1], "count_include_pad": 0}),
        ("AveragePool", {"kernel_shape": [2, 2], "strides": [2, 2], "ceil_mode": 1}),
        ("GlobalAveragePool", {}),
        ("GlobalMaxPool", {}),
    ],
)
def test_bn_after_a_pool_moves_before_it_and_folds_backward(pool: str, attrs: dict) -> None:
    model, feeds = conv_pool_bn(pool, **attrs)
    if pool.endswith("MaxPool"):  # a max commutes with a positive scale only
        index = next(i for i, t in enumerate(model.graph.initializer) if t.name == "bn_scale")
        model.graph.initializer[index].CopyFrom(init("bn_scale", np.abs(weight(6)) + 0.1))
    optimized, report = optimize(model, check=True)
    assert ops(optimized) == ["Conv", pool]
    assert record(report).into == "conv (moved before pool (" + pool + "))"
    assert report.check.passed
    assert_equivalent(model, optimized, feeds)


def test_bn_after_a_pool_counting_padded_zeros_stays() -> None:
    model, feeds = conv_pool_bn("AveragePool", kernel_shape=[3, 3], pads=[1, 1, 1, 1], count_include_pad=1)
    optimized, report = optimize(model)
    assert ops(optimized)[-1] == "BatchNormalization"
    assert "windows count padded zeros" in record(report).reason
    assert_equivalent(model, optimized, feeds)


def test_bn_with_a_negative_scale_after_a_max_pool_stays() -> None:
    model, feeds = conv_pool_bn("MaxPool", kernel_shape=[2, 2])
    index = next(i for i, t in enumerate(model.graph.initializer) if t.name == "bn_scale")
    model.graph.initializer[index].CopyFrom(init("bn_scale", -np.abs(weight(6)) - 0.1))
    optimized, report = optimize(model)
    assert ops(optimized)[-1] == "BatchNormalization"
    assert "a max commutes only with a positive scale" in record(report).reason
    assert_equivalent(model, optimized, feeds)


def test_pre_activation_in_float16_stays() -> None:
    # a move rounds the scaled weights and the shifted input once more each: more error than the BN it removes
    inits = [*bn_inits("bn", 4, np.float16), init("w", weight(6, 4, 3, 3).astype(np.float16))]
    nodes = [bn_node("x", "n"), helper.make_node("Relu", ["n"], ["a"]), helper.make_node("Conv", ["a", "w"], ["y"])]
    model = make_model(nodes, [("x", np.float16, [2, 4, 6, 6])], [("y", np.float16)], inits)
    optimized, report = optimize(model)
    assert ops(optimized)[0] == "BatchNormalization"
    assert "in float16 the move rounds the readers' scaled weights" in record(report).reason
