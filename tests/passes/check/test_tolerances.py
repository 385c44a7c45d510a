"""The float16 rule's overflow half (bnfuse.passes.check.tolerances): an inf the original has in its own precision
is matched by the optimized model's; any other fails. The rest of the rule: test_compare.py."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

import bnfuse
from bnfuse.passes.check.compare import compare_models
from bnfuse.passes.check.engines import Model, run_models
from bnfuse.passes.check.tolerances import References, own_precision, tensor_error, widened

F16 = TensorProto.FLOAT16


def _bn(name: str, source: str, output: str, scale: float, channels: int) -> tuple[onnx.NodeProto, list]:
    values = {"s": np.full(channels, scale), "b": np.zeros(channels), "m": np.zeros(channels), "v": np.ones(channels)}
    inits = [numpy_helper.from_array(v.astype(np.float16), f"{name}_{k}") for k, v in values.items()]
    node = helper.make_node("BatchNormalization", [source, *(t.name for t in inits)], [output], epsilon=0.0)
    return node, inits


def amplifier_model() -> onnx.ModelProto:
    """x -> BN(x 400) -> Relu -> BN(/ 400): float16 tensors past 65504 in the middle, back in range at the end."""
    up, up_inits = _bn("up", "x", "big", 400.0, 2)
    down, down_inits = _bn("down", "r", "y", 1 / 400, 2)
    graph = helper.make_graph(
        [up, helper.make_node("Relu", ["big"], ["r"]), down],
        "g",
        [helper.make_tensor_value_info("x", F16, [1, 2, 1, 1])],
        [helper.make_tensor_value_info("y", F16, [1, 2, 1, 1])],
        [*up_inits, *down_inits],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_own_precision_holds_every_float16_tensor_in_float16() -> None:
    model = amplifier_model()
    feeds = {"x": np.array([200.0, 1.0], np.float32).reshape(1, 2, 1, 1)}  # 80000 in the middle: past float16
    rounded = own_precision(model)
    assert rounded is not None
    casts = [n for n in rounded.graph.node if n.op_type == "Cast"]
    assert [c.attribute[0].i for c in casts] == [F16, TensorProto.FLOAT] * 3  # one round trip per tensor made
    names = ["big", "r", "y"]
    _, ((own,),) = run_models([(Model(rounded), "own", None, [(feeds, None)])], names)
    _, ((wide,),) = run_models([(Model(widened(model)), "wide", None, [(feeds, None)])], names)
    assert np.isinf(own[0]).ravel().tolist() == [True, False] and np.isinf(own[2]).ravel().tolist() == [True, False]
    assert np.all(np.isfinite(wide[2])) and np.allclose(wide[2].ravel(), [200.0, 1.0], rtol=1e-3)
    assert own[2].ravel()[1] == np.float16(wide[2].ravel()[1])  # 400 is exact: only the output's rounding differs


def test_an_overflow_the_original_has_in_its_own_precision_is_matched_and_no_other() -> None:
    exact = np.array([1.0, -2.0, 3.0, 5.0, 4.0])
    references = References([exact], [exact], [[exact]], "onnxruntime")
    want = exact.astype(np.float16)
    got = np.array([1.0, -2.0, 3.0, np.inf, np.nan], np.float16)

    def with_own(values: list[float] | None) -> References:
        own = None if values is None else [np.array(values)]
        return References(references.exact, references.folded, references.moved, "onnxruntime", lambda: own)

    matched = tensor_error("y", want, got, with_own([1.0, -2.0, 3.0, -np.inf, np.nan]), 0, None)
    assert matched.passed and "2 of 5 values inf / NaN in both" in matched.reference
    for own in ([1.0, -2.0, 3.0, np.inf, 4.0], [1.0, -2.0, 3.0, 5.0, 4.0], None):  # one not overflowing, none
        assert not tensor_error("y", want, got, with_own(own), 0, None).passed
    assert not tensor_error("y", want, got, references, 0, None).passed  # no reference in its own precision
    wrong = np.array([1.0, -2.0, 3.09, np.inf, np.nan], np.float16)  # a kept value 3% off still fails
    assert not tensor_error("y", want, wrong, with_own([1.0, -2.0, 3.0, np.inf, np.nan]), 0, None).passed


def concat_model() -> onnx.ModelProto:
    """Conv(x 2e4) -> two 1 x 1 Convs -> Concat -> BN(x 2) -> Relu -> Conv(/ 1e5): the BN folds backward into the
    two Convs, and its output, past 65504 for some inputs, then comes out of a Concat (onnxruntime's CPU has a
    float16 Concat, and runs the rest in float32)."""
    rng = np.random.default_rng(3)
    weights = {
        "w0": np.eye(2).reshape(2, 2, 1, 1) * 2e4,
        "wa": rng.normal(0, 1, (2, 2, 1, 1)),
        "wb": rng.normal(0, 1, (2, 2, 1, 1)),
        "wc": rng.normal(0, 1, (2, 4, 1, 1)) / 1e5,
    }
    inits = [numpy_helper.from_array(v.astype(np.float16), k) for k, v in weights.items()]
    bn, bn_inits = _bn("bn", "c", "n", 2.0, 4)
    nodes = [
        helper.make_node("Conv", ["x", "w0"], ["h"]),
        helper.make_node("Conv", ["h", "wa"], ["a"]),
        helper.make_node("Conv", ["h", "wb"], ["b"]),
        helper.make_node("Concat", ["a", "b"], ["c"], axis=1),
        bn,
        helper.make_node("Relu", ["n"], ["r"]),
        helper.make_node("Conv", ["r", "wc"], ["y"]),
    ]
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", F16, [1, 2, 4, 4])],
        [helper.make_tensor_value_info("y", F16, [1, 2, 4, 4])],
        [*inits, *bn_inits],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_check_passes_a_fold_whose_inf_the_original_has_and_fails_one_it_does_not() -> None:
    model = concat_model()
    optimized, report = bnfuse.optimize(model)
    assert report.count("folded") == 1 and "Concat" in [n.op_type for n in optimized.graph.node]
    result = compare_models(model, optimized, folds=report.batchnorms, written=report.written_weights)
    assert result.passed, result.outputs
    (out,) = result.outputs
    assert "in both: the original overflows float16 there in its own precision" in out.reference
    matched = int(out.reference.split("(")[1].split(" of ")[0])
    assert 0 < matched < 32  # some values overflow in the original as defined, some do not
    for name, factor in (("wa", 1.5), ("wc", 100.0)):  # a fold 50% off (more overflows), a later weight off
        broken = onnx.ModelProto()
        broken.CopyFrom(optimized)
        weight = next(t for t in broken.graph.initializer if t.name == name)
        weight.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(weight) * np.float16(factor), name))
        assert not compare_models(model, broken, folds=report.batchnorms, written=report.written_weights).passed
