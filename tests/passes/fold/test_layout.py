"""Layout folds (fold/layout.py): Transpose pairs cancelled, a per-channel map folded through a Transpose, a BN after
a channel Concat split into each producer, proven in onnxruntime.

Graphs are built with onnx.helper (tests/passes/fold/test_graph.py's helpers); every rewrite is compared with the
original on random inputs.
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
assert_clean, assert_equivalent, feed = _fold_tests.assert_clean, _fold_tests.assert_equivalent, _fold_tests.feed
bn_inits, bn_node, init = _fold_tests.bn_inits, _fold_tests.bn_node, _fold_tests.init
make_model, ops = _fold_tests.make_model, _fold_tests.ops

RNG = np.random.default_rng(21)


def weight(*shape: int) -> np.ndarray:
    return RNG.normal(0, 0.5, shape).astype(np.float32)


def folded(report) -> list[tuple[str, str | None, str | None]]:  # noqa: ANN001
    return [(r.status, r.direction, r.into) for r in report.batchnorms]


# ----- Transpose and Concat -----------------------------------------------------------------------


def test_transpose_pairs_cancel_and_the_bn_folds() -> None:
    inits = [init("w", weight(6, 3, 3, 3)), *bn_inits("bn", 6)]
    nodes = [
        helper.make_node("Transpose", ["x"], ["nchw"], name="to_nchw", perm=[0, 3, 1, 2]),
        helper.make_node("Conv", ["nchw", "w"], ["c"], name="conv"),
        helper.make_node("Transpose", ["c"], ["nhwc"], name="to_nhwc", perm=[0, 2, 3, 1]),
        helper.make_node("Transpose", ["nhwc"], ["back"], name="to_nchw2", perm=[0, 3, 1, 2]),
        bn_node("back", "b"),
        helper.make_node("Transpose", ["b"], ["y"], name="out", perm=[0, 2, 3, 1]),
    ]
    model = make_model(nodes, [("x", np.float32, [2, 7, 7, 3])], [("y", np.float32)], inits)
    optimized, report = optimize(model, check=True)
    assert ops(optimized) == ["Transpose", "Conv", "Transpose"]
    assert report.transposes_cancelled == 1 and "1 Transpose pairs cancelled" in report.format_text()
    assert_clean(optimized)
    assert_equivalent(model, optimized, feed([2, 7, 7, 3]))


def test_transpose_pair_feeding_a_graph_output_stays() -> None:
    nodes = [
        helper.make_node("Transpose", ["x"], ["t"], name="t1", perm=[0, 2, 3, 1]),
        helper.make_node("Transpose", ["t"], ["y"], name="t2", perm=[0, 3, 1, 2]),
    ]
    model = make_model(nodes, [("x", np.float32, [1, 2, 3, 4])], [("y", np.float32)], [])
    optimized, report = optimize(model)
    assert ops(optimized) == ["Transpose", "Transpose"] and report.transposes_cancelled == 0


def nhwc_preactivation(activation: list[onnx.NodeProto], relu_readers: int = 1) -> onnx.ModelProto:
    """tf2onnx (optimizers off) on a Keras pre-activation block: NCHW BN -> Transpose -> activation (NHWC) ->
    Transpose -> Conv. ``activation`` reads "nhwc" and writes "act"; a second reader of "act" with relu_readers=2."""
    inits = [init("w", weight(5, 4, 3, 3)), init("lo", np.array(0.0, np.float32)), init("hi", np.array(6, np.float32))]
    inits.append(init("slope", np.array([0.1, 0.2, 0.3, 0.4], np.float32)))  # PRelu's, along the NHWC channels
    nodes = [
        helper.make_node("Transpose", ["x"], ["nchw"], name="in_nchw", perm=[0, 3, 1, 2]),
        bn_node("nchw", "b"),
        helper.make_node("Transpose", ["b"], ["nhwc"], name="bn_nhwc", perm=[0, 2, 3, 1]),
        *activation,
        helper.make_node("Transpose", ["act"], ["back"], name="conv_nchw", perm=[0, 3, 1, 2]),
        helper.make_node("Conv", ["back", "w"], ["c"], name="conv", pads=[1, 1, 1, 1]),
        helper.make_node("Transpose", ["c"], ["y"], name="out", perm=[0, 2, 3, 1]),
    ]
    outputs = [("y", np.float32)]
    if relu_readers == 2:
        nodes.append(helper.make_node("Sigmoid", ["act"], ["z"], name="other_reader"))
        outputs.append(("z", np.float32))
    return make_model(nodes, [("x", np.float32, [2, 6, 6, 4])], outputs, [*inits, *bn_inits("bn", 4)])


@pytest.mark.parametrize(
    ("activation", "moved"),
    [
        ([helper.make_node("Relu", ["nhwc"], ["act"], name="relu")], True),
        # Clip and a chain of two activations cancel the Transposes too, but the BN does not move through them
        ([helper.make_node("Clip", ["nhwc", "lo", "hi"], ["act"], name="relu6")], False),
        (
            [
                helper.make_node("LeakyRelu", ["nhwc"], ["leaky"], name="leaky", alpha=0.1),
                helper.make_node("Relu", ["leaky"], ["act"], name="relu"),
            ],
            False,
        ),
    ],
    ids=["relu", "clip", "leakyrelu-relu"],
)
def test_transpose_pair_around_elementwise_ops_cancels_and_the_preactivation_bn_moves(
    activation: list[onnx.NodeProto], moved: bool
) -> None:
    model = nhwc_preactivation(activation)
    optimized, report = optimize(model, check=True)
    assert report.transposes_cancelled == 1
    between = [a.op_type for a in activation]
    if moved:
        assert ops(optimized) == ["Transpose", "Add", *between, "Conv", "Transpose"]
        assert folded(report)[0][:2] == ("folded", "moved")
    else:
        assert ops(optimized) == ["Transpose", "BatchNormalization", *between, "Conv", "Transpose"]
        assert folded(report)[0][0] == "skipped"
    assert report.check is not None and report.check.passed
    assert_clean(optimized)
    assert_equivalent(model, optimized, feed([2, 6, 6, 4]))


def test_transpose_pair_around_an_activation_read_elsewhere_stays() -> None:
    model = nhwc_preactivation([helper.make_node("Relu", ["nhwc"], ["act"], name="relu")], relu_readers=2)
    optimized, report = optimize(model, check=True)
    assert report.transposes_cancelled == 0 and ops(optimized).count("Transpose") == 4
    assert report.batchnorms_after == 1
    assert_equivalent(model, optimized, feed([2, 6, 6, 4]))


def test_transpose_pair_around_prelu_stays() -> None:
    """PRelu's slope broadcasts against the last (NHWC channel) axis: it does not commute with the Transpose."""
    activation = [helper.make_node("PRelu", ["nhwc", "slope"], ["act"], name="prelu")]
    model = nhwc_preactivation(activation)
    optimized, report = optimize(model, check=True)
    assert report.transposes_cancelled == 0
    assert_equivalent(model, optimized, feed([2, 6, 6, 4]))


