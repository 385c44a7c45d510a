"""Where each rewritten BatchNormalization is proven: the tensors the check exposes for it.

In context: the tensor that carries the BN's output in both models (``BatchNormRecord.replacement``, the
same name in both), exposed as an extra graph output.

Alone: the chain of nodes between the producer's data input and the compared tensor (Conv -> BN ->
trailing ops in the original; the folded Conv in the optimized model) is copied, under fresh names, to
read a new graph input that the check fills with seeded random data. The copies reference the same
weights by name, so no weight is duplicated. This measures the fold without the rounding of the folds
upstream, and it still measures something where the model washes the input out: onnx's light models
build every weight with ConstantOfShape (all 0.02), so each block maps its input towards one fixed point,
and a few dozen layers deep the input's influence is below float32 resolution: the BN's output is then
bit-identical on every random input, and comparing it cannot show a wrong weight.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import onnx
from onnx import helper

from bnfuse.passes.report import BatchNormRecord, FoldCheck, MergeRecord

LINEAR_OPS = ("Conv", "ConvTranspose", "Gemm", "MatMul")
_PREFIX = "bnfuse.isolated"


@dataclass
class FoldProbe:
    """One rewritten BN's check, with the record it proves and the producer's data input (``entry``)."""

    check: FoldCheck
    record: BatchNormRecord | MergeRecord
    entry: str | None = None


def plan(
    original: onnx.ModelProto, optimized: onnx.ModelProto, records: Sequence[BatchNormRecord | MergeRecord]
) -> list[FoldProbe]:
    """One FoldProbe per folded or converted BN and per branch merge; ``check.tensor`` is set where it can be
    exposed (a merge: the sum's output, alone from the branches' shared input)."""
    probes: list[FoldProbe] = []
    tensors: tuple[set[str], set[str]] | None = None
    producers: dict[str, onnx.NodeProto] | None = None
    for record in records:
        if record.status == "skipped":
            continue
        check = FoldCheck(record.node, record.graph, record.status, record.into, None, None)
        probe = FoldProbe(check, record)
        probes.append(probe)
        if record.graph != "main":
            check.note = f"inside {record.graph}: only the outputs cover it"
            continue
        if tensors is None or producers is None:
            tensors = (main_graph_tensors(original), main_graph_tensors(optimized))
            producers = {o: node for node in original.graph.node for o in node.output if o}
        tensor = record.replacement
        missing = [what for what, names in zip(("original", "optimized"), tensors, strict=True) if tensor not in names]
        if not tensor or missing:
            check.note = f"tensor '{tensor}' not found in the {' and '.join(missing)} model"
            continue
        check.tensor = tensor
        if tensor != record.output:
            check.note = f"'{record.output}' was folded further; its successor is compared"
        entry = _entry(record, producers)
        if entry is not None and all(entry in names for names in tensors):
            probe.entry = entry
    return probes


def main_graph_tensors(model: onnx.ModelProto) -> set[str]:
    graph = model.graph
    return {o for node in graph.node for o in node.output if o} | {i.name for i in graph.input}


def _entry(record: BatchNormRecord | MergeRecord, producers: dict[str, onnx.NodeProto]) -> str | None:
    """The tensor the rewritten chain starts from in the original: the producer's data input (a converted
    BN: its own input; a merge: the branches' shared input)."""
    if isinstance(record, MergeRecord):
        return record.input
    bn = producers.get(record.output or "")
    if bn is None or bn.op_type != "BatchNormalization" or not bn.input:
        return None
    if record.status == "converted":
        return bn.input[0]
    producer = producers.get(bn.input[0])
    if producer is None:
        return None
    if producer.op_type == "Add":  # MatMul + bias Add
        matmuls = [producers.get(i) for i in producer.input]
        producer = next((m for m in matmuls if m is not None and m.op_type == "MatMul"), None)
        if producer is None:
            return None
    return producer.input[0] if producer.op_type in LINEAR_OPS and producer.input else None


