"""Small ModelProto / GraphProto edits the training passes share (copy, opsets, ordering, clean-up)."""

from __future__ import annotations

from collections.abc import Sequence

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
