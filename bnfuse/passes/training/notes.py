"""What a training graph leaves constant or out, and why: the build report's notes (nothing frozen silently)."""

from __future__ import annotations

import onnx
from onnx import TensorProto

from bnfuse.passes.training.prepare import SHAPE_ONLY, Selection, producers_of, resolve_initializer, weight_inputs


def frozen_notes(model: onnx.ModelProto, selection: Selection, trainable_given: bool) -> list[str]:
    """Weights of trainable ops that will not train, and per-channel scale-shifts on constants (a BN folded by
    the exporter, as Keras 3 writes it) that train as constants."""
    graph = model.graph
    initializers = {t.name: t for t in graph.initializer}
    producers = producers_of(graph)
    trained = set(selection.parameters)
    unmatched: list[str] = []
    not_float: list[str] = []
    computed: list[str] = []
    for node, position in weight_inputs(graph, producers):
        if node.op_type != "BatchNormalization":
            source = resolve_initializer(node.input[position], producers, initializers, SHAPE_ONLY)
            label = f"{node.op_type} {node.name or node.output[0]!r}"
            if source is None:
                producer = producers.get(node.input[position])
                if producer is not None and _reads_constants(producer, initializers):
                    computed.append(f"{label} (from {producer.op_type})")
            elif source not in trained and source not in selection.running_stats:
                if initializers[source].data_type not in (TensorProto.FLOAT, TensorProto.DOUBLE):
                    not_float.append(source)
                elif trainable_given:
                    unmatched.append(source)
    notes = []
    if computed:
        notes.append(
            f"{len(computed)} weights are computed from constants by other ops and stay constant: " + _some(computed)
        )
    if not_float:
        notes.append(f"{len(not_float)} weights are not float32 / float64 and stay constant: " + _some(not_float))
    if unmatched:
        notes.append(f"{len(unmatched)} weights not matched by --trainable stay constant: " + _some(unmatched))
    shifts = scale_shifts(graph, initializers)
    if shifts:
        notes.append(
            f"{shifts} per-channel Mul -> Add scale-shifts on constants (a BatchNormalization the exporter folded, "
            "as Keras 3 writes it) stay constant and are not trained as BN: its statistics are gone from the "
            "file; export the model with BatchNormalization kept to train it"
        )
    return notes


def eval_mode_note(keys: list[str]) -> list[str]:
    """The BN nodes frozen because the export left them in eval() inside a train() module."""
    if not keys:
        return []
    return [
        f"{len(keys)} BatchNormalization exported in eval() inside a train() module (training_mode 0 beside 1): "
        "frozen, as PyTorch trains them (running statistics, not updated): " + _some(keys)
    ]


def dropout_notes(model: onnx.ModelProto, trained: int, seed: int) -> list[str]:
    dropouts = sum(1 for n in model.graph.node if n.op_type == "Dropout")
    if trained:
        seeds = f"seed {seed}" if trained == 1 else f"seeds {seed}..{seed + trained - 1}"
        return [f"{trained} Dropout nodes drop in training ({seeds}; masks are onnxruntime's, not PyTorch's)"]
    if dropouts:
        return [f"{dropouts} Dropout nodes run as in inference (identity): training runs without dropout"]
    if model.producer_name == "pytorch":
        return ["no Dropout in the graph (PyTorch's eval-mode export removes it): training runs without dropout"]
    return []


def scale_shifts(graph: onnx.GraphProto, initializers: dict[str, onnx.TensorProto]) -> int:
    """Mul by a per-channel float constant whose only reader is an Add of a per-channel float constant."""
    readers: dict[str, list[onnx.NodeProto]] = {}
    for node in graph.node:
        for name in node.input:
            readers.setdefault(name, []).append(node)
    count = 0
    for node in graph.node:
        if node.op_type != "Mul" or not any(_per_channel(initializers.get(n)) for n in node.input):
            continue
        following = readers.get(node.output[0], [])
        if len(following) == 1 and following[0].op_type == "Add":
            add = following[0]
            if any(_per_channel(initializers.get(n)) for n in add.input if n != node.output[0]):
                count += 1
    return count


def _per_channel(tensor: onnx.TensorProto | None) -> bool:
    """A float constant shaped like BN parameters: one axis of size > 1 (C, [1, C, 1, 1], [1, 1, C])."""
    if tensor is None or tensor.data_type not in (TensorProto.FLOAT, TensorProto.FLOAT16, TensorProto.DOUBLE):
        return False
    sizes = [d for d in tensor.dims if d != 1]
    return len(sizes) == 1


def _reads_constants(node: onnx.NodeProto, initializers: dict[str, onnx.TensorProto]) -> bool:
    """Whether the node computes from constants only (DequantizeLinear of int8 weights, a Mul of two constants)."""
    names = [name for name in node.input if name]
    return bool(names) and all(name in initializers for name in names)


def _some(names: list[str], limit: int = 4) -> str:
    return ", ".join(names[:limit]) + (f", ... ({len(names) - limit} more)" if len(names) > limit else "")
