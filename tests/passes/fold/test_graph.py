"""Folding inference BatchNormalization (and per-channel Mul/Add/Sub/Div) into producers, proven in onnxruntime:
the pass as a whole (constants, refusals, training-mode and legacy BN, subgraphs, functions, external data) and
the helpers the fold tests share; the folds by producer are in test_backward.py.

Every test builds a small graph with onnx.helper, optimizes it, and compares the original and optimized
outputs on the same random inputs (onnxruntime; onnx's reference evaluator only for dtypes or ops
onnxruntime's CPU build lacks: bfloat16, float64 Conv).
"""

from __future__ import annotations

from pathlib import Path

import ml_dtypes
import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper
from onnx.reference import ReferenceEvaluator

from bnfuse.errors import ModelError
from bnfuse.io import load_model, save_model
from bnfuse.passes.optimize import optimize

NEWEST = onnx.defs.onnx_opset_version()
ELEM = {
    np.dtype(np.float32): TensorProto.FLOAT,
    np.dtype(np.float16): TensorProto.FLOAT16,
    np.dtype(np.float64): TensorProto.DOUBLE,
    np.dtype(ml_dtypes.bfloat16): TensorProto.BFLOAT16,
}
RTOL = {np.float32: 1e-5, np.float16: 1e-2, np.float64: 1e-12, ml_dtypes.bfloat16: 3e-2}


# ----- helpers ------------------------------------------------------------------------------------


def init(name: str, values: np.ndarray) -> onnx.TensorProto:
    return numpy_helper.from_array(np.asarray(values), name)


def bn_inits(prefix: str, channels: int, dtype: type = np.float32, seed: int = 1) -> list[onnx.TensorProto]:
    rng = np.random.default_rng(seed)
    return [
        init(f"{prefix}_scale", rng.uniform(0.5, 2.0, channels).astype(dtype)),
        init(f"{prefix}_bias", rng.normal(0, 1, channels).astype(dtype)),
        init(f"{prefix}_mean", rng.normal(0, 1, channels).astype(dtype)),
        init(f"{prefix}_var", rng.uniform(0.1, 3.0, channels).astype(dtype)),
    ]


def bn_node(x: str, y: str, prefix: str = "bn", name: str = "bn", **attrs: object) -> onnx.NodeProto:
    inputs = [x, f"{prefix}_scale", f"{prefix}_bias", f"{prefix}_mean", f"{prefix}_var"]
    return helper.make_node("BatchNormalization", inputs, [y], name=name, epsilon=1e-3, **attrs)


def make_model(
    nodes: list[onnx.NodeProto],
    inputs: list[tuple[str, np.dtype, list[int | str | None]]],
    outputs: list[tuple[str, np.dtype]],
    initializers: list[onnx.TensorProto],
    opset: int = 17,
    **kwargs: object,
) -> onnx.ModelProto:
    graph = helper.make_graph(
        nodes,
        "test",
        [helper.make_tensor_value_info(n, ELEM[np.dtype(t)], s) for n, t, s in inputs],
        [helper.make_tensor_value_info(n, ELEM[np.dtype(t)], None) for n, t in outputs],
        initializers,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], **kwargs)
    model.ir_version = 13
    return with_output_shapes(model)


def with_output_shapes(model: onnx.ModelProto) -> onnx.ModelProto:
    """Give graph outputs their inferred types (the checker wants a shape) but no other value_info."""
    inferred = onnx.shape_inference.infer_shapes(model, strict_mode=True)
    for output, typed in zip(model.graph.output, inferred.graph.output, strict=True):
        output.CopyFrom(typed)
    onnx.checker.check_model(model, full_check=True)
    return model


def run(model: onnx.ModelProto, feeds: dict[str, np.ndarray], *, reference: bool = False) -> list[np.ndarray]:
    if reference:
        return [np.asarray(o) for o in ReferenceEvaluator(model).run(None, feeds)]
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    return session.run(None, feeds)


def assert_equivalent(
    original: onnx.ModelProto,
    optimized: onnx.ModelProto,
    feeds: dict[str, np.ndarray],
    *,
    rtol: float = 1e-5,
    reference: bool = False,
) -> None:
    want = run(original, feeds, reference=reference)
    got = run(optimized, feeds, reference=reference)
    assert len(want) == len(got)
    for w, g in zip(want, got, strict=True):
        w64, g64 = np.asarray(w, dtype=np.float64), np.asarray(g, dtype=np.float64)
        assert w64.shape == g64.shape
        scale = max(float(np.max(np.abs(w64))), 1e-30)
        assert float(np.max(np.abs(w64 - g64))) / scale <= rtol


