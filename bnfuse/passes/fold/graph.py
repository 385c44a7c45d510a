"""Graph surgery: fold inference BatchNormalization and per-channel Mul / Add / Sub / Div into producers.

A producer is a Conv, ConvTranspose, Gemm, or MatMul by a constant 2-D weight (with an optional bias
Add) whose output has exactly one consumer and is not a graph output. The per-channel map is folded into
the producer's weight and bias (see fold_math); the producer then writes the consumer's output tensor,
so graph output names and downstream references stay as they were. Nodes are visited in topological
order, so chains (Conv -> BN -> Mul -> Add) fold completely.

What cannot fold is left alone with a reason, or (standalone="scale-shift") becomes Mul + Add.

This module decides, per BN, which exact fold to make; the folds themselves are backward (into the
producer), forward (into the consumer), layout (through Transpose / Concat, layout no-ops), moves and qdq, on the
surgery base; bounds holds the magnitude and padding bounds that refuse a fold, context the
shared state and records, fold_math the pure math.
"""

from __future__ import annotations

import numpy as np
import onnx_graphsurgeon as gs

from bnfuse.attributes import float_attribute
from bnfuse.errors import ModelError
from bnfuse.passes.fold import fold_math
from bnfuse.passes.fold.backward import BackwardFolds
from bnfuse.passes.fold.context import (
    AFFINE_OPS,
    BN_PARAMS,
    EXACT_ELEMENTS,
    FLOAT_DTYPES,
    LOW_PRECISION_DTYPES,
    FoldContext,
    NotFoldable,
    Producer,
    TensorTypes,
    describe,
    is_default_domain,
    per_channel_vector,
)
from bnfuse.passes.fold.fold_math import ChannelAffine, InvalidStatisticsError, NotRepresentableError
from bnfuse.passes.fold.forward import ForwardFolds
from bnfuse.passes.fold.layout import LayoutFolds
from bnfuse.passes.fold.moves import MovedFolds, NotApplicable
from bnfuse.passes.fold.qdq import QuantizedFolds
from bnfuse.passes.fold.scale_shift import scale_shift_nodes

__all__ = [
    "AFFINE_OPS",
    "BN_PARAMS",
    "EXACT_ELEMENTS",
    "FLOAT_DTYPES",
    "LOW_PRECISION_DTYPES",
    "FoldContext",
    "NotFoldable",
    "Producer",
    "TensorTypes",
    "describe",
    "fold_graph",
    "is_default_domain",
    "per_channel_vector",
]


def fold_graph(graph: gs.Graph, ctx: FoldContext, *, graph_path: str = "main") -> None:
    """Fold every foldable BatchNormalization and trailing per-channel op of one (sub)graph, in place."""
    surgery = _Surgery(graph, ctx, graph_path)
    surgery.remove_layout_noops()
    surgery.cancel_transpose_pairs()
    for node in list(graph.nodes):
        if id(node) in surgery.replaced or not is_default_domain(node):
            continue
        if node.op == "BatchNormalization":
            surgery.batchnorm(node)
            if ctx.progress is not None:
                ctx.progress()
        elif node.op in AFFINE_OPS:
            surgery.trailing_op(node)
        surgery.forget_pending()
    surgery.commit()


