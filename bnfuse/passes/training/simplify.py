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

import numpy as np
import onnx
import onnx.defs
from onnx import helper, numpy_helper, shape_inference

from bnfuse.runtime import schema

Shape = tuple[int, ...]


def drop_copying_expands(
    model: onnx.ModelProto, keep: Iterable[str] = (), shapes: dict[str, Shape] | None = None
) -> int:
    """Remove the Expand nodes of ``model`` that copy their input onto its own shape, and the Reshapes that only
    undo Identity / Unsqueeze / Reshape views of a value of the target shape; returns how many. Graph outputs and
    the names in ``keep`` (values found by name later, such as the gradients a distributed rewrite all-reduces)
    stay produced. ``shapes``: static_shapes(model), where the caller has them (they stay true after the call)."""
    graph = model.graph
    # Expand / Reshape targets are small int64 tensors; weights (placeholders while the pass builds) are never one
    constants = {t.name: numpy_helper.to_array(t) for t in graph.initializer if t.data_type == onnx.TensorProto.INT64}
    shapes = _static_shapes(model)[0] if shapes is None else shapes
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


def static_shapes(model: onnx.ModelProto) -> dict[str, Shape]:
    """The fully static shapes of ``model``'s values (bnfuse's ops by their schema's rules)."""
    return _static_shapes(model)[0]


def static_shapes_and_types(model: onnx.ModelProto) -> tuple[dict[str, Shape], dict[str, int]]:
    """static_shapes(model), and the ONNX element types of the values whose types it knows."""
    return _static_shapes(model)


class _Names:
    """Fresh value names for a graph's rewrites: a stem, with "_" appended until no value of the graph has it."""

    def __init__(self, graph: onnx.GraphProto) -> None:
        self.used = {name for node in graph.node for name in (*node.input, *node.output)}
        self.used |= {t.name for t in graph.initializer} | {v.name for v in graph.input}

    def fresh(self, stem: str) -> str:
        name = stem
        while name in self.used:
            name += "_"
        self.used.add(name)
        return name


_SCALAR_BROADCAST = {"Add", "Sub", "Mul", "Div"}
_REDUCTIONS = {"ReduceSum", "ReduceMean"}


