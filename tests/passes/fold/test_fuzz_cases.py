"""Cases the differential fuzzer (bench/fuzz_folds.py) found, each reproduced at its smallest.

- `--check` refused a correct fold: a later per-channel op folded into the same producer changed the values
  of the tensor that carried the BN's output, and the proof compared that tensor;
- ONNX's float attributes are float32 (epsilon's default included): a float64 fold with epsilon = 1e-5
  exactly differed from onnxruntime's own evaluation;
- a float16 forward fold moved the BN's scale-down after the consumer's sum, which overflowed;
- a float16 backward fold into a layer whose bias its sum cancels rounds the large terms, not their small sum;
- an identity Transpose between a MatMul and its BN stopped the fold.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from bnfuse.attributes import float_attribute, onnx_float
from bnfuse.cli import main
from bnfuse.passes.optimize import optimize


def _model(nodes, inputs, outputs, inits, opset: int = 17) -> onnx.ModelProto:  # noqa: ANN001
    graph = helper.make_graph(nodes, "g", inputs, outputs, inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 8
    return model


def _run(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    return session.run(None, feeds)


def _bn(prefix: str, x: str, y: str, values: dict[str, np.ndarray], **attrs: object):  # noqa: ANN202
    inits = [numpy_helper.from_array(values[p], f"{prefix}.{p}") for p in ("scale", "bias", "mean", "var")]
    node = helper.make_node("BatchNormalization", [x, *(t.name for t in inits)], [y], name=prefix, **attrs)
    return node, inits


def gemm_transpose_div_model() -> onnx.ModelProto:
    """x[1,1] -> BN (C=1) -> Gemm(B [1,8], C [1,8]) -> Transpose(1,0) -> Div by a scalar -> y."""
    rng = np.random.default_rng(3)
    one = {k: np.array([v], np.float32) for k, v in (("scale", 1.7), ("bias", 0.3), ("mean", -0.4), ("var", 0.8))}
    bn, inits = _bn("bn", "x", "b", one)
    inits += [
        numpy_helper.from_array(rng.normal(0, 1, (1, 8)).astype(np.float32), "B"),
        numpy_helper.from_array(rng.normal(0, 1, (1, 8)).astype(np.float32), "C"),
        numpy_helper.from_array(np.array(2.5, np.float32), "d"),
    ]
    nodes = [
        bn,
        helper.make_node("Gemm", ["b", "B", "C"], ["g"], name="g"),
        helper.make_node("Transpose", ["g"], ["t"], perm=[1, 0]),
        helper.make_node("Div", ["t", "d"], ["y"]),
    ]
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 1])
    return _model(nodes, [x], [helper.make_tensor_value_info("y", TensorProto.FLOAT, [8, 1])], inits)


def test_check_passes_when_a_later_op_folds_into_the_same_producer(tmp_path: Path) -> None:
    model = gemm_transpose_div_model()
    source, target = tmp_path / "in.onnx", tmp_path / "out.onnx"
    onnx.save(model, source)
    assert main(["optimize", str(source), "-o", str(target), "--check"]) == 0
    optimized = onnx.load(target)
    assert [n.op_type for n in optimized.graph.node] == ["Gemm", "Transpose"]  # BN and Div both folded
    x = {"x": np.array([[0.7]], np.float32)}
    np.testing.assert_allclose(_run(optimized, x)[0], _run(model, x)[0], rtol=1e-6)
    # The BN's proof compares the first tensor that holds the same values in both models, not 'g', whose
    # values the Div changed: 'g' is renamed in the optimized model.
    _, report = optimize(model, check=True)
    (fold,) = report.check.folds
    assert fold.tensor == "y" and fold.outcome == "ok"
    assert "g" not in {o for n in optimized.graph.node for o in n.output}


def test_a_tensor_whose_meaning_changed_is_never_compared() -> None:
    """The defect itself: comparing 'g' (BN folded, then the Div folded in place) is a false alarm."""
    from bnfuse.passes.check.compare import compare_models

    model = gemm_transpose_div_model()
    optimized, report = optimize(model)
    (record,) = report.batchnorms
    assert record.replacement == "y"
    renamed = [o for n in optimized.graph.node for o in n.output if o.startswith("g")]
    assert renamed and renamed != ["g"]
    # Forcing the comparison of the old name shows what the old proof saw: a tensor 1/2.5 of the original.
    result = compare_models(model, optimized, folds=report.batchnorms)
    assert result.passed and result.folds[0].error.max_rel < 1e-6


def test_float_attributes_and_defaults_are_float32() -> None:
    assert onnx_float(1e-5) == float(np.float32(1e-5)) == 9.999999747378752e-06
    assert float_attribute({}, "epsilon", 1e-5) == float_attribute({"epsilon": 1e-5}, "epsilon", 0.0)
    assert float_attribute({}, "momentum", 0.9) == float(np.float32(0.9)) != 0.9


@pytest.mark.parametrize("epsilon", [None, 1e-5, 1e-3])
def test_float64_fold_equals_onnxruntime_within_1e_12(epsilon: float | None) -> None:
    """BN without an epsilon attribute, variance 1e-9 -> MatMul: onnxruntime uses float32(1e-5)."""
    rng = np.random.default_rng(7)
    c = 6
    values = {
        "scale": rng.uniform(0.5, 1.5, c),
        "bias": rng.normal(0, 0.1, c),
        "mean": rng.normal(0, 0.1, c),
        "var": np.full(c, 1e-9),
    }
    attrs = {} if epsilon is None else {"epsilon": epsilon}
    bn, inits = _bn("bn", "x", "b", values, **attrs)
    inits.append(numpy_helper.from_array(rng.normal(0, 1, (c, 5)), "w"))
    nodes = [bn, helper.make_node("MatMul", ["b", "w"], ["y"])]
    x = helper.make_tensor_value_info("x", TensorProto.DOUBLE, [4, c])
    model = _model(nodes, [x], [helper.make_tensor_value_info("y", TensorProto.DOUBLE, [4, 5])], inits)
    optimized, report = optimize(model, check=True)
    assert report.count("folded") == 1 and report.check.passed
    feeds = {"x": rng.normal(0, 1e-4, (4, c))}
    want, got = _run(model, feeds)[0], _run(optimized, feeds)[0]
    assert np.max(np.abs(got - want)) <= 1e-12 * np.max(np.abs(want))


def float16_overflow_model(consumer: str = "Gemm") -> onnx.ModelProto:
    """x -> BN1 (factor 200, shift 40000: values near 40000) -> BN2 (scale-down by 200) -> Flatten -> Gemm or
    MatMul + Add, bias 30000.

    The original's consumer sums BN2's centred output (about +-1) and gives about 3e4. Folded forward, BN2's
    scale-down lands after the sum: sum(x * W / 200) ~ 66000 (past float16's 65504), then + (30000 - 200 sum W).
    """
    rng = np.random.default_rng(5)
    c, side, n = 4, 4, 3
    half = np.float16
    bn1, inits1 = _bn(
        "bn1",
        "x",
        "h",
        {
            "scale": np.full(c, 200, half),
            "bias": np.full(c, 40000, half),
            "mean": np.zeros(c, half),
            "var": np.ones(c, half),
        },  # fmt: skip
    )
    bn2, inits2 = _bn(
        "bn2",
        "h",
        "b",
        {
            "scale": np.ones(c, half),
            "bias": np.zeros(c, half),
            "mean": np.full(c, 40000, half),
            "var": np.full(c, 40000, half),
        },  # fmt: skip
    )
    features = c * side * side
    w = rng.uniform(5.1, 5.3, (features, n))
    inits = [*inits1, *inits2, numpy_helper.from_array(w.astype(half), "w")]
    inits.append(numpy_helper.from_array(np.full(n, 30000, half), "c"))
    if consumer == "Gemm":
        tail = [helper.make_node("Flatten", ["b"], ["f"]), helper.make_node("Gemm", ["f", "w", "c"], ["y"])]
    else:
        tail = [
            helper.make_node("Flatten", ["b"], ["f"]),
            helper.make_node("MatMul", ["f", "w"], ["p"]),
            helper.make_node("Add", ["p", "c"], ["y"]),
        ]
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT16, [1, c, side, side])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT16, [1, n])
    return _model([bn1, bn2, *tail], [x], [y], inits)


@pytest.mark.parametrize("consumer", ["Gemm", "MatMul"])
def test_float16_forward_fold_that_would_overflow_is_refused_with_a_reason(consumer: str) -> None:
    model = float16_overflow_model(consumer)
    feeds = {"x": np.random.default_rng(1).standard_normal((1, 4, 4, 4)).astype(np.float16)}
    (want,) = _run(model, feeds)
    assert np.isfinite(want).all()
    optimized, report = optimize(model)
    second = report.batchnorms[1]
    assert second.status == "skipped" and "float16" in second.reason and "magnitude" in second.reason
    (got,) = _run(optimized, feeds)
    assert np.isfinite(got).all()
    np.testing.assert_array_equal(got, want)


def test_matmul_identity_transpose_bn_folds() -> None:
    rng = np.random.default_rng(11)
    c = 5
    bn, inits = _bn(
        "bn",
        "t",
        "y",
        {"scale": rng.uniform(0.5, 1.5, c).astype(np.float32), "bias": rng.normal(0, 1, c).astype(np.float32),
         "mean": rng.normal(0, 1, c).astype(np.float32), "var": rng.uniform(0.5, 1.5, c).astype(np.float32)},
    )  # fmt: skip
    inits.append(numpy_helper.from_array(rng.normal(0, 1, (3, c)).astype(np.float32), "w"))
    nodes = [
        helper.make_node("MatMul", ["x", "w"], ["m"]),
        helper.make_node("Transpose", ["m"], ["t"], perm=[0, 1]),
        bn,
    ]
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])
    model = _model(nodes, [x], [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, c])], inits)
    optimized, report = optimize(model, check=True)
    assert report.count("folded") == 1 and report.check.passed and report.noops_removed == 1
    assert [n.op_type for n in optimized.graph.node] == ["MatMul", "Add"]
    feeds = {"x": rng.normal(0, 1, (2, 3)).astype(np.float32)}
    np.testing.assert_allclose(_run(optimized, feeds)[0], _run(model, feeds)[0], rtol=1e-5, atol=1e-5)


def test_identity_and_inference_dropout_do_not_stop_a_backward_fold() -> None:
    rng = np.random.default_rng(12)
    c = 4
    bn, inits = _bn(
        "bn",
        "d",
        "y",
        {"scale": rng.uniform(0.5, 1.5, c).astype(np.float32), "bias": rng.normal(0, 1, c).astype(np.float32),
         "mean": rng.normal(0, 1, c).astype(np.float32), "var": rng.uniform(0.5, 1.5, c).astype(np.float32)},
    )  # fmt: skip
    inits.append(numpy_helper.from_array(rng.normal(0, 1, (c, 3, 3, 3)).astype(np.float32), "w"))
    nodes = [
        helper.make_node("Conv", ["x", "w"], ["c"]),
        helper.make_node("Identity", ["c"], ["i"]),
        helper.make_node("Dropout", ["i"], ["d"]),
        bn,
    ]
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 6, 6])
    model = _model(nodes, [x], [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, c, 4, 4])], inits)
    optimized, report = optimize(model, check=True)
    assert report.count("folded") == 1 and report.check.passed and report.noops_removed == 2
    assert [n.op_type for n in optimized.graph.node] == ["Conv"]


def ill_conditioned_model() -> onnx.ModelProto:
    """x[512, 64] -> MatMul -> BN -> Div(1, BN): values of the BN's output near zero turn the folded weights'
    one rounding (6e-8) into a relative error far above the check's float32 tolerance of 1e-4."""
    rng = np.random.default_rng(17)
    c = 16
    bn, inits = _bn(
        "bn",
        "m",
        "b",
        {"scale": rng.uniform(0.5, 1.5, c).astype(np.float32), "bias": rng.normal(0, 0.3, c).astype(np.float32),
         "mean": rng.normal(0, 0.3, c).astype(np.float32), "var": rng.uniform(0.5, 1.5, c).astype(np.float32)},
    )  # fmt: skip
    inits += [
        numpy_helper.from_array(rng.normal(0, 0.3, (64, c)).astype(np.float32), "w"),
        numpy_helper.from_array(np.array(1.0, np.float32), "one"),
    ]
    nodes = [helper.make_node("MatMul", ["x", "w"], ["m"]), bn, helper.make_node("Div", ["one", "b"], ["y"])]
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [512, 64])
    return _model(nodes, [x], [helper.make_tensor_value_info("y", TensorProto.FLOAT, [512, c])], inits)


