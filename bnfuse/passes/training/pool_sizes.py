"""Pooling output sizes as onnxruntime's kernels and PyTorch compute them, and pools rewritten so ONNX agrees.

With ``ceil_mode`` a last window that would start in the end padding is dropped by onnxruntime's kernels and by
PyTorch (``if (out - 1) * stride >= size + pad_begin: out -= 1``), kept by ONNX shape inference:
``AvgPool2d(2, 2, padding=1, ceil_mode=True)`` on 5x5 runs as 3x3, is inferred 4x4. A training graph is built at
static shapes (prepare.infer_static_shapes gives such a pool the runtime's size), but onnxruntime infers the shapes
of the graph again when the session is created, from ONNX's rule: where the backward expands or reshapes to the
runtime's size, it refuses the graph. So each such pool is rewritten to attributes that compute the same windows
with the same divisors and whose size ONNX infers right (``runtime_pool_attributes``): the end padding cut to what
the last kept window reaches, or floor mode where the windows fit (a stride larger than the window).

Only the end padding and ``ceil_mode`` change: the windows start where they did (o * stride - pad_begin). MaxPool
and LpPool (and AveragePool without ``count_include_pad``) read only the real elements of a window, so the end padding
a window no longer reaches changes nothing; with ``count_include_pad`` the divisor of each window (its size clipped
at size + pad_end, as both runtimes count it) must stay the same, which is checked per window.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import onnx
from onnx import helper

POOLS = ("AveragePool", "MaxPool", "LpPool")


def pool_output_size(
    size: int, kernel: int, stride: int, pad_begin: int, pad_end: int, dilation: int, ceil: bool
) -> int:
    """One spatial size of a pooling output as onnxruntime's kernels and PyTorch compute it."""
    out = onnx_output_size(size, kernel, stride, pad_begin, pad_end, dilation, ceil)
    if ceil and (out - 1) * stride >= size + pad_begin:
        out -= 1
    return out


