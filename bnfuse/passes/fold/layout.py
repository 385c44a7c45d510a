"""Layout ops and Concat: no-op layout nodes bypassed, Transpose pairs cancelled, and backward folds through a
Transpose or a channel Concat (the map cut per input)."""

from __future__ import annotations

import numpy as np
import onnx_graphsurgeon as gs

from bnfuse.passes.fold import fold_math
from bnfuse.passes.fold.bounds import require_backward_magnitudes
from bnfuse.passes.fold.context import (
    NotFoldable,
    Plan,
    Producer,
    added_elements,
    describe,
    is_default_domain,
    transpose_perm,
)
from bnfuse.passes.fold.fold_math import ChannelAffine
from bnfuse.passes.fold.producers import find_producer, fold_values
from bnfuse.passes.fold.surgery import GraphSurgery


def remove_layout_noops(surgery: GraphSurgery) -> None:
    """Readers of an identity Transpose, an Identity or an inference Dropout read its input instead.

    They compute nothing, but a fold looks for its producer right before the BN: MatMul -> Transpose
    (perm 0, 1) -> BN would otherwise need a new bias node behind a layout op and stay unfolded.
    """
    for node in list(surgery.graph.nodes):
        if not is_default_domain(node) or len(node.inputs) < 1 or not node.outputs or not _is_noop(surgery, node):
            continue
        out, source = node.outputs[0], node.inputs[0]
        readers = list(out.outputs)
        if id(out) in surgery.outputs or id(out) in surgery.ctx.graph_outputs or not readers:
            continue
        if any(id(r) not in surgery.own_nodes for r in readers):
            continue  # a subgraph reads it by name: keep the name
        for reader in readers:
            for index, tensor in enumerate(reader.inputs):
                if tensor is out:
                    reader.inputs[index] = source
        surgery.retire(node, [])
        surgery.ctx.noops_removed += 1


def _is_noop(surgery: GraphSurgery, node: gs.Node) -> bool:
    if node.op == "Identity":
        return len(node.inputs) == 1 and len(node.outputs) == 1
    if node.op == "Transpose":
        perm = node.attrs.get("perm")
        return perm is not None and [int(p) for p in perm] == list(range(len(perm)))
    if node.op == "Dropout" and surgery.ctx.opset >= 7:
        try:
            surgery.require_inference_dropout(node)
        except NotFoldable:
            return False
        return True
    return False


# Elementwise ops of one tensor, the same on every element whatever the layout: a Transpose commutes with them
# (PRelu's slope and Clip's bounds broadcast against the data, so not in this list; Clip with scalar bounds is allowed
# by _commutes_with_transpose).
ELEMENTWISE_UNARY = frozenset(
    {
        "Relu", "LeakyRelu", "Elu", "Selu", "Celu", "ThresholdedRelu", "Sigmoid", "HardSigmoid", "HardSwish",
        "Tanh", "Softplus", "Softsign", "Mish", "Gelu", "Erf", "Abs", "Neg",
    }
)  # fmt: skip