def nhwc_concat_bn(axis: int, joined: list[str]) -> onnx.ModelProto:
    """tf2onnx (optimizers off) on Keras's NASNet Concat -> BN: Conv -> Transpose (NHWC) -> Concat -> Transpose -> BN.
    ``joined``: the Concat's inputs among t1, t2 (the Convs' NHWC outputs) and nhwc (an NHWC graph input)."""
    inits = [init("w1", weight(3, 4, 3, 3)), init("w2", weight(5, 4, 1, 1)), *bn_inits("bn", 8)]
    nodes = [
        helper.make_node("Conv", ["x", "w1"], ["c1"], name="conv1", pads=[1, 1, 1, 1]),
        helper.make_node("Transpose", ["c1"], ["t1"], name="nhwc1", perm=[0, 2, 3, 1]),
        helper.make_node("Conv", ["x", "w2"], ["c2"], name="conv2"),
        helper.make_node("Transpose", ["c2"], ["t2"], name="nhwc2", perm=[0, 2, 3, 1]),
        helper.make_node("Concat", joined, ["cat"], name="concat", axis=axis),
        helper.make_node("Transpose", ["cat"], ["nchw"], name="to_nchw", perm=[0, 3, 1, 2]),
        bn_node("nchw", "y"),
    ]
    inputs = [("x", np.float32, [2, 4, 6, 6]), ("nhwc", np.float32, [2, 6, 6, 5])]
    return make_model(nodes, inputs, [("y", np.float32)], inits)


def concat_feeds() -> dict[str, np.ndarray]:
    return {**feed([2, 4, 6, 6]), **feed([2, 6, 6, 5], name="nhwc", seed=1)}


@pytest.mark.parametrize("axis", [3, -1])
def test_transposes_around_a_concat_cancel_and_the_bn_splits_into_the_convs(axis: int) -> None:
    model = nhwc_concat_bn(axis, ["t1", "t2"])
    optimized, report = optimize(model, check=True)
    assert report.transposes_cancelled == 1
    assert ops(optimized) == ["Conv", "Conv", "Concat"]
    assert [(r.status, r.direction) for r in report.batchnorms] == [("folded", "backward")]
    assert report.check is not None and report.check.passed
    assert_clean(optimized)
    assert_equivalent(model, optimized, concat_feeds())


