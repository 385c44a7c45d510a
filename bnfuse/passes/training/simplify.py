"""Clean-up of a built training graph: Expand nodes that copy a tensor onto its own shape become aliases, and so do
Reshapes that undo a chain of views (the seed axis onnx-ad adds and removes around every adjoint).

onnx-ad accumulates every parameter's gradient through ``Expand(Unsqueeze(g), shape(p) + [1])`` so a broadcast
contribution comes out full-sized; where ``g`` already has the parameter's shape (a Gemm's weight gradient, a
bias's reduced gradient, a BN's dScale) the Expand is a copy of the whole gradient every step. onnxruntime does
not remove it: its shape inference stops at bnfuse's custom ops. Here the shapes of those ops' outputs are
written in (they follow from their inputs), ONNX shape inference propagates them, and an Expand whose input is
statically its target shape is dropped (its consumers read the input). Nothing is dropped on a guess: an
unknown or symbolic shape keeps its Expand.
"""

from __future__ import annotations

from collections.abc import Iterable

import onnx
import onnx.defs
from onnx import helper, numpy_helper, shape_inference

from bnfuse.runtime import schema

Shape = tuple[int, ...]


def drop_copying_expands(model: onnx.ModelProto, keep: Iterable[str] = ()) -> int:
    """Remove the Expand nodes of ``model`` that copy their input onto its own shape, and the Reshapes that only
    undo Identity / Unsqueeze / Reshape views of a value of the target shape; returns how many. Graph outputs and
    the names in ``keep`` (values found by name later, such as the gradients a distributed rewrite all-reduces)
    stay produced."""
    graph = model.graph
    constants = {t.name: numpy_helper.to_array(t) for t in graph.initializer}
    shapes = _static_shapes(model)
    outputs = {o.name for o in graph.output} | set(keep)
    alias: dict[str, str] = {}
    kept = []
    producer = {name: node for node in graph.node for name in node.output}
    for node in graph.node:
        copying = node.op_type == "Expand" and len(node.input) == 2
        target = constants.get(node.input[1]) if copying or node.op_type == "Reshape" else None
        if target is not None and node.output[0] not in outputs:
            wanted = tuple(int(v) for v in target)
            source = node.input[0] if copying else _view_source(node.input[0], wanted, producer, shapes, alias)
            if source is not None and shapes.get(source) == wanted:
                alias[node.output[0]] = source
                continue
        kept.append(node)
    if not alias:
        return 0
    for node in kept:
        for index, name in enumerate(node.input):
            while name in alias:
                name = alias[name]
            node.input[index] = name
    graph.ClearField("node")
    graph.node.extend(_live(kept, outputs))
    return len(alias)


def _live(nodes: list[onnx.NodeProto], outputs: set[str]) -> list[onnx.NodeProto]:
    """``nodes`` without those whose outputs nothing reads any more (the views left behind by the aliasing)."""
    needed = set(outputs)
    live: list[onnx.NodeProto] = []
    for node in reversed(nodes):
        if any(name in needed for name in node.output if name):
            live.append(node)
            needed.update(name for name in node.input if name)
    return live[::-1]


def _view_source(
    name: str, wanted: Shape, producer: dict, shapes: dict[str, Shape], alias: dict[str, str]
) -> str | None:
    """The nearest value up a chain of view-only ops (Identity, Unsqueeze, Reshape: they keep the elements in
    order; and the Expands already dropped) from ``name`` whose static shape is ``wanted``: a Reshape of the
    chain to ``wanted`` is that value."""
    views = ("Identity", "Unsqueeze", "Reshape")
    while True:
        name = alias.get(name, name)
        if shapes.get(name) == wanted:
            return name
        node = producer.get(name)
        if node is None or node.op_type not in views or node.domain not in ("", "ai.onnx"):
            return None
        name = node.input[0]


def _static_shapes(model: onnx.ModelProto) -> dict[str, Shape]:
    """Fully static shapes of the graph's values, node by node in graph order: ONNX's inference for standard ops
    (constant inputs such as Reshape's shape given as data), the rules below for bnfuse's ops. One pass, however
    deep the chains of custom ops (a whole-graph inference per layer would be quadratic)."""
    graph = model.graph
    opsets = {o.domain or "": o.version for o in model.opset_import}
    constants = {t.name: t for t in graph.initializer}
    types: dict[str, onnx.TypeProto] = {v.name: v.type for v in graph.input}
    for tensor in graph.initializer:
        types[tensor.name] = helper.make_tensor_type_proto(tensor.data_type, list(tensor.dims))
    known = {name: shape for name, value in types.items() if (shape := _shape_of(value)) is not None}
    for node in graph.node:
        rule = _RULES.get((node.domain, node.op_type))
        if rule is not None:
            for name, shape in zip(node.output, rule(node, known), strict=False):
                if name and shape is not None:
                    known[name] = shape
                    types[name] = helper.make_tensor_type_proto(onnx.TensorProto.FLOAT, list(shape))
            continue
        if node.domain not in ("", "ai.onnx") or any(name and name not in types for name in node.input):
            continue
        try:
            schema = onnx.defs.get_schema(node.op_type, opsets.get("", 1), "")
            inferred = shape_inference.infer_node_outputs(
                schema,
                node,
                {name: types[name] for name in node.input if name},
                {name: constants[name] for name in node.input if name in constants},
                opset_imports=list(model.opset_import),
                ir_version=model.ir_version,
            )
        except Exception:  # noqa: BLE001 - an op ONNX cannot infer here: its outputs stay unknown
            continue
        for name, value in inferred.items():
            types[name] = value
            shape = _shape_of(value)
            if shape is not None:
                known[name] = shape
    return known


def _shape_of(value: onnx.TypeProto) -> Shape | None:
    tensor = value.tensor_type
    if not value.HasField("tensor_type") or not tensor.HasField("shape"):
        return None
    dims = [d.dim_value if d.HasField("dim_value") else None for d in tensor.shape.dim]
    return None if any(d is None for d in dims) else tuple(dims)  # type: ignore[return-value]


def _schema_outputs(node: onnx.NodeProto, known: dict[str, Shape]) -> list[Shape | None]:
    """bnfuse's ops' output shapes by the rules of their schema (runtime/schema.py)."""
    attributes = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    inputs = [known.get(name) if name else None for name in node.input]
    return schema.output_shapes(node.op_type, attributes, inputs)[: len(node.output)]


_RULES = {(schema.DOMAIN, op.name): _schema_outputs for op in (*schema.BN_OPS, *schema.CONV_OPS)}
