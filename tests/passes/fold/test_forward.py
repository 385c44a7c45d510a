"""Forward folds (BN into the linear layer after it), proven in onnxruntime (Concat splits and Transposes:
test_layout.py).

Graphs are built with onnx.helper; every rewrite is compared with the original on random inputs. The
negative cases (padding, a shared or returned BN output, a runtime weight) must keep the BN.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from bnfuse.passes.optimize import optimize
from tests.loaders import load_file

_fold_tests = load_file(Path(__file__).with_name("test_graph.py"), "bnfuse_test_fold_graph")
assert_clean, assert_equivalent, feed = _fold_tests.assert_clean, _fold_tests.assert_equivalent, _fold_tests.feed
bn_inits, bn_node, init = _fold_tests.bn_inits, _fold_tests.bn_node, _fold_tests.init
make_model, ops = _fold_tests.make_model, _fold_tests.ops

RNG = np.random.default_rng(21)


def weight(*shape: int) -> np.ndarray:
    return RNG.normal(0, 0.5, shape).astype(np.float32)


def folded(report) -> list[tuple[str, str | None, str | None]]:  # noqa: ANN001
    return [(r.status, r.direction, r.into) for r in report.batchnorms]


def bn_conv_model(
    rank: int, group: int, c_in: int, c_out: int, bias: bool, **conv_attrs: object
) -> tuple[onnx.ModelProto, dict[str, np.ndarray]]:
    inits = [*bn_inits("bn", c_in), init("w", weight(c_out, c_in // group, *([3] * rank)))]
    conv_inputs = ["n", "w"]
    if bias:
        inits.append(init("b", weight(c_out)))
        conv_inputs.append("b")
    nodes = [bn_node("x", "n"), helper.make_node("Conv", conv_inputs, ["y"], name="conv", group=group, **conv_attrs)]
    shape = [2, c_in, *([6] * rank)]
    return make_model(nodes, [("x", np.float32, shape)], [("y", np.float32)], inits), feed(shape)


# ----- Conv ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("rank", [1, 2, 3])
@pytest.mark.parametrize(("group", "c_in", "c_out"), [(1, 4, 6), (2, 4, 6), (4, 4, 4), (4, 4, 8)])
@pytest.mark.parametrize("bias", [False, True])
def test_bn_folds_forward_into_unpadded_conv_of_any_rank_and_group(
    rank: int, group: int, c_in: int, c_out: int, bias: bool
) -> None:
    model, feeds = bn_conv_model(rank, group, c_in, c_out, bias, strides=[2] * rank, dilations=[1] * rank)
    optimized, report = optimize(model, check=True)
    assert ops(optimized) == ["Conv"]
    assert folded(report) == [("folded", "forward", "conv")]
    assert report.forward_folds == 1 and "folded     bn forward into conv" in report.format_text(verbose=True)
    assert_clean(optimized)
    assert_equivalent(model, optimized, feeds)


def test_bn_folds_forward_into_auto_pad_valid_conv() -> None:
    model, feeds = bn_conv_model(2, 1, 4, 6, True, auto_pad="VALID")
    optimized, report = optimize(model)
    assert ops(optimized) == ["Conv"] and report.forward_folds == 1
    assert_equivalent(model, optimized, feeds)


@pytest.mark.parametrize("attrs", [{"pads": [1, 1, 1, 1]}, {"pads": [0, 0, 1, 0]}, {"auto_pad": "SAME_UPPER"}])
def test_bn_before_a_padded_conv_folds_with_a_border_bias_map(attrs: dict[str, object]) -> None:
    # the padded zeros are not normalized: a constant per-position map after the Conv restores the border
    # (bnfuse.passes.fold.moves; its cases: tests/passes/fold/test_moves.py)
    model, feeds = bn_conv_model(2, 1, 4, 6, True, **attrs)
    optimized, report = optimize(model, check=True)
    assert ops(optimized) == ["Conv", "Add"]
    assert report.batchnorms[0].direction == "forward" and "border bias map" in report.batchnorms[0].into
    assert_equivalent(model, optimized, feeds)


def test_bn_before_a_padded_conv_with_a_symbolic_spatial_shape_stays() -> None:
    model, feeds = bn_conv_model(2, 1, 4, 6, True, pads=[1, 1, 1, 1])
    model.graph.input[0].type.tensor_type.shape.dim[2].dim_param = "h"
    optimized, report = optimize(model)
    assert ops(optimized) == ["BatchNormalization", "Conv"]
    reason = report.batchnorms[0].reason
    assert "padded zeros are not normalized" in reason and "is not static: no border bias map" in reason
    assert_equivalent(model, optimized, feeds)


def test_pure_scaling_folds_forward_even_into_a_padded_conv() -> None:
    # mean = bias = 0: the map is a scaling, which commutes with zero padding.
    model, feeds = bn_conv_model(2, 2, 4, 6, False, pads=[1, 1, 1, 1])
    for tensor in model.graph.initializer:
        if tensor.name in ("bn_bias", "bn_mean"):
            tensor.CopyFrom(init(tensor.name, np.zeros(4, np.float32)))
    optimized, report = optimize(model)
    assert ops(optimized) == ["Conv"] and report.forward_folds == 1
    assert_equivalent(model, optimized, feeds)


@pytest.mark.parametrize("shared", ["second_reader", "graph_output"])
def test_shared_or_returned_bn_output_does_not_fold_forward(shared: str) -> None:
    model, feeds = bn_conv_model(2, 1, 4, 6, True)
    if shared == "second_reader":
        model.graph.node.append(helper.make_node("Relu", ["n"], ["r"], name="relu"))
        model.graph.output.append(helper.make_tensor_value_info("r", TensorProto.FLOAT, [2, 4, 6, 6]))
    else:
        model.graph.output.append(helper.make_tensor_value_info("n", TensorProto.FLOAT, [2, 4, 6, 6]))
    optimized, report = optimize(model)
    assert "BatchNormalization" in ops(optimized)
    assert "forward: 'n'" in report.batchnorms[0].reason
    assert_equivalent(model, optimized, feeds)


def test_conv_with_a_runtime_weight_does_not_absorb_forward() -> None:
    model, feeds = bn_conv_model(2, 1, 4, 6, False)
    model.graph.input.append(helper.make_tensor_value_info("w", TensorProto.FLOAT, [6, 4, 3, 3]))
    optimized, report = optimize(model)
    assert ops(optimized) == ["BatchNormalization", "Conv"]
    assert "weight is not constant" in report.batchnorms[0].reason


# ----- ConvTranspose ------------------------------------------------------------------------------


@pytest.mark.parametrize("group", [1, 2])
def test_bn_folds_forward_into_pointwise_conv_transpose(group: int) -> None:
    inits = [*bn_inits("bn", 4), init("w", weight(4, 6 // group, 1, 1)), init("b", weight(6))]
    nodes = [
        bn_node("x", "n"),
        helper.make_node("ConvTranspose", ["n", "w", "b"], ["y"], name="deconv", group=group, pads=[0, 1, 0, 0]),
    ]
    model = make_model(nodes, [("x", np.float32, [2, 4, 5, 5])], [("y", np.float32)], inits)
    optimized, report = optimize(model, check=True)
    assert ops(optimized) == ["ConvTranspose"] and folded(report) == [("folded", "forward", "deconv")]
    assert_equivalent(model, optimized, feed([2, 4, 5, 5]))


@pytest.mark.parametrize(("kernel", "attrs"), [(3, {}), (1, {"strides": [2, 2]}), (1, {"output_padding": [0, 0]})])
def test_bn_before_a_spreading_conv_transpose_stays(kernel: int, attrs: dict[str, object]) -> None:
    inits = [*bn_inits("bn", 4), init("w", weight(4, 6, kernel, kernel))]
    if "output_padding" in attrs:
        attrs = {"strides": [2, 2], "output_padding": [1, 1]}
    nodes = [bn_node("x", "n"), helper.make_node("ConvTranspose", ["n", "w"], ["y"], name="deconv", **attrs)]
    model = make_model(nodes, [("x", np.float32, [2, 4, 5, 5])], [("y", np.float32)], inits)
    optimized, report = optimize(model)
    assert ops(optimized) == ["BatchNormalization", "ConvTranspose"]
    assert "not exact" in report.batchnorms[0].reason


# ----- Gemm / MatMul through shape-only ops -------------------------------------------------------


def head_model(between: list[str], consumer: str, *, trans_b: int = 1, bn1d: bool = True) -> onnx.ModelProto:
    """ArcFace-style head: x (N, 8, 2, 3) -> BN2d -> ``between`` -> Gemm / MatMul(+Add) -> BN1d."""
    inits = [*bn_inits("bn2d", 8), *bn_inits("bn1d", 5, seed=3), init("fc_b", weight(5))]
    inits.append(init("fc_w", weight(5, 48) if consumer == "Gemm" and trans_b else weight(48, 5)))
    nodes, tensor = [bn_node("x", "t0", "bn2d", "bn2d")], "t0"
    for index, op in enumerate(between):
        out = f"t{index + 1}"
        if op == "Reshape":
            inits.append(init("shape", np.array([0, -1], np.int64)))
            nodes.append(helper.make_node("Reshape", [tensor, "shape"], [out], name="reshape"))
        elif op == "ReshapeStatic":
            inits.append(init("shape", np.array([-1, 48], np.int64)))
            nodes.append(helper.make_node("Reshape", [tensor, "shape"], [out], name="reshape"))
        elif op == "Dropout":
            nodes.append(helper.make_node("Dropout", [tensor], [out], name="dropout"))
        else:
            nodes.append(helper.make_node(op, [tensor], [out], name=op.lower()))
        tensor = out
    if consumer == "Gemm":
        nodes.append(helper.make_node("Gemm", [tensor, "fc_w", "fc_b"], ["fc"], name="fc", transB=trans_b, alpha=0.7))
    else:
        nodes.append(helper.make_node("MatMul", [tensor, "fc_w"], ["mm"], name="fc"))
        nodes.append(helper.make_node("Add", ["mm", "fc_b"], ["fc"], name="fc_bias"))
    output = "fc"
    if bn1d:
        nodes.append(bn_node("fc", "y", "bn1d", "bn1d"))
        output = "y"
    return make_model(nodes, [("x", np.float32, ["N", 8, 2, 3])], [(output, np.float32)], inits, 13)


@pytest.mark.parametrize(
    "between",
    [["Flatten"], ["Flatten", "Dropout"], ["Dropout", "Flatten", "Identity"], ["Reshape"], ["ReshapeStatic"]],
)
@pytest.mark.parametrize(("consumer", "trans_b"), [("Gemm", 0), ("Gemm", 1), ("MatMul", 0)])
def test_arcface_head_folds_bn2d_forward_and_bn1d_backward(between: list[str], consumer: str, trans_b: int) -> None:
    model = head_model(between, consumer, trans_b=trans_b)
    optimized, report = optimize(model, check=True, input_shapes={"x": [3, 8, 2, 3]})
    assert "BatchNormalization" not in ops(optimized)
    # BN1d folds backward into the Gemm, or into the MatMul's bias Add ("fc" is the MatMul in both)
    assert folded(report) == [("folded", "forward", "fc"), ("folded", "backward", "fc")]
    assert report.forward_folds == 1
    assert_clean(optimized)
    assert_equivalent(model, optimized, feed([3, 8, 2, 3]))


def test_matmul_without_bias_gets_one_after_a_forward_fold() -> None:
    inits = [*bn_inits("bn", 6), init("w", weight(6, 4))]
    nodes = [bn_node("x", "n"), helper.make_node("MatMul", ["n", "w"], ["y"], name="mm")]
    model = make_model(nodes, [("x", np.float32, [3, 6])], [("y", np.float32)], inits)
    optimized, report = optimize(model, check=True)
    assert ops(optimized) == ["MatMul", "Add"] and report.forward_folds == 1
    assert [o.name for o in optimized.graph.output] == ["y"]
    assert_equivalent(model, optimized, feed([3, 6]))


def test_bn_after_a_matmul_that_got_a_new_bias_folds_backward_into_it() -> None:
    inits = [*bn_inits("bn", 6), *bn_inits("bn1d", 4, seed=5), init("w", weight(6, 4))]
    nodes = [
        bn_node("x", "n"),
        helper.make_node("MatMul", ["n", "w"], ["m"], name="mm"),
        bn_node("m", "y", "bn1d", "bn1d"),
    ]
    model = make_model(nodes, [("x", np.float32, [3, 6])], [("y", np.float32)], inits)
    optimized, report = optimize(model, check=True)
    assert ops(optimized) == ["MatMul", "Add"]
    assert [r.direction for r in report.batchnorms] == ["forward", "backward"]
    assert_equivalent(model, optimized, feed([3, 6]))


def test_reshape_that_splits_the_batch_does_not_fold() -> None:
    model = head_model(["ReshapeStatic"], "Gemm", bn1d=False)
    for tensor in model.graph.initializer:
        if tensor.name == "shape":
            tensor.CopyFrom(init("shape", np.array([-1, 24], np.int64)))
        if tensor.name == "fc_w":
            tensor.CopyFrom(init("fc_w", weight(5, 24)))
    optimized, report = optimize(model)
    assert "BatchNormalization" in ops(optimized)
    assert "does not reshape to (batch, features)" in report.batchnorms[0].reason


def test_runtime_gemm_weight_blocks_the_fold() -> None:
    model = head_model(["Flatten", "Dropout"], "Gemm", bn1d=False)
    model.graph.input.append(helper.make_tensor_value_info("fc_w", TensorProto.FLOAT, [5, 48]))
    _, report = optimize(model)
    assert "B is not constant" in report.batchnorms[0].reason


def test_dropout_in_training_mode_blocks_the_fold() -> None:
    model = head_model(["Flatten", "Dropout"], "Gemm", bn1d=False)
    dropout = next(n for n in model.graph.node if n.op_type == "Dropout")
    dropout.input.extend(["ratio", "training"])
    model.graph.initializer.extend([init("ratio", np.array(0.0, np.float32)), init("training", np.array(True))])
    optimized, report = optimize(model)
    assert "BatchNormalization" in ops(optimized)
    assert "may run in training mode" in report.batchnorms[0].reason


# ----- which way: backward vs forward -------------------------------------------------------------


@pytest.mark.parametrize(
    ("first_bias", "second_bias", "direction"), [(False, True, "forward"), (True, True, "backward")]
)
def test_both_ways_possible_takes_the_one_adding_fewer_values(
    first_bias: bool, second_bias: bool, direction: str
) -> None:
    inits = [*bn_inits("bn", 4), init("w1", weight(4, 3, 1, 1)), init("w2", weight(6, 4, 1, 1))]
    inits += [init("b1", weight(4)), init("b2", weight(6))]
    nodes = [
        helper.make_node("Conv", ["x", "w1", "b1"] if first_bias else ["x", "w1"], ["c"], name="conv1"),
        bn_node("c", "n"),
        helper.make_node("Conv", ["n", "w2", "b2"] if second_bias else ["n", "w2"], ["y"], name="conv2"),
    ]
    model = make_model(nodes, [("x", np.float32, [2, 3, 4, 4])], [("y", np.float32)], inits)
    optimized, report = optimize(model, check=True)
    assert ops(optimized) == ["Conv", "Conv"]
    assert report.batchnorms[0].direction == direction
    assert len(optimized.graph.initializer) == (4 if first_bias else 3)  # no new bias either way
    assert_equivalent(model, optimized, feed([2, 3, 4, 4]))
