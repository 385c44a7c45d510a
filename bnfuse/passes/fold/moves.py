"""Folds that move a BN's map before it lands (issue 35): the BN peers leave.

- N-D MatMul: MatMul [+ bias Add] on [B, N, C] -> Flatten / Reshape to [B * N, C] -> BN (LeViT's BatchNorm1d on
  tokens): the channels stay the last axis through the reshapes, so the map folds into the MatMul's columns.
- Padded Conv: BN -> Conv(pads > 0) folded forward, with a constant per-position bias map added after the Conv
  for what the zero padding of the normalized input misses at the border (moves_math); static spatial
  sizes only, and only where the map costs less than the BN (one Add on the Conv's output against the BN's
  Mul + Add on its input).
- Pre-activation: BN -> Relu / LeakyRelu / PRelu -> (pools) -> Conv / Gemm / MatMul, every scale positive: the
  scale moves through the activation into every reader's weight, the shift stays as an Add (s / a) before it.

Each planner raises NotApplicable where its pattern is absent (the BN's reason then comes from the other
planners) and NotFoldable with the reason where the pattern is there but the fold is not exact.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import onnx_graphsurgeon as gs

from bnfuse.attributes import float_attribute
from bnfuse.passes.fold import fold_math, moves_math
from bnfuse.passes.fold.bounds import conv_border_effect, require_backward_magnitudes, require_magnitudes
from bnfuse.passes.fold.context import (
    FLOAT_DTYPES,
    LOW_PRECISION_DTYPES,
    NotApplicable,
    NotFoldable,
    Plan,
    Producer,
    added_elements,
    describe,
    has_input,
    is_default_domain,
)
from bnfuse.passes.fold.fold_math import ChannelAffine, NotRepresentableError
from bnfuse.passes.fold.producers import find_producer, fold_values
from bnfuse.passes.fold.surgery import GraphSurgery

Planner = Callable[[GraphSurgery, gs.Node, ChannelAffine], Plan]

# the border bias map must cost at most this many values per BN input value (the BN's Mul + Add: 2)
MAP_COST_LIMIT = 2.0
MAX_MAP_ELEMENTS = 1 << 22
_SCALE_PASSING = ("MaxPool", "AveragePool", "GlobalAveragePool", "GlobalMaxPool")


# ----- MatMul [B, N, C] -> Flatten / Reshape -> BN ------------------------------------------


def _matmul_nd_plan(surgery: GraphSurgery, bn: gs.Node, affine: ChannelAffine) -> Plan:
    x = bn.inputs[0]
    chain: list[gs.Node] = []  # the reshapes, the BN's side first
    tensor = x
    while len(tensor.inputs) == 1 and tensor.inputs[0].op in ("Flatten", "Reshape"):
        node = tensor.inputs[0]
        if not is_default_domain(node):
            break
        chain.append(node)
        tensor = node.inputs[0]
    source = tensor.inputs[0] if len(tensor.inputs) == 1 else None
    if not chain or source is None or source.op not in ("MatMul", "Add") or surgery.ctx.types.rank(x) != 2:
        raise NotApplicable("no MatMul -> Flatten / Reshape -> BN")
    producer = _nd_matmul(surgery, tensor)
    for node in chain:
        _require_values_private(surgery, node.outputs[0], node)
    channels = affine.channels
    for t in [tensor, *(n.outputs[0] for n in chain)]:
        shape = surgery.ctx.types.shape(t)
        if not shape or shape[-1] != channels:
            raise NotFoldable(f"'{t.name}' is not known to keep the {channels} channels as its last axis")
    weight, bias = fold_values(surgery, producer, affine)
    require_backward_magnitudes(producer, affine, surgery.input_spread(bn), weight.dtype)
    matmul = producer.node
    new_add = producer.bias_node is None and bias is not None
    if new_add and id(matmul) in surgery.replaced:
        raise NotFoldable(f"{describe(matmul)} was already rewritten")
    reshapes = ", ".join(describe(n) for n in reversed(chain))

    def apply() -> None:
        if new_add:
            surgery.set_constant(matmul, 1, weight)
            surgery.append_bias_add(matmul, bias)
        else:
            surgery.write_in_place(producer, weight, bias)
        surgery.take_output(chain[0], bn, changed=[tensor, *(n.outputs[0] for n in chain[1:])])

    into = f"{describe(matmul)} (through {reshapes})"
    return Plan("backward", into, added_elements(producer.bias, bias), apply)


def _nd_matmul(surgery: GraphSurgery, tensor: gs.Tensor) -> Producer:
    """MatMul by a constant 2-D weight (input of any rank), or its bias Add: channels are the last axis."""
    node = tensor.inputs[0]
    _require_values_private(surgery, tensor, node)
    bias_node, bias = None, None
    if node.op == "Add":
        values = [surgery.ctx.resolver.value(t) for t in node.inputs]
        constant = [i for i in (0, 1) if values[i] is not None]
        other = node.inputs[1 - constant[0]] if len(constant) == 1 else None
        if other is None or len(other.inputs) != 1 or other.inputs[0].op != "MatMul":
            raise NotApplicable("not a MatMul bias Add")
        bias_node, bias = node, values[constant[0]]
        columns = _columns(surgery, other.inputs[0])
        if np.dtype(bias.dtype) not in FLOAT_DTYPES or (bias.ndim and bias.shape[-1] not in (1, columns)):
            raise NotFoldable(f"bias of {describe(node)} is not a float constant along the last axis")
        node = other.inputs[0]
        _require_values_private(surgery, other, node)
    if node.op != "MatMul" or not is_default_domain(node):
        raise NotApplicable("not a MatMul")
    weight = surgery.float_constant(node, 1, "weight")
    if weight.ndim != 2:
        raise NotFoldable(f"MatMul {describe(node)} weight is {weight.ndim}-D, not 2-D")
    return Producer("MatMul", node, weight, bias, tensor, rank=2, bias_node=bias_node)


def _require_values_private(surgery: GraphSurgery, tensor: gs.Tensor, node: gs.Node) -> None:
    """surgery.require_private, where readers of the shape alone (Shape nodes of this graph: a reshape_as) may stay."""
    if id(node) not in surgery.own_nodes:
        raise NotFoldable(f"producer of '{tensor.name}' lives in an enclosing graph")
    if id(tensor) in surgery.outputs or id(tensor) in surgery.ctx.graph_outputs:
        raise NotFoldable(f"producer output '{tensor.name}' is a graph output")
    readers = [r for r in tensor.outputs if not (r.op == "Shape" and id(r) in surgery.own_nodes)]
    if len(readers) != 1:
        raise NotFoldable(f"producer output '{tensor.name}' has {len(readers)} consumers (besides Shape)")


def _columns(surgery: GraphSurgery, matmul: gs.Node) -> int | None:
    weight = surgery.ctx.resolver.value(matmul.inputs[1]) if len(matmul.inputs) > 1 else None
    return None if weight is None or weight.ndim != 2 else int(weight.shape[1])


# ----- Conv -> pool -> BN: the BN moved before the pool ----------------------------------------


def _pooled_plan(surgery: GraphSurgery, bn: gs.Node, affine: ChannelAffine) -> Plan:
    """BN(pool(y)) = pool(BN(y)) for a MaxPool with every scale > 0, an average pool whose windows average
    the shift back to itself (no padding counted), then folded backward into y's producer."""
    x = bn.inputs[0]
    pool = x.inputs[0] if len(x.inputs) == 1 else None
    if pool is None or pool.op not in _SCALE_PASSING or not is_default_domain(pool):
        raise NotApplicable("no pool before the BN")
    surgery.require_private(x, pool)
    label = f"{describe(pool)} ({pool.op})"
    if any(t.name and (t.outputs or id(t) in surgery.ctx.graph_outputs) for t in pool.outputs[1:]):
        raise NotFoldable(f"{label}: its indices are read")
    if pool.op in ("MaxPool", "GlobalMaxPool") and not np.all(affine.scale > 0):
        raise NotFoldable(f"{label}: a max commutes only with a positive scale")
    if pool.op == "AveragePool" and affine.shift.any() and int(pool.attrs.get("count_include_pad", 0)):
        auto_pad = pool.attrs.get("auto_pad", "NOTSET")
        auto_pad = auto_pad.decode() if isinstance(auto_pad, bytes) else auto_pad
        padded = any(int(p) for p in pool.attrs.get("pads", [])) or auto_pad not in ("NOTSET", "VALID")
        if padded or int(pool.attrs.get("ceil_mode", 0)):
            raise NotFoldable(f"{label}: its windows count padded zeros, which would average the shift down")
    producer = find_producer(surgery, pool.inputs[0])
    weight, bias = fold_values(surgery, producer, affine)
    if producer.kind == "MatMul" and producer.bias_node is None and bias is not None:
        raise NotFoldable(f"{describe(producer.node)} would need a new bias node behind {label}")
    require_backward_magnitudes(producer, affine, surgery.input_spread(bn), weight.dtype)

    def apply() -> None:
        surgery.write_in_place(producer, weight, bias)
        surgery.take_output(pool, bn, changed=[producer.output])

    into = f"{describe(producer.node)} (moved before {label})"
    return Plan("backward", into, added_elements(producer.bias, bias), apply)