def seed_axis_fast_paths(model: onnx.ModelProto, shapes: dict[str, Shape], element_types: dict[str, int]) -> int:
    """Steer onnxruntime's kernels off their per-element paths on tensors whose last axis is 1 (onnx-ad's seed axis,
    [N, C, H, W, 1]); returns how many nodes changed. Measured at 1 thread (loaded machine):

    - a binary elementwise node with a scalar operand (rank 0 or [1]) against such a tensor: [4, 144, 16, 16, 1] /
      [] 10.9 ms, / [1, 1, 1, 1, 1] 0.26 ms. The scalar is reshaped to the other operand's rank of ones.
    - ReduceSum / ReduceMean over axes that leave size-1 axes after them: [4, 1152, 2, 2, 1] over (2, 3) 2.2 ms,
      over (2, 3, 4) 0.04 ms. The trailing size-1 axes join the reduced ones (the same sums); with keepdims=0 a
      Reshape restores the output's shape.
    - a ReduceSum that is the column sums of a [rows, columns] view (a bias's or a LayerNorm's gradient over
      [batch, tokens, C, 1]): Gemm(ones[1, rows], view), [16, 16, 64, 1] over (0, 1, 3) 133 us, the Gemm 18 us.
      The row of ones takes the summed tensor's own element type (a sum the graph widens to float64 stays one).

    Only static shapes and known element types (``shapes``, ``element_types``: static_shapes_and_types(model)) and
    constant axes are read; anything else stays."""
    graph = model.graph
    constants = {t.name: numpy_helper.to_array(t) for t in graph.initializer if t.data_type == INT64}
    for node in graph.node:
        value = _constant_value(node) if node.op_type == "Constant" else None
        if value is not None and value.data_type == INT64:
            constants[node.output[0]] = numpy_helper.to_array(value)
    opset = {o.domain or "": o.version for o in model.opset_import}.get("", 1)
    nodes: list[onnx.NodeProto] = []
    reshaped: dict[tuple[str, int], str] = {}
    names = _Names(graph)
    changed = 0

    def constant(stem: str, values: list[int] | np.ndarray) -> str:
        name = names.fresh(stem)
        graph.initializer.append(numpy_helper.from_array(np.asarray(values, np.int64), name))
        return name

    for node in graph.node:
        if node.domain in ("", "ai.onnx") and node.op_type in _SCALAR_BROADCAST and len(node.input) == 2:
            a, b = (shapes.get(name) for name in node.input)
            for index, (mine, other) in enumerate(((a, b), (b, a))):
                if mine is None or other is None or len(other) < 2 or other[-1] != 1:
                    continue
                if len(mine) >= len(other) or any(d != 1 for d in mine):
                    continue
                key = (node.input[index], len(other))
                if key not in reshaped:
                    shape = constant(f"{node.input[index]}/rank{len(other)}/shape", [1] * len(other))
                    reshaped[key] = names.fresh(f"{node.input[index]}/rank{len(other)}")
                    nodes.append(helper.make_node("Reshape", [node.input[index], shape], [reshaped[key]]))
                node.input[index] = reshaped[key]
                changed += 1
                break
        elif (
            node.domain in ("", "ai.onnx")
            and node.op_type in _REDUCTIONS
            and opset >= 18
            and len(node.input) == 2
            and node.input[1] in constants
            and shapes.get(node.input[0]) is not None
        ):
            source = shapes[node.input[0]]
            rank = len(source)
            attributes = {a.name: helper.get_attribute_value(a) for a in node.attribute}
            axes = {int(a) % rank for a in constants[node.input[1]].reshape(-1)} if rank else set()
            if not axes:  # all axes, or none (noop_with_empty_axes): not a seed-axis case
                nodes.append(node)
                continue
            plan = _column_sums_plan(source, axes) if node.op_type == "ReduceSum" else None
            float_type = element_types.get(node.input[0])
            if plan is not None and node.output[0] in shapes and float_type in _GEMM_TYPES:
                rows, columns = plan
                flat, summed = names.fresh(f"{node.output[0]}/rows"), names.fresh(f"{node.output[0]}/column_sums")
                ones = names.fresh(f"{node.output[0]}/ones")
                row = np.ones((1, rows), helper.tensor_dtype_to_np_dtype(float_type))
                graph.initializer.append(numpy_helper.from_array(row, ones))
                view = constant(f"{flat}/shape", [rows, columns])
                nodes.append(helper.make_node("Reshape", [node.input[0], view], [flat]))
                nodes.append(helper.make_node("Gemm", [ones, flat], [summed]))
                target = constant(f"{node.output[0]}/shape", list(shapes[node.output[0]]))
                nodes.append(helper.make_node("Reshape", [summed, target], [node.output[0]]))
                changed += 1
                continue
            tail = set()
            for axis in range(rank - 1, max(axes), -1):
                if source[axis] != 1:
                    break
                tail.add(axis)
            keepdims = attributes.get("keepdims", 1)
            if tail and (keepdims or node.output[0] in shapes):
                node.input[1] = constant(f"{node.output[0]}/axes", sorted(axes | tail))
                changed += 1
                if not keepdims:  # the tail's axes dropped too: a Reshape gives the output its shape back
                    output, inner = node.output[0], names.fresh(f"{node.output[0]}/reduced")
                    node.output[0] = inner
                    nodes.append(node)
                    target = constant(f"{output}/shape", list(shapes[output]))
                    nodes.append(helper.make_node("Reshape", [inner, target], [output]))
                    continue
        nodes.append(node)
    if changed:
        graph.ClearField("node")
        graph.node.extend(nodes)
    return changed


# at fewer columns onnxruntime's ReduceSum is as fast as the Gemm (measured at 1 thread: [4, 8] 9 us either way;
# [16, 16, 64] 133 us against 18 us). The rows are not read: they hold the batch, and a graph built for one batch
# size must take the same nodes as one built for another (dynamic_batch: the same bits at every size)
COLUMN_SUMS_MIN_COLUMNS = 32
_GEMM_TYPES = (onnx.TensorProto.FLOAT, onnx.TensorProto.DOUBLE)  # onnxruntime's CPU Gemm


