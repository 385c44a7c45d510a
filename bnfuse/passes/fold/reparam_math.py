"""The arithmetic of structural re-parameterization: parallel linear branches summed into one Conv.

Pure NumPy, no graph code. Every branch is first written as a ``Kernel``: a Conv of the shared input (weight,
bias, groups, strides, dilations, explicit pads) computed in float64. A BatchNormalization or an Identity reading
the input is a depthwise 1 x 1 kernel (groups = channels), an AveragePool a depthwise k x k kernel of 1 / k^2, a
per-channel Mul its diagonal; per-channel affine maps after a branch scale its output channels, and a pointwise
Conv before or after another composes with it (the 1 x 1 -> k x k pairs of DBB), and a Pad after a 1 x 1 moves
onto its input where the pad value is that 1 x 1's bias (DBB's pad with the BN's bias). ``merge`` then sums kernels:
groups coarsened to their greatest common divisor (a grouped kernel written block-diagonally in fewer groups),
each kernel zero-padded to the common window at the offset its own pads give, biases added. Where that would not
compute the same values (strides, dilations or padding that do not line up, a bias that meets zero padding)
NotMergeable says why. The caller rounds the result once to the model's dtype.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import numpy as np


class NotMergeable(ValueError):
    """Why a set of branches is not exactly one Conv (a message for the report)."""


@dataclass(frozen=True)
class Kernel:
    """``y = conv(x, weight, groups, strides, dilations, pads) + bias``, all in float64 (pads: begins, then ends)."""

    weight: np.ndarray  # (C_out, C_in / groups, k1, ..., kn)
    bias: np.ndarray  # (C_out,)
    groups: int
    strides: tuple[int, ...]
    dilations: tuple[int, ...]
    pads: tuple[int, ...]

    @property
    def rank(self) -> int:
        return self.weight.ndim - 2

    @property
    def out_channels(self) -> int:
        return int(self.weight.shape[0])

    @property
    def in_channels(self) -> int:
        return int(self.weight.shape[1]) * self.groups

    @property
    def pointwise(self) -> bool:
        """A 1 x ... x 1 kernel, stride 1, no padding: a per-position channel map."""
        return self.one_by_one and not any(self.pads)

    @property
    def one_by_one(self) -> bool:
        """A 1 x ... x 1 kernel, stride 1, padded or not: a channel map of each position of its padded input."""
        return all(k == 1 for k in self.weight.shape[2:]) and all(s == 1 for s in self.strides)


def conv_kernel(
    weight: np.ndarray,
    bias: np.ndarray | None,
    *,
    groups: int = 1,
    strides: tuple[int, ...] | None = None,
    dilations: tuple[int, ...] | None = None,
    pads: tuple[int, ...] | None = None,
) -> Kernel:
    weight64 = np.asarray(weight, dtype=np.float64)
    rank = weight64.ndim - 2
    if rank < 1:
        raise NotMergeable(f"a {weight64.ndim}-D Conv weight")
    if groups < 1 or weight64.shape[0] % groups:
        raise NotMergeable(f"group {groups} does not divide the {weight64.shape[0]} output channels")
    bias64 = np.zeros(weight64.shape[0]) if bias is None else np.asarray(bias, dtype=np.float64).reshape(-1)
    return Kernel(
        weight64,
        np.broadcast_to(bias64, (weight64.shape[0],)).copy(),
        groups,
        tuple(int(s) for s in strides) if strides is not None else (1,) * rank,
        tuple(int(d) for d in dilations) if dilations is not None else (1,) * rank,
        tuple(int(p) for p in pads) if pads is not None else (0,) * (2 * rank),
    )


def identity_kernel(channels: int, rank: int) -> Kernel:
    """The input itself: a depthwise 1 x 1 kernel of ones."""
    return Kernel(np.ones((channels, 1) + (1,) * rank), np.zeros(channels), channels, (1,) * rank, (1,) * rank,
                  (0,) * (2 * rank))  # fmt: skip


def average_pool_kernel(
    channels: int,
    kernel_shape: tuple[int, ...],
    *,
    strides: tuple[int, ...] | None = None,
    dilations: tuple[int, ...] | None = None,
    pads: tuple[int, ...] | None = None,
    count_include_pad: bool = False,
    ceil_mode: bool = False,
) -> Kernel:
    """AveragePool as a depthwise Conv: exact where every window divides by the full kernel size."""
    rank = len(kernel_shape)
    pads = tuple(pads) if pads is not None else (0,) * (2 * rank)
    if ceil_mode:
        raise NotMergeable("AveragePool with ceil_mode=1 (its last window is partial)")
    if any(pads) and not count_include_pad:
        raise NotMergeable("AveragePool pads with count_include_pad=0 (border windows divide by fewer values)")
    size = math.prod(kernel_shape)
    weight = np.full((channels, 1, *kernel_shape), 1.0 / size)
    return conv_kernel(weight, None, groups=channels, strides=strides, dilations=dilations, pads=pads)


def then_affine(kernel: Kernel, scale: np.ndarray, shift: np.ndarray) -> Kernel:
    """The kernel followed by ``y * scale + shift`` per output channel (a BN, a per-channel Mul / Add)."""
    scale64 = np.broadcast_to(np.asarray(scale, dtype=np.float64).reshape(-1), (kernel.out_channels,))
    shift64 = np.broadcast_to(np.asarray(shift, dtype=np.float64).reshape(-1), (kernel.out_channels,))
    weight = kernel.weight * scale64.reshape((-1,) + (1,) * (kernel.weight.ndim - 1))
    return replace(kernel, weight=weight, bias=kernel.bias * scale64 + shift64)


def padded(kernel: Kernel, pads: tuple[int, ...], value: float, dtype: np.dtype) -> Kernel:
    """The kernel's output padded by ``pads`` (spatial begins, then ends) with the constant ``value`` (ONNX Pad):
    the same Conv reading its input padded by as much more with zeros.

    Exact where the kernel is 1 x ... x 1 with stride 1, so that a zero input gives its bias at that position, and
    that bias is ``value`` in every channel (within one ``dtype`` ulp of it: the exporter computed it in ``dtype``).
    DBB pads a 1 x 1 -> BN branch with the BN's bias so that its k x k Conv sees at the border what a k x k Conv of
    the zero-padded input would; a ``Pad(0) -> BN`` writes the same, a Pad by any other value does not.
    """
    rank = kernel.rank
    if len(pads) != 2 * rank or any(p < 0 for p in pads):
        raise NotMergeable(f"a Pad of {list(pads)} (cropping or not spatial) is not a Conv's padding")
    if not kernel.one_by_one:
        raise NotMergeable("a Pad after a window or a stride (the padded values are not the window's output)")
    value64 = np.float64(value)
    magnitude = np.maximum(np.abs(kernel.bias), abs(value64)).astype(dtype)
    ulp = np.spacing(magnitude).astype(np.float64)
    off = np.abs(kernel.bias - value64) > ulp
    if np.any(off):
        channel = int(np.argmax(off))
        raise NotMergeable(
            f"a Pad by {value:g} where the branch gives {kernel.bias[channel]:g} at a zero input (channel {channel}):"
            " the border is not the branch's value there"
        )
    total = tuple(a + b for a, b in zip(kernel.pads, pads, strict=True))
    return replace(kernel, pads=total)


def regroup(kernel: Kernel, groups: int) -> Kernel:
    """The same Conv in ``groups`` groups (a divisor of its own): each group's block placed on the diagonal."""
    if groups == kernel.groups:
        return kernel
    if groups < 1 or kernel.groups % groups:
        raise NotMergeable(f"{kernel.groups} groups cannot be written as {groups}")
    c_out, per_in = kernel.out_channels, kernel.weight.shape[1]
    out_per_old, in_per_new = c_out // kernel.groups, kernel.in_channels // groups
    weight = np.zeros((c_out, in_per_new, *kernel.weight.shape[2:]))
    for o in range(0, c_out, out_per_old):
        old_group, new_group = o // out_per_old, o // (c_out // groups)
        start = old_group * per_in - new_group * in_per_new
        weight[o : o + out_per_old, start : start + per_in] = kernel.weight[o : o + out_per_old]
    return replace(kernel, weight=weight, groups=groups)


