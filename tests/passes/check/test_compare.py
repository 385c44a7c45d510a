"""The numerical proof: errors per output, tolerance verdicts, the proof per fold (input shapes: test_inputs.py;
engines: test_engines.py)."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from bnfuse.passes.check.compare import compare_models


def matmul_model(weight: np.ndarray, x_shape: list[int | str]) -> onnx.ModelProto:
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["y"])],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, x_shape)],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        [numpy_helper.from_array(weight.astype(np.float32), "w")],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])  # IR 14: check lowers it


def test_identical_models_pass_with_zero_error() -> None:
    model = matmul_model(np.eye(4), ["batch", 4])
    result = compare_models(model, model)
    assert result.passed
    (out,) = result.outputs
    assert out.name == "y" and out.max_abs == 0.0 and out.max_rel == 0.0 and out.tolerance == 1e-4
    assert result.input_shapes == {"x": [1, 4]}  # a batch-like dynamic dim defaults to 1


def test_a_changed_weight_is_caught_and_measured() -> None:
    weight = np.eye(4)
    changed = weight.copy()
    changed[0, 0] = 1.01
    result = compare_models(matmul_model(weight, [3, 4]), matmul_model(changed, [3, 4]), seed=5)
    (out,) = result.outputs
    x = np.random.default_rng(5).standard_normal([3, 4]).astype(np.float32)
    assert out.max_abs == pytest.approx(0.01 * np.abs(x[:, 0]).max(), rel=1e-4)
    assert out.max_rel == pytest.approx(out.max_abs / np.abs(x).max(), rel=1e-4)
    assert not out.passed and not result.passed


# ----- float16 / bfloat16 against a float32 reference --------------------------------------------------


def conv_bn(elem_type: int, *, channels: int = 8, opset: int = 22) -> onnx.ModelProto:
    """Conv -> BN -> Relu -> Conv -> BN in ``elem_type`` (Conv takes bfloat16 from opset 22)."""
    dtype = helper.tensor_dtype_to_np_dtype(elem_type)
    rng = np.random.default_rng(3)
    inits = []
    nodes = []
    source = "x"
    for layer, c_in in enumerate((3, channels)):
        inits += [
            numpy_helper.from_array(rng.normal(0, 0.3, (channels, c_in, 3, 3)).astype(dtype), f"w{layer}"),
            numpy_helper.from_array(rng.uniform(0.5, 2, channels).astype(dtype), f"s{layer}"),
            numpy_helper.from_array(rng.normal(0, 1, channels).astype(dtype), f"b{layer}"),
            numpy_helper.from_array(rng.normal(0, 1, channels).astype(dtype), f"m{layer}"),
            numpy_helper.from_array(rng.uniform(0.2, 3, channels).astype(dtype), f"v{layer}"),
        ]
        nodes += [
            helper.make_node("Conv", [source, f"w{layer}"], [f"c{layer}"], name=f"conv{layer}", pads=[1] * 4),
            helper.make_node(
                "BatchNormalization",
                [f"c{layer}", f"s{layer}", f"b{layer}", f"m{layer}", f"v{layer}"],
                [f"n{layer}"],
                name=f"bn{layer}",
            ),
        ]
        source = f"n{layer}"
        if layer == 0:
            nodes.append(helper.make_node("Relu", ["n0"], ["r0"], name="relu"))
            source = "r0"
    graph = helper.make_graph(
        nodes,
        "conv_bn",
        [helper.make_tensor_value_info("x", elem_type, ["batch", 3, 6, 6])],
        [helper.make_tensor_value_info("n1", elem_type, ["batch", channels, 6, 6])],
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 10
    onnx.checker.check_model(model, full_check=True)
    return model


def scaled_channel(model: onnx.ModelProto, weight: str, factor: float) -> onnx.ModelProto:
    """A copy whose ``weight`` has output channel 0 multiplied by ``factor``: what a wrong fold looks like."""
    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    tensor = next(t for t in copy.graph.initializer if t.name == weight)
    values = numpy_helper.to_array(tensor).copy()
    values[0] = values[0].astype(np.float32) * factor
    tensor.CopyFrom(numpy_helper.from_array(values, weight))
    return copy


def test_float16_is_judged_against_the_float32_original() -> None:
    from bnfuse.passes.optimize import optimize

    model = conv_bn(TensorProto.FLOAT16, opset=17)
    folded, _ = optimize(model)
    result = compare_models(model, folded)
    (out,) = result.outputs
    assert result.passed and result.engine == "onnxruntime"
    assert out.reference.startswith("float32 original") and out.noise is not None and out.noise > 0
    assert out.tolerance == pytest.approx(2 * out.noise + 2.0**-9)
    assert 0 < out.max_rel <= out.tolerance
    # A fold that got one channel 3% wrong is far outside float16's own noise on this model.
    wrong = compare_models(model, scaled_channel(folded, "w1", 1.03))
    assert not wrong.passed and wrong.outputs[0].max_rel > 2 * wrong.outputs[0].tolerance
    # A forced tolerance compares with the float16 original directly.
    (direct,) = compare_models(model, folded, tolerance=0.5).outputs
    assert direct.reference == "original" and direct.noise is None and direct.tolerance == 0.5


def test_float32_models_keep_onnxruntime_and_1e_4() -> None:
    from bnfuse.passes.optimize import optimize

    model = conv_bn(TensorProto.FLOAT, opset=17)
    folded, _ = optimize(model)
    result = compare_models(model, folded)
    assert result.engine == "onnxruntime" and result.outputs[0].tolerance == 1e-4 and result.passed
    assert not compare_models(model, scaled_channel(folded, "w1", 1.001)).passed


# ----- the proof per fold -------------------------------------------------------------------------------


def conv_bn_chain(*, offset: float = 0.0, channels: int = 4) -> onnx.ModelProto:
    """Three Conv -> BN -> Relu blocks; ``offset`` moves block 1's conv output and BN mean far from zero."""
    rng = np.random.default_rng(0)
    inits, nodes, source = [], [], "x"
    for i in range(3):
        shift = offset if i == 1 else 0.0
        c_in = 3 if i == 0 else channels
        inits += [
            numpy_helper.from_array(rng.normal(0, 0.5, (channels, c_in, 3, 3)).astype(np.float32), f"w{i}"),
            numpy_helper.from_array(np.full(channels, shift, np.float32), f"cb{i}"),
            numpy_helper.from_array(rng.uniform(0.5, 1.5, channels).astype(np.float32), f"s{i}"),
            numpy_helper.from_array(rng.normal(0, 0.1, channels).astype(np.float32), f"b{i}"),
            numpy_helper.from_array((shift + rng.normal(0, 0.1, channels)).astype(np.float32), f"m{i}"),
            numpy_helper.from_array(rng.uniform(0.5, 2, channels).astype(np.float32), f"v{i}"),
        ]
        nodes += [
            helper.make_node("Conv", [source, f"w{i}", f"cb{i}"], [f"c{i}"], name=f"conv{i}", pads=[1] * 4),
            helper.make_node(
                "BatchNormalization", [f"c{i}", f"s{i}", f"b{i}", f"m{i}", f"v{i}"], [f"y{i}"], name=f"bn{i}"
            ),
            helper.make_node("Relu", [f"y{i}"], [f"r{i}"], name=f"relu{i}"),
        ]
        source = f"r{i}"
    graph = helper.make_graph(
        nodes,
        "chain",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 8, 8])],
        [helper.make_tensor_value_info("r2", TensorProto.FLOAT, [1, channels, 8, 8])],
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model


