"""bnfuse.ConvInputGrad: the input gradient (dX) of a Conv as one custom op, computed by oneDNN's backward-data
primitive on the CPU, reading the weight as the Conv has it (ONNX's [O, C/G, k...]).

The training pass emits it beside bnfuse.ConvWeightGrad, where oneDNN runs in the process (conv_grad.available())
and the graph may hold bnfuse ops; elsewhere (portable graphs, no oneDNN) the standard-ONNX rules stay
(ConvTranspose, or a Conv of the flipped, channel-swapped weight). It replaces them because they cost more per
step on the shapes of real networks: onnxruntime's ConvTranspose (GEMM + col2im) is 1.3-2.5x oneDNN's backward data
on torchvision resnet18's layers at batch 4, 64x64, and the flipped-weight Conv needs a Slice and a Transpose of the
weight on every step (bench/RESULTS.md). docs/ops.md documents the op. Where oneDNN is absent at run time (a graph
built elsewhere), the kernel computes the same gradient with NumPy (float64, slow).

Computed by the same C core as ConvWeightGrad (bnfuse/runtime/native/onednn_*.c), with its parallelism
(conv_grad.onednn_threads): inside a session the batch (or, where dY is small next to the weight, the input channels
or groups) splits into chunks run on onnxruntime's intra-op pool, each chunk writing its own part of dX (no partial
sums).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from bnfuse.runtime import conv_grad
from bnfuse.runtime.conv_grad import CPU, DOMAIN, F32, Geometry
from bnfuse.runtime.semantics import BatchNormError

OP = "ConvInputGrad"
INPUT_NAMES = ("dY", "W")
OUTPUT_NAMES = ("dX",)


def input_grad(
    dy: np.ndarray, w: np.ndarray, geometry: Geometry, out: np.ndarray | None = None, *, context: Any = None
) -> np.ndarray:
    """dX of ``geometry`` (its x_shape is dX's shape) into ``out`` (float32): oneDNN where available, else NumPy.
    With a kernel ``context`` the chunks run as tasks on its pool, else in order on this thread."""
    if out is None:
        out = np.empty(geometry.x_shape, F32)
    for name, array, wanted in (("dY", dy, geometry.dy_shape), ("W", w, geometry.weight_shape), ("out", out, None)):
        wanted = geometry.x_shape if wanted is None else wanted
        if array.dtype != F32 or not array.flags.c_contiguous or tuple(array.shape) != tuple(wanted):
            raise BatchNormError(f"{OP}: {name} must be a C-contiguous float32 array of shape {tuple(wanted)}")
    if conv_grad.run_core(True, geometry, dy, w, out, 0, context):
        return out
    from bnfuse.runtime import reference

    g = geometry
    out[...] = reference.conv_input_grad(dy, w, g.x_shape[2:], g.strides, g.dilations, g.pads, g.group)
    return out


# -- the custom op ---------------------------------------------------------------------------------------


@dataclass
class ConvInputGradKernel:
    """One node's kernel: its attributes, read once; the geometry checked once per input shapes."""

    node: str
    kernel_shape: tuple[int, ...]
    output_shape: tuple[int, ...]  # dX's spatial shape (the Conv's X)
    strides: tuple[int, ...] | None
    dilations: tuple[int, ...] | None
    pads: tuple[int, ...] | None
    group: int
    _geometries: dict[tuple, Geometry] = field(default_factory=dict, init=False, repr=False)

    def geometry(self, dy_shape: tuple[int, ...], w_shape: tuple[int, ...]) -> Geometry:
        key = (dy_shape, w_shape)
        known = self._geometries.get(key)
        if known is None:
            spatial = len(self.kernel_shape)
            if len(w_shape) != spatial + 2 or tuple(w_shape[2:]) != self.kernel_shape or len(dy_shape) < 1:
                raise BatchNormError(f"{OP}: W {w_shape} must be [O, C/G, *kernel_shape {list(self.kernel_shape)}]")
            known = Geometry(
                (dy_shape[0], w_shape[1] * self.group, *self.output_shape),
                dy_shape,
                self.kernel_shape,
                self.strides or (1,) * spatial,
                self.dilations or (1,) * spatial,
                self.pads or (0,) * (2 * spatial),
                self.group,
            )
            known.check()
            if known.weight_shape != tuple(w_shape):
                raise BatchNormError(f"{OP}: W {w_shape} does not fit dY {dy_shape} and group {self.group}")
            if len(self._geometries) >= 16:
                self._geometries.clear()
            self._geometries[key] = known
        return known

    def compute(self, context: Any) -> None:
        dy, w = context.input_arrays(2)
        geometry = self.geometry(dy.shape, w.shape)
        (dx,) = context.output_arrays((geometry.x_shape,), (F32,))
        input_grad(dy, w, geometry, dx, context=context)


@dataclass(frozen=True)
class ConvInputGradSpec:
    """The registered kernel (CPU, float32) in the shape ortabi.OpSpec describes."""

    name: str = OP
    provider: str = CPU
    input_dtypes: tuple[np.dtype, ...] = (F32, F32)
    output_dtypes: tuple[np.dtype, ...] = (F32,)
    optional_outputs: frozenset[int] = frozenset()

    def create_kernel(self, attributes: Any) -> ConvInputGradKernel:
        node = attributes.node_name()
        kernel_shape = tuple(attributes.ints_attr("kernel_shape", ()))
        output_shape = tuple(attributes.ints_attr("output_shape", ()))
        if not kernel_shape or len(output_shape) != len(kernel_shape):
            raise BatchNormError(
                f"{OP}: attributes kernel_shape and output_shape (dX's spatial shape) are required, of one length "
                f"(node {node!r})"
            )
        optional = {name: tuple(attributes.ints_attr(name, ())) or None for name in ("strides", "dilations", "pads")}
        return ConvInputGradKernel(
            node, kernel_shape, output_shape, group=attributes.int_attr("group", 1), **optional
        )  # fmt: skip


SPECS: tuple[ConvInputGradSpec, ...] = (ConvInputGradSpec(),)


def make_node(
    dy: str,
    w: str,
    dx: str,
    *,
    kernel_shape: Sequence[int],
    output_shape: Sequence[int],
    strides: Sequence[int],
    dilations: Sequence[int],
    pads: Sequence[int],
    group: int,
    name: str = "",
) -> Any:
    """A bnfuse.ConvInputGrad node (onnx.NodeProto): dX (spatial shape ``output_shape``) of a Conv with these
    attributes, from dY and the Conv's weight."""
    from onnx import helper

    return helper.make_node(
        OP,
        [dy, w],
        [dx],
        name=name or dx,
        domain=DOMAIN,
        kernel_shape=list(kernel_shape),
        output_shape=list(output_shape),
        strides=list(strides),
        dilations=list(dilations),
        pads=list(pads),
        group=int(group),
    )