class _Surgery(LayoutFolds, BackwardFolds, ForwardFolds, MovedFolds, QuantizedFolds):
    """One graph's folds: per BN, every exact plan (backward, forward) is computed, the cheapest is applied."""

    def batchnorm(self, bn: gs.Node) -> None:
        name = describe(bn)
        output = bn.outputs[0].name if bn.outputs else None
        self._current_reset = bool(bn.outputs) and bn.outputs[0].name in self.ctx.reset_from_training
        if self.ctx.opset < 9 and int(bn.attrs.get("spatial", 1)) == 0:
            self._per_activation(bn, name, output)
            return
        try:
            affine = self._batchnorm_affine(bn)
        except NotFoldable as why:
            self._record(name, "skipped", reason=str(why))
            return
        plans, reasons = [], []
        planners = [("", self._backward_plan), ("forward: ", self._forward_plan)]
        planners += [(f"{label}: ", planner) for label, planner in self._moved_planners()]
        for label, planner in [*planners, ("quantized: ", self._qdq_plan)]:
            try:
                plans.append(planner(bn, affine))
            except NotApplicable:
                continue  # its pattern is not there: nothing to report
            except NotFoldable as why:
                reasons.append(f"{label if reasons else ''}{why}")
        if plans:
            # Both directions are exact where planned; take the one adding the fewest values (a new bias),
            # the backward fold on a tie (see docs: "Which way a BN folds").
            plan = min(plans, key=lambda p: p.added_elements)
            plan.apply()
            self._record(name, "folded", into=plan.into, direction=plan.direction, output=output)
            return
        reason = "; ".join(reasons)
        if self.ctx.standalone == "scale-shift":
            try:
                self._scale_shift(bn, affine)
                self._record(name, "converted", reason=f"not folded: {reason}", output=output)
                return
            except NotFoldable as why:
                reason = f"{reason}; not converted: {why}"
        self._record(name, "skipped", reason=reason)

    def _batchnorm_affine(self, bn: gs.Node) -> ChannelAffine:
        if int(bn.attrs.get("training_mode", 0)) == 1:
            raise NotFoldable("training mode (training_mode=1)")
        if any(t.name for t in bn.outputs[1:]):
            raise NotFoldable("training mode (running statistics outputs requested)")
        params = self._constant_params(bn)
        if any(np.ndim(p) != 1 for p in params):  # onnxruntime refuses to run such a BN: keep it as written
            shapes = ", ".join(str(list(np.shape(p))) for p in params)
            raise NotFoldable(f"scale, bias, mean and variance must be 1-D [C] (shapes {shapes})")
        epsilon = float_attribute(bn.attrs, "epsilon", 1e-5)
        try:
            return fold_math.batchnorm_affine(*params, epsilon)
        except InvalidStatisticsError as exc:
            raise ModelError(f"BatchNormalization '{describe(bn)}': {exc}") from exc

    def _per_activation(self, bn: gs.Node, name: str, output: str | None) -> None:
        """Legacy spatial=0: statistics per activation never fold into a producer; scale-shift keeps their shape."""
        reason = "legacy spatial=0 (per-activation statistics)"
        if self.ctx.standalone != "scale-shift":
            self._record(name, "skipped", reason=reason)
            return
        try:
            params = self._constant_params(bn)
            x, y = bn.inputs[0], bn.outputs[0]
            rank, dtype = self.ctx.types.rank(x), self.ctx.types.dtype(x) or self.ctx.types.dtype(y)
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
            self._record(name, "skipped", reason=f"{reason}; not converted: {why}")
            return
        base, fresh = bn.name or y.name, self.ctx.fresh_name
        scaled = gs.Variable(fresh(f"{base}_scaled"), dtype=y.dtype or x.dtype, shape=y.shape or x.shape)
        mul = gs.Node(
            "Mul", fresh(f"{base}_mul"), inputs=[x, gs.Constant(fresh(f"{base}_scale"), mul_values)], outputs=[scaled]
        )
        add = gs.Node(
            "Add", fresh(f"{base}_add"), inputs=[scaled, gs.Constant(fresh(f"{base}_shift"), add_values)], outputs=[]
        )
        self._retire(bn, [mul, add])
        add.outputs.append(y)
        self.ctx.written.update(t.name for t in (*mul.inputs, *add.inputs) if isinstance(t, gs.Constant))
        self._record(name, "converted", reason=reason, output=output)

    def _scale_shift(self, bn: gs.Node, affine: ChannelAffine) -> None:
        x, y = bn.inputs[0], bn.outputs[0]
        rank = self.ctx.types.rank(x)
        if rank is None:
            raise NotFoldable("input rank unknown")
        dtype = self.ctx.types.dtype(x) or self.ctx.types.dtype(y)
        if dtype is None or dtype not in FLOAT_DTYPES:
            raise NotFoldable(f"input dtype {dtype} is not a float type")
        try:
            mul, add = scale_shift_nodes(
                x, y, affine, rank=rank, dtype=dtype, base=bn.name or y.name, fresh_name=self.ctx.fresh_name
            )
        except NotRepresentableError as exc:
            raise NotFoldable(str(exc)) from exc
        self._retire(bn, [mul, add])
        add.outputs.append(y)
        self.ctx.written.update(t.name for t in (*mul.inputs, *add.inputs) if isinstance(t, gs.Constant))