def _column_sums_plan(source: Shape, axes: set[int]) -> tuple[int, int] | None:
    """(rows, columns) where a ReduceSum over ``axes`` of a ``source``-shaped tensor is the column sums of its
    [rows, columns] view: the axes it keeps (of size > 1) are one contiguous run, every axis before it is summed or
    of size 1, every axis after it of size 1 (a bias's or a LayerNorm's gradient over [batch, tokens, C, 1])."""
    kept = [i for i, d in enumerate(source) if i not in axes and d != 1]
    if not kept or kept != list(range(kept[0], kept[-1] + 1)) or any(d != 1 for d in source[kept[-1] + 1 :]):
        return None
    rows = int(np.prod(source[: kept[0]], dtype=np.int64))
    columns = int(np.prod(source[kept[0] : kept[-1] + 1], dtype=np.int64))
    if columns < COLUMN_SUMS_MIN_COLUMNS:
        return None
    return rows, columns


def fast_transposes(model: onnx.ModelProto, shapes: dict[str, Shape]) -> int:
    """Rewrite Transposes that onnxruntime runs on its generic path (an index computation per element) as at most
    two that each move one axis (its fast path), on the tensor viewed without its size-1 axes and with the axes
    that stay together merged (Reshapes around: views, no copies); returns how many. Measured at 1 thread (quiet):
    [3, 1, 16, 4, 16, 16] perm (2, 3, 0, 4, 5, 1) (onnx-ad's attention adjoints) 245 -> 22 us, [16, 16, 4, 16, 1]
    perm (4, 0, 2, 3, 1) 87 -> 12 us; a Transpose that already moves one axis stays as it is."""
    graph = model.graph
    nodes: list[onnx.NodeProto] = []
    fresh = _Names(graph).fresh
    changed = 0

    for node in graph.node:
        shape = shapes.get(node.input[0]) if node.op_type == "Transpose" and node.domain in ("", "ai.onnx") else None
        out = shapes.get(node.output[0]) if shape is not None else None
        if out is None or len(shape) < 2:
            nodes.append(node)
            continue
        perm = [int(p) for p in next((helper.get_attribute_value(a) for a in node.attribute if a.name == "perm"), [])]
        perm = perm or list(range(len(shape)))[::-1]
        if moves_one_axis(perm):  # onnxruntime's fast path already
            nodes.append(node)
            continue
        steps = transpose_moves(shape, perm)
        if len(steps) > 2:
            nodes.append(node)
            continue
        current = node.input[0]
        for step_shape, step_perm in steps:
            view, moved = fresh(f"{node.output[0]}/view"), fresh(f"{node.output[0]}/moved")
            target = fresh(f"{view}/shape")
            graph.initializer.append(numpy_helper.from_array(np.array(step_shape, np.int64), target))
            nodes.append(helper.make_node("Reshape", [current, target], [view]))
            nodes.append(helper.make_node("Transpose", [view], [moved], perm=step_perm))
            current = moved
        target = fresh(f"{node.output[0]}/shape")
        graph.initializer.append(numpy_helper.from_array(np.array(out, np.int64), target))
        nodes.append(helper.make_node("Reshape", [current, target], [node.output[0]]))
        changed += 1
    if changed:
        graph.ClearField("node")
        graph.node.extend(nodes)
    return changed


def transpose_moves(shape: Shape, perm: list[int]) -> list[tuple[list[int], list[int]]]:
    """Steps (view shape, perm), each moving one axis, whose composition is Transpose(perm) of a ``shape`` tensor:
    the axes of size 1 dropped, the axes adjacent in both the input and the output merged into one, then the fewer
    of two orders of moves (filling the output from its last axis, or from its first); [] where what is left is no
    transposition at all (a view)."""
    kept = [a for a in range(len(shape)) if shape[a] != 1]
    position = {a: i for i, a in enumerate(kept)}
    groups: list[list[int]] = []  # runs of kept axes, in output order, that are consecutive in the input
    for p in (position[a] for a in perm if shape[a] != 1):
        if groups and groups[-1][-1] + 1 == p:
            groups[-1].append(p)
        else:
            groups.append([p])
    by_input = sorted(range(len(groups)), key=lambda g: groups[g][0])
    dims = [int(np.prod([shape[kept[p]] for p in groups[g]])) for g in by_input]
    target = [by_input.index(g) for g in range(len(groups))]  # the output's axes as input group indices
    return min(_one_axis_moves(dims, target, from_last=True), _one_axis_moves(dims, target, from_last=False), key=len)