def test_check_allows_what_rerounding_the_rewritten_weights_moves_an_ill_conditioned_output() -> None:
    from bnfuse.passes.check.compare import compare_models

    model = ill_conditioned_model()
    optimized, report = optimize(model)
    plain = compare_models(model, optimized, folds=report.batchnorms)  # no rewritten weights: flat tolerance
    (out,) = plain.outputs
    assert out.max_rel > 1e-4 and not out.passed  # what the old check refused
    _, checked = optimize(model, check=True)
    (out,) = checked.check.outputs
    assert checked.check.passed and out.max_rel > 1e-4 and out.noise is not None and out.max_rel <= out.tolerance
    # A wrong fold (one channel 1% off) is still refused: re-rounding explains nothing like it.
    broken = onnx.ModelProto()
    broken.CopyFrom(optimized)
    weight = next(t for t in broken.graph.initializer if t.name == "w")
    values = numpy_helper.to_array(weight).copy()
    values[:, 3] *= 1.01
    weight.CopyFrom(numpy_helper.from_array(values, "w"))
    result = compare_models(model, broken, folds=report.batchnorms, written=report.written_weights)
    assert not result.passed


def test_float16_chained_folds_round_each_value_once() -> None:
    """Conv -> BN -> Mul -> Add in float16: the folded weight and bias are the exact composed map rounded once,
    not the BN's fold rounded, then the Mul's, then the Add's."""
    rng = np.random.default_rng(23)
    c, half = 6, np.float16
    stats = {
        "scale": rng.uniform(0.5, 3, c).astype(half), "bias": rng.normal(0, 50, c).astype(half),
        "mean": rng.normal(0, 50, c).astype(half), "var": rng.uniform(0.1, 3, c).astype(half),
    }  # fmt: skip
    bn, inits = _bn("bn", "c", "b", stats)
    w = rng.normal(0, 0.3, (c, 3, 3, 3)).astype(half)
    b = rng.normal(0, 1, c).astype(half)
    k = rng.uniform(0.3, 3, (c, 1, 1)).astype(half)
    a = rng.normal(0, 30, (c, 1, 1)).astype(half)
    inits += [numpy_helper.from_array(v, n) for v, n in ((w, "w"), (b, "cb"), (k, "k"), (a, "a"))]
    nodes = [
        helper.make_node("Conv", ["x", "w", "cb"], ["c"]),
        bn,
        helper.make_node("Mul", ["b", "k"], ["m"]),
        helper.make_node("Add", ["m", "a"], ["y"]),
    ]
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT16, [1, 3, 5, 5])
    model = _model(nodes, [x], [helper.make_tensor_value_info("y", TensorProto.FLOAT16, [1, c, 3, 3])], inits)
    optimized, report = optimize(model)
    assert [n.op_type for n in optimized.graph.node] == ["Conv"] and len(report.absorbed) == 2
    factor = stats["scale"].astype(np.float64) / np.sqrt(stats["var"].astype(np.float64) + float(np.float32(1e-5)))
    shift = stats["bias"].astype(np.float64) - stats["mean"].astype(np.float64) * factor
    scale = factor * k.reshape(-1).astype(np.float64)
    bias = (b.astype(np.float64) * factor + shift) * k.reshape(-1) + a.reshape(-1)
    folded = {t.name: numpy_helper.to_array(t) for t in optimized.graph.initializer}
    conv = optimized.graph.node[0]
    exact_weight = w.astype(np.float64) * scale[:, None, None, None]
    np.testing.assert_array_equal(folded[conv.input[1]], exact_weight.astype(half))
    np.testing.assert_array_equal(folded[conv.input[2]], bias.astype(half))