def test_every_fold_is_compared_at_its_own_output() -> None:
    from bnfuse.passes.optimize import optimize

    model = conv_bn_chain()
    folded, report = optimize(model, check=True)
    assert report.check is not None and report.check.passed
    assert [(f.node, f.into, f.tensor, f.outcome) for f in report.check.folds] == [
        ("bn0", "conv0", "y0", "ok"),
        ("bn1", "conv1", "y1", "ok"),
        ("bn2", "conv2", "y2", "ok"),
    ]
    for fold in report.check.folds:
        assert fold.error is not None and not fold.error.constant
        # Folding changes float32 rounding: a zero error would mean nothing was really compared. In context a
        # tensor also carries the rounding of every fold upstream: 10x the output tolerance.
        assert 0 < fold.error.max_rel <= fold.error.tolerance == 1e-3
        # Alone (the chain from the producer's input, on random data): the output tolerance.
        assert fold.isolated is not None and fold.entry == {"bn0": "x", "bn1": "r0", "bn2": "r1"}[fold.node]
        assert 0 < fold.isolated.max_rel <= fold.isolated.tolerance == 1e-4
    # The optimized model itself keeps only its declared output: probes live in temporary copies.
    assert [o.name for o in folded.graph.output] == ["r2"]


def test_a_planted_wrong_fold_is_named_and_upstream_folds_pass() -> None:
    from bnfuse.errors import CheckFailedError
    from bnfuse.passes.optimize import optimize, prove

    model = conv_bn_chain()
    folded, report = optimize(model)
    wrong = scaled_channel(folded, "w1", 1.01)  # conv1 absorbed bn1 with channel 0 one percent off
    result = compare_models(model, wrong, folds=report.batchnorms)
    assert [f.outcome for f in result.folds] == ["ok", "failed", "failed"]
    assert result.first_failed_fold() is result.folds[1]
    assert result.folds[1].error is not None and result.folds[1].error.max_rel > 10 * 1e-4
    with pytest.raises(CheckFailedError, match="fold of BatchNormalization 'bn1' into 'conv1' fails: 'y1'") as info:
        prove(model, wrong, report, input_shapes=None, seed=0, tolerance=None)
    assert "(1 later fold(s) fail too)" in str(info.value)
    assert [f.outcome for f in info.value.report.check.folds] == ["ok", "failed", "failed"]