# ----- BN -> padded Conv, with a border bias map --------------------------------------------


def _padded_forward_plan(surgery: GraphSurgery, bn: gs.Node, affine: ChannelAffine) -> Plan:
    x, y = bn.inputs[0], bn.outputs[0]
    conv = y.outputs[0] if len(y.outputs) == 1 else None
    if conv is None or conv.op != "Conv" or not is_default_domain(conv) or not affine.shift.any():
        raise NotApplicable("no BN -> Conv with a shift")
    if id(y) in surgery.outputs or id(y) in surgery.ctx.graph_outputs or id(conv) not in surgery.own_nodes:
        raise NotApplicable("the BN output is visible elsewhere")
    if conv.inputs[0] is not y or any(t is y for t in conv.inputs[1:]):
        raise NotApplicable("the BN output is not only the Conv's data input")
    weight = surgery.float_constant(conv, 1, "weight")
    if conv_border_effect(conv, weight) is None:
        raise NotApplicable("no padding (the plain forward fold applies)")
    where = f"{describe(conv)} pads its input"
    shape = surgery.ctx.types.shape(x) or surgery.ctx.types.shape(y)
    rank = weight.ndim
    if shape is None or len(shape) != rank or any(not isinstance(d, int) for d in shape[2:]):
        raise NotFoldable(f"{where} and the spatial shape of '{x.name}' is not static: no border bias map")
    spatial = [int(d) for d in shape[2:]]
    pads, strides, dilations = _conv_geometry(conv, weight, spatial)
    group = int(conv.attrs.get("group", 1))
    outputs = [
        moves_math.conv_output_size(n, k, s, d, pads[i], pads[i + rank - 2])
        for i, (n, k, s, d) in enumerate(zip(spatial, weight.shape[2:], strides, dilations, strict=True))
    ]
    map_size = int(weight.shape[0]) * int(np.prod(outputs))
    bn_size = affine.channels * int(np.prod(spatial))
    if map_size > MAP_COST_LIMIT * bn_size or map_size > MAX_MAP_ELEMENTS:
        raise NotFoldable(
            f"{where}: its border bias map ({map_size} values) would cost more than the BN ({bn_size} inputs)"
        )
    out = conv.outputs[0]
    if any(r.op == "BatchNormalization" for r in out.outputs) or id(conv) in surgery.replaced:
        raise NotFoldable(f"{where} and a BN after it folds into it (a border map would stand between)")
    dtype = np.dtype(weight.dtype)
    exact_w = surgery.exact(conv.inputs[1], weight, dtype)
    bias = surgery.float_constant(conv, 2, "bias") if has_input(conv, 2) else None
    exact_b = None if bias is None else surgery.exact(conv.inputs[2], bias, dtype)
    try:
        new_w, new_b = fold_math.forward_conv(exact_w, exact_b, affine, group)
        correction = moves_math.padded_conv_correction(exact_w, affine.shift, group, spatial, pads, strides, dilations)
        new_w, new_b = surgery.rounded(new_w, dtype), surgery.rounded(new_b, dtype)
        border = surgery.rounded(correction.reshape((1, *correction.shape)), dtype)
        weight_abs = fold_math.conv_weight_abs(weight, group, transposed=False)
        require_magnitudes(
            fold_math.forward_magnitudes(weight_abs, affine, surgery.input_spread(bn), new_b), new_w.dtype
        )
    except NotRepresentableError as exc:
        raise NotFoldable(f"{where}: {exc}") from exc
    except ValueError as exc:
        raise NotFoldable(f"cannot fold into {describe(conv)}: {exc}") from exc

    def apply() -> None:
        surgery.ctx.superseded[y.name] = out.name
        surgery.retire(bn, [])
        conv.inputs[0] = x
        surgery.set_constant(conv, 1, new_w)
        if new_b is not None:
            surgery.set_constant(conv, 2, new_b)
        surgery.append_bias_add(conv, border)

    added = map_size + (0 if bias is not None or new_b is None else int(new_b.size))
    return Plan("forward", f"{describe(conv)} (+ a {'x'.join(map(str, outputs))} border bias map)", added, apply)