@pytest.mark.parametrize("opset", [9, 13, 15])
def test_float64_conv_check_in_the_reference_evaluator_uses_running_statistics(opset: int) -> None:
    """onnxruntime's CPU has no float64 Conv, so the check runs such a model in onnx's reference evaluator,
    whose BatchNormalization for opsets 9-13 mixes in the batch's statistics (momentum's default 0.9): the
    original came out 46% off and every correct fold failed."""
    rng = np.random.default_rng(0)
    c = 4
    values = {"scale": rng.uniform(0.5, 1.5, c), "bias": rng.normal(0, 1, c), "mean": rng.normal(3, 1, c),
              "var": rng.uniform(0.5, 1.5, c)}  # fmt: skip
    bn, inits = _bn("bn", "c", "y", values)
    inits.append(numpy_helper.from_array(rng.normal(0, 0.5, (c, 3, 3, 3)), "w"))
    nodes = [helper.make_node("Conv", ["x", "w"], ["c"]), bn]
    x = helper.make_tensor_value_info("x", TensorProto.DOUBLE, [1, 3, 6, 6])
    model = _model(nodes, [x], [helper.make_tensor_value_info("y", TensorProto.DOUBLE, [1, c, 4, 4])], inits, opset)
    _, report = optimize(model, check=True)
    (out,) = report.check.outputs
    assert report.check.passed and report.check.engine == "onnx reference evaluator" and out.max_rel < 1e-12


