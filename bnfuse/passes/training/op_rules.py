"""Reverse rules for ops of real CNN architectures that onnx-ad refuses or gets wrong for them.

Installed beside fast_rules' rules while a training graph is differentiated (fast_rules.installed):

* AveragePool with ceil_mode=1 (timm's ResNet-D ``avg_down`` shortcuts): onnx-ad refuses it (a window can overhang
  the input). PyTorch's semantics: a window covers [o*s - pad_begin, min(o*s - pad_begin + k, size + pad_end)),
  the part past the padded input is not counted; the divisor is that window's size with count_include_pad, else
  the number of real input elements in it. The divisors are constants (static shapes); dX is the transposed
  window sum of dY / divisor: a grouped ConvTranspose with a kernel of ones over the input padded at the end so
  that no window overhangs.

* Clip (ReLU6, hardtanh): PyTorch's gradient is dY where min < x < max, 0 at the bounds themselves; onnx-ad's
  passes dY at x == min or max. A BN output is exactly 0 wherever a channel is constant over the batch (dead
  channels; the bias starts at 0), so the two differ on real networks (mobilenet_v2, rexnet).

A rule falls back to onnx-ad's where its shapes are not static.
"""

from __future__ import annotations

import itertools

import numpy as np


def _attr(node, name, default=None):  # noqa: ANN001, ANN202
    from onnx_ad._build import attribute

    return attribute(node, name, default)


def average_pool_divisors(
    size: list[int],
    out: list[int],
    kernel: list[int],
    strides: list[int],
    pads: list[int],
    dilations: list[int],
    include_pad: bool,
) -> np.ndarray:
    """The divisor of each output element of an AveragePool, shape ``out`` (PyTorch's rule, see module)."""
    spatial = len(size)
    per_axis = []
    for axis in range(spatial):
        reach = dilations[axis] * (kernel[axis] - 1) + 1
        counts = []
        for o in range(out[axis]):
            start = o * strides[axis] - pads[axis]
            end = min(start + reach, size[axis] + pads[spatial + axis])
            if include_pad:
                taps = range(start, end, dilations[axis])
            else:
                taps = [t for t in range(start, end, dilations[axis]) if 0 <= t < size[axis]]
            counts.append(len(taps))
        per_axis.append(counts)
    divisors = np.ones(out, np.float64)
    for index in itertools.product(*(range(n) for n in out)):
        divisors[index] = np.prod([per_axis[a][i] for a, i in enumerate(index)])
    return divisors


def _average_pool_reverse(original):  # noqa: ANN001, ANN202
    def rule(ctx, node, grads):  # noqa: ANN001, ANN202
        from bnfuse.passes.training.fast_rules import _drop_seed

        x, y = node.input[0], node.output[0]
        xs, ys = ctx.shapes.static(x), ctx.shapes.static(y)
        if not _attr(node, "ceil_mode", 0) or xs is None or ys is None:
            return original(ctx, node, grads)
        if _attr(node, "auto_pad", "NOTSET") not in ("NOTSET", "VALID"):
            return original(ctx, node, grads)  # onnx-ad's clear refusal
        spatial = len(xs) - 2
        kernel = list(_attr(node, "kernel_shape"))
        strides = list(_attr(node, "strides", [1] * spatial))
        pads = list(_attr(node, "pads", [0] * (2 * spatial)))
        dilations = list(_attr(node, "dilations", [1] * spatial))
        size, out = list(xs[2:]), list(ys[2:])
        include_pad = bool(_attr(node, "count_include_pad", 0))
        divisors = average_pool_divisors(size, out, kernel, strides, pads, dilations, include_pad)
        dtype = ctx.dtype(x)
        scale = ctx.b.constant((1.0 / divisors).reshape([1, 1, *out]), dtype)
        dy = ctx.b.op("Mul", [_drop_seed(ctx, grads[0], y), scale], stem="avgpool_scaled")
        # pad the end so the last window ends inside: (out - 1) * s + reach = size + pads + extra
        overhang = [
            (out[a] - 1) * strides[a] + dilations[a] * (kernel[a] - 1) + 1 - (size[a] + pads[a] + pads[spatial + a])
            for a in range(spatial)
        ]
        extra = [max(0, r) for r in overhang]  # windows past the padded end: pad more
        tail = [max(0, -r) for r in overhang]  # rows no window reaches: output_padding (their gradient is 0)
        channels = xs[1]
        ones = ctx.b.constant(np.ones([channels, 1, *kernel]), dtype)
        end_pads = [pads[spatial + a] + extra[a] for a in range(spatial)]
        dx = ctx.b.op(
            "ConvTranspose",
            [dy, ones],
            stem="avgpool_spread",
            group=channels,
            strides=strides,
            dilations=dilations,
            pads=pads[:spatial] + end_pads,
            kernel_shape=kernel,
            output_padding=tail,
        )
        return [ctx.unsqueeze(dx, [-1])]

    return rule


def _clip_reverse(original):  # noqa: ANN001, ANN202
    def rule(ctx, node, grads):  # noqa: ANN001, ANN202
        from bnfuse.passes.training.fast_rules import _drop_seed

        x, y = node.input[0], node.output[0]
        if ctx.shapes.static(y) is None or not grads or grads[0] is None:
            return original(ctx, node, grads)
        bounds = [node.input[i] if len(node.input) > i and node.input[i] else None for i in (1, 2)]
        if any(b is not None and ctx.values.get(b) is None for b in bounds):
            return original(ctx, node, grads)  # a computed bound: onnx-ad's rule also differentiates it
        dtype = ctx.dtype(x)
        dy = _drop_seed(ctx, grads[0], y)
        for bound, comparison in zip(bounds, ("Greater", "Less"), strict=True):
            if bound is None:
                continue
            inside = ctx.b.op(comparison, [x, bound], stem="clip_inside")
            dy = ctx.b.op("Mul", [dy, ctx.b.op("Cast", [inside], to=dtype)], stem="clip_grad")
        return [ctx.unsqueeze(dy, [-1])] + [None] * (len(node.input) - 1)

    return rule


RULES = {"AveragePool": _average_pool_reverse, "Clip": _clip_reverse}