def cancel_transpose_pairs(surgery: GraphSurgery) -> None:
    """Transpose(p) -> [elementwise ops] -> Transpose(q) composing to the identity: the elementwise ops read the
    first's input, and readers of the second read their result (or, with no op between, the first's input).

    Exporters of NHWC models (tf2onnx with its optimizers off) wrap every NCHW op in such pairs, with the activations
    between them in NHWC (BN -> Transpose -> Relu -> Transpose -> Conv); once they are gone, Conv -> BN and
    BN -> Relu -> Conv are adjacent again. A Concat of Transpose(p) outputs read only by a Transpose(q) becomes a
    Concat of their inputs (Conv -> Concat -> BN, which splits into the Convs).
    """
    for second in list(surgery.graph.nodes):
        if second.op != "Transpose" or not is_default_domain(second) or not second.inputs:
            continue
        if _cancel_around_concat(surgery, second):
            continue
        between = _elementwise_chain(surgery, second.inputs[0])
        middle = between[0].inputs[0] if between else second.inputs[0]
        first = middle.inputs[0] if len(middle.inputs) == 1 else None
        if (
            first is None
            or first.op != "Transpose"
            or not is_default_domain(first)
            or id(first) not in surgery.own_nodes
        ):
            continue
        q = second.attrs.get("perm")
        p = first.attrs.get("perm")
        rank = len(p) if p is not None else len(q) if q is not None else surgery.ctx.types.rank(middle)
        if rank is None:
            continue
        p, q = transpose_perm(first, rank), transpose_perm(second, rank)
        if len(p) != len(q) or [p[axis] for axis in q] != list(range(len(q))):
            continue
        out, source = second.outputs[0], first.inputs[0]
        readers = list(out.outputs)
        if id(out) in surgery.outputs or id(out) in surgery.ctx.graph_outputs:
            continue
        if any(id(r) not in surgery.own_nodes for r in readers):
            continue
        result = between[-1].outputs[0] if between else source
        if between:
            _relayout(surgery, between, source)
        for reader in readers:
            for index, tensor in enumerate(reader.inputs):
                if tensor is out:
                    reader.inputs[index] = result
        surgery.retire(second, [])
        if not middle.outputs and id(middle) not in surgery.outputs and id(middle) not in surgery.ctx.graph_outputs:
            surgery.retire(first, [])
        surgery.ctx.transposes_cancelled += 1


def _cancel_around_concat(surgery: GraphSurgery, second: gs.Node) -> bool:
    """Concat(axis a) of Transpose(p) outputs -> Transpose(q), p then q the identity: the Concat joins the
    Transposes' inputs along axis p[a] and its readers are the second's. False (nothing changed) where it does not
    apply."""
    joined = second.inputs[0]
    concat = joined.inputs[0] if len(joined.inputs) == 1 else None
    if concat is None or concat.op != "Concat" or not is_default_domain(concat) or id(concat) not in surgery.own_nodes:
        return False
    if len(joined.outputs) != 1 or id(joined) in surgery.outputs or id(joined) in surgery.ctx.graph_outputs:
        return False
    out = second.outputs[0]
    if id(out) in surgery.outputs or id(out) in surgery.ctx.graph_outputs:
        return False
    if any(id(r) not in surgery.own_nodes for r in out.outputs):
        return False
    firsts = [t.inputs[0] if len(t.inputs) == 1 else None for t in concat.inputs]
    if not firsts or any(
        f is None or f.op != "Transpose" or not is_default_domain(f) or id(f) not in surgery.own_nodes for f in firsts
    ):
        return False
    rank = surgery.ctx.types.rank(joined)
    if rank is None:
        return False
    q = transpose_perm(second, rank)
    perms = [transpose_perm(f, rank) for f in firsts]
    p = perms[0]
    if any(perm != p for perm in perms) or len(p) != rank or [p[axis] for axis in q] != list(range(rank)):
        return False
    axis = int(concat.attrs.get("axis", 0))
    concat.attrs["axis"] = p[axis + rank if axis < 0 else axis]
    sources = [f.inputs[0] for f in firsts]
    transposed = list(concat.inputs)
    concat.inputs.clear()
    concat.inputs.extend(sources)
    shape = surgery.ctx.types.shape(out)
    joined.name = surgery.ctx.fresh_name(f"{joined.name}_relayout")  # it now holds the other layout
    joined.shape = list(shape) if shape is not None else None
    readers = list(out.outputs)
    surgery.retire(second, [])
    for reader in readers:
        for index, tensor in enumerate(reader.inputs):
            if tensor is out:
                reader.inputs[index] = joined
    for first, tensor in zip(firsts, transposed, strict=True):
        if first.outputs and not tensor.outputs and id(tensor) not in surgery.outputs:
            if id(tensor) not in surgery.ctx.graph_outputs:
                surgery.retire(first, [])
    surgery.ctx.transposes_cancelled += 1
    return True