def test_a_tensor_equal_on_every_input_is_flagged_constant() -> None:
    """Softmax over logits from an all-equal weight: uniform on any input, as light_resnet50's output."""
    from bnfuse.passes.report import check_warnings

    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["logits"]), helper.make_node("Softmax", ["logits"], ["p"])],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4])],
        [helper.make_tensor_value_info("p", TensorProto.FLOAT, [1, 6])],
        [numpy_helper.from_array(np.full((4, 6), 0.02, np.float32), "w")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    result = compare_models(model, model)
    (out,) = result.outputs
    assert out.constant and out.passed and out.outcome == "constant"
    assert any("'p' is the same on every random input" in w for w in check_warnings(result))
    # An input-dependent output is not flagged.
    (varying,) = compare_models(matmul_model(np.eye(4), [1, 4]), matmul_model(np.eye(4), [1, 4])).outputs
    assert not varying.constant and varying.outcome == "ok"


def test_a_trailing_op_folded_after_the_bn_moves_its_comparison_downstream() -> None:
    """Conv -> BN -> Mul: the BN's output vanishes from the optimized model; the Mul's output stands for it."""
    from bnfuse.passes.optimize import optimize

    model = conv_bn_chain()
    graph = model.graph
    graph.initializer.append(
        numpy_helper.from_array(np.linspace(0.5, 2, 4).reshape(1, 4, 1, 1).astype(np.float32), "k")
    )
    relu = next(n for n in graph.node if n.name == "relu1")
    relu.input[0] = "y1k"
    graph.node.insert(list(graph.node).index(relu), helper.make_node("Mul", ["y1", "k"], ["y1k"], name="mul1"))
    folded, report = optimize(model, check=True)
    record = next(r for r in report.batchnorms if r.node == "bn1")
    assert (record.output, record.replacement) == ("y1", "y1k")
    assert "y1" not in {o for n in folded.graph.node for o in n.output}
    fold = next(f for f in report.check.folds if f.node == "bn1")
    assert fold.tensor == "y1k" and fold.outcome == "ok" and "'y1' was folded further" in fold.note
    # A wrong fold of the Mul shows at the BN's comparison.
    assert compare_models(model, scaled_channel(folded, "w1", 1.01), folds=report.batchnorms).folds[1].outcome == (
        "failed"
    )


def test_a_bn_inside_a_subgraph_is_not_compared_on_its_own_and_says_so() -> None:
    from bnfuse.passes.optimize import optimize
    from bnfuse.passes.report import check_warnings

    rng = np.random.default_rng(14)
    params = [
        numpy_helper.from_array(values.astype(np.float32), name)
        for name, values in [
            ("s", rng.uniform(0.5, 1.5, 3)),
            ("b", rng.normal(0, 0.1, 3)),
            ("m", rng.normal(0, 0.1, 3)),
            ("v", rng.uniform(0.5, 2, 3)),
            ("w", rng.normal(0, 1, (3, 3, 1, 1))),
        ]
    ]
    branch = helper.make_graph(
        [
            helper.make_node("Conv", ["x", "w"], ["tc"], name="then_conv"),
            helper.make_node("BatchNormalization", ["tc", "s", "b", "m", "v"], ["ty"], name="then_bn"),
        ],
        "then",
        [],
        [helper.make_tensor_value_info("ty", TensorProto.FLOAT, None)],
    )
    other = helper.make_graph(
        [helper.make_node("Relu", ["x"], ["er"])],
        "else",
        [],
        [helper.make_tensor_value_info("er", TensorProto.FLOAT, None)],
    )
    graph = helper.make_graph(
        [helper.make_node("If", ["cond"], ["y"], name="if", then_branch=branch, else_branch=other)],
        "g",
        [
            helper.make_tensor_value_info("cond", TensorProto.BOOL, []),
            helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 2, 2]),
        ],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 3, 2, 2])],
        params,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 10
    _, report = optimize(model, check=True)
    (fold,) = report.check.folds
    assert fold.node == "then_bn" and fold.outcome == "not compared" and fold.tensor is None
    assert "inside main/if.then_branch" in fold.note
    assert report.check.passed and any("only the outputs cover 'then_bn'" in w for w in check_warnings(report.check))


