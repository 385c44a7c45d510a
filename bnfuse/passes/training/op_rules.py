"""Reverse rules for ops of real CNN architectures that onnx-ad refuses or gets wrong for them.

Installed beside fast_rules' rules while a training graph is differentiated (fast_rules.installed):

* AveragePool with ceil_mode=1 (timm's ResNet-D ``avg_down`` shortcuts): onnx-ad refuses it (a window can overhang
  the input). PyTorch's semantics: a window covers [o*s - pad_begin, min(o*s - pad_begin + k, size + pad_end)),
  the part past the padded input is not counted; the divisor is that window's size with count_include_pad, else
  the number of real input elements in it. The divisors are constants (static shapes); dX is the transposed
  window sum of dY / divisor: a grouped ConvTranspose with a kernel of ones over the input padded at the end so
  that no window overhangs. The output's size is the runtime's (prepare.infer_static_shapes: no window starts in
  the end padding), so every window has at least one real element.
  The same rule serves a floor-mode AveragePool where onnx-ad's goes wrong: onnx-ad's ConvTranspose gives
  ``output_shape``, so onnxruntime derives the pads (the odd one at the start), which misplaces the gradient of a
  pool whose begin padding is not that (pads (1, 0): the floor-mode form pool_sizes.py gives a stride-3 ceil_mode
  pool; a stride of 3 or more with 2 or more rows left over at the end), or rows left over at the end at all (the
  pads then depend on the runtime: explicit pads and output_padding here); and where the output is larger than the
  input (``AvgPool2d(2, 1, padding=1)``), ONNX shape inference leaves that ConvTranspose's output with rank 2,
  which onnxruntime's inference of the Reshape after it refuses at session creation.

* Clip (ReLU6, hardtanh): PyTorch's gradient is dY where min < x < max, 0 at the bounds themselves; onnx-ad's
  passes dY at x == min or max. A BN output is exactly 0 wherever a channel is constant over the batch (dead
  channels; the bias starts at 0), so the two differ on real networks (mobilenet_v2, rexnet).

* Pad in reflect, edge and wrap modes (``nn.Conv2d(padding_mode="reflect" / "replicate")``, ``F.pad``): onnx-ad
  differentiates constant mode only. Each mode copies input values into the border, so dX is dY's interior plus
  every border slice added back onto the values it copied: per padded axis, reflect adds the reversed border
  onto the rows next to the edge, edge adds the border's sum onto the edge row, wrap adds it onto the rows at the
  other end (the modes pad each axis independently, so the axes' adjoints compose in any order).

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


def _misplaced_by_onnx_ad(node, size: list[int], out: list[int]) -> bool:  # noqa: ANN001
    """Whether onnx-ad's AveragePool rule goes wrong on this floor-mode node: its ConvTranspose gives
    ``output_shape``, so onnxruntime derives the pads from it (the odd one at the start: total - total // 2), which
    is the node's begin padding only where the end's remainder is less than 2;
    where rows are left over at the end (a negative total: the output_shape past the transposed convolution's own),
    the pads are the runtime's choice: onnxruntime clamps the total at 0 and leaves the rows at the end, ONNX's
    formula (and its reference evaluator) splits the negative total over both ends, moving the gradient one row;
    and an output larger than the input leaves that ConvTranspose without a shape in ONNX's inference."""
    spatial = len(size)
    kernel = list(_attr(node, "kernel_shape"))
    strides = list(_attr(node, "strides", [1] * spatial))
    pads = list(_attr(node, "pads", [0] * (2 * spatial)))
    dilations = list(_attr(node, "dilations", [1] * spatial))
    for a in range(spatial):
        total = (out[a] - 1) * strides[a] + dilations[a] * (kernel[a] - 1) + 1 - size[a]
        if out[a] > size[a] or total < 0 or total - total // 2 != pads[a]:
            return True
    return False


def _average_pool_reverse(original):  # noqa: ANN001, ANN202
    def rule(ctx, node, grads):  # noqa: ANN001, ANN202
        from bnfuse.passes.training.fast_rules import _drop_seed

        x, y = node.input[0], node.output[0]
        xs, ys = ctx.shapes.static(x), ctx.shapes.static(y)
        if xs is None or ys is None:
            return original(ctx, node, grads)
        if not _attr(node, "ceil_mode", 0) and not _misplaced_by_onnx_ad(node, list(xs[2:]), list(ys[2:])):
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


INT64_MIN = -(2**63)


def pad_adjoint_parts(mode: str, size: int, before: int, after: int) -> list[tuple[int, int, int, int, int]]:
    """The adjoint of padding one axis of length ``size`` by (before, after) in ``mode``, as the border slices of
    dY added onto dX: (start, stop, step) of the slice of dY, then the zeros padded before and after it along the
    axis to place it on dX (lengths sum to ``size``); a step of 0 sums the slice onto one row (edge mode)."""
    parts = [(before, before + size, 1, 0, 0)]  # the interior
    end = before + size
    if mode == "reflect":  # output i < before copies input before - i; output end + j copies size - 2 - j
        if before:
            parts.append((before - 1, INT64_MIN, -1, 1, size - 1 - before))
        if after:
            parts.append((end + after - 1, end - 1, -1, size - 1 - after, 1))
    elif mode == "edge":
        if before:
            parts.append((0, before, 0, 0, size - 1))
        if after:
            parts.append((end, end + after, 0, size - 1, 0))
    elif mode == "wrap":  # output i < before copies input size - before + i; output end + j copies j
        if before:
            parts.append((0, before, 1, size - before, 0))
        if after:
            parts.append((end, end + after, 1, 0, size - after))
    return parts


def _pad_reverse(original):  # noqa: ANN001, ANN202
    def rule(ctx, node, grads):  # noqa: ANN001, ANN202
        from onnx_ad.rules import _pad_widths

        from bnfuse.passes.training.fast_rules import _drop_seed

        mode = _attr(node, "mode", "constant")
        mode = mode.decode() if isinstance(mode, bytes) else mode
        x, y = node.input[0], node.output[0]
        xs = ctx.shapes.static(x)
        if mode not in ("reflect", "edge", "wrap") or xs is None or ctx.shapes.static(y) is None:
            return original(ctx, node, grads)
        before, after = _pad_widths(ctx, node)
        if min(before + after) < 0:
            return original(ctx, node, grads)  # a crop: onnx-ad's own answer
        dy = _drop_seed(ctx, grads[0], y)
        for axis, size in enumerate(xs):
            if not before[axis] and not after[axis]:
                continue
            total = None
            for start, stop, step, lead, trail in pad_adjoint_parts(mode, size, before[axis], after[axis]):
                piece = ctx.b.op(
                    "Slice",
                    [dy, ctx.b.ints([start]), ctx.b.ints([stop]), ctx.b.ints([axis]), ctx.b.ints([step or 1])],
                    stem="pad_border",
                )
                if step == 0:
                    piece = ctx.b.op("ReduceSum", [piece, ctx.b.ints([axis])], keepdims=1, stem="pad_edge")
                if lead or trail:
                    widths = [0] * (2 * len(xs))
                    widths[axis], widths[len(xs) + axis] = lead, trail
                    piece = ctx.b.op("Pad", [piece, ctx.b.ints(widths)], mode="constant", stem="pad_place")
                total = piece if total is None else ctx.b.op("Add", [total, piece], stem="pad_adjoint")
            dy = total
        return [ctx.unsqueeze(dy, [-1])] + [None] * (len(node.input) - 1)

    return rule


RULES = {"AveragePool": _average_pool_reverse, "Clip": _clip_reverse, "Pad": _pad_reverse}