def _elementwise_chain(surgery: GraphSurgery, tensor: gs.Tensor) -> list[gs.Node]:
    """The elementwise ops that compute ``tensor`` from the nearest tensor before them (first op first), each
    output read only by the next op and visible nowhere else: what a Transpose before them can move past."""
    chain: list[gs.Node] = []
    while len(tensor.inputs) == 1:
        node = tensor.inputs[0]
        if not _commutes_with_transpose(surgery, node) or len(tensor.outputs) != 1:
            break
        if id(tensor) in surgery.outputs or id(tensor) in surgery.ctx.graph_outputs:
            break
        chain.insert(0, node)
        tensor = node.inputs[0]
    return chain


def _commutes_with_transpose(surgery: GraphSurgery, node: gs.Node) -> bool:
    if not is_default_domain(node) or id(node) not in surgery.own_nodes or len(node.outputs) != 1:
        return False
    data = node.inputs[0] if node.inputs else None
    if data is None or any(t is data for t in node.inputs[1:]):
        return False
    if node.op in ELEMENTWISE_UNARY:
        return len(node.inputs) == 1
    if node.op == "Clip":  # ReLU6: scalar bounds (inputs from opset 11, attributes before)
        bounds = [surgery.ctx.resolver.value(t) for t in node.inputs[1:] if t.name]
        return all(b is not None and b.size == 1 for b in bounds)
    return False


def _relayout(surgery: GraphSurgery, between: list[gs.Node], source: gs.Tensor) -> None:
    """The elementwise ops read ``source`` (the first Transpose's input), so each output has its layout: renamed now,
    before any fold or proof looks a tensor up by name, since each name meant the transposed layout."""
    between[0].inputs[0] = source
    shape = surgery.ctx.types.shape(source)
    for node in between:
        tensor = node.outputs[0]
        tensor.name = surgery.ctx.fresh_name(f"{tensor.name}_relayout")
        tensor.shape = list(shape) if shape is not None else None


# ----- through Transpose / Concat -----------------------------------------------------------


def concat_plan(surgery: GraphSurgery, bn: gs.Node, concat: gs.Node, affine: ChannelAffine) -> Plan:
    """BN after Concat along channels: cut the map per input and fold each part into its producer."""
    return split_over_concat(surgery, bn, bn.inputs[0], concat, affine, surgery.input_spread(bn))


def split_over_concat(
    surgery: GraphSurgery,
    node: gs.Node,
    x: gs.Tensor,
    concat: gs.Node,
    affine: ChannelAffine,
    spread: fold_math.InputSpread | None,
    *,
    channel_axis: int = 1,
) -> Plan:
    """The per-channel map of ``node`` (a BN, or a trailing Mul / Add / Sub / Div reading ``x``, the Concat's output)
    cut per Concat input and folded into each producer, directly or through a Transpose that puts its channels on
    ``channel_axis`` (Keras 3 / tf2onnx: Conv -> Transpose -> Concat(axis 3) -> Mul). ``spread``: the BN's input
    statistics, for the magnitude bounds (None for a trailing op, which backward.trailing_op folds without them)."""
    surgery.require_private(x, concat)
    rank = surgery.ctx.types.rank(x)
    axis = int(concat.attrs.get("axis", 1))
    if rank is None or (axis + rank if axis < 0 else axis) != channel_axis:
        raise NotFoldable(f"{describe(concat)} does not concatenate along the channel axis")
    producers, transposed = [], []
    for tensor in concat.inputs:
        transpose = transpose_before(tensor)
        if transpose is None:
            if channel_axis != 1:
                raise NotFoldable(f"'{tensor.name}' has no Transpose putting its channels on axis {channel_axis}")
            producers.append(find_producer(surgery, tensor))
            continue
        producer, moved_to = producer_through(surgery, transpose, tensor)
        if moved_to != channel_axis:
            raise NotFoldable(f"{describe(transpose)} moves the channels to axis {moved_to}, not {channel_axis}")
        producers.append(producer)
        transposed.append(tensor)
    try:
        parts = fold_math.split_channels(affine, [p.channels for p in producers])
    except ValueError as exc:
        raise NotFoldable(f"cannot split the map over {describe(concat)}: {exc}") from exc
    folded = [fold_values(surgery, p, part) for p, part in zip(producers, parts, strict=True)]
    spreads = spread.split([p.channels for p in producers]) if spread is not None else [None] * len(producers)
    for producer, part, part_spread, (weight, bias) in zip(producers, parts, spreads, folded, strict=True):
        require_in_place(producer, bias)
        if part_spread is not None:
            require_backward_magnitudes(producer, part, part_spread, weight.dtype)

    def split() -> None:
        for producer, (weight, bias) in zip(producers, folded, strict=True):
            surgery.write_in_place(producer, weight, bias)
        # the Transposes' outputs now hold the folded values too: renamed with the producers' outputs
        surgery.take_output(concat, node, changed=[p.output for p in producers] + transposed)

    added = sum(added_elements(p.bias, b) for p, (_, b) in zip(producers, folded, strict=True))
    into = f"{describe(concat)} inputs ({', '.join(describe(p.node) for p in producers)})"
    return Plan("backward", into, added, split)