def moves_one_axis(perm: list[int]) -> bool:
    """Whether ``perm`` moves one axis and keeps the others in their order (onnxruntime's fast Transpose path)."""
    return any([p for p in perm if p != a] == sorted(set(perm) - {a}) for a in perm)


def _one_axis_moves(dims: list[int], target: list[int], from_last: bool) -> list[tuple[list[int], list[int]]]:
    steps, current = [], list(range(len(dims)))
    for i in range(len(target) - 1, -1, -1) if from_last else range(len(target)):
        j = current.index(target[i])
        if j != i:
            rest = [k for k in range(len(current)) if k != j]
            perm = rest[:i] + [j] + rest[i:]
            steps.append(([dims[c] for c in current], perm))
            current = [current[k] for k in perm]
    return steps


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


def _static_shapes(model: onnx.ModelProto) -> tuple[dict[str, Shape], dict[str, int]]:
    """Fully static shapes of the graph's values, node by node in graph order: ONNX's inference for standard ops
    (constant inputs such as Reshape's shape given as data), the rules below for bnfuse's ops. One pass, however
    deep the chains of custom ops (a whole-graph inference per layer would be quadratic). The common view and
    elementwise ops on static shapes are computed here (``_fast_shape``: what ONNX's inference gives them, without
    its per-node round trip through protobuf); anything else, or anything unusual about them, goes to ONNX."""
    graph = model.graph
    opset = {o.domain or "": o.version for o in model.opset_import}.get("", 1)
    # values for ONNX's inference (shapes, axes); a weight's placeholder (weights.py) has none to give
    constants = {t.name: t for t in graph.initializer if t.data_location != onnx.TensorProto.EXTERNAL}
    int_constants = {t.name: numpy_helper.to_array(t) for t in constants.values() if t.data_type == INT64}
    types: dict[str, onnx.TypeProto] = {v.name: v.type for v in graph.input}
    known = {name: shape for name, value in types.items() if (shape := _shape_of(value)) is not None}
    elem = {name: value.tensor_type.elem_type for name, value in types.items() if value.HasField("tensor_type")}
    for tensor in graph.initializer:  # its TypeProto made only if ONNX's inference needs it (type_of)
        known[tensor.name], elem[tensor.name] = tuple(tensor.dims), tensor.data_type
        types.pop(tensor.name, None)
    schemas: dict[str, onnx.defs.OpSchema] = {}

    def type_of(name: str) -> onnx.TypeProto | None:
        if name not in types and name in known and name in elem:  # computed here: its TypeProto when ONNX needs it
            types[name] = helper.make_tensor_type_proto(elem[name], list(known[name]))
        return types.get(name)

    for node in graph.node:
        if node.op_type == "Constant" and node.domain in ("", "ai.onnx") and _constant_value(node) is not None:
            # the exporter's Constant nodes (a ReduceMean's axes): values ONNX's inference needs, as initializers'
            tensor = _constant_value(node)
            constants[node.output[0]] = tensor
            if tensor.data_type == INT64:
                int_constants[node.output[0]] = numpy_helper.to_array(tensor)
            known[node.output[0]], elem[node.output[0]] = tuple(tensor.dims), tensor.data_type
            types.pop(node.output[0], None)
            continue
        rule = _RULES.get((node.domain, node.op_type))
        if rule is not None:
            element_types = schema.output_element_types(node.op_type, [elem.get(name) for name in node.input])
            for name, shape, element_type in zip(node.output, rule(node, known), element_types, strict=False):
                if name and shape is not None and element_type is not None:
                    known[name], elem[name] = shape, element_type
                    types.pop(name, None)
            continue
        if node.domain not in ("", "ai.onnx"):
            continue
        fast = _fast_shape(node, known, elem, int_constants, opset)
        if fast is not None:
            known[node.output[0]], elem[node.output[0]] = fast
            continue
        inputs = {name: type_of(name) for name in node.input if name}
        if any(value is None for value in inputs.values()):
            continue
        try:
            op_schema = schemas.get(node.op_type) or schemas.setdefault(
                node.op_type, onnx.defs.get_schema(node.op_type, opset, "")
            )
            inferred = shape_inference.infer_node_outputs(
                op_schema,
                node,
                inputs,
                {name: constants[name] for name in node.input if name in constants},
                opset_imports=list(model.opset_import),
                ir_version=model.ir_version,
            )
        except Exception:  # noqa: BLE001 - an op ONNX cannot infer here: its outputs stay unknown
            continue
        for name, value in inferred.items():
            types[name] = value
            if value.HasField("tensor_type"):
                elem[name] = value.tensor_type.elem_type
            shape = _shape_of(value)
            if shape is not None:
                known[name] = shape
    return known, elem


