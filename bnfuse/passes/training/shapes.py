"""Shape computations resolved for the given input shapes.

Exporters compute reshape targets, slice bounds, pads and resize sizes from the input at run time: ``Shape ->
Gather -> Unsqueeze -> Concat -> Reshape`` (shufflenet_v2's channel shuffle), ``Shape -> Slice -> Concat ->
Resize``, bounds through Unsqueeze (dpn68). A training graph has static shapes (the input shapes are fixed
first), so every such value is a constant: each node whose inputs are all shape-derived values or integer
constants is evaluated here (onnx's reference evaluator, node by node) and its outputs become initializers.
Only shape-derived values are folded; weights and their Reshape / Transpose chains stay as they are (they train).

Folding repeats with shapes inferred anew until nothing more folds: onnx's shape inference does not carry values
through every op (Div, Cast of a Shape-computed dimension), so the tensor a folded Reshape makes has a static shape
only after the fold, and the ``Shape`` of it (a flatten by ``x.size(0)`` after a channel shuffle) folds in the next
round. A dynamic-batch export computes every such shape from its input: fixed here, it resolves for the probe batch
sizes (dynamic_batch.py) as for any other.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import onnx
from onnx import numpy_helper

from bnfuse.errors import ModelError
from bnfuse.passes.training import prepare

MAX_FOLDED = 1 << 16  # elements: shape arithmetic is small; anything larger is left to the runtime


def fold_shape_computations(model: onnx.ModelProto, shapes: Mapping[str, tuple[tuple[int, ...], int]]) -> int:
    """Replace shape-derived nodes by initializers (in place), rounds with shapes inferred anew until nothing more
    folds; returns how many nodes were folded."""
    total, waiting = _fold_once(model, shapes)
    folded = total
    while folded and waiting:  # another round only for Shape nodes whose input had no static shape
        folded, waiting = _fold_once(model, prepare.infer_static_shapes(model))
        total += folded
    return total


def _fold_once(model: onnx.ModelProto, shapes: Mapping[str, tuple[tuple[int, ...], int]]) -> tuple[int, int]:
    """One pass over the nodes: (nodes folded, Shape nodes left for want of a static input shape)."""
    from onnx.reference import ReferenceEvaluator

    graph = model.graph
    known: dict[str, np.ndarray] = {t.name: numpy_helper.to_array(t) for t in graph.initializer}
    derived: set[str] = set()
    folded: list[int] = []
    waiting = 0
    opsets = list(model.opset_import)
    for index, node in enumerate(graph.node):
        if node.domain not in ("", "ai.onnx"):
            continue
        if node.op_type == "Constant":
            value = constant_value(node)
            if value is not None:
                known[node.output[0]] = value
                if value.size <= 64:  # a small Constant node (resize scales, slice bounds): shape arithmetic
                    derived.add(node.output[0])
            continue
        if node.op_type == "Shape":
            dims = shapes.get(node.input[0], ((), 0))[0]
            if not dims or any(d < 0 for d in dims):
                waiting += 1
                continue
            attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
            rank = len(dims)
            start, end = int(attrs.get("start", 0)), int(attrs.get("end", rank))
            known[node.output[0]] = np.array(dims, np.int64)[slice(start, end)]
            derived.add(node.output[0])
            folded.append(index)
            continue
        inputs = [name for name in node.input if name]
        if not inputs or not all(name in known for name in inputs):
            continue
        # shape arithmetic: every input shape-derived or an integer constant, at least one shape-derived or
        # computed (bounds built by Unsqueeze of a Constant too); float weights are never folded
        if not all(name in derived or _integer(known[name]) for name in inputs):
            continue
        try:
            single = onnx.helper.make_graph(
                [node],
                "fold",
                [onnx.helper.make_tensor_value_info(n, _elem(known[n]), list(known[n].shape)) for n in inputs],
                [onnx.helper.make_value_info(n, onnx.TypeProto()) for n in node.output if n],
            )
            values = ReferenceEvaluator(onnx.helper.make_model(single, opset_imports=opsets)).run(
                None, {n: known[n] for n in inputs}
            )
        except Exception as exc:  # noqa: BLE001 - an op the evaluator cannot run: left to the runtime
            del exc
            continue
        outputs = [n for n in node.output if n]
        if any(np.asarray(v).size > MAX_FOLDED for v in values):
            continue
        for name, value in zip(outputs, values, strict=False):
            known[name] = np.asarray(value)
            derived.add(name)
        folded.append(index)
    if not folded:
        return 0, waiting
    read = {name for i, node in enumerate(graph.node) if i not in set(folded) for name in node.input}
    read |= {o.name for o in graph.output}
    existing = {t.name for t in graph.initializer}
    folded_set = set(folded)
    for index in folded:
        for name in graph.node[index].output:
            if name and name in read and name not in existing:
                graph.initializer.append(numpy_helper.from_array(known[name], name))
    keep = [node for i, node in enumerate(graph.node) if i not in folded_set]
    copies = []
    for node in keep:
        copy = onnx.NodeProto()
        copy.CopyFrom(node)
        copies.append(copy)
    graph.ClearField("node")
    graph.node.extend(copies)
    prepare.remove_dead(graph)
    return len(folded), waiting


def _integer(value: np.ndarray) -> bool:
    return value.dtype.kind in "iub" and value.size <= MAX_FOLDED


def _elem(value: np.ndarray) -> int:
    try:
        return onnx.helper.np_dtype_to_tensor_dtype(value.dtype)
    except Exception as exc:  # noqa: BLE001
        raise ModelError(f"cannot fold a shape computation of type {value.dtype}") from exc


def constant_value(node: onnx.NodeProto) -> np.ndarray | None:
    for attr in node.attribute:
        if attr.name == "value":
            return numpy_helper.to_array(attr.t)
        if attr.name == "value_int":
            return np.array(attr.i, np.int64)
        if attr.name == "value_ints":
            return np.array(list(attr.ints), np.int64)
        if attr.name == "value_float":
            return np.array(attr.f, np.float32)
        if attr.name == "value_floats":
            return np.array(list(attr.floats), np.float32)
    return None