def ops(model: onnx.ModelProto) -> list[str]:
    return [n.op_type for n in model.graph.node]


def assert_clean(model: onnx.ModelProto) -> None:
    """Full checker passes and no initializer is left unused."""
    onnx.checker.check_model(model, full_check=True)
    used = {name for node in model.graph.node for name in node.input}
    used |= {o.name for o in model.graph.output}
    assert [t.name for t in model.graph.initializer if t.name not in used] == []


def feed(shape: list[int], dtype: type = np.float32, name: str = "x", seed: int = 0) -> dict[str, np.ndarray]:
    return {name: np.random.default_rng(seed).standard_normal(shape).astype(dtype)}


def conv_bn_model(
    rank: int, group: int, bias: bool, dtype: type = np.float32, opset: int = 17, c_in: int = 4, c_out: int = 6
) -> tuple[onnx.ModelProto, dict[str, np.ndarray]]:
    rng = np.random.default_rng(7)
    kernel = [3] * rank
    weight = rng.normal(0, 0.5, [c_out, c_in // group, *kernel]).astype(dtype)
    inits = [init("w", weight), *bn_inits("bn", c_out, dtype)]
    conv_inputs = ["x", "w"]
    if bias:
        inits.append(init("b", rng.normal(0, 1, c_out).astype(dtype)))
        conv_inputs.append("b")
    nodes = [
        helper.make_node("Conv", conv_inputs, ["c"], name="conv", group=group, pads=[1] * (2 * rank)),
        bn_node("c", "y"),
    ]
    shape = [2, c_in, *([5] * rank)]
    return make_model(nodes, [("x", dtype, shape)], [("y", dtype)], inits, opset), feed(shape, dtype)


# ----- constants from Constant nodes / subgraphs ----------------------------------------------------


def test_weights_and_params_from_constant_nodes_and_cast() -> None:
    rng = np.random.default_rng(11)
    weight = rng.normal(0, 1, (4, 2, 3, 3)).astype(np.float64)
    nodes = [
        helper.make_node("Constant", [], ["w64"], value=init("wv", weight)),
        helper.make_node("Cast", ["w64"], ["w"], to=TensorProto.FLOAT),
        helper.make_node("Constant", [], ["bn_scale"], value_floats=[1.0, 2.0, 0.5, 1.5]),
        helper.make_node("Identity", ["mean0"], ["bn_mean"]),
        helper.make_node("Reshape", ["var2d", "flat"], ["bn_var"]),
        helper.make_node("Conv", ["x", "w"], ["c"], name="conv"),
        bn_node("c", "y"),
    ]
    inits = [
        init("bn_bias", rng.normal(0, 1, 4).astype(np.float32)),
        init("mean0", rng.normal(0, 1, 4).astype(np.float32)),
        init("var2d", rng.uniform(0.5, 1, (2, 2)).astype(np.float32)),
        init("flat", np.array([-1], dtype=np.int64)),
    ]
    model = make_model(nodes, [("x", np.float32, [1, 2, 5, 5])], [("y", np.float32)], inits, opset=13)
    optimized, report = optimize(model)
    assert ops(optimized) == ["Conv"] and report.count("folded") == 1
    assert_clean(optimized)
    assert_equivalent(model, optimized, feed([1, 2, 5, 5]))


# ----- refusals -------------------------------------------------------------------------------------


def test_shared_weight_initializer_is_cloned_not_edited() -> None:
    rng = np.random.default_rng(12)
    inits = [init("w", rng.normal(0, 1, (4, 4, 1, 1)).astype(np.float32)), *bn_inits("bn", 4)]
    nodes = [
        helper.make_node("Conv", ["x", "w"], ["c"], name="conv"),
        bn_node("c", "b"),
        helper.make_node("Conv", ["b", "w"], ["y"], name="conv_shared"),
    ]
    model = make_model(nodes, [("x", np.float32, [1, 4, 3, 3])], [("y", np.float32)], inits)
    optimized, report = optimize(model)
    assert ops(optimized) == ["Conv", "Conv"] and report.count("folded") == 1
    first, second = optimized.graph.node
    assert second.input[1] == "w" and first.input[1] != "w"
    original_w = numpy_helper.to_array(inits[0])
    kept = next(t for t in optimized.graph.initializer if t.name == "w")
    np.testing.assert_array_equal(numpy_helper.to_array(kept), original_w)
    assert_clean(optimized)
    assert_equivalent(model, optimized, feed([1, 4, 3, 3]))


@pytest.mark.parametrize("where", ["graph_output", "read_in_subgraph"])
def test_weight_seen_elsewhere_is_cloned_not_edited(where: str) -> None:
    """`w` and `b` are returned to the caller, or read inside an If branch: they must keep their values."""
    model, feeds = conv_bn_model(2, 1, True)
    weight = numpy_helper.to_array(next(t for t in model.graph.initializer if t.name == "w"))
    bias = numpy_helper.to_array(next(t for t in model.graph.initializer if t.name == "b"))
    returned = ["w", "b"]
    if where == "read_in_subgraph":
        branch = helper.make_graph(
            [helper.make_node("Identity", ["w"], ["bw"]), helper.make_node("Identity", ["b"], ["bb"])],
            "branch",
            [],
            [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in ("bw", "bb")],
        )
        model.graph.node.append(
            helper.make_node("If", ["cond"], ["wo", "bo"], name="if", then_branch=branch, else_branch=branch)
        )
        model.graph.input.append(helper.make_tensor_value_info("cond", TensorProto.BOOL, []))
        feeds["cond"] = np.array(True)
        returned = ["wo", "bo"]
    for name, value in zip(returned, (weight, bias), strict=True):
        model.graph.output.append(helper.make_tensor_value_info(name, TensorProto.FLOAT, list(value.shape)))
    onnx.checker.check_model(model, full_check=True)
    optimized, report = optimize(model)
    assert report.count("folded") == 1 and ops(optimized)[0] == "Conv"
    conv = optimized.graph.node[0]
    assert conv.input[1] != "w" and conv.input[2] != "b"  # folded into clones
    graphs = [optimized.graph, *(a.g for n in optimized.graph.node for a in n.attribute if a.type == a.GRAPH)]
    kept = {t.name: numpy_helper.to_array(t) for g in graphs for t in g.initializer}  # gs copies outer constants in
    np.testing.assert_array_equal(kept["w"], weight)
    np.testing.assert_array_equal(kept["b"], bias)
    onnx.checker.check_model(optimized, full_check=True)
    _, got_w, got_b = run(optimized, feeds)
    np.testing.assert_array_equal(got_w, weight)  # what onnxruntime returns is unchanged
    np.testing.assert_array_equal(got_b, bias)
    assert_equivalent(model, optimized, feeds)


def test_producer_with_another_consumer_is_not_folded() -> None:
    rng = np.random.default_rng(13)
    inits = [init("w", rng.normal(0, 1, (4, 4, 1, 1)).astype(np.float32)), *bn_inits("bn", 4)]
    nodes = [
        helper.make_node("Conv", ["x", "w"], ["c"], name="conv"),
        bn_node("c", "b"),
        helper.make_node("Add", ["b", "c"], ["y"], name="residual"),
    ]
    model = make_model(nodes, [("x", np.float32, [1, 4, 3, 3])], [("y", np.float32)], inits)
    optimized, report = optimize(model)
    assert "BatchNormalization" in ops(optimized)
    assert report.batchnorms[0].reason.startswith("producer output 'c' has 2 consumers")
    assert_equivalent(model, optimized, feed([1, 4, 3, 3]))


def test_producer_output_that_is_a_graph_output_is_not_folded() -> None:
    model, feeds = conv_bn_model(2, 1, False)
    model.graph.output.append(helper.make_tensor_value_info("c", TensorProto.FLOAT, [2, 6, 5, 5]))
    optimized, report = optimize(model)
    assert ops(optimized) == ["Conv", "BatchNormalization"]
    assert report.batchnorms[0].reason.startswith("producer output 'c' is a graph output")
    assert [o.name for o in optimized.graph.output] == ["y", "c"]
    assert_equivalent(model, optimized, feeds)


def training_mode_model(opset: int = 17) -> tuple[onnx.ModelProto, dict[str, np.ndarray]]:
    model, feeds = conv_bn_model(2, 1, True, opset=opset)
    bn = model.graph.node[1]
    if opset >= 14:
        bn.attribute.append(helper.make_attribute("training_mode", 1))
        bn.output.extend(["running_mean", "running_var"])  # onnx's shape inference requires them in training mode
    else:
        bn.output.extend(["rm", "rv", "saved_mean", "saved_var"])
    return model, feeds


@pytest.mark.parametrize("opset", [9, 17])
def test_training_mode_batchnorm_is_reset_to_inference_and_folded(opset: int) -> None:
    model, feeds = training_mode_model(opset)
    before = model.SerializeToString()
    optimized, report = optimize(model, check=True)
    assert ops(optimized) == ["Conv"]
    record = report.batchnorms[0]
    assert (record.status, record.reset_from_training) == ("folded", True)
    assert "(reset from training mode)" in report.format_text(verbose=True)
    assert report.check is not None and report.check.passed  # proven against the model in inference mode
    inference = onnx.ModelProto()
    inference.CopyFrom(model)
    del inference.graph.node[1].output[1:]
    del inference.graph.node[1].attribute[1:]  # epsilon stays, training_mode goes
    assert_equivalent(inference, optimized, feeds)
    assert model.SerializeToString() == before, "input modified"


def test_training_mode_batchnorm_is_reset_file_to_file(tmp_path: Path) -> None:
    from bnfuse.passes.optimize_file import optimize_file

    model, feeds = training_mode_model(17)
    source = tmp_path / "train_mode.onnx"
    save_model(model, source)
    before = source.read_bytes()
    report = optimize_file(source, tmp_path / "out.onnx", check=True)
    assert report.batchnorms[0].reset_from_training and report.check is not None and report.check.passed
    assert ops(load_model(tmp_path / "out.onnx")) == ["Conv"]
    assert source.read_bytes() == before


def test_training_mode_batchnorm_whose_statistics_are_read_stays() -> None:
    model, _ = training_mode_model(17)
    model.graph.output.append(helper.make_tensor_value_info("running_mean", TensorProto.FLOAT, [6]))
    optimized, report = optimize(model)
    assert ops(optimized) == ["Conv", "BatchNormalization"]
    assert report.batchnorms[0].reason.startswith("training mode (training_mode=1)")
    assert not report.batchnorms[0].reset_from_training


def spatial_0_model() -> tuple[onnx.ModelProto, dict[str, np.ndarray]]:
    """Opset 7 Conv -> BatchNormalization(spatial=0): statistics per activation, shaped (C, H, W)."""
    rng = np.random.default_rng(3)
    c, h, w = 6, 5, 5
    inits = [
        init("w", rng.normal(0, 0.5, (c, 4, 3, 3)).astype(np.float32)),
        init("bn_scale", rng.uniform(0.5, 2.0, (c, h, w)).astype(np.float32)),
        init("bn_bias", rng.normal(0, 1, (c, h, w)).astype(np.float32)),
        init("bn_mean", rng.normal(0, 1, (c, h, w)).astype(np.float32)),
        init("bn_var", rng.uniform(0.1, 3.0, (c, h, w)).astype(np.float32)),
    ]
    nodes = [
        helper.make_node("Conv", ["x", "w"], ["c"], name="conv", pads=[1, 1, 1, 1]),
        bn_node("c", "y", spatial=0),
    ]
    return make_model(nodes, [("x", np.float32, [2, 4, h, w])], [("y", np.float32)], inits, 7), feed([2, 4, h, w])


def test_legacy_spatial_0_is_not_folded() -> None:
    model, _ = spatial_0_model()
    optimized, report = optimize(model)
    assert ops(optimized) == ["Conv", "BatchNormalization"]
    assert report.batchnorms[0].status == "skipped" and "spatial=0" in report.batchnorms[0].reason


def test_legacy_spatial_0_becomes_per_activation_scale_shift() -> None:
    model, feeds = spatial_0_model()
    optimized, report = optimize(model, standalone="scale-shift")
    assert ops(optimized) == ["Conv", "Mul", "Add"]
    assert report.batchnorms[0].status == "converted" and "spatial=0" in report.batchnorms[0].reason
    shapes = {t.name: list(t.dims) for t in optimized.graph.initializer}
    assert [shapes[n.input[1]] for n in optimized.graph.node[1:]] == [[6, 5, 5], [6, 5, 5]]
    assert_clean(optimized)
    assert_equivalent(model, optimized, feeds)


def test_non_constant_params_are_not_folded() -> None:
    model, feeds = conv_bn_model(2, 1, True)
    scale = next(t for t in model.graph.initializer if t.name == "bn_scale")
    model.graph.initializer.remove(scale)
    model.graph.input.append(helper.make_tensor_value_info("bn_scale", TensorProto.FLOAT, [6]))
    optimized, report = optimize(model, standalone="scale-shift")
    assert ops(optimized) == ["Conv", "BatchNormalization"]
    assert report.batchnorms[0].reason.startswith("scale 'bn_scale' is not constant")
    feeds["bn_scale"] = np.linspace(0.5, 1.5, 6).astype(np.float32)
    assert_equivalent(model, optimized, feeds)


def test_overridable_initializer_params_are_not_folded_and_stay_inputs() -> None:
    """IR >= 4: an initializer also listed as a graph input is a default a caller may override."""
    model, feeds = conv_bn_model(2, 1, True)
    model.graph.input.append(helper.make_tensor_value_info("bn_mean", TensorProto.FLOAT, [6]))
    optimized, report = optimize(model)
    assert report.batchnorms[0].reason.startswith("mean 'bn_mean' is not constant")
    assert [i.name for i in optimized.graph.input] == ["x", "bn_mean"]
    assert "bn_mean" in {t.name for t in optimized.graph.initializer}
    feeds["bn_mean"] = np.full(6, 0.25, dtype=np.float32)
    assert_equivalent(model, optimized, feeds)


def test_ir3_initializers_stay_listed_as_inputs() -> None:
    model, feeds = conv_bn_model(2, 1, True, opset=7)
    model.ir_version = 3
    model.graph.input.extend(
        helper.make_tensor_value_info(t.name, t.data_type, list(t.dims)) for t in model.graph.initializer
    )
    optimized, report = optimize(model)
    assert report.count("folded") == 1 and optimized.ir_version == 3
    initializers = {t.name for t in optimized.graph.initializer}
    assert initializers <= {i.name for i in optimized.graph.input}
    assert_clean(optimized)
    assert_equivalent(model, optimized, feeds)


@pytest.mark.parametrize("bad", [-1.0, float("nan")])
def test_negative_or_nan_variance_is_a_model_error(bad: float) -> None:
    model, _ = conv_bn_model(2, 1, True)
    var = next(t for t in model.graph.initializer if t.name == "bn_var")
    values = numpy_helper.to_array(var).copy()
    values[2] = bad
    var.CopyFrom(init("bn_var", values))
    with pytest.raises(ModelError, match="variance has negative or NaN"):
        optimize(model)


# ----- subgraphs, functions, external data ----------------------------------------------------------


def test_batchnorm_inside_if_branch_is_folded_and_reported() -> None:
    rng = np.random.default_rng(14)
    then_graph = helper.make_graph(
        [helper.make_node("Conv", ["x", "w"], ["tc"], name="then_conv"), bn_node("tc", "ty", name="then_bn")],
        "then",
        [],
        [helper.make_tensor_value_info("ty", TensorProto.FLOAT, None)],
    )
    else_graph = helper.make_graph(
        [helper.make_node("Relu", ["x"], ["er"]), bn_node("er", "ey", prefix="bn", name="else_bn")],
        "else",
        [],
        [helper.make_tensor_value_info("ey", TensorProto.FLOAT, None)],
    )
    nodes = [helper.make_node("If", ["cond"], ["y"], name="if", then_branch=then_graph, else_branch=else_graph)]
    inits = [init("w", rng.normal(0, 1, (3, 3, 1, 1)).astype(np.float32)), *bn_inits("bn", 3)]
    graph = helper.make_graph(
        nodes,
        "g",
        [
            helper.make_tensor_value_info("cond", TensorProto.BOOL, []),
            helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 2, 2]),
        ],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 10
    model.graph.output[0].CopyFrom(helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 3, 2, 2]))
    optimized, report = optimize(model)
    by_node = {r.node: r for r in report.batchnorms}
    assert by_node["then_bn"].status == "folded" and by_node["then_bn"].graph == "main/if.then_branch"
    assert by_node["else_bn"].status == "skipped" and by_node["else_bn"].graph == "main/if.else_branch"
    assert report.batchnorms_before == 2 and report.batchnorms_after == 1
    onnx.checker.check_model(optimized, full_check=True)
    x = feed([1, 3, 2, 2])["x"]
    for cond in (True, False):
        feeds = {"cond": np.array(cond), "x": x}
        assert_equivalent(model, optimized, feeds)


