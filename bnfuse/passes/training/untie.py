"""Untying: every weight input of the model gets its own initializer before training.

Exporters deduplicate initializers with equal values: PyTorch's TorchScript exporter keeps one tensor and turns the
other names into Identity nodes (a fresh network's BN weights are all ones, its squeeze-excite conv biases all
zeros, so a Conv bias may read a BN's bias). Trained as found, one tensor would take the sum of every reader's
gradient and the other names would be missing from the trained state. Here each weight slot (the inputs of
``prepare.WEIGHT_POSITIONS``, BN's running statistics, the bias of an Add after a linear op) reads a tensor of its
own: an Identity output read by that slot alone becomes an initializer of that name (PyTorch names the Identity
outputs after the module's parameters: ``blocks.0.se.conv_expand.bias``), and a tensor several slots read (directly,
through Identity or through other shape-only ops) is copied for all of them but the last, which keeps the name.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import onnx

from bnfuse.errors import BnfuseError, ModelError
from bnfuse.passes.training import prepare

STANDARD = ("", "ai.onnx")


@dataclass
class Untied:
    renamed: dict[str, str] = field(default_factory=dict)  # copy's new name -> the name its reader read
    untied: list[str] = field(default_factory=list)  # names of the tensors given their own copy of a shared value


def _is_bn(node: onnx.NodeProto) -> bool:
    return node.op_type == "BatchNormalization" and node.domain in STANDARD


def _slots(graph: onnx.GraphProto) -> list[tuple[int, int]]:
    """(node index, input position) of every weight input and BN statistic, in graph order."""
    index_of = {tuple(node.output): i for i, node in enumerate(graph.node)}  # outputs name a node
    slots: set[tuple[int, int]] = set()
    for index, node in enumerate(graph.node):
        if _is_bn(node):
            if len(node.input) < 5:
                raise ModelError(f"BatchNormalization {node.name or node.output[0]!r} has fewer than 5 inputs")
            slots.update((index, p) for p in range(1, 5))
    for node, position in prepare.weight_inputs(graph, prepare.producers_of(graph)):
        slots.add((index_of[tuple(node.output)], position))
    return sorted(slots)


def untie_parameters(model: onnx.ModelProto) -> Untied:
    """Give every weight slot its own initializer (in place); see the module docstring."""
    graph = model.graph
    result = Untied()
    initializers = {t.name: t for t in graph.initializer}
    outputs = {o.name for o in graph.output}
    uses: dict[str, int] = {}
    for node in graph.node:
        for name in node.input:
            uses[name] = uses.get(name, 0) + 1
    slots = _slots(graph)
    producers = prepare.producers_of(graph)

    def release(name: str) -> None:
        """One reader of ``name`` fewer; a shape-only node nothing reads any more releases its own input."""
        uses[name] = uses.get(name, 0) - 1
        node = producers.get(name)
        if uses[name] <= 0 and node is not None and node.op_type in prepare.SHAPE_ONLY and name not in outputs:
            release(node.input[0])

    def copy_initializer(source: str, name: str) -> None:
        copy = onnx.TensorProto()
        copy.CopyFrom(initializers[source])
        copy.name = name
        graph.initializer.append(copy)
        initializers[name] = copy

    index_of = {out: i for i, node in enumerate(graph.node) for out in node.output if out}
    dropped: set[int] = set()
    # 1. an Identity output read by one slot alone becomes an initializer of that name (the Identity dropped)
    for index, position in slots:
        node = graph.node[index]
        name = node.input[position]
        identity = producers.get(name)
        if identity is None or identity.op_type != "Identity" or uses.get(name, 0) != 1 or name in outputs:
            continue
        source = prepare.resolve_initializer(name, producers, initializers)
        if source is None:
            continue
        shared = uses.get(source, 0) > 1 or _shared_chain(name, source, producers, uses)
        copy_initializer(source, name)
        dropped.add(index_of[name])
        del producers[name]  # the slot (its one reader) now reads the initializer
        release(identity.input[0])
        if shared:
            result.untied.append(name)
    # 2. what is still shared: a private copy for every reader but the last
    taken = set(initializers) | set(producers) | {i.name for i in graph.input}
    before: dict[int, list[onnx.NodeProto]] = {}
    for index, position in slots:
        node = graph.node[index]
        read = node.input[position]
        chain, source = _chain(read, producers, initializers)
        if source is None:
            if _is_bn(node):
                role = ("scale", "bias", "mean", "var")[position - 1]
                raise BnfuseError(
                    f"BatchNormalization {node.name or node.output[0]!r}: {role} {read!r} is not an initializer; "
                    "training needs its value"
                )
            continue  # an activation, or a weight computed by other ops: not a parameter
        path = [read] + [n.input[0] for n in chain]
        if all(uses.get(name, 0) == 1 and name not in outputs for name in path):
            continue  # its own tensor already
        identity_only = all(n.op_type == "Identity" for n in chain)
        stem = read if identity_only else source
        name, k = stem, 0
        while name in taken:
            k += 1
            name = f"{stem}.{k}"
        taken.add(name)
        copy_initializer(source, name)
        tail = name
        if not identity_only:  # a private copy of the Reshape / Transpose ... chain over the copied tensor
            for original in reversed(chain):
                clone = onnx.NodeProto()
                clone.CopyFrom(original)
                clone.input[0] = tail
                clone.output[0] = f"{original.output[0]}.{k}"
                clone.name = f"{original.name}.{k}" if original.name else ""
                before.setdefault(index, []).append(clone)
                tail = clone.output[0]
        node.input[position] = tail
        release(read)
        result.renamed[name] = stem
        result.untied.append(name)
    if before or dropped:  # chain copies go right before their reader
        nodes = [
            _copy(n)
            for index, node in enumerate(graph.node)
            for n in [*before.get(index, []), *([node] if index not in dropped else [])]
        ]
        graph.ClearField("node")
        graph.node.extend(nodes)
    prepare.remove_dead(graph)
    return result


def _chain(
    name: str, producers: dict[str, onnx.NodeProto], initializers: dict[str, onnx.TensorProto]
) -> tuple[list[onnx.NodeProto], str | None]:
    """The shape-only nodes from ``name`` up to an initializer (nearest first), and that initializer (or None)."""
    chain: list[onnx.NodeProto] = []
    while name not in initializers:
        node = producers.get(name)
        if node is None or node.op_type not in prepare.SHAPE_ONLY or node.domain not in STANDARD or len(chain) > 64:
            return chain, None
        chain.append(node)
        name = node.input[0]
    return chain, name


def _shared_chain(name: str, source: str, producers: dict[str, onnx.NodeProto], uses: dict[str, int]) -> bool:
    while name != source:
        node = producers[name]
        name = node.input[0]
        if name != source and uses.get(name, 0) > 1:
            return True
    return False


def _copy(node: onnx.NodeProto) -> onnx.NodeProto:
    copy = onnx.NodeProto()
    copy.CopyFrom(node)
    return copy


def note(untied: Untied) -> list[str]:
    """The report's line on untied tensors (none when nothing was shared)."""
    if not untied.untied:
        return []
    names = ", ".join(untied.untied[:6]) + (f", ... ({len(untied.untied)} in all)" if len(untied.untied) > 6 else "")
    return [
        f"untied {len(untied.untied)} weight tensors that several nodes shared (the exporter merges equal "
        f"initializers): each trains on its own: {names}"
    ]
