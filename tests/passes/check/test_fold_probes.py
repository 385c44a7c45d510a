"""Where each fold is proven: compared tensors, producers' data inputs, chains copied under fresh names."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper

from bnfuse.passes.check import fold_probes
from bnfuse.passes.report import BatchNormRecord


def graph(nodes: list[onnx.NodeProto]) -> onnx.GraphProto:
    return helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 2])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 2])],
    )


def test_path_nodes_are_the_nodes_between_two_tensors_in_order() -> None:
    g = graph(
        [
            helper.make_node("Relu", ["x"], ["a"], name="relu"),
            helper.make_node("Conv", ["a", "w"], ["c"], name="conv"),
            helper.make_node("Sigmoid", ["a"], ["side"], name="side"),  # reads the source, not on the path
            helper.make_node("BatchNormalization", ["c", "s", "b", "m", "v"], ["n"], name="bn"),
            helper.make_node("Add", ["n", "side"], ["y"], name="add"),
        ]
    )
    assert [n.name for n in fold_probes.path_nodes(g.node, "a", "n")] == ["conv", "bn"]
    assert [n.name for n in fold_probes.path_nodes(g.node, "a", "y")] == ["conv", "side", "bn", "add"]
    assert fold_probes.path_nodes(g.node, "c", "side") == []


def test_plan_finds_the_producers_data_input_and_isolate_renames_only_the_chain() -> None:
    nodes = [
        helper.make_node("MatMul", ["x", "w"], ["mm"], name="matmul"),
        helper.make_node("Add", ["mm", "bias"], ["p"], name="bias_add"),
        helper.make_node("BatchNormalization", ["p", "s", "b", "m", "v"], ["y"], name="bn"),
    ]
    original = helper.make_model(graph(nodes))
    optimized = helper.make_model(graph(nodes[:1] + [helper.make_node("Add", ["mm", "bias2"], ["y"], name="bias_add")]))
    record = BatchNormRecord("bn", "main", "folded", into="matmul", output="y", replacement="y")
    skipped = BatchNormRecord("other", "main", "skipped", reason="...")
    (probe,) = fold_probes.plan(original, optimized, [record, skipped])
    assert probe.check.tensor == "y" and probe.entry == "x" and probe.check.note is None

    isolation = fold_probes.isolate(original, optimized, [probe], {"x": ((1, 2), np.dtype(np.float32))})
    (fresh,) = isolation.inputs
    assert fresh.endswith("/x") and isolation.outputs == [fresh[: -len("x")] + "y"]
    copied = isolation.original.node
    assert [n.op_type for n in copied] == ["MatMul", "Add", "BatchNormalization"]
    assert copied[0].input == [fresh, "w"]  # the weight keeps its name: nothing is copied
    assert list(copied[2].input[1:]) == ["s", "b", "m", "v"] and copied[2].output == isolation.outputs
    assert [n.op_type for n in isolation.optimized.node] == ["MatMul", "Add"]
    assert isolation.optimized.node[1].input[1] == "bias2"


def test_a_bn_in_a_subgraph_or_with_a_missing_tensor_is_not_compared() -> None:
    nodes = [helper.make_node("Relu", ["x"], ["y"])]
    model = helper.make_model(graph(nodes))
    inside = BatchNormRecord("bn", "main/if.then_branch", "folded", into="c", output="t", replacement="t")
    missing = BatchNormRecord("bn2", "main", "folded", into="c", output="gone", replacement="gone")
    first, second = fold_probes.plan(model, model, [inside, missing])
    assert first.check.tensor is None and "inside main/if.then_branch" in first.check.note
    assert second.check.tensor is None and "'gone' not found in the original and optimized model" in second.check.note
