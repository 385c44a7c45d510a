"""The check's seeded inputs (check/inputs.py): dynamic dims filled from given shapes or defaults, bad shapes a
user error."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from onnx import TensorProto, helper

from bnfuse.errors import BnfuseError
from bnfuse.passes.check.compare import compare_models
from tests.loaders import load_file

_check_tests = load_file(Path(__file__).with_name("test_compare.py"), "bnfuse_test_check_compare")
matmul_model = _check_tests.matmul_model


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