def concat_part_plan(surgery: GraphSurgery, bn: gs.Node, part: gs.Node, concat: gs.Node, affine: ChannelAffine) -> Plan:
    """BN after a Slice / Split of a channel Concat: fold into the producers of the channels it covers.

    Exact where those channels are whole inputs of the Concat and nothing else reads them: every other reader of
    the Concat is a Slice / Split keeping other channels. The covered producers then write the BN's values, the
    Slice / Split passes them on, and the rest of the Concat is unchanged.
    """
    x = bn.inputs[0]
    surgery.require_private(x, part)
    joined = concat.outputs[0]
    if id(joined) in surgery.outputs or id(joined) in surgery.ctx.graph_outputs:
        raise NotFoldable(f"'{joined.name}' ({describe(concat)}'s output) is a graph output")
    rank = surgery.ctx.types.rank(joined)
    axis = int(concat.attrs.get("axis", 1))
    if rank is None or (axis + rank if axis < 0 else axis) != 1:
        raise NotFoldable(f"{describe(concat)} does not concatenate along the channel axis")
    sizes = [_channels(surgery, t) for t in concat.inputs]
    channels = sum(sizes)
    try:
        begin, end = _channel_blocks(surgery, part, rank, channels)[part.outputs.index(x)]
        first, last = fold_math.concat_inputs_covering(sizes, begin, end)
    except ValueError as exc:
        raise NotFoldable(f"{describe(part)} of {describe(concat)}: {exc}") from exc
    for reader in joined.outputs:
        if id(reader) not in surgery.own_nodes or not is_default_domain(reader) or reader.op not in ("Slice", "Split"):
            raise NotFoldable(f"{describe(reader)} reads all of {describe(concat)} (only a Slice / Split may)")
        try:
            blocks = _channel_blocks(surgery, reader, rank, channels)
        except ValueError as exc:
            raise NotFoldable(f"{describe(reader)} of {describe(concat)}: {exc}") from exc
        for index, (start, stop) in enumerate(blocks):
            if (reader is not part or reader.outputs[index] is not x) and start < end and begin < stop:
                raise NotFoldable(f"{describe(reader)} also reads channels {max(begin, start)}:{min(end, stop)}")
    producers = [find_producer(surgery, t) for t in concat.inputs[first:last]]
    parts = fold_math.split_channels(affine, [p.channels for p in producers])
    folded = [fold_values(surgery, p, block) for p, block in zip(producers, parts, strict=True)]
    spreads = surgery.input_spread(bn).split([p.channels for p in producers])
    for producer, block, spread, (weight, bias) in zip(producers, parts, spreads, folded, strict=True):
        require_in_place(producer, bias)
        require_backward_magnitudes(producer, block, spread, weight.dtype)

    def through_part() -> None:
        for producer, (weight, bias) in zip(producers, folded, strict=True):
            surgery.write_in_place(producer, weight, bias)
        changed = [p.output for p in producers] + [joined]
        surgery.take_output(part, bn, changed=changed, index=part.outputs.index(x))

    added = sum(added_elements(p.bias, b) for p, (_, b) in zip(producers, folded, strict=True))
    into = (
        f"{describe(concat)} inputs ({', '.join(describe(p.node) for p in producers)}; channels {begin}:{end} "
        f"of {channels}, through {describe(part)})"
    )
    return Plan("backward", into, added, through_part)


