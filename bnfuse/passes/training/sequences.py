"""Tensor sequences the exporters write for a split, turned back into one Split that autodiff differentiates.

With ``optimize=False`` PyTorch's dynamo exporter writes ``torch.split`` / ``x.chunk`` as ``SplitToSequence(x,
split)`` read only by ``SequenceAt(sequence, index)`` nodes (shufflenet_v2's channel split, mixnet's mixed
kernels); the TorchScript exporter writes a plain Split. onnx-ad has no reverse rule for sequences, so where the
split sizes and every index are constants and the split axis has a static size, the pair becomes one
``Split(x, sizes)`` whose pieces the ``SequenceAt`` outputs take over (through Identity). Anything else stays.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import onnx
from onnx import helper, numpy_helper


def split_sequences(model: onnx.ModelProto, shapes: Mapping[str, tuple[tuple[int, ...], int]]) -> int:
    """Rewrite every constant ``SplitToSequence`` -> ``SequenceAt`` pair of the main graph; returns how many."""
    graph = model.graph
    constants = _constants(graph)
    readers: dict[str, list[onnx.NodeProto]] = {}
    for node in graph.node:
        for name in node.input:
            readers.setdefault(name, []).append(node)
    outputs = {o.name for o in graph.output}
    rewritten = 0
    for node in list(graph.node):
        if node.op_type != "SplitToSequence" or node.domain not in ("", "ai.onnx") or node.output[0] in outputs:
            continue
        sizes = _sizes(node, constants, shapes)
        reads = readers.get(node.output[0], [])
        if sizes is None or not reads or any(r.op_type != "SequenceAt" for r in reads):
            continue
        indices = [_index(r, constants, len(sizes)) for r in reads]
        if any(i is None for i in indices):
            continue
        axis = next((a.i for a in node.attribute if a.name == "axis"), 0)
        pieces = [f"{node.output[0]}/piece{k}" for k in range(len(sizes))]
        sizes_name = f"{node.output[0]}/sizes"
        graph.initializer.append(numpy_helper.from_array(np.asarray(sizes, np.int64), sizes_name))
        position = list(graph.node).index(node)
        split = helper.make_node("Split", [node.input[0], sizes_name], pieces, name=f"{node.name}/split", axis=axis)
        graph.node.insert(position, split)
        graph.node.remove(node)
        for read, index in zip(reads, indices, strict=True):
            at = list(graph.node).index(read)
            graph.node.insert(at, helper.make_node("Identity", [pieces[index]], [read.output[0]], name=read.name))
            graph.node.remove(read)
        rewritten += 1
    return rewritten


def _constants(graph: onnx.GraphProto) -> dict[str, onnx.TensorProto]:
    """The graph's constant tensors by name, unread: only a split's sizes and indices are converted (weights may be
    placeholders whose bytes are held elsewhere while the pass builds: passes/training/weights.py)."""
    values = {t.name: t for t in graph.initializer}
    for node in graph.node:
        if node.op_type == "Constant" and node.domain in ("", "ai.onnx"):
            for attribute in node.attribute:
                if attribute.name == "value":
                    values[node.output[0]] = attribute.t
    return values


def _value(constants: Mapping[str, onnx.TensorProto], name: str) -> np.ndarray | None:
    """A small integer constant's values; None for anything else (a weight, external data, a large tensor)."""
    tensor = constants.get(name)
    if tensor is None or tensor.data_location == onnx.TensorProto.EXTERNAL or len(tensor.dims) > 1:
        return None
    if tensor.data_type not in (onnx.TensorProto.INT64, onnx.TensorProto.INT32):
        return None
    return numpy_helper.to_array(tensor)


def _sizes(
    node: onnx.NodeProto, constants: Mapping[str, onnx.TensorProto], shapes: Mapping[str, tuple[tuple[int, ...], int]]
) -> list[int] | None:
    """The pieces' sizes along the axis, or None where they are not constants (or keepdims=0 drops the axis)."""
    attributes = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    given = _value(constants, node.input[1]) if len(node.input) > 1 and node.input[1] else None
    if attributes.get("keepdims", 1) == 0 or given is None:
        return None
    split = given.astype(np.int64)
    if split.ndim == 1:
        return [int(s) for s in split] if (split >= 0).all() else None
    shape = shapes.get(node.input[0], ((), 0))[0]
    axis = attributes.get("axis", 0)
    if not shape or not -len(shape) <= axis < len(shape) or shape[axis] < 0 or int(split) <= 0:
        return None
    total, piece = shape[axis], int(split)
    return [piece] * (total // piece) + ([total % piece] if total % piece else [])


def _index(read: onnx.NodeProto, constants: Mapping[str, onnx.TensorProto], count: int) -> int | None:
    given = _value(constants, read.input[1]) if len(read.input) > 1 else None
    if given is None or given.size != 1:
        return None
    index = int(given.reshape(()))
    index = index + count if index < 0 else index
    return index if 0 <= index < count else None
