"""The numerical proof: seeded random inputs, errors per output, tolerance verdicts, engines."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from bnfuse.errors import BnfuseError
from bnfuse.passes.check import compare_models, random_inputs


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


def test_given_input_shapes_fill_dynamic_dims() -> None:
    model = matmul_model(np.eye(4), ["n", 4])
    result = compare_models(model, model, input_shapes={"x": [6, 4]})
    assert result.input_shapes == {"x": [6, 4]}


def test_default_dims_for_images() -> None:
    graph = helper.make_graph(
        [helper.make_node("Relu", ["x"], ["y"])],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 3, "H", "W"])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    assert compare_models(model, model).input_shapes == {"x": [1, 3, 32, 32]}


@pytest.mark.parametrize(
    ("shapes", "message"),
    [({"nope": [1, 4]}, "names no model input"), ({"x": [2, 5]}, "does not match the declared shape")],
)
def test_bad_input_shapes_are_user_errors(shapes: dict, message: str) -> None:
    model = matmul_model(np.eye(4), ["n", 4])
    with pytest.raises(BnfuseError, match=message):
        compare_models(model, model, input_shapes=shapes)


def test_a_model_no_engine_can_run_is_a_clear_error() -> None:
    graph = helper.make_graph(
        [helper.make_node("NoSuchOp", ["x"], ["y"], domain="nowhere")],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("nowhere", 1)])
    with pytest.raises(BnfuseError, match="cannot run the original model") as info:
        compare_models(model, model)
    message = str(info.value)
    assert "\n" not in message and "onnxruntime: " in message and "reference evaluator: " in message
    assert "NoSuchOp" in message


# ----- float16 / bfloat16 against a float32 reference, engines, big models -------------------------------


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
    assert out.reference == "float32 original" and out.noise is not None and out.noise > 0
    assert out.tolerance == pytest.approx(2 * out.noise + 2.0**-9)
    assert 0 < out.max_rel <= out.tolerance
    # A fold that got one channel 3% wrong is far outside float16's own noise on this model.
    wrong = compare_models(model, scaled_channel(folded, "w1", 1.03))
    assert not wrong.passed and wrong.outputs[0].max_rel > 2 * wrong.outputs[0].tolerance
    # A forced tolerance compares with the float16 original directly.
    (direct,) = compare_models(model, folded, tolerance=0.5).outputs
    assert direct.reference == "original" and direct.noise is None and direct.tolerance == 0.5


@pytest.mark.parametrize("elem_type", [TensorProto.DOUBLE, TensorProto.BFLOAT16])
def test_models_onnxruntime_cannot_run_are_checked_by_the_reference_evaluator(elem_type: int) -> None:
    from bnfuse.passes.optimize import optimize

    model = conv_bn(elem_type)
    feeds = random_inputs(model, {}, 0)
    assert feeds["x"].dtype == np.dtype(helper.tensor_dtype_to_np_dtype(elem_type))  # bfloat16 included
    assert feeds["x"].shape == (1, 3, 6, 6) and np.ptp(feeds["x"].astype(np.float32)) > 0
    folded, report = optimize(model, check=True)
    assert report.check is not None and report.check.passed
    assert report.check.engine == "onnx reference evaluator"
    assert "check passed (onnx reference evaluator, seed 0" in report.format_text()
    (out,) = report.check.outputs
    assert out.max_rel > 0  # the fold changed rounding: the outputs really were computed and compared
    if elem_type == TensorProto.DOUBLE:
        assert out.reference == "original" and out.tolerance == 1e-9
    else:
        assert out.reference == "float32 original" and out.max_rel <= out.tolerance
    assert not compare_models(model, scaled_channel(folded, "w1", 1.1)).passed


def test_float32_models_keep_onnxruntime_and_1e_4() -> None:
    from bnfuse.passes.optimize import optimize

    model = conv_bn(TensorProto.FLOAT, opset=17)
    folded, _ = optimize(model)
    result = compare_models(model, folded)
    assert result.engine == "onnxruntime" and result.outputs[0].tolerance == 1e-4 and result.passed
    assert not compare_models(model, scaled_channel(folded, "w1", 1.001)).passed


def test_model_over_the_protobuf_limit_goes_to_onnxruntime_as_a_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Over 2 GiB a model cannot be serialized to bytes: onnxruntime gets a path with external data."""
    from bnfuse import io
    from bnfuse.passes import check

    model = conv_bn(TensorProto.FLOAT, opset=17)
    assert isinstance(check._ort_source(model, "original", tmp_path), bytes)
    monkeypatch.setattr(io, "_METADATA_MARGIN", 0)
    monkeypatch.setattr(io, "_PROTOBUF_LIMIT", 1024)
    source = check._ort_source(model, "original", tmp_path)
    assert source == str(tmp_path / "original.onnx")
    assert (tmp_path / "original.onnx.data").stat().st_size > 0
    result = compare_models(model, scaled_channel(model, "w1", 1.0))
    assert result.engine == "onnxruntime" and result.passed and result.outputs[0].max_abs == 0.0