def test_concat_with_an_input_that_is_no_transpose_keeps_its_transposes() -> None:
    model = nhwc_concat_bn(3, ["t1", "nhwc"])
    optimized, report = optimize(model, check=True)
    assert report.transposes_cancelled == 0 and report.batchnorms_after == 1
    assert ops(optimized).count("Transpose") == 2
    assert_equivalent(model, optimized, concat_feeds())


@pytest.mark.parametrize("producer", ["Conv", "Gemm"])
def test_per_channel_map_after_a_transpose_folds_through_it(producer: str) -> None:
    """Keras 3 / tf2onnx: Conv -> Transpose(0,2,3,1) -> Mul(c[C]) -> Add(c[C]); the map's last axis is channels."""
    if producer == "Conv":
        inits = [init("w", weight(6, 3, 3, 3)), init("s", weight(6)), init("t", weight(1, 1, 1, 6))]
        first = helper.make_node("Conv", ["x", "w"], ["c"], name="conv")
        perm, shape = [0, 2, 3, 1], [2, 3, 7, 7]
    else:
        inits = [init("w", weight(3, 6)), init("s", weight(6)), init("t", weight(6))]
        first = helper.make_node("Gemm", ["x", "w"], ["c"], name="conv")
        perm, shape = [1, 0], [4, 3]
    nodes = [
        first,
        helper.make_node("Transpose", ["c"], ["nhwc"], name="to_nhwc", perm=perm),
        helper.make_node("Mul", ["nhwc", "s"] if producer == "Conv" else ["nhwc", "s_col"], ["m"], name="mul"),
        helper.make_node("Add", ["m", "t"] if producer == "Conv" else ["m", "t_col"], ["y"], name="add"),
    ]
    if producer == "Gemm":  # after Transpose(1, 0) the channels are rows: constants shaped (C, 1)
        inits = [inits[0], init("s_col", weight(6, 1)), init("t_col", weight(6, 1))]
    model = make_model(nodes, [("x", np.float32, shape)], [("y", np.float32)], inits)
    optimized, report = optimize(model, check=True)
    assert ops(optimized) == [producer, "Transpose"]
    assert [(a.op, a.into) for a in report.absorbed] == [("Mul", "conv"), ("Add", "conv")]
    assert_equivalent(model, optimized, feed(shape))


def test_map_on_a_non_channel_axis_after_a_transpose_stays() -> None:
    inits = [init("w", weight(6, 3, 3, 3)), init("s", weight(5, 1, 1))]  # along H of (N, H, W, C)
    nodes = [
        helper.make_node("Conv", ["x", "w"], ["c"], name="conv"),
        helper.make_node("Transpose", ["c"], ["nhwc"], name="to_nhwc", perm=[0, 2, 3, 1]),
        helper.make_node("Mul", ["nhwc", "s"], ["y"], name="mul"),
    ]
    model = make_model(nodes, [("x", np.float32, [2, 3, 7, 3])], [("y", np.float32)], inits)
    optimized, report = optimize(model)
    assert ops(optimized) == ["Conv", "Transpose", "Mul"] and report.absorbed == []


def concat_model(shared: bool = False) -> onnx.ModelProto:
    inits = [init("w1", weight(4, 3, 3, 3)), init("w2", weight(2, 3, 1, 1)), init("b2", weight(2)), *bn_inits("bn", 6)]
    nodes = [
        helper.make_node("Conv", ["x", "w1"], ["a"], name="conv_a", pads=[1, 1, 1, 1]),
        helper.make_node("Conv", ["x", "w2", "b2"], ["b"], name="conv_b"),
        helper.make_node("Concat", ["a", "b"], ["cat"], name="concat", axis=1),
        bn_node("cat", "y"),
    ]
    outputs = [("y", np.float32)] + ([("b", np.float32)] if shared else [])
    return make_model(nodes, [("x", np.float32, [2, 3, 5, 5])], outputs, inits)


def test_bn_after_concat_is_split_into_each_producer() -> None:
    model = concat_model()
    optimized, report = optimize(model, check=True)
    assert ops(optimized) == ["Conv", "Conv", "Concat"]
    assert folded(report) == [("folded", "backward", "concat inputs (conv_a, conv_b)")]
    assert_clean(optimized)
    assert_equivalent(model, optimized, feed([2, 3, 5, 5]))


