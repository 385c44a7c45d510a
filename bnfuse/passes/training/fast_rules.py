"""Reverse rules bnfuse installs into onnx-ad's rule table while it differentiates a training graph.

onnx-ad's rules are general: every adjoint carries a trailing seed axis of any length, so its Conv rule
folds that axis into the batch with Transposes and computes the weight gradient as a convolution of the
channel-swapped input with the channel-swapped adjoint (a kernel as large as the feature map: slow in
onnxruntime's im2col). A training graph has exactly one seed (a scalar loss), so these rules drop the seed
axis with a free Reshape, and compute

* Conv and ConvTranspose weight gradients as one bnfuse.ConvWeightGrad node, and Conv input gradients as one
  bnfuse.ConvInputGrad node (both oneDNN, on the weight as it is) where oneDNN runs in this process and the graph
  may hold bnfuse ops (not --portable); else the graph rules below;
* Conv 1-D to 3-D: dX = Conv(dY, flipped channel-swapped W) at stride 1 on FLIP_MIN_PIXELS+ pixels per image
  (~2x faster than onnxruntime's ConvTranspose), else ConvTranspose with explicit pads and output_padding; dW at
  stride 1 = one Gemm (a batched MatMul over groups) of contiguous slices of the flattened padded input with the
  transposed adjoint (see _weight_grad_flat), at other strides one MatMul of the transposed adjoint [Co, N*P] with
  the input's patches [N*P, K*Ci] (channels-last slices, concatenated); grouped and depthwise convolutions, which
  onnx-ad refuses, as a batched MatMul over groups;
* ConvTranspose 1-D to 3-D (onnx-ad has no weight gradient for it): dX = Conv(dY, W); dW the same weight gradient
  with the roles of input and adjoint swapped;
* GlobalAveragePool: dX = Expand(dY / (H*W)), scaled before it is broadcast;
* Relu: dX = dY * Cast(Y > 0);
* Gemm and 2-D MatMul: adjoints as Gemm nodes with transA / transB flags instead of Transpose nodes; a batched
  input times a 2-D weight (token Linears) the same on its rows stacked, not a batched MatMul and a ReduceSum;
* bnfuse.BatchNormalizationTraining: one bnfuse.BatchNormalizationGrad node (with a fused ReLU, bn.fuse_relu:
  the same node masking dY by the forward's Y; no Greater / Cast / Mul).

Anything else (other ranks, auto_pad) falls back to onnx-ad's own rule.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import numpy as np
import onnx

from bnfuse.attributes import onnx_float
from bnfuse.errors import BnfuseError
from bnfuse.passes.training import bn, op_rules


def _attr(node, name, default=None):  # noqa: ANN001, ANN202
    from onnx_ad._build import attribute

    return attribute(node, name, default)


def _drop_seed(ctx, grad, name):  # noqa: ANN001, ANN202
    """The adjoint without its trailing length-1 seed axis, shaped like the primal ``name``."""
    shape = ctx.shapes.static(name)
    if shape is None:
        raise BnfuseError(f"{name!r} needs a static shape in the training graph (fix the batch size)")
    return ctx.b.op("Reshape", [grad, ctx.b.ints(list(shape))], stem="g_" + name)


def _bn_training_reverse(ctx, node, grads):  # noqa: ANN001, ANN202
    """Adjoints of (X, scale, B, running_mean, running_var) from the adjoint of Y."""
    contributions: list[str | None] = [None] * len(node.input)
    if not grads or grads[0] is None:
        return contributions
    x, scale, bias = node.input[0], node.input[1], node.input[2]
    y, saved_mean, saved_inv_std = node.output[0], node.output[3], node.output[4]
    config = bn.config_of(node)
    activated = [y] if config.activation == "relu" else []  # fused BN -> ReLU: the grad op masks dY by Y
    outputs = ctx.b.op(
        bn.GRAD,
        [_drop_seed(ctx, grads[0], y), x, scale, saved_mean, saved_inv_std, *activated],
        outputs=3,
        stem="bn_grad_" + y,
        domain=bn.DOMAIN,
        **bn.grad_attributes(config),
    )
    for index, (name, grad) in enumerate(zip((x, scale, bias), outputs, strict=True)):
        if index == 1 and config.fix_gamma:
            continue
        if ctx.asked_for(name):
            contributions[index] = ctx.unsqueeze(grad, [-1])
    return contributions


# Fewest dX pixels per image for which the stride-1 dX is a Conv of the flipped, channel-swapped weight rather than
# a ConvTranspose of the weight as it is: that Slice + Transpose of the weight runs on every step (~3 ns per weight
# element in onnxruntime) and pays off only where each weight element is used at enough positions. Per image, not
# per batch: a dynamic-batch graph is the graph built for each batch size, bit for bit. torchvision resnet18 at
# batch 4, 64x64 (its 4x4 and 2x2 stages below this): step 78 -> 64 ms at 1 thread (62 ms with its 8x8 stage too,
# but that would change the 8x8 stage of bench_step_vs_torch's ResNet at batch 32, where the flip is cheap).
FLIP_MIN_PIXELS = 64


def _conv_parts(ctx, node):  # noqa: ANN001, ANN202
    """Static shapes and attributes of a 2-D Conv / ConvTranspose this module handles, else None."""
    x, w, y = node.input[0], node.input[1], node.output[0]
    xs, ws, ys = ctx.shapes.static(x), ctx.shapes.static(w), ctx.shapes.static(y)
    if (
        _attr(node, "auto_pad", "NOTSET") not in ("NOTSET", "VALID")
        or _attr(node, "output_shape") is not None
        or xs is None
        or ws is None
        or ys is None
        or not 3 <= len(xs) <= 5
    ):
        return None
    spatial = len(xs) - 2
    return {
        "xs": xs,
        "ws": ws,
        "ys": ys,
        "group": int(_attr(node, "group", 1)),
        "strides": list(_attr(node, "strides", [1] * spatial)),
        "dilations": list(_attr(node, "dilations", [1] * spatial)),
        "pads": list(_attr(node, "pads", [0] * (2 * spatial))),
        "spatial": spatial,
    }


def _conv_reverse(original):  # noqa: ANN001, ANN202
    def rule(ctx, node, grads):  # noqa: ANN001, ANN202
        parts = _conv_parts(ctx, node)
        if parts is None:
            return original(ctx, node, grads)
        x, w, y = node.input[0], node.input[1], node.output[0]
        xs, ws, ys = parts["xs"], parts["ws"], parts["ys"]
        strides, dilations, pads, group = parts["strides"], parts["dilations"], parts["pads"], parts["group"]
        dy = _drop_seed(ctx, grads[0], y)
        result: list[str | None] = [None] * len(node.input)
        if ctx.asked_for(x):
            kernel, spatial = ws[2:], parts["spatial"]
            extra = [
                (xs[2 + i] + pads[i] + pads[i + spatial] - dilations[i] * (kernel[i] - 1) - 1) % strides[i]
                for i in range(spatial)
            ]
            dx = _input_grad_node(ctx, dy, w, parts)
            if dx is None:
                dx = _input_grad_conv(ctx, dy, w, ws, parts, extra)
            if dx is None:
                dx = ctx.b.op(
                    "ConvTranspose",
                    [dy, w],
                    stem="dx_" + x,
                    group=group,
                    strides=strides,
                    dilations=dilations,
                    pads=pads,
                    output_padding=extra,
                    kernel_shape=list(kernel),
                )
            result[0] = ctx.unsqueeze(dx, [-1])
        if ctx.asked_for(w):
            # dW[o, i, a, b] = sum over n, h, w of dY[n, o, h, w] * Xpad[n, i, h*s + a*d, w*s + b*d]
            dw = _weight_grad_node(ctx, x, dy, ws, parts)
            if dw is None:
                dw = _weight_grad(ctx, dy, ys, x, xs, ws, parts)
            result[1] = ctx.unsqueeze(dw, [-1])
        if len(node.input) > 2 and node.input[2] and ctx.asked_for(node.input[2]):
            result[2] = ctx.unsqueeze(_bias_sum(ctx, dy, node.input[2], parts["spatial"]), [-1])
        return result

    return rule


def _input_grad_node(ctx, dy, w, parts):  # noqa: ANN001, ANN202
    """One bnfuse.ConvInputGrad node (oneDNN's backward data on the weight as it is; conv_input_grad.py) where
    ConvWeightGrad nodes are emitted too (oneDNN in this process, not portable), else None (the graph rules).

    Every Conv's dX, whatever its size: measured in training steps at 1 thread (bench/RESULTS.md, "Conv input
    gradients on oneDNN"): oneDNN's backward data is 1.3-2.5x faster than onnxruntime's ConvTranspose on small maps
    (torchvision resnet18 at 64x64: 512x512 3x3 on 2x2 maps 1.45 vs 3.1-3.6 ms; resnet50's 1x1 convs on 2x2 / 4x4
    maps: 20 ConvTranspose nodes ~40 ms, all 52 ConvInputGrad nodes ~39 ms) and needs no per-step weight Slice +
    Transpose as the flipped-weight Conv does; on the bench ResNet (width 16, 32x32, batch 32) the step is the
    same (quiet machine: 0.57x PyTorch's step against the rules' 0.56x at 1 thread, 0.64x vs 0.68x at 2)."""
    if not _weight_grad_op:
        return None
    from bnfuse.runtime import conv_input_grad

    return ctx.b.op(
        conv_input_grad.OP,
        [dy, w],
        stem="dx",
        domain=conv_input_grad.DOMAIN,
        kernel_shape=list(parts["ws"][2:]),
        output_shape=list(parts["xs"][2:]),
        strides=parts["strides"],
        dilations=parts["dilations"],
        pads=parts["pads"],
        group=parts["group"],
    )


def _input_grad_conv(ctx, dy, w, ws, parts, extra):  # noqa: ANN001, ANN202
    """Stride 1: dX as a Conv of dY with the flipped, channel-swapped weight (per group), pads d*(k-1) - pad
    (+ the unused input tail at the end); None where a pad would be negative. onnxruntime's Conv is ~2x
    faster than its ConvTranspose (GEMM + col2im) on ResNet shapes. None too below FLIP_MIN_PIXELS."""
    spatial, group, dilations, pads = parts["spatial"], parts["group"], parts["dilations"], parts["pads"]
    if any(s != 1 for s in parts["strides"]):
        return None
    if int(np.prod(parts["xs"][2:])) < FLIP_MIN_PIXELS:
        return None
    kernel = list(ws[2:])
    reach = [d * (k - 1) for d, k in zip(dilations, kernel, strict=True)]
    new_pads = [reach[i] - pads[i] for i in range(spatial)] + [
        reach[i] - pads[spatial + i] + extra[i] for i in range(spatial)
    ]
    if any(p < 0 for p in new_pads):
        return None
    b = ctx.b
    co, cig = ws[0], ws[1]
    cog = co // group
    swapped = b.op("Reshape", [w, b.ints([group, cog, cig, *kernel])])
    swapped = b.op("Transpose", [swapped], perm=[0, 2, 1, *range(3, 3 + spatial)])  # [G, C/G in, Co/G, k...]
    swapped = b.op("Reshape", [swapped, b.ints([group * cig, cog, *kernel])])
    axes = list(range(2, 2 + spatial))
    flipped = b.op(
        "Slice",
        [swapped, b.ints([-1] * spatial), b.ints([-(2**62)] * spatial), b.ints(axes), b.ints([-1] * spatial)],
        stem="flipped_" + w,
    )
    return b.op(
        "Conv",
        [dy, flipped],
        stem="dx_conv",
        group=group,
        dilations=dilations,
        pads=new_pads,
        kernel_shape=kernel,
    )


def _bias_sum(ctx, dy, bias, spatial):  # noqa: ANN001, ANN202
    """A convolution's bias gradient, dY summed over the batch and the map, accumulated in float64: before a
    training-mode BN that sum is 0 in exact arithmetic, and onnxruntime's float32 ReduceSum left a residue 19x
    PyTorch's (its cascaded sum) on a fuzzed network (bench/RESULTS.md, session 34), the largest error growth in it."""
    axes = [0, *range(2, 2 + spatial)]
    dtype = ctx.dtype(bias)
    if dtype == onnx.TensorProto.DOUBLE:
        return ctx.reduce_sum(dy, axes, keepdims=0)
    wide = ctx.b.op("Cast", [dy], to=onnx.TensorProto.DOUBLE, stem="bias_grad_wide")
    return ctx.b.op("Cast", [ctx.reduce_sum(wide, axes, keepdims=0)], to=dtype, stem="bias_grad")


def _conv_transpose_reverse(original):  # noqa: ANN001, ANN202
    """ConvTranspose (onnx-ad has no weight gradient for it): dX is a Conv of dY with the same weight;
    dW[i, o, a, b] = sum over n, h, w of X[n, i, h, w] * dYpad[n, o, h*s + a*d, w*s + b*d]."""

    def rule(ctx, node, grads):  # noqa: ANN001, ANN202
        parts = _conv_parts(ctx, node)
        if parts is None:
            return original(ctx, node, grads)
        x, w, y = node.input[0], node.input[1], node.output[0]
        dy = _drop_seed(ctx, grads[0], y)
        result: list[str | None] = [None] * len(node.input)
        if ctx.asked_for(x):
            dx = ctx.b.op(
                "Conv",
                [dy, w],
                stem="dx_" + x,
                group=parts["group"],
                strides=parts["strides"],
                dilations=parts["dilations"],
                pads=parts["pads"],
                kernel_shape=list(parts["ws"][2:]),
            )
            result[0] = ctx.unsqueeze(dx, [-1])
        if ctx.asked_for(w):
            dw = _weight_grad_node(ctx, dy, x, parts["ws"], parts)  # a Conv from dY to X in the roles
            if dw is None:
                dw = _weight_grad(ctx, x, parts["xs"], dy, parts["ys"], parts["ws"], parts)
            result[1] = ctx.unsqueeze(dw, [-1])
        if len(node.input) > 2 and node.input[2] and ctx.asked_for(node.input[2]):
            result[2] = ctx.unsqueeze(_bias_sum(ctx, dy, node.input[2], parts["spatial"]), [-1])
        return result

    return rule


_weight_grad_op = False  # set by installed(): emit bnfuse.ConvWeightGrad where oneDNN runs it


def _weight_grad_node(ctx, source, lhs, ws, parts):  # noqa: ANN001, ANN202
    """One bnfuse.ConvWeightGrad node (oneDNN; bnfuse/runtime/conv_grad.py), or None where the graph rule is
    used: portable graphs, oneDNN absent (or BNFUSE_ONEDNN=0). ``source`` is the Conv's input, ``lhs`` its
    output's adjoint."""
    if not _weight_grad_op:
        return None
    from bnfuse.runtime import conv_grad

    return ctx.b.op(
        conv_grad.OP,
        [source, lhs],
        stem="dw",
        domain=conv_grad.DOMAIN,
        kernel_shape=list(ws[2:]),
        strides=parts["strides"],
        dilations=parts["dilations"],
        pads=parts["pads"],
        group=parts["group"],
    )


def _weight_grad(ctx, lhs, lhs_shape, source, source_shape, ws, parts):  # noqa: ANN001, ANN202
    """grad[l, c, k...] = sum over n and positions p of lhs[n, l, p] * source_pad[n, c, p*s + k*d], shaped like
    the weight ws = [L, C/G, k...]."""
    if all(s == 1 for s in parts["strides"]):
        return _weight_grad_flat(ctx, lhs, lhs_shape, source, source_shape, ws, parts)
    return _weight_grad_patches(ctx, lhs, lhs_shape, source, source_shape, ws, parts)


def _weight_grad_flat(ctx, lhs, lhs_shape, source, source_shape, ws, parts):  # noqa: ANN001, ANN202
    """Stride 1: with the padded source flattened per (c, n) row, the patch of a kernel offset is ONE contiguous
    range of it (offset sum k_i d_i pitch_i) when positions run over the padded grid in all but the first spatial
    axis (lhs zero-padded there: the extra positions add nothing). Each patch is a Slice of whole rows (a memcpy),
    stacked as [G, K, C/G, N*Q] rows that one Gemm reads in place (lhs^T the small, packed operand).

    Split (2-D and up, wide maps): the offsets of the leading spatial axes move to the lhs side instead, as
    shifted zero-paddings of lhs (sum over p of lhs[p - a] src[p + b] = sum of lhs[p] src[p + a + b]): K_last
    source slices plus K/K_last lhs Pads and Gemms instead of K source slices; ~2x faster in onnxruntime on a
    [32, 16, 32, 32] 3x3 layer, slower on small maps (Pad of short rows is slow) and narrow sources."""
    import itertools

    b = ctx.b
    n, cl = lhs_shape[:2]
    out = list(lhs_shape[2:])
    cs = source_shape[1]
    csg, kernel = ws[1], list(ws[2:])
    spatial = len(kernel)
    group, dilations, pads = parts["group"], parts["dilations"], parts["pads"]
    padded = [source_shape[2 + i] + pads[i] + pads[i + spatial] for i in range(spatial)]
    pitch = [1] * spatial  # element stride of each spatial axis in the flattened padded grid
    for i in range(spatial - 2, -1, -1):
        pitch[i] = pitch[i + 1] * padded[i + 1]
    count = 1
    for k in kernel:
        count *= k
    # measured cost model in copied elements per (n, position): slices + Concat of the source, Pads of lhs
    split_cost = 2 * kernel[-1] * cs + 2 * (count // kernel[-1]) * cl
    split = spatial > 1 and padded[-1] >= 16 and split_cost < 2 * count * cs + cl
    lead = spatial - 1 if split else 0  # spatial axes whose offsets the lhs side takes
    extent = padded[0] if split else out[0]
    rows = extent * pitch[0]  # Q: positions per (c, n) row
    offsets = [
        sum(k * d * p for k, d, p in zip(offset, dilations[lead:], pitch[lead:], strict=True))
        for offset in itertools.product(*(range(k) for k in kernel[lead:]))
    ]
    # rows past the padded grid the last offsets read (their lhs factor is zero): extra end padding, axis 0
    extra = -(-max(0, offsets[-1] + rows - padded[0] * pitch[0]) // pitch[0])
    channels_first = b.op("Transpose", [source], perm=[1, 0, *range(2, 2 + spatial)], stem="cnhw_" + source)
    widths = [0, 0, *pads[:spatial], 0, 0, pads[spatial] + extra, *pads[spatial + 1 :]]
    if any(widths):
        channels_first = b.op("Pad", [channels_first, b.ints(widths)], mode="constant")
    length = (padded[0] + extra) * pitch[0]
    flat = b.op("Reshape", [channels_first, b.ints([cs, n, length])])
    axis, stacked = b.ints([2]), b.ints([group, 1, csg, n * rows])
    patches = []
    for start in offsets:
        patch = flat
        if start != 0 or rows != length:
            patch = b.op("Slice", [flat, b.ints([start]), b.ints([start + rows]), axis], stem="patch")
        patches.append(b.op("Reshape", [patch, stacked]))
    cols = patches[0] if len(patches) == 1 else b.op("Concat", patches, axis=1, stem="cols_" + source)
    cols = b.op("Reshape", [cols, b.ints([-1, n * rows] if group == 1 else [group, -1, n * rows])])
    lhs_t = b.op("Transpose", [lhs], perm=[1, 0, *range(2, 2 + spatial)])  # [L, N, out...]
    products = []
    for shift in itertools.product(*(range(k) for k in kernel[:lead])):
        begins = [a * d for a, d in zip(shift, dilations[:lead], strict=True)] + [0] * (spatial - lead)
        ends = [padded[i] - out[i] - begins[i] for i in range(spatial)]
        if not split:
            ends[0] = 0
        shifted = lhs_t
        if any(begins) or any(ends):
            shifted = b.op("Pad", [lhs_t, b.ints([0, 0, *begins, 0, 0, *ends])], mode="constant")
        if group == 1:
            product = b.op("Gemm", [cols, b.op("Reshape", [shifted, b.ints([cl, n * rows])])], transB=1)
        else:
            grouped = b.op("Reshape", [shifted, b.ints([group, cl // group, n * rows])])
            product = b.op("MatMul", [cols, b.op("Transpose", [grouped], perm=[0, 2, 1])])
        products.append(b.op("Reshape", [product, b.ints([group, 1, -1, cl // group])]))
    product = products[0] if len(products) == 1 else b.op("Concat", products, axis=1)  # [G, K/Kx, Kx*C/G, L/G]
    grad = b.op("Reshape", [product, b.ints([group, *kernel, csg, cl // group])])  # [G, k..., C/G, L/G]
    grad = b.op("Transpose", [grad], perm=[0, spatial + 2, spatial + 1, *range(1, spatial + 1)])
    return b.op("Reshape", [grad, b.ints([cl, csg, *kernel])], stem="dw")


def _weight_grad_patches(ctx, lhs, lhs_shape, source, source_shape, ws, parts):  # noqa: ANN001, ANN202
    """Any stride: the patches of the padded source (channels-last slices, concatenated), then one MatMul with
    the transposed lhs (a batched one over groups)."""
    import itertools

    n, cl = lhs_shape[:2]
    out = list(lhs_shape[2:])
    cs = source_shape[1]
    csg, kernel = ws[1], list(ws[2:])
    rank = len(source_shape)
    spatial = rank - 2
    group, strides, dilations, pads = parts["group"], parts["strides"], parts["dilations"], parts["pads"]
    b = ctx.b
    last = [0, *range(2, rank), 1]
    nhwc = b.op("Transpose", [source], perm=last, stem="nhwc_" + source)
    if any(pads):
        widths = [0, *pads[:spatial], 0, 0, *pads[spatial:], 0]
        nhwc = b.op("Pad", [nhwc, b.ints(widths)], mode="constant")
    axes = b.ints(list(range(1, 1 + spatial)))
    steps = b.ints(strides)
    patches = []
    for offset in itertools.product(*(range(k) for k in kernel)):
        starts = [o * d for o, d in zip(offset, dilations, strict=True)]
        ends = [st + (o - 1) * s + 1 for st, o, s in zip(starts, out, strides, strict=True)]
        patches.append(b.op("Slice", [nhwc, b.ints(starts), b.ints(ends), axes, steps], stem="patch"))
    cols = patches[0] if len(patches) == 1 else b.op("Concat", patches, axis=rank - 1, stem="cols_" + source)
    positions = 1
    for o in out:
        positions *= o
    count = len(patches)
    rows = n * positions  # cols: [N, out..., K*C] with index k*C + c
    lhst = b.op("Transpose", [b.op("Reshape", [lhs, b.ints([n, cl, positions])])], perm=[1, 0, 2])  # [L, N, P]
    if group == 1:
        product = b.op(
            "MatMul",
            [b.op("Reshape", [lhst, b.ints([cl, rows])]), b.op("Reshape", [cols, b.ints([rows, count * cs])])],
        )  # [L, K*C]
    else:
        grouped = b.op(
            "Transpose", [b.op("Reshape", [cols, b.ints([rows, count, group, csg])])], perm=[2, 0, 1, 3]
        )  # [G, rows, K, C/G]
        product = b.op(
            "MatMul",
            [
                b.op("Reshape", [lhst, b.ints([group, cl // group, rows])]),
                b.op("Reshape", [grouped, b.ints([group, rows, count * csg])]),
            ],
        )  # [G, L/G, K*C/G]
    grad = b.op("Reshape", [product, b.ints([cl, *kernel, csg])])
    return b.op("Transpose", [grad], perm=[0, 1 + spatial, *range(1, 1 + spatial)], stem="dw")


def _global_average_pool_reverse(original):  # noqa: ANN001, ANN202
    def rule(ctx, node, grads):  # noqa: ANN001, ANN202
        x, y = node.input[0], node.output[0]
        xs, ys = ctx.shapes.static(x), ctx.shapes.static(y)
        if xs is None or ys is None:
            return original(ctx, node, grads)
        count = 1
        for d in xs[2:]:
            count *= d
        scaled = ctx.b.op("Mul", [_drop_seed(ctx, grads[0], y), ctx.constant(1.0 / count, ctx.dtype(x))])
        return [ctx.unsqueeze(ctx.b.op("Expand", [scaled, ctx.b.ints(list(xs))]), [-1])]

    return rule


def _gemm_reverse(original):  # noqa: ANN001, ANN202
    """Gemm (Linear layers): the adjoints are Gemms with transA / transB flags, no Transpose nodes.

    Y = alpha A' B' + beta C, A' = A or A^T, B' = B or B^T: dA = alpha dY B'^T (or its transpose when
    transA), dB = alpha A'^T dY (or its transpose when transB), dC = beta dY summed to C's shape."""

    def rule(ctx, node, grads):  # noqa: ANN001, ANN202
        a, b_, y = node.input[0], node.input[1], node.output[0]
        if ctx.shapes.static(y) is None or (
            len(node.input) > 2 and node.input[2] and ctx.shapes.static(node.input[2]) is None
        ):
            return original(ctx, node, grads)
        alpha, beta = onnx_float(_attr(node, "alpha", 1.0)), onnx_float(_attr(node, "beta", 1.0))
        trans_a, trans_b = int(_attr(node, "transA", 0)), int(_attr(node, "transB", 0))
        dy = _drop_seed(ctx, grads[0], y)
        result: list[str | None] = [None] * len(node.input)
        if ctx.asked_for(a):
            if trans_a:
                da = ctx.b.op("Gemm", [b_, dy], alpha=alpha, transA=trans_b, transB=1, stem="da_" + a)
            else:
                da = ctx.b.op("Gemm", [dy, b_], alpha=alpha, transA=0, transB=1 - trans_b, stem="da_" + a)
            result[0] = ctx.unsqueeze(da, [-1])
        if ctx.asked_for(b_):
            if trans_b:
                db = ctx.b.op("Gemm", [dy, a], alpha=alpha, transA=1, transB=trans_a, stem="db_" + b_)
            else:
                db = ctx.b.op("Gemm", [a, dy], alpha=alpha, transA=1 - trans_a, transB=0, stem="db_" + b_)
            result[1] = ctx.unsqueeze(db, [-1])
        if len(node.input) > 2 and node.input[2] and ctx.asked_for(node.input[2]):
            c = node.input[2]
            cs, ys = ctx.shapes.static(c), ctx.shapes.static(y)
            lead = len(ys) - len(cs)
            axes = list(range(lead)) + [lead + i for i, d in enumerate(cs) if d == 1 and ys[lead + i] != 1]
            if axes == [0] and len(ys) == 2:  # a bias over the batch rows: the column sums as a Gemm
                dc = _column_sums(ctx, dy, ys[0], ctx.dtype(y))
            else:
                dc = ctx.reduce_sum(dy, axes, keepdims=1) if axes else dy
            dc = ctx.b.op("Reshape", [dc, ctx.b.ints(list(cs))])
            if beta != 1.0:
                dc = ctx.b.op("Mul", [dc, ctx.constant(beta, ctx.dtype(y))])
            result[2] = ctx.unsqueeze(dc, [-1])
        return result

    return rule


def _column_sums(ctx, value, rows, dtype):  # noqa: ANN001, ANN202
    """The column sums of a 2-D [rows, cols] tensor, as Gemm(ones[1, rows], value) -> [1, cols]: onnxruntime's
    ReduceSum over the leading axis took 0.11 ms for 256x512 on 2 threads, this Gemm 0.01 ms."""
    ones = ctx.b.constant(np.ones((1, rows)), dtype)
    return ctx.b.op("Gemm", [ones, value], stem="column_sums")


def _matmul_reverse(original):  # noqa: ANN001, ANN202
    """2-D MatMul: dA = dY B^T, dB = A^T dY as Gemms with transpose flags. A batched A [..., M, K] times a 2-D B
    [K, N] (a Linear layer over tokens: transformer blocks): the same two Gemms on A and dY viewed as [rows, K] and
    [rows, N]. onnx-ad's rule makes dB a batched MatMul [..., K, N] then a ReduceSum over the batch axes: 16 outer
    products and a reduction where one Gemm does (mobilevit_xxs: 12 of its 64 ms kernel time per step at 1 thread).
    Other ranks: onnx-ad's rule."""

    def rule(ctx, node, grads):  # noqa: ANN001, ANN202
        a, b_, y = node.input[0], node.input[1], node.output[0]
        shapes = [ctx.shapes.static(n) for n in (a, b_, y)]
        if any(shape is None for shape in shapes):
            return original(ctx, node, grads)
        if len(shapes[0]) > 2 and len(shapes[1]) == 2 and len(shapes[2]) == len(shapes[0]):
            return _batched_by_matrix(ctx, node, grads, shapes[0])
        if any(len(shape) != 2 for shape in shapes):
            return original(ctx, node, grads)
        dy = _drop_seed(ctx, grads[0], y)
        result: list[str | None] = [None, None]
        if ctx.asked_for(a):
            result[0] = ctx.unsqueeze(ctx.b.op("Gemm", [dy, b_], transB=1, stem="da_" + a), [-1])
        if ctx.asked_for(b_):
            result[1] = ctx.unsqueeze(ctx.b.op("Gemm", [a, dy], transA=1, stem="db_" + b_), [-1])
        return result

    return rule


def _batched_by_matrix(ctx, node, grads, a_shape):  # noqa: ANN001, ANN202
    """Adjoints of Y = A B, A [..., M, K], B [K, N]: the rows of every batch stacked (a Reshape to [-1, K], no
    copy), dA = dY2 B^T reshaped back to A's shape, dB = A2^T dY2 (the sum over the batch of A_i^T dY_i, one Gemm)."""
    a, b_, y = node.input[0], node.input[1], node.output[0]
    k, n = ctx.shapes.static(b_)
    dy = ctx.b.op("Reshape", [grads[0], ctx.b.ints([-1, n])], stem="g_" + y)  # the seed axis has length 1
    result: list[str | None] = [None, None]
    if ctx.asked_for(a):
        da = ctx.b.op("Gemm", [dy, b_], transB=1, stem="da_" + a)
        result[0] = ctx.b.op("Reshape", [da, ctx.b.ints([*a_shape, 1])], stem="da_" + a)
    if ctx.asked_for(b_):
        rows = ctx.b.op("Reshape", [a, ctx.b.ints([-1, k])], stem="rows_" + a)
        result[1] = ctx.unsqueeze(ctx.b.op("Gemm", [rows, dy], transA=1, stem="db_" + b_), [-1])
    return result


def _relu_reverse(original):  # noqa: ANN001, ANN202
    """dX = dY * Cast(Y > 0): the 0/1 mask (Relu'(0) = 0, as in PyTorch) read from the primal output.
    Measured in onnxruntime (CPU): Greater + Cast + Mul ~0.3 ms on [32, 16, 32, 32], Sign + Mul ~0.7 ms
    (Sign is not vectorized), Where ~2.5 ms."""

    def rule(ctx, node, grads):  # noqa: ANN001, ANN202
        y = node.output[0]
        if ctx.shapes.static(y) is None:
            return original(ctx, node, grads)
        dtype = ctx.dtype(y)
        positive = ctx.b.op("Greater", [y, ctx.constant(0.0, dtype)], stem="positive_" + y)
        mask = ctx.b.op("Cast", [positive], to=dtype, stem="mask_" + y)
        return [ctx.unsqueeze(ctx.b.op("Mul", [_drop_seed(ctx, grads[0], y), mask]), [-1])]

    return rule


def _dropout_reverse(original):  # noqa: ANN001, ANN202
    """Training-mode Dropout (dropout.training_dropout): dX = dY * Cast(mask) * 1 / (1 - ratio); inference
    Dropout (the identity) keeps onnx-ad's rule."""
    from bnfuse.passes.training import dropout

    def rule(ctx, node, grads):  # noqa: ANN001, ANN202
        if not dropout.is_training(node):
            return original(ctx, node, grads)
        contributions = [None] * len(node.input)
        if grads and grads[0] is not None:
            y, mask = node.output[0], node.output[1]
            ratio = ctx.values.get(node.input[1]) if node.input[1] else np.array(0.5)
            if ratio is None:
                raise BnfuseError(f"Dropout {node.name or y!r}: its ratio must be a constant to train")
            ratio = float(np.asarray(ratio).reshape(-1)[0])
            dtype = ctx.dtype(y)
            keep = ctx.b.op("Cast", [mask], to=dtype, stem="keep_" + y)
            scale = ctx.constant(1.0 / (1.0 - ratio) if ratio < 1 else 0.0, dtype)
            grad = ctx.b.op("Mul", [ctx.b.op("Mul", [_drop_seed(ctx, grads[0], y), keep]), scale])
            contributions[0] = ctx.unsqueeze(grad, [-1])
        return contributions

    return rule


@contextlib.contextmanager
def installed(*, fast: bool = True, weight_grad_op: bool = False) -> Iterator[None]:
    """bnfuse's rules in onnx-ad's reverse table for the duration of the block (then restored).

    fast=False installs only the BN and ConvTranspose rules (onnx-ad's own Conv, pooling, Gemm, MatMul, Relu stay).
    weight_grad_op: Conv / ConvTranspose weight gradients as bnfuse.ConvWeightGrad nodes and Conv input gradients as
    bnfuse.ConvInputGrad nodes where oneDNN is available in this process (else, and for portable graphs, the graph
    rules below)."""
    global _weight_grad_op
    from onnx_ad import rules

    from bnfuse.runtime import conv_grad

    saved_op, _weight_grad_op = _weight_grad_op, bool(weight_grad_op and conv_grad.available())

    table = rules.REVERSE
    fast_ops = {"Conv": _conv_reverse, "GlobalAveragePool": _global_average_pool_reverse, "Gemm": _gemm_reverse}
    fast_ops.update(MatMul=_matmul_reverse, Relu=_relu_reverse)
    saved = {key: table.get(key) for key in (bn.TRAINING, "ConvTranspose", "Dropout", *fast_ops, *op_rules.RULES)}
    table[bn.TRAINING] = _bn_training_reverse
    for op_type, make in op_rules.RULES.items():  # ops onnx-ad refuses (ceil_mode pooling, ...)
        table[op_type] = make(saved[op_type])
    if saved["Dropout"] is not None:
        table["Dropout"] = _dropout_reverse(saved["Dropout"])
    if saved["ConvTranspose"] is not None:  # onnx-ad has no weight gradient for ConvTranspose
        table["ConvTranspose"] = _conv_transpose_reverse(saved["ConvTranspose"])
    for op_type, make in fast_ops.items():
        if fast and saved[op_type] is not None:
            table[op_type] = make(saved[op_type])
    try:
        yield
    finally:
        _weight_grad_op = saved_op
        for key, rule in saved.items():
            if rule is None:
                table.pop(key, None)
            else:
                table[key] = rule
