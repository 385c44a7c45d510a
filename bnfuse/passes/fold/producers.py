"""The producer of a per-channel map's input (Conv, ConvTranspose, Gemm, MatMul [+ bias Add]) and its weight and
bias with the map applied: what the backward, layout and moved folds fold into."""

from __future__ import annotations

import numpy as np
import onnx_graphsurgeon as gs

from bnfuse.attributes import float_attribute
from bnfuse.passes.fold import fold_math
from bnfuse.passes.fold.context import FLOAT_DTYPES, NotFoldable, Producer, describe, has_input, is_default_domain
from bnfuse.passes.fold.fold_math import ChannelAffine, NotRepresentableError
from bnfuse.passes.fold.surgery import GraphSurgery


def find_producer(surgery: GraphSurgery, tensor: gs.Tensor) -> Producer:
    if not tensor.inputs:
        raise NotFoldable(f"input '{tensor.name}' is a graph input or constant, not a node output")
    node = tensor.inputs[0]
    surgery.require_private(tensor, node)
    if not is_default_domain(node):
        raise NotFoldable(f"producer {describe(node)} ({node.domain}::{node.op}) cannot absorb it")
    if node.op in ("Conv", "ConvTranspose"):
        weight = surgery.float_constant(node, 1, "weight")
        bias = surgery.float_constant(node, 2, "bias") if has_input(node, 2) else None
        return Producer(node.op, node, weight, bias, tensor, rank=weight.ndim)
    if node.op == "Gemm":
        weight = surgery.float_constant(node, 1, "B")
        bias = surgery.float_constant(node, 2, "C") if has_input(node, 2) else None
        if weight.ndim != 2:
            raise NotFoldable(f"Gemm {describe(node)} has a {weight.ndim}-D B")
        return Producer("Gemm", node, weight, bias, tensor, rank=2)
    if node.op == "MatMul":
        return _matmul(surgery, node, tensor, bias_node=None, bias=None)
    if node.op == "Add":
        return _matmul_with_bias(surgery, node, tensor)
    raise NotFoldable(f"producer {describe(node)} ({node.op}) cannot absorb a per-channel map")


def _matmul_with_bias(surgery: GraphSurgery, add: gs.Node, tensor: gs.Tensor) -> Producer:
    values = [surgery.ctx.resolver.value(t) for t in add.inputs]
    for index in (0, 1):
        other = add.inputs[1 - index]
        if values[index] is None or values[1 - index] is not None or not other.inputs:
            continue
        matmul = other.inputs[0]
        if matmul.op != "MatMul" or not is_default_domain(matmul):
            continue
        surgery.require_private(other, matmul)
        bias = values[index]
        if bias.ndim > 2 or np.dtype(bias.dtype) not in FLOAT_DTYPES:
            raise NotFoldable(f"bias of {describe(add)} is not a rank <= 2 float constant")
        return _matmul(surgery, matmul, tensor, bias_node=add, bias=bias)
    raise NotFoldable(f"producer {describe(add)} (Add) is not a MatMul bias add")


def _matmul(
    surgery: GraphSurgery, node: gs.Node, tensor: gs.Tensor, *, bias_node: gs.Node | None, bias: np.ndarray | None
):
    weight = surgery.float_constant(node, 1, "weight")
    if weight.ndim != 2:
        raise NotFoldable(f"MatMul {describe(node)} weight is {weight.ndim}-D, not 2-D")
    if surgery.ctx.types.rank(node.inputs[0]) != 2:
        raise NotFoldable(f"MatMul {describe(node)} input is not known to be 2-D (channel axis 1 is features)")
    return Producer("MatMul", node, weight, bias, tensor, rank=2, bias_node=bias_node)


def fold_values(
    surgery: GraphSurgery, producer: Producer, affine: ChannelAffine
) -> tuple[np.ndarray, np.ndarray | None]:
    """The producer's new weight and bias with ``affine`` applied to its output channels (no edit)."""
    if affine.channels != producer.channels:
        raise NotFoldable(
            f"{affine.channels} per-channel values but {describe(producer.node)} has "
            f"{producer.channels} output channels"
        )
    node = producer.node
    dtype = np.dtype(producer.weight.dtype)
    weight = surgery.exact(node.inputs[1], producer.weight, dtype)
    bias = None if producer.bias is None else surgery.exact(surgery.bias_tensor(producer), producer.bias, dtype)
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
        return surgery.rounded(folded[0], dtype), surgery.rounded(folded[1], dtype)
    except NotRepresentableError as exc:
        raise NotFoldable(str(exc)) from exc
    except ValueError as exc:
        raise NotFoldable(f"cannot fold into {describe(node)}: {exc}") from exc