def test_bn_after_concat_with_a_shared_input_stays() -> None:
    optimized, report = optimize(concat_model(shared=True))
    assert "BatchNormalization" in ops(optimized)
    assert "graph output" in report.batchnorms[0].reason


def concat_part_model(part: str, *, covered: int = 4, other_reader: str | None = None) -> onnx.ModelProto:
    """x -> Conv a (4 ch), Conv b (2 ch), Conv c (3 ch) -> Concat -> [Split / Slice] -> BN on the first ``covered``
    channels, Relu on the rest; ``other_reader``: another node reading the Concat."""
    inits = [init("w1", weight(4, 3, 3, 3)), init("w2", weight(2, 3, 1, 1)), init("b2", weight(2)),
             init("w3", weight(3, 3, 1, 1)), *bn_inits("bn", covered)]  # fmt: skip
    nodes = [
        helper.make_node("Conv", ["x", "w1"], ["a"], name="conv_a", pads=[1, 1, 1, 1]),
        helper.make_node("Conv", ["x", "w2", "b2"], ["b"], name="conv_b"),
        helper.make_node("Conv", ["x", "w3"], ["c"], name="conv_c"),
        helper.make_node("Concat", ["a", "b", "c"], ["cat"], name="concat", axis=1),
    ]
    if part == "split":
        inits.append(init("sizes", np.array([covered, 9 - covered], np.int64)))
        nodes.append(helper.make_node("Split", ["cat", "sizes"], ["kept", "rest"], name="split", axis=1))
    else:  # Slice along the channels with axes given, the rest through a Slice with a negative start
        for name, values in (("s0", [0]), ("e0", [covered]), ("axis", [1]), ("s1", [covered - 9]), ("e1", [2**63 - 1])):
            inits.append(init(name, np.array(values, np.int64)))
        nodes += [helper.make_node("Slice", ["cat", "s0", "e0", "axis"], ["kept"], name="slice"),
                  helper.make_node("Slice", ["cat", "s1", "e1", "axis"], ["rest"], name="slice_rest")]  # fmt: skip
    nodes += [bn_node("kept", "n"), helper.make_node("Relu", ["rest"], ["r"], name="relu"),
              helper.make_node("Concat", ["n", "r"], ["y"], name="join", axis=1)]  # fmt: skip
    outputs = [("y", np.float32)]
    if other_reader == "sigmoid":
        nodes.append(helper.make_node("Sigmoid", ["cat"], ["z"], name="sigmoid"))
        outputs.append(("z", np.float32))
    elif other_reader == "overlap":  # channels 3:5 read again
        inits += [init("s2", np.array([3], np.int64)), init("e2", np.array([5], np.int64)), init("a2", np.array([1]))]
        nodes.append(helper.make_node("Slice", ["cat", "s2", "e2", "a2"], ["z"], name="slice_overlap"))
        outputs.append(("z", np.float32))
    return make_model(nodes, [("x", np.float32, [2, 3, 5, 5])], outputs, inits)


@pytest.mark.parametrize("part", ["split", "slice"])
@pytest.mark.parametrize("covered", [4, 6])
def test_bn_on_part_of_a_concat_folds_into_the_producers_of_its_channels(part: str, covered: int) -> None:
    model = concat_part_model(part, covered=covered)
    optimized, report = optimize(model, check=True)
    assert "BatchNormalization" not in ops(optimized) and report.check.passed
    producers = "conv_a" if covered == 4 else "conv_a, conv_b"
    assert folded(report) == [("folded", "backward", f"concat inputs ({producers}; channels 0:{covered} of 9, "
                                                     f"through {part})")]  # fmt: skip
    assert_clean(optimized)
    assert_equivalent(model, optimized, feed([2, 3, 5, 5]))


@pytest.mark.parametrize(
    ("covered", "other_reader", "reason"),
    [
        (5, None, "channels 0:5 cut a Concat input"),
        (4, "sigmoid", "reads all of concat"),
        (6, "overlap", "slice_overlap also reads channels 3:5"),
    ],
)
def test_bn_on_part_of_a_concat_stays_where_other_readers_see_its_channels(
    covered: int, other_reader: str | None, reason: str
) -> None:
    model = concat_part_model("slice", covered=covered, other_reader=other_reader)
    optimized, report = optimize(model)
    assert "BatchNormalization" in ops(optimized)
    assert reason in report.batchnorms[0].reason
    assert_equivalent(model, optimized, feed([2, 3, 5, 5]))