def test_float16_folds_are_judged_per_tensor_against_the_float32_original() -> None:
    from bnfuse.passes.optimize import optimize

    model = conv_bn(TensorProto.FLOAT16, opset=17)
    folded, report = optimize(model, check=True)
    assert report.check is not None and report.check.passed
    assert [(f.node, f.tensor) for f in report.check.folds] == [("bn0", "n0"), ("bn1", "n1")]
    for fold in report.check.folds:
        error = fold.error
        assert error is not None and error.reference.startswith("float32 original") and error.noise is not None
        assert error.tolerance == pytest.approx(2 * error.noise + 2.0**-9) and error.max_rel <= error.tolerance
        # Alone, one layer deep: 8 float16 ulps at the largest magnitude.
        assert fold.isolated is not None and fold.isolated.tolerance == 2.0**-7
        assert 0 < fold.isolated.max_rel <= fold.isolated.tolerance
    # Channel 0 of the first fold three percent off: that fold is the one named.
    wrong = compare_models(model, scaled_channel(folded, "w0", 1.03), folds=report.batchnorms)
    assert wrong.first_failed_fold() is wrong.folds[0]
    assert wrong.folds[0].isolated is not None and not wrong.folds[0].isolated.passed


def washed_out_conv_bn() -> onnx.ModelProto:
    """x * 0 -> Conv -> BN: the BN's output is the same on every input, as deep in onnx's light models."""
    model = conv_bn_chain()
    graph = model.graph
    graph.initializer.append(numpy_helper.from_array(np.zeros(1, np.float32), "zero"))
    conv = next(n for n in graph.node if n.name == "conv1")
    conv.input[0] = "z"
    graph.node.insert(list(graph.node).index(conv), helper.make_node("Mul", ["r0", "zero"], ["z"], name="wash"))
    return model


