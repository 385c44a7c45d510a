"""The training passes' shared graph edits: topological order and the one dead-node remover."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from bnfuse.errors import BnfuseError
from bnfuse.passes.training import prepare
from bnfuse.passes.training.graph_edit import dead_nodes, toposort


def _node(op: str, inputs: list[str], outputs: list[str]) -> onnx.NodeProto:
    return helper.make_node(op, inputs, outputs, name=outputs[0] if outputs else op)


def test_toposort_puts_producers_first_and_refuses_a_cycle() -> None:
    nodes = [_node("Relu", ["b"], ["c"]), _node("Relu", ["a"], ["b"]), _node("Add", ["c", "w"], ["d"])]
    assert [n.name for n in toposort(nodes, ["a", "w"])] == ["b", "c", "d"]
    with pytest.raises(BnfuseError, match="cycle"):
        toposort([_node("Relu", ["y"], ["x"]), _node("Relu", ["x"], ["y"])], [])


def test_dead_nodes_follow_chains_and_keep_what_is_read() -> None:
    # a -> b -> c (read by the output), a -> d -> e (nothing reads e: d and e die, in two rounds)
    nodes = [
        _node("Relu", ["a"], ["b"]),
        _node("Relu", ["b"], ["c"]),
        _node("Neg", ["a", "k"], ["d"]),
        _node("Identity", ["d"], ["e"]),
        _node("Dropout", ["c"], ["f", ""]),  # an empty optional output is no tensor: f is read, so it lives
        _node("Identity", ["f"], ["g"]),
    ]
    dead, orphans = dead_nodes(nodes, {"g"})
    assert dead == {2, 3}
    assert orphans == {"k", "d"}  # 'a' is still read by the first node
    dead, orphans = dead_nodes(nodes, {"g"}, readers=[_node("Abs", ["e"], ["z"])])
    assert dead == set() and orphans == set()


def test_dead_nodes_with_suspects_touch_only_the_producers_of_what_was_removed() -> None:
    nodes = [
        _node("Shape", ["x"], ["n"]),  # fed only the removed node: dies
        _node("Cast", ["n"], ["nf"]),  # read by nothing left, but writes no suspect: the caller's graph stays
        _node("Relu", ["x"], ["y"]),
        _node("Reciprocal", ["m"], ["m_inv"]),  # m_inv is read by a reader the caller adds
    ]
    removed = _node("Div", ["n", "m_inv", "one"], ["inv"])
    dead, orphans = dead_nodes(nodes, {"y"}, readers=[_node("Neg", ["m_inv"], ["z"])], suspects=removed.input)
    assert dead == set() and orphans == {"one"}  # n is read by the Cast, which is no suspect
    dead, orphans = dead_nodes(nodes[:1] + nodes[2:], {"y"}, suspects=removed.input)
    assert dead == {0, 2} and orphans == {"n", "m_inv", "one", "m"}  # x is still read by the Relu
    dead, orphans = dead_nodes(nodes[:1] + nodes[2:], {"y"}, readers=[_node("Neg", ["m_inv"], ["z"])], suspects=["n"])
    assert dead == {0} and orphans == {"n"}  # the Reciprocal writes no suspect: it stays


def test_remove_dead_drops_the_nodes_and_the_initializers_nothing_reads() -> None:
    w = numpy_helper.from_array(np.ones((2, 2), np.float32), "w")
    unused = numpy_helper.from_array(np.ones(2, np.float32), "unused")
    graph = helper.make_graph(
        [
            _node("Identity", ["w"], ["w.copy"]),  # an untying leftover: nothing reads it
            _node("MatMul", ["x", "w"], ["y"]),
            _node("Identity", ["w.copy"], ["w.copy2"]),
        ],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 2])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 2])],
        [w, unused],
    )
    prepare.remove_dead(graph)
    assert [n.op_type for n in graph.node] == ["MatMul"]
    assert [t.name for t in graph.initializer] == ["w"]
