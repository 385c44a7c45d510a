"""bnfuse.tensorcheck: tensor data against dims and type, names as UTF-8, for tensors of any size."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from bnfuse.errors import ModelError
from bnfuse.tensorcheck import check_strings, check_tensors, element_count, tensor_nbytes


def _model(*tensors: TensorProto) -> onnx.ModelProto:
    graph = helper.make_graph([], "g", [], [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])], list(tensors))
    return helper.make_model(graph)


def test_consistent_tensors_of_every_layout_pass() -> None:
    tensors = [
        numpy_helper.from_array(np.ones((3, 4), np.float32), "raw"),
        helper.make_tensor("floats", TensorProto.FLOAT, [2, 2], [1.0, 2.0, 3.0, 4.0]),
        TensorProto(name="complex", data_type=TensorProto.COMPLEX64, dims=[2], float_data=[1.0, 2.0, 3.0, 4.0]),
        helper.make_tensor("halves", TensorProto.FLOAT16, [3], np.ones(3, np.float16).view(np.uint16).tolist()),
        helper.make_tensor("text", TensorProto.STRING, [2], [b"a", b"b"]),
        helper.make_tensor("empty", TensorProto.FLOAT, [0, 5], []),
        helper.make_tensor("nibbles", TensorProto.INT4, [3], [1, -2, 3]),  # packed: 2 bytes of raw data
    ]
    check_tensors(_model(*tensors), what="m")


@pytest.mark.parametrize(
    ("tensor", "message"),
    [
        (
            TensorProto(name="t", data_type=1, dims=[3], float_data=[1.0, 2.0]),
            "float_data holds 2 values but its dims need 3",
        ),
        (
            TensorProto(name="t", data_type=15, dims=[2], double_data=[1.0, 2.0]),
            "double_data holds 2 values but its dims",
        ),
        (TensorProto(name="t", data_type=7, dims=[2], int64_data=[1, 2, 3]), "int64_data holds 3 values"),
        (TensorProto(name="t", data_type=TensorProto.FLOAT, dims=[2], raw_data=b"\0" * 7), "raw_data holds 7 bytes"),
        (TensorProto(name="t", data_type=TensorProto.INT4, dims=[3], raw_data=b"\0" * 3), "dims and type need 2"),
        (TensorProto(name="t", data_type=TensorProto.FLOAT, dims=[2, -1], raw_data=b""), "negative dimension -1"),
        (TensorProto(name="t", data_type=TensorProto.FLOAT, dims=[2**40, 2**40]), "more than 2^63 elements"),
        (TensorProto(name="t", data_type=1, dims=[1], raw_data=b"\0" * 4, float_data=[1.0]), "raw_data and float_data"),
    ],
)
def test_inconsistent_tensors_are_one_line(tensor: TensorProto, message: str) -> None:
    with pytest.raises(ModelError, match="^m: tensor 't': ") as info:
        check_tensors(_model(tensor), what="m")
    assert message in str(info.value) and "\n" not in str(info.value)


def test_attribute_and_subgraph_tensors_are_checked_too() -> None:
    bad = TensorProto(name="inner", data_type=TensorProto.FLOAT, dims=[4], raw_data=b"\0" * 8)
    body = helper.make_graph(
        [helper.make_node("Constant", [], ["c"], value=bad)], "body", [], [helper.make_tensor_value_info("c", 1, [4])]
    )
    graph = helper.make_graph(
        [helper.make_node("If", ["cond"], ["y"], then_branch=body, else_branch=body)],
        "g",
        [helper.make_tensor_value_info("cond", TensorProto.BOOL, [])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4])],
    )
    with pytest.raises(ModelError, match="tensor 'inner': raw_data holds 8 bytes but its dims and type need 16"):
        check_tensors(helper.make_model(graph), what="m")


def test_sizes_use_python_integers() -> None:
    wide = TensorProto(data_type=TensorProto.FLOAT, dims=[2**31, 2**31])
    assert element_count(wide, "w") == 2**62 and tensor_nbytes(wide, "w") == 2**64  # no int64 wrap
    assert tensor_nbytes(TensorProto(data_type=TensorProto.STRING, dims=[3]), "s") is None


def test_names_that_are_not_utf8_are_named() -> None:
    model = _model(numpy_helper.from_array(np.ones(2, np.float32), "w"))
    model.graph.node.append(helper.make_node("Identity", ["w"], ["y"], name="node"))
    parsed = onnx.ModelProto.FromString(model.SerializeToString().replace(b"node", b"no\xe9e"))
    with pytest.raises(ModelError, match=r"^m: NodeProto.name b'no\\xe9e' is not valid UTF-8 text$"):
        check_strings(parsed, what="m")
    check_strings(model, what="m")
