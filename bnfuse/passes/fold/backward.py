"""Backward folds: a per-channel map (a BN, or a trailing Mul / Add / Sub / Div by a constant) folded into the
Conv, ConvTranspose, Gemm or MatMul that produces its input (found by producers.py; through a Transpose, a
channel Concat, or a Slice / Split of one into the producers of the channels it keeps: layout.py)."""

from __future__ import annotations

import numpy as np
import onnx_graphsurgeon as gs

from bnfuse.passes.fold import fold_math
from bnfuse.passes.fold.bounds import require_backward_magnitudes
from bnfuse.passes.fold.context import (
    NotFoldable,
    Plan,
    added_elements,
    describe,
    is_default_domain,
    per_channel_vector,
    transpose_perm,
)
from bnfuse.passes.fold.fold_math import ChannelAffine
from bnfuse.passes.fold.layout import (
    concat_part_plan,
    concat_plan,
    producer_through,
    require_in_place,
    split_over_concat,
    transpose_before,
)
from bnfuse.passes.fold.producers import find_producer, fold_values
from bnfuse.passes.fold.surgery import GraphSurgery
from bnfuse.passes.report import AbsorbedOp


def trailing_op(surgery: GraphSurgery, node: gs.Node) -> None:
    """Absorb ``x <op> c`` (c a per-channel constant) into x's producer; silently keep it otherwise."""
    if len(node.inputs) != 2 or len(node.outputs) != 1:
        return
    values = [surgery.ctx.resolver.value(t) for t in node.inputs]
    if (values[0] is None) == (values[1] is None):
        return
    constant_first = values[0] is not None
    constant = values[0] if constant_first else values[1]
    data = node.inputs[1] if constant_first else node.inputs[0]
    transpose = transpose_before(data)
    source = data.inputs[0] if len(data.inputs) == 1 else None
    try:
        if source is not None and source.op == "Concat" and is_default_domain(source):
            _trailing_through_concat(surgery, node, data, source, constant, constant_first)
            return
        if transpose is not None:  # Conv -> Transpose -> Mul(c): the map's axis is where the channels went
            producer, axis = producer_through(surgery, transpose, data)
            rank = len(transpose_perm(transpose, producer.rank))
        else:
            producer, axis, rank = find_producer(surgery, data), 1, None
            if producer.kind == "MatMul" and producer.bias_node is None and node.op in ("Add", "Sub"):
                return  # MatMul + Add is already the canonical bias form
        vector = per_channel_vector(constant, rank or producer.rank, producer.channels, axis=axis)
        if vector is None:
            return
        affine = fold_math.constant_affine(node.op, vector, producer.channels, constant_first=constant_first)
        weight, bias = fold_values(surgery, producer, affine)
        if transpose is not None:
            require_in_place(producer, bias)
            surgery.write_in_place(producer, weight, bias)
            surgery.take_output(transpose, node, changed=[producer.output])
        else:
            surgery.write(producer, weight, bias, node)
    except (NotFoldable, ValueError):
        return
    surgery.ctx.absorbed.append(AbsorbedOp(describe(node), node.op, surgery.path, describe(producer.node)))


def _trailing_through_concat(
    surgery: GraphSurgery, node: gs.Node, data: gs.Tensor, concat: gs.Node, constant: np.ndarray, constant_first: bool
) -> None:
    """Concat -> ``x <op> c``, c per channel along the Concat's axis: cut per Concat input, each part folded into its
    producer, directly (axis 1) or through a Transpose (Keras 3's BN after a Concat arrives as such a Mul and Add;
    tf2onnx with its optimizers off leaves the Concat in NHWC). Raises NotFoldable / ValueError where it does not
    apply."""
    shape = surgery.ctx.types.shape(data)
    axis = int(concat.attrs.get("axis", 1))
    axis = axis + len(shape) if shape and axis < 0 else axis
    if not shape or len(shape) < 2 or not 0 < axis < len(shape) or not isinstance(shape[axis], int):
        raise NotFoldable(f"channels of '{data.name}' unknown")
    channels = shape[axis]
    vector = per_channel_vector(constant, len(shape), channels, axis=axis)
    if vector is None:
        raise NotFoldable(f"{describe(node)}'s constant is not per channel")
    affine = fold_math.constant_affine(node.op, vector, channels, constant_first=constant_first)
    plan = split_over_concat(surgery, node, data, concat, affine, None, channel_axis=axis)
    plan.apply()
    surgery.ctx.absorbed.append(AbsorbedOp(describe(node), node.op, surgery.path, plan.into))


def backward_plan(surgery: GraphSurgery, bn: gs.Node, affine: ChannelAffine) -> Plan:
    x = bn.inputs[0]
    source = x.inputs[0] if len(x.inputs) == 1 else None
    if source is not None and is_default_domain(source) and source.op == "Concat":
        return concat_plan(surgery, bn, source, affine)
    if source is not None and is_default_domain(source) and source.op in ("Slice", "Split") and source.inputs:
        joined = source.inputs[0]
        concat = joined.inputs[0] if len(joined.inputs) == 1 else None
        if concat is not None and is_default_domain(concat) and concat.op == "Concat":
            return concat_part_plan(surgery, bn, source, concat, affine)
    if source is not None and is_default_domain(source) and source.op == "Transpose":
        producer, axis = producer_through(surgery, source, x)
        if axis != 1:
            raise NotFoldable(f"{describe(source)} moves the producer's channels to axis {axis}")
        weight, bias = fold_values(surgery, producer, affine)
        require_in_place(producer, bias)
        require_backward_magnitudes(producer, affine, surgery.input_spread(bn), weight.dtype)

        def through_transpose() -> None:
            surgery.write_in_place(producer, weight, bias)
            surgery.take_output(source, bn, changed=[producer.output])

        into = f"{describe(producer.node)} (through {describe(source)})"
        return Plan("backward", into, added_elements(producer.bias, bias), through_transpose)
    producer = find_producer(surgery, x)
    weight, bias = fold_values(surgery, producer, affine)
    require_backward_magnitudes(producer, affine, surgery.input_spread(bn), weight.dtype)
    return Plan(
        "backward",
        describe(producer.node),
        added_elements(producer.bias, bias),
        lambda: surgery.write(producer, weight, bias, bn),
    )