def test_a_fold_behind_an_input_independent_tensor_is_compared_on_random_data() -> None:
    from bnfuse.errors import CheckFailedError
    from bnfuse.passes.optimize import optimize, prove

    model = washed_out_conv_bn()
    folded, report = optimize(model, check=True)
    bn1 = report.check.folds[1]
    assert bn1.error is not None and bn1.error.constant  # in context: bias only, the weights are invisible
    assert bn1.entry == "z" and bn1.isolated is not None and not bn1.isolated.constant
    assert 0 < bn1.isolated.max_rel <= bn1.isolated.tolerance and bn1.outcome == "ok"
    assert [f.error.constant for f in report.check.folds] == [False, True, True]  # bn2 lies downstream
    assert all(f.isolated is not None and f.entry for f in report.check.folds)  # every fold is also isolated
    # Channel 0 of conv1's folded weight one percent off: invisible in context, named through the copy.
    result = compare_models(model, scaled_channel(folded, "w1", 1.01), folds=report.batchnorms)
    bn1 = result.folds[1]
    assert bn1.error is not None and bn1.error.passed and bn1.error.constant
    assert bn1.isolated is not None and not bn1.isolated.passed and bn1.outcome == "failed"
    assert result.first_failed_fold() is bn1 and not result.passed
    assert result.folds[2].outcome == "ok"  # bn2's own chain does not involve conv1
    with pytest.raises(CheckFailedError, match="'bn1' into 'conv1' fails: 'y1' on random data at 'z' differs"):
        prove(model, scaled_channel(folded, "w1", 1.01), report, input_shapes=None, seed=0, tolerance=None)


def test_a_bn_converted_to_mul_add_is_proven_like_a_fold() -> None:
    from bnfuse.passes.optimize import optimize

    model = conv_bn_chain()
    relu = next(n for n in model.graph.node if n.name == "relu0")
    bn1 = next(n for n in model.graph.node if n.name == "bn1")
    model.graph.node.remove(next(n for n in model.graph.node if n.name == "conv1"))
    bn1.input[0] = "r0"  # Relu -> BN: nothing to fold into
    assert relu.output[0] == "r0"
    # a negative scale: the BN's scale cannot move through relu1 into conv2 either (bnfuse.passes.fold.moves)
    scale = next(t for t in model.graph.initializer if t.name == "s1")
    scale.CopyFrom(numpy_helper.from_array(-numpy_helper.to_array(scale), "s1"))
    optimized, report = optimize(model, standalone="scale-shift", check=True)
    fold = next(f for f in report.check.folds if f.node == "bn1")
    assert fold.status == "converted" and fold.into is None and fold.tensor == "y1" and fold.entry == "r0"
    assert fold.outcome == "ok" and fold.isolated is not None and 0 < fold.isolated.max_rel <= 1e-4
    assert [n.op_type for n in optimized.graph.node].count("Mul") == 1


def test_values_the_precision_does_not_determine_are_left_out_of_the_float16_comparison() -> None:
    from bnfuse.passes.check.tolerances import References, determined, tensor_error

    base = np.array([1.0, -2.0, 3.0, -2843.0, 0.0])
    twins = [base + np.array([1e-3, 0, -1e-3, 47028.0, 0]), base + np.array([0, 2e-3, 0, 850.0, 0])]
    exact = base.copy()
    assert determined(base, twins, exact).tolist() == [True, True, True, False, True]
    # a value the optimized model gives near zero where the original's is large stays compared
    assert determined(np.array([1e-4]), [np.array([2e-4])], np.array([5.0])).tolist() == [True]
    want = (exact + 1e-4).astype(np.float16)
    references = References([exact], [base], [[t] for t in twins], "onnxruntime")
    flipped = exact.copy()
    flipped[3] = 20304.0  # the undetermined value's sign flipped: left out
    error = tensor_error("y", want, flipped.astype(np.float16), references, 0, None)
    assert error.passed and "1 of 5 values float16 cannot determine left out" in error.reference
    wrong = flipped.copy()
    wrong[2] *= 1.03  # a determined value 3% off still fails
    assert not tensor_error("y", want, wrong.astype(np.float16), references, 0, None).passed
