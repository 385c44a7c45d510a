"""Untying: every weight input of the model gets its own initializer before training.

Exporters deduplicate initializers with equal values: PyTorch's TorchScript exporter keeps one tensor and turns the
other names into Identity nodes (a fresh network's BN weights are all ones, its squeeze-excite conv biases all
zeros, so a Conv bias may read a BN's bias). Trained as found, one tensor would take the sum of every reader's
gradient and the other names would be missing from the trained state. Here each weight slot (the inputs of
``prepare.WEIGHT_POSITIONS``, BN's running statistics, the bias of an Add after a linear op) reads a tensor of its
own: an Identity output read by that slot alone becomes an initializer of that name (PyTorch names the Identity
outputs after the module's parameters: ``blocks.0.se.conv_expand.bias``), and a tensor several slots read (directly,
through Identity or through other shape-only ops) is copied for all of them but the last, which keeps the name.

A BN without affine parameters (PyTorch's ``affine=False``) has no weight to train: the exporters write its scale and
bias as constants, a Constant node (TorchScript) or ``Constant -> CastLike -> Expand(Shape(x)[1:2])`` (dynamo), the
same through Identity. ``constant_bn_parameters`` evaluates each such value once (the channel count is static) into
one Constant node: the BN still normalizes in training mode and updates its running statistics, its scale and bias
stay constant (not parameters), as in PyTorch.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import onnx
from onnx import helper, numpy_helper

from bnfuse.errors import BnfuseError, ModelError
from bnfuse.passes.training import prepare
from bnfuse.passes.training.shapes import constant_value

STANDARD = ("", "ai.onnx")


@dataclass
class Untied:
    renamed: dict[str, str] = field(default_factory=dict)  # copy's new name -> the name its reader read
    untied: list[str] = field(default_factory=list)  # names of the tensors given their own copy of a shared value
    constant_bns: list[str] = field(default_factory=list)  # BN without affine parameters (constant scale / bias)


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
    result = Untied(constant_bns=constant_bn_parameters(model))
    initializers = {t.name: t for t in graph.initializer}
    outputs = {o.name for o in graph.output}
    uses: dict[str, int] = {}
    for node in graph.node:
        for position, name in enumerate(node.input):
            if not _type_only(node, position):  # the dynamo exporter's Shape(weight): no reader of its values
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
            if _is_bn(node) and position in (1, 2) and _constant(read, producers):
                continue  # an affine-free BN's scale / bias: a constant, not a parameter
            if _is_bn(node):
                role = ("scale", "bias", "mean", "var")[position - 1]
                hint = (
                    " (computed in the graph, as the dynamo exporter writes BatchNorm(track_running_stats=False): "
                    "no running statistics to update)"
                    if position > 2
                    else ""
                )
                raise BnfuseError(
                    f"BatchNormalization {node.name or node.output[0]!r}: {role} {read!r} is not an initializer; "
                    f"training needs its value{hint}"
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


def _type_only(node: onnx.NodeProto, position: int) -> bool:
    """Whether the node reads only the shape or element type of its input ``position`` (Shape; CastLike's target): it
    reads a trained weight as well as the original, and shares no values with it."""
    return node.domain in STANDARD and (node.op_type == "Shape" or (node.op_type == "CastLike" and position == 1))


def _constant(name: str, producers: dict[str, onnx.NodeProto]) -> bool:
    """Whether ``name`` is a Constant node's output (through shape-only ops)."""
    for _ in range(64):
        node = producers.get(name)
        if node is None or node.domain not in STANDARD:
            return False
        if node.op_type == "Constant":
            return True
        if node.op_type not in prepare.SHAPE_ONLY:
            return False
        name = node.input[0]
    return False


MAX_CONSTANT = 1 << 20  # elements: a BN's scale is one value a channel


def constant_bn_parameters(model: onnx.ModelProto) -> list[str]:
    """Turn every BN scale / bias computed from constants alone into one Constant node (in place): the nodes
    computing it are replaced (the chain left behind is removed by ``prepare.remove_dead``). A value reaching a
    float initializer is a parameter (left to untying), a graph input not a constant (left as it is). Returns the
    keys of the BN nodes with a constant scale or bias (the affine-free ones)."""
    graph = model.graph
    initializers = {t.name: t for t in graph.initializer}
    producers = prepare.producers_of(graph)
    inputs = {i.name for i in graph.input}
    keys: list[str] = []
    pending: list[tuple[onnx.NodeProto, int]] = []
    for node in graph.node:
        if not _is_bn(node) or len(node.input) < 3:
            continue
        for position in (1, 2):
            name = node.input[position]
            if _chain(name, producers, initializers)[1] is None and name not in inputs:
                pending.append((node, position))
    if not pending:
        return keys
    # a BN's input has rank >= 2 and its running mean's length channels: Shape(x)[1:2] even where shape inference
    # lost x's rank (the dynamo exporter's ReduceMean with computed axes, before shape computations fold)
    channels = {
        node.input[0]: int(initializers[node.input[3]].dims[0])
        for node in graph.node
        if _is_bn(node) and node.input[3] in initializers and len(initializers[node.input[3]].dims) == 1
    }
    values = _Evaluator(model, initializers, producers, channels)
    replaced: dict[str, onnx.NodeProto] = {}
    for node, position in pending:
        name = node.input[position]
        value = values.value(name)
        if value is None:
            continue  # computed from a parameter or an input: untying says what it is
        key = prepare.bn_key(node)
        if key not in keys:
            keys.append(key)
        producer = producers[name]
        if producer.op_type == "Constant" or name in replaced:
            continue
        replaced[name] = helper.make_node(
            "Constant", [], [name], name=f"{name}.constant", value=numpy_helper.from_array(value, name)
        )
    if replaced:
        nodes = []
        for node in graph.node:
            outputs = [o for o in node.output if o]
            nodes.append(replaced.pop(outputs[0]) if len(outputs) == 1 and outputs[0] in replaced else _copy(node))
        # a value that is one output of several: its own Constant, read under a new name
        renamed = {name: f"{name}.constant" for name in replaced}
        for name, constant in replaced.items():
            constant.output[0] = renamed[name]
            nodes.insert(0, constant)
        for node in nodes:
            if _is_bn(node):
                for position in (1, 2):
                    node.input[position] = renamed.get(node.input[position], node.input[position])
        graph.ClearField("node")
        graph.node.extend(nodes)
        prepare.remove_dead(graph)
    return keys


class _Evaluator:
    """Values computed from constants alone: Constant nodes, integer initializers, static dimensions (Shape) and
    element types (CastLike), through any standard op onnx's reference evaluator runs."""

    def __init__(
        self,
        model: onnx.ModelProto,
        initializers: dict[str, onnx.TensorProto],
        producers: dict[str, onnx.NodeProto],
        channels: dict[str, int] | None = None,
    ) -> None:
        self.model = model
        self.initializers = initializers
        self.producers = producers
        self.channels = channels or {}  # a BN input -> its channel count (dimension 1)
        self.known: dict[str, np.ndarray | None] = {}
        self._types: dict[str, tuple[tuple[int, ...] | None, int]] | None = None

    def types(self) -> dict[str, tuple[tuple[int, ...] | None, int]]:
        """name -> (dims, -1 where dynamic, None where the rank is unknown; element type), inferred once."""
        if self._types is None:
            try:
                inferred = onnx.shape_inference.infer_shapes(self.model, data_prop=True)
            except Exception:  # noqa: BLE001 - without shapes nothing Shape-based evaluates
                inferred = self.model
            self._types = {}
            for value in [*inferred.graph.input, *inferred.graph.value_info, *inferred.graph.output]:
                kind = value.type.tensor_type
                dims = tuple(d.dim_value if d.HasField("dim_value") else -1 for d in kind.shape.dim)
                self._types[value.name] = (dims if kind.HasField("shape") else None, kind.elem_type)
        return self._types

    def value(self, name: str, depth: int = 0) -> np.ndarray | None:
        if name not in self.known:
            self.known[name] = self._compute(name, depth) if depth < 64 else None
        return self.known[name]

    def _compute(self, name: str, depth: int) -> np.ndarray | None:
        tensor = self.initializers.get(name)
        if tensor is not None:
            array = numpy_helper.to_array(tensor)
            return array if array.dtype.kind in "iub" else None  # a float initializer is a parameter
        node = self.producers.get(name)
        if node is None or node.domain not in STANDARD:
            return None
        if node.op_type == "Constant":
            return constant_value(node)
        if node.op_type == "Shape":
            source = self.initializers.get(node.input[0])
            dims = tuple(source.dims) if source is not None else self.types().get(node.input[0], (None, 0))[0]
            attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
            channel = (attrs.get("start"), attrs.get("end")) == (1, 2) and node.input[0] in self.channels
            if channel:  # a BN input's channel dimension, however little inference knows of the rest (the rank
                # lost after a ReduceMean with computed axes; -1 after a Reshape to [N, -1, H, W], a channel shuffle)
                return np.array([self.channels[node.input[0]]], np.int64)
            if dims is None:  # rank unknown: no slice of it is known
                return None
            part = dims[slice(int(attrs.get("start", 0)), int(attrs.get("end", len(dims))))]
            return None if any(d < 0 for d in part) else np.array(part, np.int64)
        if node.op_type == "CastLike":  # only the element type of the second input is read
            source = self.value(node.input[0], depth + 1)
            target = self.types().get(node.input[1], ((), 0))[1]
            if node.input[1] in self.initializers:
                target = self.initializers[node.input[1]].data_type
            if source is None or not target:
                return None
            return source.astype(helper.tensor_dtype_to_np_dtype(target))
        inputs = [n for n in node.input if n]
        arrays = [self.value(n, depth + 1) for n in inputs]
        if not inputs or any(a is None for a in arrays):
            return None
        from onnx.reference import ReferenceEvaluator

        single = helper.make_graph(
            [node],
            "constant",
            [
                helper.make_tensor_value_info(n, helper.np_dtype_to_tensor_dtype(a.dtype), a.shape)
                for n, a in zip(inputs, arrays, strict=True)
            ],
            [helper.make_value_info(n, onnx.TypeProto()) for n in node.output if n],
        )
        try:
            results = ReferenceEvaluator(helper.make_model(single, opset_imports=list(self.model.opset_import))).run(
                None, dict(zip(inputs, arrays, strict=True))
            )
        except Exception:  # noqa: BLE001 - an op the evaluator cannot run: not a constant here
            return None
        outputs = [n for n in node.output if n]
        for output, result in zip(outputs, results, strict=False):
            array = np.asarray(result)
            self.known[output] = array if array.size <= MAX_CONSTANT else None
        return self.known.get(name)


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
    """The report's lines on BN without affine parameters and on untied tensors (none when there are none)."""
    notes = []
    if untied.constant_bns:
        keys = untied.constant_bns
        listed = ", ".join(keys[:4]) + (f", ... ({len(keys)} in all)" if len(keys) > 4 else "")
        notes.append(
            f"{len(keys)} BatchNormalization without affine parameters (scale / bias constants from the exporter): "
            f"normalized with batch statistics and running statistics updated, scale and bias not trained: {listed}"
        )
    if not untied.untied:
        return notes
    names = ", ".join(untied.untied[:6]) + (f", ... ({len(untied.untied)} in all)" if len(untied.untied) > 6 else "")
    return [
        *notes,
        f"untied {len(untied.untied)} weight tensors that several nodes shared (the exporter merges equal "
        f"initializers): each trains on its own: {names}",
    ]