def bias_cancelling_model(elem_type: int) -> onnx.ModelProto:
    """x ~ 1 +- 0.01 -> Conv (3x3, every weight -7.4, bias +200: the sum cancels the bias, z ~ 0.5 +- 0.4) -> BN
    with the statistics of z -> Div(1, .) -> y."""
    dtype = helper.tensor_dtype_to_np_dtype(elem_type)
    c = 2
    stats = {"scale": np.ones(c), "bias": np.zeros(c), "mean": np.full(c, 0.5), "var": np.full(c, 0.16)}
    bn, inits = _bn("bn", "z", "n", {k: v.astype(dtype) for k, v in stats.items()})
    inits += [
        numpy_helper.from_array(np.full((c, 3, 3, 3), -200 / 27 * (1 - 0.5 / 200), dtype), "w"),
        numpy_helper.from_array(np.full(c, 200.0, dtype), "b"),
    ]
    nodes = [helper.make_node("Conv", ["x", "w", "b"], ["z"], name="conv"), bn]
    x = helper.make_tensor_value_info("x", elem_type, [1, 3, 6, 6])
    return _model(nodes, [x], [helper.make_tensor_value_info("n", elem_type, [1, c, 4, 4])], inits)


def test_float16_fold_whose_bias_cancels_the_sum_is_refused_with_a_reason() -> None:
    """Folded, the float16 Conv would round a * W (~ -18) and a * b (~500, ulp 0.25) where the original rounds
    z ~ 0.5: the BN's output would move by ~0.1 where the original's is within ~1e-3 (measured below)."""
    feeds = {"x": (1 + 0.01 * np.random.default_rng(5).standard_normal((1, 3, 6, 6))).astype(np.float16)}
    model = bias_cancelling_model(TensorProto.FLOAT16)
    optimized, report = optimize(model)
    (record,) = report.batchnorms
    assert record.status == "skipped" and "cancels its sum" in record.reason and "float16" in record.reason
    np.testing.assert_array_equal(_run(optimized, feeds)[0], _run(model, feeds)[0])
    # What the fold would have done: the fold of the original widened to float32 (which folds it), rounded to
    # float16, against that widened original.
    from bnfuse.passes.check.tolerances import widened

    wide, _ = optimize(widened(model))
    assert [n.op_type for n in wide.graph.node] == ["Conv"]
    exact = _run(widened(model), {"x": feeds["x"].astype(np.float32)})[0]
    rounded = onnx.ModelProto()
    rounded.CopyFrom(wide)
    for tensor in rounded.graph.initializer:
        tensor.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(tensor).astype(np.float16), tensor.name))
    for info in [*rounded.graph.input, *rounded.graph.output]:
        info.type.tensor_type.elem_type = TensorProto.FLOAT16
    folded16 = _run(rounded, feeds)[0].astype(np.float64)
    own = np.abs(_run(model, feeds)[0] - exact).max() / np.abs(exact).max()
    lost = np.abs(folded16 - exact).max() / np.abs(exact).max()
    assert own < 5e-3 and lost > 10 * own, (own, lost)
