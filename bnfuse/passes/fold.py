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
AFFINE_OPS = ("Mul", "Add", "Sub", "Div")
BN_PARAMS = ("scale", "bias", "mean", "variance")


class TensorTypes(Protocol):
    """Rank and element type of graph tensors (None when unknown)."""

    def rank(self, tensor: gs.Tensor) -> int | None: ...

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
    for node in list(graph.nodes):
        if id(node) in surgery.replaced or not is_default_domain(node):
            continue
        if node.op == "BatchNormalization":
            surgery.batchnorm(node)
            if ctx.progress is not None:
                ctx.progress()
        elif node.op in AFFINE_OPS:
            surgery.trailing_op(node)
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

    # ----- entry points -------------------------------------------------------------------------

    def batchnorm(self, bn: gs.Node) -> None:
        name = describe(bn)
        output = bn.outputs[0].name if bn.outputs else None
        if self.ctx.opset < 9 and int(bn.attrs.get("spatial", 1)) == 0:
            self._per_activation(bn, name, output)
            return
        try:
            affine = self._batchnorm_affine(bn)
        except NotFoldable as why:
            self._record(name, "skipped", reason=str(why))
            return
        try:
            producer = self._producer(bn.inputs[0])
            self._absorb(producer, affine, bn)
            self._record(name, "folded", into=describe(producer.node), output=output)
            return
        except NotFoldable as why:
            reason = str(why)
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
        try:
            producer = self._producer(data)
            if producer.kind == "MatMul" and producer.bias_node is None and node.op in ("Add", "Sub"):
                return  # MatMul + Add is already the canonical bias form
            vector = per_channel_vector(constant, producer.rank, producer.channels)
            if vector is None:
                return
            affine = fold_math.constant_affine(node.op, vector, producer.channels, constant_first=constant_first)
            self._absorb(producer, affine, node)
        except (NotFoldable, ValueError):
            return
        self.ctx.absorbed.append(AbsorbedOp(describe(node), node.op, self.path, describe(producer.node)))

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
        epsilon = float(bn.attrs.get("epsilon", 1e-5))
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
                    *params, float(bn.attrs.get("epsilon", 1e-5)), dtype
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

    def _absorb(self, producer: Producer, affine: ChannelAffine, consumer: gs.Node) -> None:
        """Fold ``affine`` (applied by ``consumer`` to producer.output) into the producer."""
        if affine.channels != producer.channels:
            raise NotFoldable(
                f"{affine.channels} per-channel values but {describe(producer.node)} has "
                f"{producer.channels} output channels"
            )
        node = producer.node
        try:
            if producer.kind == "Conv":
                weight, bias = fold_math.fold_conv(producer.weight, producer.bias, affine)
            elif producer.kind == "ConvTranspose":
                group = int(node.attrs.get("group", 1))
                weight, bias = fold_math.fold_conv_transpose(producer.weight, producer.bias, affine, group)
            elif producer.kind == "Gemm":
                weight, bias = fold_math.fold_gemm(
                    producer.weight,
                    producer.bias,
                    affine,
                    trans_b=bool(node.attrs.get("transB", 0)),
                    beta=float(node.attrs.get("beta", 1.0)),
                )
            else:
                weight, bias = fold_math.fold_matmul(producer.weight, producer.bias, affine)
        except NotRepresentableError as exc:
            raise NotFoldable(str(exc)) from exc
        except ValueError as exc:
            raise NotFoldable(f"cannot fold into {describe(node)}: {exc}") from exc

        self._set_constant(node, 1, weight)
        output_node = node
        if producer.kind == "MatMul":
            if producer.bias_node is not None:
                output_node = producer.bias_node
                bias_index = 0 if self.ctx.resolver.value(output_node.inputs[0]) is not None else 1
                self._set_constant(output_node, bias_index, bias)
            elif bias is not None:
                output_node = self._new_bias_add(node, bias)
        elif bias is not None:
            if producer.kind == "Gemm":
                node.attrs["beta"] = 1.0
            self._set_constant(node, 2, bias)

        result = consumer.outputs[0]
        self.ctx.superseded[producer.output.name] = result.name
        is_new = output_node is not node and output_node is not producer.bias_node
        self._retire(consumer, [output_node] if is_new else [])
        if is_new:
            output_node.outputs.append(result)
        else:
            output_node.outputs[0] = result

    def _new_bias_add(self, matmul: gs.Node, bias: np.ndarray) -> gs.Node:
        base = matmul.name or matmul.outputs[0].name
        constant = gs.Constant(self.ctx.fresh_name(f"{base}_bias"), bias)
        return gs.Node("Add", self.ctx.fresh_name(f"{base}_bias_add"), inputs=[matmul.outputs[0], constant])

    def _set_constant(self, node: gs.Node, index: int, values: np.ndarray) -> None:
        """Give ``node`` new constant values at input ``index``: edit a private initializer, clone a shared one.

        Shared means read by another node (gs counts consumers in subgraphs too) or returned as an output of
        any graph, where the caller would see the folded values.
        """
        current = node.inputs[index] if _has_input(node, index) else None
        private = (
            isinstance(current, gs.Constant)
            and len(current.outputs) == 1
            and id(current) not in self.outputs
            and id(current) not in self.ctx.graph_outputs
        )
        if private:
            release_mapped(current)  # the old weights were read for the last time
            current.values = values
            self.ctx.resolver.forget(current)
            return
        base = current.name if current is not None else f"{node.name or node.outputs[0].name}_bias"
        fresh = gs.Constant(self.ctx.fresh_name(f"{base}_bnfuse" if current is not None else base), values)
        if index < len(node.inputs):
            node.inputs[index] = fresh
        else:
            node.inputs.extend([gs.Variable.empty()] * (index - len(node.inputs)) + [fresh])

    def _retire(self, node: gs.Node, replacements: list[gs.Node]) -> None:
        """Disconnect ``node``; ``replacements`` take its place in the node order."""
        node.inputs.clear()
        node.outputs.clear()
        self.replaced[id(node)] = replacements

    def commit(self) -> None:
        if not self.replaced:
            return
        nodes: list[gs.Node] = []
        for node in self.graph.nodes:
            nodes.extend(self.replaced.get(id(node), [node]))
        self.graph.nodes = nodes

    def _record(
        self, node: str, status: str, *, into: str | None = None, reason: str | None = None, output: str | None = None
    ) -> None:
        record = BatchNormRecord(node, self.path, status, into=into, reason=reason, output=output)
        self.ctx.records.append(record)


def per_channel_vector(constant: np.ndarray, rank: int, channels: int) -> np.ndarray | None:
    """``constant`` as a (C,) or (1,) vector when it broadcasts only along axis 1 of a rank-``rank`` output."""
    if constant.ndim > rank or np.dtype(constant.dtype) not in FLOAT_DTYPES:
        return None
    shape = (1,) * (rank - constant.ndim) + tuple(constant.shape)
    if any(d != 1 for axis, d in enumerate(shape) if axis != 1):
        return None
    if rank >= 2 and shape[1] not in (1, channels):
        return None
    return constant.reshape(-1)


def _has_input(node: gs.Node, index: int) -> bool:
    return index < len(node.inputs) and bool(node.inputs[index].name)