INT64 = onnx.TensorProto.INT64


def _constant_value(node: onnx.NodeProto) -> onnx.TensorProto | None:
    """A Constant node's tensor (its ``value`` attribute), None for the other forms."""
    for attribute in node.attribute:
        if attribute.name == "value" and attribute.type == onnx.AttributeProto.TENSOR:
            return attribute.t
    return None


_SAME_SHAPE = {"Identity", "Relu", "Sigmoid", "Neg", "Exp", "Sqrt", "Reciprocal", "Tanh", "Abs"}
_BROADCAST = {"Add", "Sub", "Mul", "Div", "Sum", "Max", "Min"}


def _fast_shape(
    node: onnx.NodeProto,
    known: dict[str, Shape],
    elem: dict[str, int],
    constants: dict[str, np.ndarray],
    opset: int,
) -> tuple[Shape, int] | None:
    """(shape, element type) of a single-output view or elementwise node whose inputs are static, as ONNX's shape
    inference gives it; None where this does not know for sure (ONNX then decides)."""
    op = node.op_type
    if len(node.output) != 1 or not node.input or any(not n or n not in known or n not in elem for n in node.input):
        return None
    first = node.input[0]
    if op in _SAME_SHAPE and len(node.input) == 1 and not node.attribute:
        return known[first], elem[first]
    if op in _BROADCAST and not node.attribute and len({elem[n] for n in node.input}) == 1:
        if op not in ("Sum", "Max", "Min") and len(node.input) != 2:
            return None
        try:
            shape = np.broadcast_shapes(*(known[n] for n in node.input))
        except ValueError:
            return None
        return tuple(int(d) for d in shape), elem[first]
    if op == "Unsqueeze":
        if opset >= 13:
            axes = constants.get(node.input[1]) if len(node.input) == 2 and not node.attribute else None
        else:
            attributes = {a.name: a for a in node.attribute}
            axes = np.array(attributes["axes"].ints) if len(node.input) == 1 and list(attributes) == ["axes"] else None
        if axes is None or axes.ndim > 1:
            return None
        rank = len(known[first]) + axes.size
        normalized = sorted(int(a) + rank if a < 0 else int(a) for a in axes.reshape(-1))
        if len(set(normalized)) != len(normalized) or any(not 0 <= a < rank for a in normalized):
            return None
        dims = list(known[first])
        for axis in normalized:
            dims.insert(axis, 1)
        return tuple(dims), elem[first]
    if op == "Reshape" and opset >= 5 and len(node.input) == 2:
        target = constants.get(node.input[1])
        allowzero = {a.name: a.i for a in node.attribute}.get("allowzero", 0)
        if target is None or target.ndim != 1 or any(a.name != "allowzero" for a in node.attribute):
            return None
        source = known[first]
        dims = [int(d) for d in target]
        if not allowzero:
            if any(d == 0 and i >= len(source) for i, d in enumerate(dims)):
                return None
            dims = [source[i] if d == 0 else d for i, d in enumerate(dims)]
        if dims.count(-1) > 1 or any(d < -1 for d in dims):
            return None
        total = int(np.prod(source, dtype=np.int64))
        if -1 in dims:
            rest = int(np.prod([d for d in dims if d != -1], dtype=np.int64))
            if rest == 0 or total % rest:
                return None
            dims[dims.index(-1)] = total // rest
        if int(np.prod(dims, dtype=np.int64)) != total:
            return None
        return tuple(dims), elem[first]
    return None


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
