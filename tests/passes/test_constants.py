"""Constant resolution: initializers, Constant nodes, small constant subgraphs, overridable inputs."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_graphsurgeon as gs
import pytest
from onnx import TensorProto, helper, numpy_helper
from onnx.reference import ReferenceEvaluator

from bnfuse.passes.constants import ConstantResolver, overridable_initializers


def resolve(nodes: list[onnx.NodeProto], inits: list[onnx.TensorProto], opset: int = 17, **kw) -> dict:
    """Values of every node output and graph output of a tiny model (None where not constant).

    Every value the resolver folds is also checked, value and dtype, against onnx's reference evaluator running the
    same model: a fold that gets the shape right and the numbers wrong (a reshape in the wrong order, a transposed
    copy, a wrong cast) fails in every test that resolves it.
    """
    outputs = [helper.make_tensor_value_info(n.output[0], TensorProto.FLOAT, None) for n in nodes]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])], outputs, inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    imported = gs.import_onnx(model)
    resolver = ConstantResolver(overridable=kw.get("overridable", set()))
    tensors = imported.tensors()
    values = {name: resolver.value(tensor) for name, tensor in tensors.items()}
    folded = [n.output[0] for n in nodes if values[n.output[0]] is not None]
    if folded:
        feeds = {"x": np.array([3.0, -7.0], np.float32)}
        for name, want in zip(folded, ReferenceEvaluator(model).run(folded, feeds), strict=True):
            assert values[name].dtype == want.dtype and values[name].shape == want.shape, name
            np.testing.assert_array_equal(values[name], want, err_msg=name)
    return values


def test_initializer_and_graph_input() -> None:
    values = resolve([helper.make_node("Identity", ["w"], ["y"])], [numpy_helper.from_array(np.arange(3.0), "w")])
    np.testing.assert_array_equal(values["y"], np.arange(3.0))
    assert values["x"] is None


def test_overridable_initializer_is_not_constant() -> None:
    values = resolve(
        [helper.make_node("Identity", ["w"], ["y"])],
        [numpy_helper.from_array(np.arange(3.0), "w")],
        overridable={"w"},
    )
    assert values["w"] is None and values["y"] is None


@pytest.mark.parametrize(
    ("attrs", "expected"),
    [
        ({"value_float": 2.5}, np.float32(2.5)),
        ({"value_floats": [1.0, 2.0]}, np.array([1, 2], np.float32)),
        ({"value_int": 3}, np.int64(3)),
        ({"value_ints": [4, 5]}, np.array([4, 5], np.int64)),
        ({"value": numpy_helper.from_array(np.eye(2, dtype=np.float32))}, np.eye(2, dtype=np.float32)),
    ],
)
def test_constant_node_attributes(attrs: dict, expected: np.ndarray) -> None:
    values = resolve([helper.make_node("Constant", [], ["y"], **attrs)], [])
    np.testing.assert_array_equal(values["y"], expected)
    assert values["y"].dtype == np.asarray(expected).dtype


def test_constant_of_shape_cast_and_default_fill() -> None:
    nodes = [
        helper.make_node("ConstantOfShape", ["shape"], ["filled"], value=helper.make_tensor("v", 1, [1], [0.02])),
        helper.make_node("ConstantOfShape", ["shape"], ["zeros"]),
        helper.make_node("Cast", ["filled"], ["half"], to=TensorProto.FLOAT16),
    ]
    values = resolve(nodes, [numpy_helper.from_array(np.array([2, 3], np.int64), "shape")])
    np.testing.assert_array_equal(values["filled"], np.full((2, 3), 0.02, np.float32))
    np.testing.assert_array_equal(values["zeros"], np.zeros((2, 3), np.float32))
    np.testing.assert_array_equal(values["half"], np.full((2, 3), np.float16(0.02), np.float16))
    assert values["half"].dtype == np.float16


def test_unsqueeze_axes_attribute_before_opset_13() -> None:
    nodes = [helper.make_node("Unsqueeze", ["v"], ["y"], axes=[1, -1])]
    values = resolve(nodes, [numpy_helper.from_array(np.arange(4.0), "v")], opset=11)
    np.testing.assert_array_equal(values["y"], np.arange(4.0).reshape(4, 1, 1))


def test_unsqueeze_squeeze_and_reshape_with_axes_inputs() -> None:
    nodes = [
        helper.make_node("Unsqueeze", ["v", "axes"], ["u"]),
        helper.make_node("Squeeze", ["u", "axes"], ["s"]),
        helper.make_node("Reshape", ["u", "shape"], ["r"]),
    ]
    inits = [
        numpy_helper.from_array(np.arange(6.0).reshape(2, 3), "v"),
        numpy_helper.from_array(np.array([0], np.int64), "axes"),
        numpy_helper.from_array(np.array([0, -1], np.int64), "shape"),
    ]
    values = resolve(nodes, inits, opset=13)
    v = np.arange(6.0).reshape(2, 3)
    np.testing.assert_array_equal(values["u"], v[None])
    np.testing.assert_array_equal(values["s"], v)
    np.testing.assert_array_equal(values["r"], v.reshape(1, 6))  # 0 copies the input dimension, -1 takes the rest


def test_concat_and_transpose_values() -> None:
    """The dynamo exporter's Concat-built Reshape targets; tf2onnx's HWIO -> OIHW kernel Transposes."""
    kernel = np.arange(24.0, dtype=np.float32).reshape(2, 3, 1, 4)  # H, W, I, O: every element distinct
    nodes = [
        helper.make_node("Concat", ["a", "b"], ["joined"], axis=0),
        helper.make_node("Concat", ["m", "m"], ["wide"], axis=-1),
        helper.make_node("Transpose", ["k"], ["oihw"], perm=[3, 2, 0, 1]),
        helper.make_node("Transpose", ["m"], ["reversed"]),
        helper.make_node("Reshape", ["oihw", "flat"], ["rows"]),
    ]
    inits = [
        numpy_helper.from_array(np.array([0, 4], np.int64), "a"),
        numpy_helper.from_array(np.array([-1], np.int64), "b"),
        numpy_helper.from_array(np.arange(6.0, dtype=np.float32).reshape(2, 3), "m"),
        numpy_helper.from_array(kernel, "k"),
        numpy_helper.from_array(np.array([4, -1], np.int64), "flat"),
    ]
    values = resolve(nodes, inits)
    m = np.arange(6.0, dtype=np.float32).reshape(2, 3)
    np.testing.assert_array_equal(values["joined"], np.array([0, 4, -1], np.int64))
    np.testing.assert_array_equal(values["wide"], np.concatenate([m, m], axis=1))
    np.testing.assert_array_equal(values["oihw"], kernel.transpose(3, 2, 0, 1))
    np.testing.assert_array_equal(values["reversed"], m.T)
    np.testing.assert_array_equal(values["rows"], kernel.transpose(3, 2, 0, 1).reshape(4, 6))
    assert values["oihw"].flags.c_contiguous


def test_anything_fed_by_a_graph_input_is_not_constant() -> None:
    nodes = [helper.make_node("Identity", ["x"], ["a"]), helper.make_node("Add", ["a", "w"], ["b"])]
    values = resolve(nodes, [numpy_helper.from_array(np.ones(2, np.float32), "w")])
    assert values["a"] is None and values["b"] is None


def test_overridable_initializers_by_ir_version() -> None:
    graph = helper.make_graph(
        [],
        "g",
        [helper.make_tensor_value_info("w", TensorProto.FLOAT, [1])],
        [],
        [numpy_helper.from_array(np.ones(1, np.float32), "w"), numpy_helper.from_array(np.ones(1, np.float32), "k")],
    )
    assert overridable_initializers(graph, 3) == set()  # IR < 4 lists every initializer as an input
    assert overridable_initializers(graph, 8) == {"w"}


def test_expansion_has_a_total_budget_not_only_a_per_node_cap() -> None:
    """Many small ConstantOfShape nodes may not add up past the budget: later ones stay non-constant."""
    shape = numpy_helper.from_array(np.array([256, 1024], np.int64), "shape")  # 1 MiB of float32 each
    nodes = [helper.make_node("ConstantOfShape", ["shape"], [f"c{i}"]) for i in range(6)]
    graph = helper.make_graph(
        nodes, "g", [], [helper.make_tensor_value_info(f"c{i}", TensorProto.FLOAT, None) for i in range(6)], [shape]
    )
    imported = gs.import_onnx(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]))
    resolver = ConstantResolver(overridable=set(), budget_bytes=4 * 2**20 + 100)
    tensors = imported.tensors()
    values = [resolver.value(tensors[f"c{i}"]) for i in range(6)]
    assert [v is not None for v in values] == [True] * 4 + [False] * 2
    assert resolver.spent_bytes == 4 * 2**20 and resolver.over_budget == {"c4", "c5"}
    np.testing.assert_array_equal(values[0], np.zeros((256, 1024), np.float32))
    assert values[0].dtype == np.float32


def test_a_wrapping_constant_of_shape_is_not_materialized() -> None:
    shape = numpy_helper.from_array(np.array([2**62, 8], np.int64), "shape")  # int64 product wraps to 0
    graph = helper.make_graph(
        [helper.make_node("ConstantOfShape", ["shape"], ["c"])],
        "g",
        [],
        [helper.make_tensor_value_info("c", TensorProto.FLOAT, None)],
        [shape],
    )
    imported = gs.import_onnx(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]))
    resolver = ConstantResolver(overridable=set())
    assert resolver.value(imported.tensors()["c"]) is None and resolver.spent_bytes == 0
