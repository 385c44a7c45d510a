"""The numerical proof: onnxruntime on seeded random inputs, errors per output, tolerance verdicts."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from bnfuse.errors import BnfuseError
from bnfuse.passes.check import compare_models


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


def test_a_model_onnxruntime_cannot_run_is_a_clear_error() -> None:
    graph = helper.make_graph(
        [helper.make_node("NoSuchOp", ["x"], ["y"], domain="nowhere")],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("nowhere", 1)])
    with pytest.raises(BnfuseError, match="onnxruntime cannot run the original model"):
        compare_models(model, model)