def _channels(surgery: GraphSurgery, tensor: gs.Tensor) -> int:
    shape = surgery.ctx.types.shape(tensor)
    if shape is None or len(shape) < 2 or not isinstance(shape[1], int):
        raise NotFoldable(f"the channel count of '{tensor.name}' is unknown")
    return int(shape[1])


def _channel_blocks(surgery: GraphSurgery, node: gs.Node, rank: int, channels: int) -> list[tuple[int, int]]:
    """The channel block [begin, end) each output of a Slice / Split along the channel axis keeps; ValueError
    where it is not such a block or its parameters are not constant."""
    value = surgery.ctx.resolver.value

    def ints(values: object) -> list[int] | None:
        return None if values is None else [int(v) for v in np.asarray(values).reshape(-1)]

    if node.op == "Slice":
        if len(node.inputs) >= 3:  # opset 10+: starts, ends, axes, steps as inputs
            given = [t if t.name else None for t in node.inputs[1:5]] + [None] * (5 - len(node.inputs))
            values = [None if t is None else value(t) for t in given]
            if any(t is not None and v is None for t, v in zip(given, values, strict=True)):
                raise ValueError("its starts, ends, axes or steps are not constant")
            starts, ends, axes, steps = (ints(v) for v in values)
        else:
            starts, ends = ints(node.attrs.get("starts")), ints(node.attrs.get("ends"))
            axes, steps = ints(node.attrs.get("axes")), None
        if starts is None or ends is None:
            raise ValueError("no starts or ends")
        return [fold_math.slice_channels(starts, ends, axes, steps, rank, channels)]
    axis = int(node.attrs.get("axis", 0))
    if (axis + rank if axis < 0 else axis) != 1:
        raise ValueError(f"it splits axis {axis}, not the channels")
    sizes = ints(node.attrs.get("split"))
    if len(node.inputs) > 1 and node.inputs[1].name:
        sizes = ints(value(node.inputs[1]))
        if sizes is None:
            raise ValueError("its split sizes are not constant")
    return fold_math.split_channels_ranges(sizes, len(node.outputs), channels)


def transpose_before(tensor: gs.Tensor) -> gs.Node | None:
    node = tensor.inputs[0] if len(tensor.inputs) == 1 else None
    return node if node is not None and node.op == "Transpose" and is_default_domain(node) else None


def producer_through(surgery: GraphSurgery, transpose: gs.Node, tensor: gs.Tensor) -> tuple[Producer, int]:
    """The producer before ``transpose`` and the axis of ``tensor`` its channels (axis 1) went to."""
    surgery.require_private(tensor, transpose)
    producer = find_producer(surgery, transpose.inputs[0])
    perm = transpose_perm(transpose, producer.rank)
    if len(perm) != producer.rank or 1 not in perm:
        raise NotFoldable(f"{describe(transpose)} perm {perm} does not fit a rank-{producer.rank} producer")
    return producer, perm.index(1)


def require_in_place(producer: Producer, bias: np.ndarray | None) -> None:
    if producer.kind == "MatMul" and producer.bias_node is None and bias is not None:
        raise NotFoldable(f"{describe(producer.node)} would need a new bias node behind a layout op")
