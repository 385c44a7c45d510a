"""Graph surgery: fold inference BatchNormalization and per-channel Mul / Add / Sub / Div into producers.

A producer is a Conv, ConvTranspose, Gemm, or MatMul by a constant 2-D weight (with an optional bias
Add) whose output has exactly one consumer and is not a graph output. The per-channel map is folded into
the producer's weight and bias (see fold_math); the producer then writes the consumer's output tensor,
so graph output names and downstream references stay as they were. Nodes are visited in topological
order, so chains (Conv -> BN -> Mul -> Add) fold completely.

What cannot fold is left alone with a reason, or (standalone="scale-shift") becomes Mul + Add.

This module decides, per BN, which exact fold to make among the plans of backward (into the producer), forward
(into the consumer), layout (through Transpose / Concat, layout no-ops), moves and qdq: functions over one
GraphSurgery (surgery.py) per graph, each module importing only those below it (producers.py finds the producer
of a map for backward, layout and moves); bounds holds the magnitude and padding bounds that refuse a fold,
context the shared state and records, fold_math the pure math.
"""

from __future__ import annotations

import numpy as np
import onnx_graphsurgeon as gs

from bnfuse.attributes import float_attribute
from bnfuse.errors import ModelError
from bnfuse.passes.fold import fold_math, moves
from bnfuse.passes.fold.backward import backward_plan, trailing_op
from bnfuse.passes.fold.context import (
    AFFINE_OPS,
    FLOAT_DTYPES,
    FoldContext,
    NotApplicable,
    NotFoldable,
    describe,
    is_default_domain,
)
from bnfuse.passes.fold.fold_math import ChannelAffine, InvalidStatisticsError, NotRepresentableError
from bnfuse.passes.fold.forward import forward_plan
from bnfuse.passes.fold.layout import cancel_transpose_pairs, remove_layout_noops
from bnfuse.passes.fold.qdq import qdq_plan
from bnfuse.passes.fold.scale_shift import scale_shift_nodes
from bnfuse.passes.fold.surgery import GraphSurgery

__all__ = ["fold_graph"]


def fold_graph(graph: gs.Graph, ctx: FoldContext, *, graph_path: str = "main") -> None:
    """Fold every foldable BatchNormalization and trailing per-channel op of one (sub)graph, in place."""
    surgery = GraphSurgery(graph, ctx, graph_path)
    remove_layout_noops(surgery)
    cancel_transpose_pairs(surgery)
    for node in list(graph.nodes):
        if id(node) in surgery.replaced or not is_default_domain(node):
            continue
        if node.op == "BatchNormalization":
            fold_batchnorm(surgery, node)
            if ctx.progress is not None:
                ctx.progress()
        elif node.op in AFFINE_OPS:
            trailing_op(surgery, node)
        surgery.forget_pending()
    surgery.commit()


def fold_batchnorm(surgery: GraphSurgery, bn: gs.Node) -> None:
    """Per BN, every exact plan (backward, forward, moved, quantized) is computed, the cheapest applied."""
    name = describe(bn)
    output = bn.outputs[0].name if bn.outputs else None
    surgery.current_reset = bool(bn.outputs) and bn.outputs[0].name in surgery.ctx.reset_from_training
    if surgery.ctx.opset < 9 and int(bn.attrs.get("spatial", 1)) == 0:
        _per_activation(surgery, bn, name, output)
        return
    try:
        affine = _batchnorm_affine(surgery, bn)
    except NotFoldable as why:
        surgery.record(name, "skipped", reason=str(why))
        return
    plans, reasons = [], []
    planners = [("", backward_plan), ("forward: ", forward_plan)]
    planners += [
        (f"{label}: ", planner)
        for label, planner in moves.PLANNERS
        if surgery.ctx.activation_moves or label != "pre-activation"
    ]
    for label, planner in [*planners, ("quantized: ", qdq_plan)]:
        try:
            plans.append(planner(surgery, bn, affine))
        except NotApplicable:
            continue  # its pattern is not there: nothing to report
        except NotFoldable as why:
            reasons.append(f"{label if reasons else ''}{why}")
    if plans:
        # Both directions are exact where planned; take the one adding the fewest values (a new bias),
        # the backward fold on a tie (see docs: "Which way a BN folds").
        plan = min(plans, key=lambda p: p.added_elements)
        plan.apply()
        surgery.record(name, "folded", into=plan.into, direction=plan.direction, output=output)
        return
    reason = "; ".join(reasons)
    if surgery.ctx.standalone == "scale-shift":
        try:
            _scale_shift(surgery, bn, affine)
            surgery.record(name, "converted", reason=f"not folded: {reason}", output=output)
            return
        except NotFoldable as why:
            reason = f"{reason}; not converted: {why}"
    surgery.record(name, "skipped", reason=reason)