def compose(first: Kernel, second: Kernel) -> Kernel:
    """``second`` applied to ``first``'s output, as one Conv; one of them must be pointwise.

    first 1 x 1 (stride 1): W[o, i] = sum_m W2[o, m] W1[m, i] per group; its bias goes through every tap of W2,
    which is exact only where ``second`` reads no zero padding or that bias is 0 (zero padding is not its bias);
    ``second``'s window, both pads added (a 1 x 1 of a padded input gives its bias at the border: ``padded``).
    second pointwise: W[o, i] = sum_m W2[o, m] W1[m, i], bias W2 b1 + b2, with ``first``'s window.
    """
    if second.in_channels != first.out_channels:
        raise NotMergeable(f"{second.in_channels} input channels after {first.out_channels} output channels")
    groups = math.gcd(first.groups, second.groups)
    a, b = regroup(first, groups), regroup(second, groups)
    w1 = a.weight.reshape(groups, a.out_channels // groups, *a.weight.shape[1:])
    w2 = b.weight.reshape(groups, b.out_channels // groups, *b.weight.shape[1:])
    if first.one_by_one:
        if any(second.pads) and np.any(first.bias):
            raise NotMergeable("a biased pointwise branch before a padded Conv (zero padding is not its bias)")
        weight = np.einsum("gom...,gmi->goi...", w2, w1.reshape(w1.shape[:3]))
        through = b.weight.reshape(b.out_channels, b.weight.shape[1], -1).sum(axis=2)
        bias = b.bias + np.einsum("gom,gm->go", through.reshape(groups, -1, through.shape[1]),
                                  a.bias.reshape(groups, -1)).reshape(-1)  # fmt: skip
        geometry = replace(second, pads=tuple(a + b for a, b in zip(first.pads, second.pads, strict=True)))
    elif second.pointwise:
        weight = np.einsum("gom,gmi...->goi...", w2.reshape(w2.shape[:3]), w1)
        mixed = np.einsum("gom,gm->go", w2.reshape(w2.shape[:3]), a.bias.reshape(groups, -1)).reshape(-1)
        bias = b.bias + mixed
        geometry = first
    else:
        raise NotMergeable("two Convs in a row, neither pointwise")
    weight = weight.reshape(b.out_channels, -1, *weight.shape[3:])
    return Kernel(weight, bias, groups, geometry.strides, geometry.dilations, geometry.pads)


def merge(kernels: list[Kernel]) -> Kernel:
    """The sum of Convs of one input as one Conv: groups coarsened to their gcd, windows aligned, biases added."""
    if not kernels:
        raise NotMergeable("no branch")
    rank = kernels[0].rank
    if any(k.rank != rank for k in kernels):
        raise NotMergeable("branches of different spatial ranks")
    channels = {(k.out_channels, k.in_channels) for k in kernels}
    if len(channels) != 1:
        raise NotMergeable(f"branches map different channel counts (out, in): {sorted(channels)}")
    groups = math.gcd(*(k.groups for k in kernels))
    regrouped = [regroup(k, groups) for k in kernels]
    strides, dilations, first, last, tail = [], [], [], [], []
    for axis in range(rank):
        axis_strides = {k.strides[axis] for k in kernels}
        if len(axis_strides) != 1:
            raise NotMergeable(f"strides differ along spatial axis {axis}: {sorted(axis_strides)}")
        # a one-tap kernel reads the same values at any dilation
        spread = {k.dilations[axis] for k in kernels if k.weight.shape[2 + axis] > 1} or {1}
        if len(spread) != 1:
            raise NotMergeable(f"dilations differ along spatial axis {axis}: {sorted(spread)}")
        dilation = spread.pop()
        # each branch's taps read input offsets -pad_begin + dilation * j; its output length is set by
        # pad_end - (its last tap's offset), which must agree for the branches to line up
        begins = [-k.pads[axis] for k in kernels]
        ends = [b + dilation * (k.weight.shape[2 + axis] - 1) for b, k in zip(begins, kernels, strict=True)]
        tails = {k.pads[rank + axis] - e for k, e in zip(kernels, ends, strict=True)}
        if len(tails) != 1 or len({b % dilation for b in begins}) != 1:
            raise NotMergeable(f"padding does not line up along spatial axis {axis} (pads {[k.pads for k in kernels]})")
        strides.append(axis_strides.pop())
        dilations.append(dilation)
        first.append(begins)
        last.append(max(ends))
        tail.append(tails.pop())
    window = [(last[a] - min(first[a])) // dilations[a] + 1 for a in range(rank)]
    weight = np.zeros((kernels[0].out_channels, kernels[0].in_channels // groups, *window))
    for index, kernel in enumerate(regrouped):
        offsets = [(first[a][index] - min(first[a])) // dilations[a] for a in range(rank)]
        where = tuple(slice(o, o + s) for o, s in zip(offsets, kernel.weight.shape[2:], strict=True))
        weight[(slice(None), slice(None), *where)] += kernel.weight
    pads = tuple(-min(first[a]) for a in range(rank)) + tuple(tail[a] + last[a] for a in range(rank))
    bias = np.sum([k.bias for k in kernels], axis=0)
    return Kernel(weight, bias, groups, tuple(strides), tuple(dilations), pads)


def weight_elements(kernel: Kernel) -> int:
    """Multiply-adds per output position: what a branch costs to run (a merge never costs more than its parts)."""
    return int(kernel.weight.size)


def rounded(values: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """``values`` (float64) rounded once to ``dtype``; NotMergeable where a value does not fit."""
    with np.errstate(over="ignore", invalid="ignore"):
        cast = np.asarray(values, dtype=np.float64).astype(dtype)
    if not np.all(np.isfinite(cast)):
        raise NotMergeable(f"a merged value does not fit {np.dtype(dtype).name}")
    return cast