def _conv_geometry(conv: gs.Node, weight: np.ndarray, spatial: list[int]) -> tuple[list[int], list[int], list[int]]:
    rank = len(spatial)
    strides = [int(s) for s in conv.attrs.get("strides", [1] * rank)]
    dilations = [int(d) for d in conv.attrs.get("dilations", [1] * rank)]
    auto_pad = conv.attrs.get("auto_pad", "NOTSET")
    auto_pad = auto_pad.decode() if isinstance(auto_pad, bytes) else auto_pad
    if auto_pad in ("SAME_UPPER", "SAME_LOWER"):
        pairs = [
            moves_math.same_pads(n, int(k), s, d, auto_pad == "SAME_UPPER")
            for n, k, s, d in zip(spatial, weight.shape[2:], strides, dilations, strict=True)
        ]
        return [p[0] for p in pairs] + [p[1] for p in pairs], strides, dilations
    return [int(p) for p in conv.attrs.get("pads", [0] * 2 * rank)], strides, dilations


# ----- BN -> Relu-like -> (pools) -> Conv / Gemm / MatMul -----------------------------------


def _preactivation_plan(surgery: GraphSurgery, bn: gs.Node, affine: ChannelAffine) -> Plan:
    x, y = bn.inputs[0], bn.outputs[0]
    act = y.outputs[0] if len(y.outputs) == 1 else None
    if act is None or act.op not in moves_math.SCALE_COMMUTING or not is_default_domain(act):
        raise NotApplicable("no BN -> Relu-like activation")
    if id(y) in surgery.outputs or id(y) in surgery.ctx.graph_outputs or act.inputs[0] is not y:
        raise NotApplicable("the BN output is visible elsewhere")
    label = f"through {describe(act)} ({act.op})"
    rank = surgery.ctx.types.rank(x)
    dtype = surgery.ctx.types.dtype(x) or surgery.ctx.types.dtype(y)
    if rank is None or rank < 2 or dtype is None or dtype not in FLOAT_DTYPES:
        raise NotFoldable(f"{label}: rank or float dtype of '{x.name}' unknown")
    if dtype in LOW_PRECISION_DTYPES:  # measured: densenet121 in float16, 1.8x the error of the unmoved model
        raise NotFoldable(
            f"{label}: in {dtype} the move rounds the readers' scaled weights and the shifted input once more "
            "each, more error than the BN it removes"
        )
    try:
        scale, inner = moves_math.split_through_activation(affine)
        shift = fold_math.rounded(inner.reshape((-1,) + (1,) * (rank - 2)), dtype)
    except (ValueError, NotRepresentableError) as exc:
        raise NotFoldable(f"{label}: {exc}") from exc
    moved: list[gs.Tensor] = []
    sinks = _scale_sinks(surgery, act.outputs[0], affine.channels, 1, label, moved)
    scaling = ChannelAffine(scale, np.zeros_like(scale))
    values = [_scaled_weight(surgery, node, scaling, inner_size, label) for node, inner_size in sinks]

    replacement = _sink_result(surgery, sinks[0][0])

    def apply() -> None:
        surgery.ctx.superseded[y.name] = replacement.name
        base = bn.name or y.name
        shifted = gs.Variable(surgery.ctx.fresh_name(f"{base}_shifted"), dtype=y.dtype, shape=y.shape)
        constant = gs.Constant(surgery.ctx.fresh_name(f"{base}_shift"), shift)
        surgery.ctx.written.add(constant.name)
        add = gs.Node("Add", surgery.ctx.fresh_name(f"{base}_shift_add"), inputs=[x, constant], outputs=[shifted])
        surgery.retire(bn, [add])
        act.inputs[0] = shifted
        for (node, _), weight in zip(sinks, values, strict=True):
            surgery.set_constant(node, 1, weight)
        # they now hold the values divided by the scale: renamed so no name means two things
        surgery.renamed.extend((t, "_unscaled") for t in moved)

    readers = ", ".join(describe(node) for node, _ in sinks)
    into = f"scale into {readers} {label}; shift kept as an Add before it"
    return Plan("moved", into, int(shift.size), apply)