def test_batchnorm_inside_a_local_function_is_reported() -> None:
    function = helper.make_function(
        "custom",
        "Norm",
        ["fx", "s", "b", "m", "v"],
        ["fy"],
        [helper.make_node("BatchNormalization", ["fx", "s", "b", "m", "v"], ["fy"], name="fn_bn")],
        [helper.make_opsetid("", 17)],
    )
    model, feeds = conv_bn_model(2, 1, True)
    model.graph.node[1].CopyFrom(
        helper.make_node("Norm", ["c", "bn_scale", "bn_bias", "bn_mean", "bn_var"], ["y"], domain="custom")
    )
    model.functions.append(function)
    model.opset_import.append(helper.make_opsetid("custom", 1))
    optimized, report = optimize(model)
    (record,) = report.batchnorms
    assert record.status == "skipped" and record.graph == "function custom:Norm"
    assert list(optimized.functions) == [function]
    assert_equivalent(model, optimized, feeds)


def test_external_data_model_round_trip(tmp_path: Path) -> None:
    model, feeds = conv_bn_model(2, 1, True, c_in=16, c_out=32)
    source = tmp_path / "in.onnx"
    onnx.save_model(model, str(source), save_as_external_data=True, location="in.onnx.data", size_threshold=64)
    assert (tmp_path / "in.onnx.data").exists()
    before = source.read_bytes(), (tmp_path / "in.onnx.data").read_bytes()
    optimized, report = optimize(source)
    assert report.count("folded") == 1
    target = save_model(optimized, tmp_path / "out.onnx")
    assert (source.read_bytes(), (tmp_path / "in.onnx.data").read_bytes()) == before
    assert_equivalent(load_model(source), load_model(target), feeds)


