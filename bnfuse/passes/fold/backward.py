"""Backward folds: a per-channel map (a BN, or a trailing Mul / Add / Sub / Div by a constant) folded into the
Conv, ConvTranspose, Gemm or MatMul that produces its input."""

from __future__ import annotations

import numpy as np
import onnx_graphsurgeon as gs

from bnfuse.attributes import float_attribute
from bnfuse.passes.fold import fold_math
from bnfuse.passes.fold.bounds import require_backward_magnitudes
from bnfuse.passes.fold.context import (
    FLOAT_DTYPES,
    NotFoldable,
    Plan,
    Producer,
    added_elements,
    describe,
    has_input,
    is_default_domain,
    per_channel_vector,
    transpose_perm,
)
from bnfuse.passes.fold.fold_math import ChannelAffine, NotRepresentableError
from bnfuse.passes.fold.surgery import GraphSurgery
from bnfuse.passes.report import AbsorbedOp


class BackwardFolds(GraphSurgery):
    """Folds into the producer of the mapped tensor (through a Transpose or Concat: layout)."""

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
                rank = len(transpose_perm(transpose, producer.rank))
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

    def _backward_plan(self, bn: gs.Node, affine: ChannelAffine) -> Plan:
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
            require_backward_magnitudes(producer, affine, self._input_spread(bn), weight.dtype)

            def through_transpose() -> None:
                self._write_in_place(producer, weight, bias)
                self._take_output(source, bn, changed=[producer.output])

            into = f"{describe(producer.node)} (through {describe(source)})"
            return Plan("backward", into, added_elements(producer.bias, bias), through_transpose)
        producer = self._producer(x)
        weight, bias = self._fold_values(producer, affine)
        require_backward_magnitudes(producer, affine, self._input_spread(bn), weight.dtype)
        return Plan(
            "backward",
            describe(producer.node),
            added_elements(producer.bias, bias),
            lambda: self._write(producer, weight, bias, bn),
        )

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
            bias = self._float_constant(node, 2, "bias") if has_input(node, 2) else None
            return Producer(node.op, node, weight, bias, tensor, rank=weight.ndim)
        if node.op == "Gemm":
            weight = self._float_constant(node, 1, "B")
            bias = self._float_constant(node, 2, "C") if has_input(node, 2) else None
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
