"""The arithmetic of the folds that move a BN's map before it lands: through an activation, past a padded
border, into a dequantized weight's scale.

Pure NumPy, no graph code; float64 throughout, rounded by the caller (fold_math.rounded).
"""

from __future__ import annotations

import itertools

import numpy as np

from bnfuse.passes.fold.fold_math import ChannelAffine, NotRepresentableError

# Activations a positive per-channel scale commutes with: f(a x) = a f(x) for a > 0 (LeakyRelu's and PRelu's
# slopes act on the sign, which a positive scale keeps; max / average pooling are positively homogeneous).
SCALE_COMMUTING = ("Relu", "LeakyRelu", "PRelu")


def split_through_activation(affine: ChannelAffine) -> tuple[np.ndarray, np.ndarray]:
    """``a x + s`` written as ``a (x + s / a)``: (scale a, the shift s / a left before the activation).

    f(a x + s) = a f(x + s / a) for a positively homogeneous f only when every a > 0; refused otherwise.
    """
    scale = np.asarray(affine.scale, dtype=np.float64)
    bad = np.flatnonzero(~(scale > 0))
    if bad.size:
        raise ValueError(
            f"channel {int(bad[0])} has scale {scale[bad[0]]:.3g}: only a positive scale commutes with the activation"
        )
    with np.errstate(over="ignore", divide="ignore", invalid="ignore"):
        inner = np.asarray(affine.shift, dtype=np.float64) / scale
    if not np.isfinite(inner).all():
        raise NotRepresentableError("shift / scale is not finite (scale too small)")
    return scale, inner


def conv_output_size(size: int, kernel: int, stride: int, dilation: int, pad_begin: int, pad_end: int) -> int:
    return (size + pad_begin + pad_end - ((kernel - 1) * dilation + 1)) // stride + 1


def same_pads(size: int, kernel: int, stride: int, dilation: int, upper: bool) -> tuple[int, int]:
    """auto_pad SAME_UPPER / SAME_LOWER: (begin, end) padding of one axis (the extra one at the end for UPPER)."""
    out = -(-size // stride)
    total = max((out - 1) * stride + (kernel - 1) * dilation + 1 - size, 0)
    small = total // 2
    return (small, total - small) if upper else (total - small, small)


def padded_conv_correction(
    weight: np.ndarray,
    shift: np.ndarray,
    group: int,
    spatial: list[int],
    pads: list[int],
    strides: list[int],
    dilations: list[int],
) -> np.ndarray:
    """(C_out, O_1, ..., O_n) in float64: conv(zero-pad(shift per input channel)) minus its value where every tap
    lands inside, i.e. what the shift misses at the border (zero away from it).

    A Conv reading ``a x + s`` computes conv(a x) + conv(pad(s)): its border taps read zeros, not s. Folded, it
    reads x with W a and the full bias b + sum_taps W s; adding this map restores every output position exactly.
    ``pads`` is ONNX's [begin_1, ..., begin_n, end_1, ..., end_n].
    """
    weight64 = np.asarray(weight, dtype=np.float64)
    c_out, per_group = weight64.shape[:2]
    kernel = list(weight64.shape[2:])
    rank = len(kernel)
    if not (len(spatial) == len(strides) == len(dilations) == rank and len(pads) == 2 * rank):
        raise ValueError("spatial sizes, pads, strides and dilations do not match the kernel rank")
    if group < 1 or c_out % group:
        raise ValueError(f"group {group} does not divide the {c_out} output channels")
    in_channel = (np.arange(c_out)[:, None] // (c_out // group)) * per_group + np.arange(per_group)[None, :]
    shift64 = np.asarray(shift, dtype=np.float64)
    # per output channel and kernel tap: sum over input channels of W * s
    per_tap = np.einsum("oi...,oi->o...", weight64, shift64[in_channel]).reshape(c_out, -1)
    # per axis, (kernel taps, outputs): does the tap read a real (not padded) input position?
    inside = []
    for axis in range(rank):
        size, k, s, d = spatial[axis], kernel[axis], strides[axis], dilations[axis]
        out = conv_output_size(size, k, s, d, pads[axis], pads[axis + rank])
        if out < 1:
            raise ValueError(f"axis {axis + 2}: no output position")
        coord = np.arange(out)[None, :] * s - pads[axis] + np.arange(k)[:, None] * d
        inside.append((coord >= 0) & (coord < size))
    outs = [m.shape[1] for m in inside]
    missing = np.ones([int(np.prod(kernel))] + outs)
    for index, taps in enumerate(itertools.product(*(range(k) for k in kernel))):
        grid = np.ones(outs, dtype=bool)
        for axis, tap in enumerate(taps):
            grid = grid & inside[axis][tap].reshape([-1 if a == axis else 1 for a in range(rank)])
        missing[index] = grid
    missing -= 1.0  # -1 where the tap reads padding, 0 where it reads the input
    return np.tensordot(per_tap, missing, axes=([1], [0]))


def dequantized_scale(scale: np.ndarray, factor: np.ndarray, axis_channels: int) -> np.ndarray:
    """A per-output-channel DequantizeLinear scale times the BN's positive scale: (q - z) * s * a.

    The zero point stays; the scale must be per channel (one value per output channel) and ``factor`` > 0 (a
    quantization scale must stay positive).
    """
    scale64 = np.asarray(scale, dtype=np.float64).reshape(-1)
    factor64 = np.asarray(factor, dtype=np.float64).reshape(-1)
    if scale64.size != axis_channels or factor64.size != axis_channels:
        raise ValueError(f"{scale64.size} quantization scales for {axis_channels} output channels")
    bad = np.flatnonzero(~(factor64 > 0))
    if bad.size:
        raise ValueError(
            f"channel {int(bad[0])} has BN scale {factor64[bad[0]]:.3g}: a quantization scale must stay positive"
        )
    return scale64 * factor64


def requantized_bias(
    quantized: np.ndarray, bias_scale: np.ndarray, affine: ChannelAffine, *, zero_point: np.ndarray | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """An integer bias (q - z) * s after the map: (new integers, new scale s * a), exact or refused.

    a ((q - z) s) + t = (q' - z) (s a) needs q' = q + t / (s a) with t / (s a) an integer (within the dtype's range:
    the caller checks). The new scale keeps the quantized-bias rule s_bias = s_x * s_w when the weight's scale
    was multiplied by the same a.
    """
    q = np.asarray(quantized, dtype=np.float64).reshape(-1)
    s = np.broadcast_to(np.asarray(bias_scale, dtype=np.float64).reshape(-1), q.shape)
    new_scale = s * affine.scale
    with np.errstate(divide="ignore", invalid="ignore"):
        step = affine.shift / new_scale
    whole = np.round(step)
    bad = np.flatnonzero(~np.isfinite(step) | (np.abs(step - whole) > 1e-6 * np.maximum(1.0, np.abs(step))))
    if bad.size:
        c = int(bad[0])
        raise ValueError(
            f"the BN shift of channel {c} is {step[c]:.6g} bias steps, not a whole number: the integer bias "
            "cannot hold it exactly"
        )
    return q + whole, new_scale