def test_value_info_of_kept_tensors_is_preserved() -> None:
    model, feeds = conv_bn_model(2, 1, True)
    relu = helper.make_node("Relu", ["y"], ["r"], name="relu")
    model.graph.node.append(relu)
    model.graph.output[0].CopyFrom(helper.make_tensor_value_info("r", TensorProto.FLOAT, None))
    model = onnx.shape_inference.infer_shapes(model)
    assert {v.name for v in model.graph.value_info} == {"c", "y"}
    optimized, _ = optimize(model)
    (info,) = optimized.graph.value_info
    assert info.name == "y" and [d.dim_value for d in info.type.tensor_type.shape.dim] == [2, 6, 5, 5]


def test_batchnorm_inside_loop_body_is_folded() -> None:
    rng = np.random.default_rng(15)
    body = helper.make_graph(
        [
            helper.make_node("Identity", ["cond_in"], ["cond_out"]),
            helper.make_node("Conv", ["x", "w"], ["lc"], name="loop_conv"),
            bn_node("lc", "ly", name="loop_bn"),
        ],
        "body",
        [
            helper.make_tensor_value_info("i", TensorProto.INT64, []),
            helper.make_tensor_value_info("cond_in", TensorProto.BOOL, []),
        ],
        [
            helper.make_tensor_value_info("cond_out", TensorProto.BOOL, []),
            helper.make_tensor_value_info("ly", TensorProto.FLOAT, None),
        ],
    )
    inits = [
        init("w", rng.normal(0, 1, (3, 3, 1, 1)).astype(np.float32)),
        init("trip", np.array(2, np.int64)),
        init("cond", np.array(True)),
        *bn_inits("bn", 3),
    ]
    graph = helper.make_graph(
        [helper.make_node("Loop", ["trip", "cond"], ["y"], name="loop", body=body)],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 2, 2])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 1, 3, 2, 2])],
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 10
    optimized, report = optimize(model)
    (record,) = report.batchnorms
    assert (record.status, record.graph, record.into) == ("folded", "main/loop.body", "loop_conv")
    onnx.checker.check_model(optimized, full_check=True)
    assert_equivalent(model, optimized, feed([1, 3, 2, 2]))