def _batchnorm_affine(surgery: GraphSurgery, bn: gs.Node) -> ChannelAffine:
    if int(bn.attrs.get("training_mode", 0)) == 1:
        raise NotFoldable("training mode (training_mode=1)")
    if any(t.name for t in bn.outputs[1:]):
        raise NotFoldable("training mode (running statistics outputs requested)")
    params = surgery.constant_params(bn)
    if any(np.ndim(p) != 1 for p in params):  # onnxruntime refuses to run such a BN: keep it as written
        shapes = ", ".join(str(list(np.shape(p))) for p in params)
        raise NotFoldable(f"scale, bias, mean and variance must be 1-D [C] (shapes {shapes})")
    epsilon = float_attribute(bn.attrs, "epsilon", 1e-5)
    try:
        return fold_math.batchnorm_affine(*params, epsilon)
    except InvalidStatisticsError as exc:
        raise ModelError(f"BatchNormalization '{describe(bn)}': {exc}") from exc


def _per_activation(surgery: GraphSurgery, bn: gs.Node, name: str, output: str | None) -> None:
    """Legacy spatial=0: statistics per activation never fold into a producer; scale-shift keeps their shape."""
    reason = "legacy spatial=0 (per-activation statistics)"
    if surgery.ctx.standalone != "scale-shift":
        surgery.record(name, "skipped", reason=reason)
        return
    try:
        params = surgery.constant_params(bn)
        x, y = bn.inputs[0], bn.outputs[0]
        rank, dtype = surgery.ctx.types.rank(x), surgery.ctx.types.dtype(x) or surgery.ctx.types.dtype(y)
        if dtype is None or dtype not in FLOAT_DTYPES:
            raise NotFoldable(f"input dtype {dtype} is not a float type")
        if rank is None or params[0].ndim != rank - 1:
            raise NotFoldable(f"parameters of shape {params[0].shape} do not match an input of rank {rank}")
        try:
            mul_values, add_values = fold_math.per_activation_constants(
                *params, float_attribute(bn.attrs, "epsilon", 1e-5), dtype
            )
        except InvalidStatisticsError as exc:
            raise ModelError(f"BatchNormalization '{name}': {exc}") from exc
        except NotRepresentableError as exc:
            raise NotFoldable(str(exc)) from exc
    except NotFoldable as why:
        surgery.record(name, "skipped", reason=f"{reason}; not converted: {why}")
        return
    base, fresh = bn.name or y.name, surgery.ctx.fresh_name
    scaled = gs.Variable(fresh(f"{base}_scaled"), dtype=y.dtype or x.dtype, shape=y.shape or x.shape)
    mul = gs.Node(
        "Mul", fresh(f"{base}_mul"), inputs=[x, gs.Constant(fresh(f"{base}_scale"), mul_values)], outputs=[scaled]
    )
    add = gs.Node(
        "Add", fresh(f"{base}_add"), inputs=[scaled, gs.Constant(fresh(f"{base}_shift"), add_values)], outputs=[]
    )
    surgery.retire(bn, [mul, add])
    add.outputs.append(y)
    surgery.ctx.written.update(t.name for t in (*mul.inputs, *add.inputs) if isinstance(t, gs.Constant))
    surgery.record(name, "converted", reason=reason, output=output)


def _scale_shift(surgery: GraphSurgery, bn: gs.Node, affine: ChannelAffine) -> None:
    x, y = bn.inputs[0], bn.outputs[0]
    rank = surgery.ctx.types.rank(x)
    if rank is None:
        raise NotFoldable("input rank unknown")
    dtype = surgery.ctx.types.dtype(x) or surgery.ctx.types.dtype(y)
    if dtype is None or dtype not in FLOAT_DTYPES:
        raise NotFoldable(f"input dtype {dtype} is not a float type")
    try:
        mul, add = scale_shift_nodes(
            x, y, affine, rank=rank, dtype=dtype, base=bn.name or y.name, fresh_name=surgery.ctx.fresh_name
        )
    except NotRepresentableError as exc:
        raise NotFoldable(str(exc)) from exc
    surgery.retire(bn, [mul, add])
    add.outputs.append(y)
    surgery.ctx.written.update(t.name for t in (*mul.inputs, *add.inputs) if isinstance(t, gs.Constant))