def onnx_output_size(
    size: int, kernel: int, stride: int, pad_begin: int, pad_end: int, dilation: int, ceil: bool
) -> int:
    """The same size as ONNX shape inference computes it (ceil_mode keeps a window starting in the end padding)."""
    span = size + pad_begin + pad_end - dilation * (kernel - 1) - 1
    return (-(-span // stride) if ceil else span // stride) + 1


def include_pad_divisors(
    size: int, kernel: int, stride: int, pad_begin: int, pad_end: int, dilation: int, out: int
) -> list[int]:
    """With count_include_pad, how many taps each of ``out`` windows averages: its taps up to size + pad_end."""
    reach = dilation * (kernel - 1) + 1
    counts = []
    for o in range(out):
        start = o * stride - pad_begin
        counts.append(len(range(start, min(start + reach, size + pad_end), dilation)))
    return counts


@dataclass
class Pooling:
    """A pooling node's window attributes, explicit (auto_pad NOTSET / VALID)."""

    kernel: list[int]
    strides: list[int]
    pads: list[int]
    dilations: list[int]
    ceil: bool
    include_pad: bool  # AveragePool's count_include_pad: the divisor depends on the end padding


def pooling(node: onnx.NodeProto) -> Pooling | None:
    """The node's window attributes, or None for a node that is no ONNX pooling or pads automatically (SAME_*)."""
    if node.op_type not in POOLS or node.domain not in ("", "ai.onnx"):
        return None
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    auto_pad = attrs.get("auto_pad", b"NOTSET")
    auto_pad = auto_pad.decode() if isinstance(auto_pad, bytes) else auto_pad
    if auto_pad not in ("NOTSET", "VALID") or "kernel_shape" not in attrs:
        return None
    kernel = list(attrs["kernel_shape"])
    spatial = len(kernel)
    return Pooling(
        kernel,
        list(attrs.get("strides", [1] * spatial)),
        list(attrs.get("pads", [0] * (2 * spatial))) if auto_pad == "NOTSET" else [0] * (2 * spatial),
        list(attrs.get("dilations", [1] * spatial)),
        bool(attrs.get("ceil_mode", 0)),
        node.op_type == "AveragePool" and bool(attrs.get("count_include_pad", 0)),
    )


def has_ceil_mode_pool(graph: onnx.GraphProto) -> bool:
    return any(window is not None and window.ceil for window in map(pooling, graph.node))


def _shape(node: onnx.NodeProto, input_shape: Sequence[int], size_rule: Callable[..., int]) -> tuple[int, ...] | None:
    window = pooling(node)
    if window is None or not window.ceil or len(input_shape) != len(window.kernel) + 2:
        return None
    if any(d < 0 for d in input_shape):
        return None
    spatial = len(window.kernel)
    sizes = [
        size_rule(
            input_shape[2 + a],
            window.kernel[a],
            window.strides[a],
            window.pads[a],
            window.pads[spatial + a],
            window.dilations[a],
            True,
        )
        for a in range(spatial)
    ]
    return (*input_shape[:2], *sizes)


def pool_shape(node: onnx.NodeProto, input_shape: Sequence[int]) -> tuple[int, ...] | None:
    """The runtime output shape of a ceil_mode pooling node (None for any other node, or an input shape not
    static): the only pooling whose size ONNX shape inference gets wrong."""
    return _shape(node, input_shape, pool_output_size)


def inferred_pool_shape(node: onnx.NodeProto, input_shape: Sequence[int]) -> tuple[int, ...] | None:
    """ONNX shape inference's output shape of the same (None where pool_shape is)."""
    return _shape(node, input_shape, onnx_output_size)


def _end_pad(size: int, window: Pooling, axis: int, ceil: bool, out: int) -> int | None:
    """An end padding for ``axis`` with which ONNX and the runtime both give ``out`` windows in ``ceil`` mode, and
    every window's count_include_pad divisor stays as it is: the one nearest the given padding, or None."""
    spatial = len(window.kernel)
    k, s, d, begin, end = (
        window.kernel[axis],
        window.strides[axis],
        window.dilations[axis],
        window.pads[axis],
        window.pads[spatial + axis],
    )
    divisors = include_pad_divisors(size, k, s, begin, end, d, out)
    for candidate in sorted(range(end + 1), key=lambda p: end - p):  # only less padding: PyTorch's limit holds
        if onnx_output_size(size, k, s, begin, candidate, d, ceil) != out:
            continue
        if pool_output_size(size, k, s, begin, candidate, d, ceil) != out:
            continue
        if window.include_pad and include_pad_divisors(size, k, s, begin, candidate, d, out) != divisors:
            continue
        return candidate
    return None


def runtime_pool_attributes(node: onnx.NodeProto, input_shape: Sequence[int]) -> tuple[list[int], bool] | None:
    """(pads, ceil_mode) computing the node's windows and divisors at the runtime's size, which ONNX shape inference
    also gives (the node's own where they agree already); None where no such attributes exist."""
    runtime = pool_shape(node, input_shape)
    window = pooling(node)
    if runtime is None or window is None:
        return None
    spatial = len(window.kernel)
    if runtime == inferred_pool_shape(node, input_shape):
        return window.pads, window.ceil
    sizes, outs = list(input_shape[2:]), list(runtime[2:])
    for ceil in (True, False):  # ceil_mode kept where it can be
        ends = [_end_pad(sizes[a], window, a, ceil, outs[a]) for a in range(spatial)]
        if all(e is not None for e in ends):
            return window.pads[:spatial] + [int(e) for e in ends], ceil
    return None


def match_pool_sizes(model: onnx.ModelProto, shapes: Mapping[str, tuple[tuple[int, ...], int]]) -> int:
    """Rewrite (in place) every ceil_mode pooling node whose size ONNX shape inference gets wrong to the attributes
    ``runtime_pool_attributes`` finds, at the static input shapes ``shapes`` (prepare.infer_static_shapes: the
    runtime's sizes), and drop what the model declared after it; returns how many. Such attributes always exist:
    the dropped window starts at or past the input's end, so the last kept one reaches r < pad_end past it, and an
    end padding of max(0, r) in ceil mode (r >= 0) or floor mode (-stride < r < 0) counts exactly the kept windows
    (tests/passes/training/test_pool_sizes.py checks every small case)."""
    rewritten: list[str] = []
    for node in model.graph.node:
        if node.op_type not in POOLS or node.input[0] not in shapes:
            continue
        input_shape = shapes[node.input[0]][0]
        runtime = pool_shape(node, input_shape)
        if runtime is None or runtime == inferred_pool_shape(node, input_shape):
            continue
        found = runtime_pool_attributes(node, input_shape)
        if found is None:  # none exist (see above); the graph keeps the node and onnxruntime's verdict on it
            continue
        pads, ceil = found
        kept = [a for a in node.attribute if a.name not in ("pads", "ceil_mode", "auto_pad")]
        del node.attribute[:]
        node.attribute.extend(kept)
        node.attribute.extend([helper.make_attribute("pads", pads), helper.make_attribute("ceil_mode", int(ceil))])
        rewritten.append(node.output[0])
    drop_declared_after(model.graph, rewritten)
    return len(rewritten)


def drop_declared_after(graph: onnx.GraphProto, names: Sequence[str]) -> None:
    """Remove (in place) the value_info of ``names`` and of everything computed from them: an exporter declares the
    shapes ONNX inferred after such a pool, from the wrong size."""
    downstream = set(names)
    for node in graph.node:  # topological order
        if any(name in downstream for name in node.input):
            downstream.update(name for name in node.output if name)
    keep = [v for v in graph.value_info if v.name not in downstream]
    if len(keep) != len(graph.value_info):
        graph.ClearField("value_info")
        graph.value_info.extend(keep)