def test_batchnorm_inside_scan_body_is_folded() -> None:
    """Scan over 3 frames: each frame goes Conv -> BN (outer-scope weight and statistics), summed in a state."""
    rng = np.random.default_rng(17)
    body = helper.make_graph(
        [
            helper.make_node("Conv", ["frame", "w"], ["sc"], name="scan_conv", pads=[1, 1, 1, 1]),
            bn_node("sc", "sy", name="scan_bn"),
            helper.make_node("Add", ["acc_in", "sy"], ["acc_out"], name="accumulate"),
        ],
        "body",
        [
            helper.make_tensor_value_info("acc_in", TensorProto.FLOAT, [1, 4, 3, 3]),
            helper.make_tensor_value_info("frame", TensorProto.FLOAT, [1, 2, 3, 3]),
        ],
        [
            helper.make_tensor_value_info("acc_out", TensorProto.FLOAT, [1, 4, 3, 3]),
            helper.make_tensor_value_info("sy", TensorProto.FLOAT, [1, 4, 3, 3]),
        ],
    )
    inits = [
        init("w", rng.normal(0, 0.5, (4, 2, 3, 3)).astype(np.float32)),
        init("acc0", np.zeros((1, 4, 3, 3), np.float32)),
        *bn_inits("bn", 4, seed=18),
    ]
    graph = helper.make_graph(
        [
            helper.make_node(
                "Scan", ["acc0", "frames"], ["total", "per_frame"], name="scan", body=body, num_scan_inputs=1
            )
        ],
        "g",
        [helper.make_tensor_value_info("frames", TensorProto.FLOAT, [3, 1, 2, 3, 3])],
        [
            helper.make_tensor_value_info("total", TensorProto.FLOAT, [1, 4, 3, 3]),
            helper.make_tensor_value_info("per_frame", TensorProto.FLOAT, [3, 1, 4, 3, 3]),
        ],
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 10
    onnx.checker.check_model(model, full_check=True)
    optimized, report = optimize(model, check=True)
    (record,) = report.batchnorms
    assert (record.status, record.graph, record.into) == ("folded", "main/scan.body", "scan_conv")
    assert report.batchnorms_after == 0 and report.check is not None and report.check.passed
    (scan,) = optimized.graph.node
    (body_out,) = [a.g for a in scan.attribute if a.name == "body"]
    assert [n.op_type for n in body_out.node] == ["Conv", "Add"]
    onnx.checker.check_model(optimized, full_check=True)
    feeds = feed([3, 1, 2, 3, 3], name="frames")
    assert_equivalent(model, optimized, feeds)
    assert np.ptp(run(model, feeds)[1][2]) > 0  # the last frame really went through Conv -> BN


def test_opset_15_float32_params_fold_into_float16_conv() -> None:
    """BatchNormalization-15 lets scale/bias/mean/var be float32 while X is float16."""
    rng = np.random.default_rng(16)
    inits = [init("w", rng.normal(0, 0.5, (4, 2, 3, 3)).astype(np.float16)), *bn_inits("bn", 4, np.float32)]
    nodes = [helper.make_node("Conv", ["x", "w"], ["c"], name="conv"), bn_node("c", "y")]
    model = make_model(nodes, [("x", np.float16, [1, 2, 5, 5])], [("y", np.float16)], inits, opset=15)
    optimized, _ = optimize(model)
    assert ops(optimized) == ["Conv"]
    assert {t.name: t.data_type for t in optimized.graph.initializer}["w"] == TensorProto.FLOAT16
    assert_clean(optimized)
    assert_equivalent(model, optimized, feed([1, 2, 5, 5], np.float16), rtol=1e-2, reference=True)


def test_conv_with_a_runtime_weight_is_not_folded() -> None:
    model, feeds = conv_bn_model(2, 1, False)
    weight = next(t for t in model.graph.initializer if t.name == "w")
    feeds["w"] = numpy_helper.to_array(weight)
    model.graph.initializer.remove(weight)
    model.graph.input.append(helper.make_tensor_value_info("w", TensorProto.FLOAT, [6, 4, 3, 3]))
    optimized, report = optimize(model)
    assert ops(optimized) == ["Conv", "BatchNormalization"]
    assert report.batchnorms[0].reason.startswith("Conv conv weight is not constant")
    assert_equivalent(model, optimized, feeds)
