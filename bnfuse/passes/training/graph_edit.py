"""Small ModelProto / GraphProto edits the training passes share (copy, opsets, ordering, dead-node clean-up)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import onnx
from onnx import helper

from bnfuse.errors import BnfuseError
from bnfuse.passes.training import bn


def copy_model(model: onnx.ModelProto) -> onnx.ModelProto:
    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    return copy


def tensor_info(tensor: onnx.TensorProto) -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(tensor.name, tensor.data_type, list(tensor.dims))


def opsets(model: onnx.ModelProto, custom: bool = True) -> list[onnx.OperatorSetIdProto]:
    opsets = [o for o in model.opset_import if o.domain != bn.DOMAIN]
    if custom:
        opsets.append(helper.make_opsetid(bn.DOMAIN, 1))
    return opsets


def drop_values(values, names: set[str]) -> None:  # noqa: ANN001 (a protobuf repeated field)
    keep = [v for v in values if v.name not in names]
    del values[:]
    values.extend(keep)


def toposort(nodes: Sequence[onnx.NodeProto], available: Sequence[str]) -> list[onnx.NodeProto]:
    """Nodes in an order where every input is produced before it is read (Kahn's algorithm)."""
    ready = set(available) | {""}
    producer = {out: i for i, node in enumerate(nodes) for out in node.output if out}
    waiting: dict[int, set[str]] = {}
    readers: dict[str, list[int]] = {}
    queue: list[int] = []
    for i, node in enumerate(nodes):
        missing = {name for name in node.input if name not in ready and name in producer}
        waiting[i] = missing
        for name in missing:
            readers.setdefault(name, []).append(i)
        if not missing:
            queue.append(i)
    order: list[onnx.NodeProto] = []
    while queue:
        i = queue.pop(0)
        order.append(nodes[i])
        for out in nodes[i].output:
            for j in readers.pop(out, []):
                waiting[j].discard(out)
                if not waiting[j]:
                    queue.append(j)
    if len(order) != len(nodes):
        raise BnfuseError("internal error: the training graph has a cycle")
    return order


def remove_unused_initializers(graph: onnx.GraphProto) -> None:
    read = {name for node in graph.node for name in node.input} | {i.name for i in graph.input}
    keep = [t for t in graph.initializer if t.name in read]
    graph.ClearField("initializer")
    graph.initializer.extend(keep)


def dead_nodes(
    nodes: Sequence[onnx.NodeProto],
    live: Iterable[str],
    *,
    readers: Sequence[onnx.NodeProto] = (),
    suspects: Iterable[str] | None = None,
) -> tuple[set[int], set[str]]:
    """The nodes of ``nodes`` that compute nothing read, by index, and the names they read that nothing reads any more
    (initializers to drop: onnxruntime warns about unused ones).

    A node is dead when no output of it is read by a node left (of ``nodes`` or ``readers``) or named in ``live``;
    found again until none is left, since what a dead node read may die in turn. With ``suspects`` (the inputs of
    nodes a caller removed itself), only a node writing a suspect may die, and a dead node's inputs become suspects:
    the rest of the graph stays as it is."""
    live = set(live)
    suspected = None if suspects is None else set(suspects)
    released = list(suspected or ())  # what the removed nodes (and the caller's) read
    gone: set[int] = set()

    def read_now() -> set[str]:
        left = (node for i, node in enumerate(nodes) if i not in gone)
        return {name for node in [*left, *readers] for name in node.input} | live

    while True:
        read = read_now()
        dead = [
            i
            for i, node in enumerate(nodes)
            if i not in gone
            and not any(o in read for o in node.output if o)
            and (suspected is None or any(o in suspected for o in node.output if o))
        ]
        if not dead:
            break
        gone.update(dead)
        for i in dead:
            released += nodes[i].input
            if suspected is not None:
                suspected.update(nodes[i].input)
    read = read_now()
    return gone, {name for name in released if name and name not in read}