@dataclass
class Isolation:
    """Graph additions that compute each isolated chain in one model, and the names involved."""

    original: onnx.GraphProto
    optimized: onnx.GraphProto
    inputs: dict[str, tuple[tuple[int, ...], np.dtype]]  # fresh input -> shape, dtype
    outputs: list[str]  # one per isolated probe, in order
    isolated: list[FoldProbe]


def isolate(
    original: onnx.ModelProto,
    optimized: onnx.ModelProto,
    probes: Sequence[FoldProbe],
    entry_types: dict[str, tuple[tuple[int, ...], np.dtype]],
) -> Isolation:
    """Copies of each probe's chain (entry -> compared tensor) in both models, reading a fresh input."""
    additions = (onnx.GraphProto(), onnx.GraphProto())
    inputs: dict[str, tuple[tuple[int, ...], np.dtype]] = {}
    outputs: list[str] = []
    isolated: list[FoldProbe] = []
    taken = main_graph_tensors(original) | main_graph_tensors(optimized)
    base = _PREFIX
    while any(name.startswith(base) for name in taken):  # fresh names: a prefix no tensor name starts with
        base = "_" + base
    models = [(list(m.graph.node), _positions(m.graph)) for m in (original, optimized)]
    for index, probe in enumerate(probes):
        entry, tensor = probe.entry, probe.check.tensor
        if entry is None or tensor is None or entry not in entry_types:
            continue
        # Nodes are topologically sorted: a path from entry to tensor lies between their producers.
        chains = [
            path_nodes(nodes[positions.get(entry, -1) + 1 : positions.get(tensor, -1) + 1], entry, tensor)
            for nodes, positions in models
        ]
        if not all(chains):
            continue
        prefix = f"{base}{index}/"
        fresh = prefix + entry
        for addition, chain in zip(additions, chains, strict=True):
            addition.node.extend(_renamed(chain, prefix, entry, fresh))
        shape, dtype = entry_types[entry]
        for addition in additions:
            addition.input.append(
                helper.make_tensor_value_info(fresh, helper.np_dtype_to_tensor_dtype(dtype), list(shape))
            )
        inputs[fresh] = (shape, dtype)
        outputs.append(prefix + tensor)
        isolated.append(probe)
    return Isolation(additions[0], additions[1], inputs, outputs, isolated)


def _positions(graph: onnx.GraphProto) -> dict[str, int]:
    """Index of the node producing each tensor (main-graph nodes are topologically sorted)."""
    return {o: index for index, node in enumerate(graph.node) for o in node.output if o}


def path_nodes(nodes: Sequence[onnx.NodeProto], source: str, target: str) -> list[onnx.NodeProto]:
    """The nodes (topologically sorted) on a path from tensor ``source`` to tensor ``target``, or [] if none."""
    reached = {source}
    forward = []
    for node in nodes:
        if any(i in reached for i in node.input):
            forward.append(node)
            reached.update(o for o in node.output if o)
    if target not in reached:
        return []
    needed = {target}
    chain = []
    for node in reversed(forward):
        if any(o in needed for o in node.output):
            chain.append(node)
            needed.update(i for i in node.input if i in reached)
    return chain[::-1]


def _renamed(chain: Sequence[onnx.NodeProto], prefix: str, entry: str, fresh: str) -> list[onnx.NodeProto]:
    """Copies of ``chain`` reading ``fresh`` for ``entry`` and writing prefixed outputs; other inputs (weights,
    BN statistics, constants computed elsewhere in the graph) keep their names, so nothing is copied."""
    produced = {o for node in chain for o in node.output if o}
    copies = []
    for node in chain:
        copy = onnx.NodeProto()
        copy.CopyFrom(node)
        copy.name = prefix + node.name if node.name else ""
        for position, name in enumerate(copy.input):
            if name == entry:
                copy.input[position] = fresh
            elif name in produced:
                copy.input[position] = prefix + name
        for position, name in enumerate(copy.output):
            if name:
                copy.output[position] = prefix + name
        copies.append(copy)
    return copies
