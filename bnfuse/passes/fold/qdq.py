"""Quantized (QDQ) graphs: a BN after a Conv / Gemm whose weight comes through a per-output-channel
DequantizeLinear folds into that DequantizeLinear's scale ((q - z) * s * a: the integers and zero points stay) and
into the bias (a float constant as usual; an int32 DequantizeLinear bias only where the shift is a whole number
of its steps). A BN reading a DequantizeLinear (the Conv's output quantized before it) stays, with the reason.
"""

from __future__ import annotations

import numpy as np
import onnx_graphsurgeon as gs

from bnfuse.attributes import float_attribute
from bnfuse.passes.fold import fold_math, moves_math
from bnfuse.passes.fold.context import (
    FLOAT_DTYPES,
    NotApplicable,
    NotFoldable,
    Plan,
    describe,
    has_input,
    is_default_domain,
)
from bnfuse.passes.fold.fold_math import ChannelAffine, NotRepresentableError
from bnfuse.passes.fold.surgery import GraphSurgery

_QUANTIZE_OPS = ("DequantizeLinear", "QuantizeLinear")


def qdq_plan(surgery: GraphSurgery, bn: gs.Node, affine: ChannelAffine) -> Plan:
    x = bn.inputs[0]
    node = x.inputs[0] if len(x.inputs) == 1 else None
    if node is None:
        raise NotApplicable("no producer")
    if node.op in _QUANTIZE_OPS:
        raise NotFoldable(
            f"reads {describe(node)} ({node.op}): the producer's output is quantized before the BN, and a "
            "fold would change what is rounded"
        )
    if node.op not in ("Conv", "Gemm") or not is_default_domain(node) or len(node.inputs) < 2:
        raise NotApplicable("not a Conv / Gemm")
    dequantize = _dequantizer(surgery, node.inputs[1])
    if dequantize is None:
        raise NotApplicable("weight not from a DequantizeLinear")
    surgery.require_private(x, node)
    where = f"{describe(node)} (weight through {describe(dequantize)})"
    weight_q = surgery.ctx.resolver.value(dequantize.inputs[0])
    scale = surgery.ctx.resolver.value(dequantize.inputs[1])
    if weight_q is None or scale is None:
        raise NotFoldable(f"{where}: the quantized weight or its scale is not constant")
    if len(node.inputs[1].outputs) != 1:
        raise NotFoldable(f"{where}: the dequantized weight is shared")
    if int(dequantize.attrs.get("block_size", 0)):
        raise NotFoldable(f"{where}: blocked quantization (block_size) is not per output channel")
    trans_b = node.op == "Gemm" and bool(node.attrs.get("transB", 0))
    out_axis = 0 if node.op == "Conv" or trans_b else 1
    rank = weight_q.ndim
    axis = int(dequantize.attrs.get("axis", 1))
    axis = axis + rank if axis < 0 else axis
    channels = int(weight_q.shape[out_axis]) if rank > out_axis else 0
    if scale.size != channels or (scale.size > 1 and axis != out_axis):
        raise NotFoldable(
            f"{where}: the weight scale is not per output channel ({scale.size} values on axis {axis}); "
            "a per-channel BN scale has no place in it"
        )
    if affine.channels != channels:
        raise NotFoldable(f"{affine.channels} per-channel values but {describe(node)} has {channels} outputs")
    try:
        new_scale = fold_math.rounded(
            moves_math.dequantized_scale(scale, affine.scale, channels).reshape(scale.shape),
            np.dtype(scale.dtype),
        )
        bias_plan = _quantized_bias(surgery, node, affine, where)
    except (ValueError, NotRepresentableError) as exc:
        raise NotFoldable(f"{where}: {exc}") from exc

    def apply() -> None:
        surgery.set_constant(dequantize, 1, new_scale)
        bias_plan()
        result = bn.outputs[0]
        surgery.ctx.superseded[x.name] = result.name
        surgery.retire(bn, [])
        node.outputs[0] = result

    return Plan("backward", where, 0 if has_input(node, 2) or not affine.shift.any() else channels, apply)


def _dequantizer(surgery: GraphSurgery, tensor: gs.Tensor) -> gs.Node | None:
    node = tensor.inputs[0] if len(tensor.inputs) == 1 else None
    ok = node is not None and node.op == "DequantizeLinear" and is_default_domain(node)
    return node if ok and id(node) in surgery.own_nodes else None


def _quantized_bias(surgery: GraphSurgery, node: gs.Node, affine: ChannelAffine, where: str):  # noqa: ANN202
    """The edit of the bias (float constant, int32 DequantizeLinear, or none), computed now, applied later."""
    beta = float_attribute(node.attrs, "beta", 1.0) if node.op == "Gemm" else 1.0
    if not has_input(node, 2):
        if not affine.shift.any():
            return lambda: None
        shift = fold_math.rounded(affine.shift, np.dtype(np.float32))

        def new_bias() -> None:
            if node.op == "Gemm":
                node.attrs["beta"] = 1.0
            surgery.set_constant(node, 2, shift)

        return new_bias
    dequantize = _dequantizer(surgery, node.inputs[2])
    if dequantize is None:
        bias = surgery.ctx.resolver.value(node.inputs[2])
        if bias is None or np.dtype(bias.dtype) not in FLOAT_DTYPES:
            raise ValueError("the bias is neither a float constant nor dequantized")
        if node.op == "Gemm" and bias.size not in (1, affine.channels):
            raise ValueError("C is not a per-column bias")
        folded = np.broadcast_to(beta * np.asarray(bias, dtype=np.float64).reshape(-1), (affine.channels,))
        new_bias = fold_math.rounded(folded * affine.scale + affine.shift, np.dtype(bias.dtype))

        def float_bias() -> None:
            if node.op == "Gemm":
                node.attrs["beta"] = 1.0
            surgery.set_constant(node, 2, new_bias)

        return float_bias
    quantized = surgery.ctx.resolver.value(dequantize.inputs[0])
    bias_scale = surgery.ctx.resolver.value(dequantize.inputs[1])
    zero = surgery.ctx.resolver.value(dequantize.inputs[2]) if has_input(dequantize, 2) else None
    if quantized is None or bias_scale is None or (has_input(dequantize, 2) and zero is None):
        raise ValueError("the quantized bias is not constant")
    if beta != 1.0 or quantized.size != affine.channels or (zero is not None and np.any(zero)):
        raise ValueError("the quantized bias is not a plain per-channel int32 bias (zero point 0, beta 1)")
    integers, new_bias_scale = moves_math.requantized_bias(quantized, bias_scale, affine)
    info = np.iinfo(quantized.dtype)
    if integers.min() < info.min or integers.max() > info.max:
        raise ValueError(f"the requantized bias leaves {quantized.dtype}'s range")
    new_q = integers.astype(quantized.dtype).reshape(quantized.shape)
    new_s = fold_math.rounded(np.broadcast_to(new_bias_scale, (affine.channels,)), np.dtype(bias_scale.dtype))
    if bias_scale.size == 1:
        raise ValueError("the quantized bias has one scale for every channel")
    new_s = new_s.reshape(bias_scale.shape)

    def int_bias() -> None:
        surgery.set_constant(dequantize, 0, new_q)
        surgery.set_constant(dequantize, 1, new_s)

    return int_bias
