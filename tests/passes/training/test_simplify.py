"""simplify.drop_copying_expands: onnx-ad's gradient-accumulating Expands that copy a tensor onto its own shape are
dropped, true broadcasts and anything of unknown shape are kept, and training gives the same numbers."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from bnfuse.io import ort_compatible
from bnfuse.passes.training import SGD, build_training_graph, simplify
from bnfuse.training import TrainingSession
from tests.loaders import torch_nets


def _expand_model(x_shape: list[int | str], target: list[int], as_output: bool = False) -> onnx.ModelProto:
    nodes = [helper.make_node("Expand", ["x", "shape"], ["e"]), helper.make_node("Relu", ["e"], ["y"])]
    outputs = [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)]
    if as_output:
        outputs.append(helper.make_tensor_value_info("e", TensorProto.FLOAT, None))
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, x_shape)],
        outputs,
        [numpy_helper.from_array(np.array(target, np.int64), "shape")],
    )
    return ort_compatible(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]))


@pytest.mark.parametrize(
    ("x_shape", "target", "as_output", "dropped"),
    [
        ([2, 3], [2, 3], False, 1),  # a copy onto its own shape
        ([1, 3], [2, 3], False, 0),  # a real broadcast
        (["n", 3], [2, 3], False, 0),  # unknown at build time: kept
        ([2, 3], [2, 3], True, 0),  # its output is a graph output: kept
    ],
)
def test_only_copies_onto_the_same_static_shape_are_dropped(x_shape, target, as_output, dropped) -> None:
    model = _expand_model(x_shape, target, as_output)
    assert simplify.drop_copying_expands(model) == dropped
    remaining = [n for n in model.graph.node if n.op_type == "Expand"]
    assert len(remaining) == 1 - dropped
    relu = next(n for n in model.graph.node if n.op_type == "Relu")
    assert relu.input[0] == ("x" if dropped else "e")


def _view_round_trip(keep_name: bool) -> tuple[onnx.ModelProto, list[str]]:
    """x -> Unsqueeze -> Reshape back to x's shape -> Relu: the Reshape undoes a view."""
    nodes = [
        helper.make_node("Unsqueeze", ["x", "axes"], ["u"]),
        helper.make_node("Reshape", ["u", "shape"], ["r"]),
        helper.make_node("Relu", ["r"], ["y"]),
    ]
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        [
            numpy_helper.from_array(np.array([0], np.int64), "axes"),
            numpy_helper.from_array(np.array([2, 3], np.int64), "shape"),
        ],
    )
    model = ort_compatible(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]))
    return model, ["r"] if keep_name else []


def test_a_reshape_undoing_views_becomes_an_alias_and_the_views_go() -> None:
    model, keep = _view_round_trip(keep_name=False)
    assert simplify.drop_copying_expands(model, keep=keep) == 1
    assert [(n.op_type, list(n.input)) for n in model.graph.node] == [("Relu", ["x"])]


def test_kept_names_stay_produced() -> None:
    model, keep = _view_round_trip(keep_name=True)
    assert simplify.drop_copying_expands(model, keep=keep) == 0
    assert [n.op_type for n in model.graph.node] == ["Unsqueeze", "Reshape", "Relu"]


def _exported(kind: str) -> tuple[onnx.ModelProto, tuple[int, ...]]:
    torch = pytest.importorskip("torch")
    nets = torch_nets()
    net, shape = nets.make(kind, seed=2)
    return nets.export(net, torch.randn(*shape)), shape


@pytest.mark.parametrize(("kind", "classes"), [("mlp", 5), ("resnet", 10)])
def test_training_graph_loses_its_copying_expands_and_trains_the_same(
    kind: str, classes: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    model, shape = _exported(kind)
    simplified, _ = build_training_graph(model, optimizer=SGD(momentum=0.9))
    monkeypatch.setattr(simplify, "drop_copying_expands", lambda *_, **__: 0)
    as_built, _ = build_training_graph(model, optimizer=SGD(momentum=0.9))
    expands = [sum(n.op_type == "Expand" for n in m.graph.node) for m in (as_built, simplified)]
    assert expands[0] > expands[1]
    rng = np.random.default_rng(0)
    x = rng.standard_normal(shape).astype(np.float32)
    labels = rng.integers(0, classes, shape[0]).astype(np.int64)
    sessions = [TrainingSession(m, lr=0.05) for m in (as_built, simplified)]
    losses = [[s.step(x, labels) for _ in range(5)] for s in sessions]
    assert losses[0] == losses[1]
    for name, value in sessions[0].state().items():
        np.testing.assert_array_equal(value, sessions[1].state()[name])