def _scale_sinks(
    surgery: GraphSurgery, tensor: gs.Tensor, channels: int, inner: int, label: str, moved: list[gs.Tensor]
) -> list[tuple[gs.Node, int]]:
    """Every linear node that absorbs a positive per-channel scale on ``tensor`` (through pools / Flatten)."""
    if id(tensor) in surgery.outputs or id(tensor) in surgery.ctx.graph_outputs:
        raise NotFoldable(f"{label}: '{tensor.name}' is a graph output")
    if not tensor.outputs:
        raise NotFoldable(f"{label}: nothing reads '{tensor.name}'")
    moved.append(tensor)
    sinks: list[tuple[gs.Node, int]] = []
    for node in tensor.outputs:
        if id(node) not in surgery.own_nodes or not is_default_domain(node):
            raise NotFoldable(f"{label}: {describe(node)} ({node.op}) cannot absorb the scale")
        if node.inputs[0] is not tensor or any(t is tensor for t in node.inputs[1:]):
            raise NotFoldable(f"{label}: '{tensor.name}' is not only the data input of {describe(node)}")
        if node.op == "Conv" and inner == 1:
            sinks.append((node, 1))
        elif node.op in ("Gemm", "MatMul") and surgery.ctx.types.rank(tensor) == 2:
            sinks.append((node, inner))
        elif node.op in _SCALE_PASSING and inner == 1:
            if any(t.name and (t.outputs or id(t) in surgery.ctx.graph_outputs) for t in node.outputs[1:]):
                raise NotFoldable(f"{label}: {describe(node)}'s indices are read")
            sinks += _scale_sinks(surgery, node.outputs[0], channels, inner, label, moved)
        elif node.op == "Flatten" and inner == 1:
            shape = surgery.ctx.types.shape(tensor)
            axis = int(node.attrs.get("axis", 1))
            if not shape or (axis + len(shape) if axis < 0 else axis) != 1:
                raise NotFoldable(f"{label}: {describe(node)} does not flatten to (batch, features)")
            if any(not isinstance(d, int) for d in shape[2:]):
                raise NotFoldable(f"{label}: {describe(node)} flattens a symbolic spatial shape")
            sinks += _scale_sinks(surgery, node.outputs[0], channels, int(np.prod(shape[2:])), label, moved)
        else:
            raise NotFoldable(f"{label}: {describe(node)} ({node.op}) reads it and cannot absorb the scale")
    return sinks


