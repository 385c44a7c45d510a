"""Graph surgery: fold inference BatchNormalization and per-channel Mul / Add / Sub / Div into producers.

A producer is a Conv, ConvTranspose, Gemm, or MatMul by a constant 2-D weight (with an optional bias
Add) whose output has exactly one consumer and is not a graph output. The per-channel map is folded into
the producer's weight and bias (see fold_math); the producer then writes the consumer's output tensor,
so graph output names and downstream references stay as they were. Nodes are visited in topological
order, so chains (Conv -> BN -> Mul -> Add) fold completely.

What cannot fold is left alone with a reason, or (standalone="scale-shift") becomes Mul + Add.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import onnx_graphsurgeon as gs
from onnx import TensorProto, helper

from bnfuse.attributes import float_attribute
from bnfuse.errors import ModelError
from bnfuse.passes import fold_math
from bnfuse.passes.constants import ConstantResolver, release_mapped
from bnfuse.passes.fold_math import ChannelAffine, InvalidStatisticsError, NotRepresentableError
from bnfuse.passes.report import AbsorbedOp, BatchNormRecord
from bnfuse.passes.scale_shift import scale_shift_nodes

# bfloat16 comes from ml_dtypes, through onnx's own mapping.
FLOAT_DTYPES = {np.dtype(t) for t in (np.float16, np.float32, np.float64)} | {
    np.dtype(helper.tensor_dtype_to_np_dtype(TensorProto.BFLOAT16))
}
LOW_PRECISION_DTYPES = {np.dtype(np.float16), np.dtype(helper.tensor_dtype_to_np_dtype(TensorProto.BFLOAT16))}
# float16 / bfloat16 values a fold computed are kept in float64 (up to this many elements per constant), so a
# second fold into the same layer starts from them, not from their rounding: each value is rounded once.
EXACT_ELEMENTS = 1 << 22
AFFINE_OPS = ("Mul", "Add", "Sub", "Div")
BN_PARAMS = ("scale", "bias", "mean", "variance")


class TensorTypes(Protocol):
    """Rank and element type of graph tensors (None when unknown)."""

    def rank(self, tensor: gs.Tensor) -> int | None: ...

    def shape(self, tensor: gs.Tensor) -> tuple[int | str | None, ...] | None: ...

    def dtype(self, tensor: gs.Tensor) -> np.dtype | None: ...


class NotFoldable(Exception):
    """Why a per-channel map cannot be folded here (a message for the report)."""


@dataclass
class Producer:
    """A linear node able to absorb a per-channel map on its output channels (axis 1)."""

    kind: str  # Conv, ConvTranspose, Gemm, MatMul
    node: gs.Node
    weight: np.ndarray
    bias: np.ndarray | None
    output: gs.Tensor  # the tensor the per-channel map reads
    rank: int
    bias_node: gs.Node | None = None  # MatMul's bias Add

    @property
    def channels(self) -> int:
        if self.kind == "Conv":
            return int(self.weight.shape[0])
        if self.kind == "ConvTranspose":
            return int(self.weight.shape[1]) * int(self.node.attrs.get("group", 1))
        if self.kind == "Gemm":
            return int(self.weight.shape[0] if self.node.attrs.get("transB", 0) else self.weight.shape[1])
        return int(self.weight.shape[1])


@dataclass
class _Plan:
    """One exact way to fold a BN, computed before any edit: ``apply`` does the surgery."""

    direction: str  # "backward" (into the producer) or "forward" (into the consumer)
    into: str
    added_elements: int  # values the fold adds to the model (a new bias)
    apply: Callable[[], None]


@dataclass
class FoldContext:
    """State shared by the folds of one model: constants, fresh names, ranks, what was done."""

    resolver: ConstantResolver
    used_names: set[str]
    types: TensorTypes
    opset: int
    standalone: str = "keep"
    records: list[BatchNormRecord] = field(default_factory=list)
    absorbed: list[AbsorbedOp] = field(default_factory=list)
    progress: Callable[[], None] | None = None
    # ids of the tensors that are an output of any graph of the model (main or subgraph): their values
    # are visible to callers, so a fold must never edit them in place.
    graph_outputs: set[int] = field(default_factory=set)
    # A producer output consumed by a fold disappears; the folded consumer's output carries its values on,
    # mapped here (vanished name -> successor) so every BN record can name the tensor that replaces it.
    superseded: dict[str, str] = field(default_factory=dict)

    def replacement(self, name: str) -> str:
        while name in self.superseded:
            name = self.superseded[name]
        return name

    # names (in the input model) of the weights and biases the folds gave new values: what the check's
    # re-rounded twin perturbs (a fold rounds exactly those once more)
    rewritten: set[str] = field(default_factory=set)
    # the constants holding values a fold computed, as named in the optimized model (the check re-rounds them
    # to measure what one rounding of the new weights moves the optimized model by)
    written: set[str] = field(default_factory=set)
    # id(gs.Constant) -> (that constant, the float64 values a fold computed for it): float16 / bfloat16 only
    # (see EXACT_ELEMENTS); the constant is held so that its id cannot name another one
    exact: dict[int, tuple[gs.Constant, np.ndarray]] = field(default_factory=dict)
    transposes_cancelled: int = 0
    noops_removed: int = 0  # identity Transposes, Identity and inference Dropout nodes bypassed before folding
    # output names of the BNs that were in training mode in the input and were reset to inference
    reset_from_training: set[str] = field(default_factory=set)

    def fresh_name(self, base: str) -> str:
        name, index = base, 1
        while name in self.used_names:
            name, index = f"{base}_{index}", index + 1
        self.used_names.add(name)
        return name


def describe(node: gs.Node) -> str:
    if node.name:
        return node.name
    output = node.outputs[0].name if node.outputs else "?"
    return f"{node.op}->{output}"


def is_default_domain(node: gs.Node) -> bool:
    return node.domain in (None, "", "ai.onnx")


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


class _Surgery:
    """Edits of one graph; replaced nodes are swapped out of graph.nodes once, at the end."""

    def __init__(self, graph: gs.Graph, ctx: FoldContext, graph_path: str) -> None:
        self.graph = graph
        self.ctx = ctx
        self.path = graph_path
        self.outputs = {id(t) for t in graph.outputs}
        self.own_nodes = {id(n) for n in graph.nodes}
        self.replaced: dict[int, list[gs.Node]] = {}
        self.renamed: list[tuple[gs.Tensor, str]] = []  # (tensor, suffix): renamed at commit
        self._pending: dict[int, np.ndarray] = {}  # id(rounded array) -> its float64 values, until written
        self._current_reset = False

    # ----- entry points -------------------------------------------------------------------------

    def forget_pending(self) -> None:
        """Drop the float64 values of folds planned but not made (the direction not taken)."""
        self._pending.clear()

    def remove_layout_noops(self) -> None:
        """Readers of an identity Transpose, an Identity or an inference Dropout read its input instead.

        They compute nothing, but a fold looks for its producer right before the BN: MatMul -> Transpose
        (perm 0, 1) -> BN would otherwise need a new bias node behind a layout op and stay unfolded.
        """
        for node in list(self.graph.nodes):
            if not is_default_domain(node) or len(node.inputs) < 1 or not node.outputs or not self._is_noop(node):
                continue
            out, source = node.outputs[0], node.inputs[0]
            readers = list(out.outputs)
            if id(out) in self.outputs or id(out) in self.ctx.graph_outputs or not readers:
                continue
            if any(id(r) not in self.own_nodes for r in readers):
                continue  # a subgraph reads it by name: keep the name
            for reader in readers:
                for index, tensor in enumerate(reader.inputs):
                    if tensor is out:
                        reader.inputs[index] = source
            self._retire(node, [])
            self.ctx.noops_removed += 1

    def _is_noop(self, node: gs.Node) -> bool:
        if node.op == "Identity":
            return len(node.inputs) == 1 and len(node.outputs) == 1
        if node.op == "Transpose":
            perm = node.attrs.get("perm")
            return perm is not None and [int(p) for p in perm] == list(range(len(perm)))
        if node.op == "Dropout" and self.ctx.opset >= 7:
            try:
                self._require_inference_dropout(node)
            except NotFoldable:
                return False
            return True
        return False

    def cancel_transpose_pairs(self) -> None:
        """Transpose(p) -> Transpose(q) composing to the identity: readers of the second read the first's input.

        Exporters of NHWC models (tf2onnx with its optimizers off) wrap every NCHW op in such pairs; once
        they are gone, Conv -> BN is adjacent again.
        """
        for second in list(self.graph.nodes):
            if second.op != "Transpose" or not is_default_domain(second) or not second.inputs:
                continue
            middle = second.inputs[0]
            first = middle.inputs[0] if len(middle.inputs) == 1 else None
            if (
                first is None
                or first.op != "Transpose"
                or not is_default_domain(first)
                or id(first) not in self.own_nodes
            ):
                continue
            q = second.attrs.get("perm")
            p = first.attrs.get("perm")
            rank = len(p) if p is not None else len(q) if q is not None else self.ctx.types.rank(middle)
            if rank is None:
                continue
            p, q = _perm(first, rank), _perm(second, rank)
            if len(p) != len(q) or [p[axis] for axis in q] != list(range(len(q))):
                continue
            out, source = second.outputs[0], first.inputs[0]
            readers = list(out.outputs)
            if id(out) in self.outputs or id(out) in self.ctx.graph_outputs:
                continue
            if any(id(r) not in self.own_nodes for r in readers):
                continue
            for reader in readers:
                for index, tensor in enumerate(reader.inputs):
                    if tensor is out:
                        reader.inputs[index] = source
            self._retire(second, [])
            if not middle.outputs and id(middle) not in self.outputs and id(middle) not in self.ctx.graph_outputs:
                self._retire(first, [])
            self.ctx.transposes_cancelled += 1

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
        for planner in (self._backward_plan, self._forward_plan):
            try:
                plans.append(planner(bn, affine))
            except NotFoldable as why:
                reasons.append(str(why))
        if plans:
            # Both directions are exact where planned; take the one adding the fewest values (a new bias),
            # the backward fold on a tie (see docs: "Which way a BN folds").
            plan = min(plans, key=lambda p: p.added_elements)
            plan.apply()
            self._record(name, "folded", into=plan.into, direction=plan.direction, output=output)
            return
        reason = "; ".join(reasons[:1] + [f"forward: {r}" for r in reasons[1:]])
        if self.ctx.standalone == "scale-shift":
            try:
                self._scale_shift(bn, affine)
                self._record(name, "converted", reason=f"not folded: {reason}", output=output)
                return
            except NotFoldable as why:
                reason = f"{reason}; not converted: {why}"
        self._record(name, "skipped", reason=reason)

    def trailing_op(self, node: gs.Node) -> None:
        """Absorb ``x <op> c`` (c a per-channel constant) into x's producer; silently keep it otherwise."""
        if len(node.inputs) != 2 or len(node.outputs) != 1:
            return
        values = [self.ctx.resolver.value(t) for t in node.inputs]
        if (values[0] is None) == (values[1] is None):
            return
        constant_first = values[0] is not None
        constant = values[0] if constant_first else values[1]
        data = node.inputs[1] if constant_first else node.inputs[0]
        transpose = self._transpose_before(data)
        try:
            if transpose is not None:  # Conv -> Transpose -> Mul(c): the map's axis is where the channels went
                producer, axis = self._producer_through(transpose, data)
                rank = len(_perm(transpose, producer.rank))
            else:
                producer, axis, rank = self._producer(data), 1, None
                if producer.kind == "MatMul" and producer.bias_node is None and node.op in ("Add", "Sub"):
                    return  # MatMul + Add is already the canonical bias form
            vector = per_channel_vector(constant, rank or producer.rank, producer.channels, axis=axis)
            if vector is None:
                return
            affine = fold_math.constant_affine(node.op, vector, producer.channels, constant_first=constant_first)
            weight, bias = self._fold_values(producer, affine)
            if transpose is not None:
                self._require_in_place(producer, bias)
                self._write_in_place(producer, weight, bias)
                self._take_output(transpose, node, changed=[producer.output])
            else:
                self._write(producer, weight, bias, node)
        except (NotFoldable, ValueError):
            return
        self.ctx.absorbed.append(AbsorbedOp(describe(node), node.op, self.path, describe(producer.node)))

    # ----- plans: the ways one BN can fold, computed before any edit --------------------------------

    def _backward_plan(self, bn: gs.Node, affine: ChannelAffine) -> _Plan:
        x = bn.inputs[0]
        source = x.inputs[0] if len(x.inputs) == 1 else None
        if source is not None and is_default_domain(source) and source.op == "Concat":
            return self._concat_plan(bn, source, affine)
        if source is not None and is_default_domain(source) and source.op == "Transpose":
            producer, axis = self._producer_through(source, x)
            if axis != 1:
                raise NotFoldable(f"{describe(source)} moves the producer's channels to axis {axis}")
            weight, bias = self._fold_values(producer, affine)
            self._require_in_place(producer, bias)
            self._require_backward_magnitudes(producer, affine, self._input_spread(bn), weight.dtype)

            def through_transpose() -> None:
                self._write_in_place(producer, weight, bias)
                self._take_output(source, bn, changed=[producer.output])

            into = f"{describe(producer.node)} (through {describe(source)})"
            return _Plan("backward", into, _added(producer.bias, bias), through_transpose)
        producer = self._producer(x)
        weight, bias = self._fold_values(producer, affine)
        self._require_backward_magnitudes(producer, affine, self._input_spread(bn), weight.dtype)
        return _Plan(
            "backward",
            describe(producer.node),
            _added(producer.bias, bias),
            lambda: self._write(producer, weight, bias, bn),
        )

    def _concat_plan(self, bn: gs.Node, concat: gs.Node, affine: ChannelAffine) -> _Plan:
        """BN after Concat along channels: cut the map per input and fold each part into its producer."""
        x = bn.inputs[0]
        self._require_private(x, concat)
        rank = self.ctx.types.rank(x)
        axis = int(concat.attrs.get("axis", 1))
        if rank is None or (axis + rank if axis < 0 else axis) != 1:
            raise NotFoldable(f"{describe(concat)} does not concatenate along the channel axis")
        producers = [self._producer(t) for t in concat.inputs]
        try:
            parts = fold_math.split_channels(affine, [p.channels for p in producers])
        except ValueError as exc:
            raise NotFoldable(f"cannot split the map over {describe(concat)}: {exc}") from exc
        folded = [self._fold_values(p, part) for p, part in zip(producers, parts, strict=True)]
        spreads = self._input_spread(bn).split([p.channels for p in producers])
        for producer, part, spread, (weight, bias) in zip(producers, parts, spreads, folded, strict=True):
            self._require_in_place(producer, bias)
            self._require_backward_magnitudes(producer, part, spread, weight.dtype)

        def split() -> None:
            for producer, (weight, bias) in zip(producers, folded, strict=True):
                self._write_in_place(producer, weight, bias)
            self._take_output(concat, bn, changed=[p.output for p in producers])

        added = sum(_added(p.bias, b) for p, (_, b) in zip(producers, folded, strict=True))
        into = f"{describe(concat)} inputs ({', '.join(describe(p.node) for p in producers)})"
        return _Plan("backward", into, added, split)

    def _forward_plan(self, bn: gs.Node, affine: ChannelAffine) -> _Plan:
        """Fold into the linear consumer of the BN output, through shape-only ops (see FORWARD_PASSTHROUGH)."""
        x, tensor = bn.inputs[0], bn.outputs[0]
        first: gs.Node | None = None
        passthrough: list[gs.Node] = []
        flattened = False
        while True:
            node = self._only_reader(tensor)
            first = first or node
            passthrough.append(node)
            if node.op in ("Identity", "Dropout"):
                self._require_inference_dropout(node)
            elif node.op == "Flatten":
                rank = self.ctx.types.rank(tensor)
                axis = int(node.attrs.get("axis", 1))
                if rank is None or (axis + rank if axis < 0 else axis) != 1:
                    raise NotFoldable(f"{describe(node)} does not flatten to (batch, features)")
                flattened = True
            elif node.op == "Reshape":
                self._require_batch_features_reshape(node, x)
                flattened = True
            else:
                passthrough.pop()
                break
            tensor = node.outputs[0]
        consumer = node
        spread = self._input_spread(bn)
        if consumer.op in ("Conv", "ConvTranspose") and not flattened:
            weight, bias = self._forward_conv_values(consumer, affine, spread)
            output_node = consumer
        elif consumer.op in ("Gemm", "MatMul"):
            weight, bias, output_node = self._forward_matrix_values(consumer, tensor, affine, flattened, spread)
        else:
            raise NotFoldable(f"consumer {describe(consumer)} ({consumer.op}) cannot absorb a per-channel map")

        def apply() -> None:
            # The BN's output vanishes; the first tensor holding the same values in both models is the
            # consumer's result (a MatMul's bias Add writes it where there is one).
            result = output_node.outputs[0] if output_node is not None else consumer.outputs[0]
            self.ctx.superseded[bn.outputs[0].name] = result.name
            self._retire(bn, [])
            first.inputs[0] = x
            # They now carry the values before the BN: renamed (at commit, after every lookup by name) so
            # that no name means one thing in the original and another in the optimized model.
            self.renamed.extend((node.outputs[0], "_before_bn") for node in passthrough)
            self._set_constant(consumer, 1, weight)
            if bias is None:
                return
            if consumer.op == "MatMul":
                if output_node is None:
                    self._append_bias_add(consumer, bias)
                else:
                    index = 0 if self.ctx.resolver.value(output_node.inputs[0]) is not None else 1
                    self._set_constant(output_node, index, bias)
                return
            if consumer.op == "Gemm":
                consumer.attrs["beta"] = 1.0
            self._set_constant(consumer, 2, bias)

        had_bias = output_node is not None and (consumer.op == "MatMul" or _has_input(consumer, 2))
        added = 0 if bias is None or had_bias else int(np.size(bias))
        return _Plan("forward", describe(consumer), added, apply)

    # ----- forward fold helpers -----------------------------------------------------------------

    def _only_reader(self, tensor: gs.Tensor) -> gs.Node:
        """The one node reading ``tensor`` (as its first input), which the forward fold may rewrite."""
        if id(tensor) in self.outputs or id(tensor) in self.ctx.graph_outputs:
            raise NotFoldable(f"'{tensor.name}' is a graph output")
        if len(tensor.outputs) != 1:
            raise NotFoldable(f"'{tensor.name}' has {len(tensor.outputs)} consumers")
        node = tensor.outputs[0]
        if id(node) not in self.own_nodes or not is_default_domain(node):
            raise NotFoldable(f"consumer {describe(node)} ({node.op}) cannot absorb a per-channel map")
        if node.inputs[0] is not tensor or any(t is tensor for t in node.inputs[1:]):
            raise NotFoldable(f"'{tensor.name}' is not only the data input of {describe(node)}")
        return node

    def _require_inference_dropout(self, node: gs.Node) -> None:
        if node.op != "Dropout":
            return
        if len(node.inputs) > 2 and node.inputs[2].name:
            training = self.ctx.resolver.value(node.inputs[2])
            if training is None or bool(np.asarray(training).reshape(-1)[0]):
                raise NotFoldable(f"{describe(node)} may run in training mode")
        if any(t.name and (t.outputs or id(t) in self.ctx.graph_outputs) for t in node.outputs[1:]):
            raise NotFoldable(f"{describe(node)} mask is used")

    def _require_batch_features_reshape(self, node: gs.Node, x: gs.Tensor) -> None:
        """A Reshape that only merges every axis after the batch: (N, C, d1, ...) -> (N, C * d1 * ...)."""
        target = self.ctx.resolver.value(node.inputs[1]) if len(node.inputs) > 1 else None
        allowzero = int(node.attrs.get("allowzero", 0))
        if target is None or target.size != 2:
            raise NotFoldable(f"{describe(node)} does not reshape to (batch, features)")
        first, second = (int(d) for d in target.reshape(-1))
        if first == 0 and second == -1 and not allowzero:
            return
        shape = self.ctx.types.shape(x)
        if shape is None or any(not isinstance(d, int) for d in shape[1:]):
            raise NotFoldable(f"{describe(node)}: the per-sample shape of '{x.name}' is not static")
        keeps_batch = (first == 0 and not allowzero) or first == -1 or first == shape[0]
        if not keeps_batch or second not in (-1, int(np.prod(shape[1:]))) or (first == -1 and second == -1):
            raise NotFoldable(f"{describe(node)} does not reshape to (batch, features)")

    def _forward_conv_values(
        self, conv: gs.Node, affine: ChannelAffine, spread: fold_math.InputSpread
    ) -> tuple[np.ndarray, np.ndarray | None]:
        weight = self._float_constant(conv, 1, "weight")
        bias = self._float_constant(conv, 2, "bias") if _has_input(conv, 2) else None
        group = int(conv.attrs.get("group", 1))
        if affine.shift.any():  # a pure scaling is exact whatever the padding; a shift only without padding
            reason = _conv_border_effect(conv, weight) if conv.op == "Conv" else _deconv_border_effect(conv, weight)
            if reason:
                raise NotFoldable(f"{describe(conv)} {reason}")
        dtype = np.dtype(weight.dtype)
        exact_w = self._exact(conv.inputs[1], weight, dtype)
        exact_b = None if bias is None else self._exact(conv.inputs[2], bias, dtype)
        try:
            if conv.op == "Conv":
                new_w, new_b = fold_math.forward_conv(exact_w, exact_b, affine, group)
            else:
                new_w, new_b = fold_math.forward_conv_transpose(exact_w, exact_b, affine, group)
            new_w, new_b = self._rounded(new_w, dtype), self._rounded(new_b, dtype)
            weight_abs = fold_math.conv_weight_abs(weight, group, transposed=conv.op == "ConvTranspose")
            self._require_magnitudes(fold_math.forward_magnitudes(weight_abs, affine, spread, new_b), new_w.dtype)
            return new_w, new_b
        except NotRepresentableError as exc:
            raise NotFoldable(str(exc)) from exc
        except ValueError as exc:
            raise NotFoldable(f"cannot fold into {describe(conv)}: {exc}") from exc

    def _forward_matrix_values(
        self, node: gs.Node, data: gs.Tensor, affine: ChannelAffine, flattened: bool, spread: fold_math.InputSpread
    ) -> tuple[np.ndarray, np.ndarray | None, gs.Node | None]:
        """New weight and bias of a Gemm / MatMul reading the mapped features, and the node holding the bias
        (the Gemm itself, a MatMul's private bias Add, or None when a MatMul needs a new one)."""
        weight = self._float_constant(node, 1, "weight" if node.op == "MatMul" else "B")
        if weight.ndim != 2:
            raise NotFoldable(f"{describe(node)} weight is {weight.ndim}-D, not 2-D")
        if node.op == "Gemm" and int(node.attrs.get("transA", 0)):
            raise NotFoldable(f"{describe(node)} transposes its input (transA=1)")
        if node.op == "MatMul" and self.ctx.types.rank(data) != 2:
            raise NotFoldable(f"{describe(node)} input is not known to be 2-D (features on axis 1)")
        trans_b = node.op == "Gemm" and bool(node.attrs.get("transB", 0))
        features = int(weight.shape[1] if trans_b else weight.shape[0])
        if features % affine.channels or (not flattened and features != affine.channels):
            raise NotFoldable(f"{features} input features of {describe(node)} for {affine.channels} channels")
        per_feature = fold_math.repeat_channels(affine, features // affine.channels)
        holder: gs.Node | None = node
        dtype = np.dtype(weight.dtype)
        exact_w = self._exact(node.inputs[1], weight, dtype)
        try:
            if node.op == "Gemm":
                c = self._float_constant(node, 2, "C") if _has_input(node, 2) else None
                c = None if c is None else self._exact(node.inputs[2], c, dtype)
                alpha, beta = float_attribute(node.attrs, "alpha", 1.0), float_attribute(node.attrs, "beta", 1.0)
                new_w, new_b = fold_math.forward_gemm(exact_w, c, per_feature, trans_b=trans_b, alpha=alpha, beta=beta)
            else:
                alpha = 1.0
                holder, bias = self._matmul_bias(node)
                if bias is not None and holder is not None:
                    constant = holder.inputs[0] if holder.inputs[1] is node.outputs[0] else holder.inputs[1]
                    bias = self._exact(constant, bias, dtype)
                new_w, new_b = fold_math.forward_matmul(exact_w, bias, per_feature)
            new_w, new_b = self._rounded(new_w, dtype), self._rounded(new_b, dtype)
            weight_abs = abs(alpha) * np.abs(np.asarray(weight, dtype=np.float64))
            weight_abs = weight_abs.T if trans_b else weight_abs
            inner = features // affine.channels
            magnitudes = fold_math.forward_magnitudes(weight_abs, per_feature, spread.repeated(inner), new_b)
            self._require_magnitudes(magnitudes, new_w.dtype)
        except NotRepresentableError as exc:
            raise NotFoldable(str(exc)) from exc
        except ValueError as exc:
            raise NotFoldable(f"cannot fold into {describe(node)}: {exc}") from exc
        return new_w, new_b, holder

    def _matmul_bias(self, matmul: gs.Node) -> tuple[gs.Node | None, np.ndarray | None]:
        """A MatMul's private bias Add and its values, or (None, None)."""
        out = matmul.outputs[0]
        if len(out.outputs) != 1 or id(out) in self.outputs or id(out) in self.ctx.graph_outputs:
            return None, None
        add = out.outputs[0]
        if add.op != "Add" or not is_default_domain(add) or id(add) not in self.own_nodes or len(add.inputs) != 2:
            return None, None
        other = add.inputs[1] if add.inputs[0] is out else add.inputs[0]
        bias = self.ctx.resolver.value(other)
        if other is out or bias is None or bias.ndim > 2 or np.dtype(bias.dtype) not in FLOAT_DTYPES:
            return None, None
        if bias.ndim == 2 and bias.shape[0] != 1:
            return None, None  # a per-row bias is not a bias of the features
        return add, bias

    def _append_bias_add(self, matmul: gs.Node, bias: np.ndarray) -> None:
        """MatMul -> fresh tensor -> Add(bias) -> the MatMul's old output, placed right after the MatMul."""
        out = matmul.outputs[0]
        base = matmul.name or out.name
        product = gs.Variable(self.ctx.fresh_name(f"{base}_product"), dtype=out.dtype, shape=out.shape)
        matmul.outputs[0] = product
        constant = gs.Constant(self.ctx.fresh_name(f"{base}_bias"), bias)
        self.ctx.written.add(constant.name)
        self._keep_exact(constant, self._pending.pop(id(bias), None))
        add = gs.Node("Add", self.ctx.fresh_name(f"{base}_bias_add"), inputs=[product, constant], outputs=[out])
        self.replaced[id(matmul)] = [matmul, add]
        self.own_nodes.add(id(add))  # a BN after it may fold backward into it

    # ----- through Transpose / Concat -----------------------------------------------------------

    def _transpose_before(self, tensor: gs.Tensor) -> gs.Node | None:
        node = tensor.inputs[0] if len(tensor.inputs) == 1 else None
        return node if node is not None and node.op == "Transpose" and is_default_domain(node) else None

    def _producer_through(self, transpose: gs.Node, tensor: gs.Tensor) -> tuple[Producer, int]:
        """The producer before ``transpose`` and the axis of ``tensor`` its channels (axis 1) went to."""
        self._require_private(tensor, transpose)
        producer = self._producer(transpose.inputs[0])
        perm = _perm(transpose, producer.rank)
        if len(perm) != producer.rank or 1 not in perm:
            raise NotFoldable(f"{describe(transpose)} perm {perm} does not fit a rank-{producer.rank} producer")
        return producer, perm.index(1)

    def _require_in_place(self, producer: Producer, bias: np.ndarray | None) -> None:
        if producer.kind == "MatMul" and producer.bias_node is None and bias is not None:
            raise NotFoldable(f"{describe(producer.node)} would need a new bias node behind a layout op")

    def _take_output(self, node: gs.Node, consumer: gs.Node, *, changed: list[gs.Tensor]) -> None:
        """``node`` now writes ``consumer``'s output (the map moved into its producer); ``consumer`` goes.

        ``changed``: the producer outputs written in place, which now hold other values under their old
        names. Each is superseded by the result (the first tensor holding the same values in both models)
        and renamed at commit, so that no name means one thing in the original and another here: a BN folded
        into that producer earlier is then proven on the result, not on a tensor whose meaning changed.
        """
        result = consumer.outputs[0]
        self.ctx.superseded[node.outputs[0].name] = result.name
        for tensor in changed:
            self.ctx.superseded[tensor.name] = result.name
            self.renamed.append((tensor, "_refolded"))
        self._retire(consumer, [])
        node.outputs[0] = result

    # ----- magnitudes (fold_math: what the folded layer computes, bounded by the BN's statistics) ------------

    def _input_spread(self, bn: gs.Node) -> fold_math.InputSpread:
        _, _, mean, var = self._constant_params(bn)
        return fold_math.input_spread(mean, var, float_attribute(bn.attrs, "epsilon", 1e-5))

    def _require_magnitudes(self, magnitudes: tuple[float, float], dtype: np.dtype, *, growth: bool = True) -> None:
        problem = fold_math.magnitude_problem(*magnitudes, dtype, growth=growth)
        if problem is not None:
            raise NotRepresentableError(problem)

    def _require_backward_magnitudes(
        self, producer: Producer, affine: ChannelAffine, spread: fold_math.InputSpread, dtype: np.dtype
    ) -> None:
        old_bias = producer.bias
        if old_bias is not None and producer.kind == "Gemm":
            old_bias = float_attribute(producer.node.attrs, "beta", 1.0) * np.asarray(old_bias, dtype=np.float64)
        try:
            self._require_magnitudes(fold_math.backward_magnitudes(affine, spread, old_bias), dtype, growth=False)
        except NotRepresentableError as exc:
            raise NotFoldable(f"{describe(producer.node)}: {exc}") from exc

    # ----- batch normalization ------------------------------------------------------------------

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

    def _constant_params(self, bn: gs.Node) -> list[np.ndarray]:
        if len(bn.inputs) != 5:
            raise NotFoldable(f"expected 5 inputs, got {len(bn.inputs)}")
        params = []
        for label, tensor in zip(BN_PARAMS, bn.inputs[1:], strict=True):
            value = self.ctx.resolver.value(tensor)
            if value is None:
                raise NotFoldable(f"{label} '{tensor.name}' is not constant{self._budget_note(tensor)}")
            params.append(value)
        return params

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

    # ----- producers ----------------------------------------------------------------------------

    def _producer(self, tensor: gs.Tensor) -> Producer:
        if not tensor.inputs:
            raise NotFoldable(f"input '{tensor.name}' is a graph input or constant, not a node output")
        node = tensor.inputs[0]
        self._require_private(tensor, node)
        if not is_default_domain(node):
            raise NotFoldable(f"producer {describe(node)} ({node.domain}::{node.op}) cannot absorb it")
        if node.op in ("Conv", "ConvTranspose"):
            weight = self._float_constant(node, 1, "weight")
            bias = self._float_constant(node, 2, "bias") if _has_input(node, 2) else None
            return Producer(node.op, node, weight, bias, tensor, rank=weight.ndim)
        if node.op == "Gemm":
            weight = self._float_constant(node, 1, "B")
            bias = self._float_constant(node, 2, "C") if _has_input(node, 2) else None
            if weight.ndim != 2:
                raise NotFoldable(f"Gemm {describe(node)} has a {weight.ndim}-D B")
            return Producer("Gemm", node, weight, bias, tensor, rank=2)
        if node.op == "MatMul":
            return self._matmul(node, tensor, bias_node=None, bias=None)
        if node.op == "Add":
            return self._matmul_with_bias(node, tensor)
        raise NotFoldable(f"producer {describe(node)} ({node.op}) cannot absorb a per-channel map")

    def _matmul_with_bias(self, add: gs.Node, tensor: gs.Tensor) -> Producer:
        values = [self.ctx.resolver.value(t) for t in add.inputs]
        for index in (0, 1):
            other = add.inputs[1 - index]
            if values[index] is None or values[1 - index] is not None or not other.inputs:
                continue
            matmul = other.inputs[0]
            if matmul.op != "MatMul" or not is_default_domain(matmul):
                continue
            self._require_private(other, matmul)
            bias = values[index]
            if bias.ndim > 2 or np.dtype(bias.dtype) not in FLOAT_DTYPES:
                raise NotFoldable(f"bias of {describe(add)} is not a rank <= 2 float constant")
            return self._matmul(matmul, tensor, bias_node=add, bias=bias)
        raise NotFoldable(f"producer {describe(add)} (Add) is not a MatMul bias add")

    def _matmul(self, node: gs.Node, tensor: gs.Tensor, *, bias_node: gs.Node | None, bias: np.ndarray | None):
        weight = self._float_constant(node, 1, "weight")
        if weight.ndim != 2:
            raise NotFoldable(f"MatMul {describe(node)} weight is {weight.ndim}-D, not 2-D")
        if self.ctx.types.rank(node.inputs[0]) != 2:
            raise NotFoldable(f"MatMul {describe(node)} input is not known to be 2-D (channel axis 1 is features)")
        return Producer("MatMul", node, weight, bias, tensor, rank=2, bias_node=bias_node)

    def _require_private(self, tensor: gs.Tensor, node: gs.Node) -> None:
        """Folding rewrites ``tensor``'s producer, so nothing else may see the old values."""
        if id(node) not in self.own_nodes:
            raise NotFoldable(f"producer of '{tensor.name}' lives in an enclosing graph")
        if id(tensor) in self.outputs:
            raise NotFoldable(f"producer output '{tensor.name}' is a graph output")
        if len(tensor.outputs) != 1:
            raise NotFoldable(f"producer output '{tensor.name}' has {len(tensor.outputs)} consumers")

    def _budget_note(self, tensor: gs.Tensor | None) -> str:
        """Why a constant-looking tensor is not constant: the expansion budget, when that is the reason."""
        over = self.ctx.resolver.over_budget
        pending, seen = [tensor], 0
        while over and pending and seen < 32:  # the small constant subgraph that feeds it
            current = pending.pop()
            seen += 1
            if current is None:
                continue
            if current.name in over:
                budget = self.ctx.resolver.budget_bytes / 2**20
                return f" (expanding its constant subgraph would pass the {budget:.0f} MiB budget)"
            pending += [t for producer in current.inputs for t in producer.inputs]
        return ""

    def _float_constant(self, node: gs.Node, index: int, label: str) -> np.ndarray:
        value = self.ctx.resolver.value(node.inputs[index]) if index < len(node.inputs) else None
        if value is None:
            tensor = node.inputs[index] if index < len(node.inputs) else None
            raise NotFoldable(f"{node.op} {describe(node)} {label} is not constant{self._budget_note(tensor)}")
        if np.dtype(value.dtype) not in FLOAT_DTYPES:
            raise NotFoldable(f"{node.op} {describe(node)} {label} has dtype {value.dtype}")
        return value

    # ----- the fold -----------------------------------------------------------------------------

    def _fold_values(self, producer: Producer, affine: ChannelAffine) -> tuple[np.ndarray, np.ndarray | None]:
        """The producer's new weight and bias with ``affine`` applied to its output channels (no edit)."""
        if affine.channels != producer.channels:
            raise NotFoldable(
                f"{affine.channels} per-channel values but {describe(producer.node)} has "
                f"{producer.channels} output channels"
            )
        node = producer.node
        dtype = np.dtype(producer.weight.dtype)
        weight = self._exact(node.inputs[1], producer.weight, dtype)
        bias = None if producer.bias is None else self._exact(self._bias_tensor(producer), producer.bias, dtype)
        try:
            if producer.kind == "Conv":
                folded = fold_math.fold_conv(weight, bias, affine)
            elif producer.kind == "ConvTranspose":
                group = int(node.attrs.get("group", 1))
                folded = fold_math.fold_conv_transpose(weight, bias, affine, group)
            elif producer.kind == "Gemm":
                folded = fold_math.fold_gemm(
                    weight,
                    bias,
                    affine,
                    trans_b=bool(node.attrs.get("transB", 0)),
                    beta=float_attribute(node.attrs, "beta", 1.0),
                )
            else:
                folded = fold_math.fold_matmul(weight, bias, affine)
            return self._rounded(folded[0], dtype), self._rounded(folded[1], dtype)
        except NotRepresentableError as exc:
            raise NotFoldable(str(exc)) from exc
        except ValueError as exc:
            raise NotFoldable(f"cannot fold into {describe(node)}: {exc}") from exc

    # ----- float16 / bfloat16: every folded value rounded once ------------------------------------------

    def _exact(self, tensor: gs.Tensor | None, values: np.ndarray, dtype: np.dtype) -> np.ndarray:
        """What a fold computes from: ``values`` as they are, or (float16 / bfloat16) in float64, exactly as an
        earlier fold computed them where one did."""
        if dtype not in LOW_PRECISION_DTYPES:
            return values
        entry = self.ctx.exact.get(id(tensor)) if tensor is not None else None
        if entry is not None and entry[0] is tensor and entry[1].shape == np.shape(values):
            exact = entry[1]
            if np.array_equal(exact.astype(dtype), values):  # what the constant holds is its rounding
                return exact
        return np.asarray(values, dtype=np.float64)

    def _rounded(self, values: np.ndarray | None, dtype: np.dtype) -> np.ndarray | None:
        """``values`` in the model's ``dtype`` (checked), remembering float64 ones until _set_constant writes them."""
        if values is None or np.dtype(values.dtype) == dtype:
            return values
        rounded = fold_math.rounded(values, dtype)
        if values.size <= EXACT_ELEMENTS:
            self._pending[id(rounded)] = values
        return rounded

    def _bias_tensor(self, producer: Producer) -> gs.Tensor | None:
        node = producer.node
        if producer.kind == "MatMul":
            holder = producer.bias_node
            if holder is None:
                return None
            return holder.inputs[0] if self.ctx.resolver.value(holder.inputs[0]) is not None else holder.inputs[1]
        return node.inputs[2] if _has_input(node, 2) else None

    def _absorb(self, producer: Producer, affine: ChannelAffine, consumer: gs.Node) -> None:
        """Fold ``affine`` (applied by ``consumer`` to producer.output) into the producer."""
        weight, bias = self._fold_values(producer, affine)
        self._write(producer, weight, bias, consumer)

    def _write_in_place(self, producer: Producer, weight: np.ndarray, bias: np.ndarray | None) -> None:
        """New constants for a producer that keeps writing its output tensor (no new node)."""
        node = producer.node
        self._set_constant(node, 1, weight)
        if bias is None:
            return
        if producer.kind == "MatMul":
            holder = producer.bias_node
            self._set_constant(holder, 0 if self.ctx.resolver.value(holder.inputs[0]) is not None else 1, bias)
            return
        if producer.kind == "Gemm":
            node.attrs["beta"] = 1.0
        self._set_constant(node, 2, bias)

    def _write(self, producer: Producer, weight: np.ndarray, bias: np.ndarray | None, consumer: gs.Node) -> None:
        """New constants, and the producer (or its bias Add) writes ``consumer``'s output instead of it."""
        node = producer.node
        new_add = producer.kind == "MatMul" and producer.bias_node is None and bias is not None
        if new_add:
            self._set_constant(node, 1, weight)
            output_node = self._new_bias_add(node, bias)
        else:
            self._write_in_place(producer, weight, bias)
            output_node = producer.bias_node if producer.kind == "MatMul" and producer.bias_node else node
        result = consumer.outputs[0]
        self.ctx.superseded[producer.output.name] = result.name
        self._retire(consumer, [output_node] if new_add else [])
        if new_add:
            output_node.outputs.append(result)
        else:
            output_node.outputs[0] = result

    def _new_bias_add(self, matmul: gs.Node, bias: np.ndarray) -> gs.Node:
        base = matmul.name or matmul.outputs[0].name
        constant = gs.Constant(self.ctx.fresh_name(f"{base}_bias"), bias)
        self.ctx.written.add(constant.name)
        self._keep_exact(constant, self._pending.pop(id(bias), None))
        add = gs.Node("Add", self.ctx.fresh_name(f"{base}_bias_add"), inputs=[matmul.outputs[0], constant])
        self.own_nodes.add(id(add))
        return add

    def _set_constant(self, node: gs.Node, index: int, values: np.ndarray) -> None:
        """Give ``node`` new constant values at input ``index``: edit a private initializer, clone a shared one.

        Shared means read by another node (gs counts consumers in subgraphs too) or returned as an output of
        any graph, where the caller would see the folded values.
        """
        current = node.inputs[index] if _has_input(node, index) else None
        if current is not None:
            self.ctx.rewritten.add(current.name)
        private = (
            isinstance(current, gs.Constant)
            and len(current.outputs) == 1
            and id(current) not in self.outputs
            and id(current) not in self.ctx.graph_outputs
        )
        exact = self._pending.pop(id(values), None)
        if private:
            release_mapped(current)  # the old weights were read for the last time
            current.values = values
            self.ctx.resolver.forget(current)
            self.ctx.written.add(current.name)
            self._keep_exact(current, exact)
            return
        base = current.name if current is not None else f"{node.name or node.outputs[0].name}_bias"
        fresh = gs.Constant(self.ctx.fresh_name(f"{base}_bnfuse" if current is not None else base), values)
        self.ctx.written.add(fresh.name)
        self._keep_exact(fresh, exact)
        if index < len(node.inputs):
            node.inputs[index] = fresh
        else:
            node.inputs.extend([gs.Variable.empty()] * (index - len(node.inputs)) + [fresh])

    def _keep_exact(self, constant: gs.Constant, exact: np.ndarray | None) -> None:
        if exact is None:
            self.ctx.exact.pop(id(constant), None)
        else:
            self.ctx.exact[id(constant)] = (constant, exact)

    def _retire(self, node: gs.Node, replacements: list[gs.Node]) -> None:
        """Disconnect ``node``; ``replacements`` take its place in the node order."""
        node.inputs.clear()
        node.outputs.clear()
        self.replaced[id(node)] = replacements

    def commit(self) -> None:
        for tensor, suffix in self.renamed:
            tensor.name = self.ctx.fresh_name(f"{tensor.name}{suffix}")
        if not self.replaced:
            return
        nodes: list[gs.Node] = []
        for node in self.graph.nodes:
            nodes.extend(self.replaced.get(id(node), [node]))
        self.graph.nodes = nodes

    def _record(
        self,
        node: str,
        status: str,
        *,
        into: str | None = None,
        reason: str | None = None,
        direction: str | None = None,
        output: str | None = None,
    ) -> None:
        record = BatchNormRecord(node, self.path, status, into=into, reason=reason, direction=direction, output=output)
        record.reset_from_training = self._current_reset
        self.ctx.records.append(record)


def per_channel_vector(constant: np.ndarray, rank: int, channels: int, *, axis: int = 1) -> np.ndarray | None:
    """``constant`` as a (C,) or (1,) vector when it broadcasts only along ``axis`` of a rank-``rank`` output."""
    if constant.ndim > rank or np.dtype(constant.dtype) not in FLOAT_DTYPES:
        return None
    shape = (1,) * (rank - constant.ndim) + tuple(constant.shape)
    if any(d != 1 for index, d in enumerate(shape) if index != axis):
        return None
    if rank > axis and shape[axis] not in (1, channels):
        return None
    return constant.reshape(-1)


def _perm(transpose: gs.Node, rank: int) -> list[int]:
    perm = transpose.attrs.get("perm")
    return [int(p) for p in perm] if perm is not None else list(range(rank))[::-1]


def _added(old_bias: np.ndarray | None, new_bias: np.ndarray | None) -> int:
    """Values a fold adds to the model: a bias where there was none."""
    return 0 if new_bias is None or old_bias is not None else int(np.size(new_bias))


def _conv_border_effect(conv: gs.Node, weight: np.ndarray) -> str | None:
    """Why a Conv's output at the borders would differ after a forward fold (padding), or None."""
    auto_pad = conv.attrs.get("auto_pad", "NOTSET")
    auto_pad = auto_pad.decode() if isinstance(auto_pad, bytes) else auto_pad
    if auto_pad == "VALID":
        return None
    if auto_pad in ("SAME_UPPER", "SAME_LOWER"):
        return f"pads its input (auto_pad={auto_pad}): padded zeros are not normalized"
    if any(int(p) for p in conv.attrs.get("pads", [])):
        return "pads its input: padded zeros are not normalized"
    return None


def _deconv_border_effect(conv: gs.Node, weight: np.ndarray) -> str | None:
    """A ConvTranspose adds a constant shift uniformly only when each output sees exactly one tap of each input:
    1x1 kernel, stride 1, no output_shape / output_padding (pads then only crop)."""
    pointwise = all(int(k) == 1 for k in weight.shape[2:]) and all(int(s) == 1 for s in conv.attrs.get("strides", []))
    if not pointwise:
        return "spreads a shift unevenly (kernel larger than 1 or stride above 1): not exact"
    if "output_shape" in conv.attrs or any(int(p) for p in conv.attrs.get("output_padding", [])):
        return "pads its output (output_shape / output_padding): not exact"
    return None


def _has_input(node: gs.Node, index: int) -> bool:
    return index < len(node.inputs) and bool(node.inputs[index].name)