def _sink_result(surgery: GraphSurgery, node: gs.Node) -> gs.Tensor:
    """The first tensor after ``node`` that a later fold into it supersedes: a MatMul's private bias Add's
    output (a BN folded into MatMul + Add rewrites the MatMul's own output in place, under its name)."""
    out = node.outputs[0]
    add = out.outputs[0] if node.op == "MatMul" and len(out.outputs) == 1 else None
    if add is not None and add.op == "Add" and len(add.inputs) == 2:
        other = add.inputs[1] if add.inputs[0] is out else add.inputs[0]
        if other is not out and surgery.ctx.resolver.value(other) is not None:
            return add.outputs[0]
    return out


def _scaled_weight(surgery: GraphSurgery, node: gs.Node, scaling: ChannelAffine, inner: int, label: str) -> np.ndarray:
    """The weight of ``node`` reading the scaled tensor (its bias unchanged: the map has no shift)."""
    weight = surgery.float_constant(node, 1, "weight" if node.op != "Gemm" else "B")
    dtype = np.dtype(weight.dtype)
    exact = surgery.exact(node.inputs[1], weight, dtype)
    try:
        if node.op == "Conv":
            new_w, _ = fold_math.forward_conv(exact, None, scaling, int(node.attrs.get("group", 1)))
        elif node.op == "Gemm":
            if int(node.attrs.get("transA", 0)):
                raise ValueError("it transposes its input (transA=1)")
            per_feature = fold_math.repeat_channels(scaling, inner)
            trans_b = bool(node.attrs.get("transB", 0))
            alpha, beta = float_attribute(node.attrs, "alpha", 1.0), float_attribute(node.attrs, "beta", 1.0)
            new_w, _ = fold_math.forward_gemm(exact, None, per_feature, trans_b=trans_b, alpha=alpha, beta=beta)
        else:
            if weight.ndim != 2:
                raise ValueError(f"weight is {weight.ndim}-D, not 2-D")
            new_w, _ = fold_math.forward_matmul(exact, None, fold_math.repeat_channels(scaling, inner))
        return surgery.rounded(new_w, dtype)
    except (ValueError, NotRepresentableError) as exc:
        raise NotFoldable(f"{label}: cannot scale {describe(node)}: {exc}") from exc


# (label, planner) in the order graph.py tries them
PLANNERS: list[tuple[str, Planner]] = [
    ("N-D MatMul", _matmul_nd_plan),
    ("padded Conv", _padded_forward_plan),
    ("pre-activation", _preactivation_plan),
    ("through the pool", _pooled_plan),
]
