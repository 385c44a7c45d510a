"""bnfuse.ConvWeightGrad: the weight gradient of a Conv as one custom op, computed by oneDNN on the CPU.

The training pass emits it (instead of its Slice / Pad / Gemm graph rule) where oneDNN can run it
(:func:`available`); docs/ops.md documents the op. The gradient is computed by the Python-free C core in
bnfuse/runtime/native/onednn_*.c (onednn_conv.h: geometry, plans, chunking over the host's threads, workspaces),
the same code the native custom-op library runs; this module holds the op's attributes, shape checks and the NumPy
fallback and calls the core through the small extension ``bnfuse.runtime._onednn`` (bnfuse/runtime/onednn.c). The
core dlopen()s the ``onednn-cpu-gomp`` wheel's ``libdnnl.so.3`` at first use, so nothing links against oneDNN and
a process without the wheel never loads it. Where oneDNN is absent at run time (a graph built elsewhere), the
kernel computes the same gradient with NumPy (float64, slow).

``BNFUSE_ONEDNN=0`` in the environment turns oneDNN off for the process: the pass then keeps its graph rule
and the op's kernel uses NumPy. ``BNFUSE_ONEDNN_LIBRARY`` names another libdnnl.so.3 (oneDNN 3.2, OpenMP build:
the release whose enum values the core declares; any other is refused). Without the wheel, the core tries the
dynamic loader's ``libdnnl.so.3`` (a system install).
"""

from __future__ import annotations

import contextlib
import functools
import os
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from bnfuse.runtime.semantics import BatchNormError

DOMAIN = "bnfuse"
OP = "ConvWeightGrad"
CPU = "CPUExecutionProvider"
F32 = np.dtype(np.float32)
INPUT_NAMES = ("X", "dY")
OUTPUT_NAMES = ("dW",)
WHEEL = "onednn-cpu-gomp"
LIBRARY = "libdnnl.so.3"
VERIFIED_VERSION = (3, 2)  # onednn-cpu-gomp 2023.2


# -- finding and loading oneDNN ----------------------------------------------------------------------------


def library_path() -> Path | None:
    """libdnnl.so.3 of the installed ``onednn-cpu-gomp`` wheel (its files go to <prefix>/lib), else None."""
    override = os.environ.get("BNFUSE_ONEDNN_LIBRARY")
    if override:
        return Path(override)
    from importlib import metadata

    try:
        files = metadata.distribution(WHEEL).files or []
    except metadata.PackageNotFoundError:
        return None
    for entry in files:
        if entry.name == LIBRARY:
            path = Path(str(entry.locate())).resolve()
            if path.is_file():
                return path
    return None


@functools.cache
def _extension() -> Any:
    """The loaded ``_onednn`` extension, or None where it is not built, oneDNN is missing or turned off."""
    if os.environ.get("BNFUSE_ONEDNN", "1").strip().lower() in ("0", "false", "no", "off"):
        return None
    path = library_path()
    try:
        from bnfuse.runtime import _onednn  # type: ignore[attr-defined]

        _onednn.load(None if path is None else str(path))  # None: the dynamic loader's search
    except (ImportError, OSError, RuntimeError):
        return None
    # the core declares the enum values of oneDNN 3.2's headers (and refuses other releases)
    return _onednn if tuple(_onednn.version()[:2]) == VERIFIED_VERSION else None


def available() -> bool:
    """Whether oneDNN runs ConvWeightGrad in this process."""
    return _extension() is not None


def version() -> tuple[int, int, int] | None:
    """The loaded oneDNN's version, or None."""
    extension = _extension()
    return None if extension is None else extension.version()


_settings = threading.local()
# One thread per gradient unless onednn_threads() says otherwise. Inside a session the op's parallel form is
# chunks (of the batch, the channels or the groups) on onnxruntime's own intra-op pool, one OpenMP thread each:
# OpenMP workers beside ORT's pool spin after each call and fight it (measured on 2 shared cores, ResNet width 16
# step at intra_op_num_threads=2: oneDNN on 2 OpenMP threads 3.4x the graph rule's step, on 1 thread 0.77x;
# bench/RESULTS.md). TrainingSession sets the count to its intra-op thread count.
DEFAULT_THREADS = 1


@contextlib.contextmanager
def onednn_threads(count: int) -> Iterator[None]:
    """Parallelism of the convolution gradients this thread computes during the block (default 1): the oneDNN core
    splits a gradient into chunks fixed by the shape and ``count`` (:func:`split`: the batch, or the channels or
    groups where the activations are small next to the weight), one oneDNN thread each. Inside an onnxruntime
    session the chunks run as tasks on the session's intra-op pool, and a batch-split weight gradient adds the
    chunks' partial sums in chunk order (the bits depend on the count, not on the pool); called directly
    (:func:`weight_grad` without a context) they run in order on this thread. 0: one oneDNN call on OpenMP's own
    team (all cores), the calling thread's OpenMP setting restored after it."""
    previous = getattr(_settings, "threads", DEFAULT_THREADS)
    _settings.threads = max(0, int(count))
    try:
        yield
    finally:
        _settings.threads = previous


def current_threads() -> int:
    """The parallelism onednn_threads() set for this thread (DEFAULT_THREADS outside it)."""
    return getattr(_settings, "threads", DEFAULT_THREADS)


# -- geometry ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Geometry:
    """One weight gradient: X [N, C, in...], dY [N, O, out...] -> dW [O, C/G, kernel...] (ONNX Conv attributes)."""

    x_shape: tuple[int, ...]
    dy_shape: tuple[int, ...]
    kernel_shape: tuple[int, ...]
    strides: tuple[int, ...]
    dilations: tuple[int, ...]
    pads: tuple[int, ...]
    group: int

    @property
    def weight_shape(self) -> tuple[int, ...]:
        return (self.dy_shape[1], self.x_shape[1] // self.group, *self.kernel_shape)

    def check(self) -> None:
        """Raise BatchNormError naming what does not fit (the shapes must be those of the Conv's X and Y)."""
        spatial = len(self.kernel_shape)
        x, dy = self.x_shape, self.dy_shape
        if not 1 <= spatial <= 3 or len(x) != spatial + 2 or len(dy) != spatial + 2:
            raise BatchNormError(f"{OP}: X {x} and dY {dy} must both have rank len(kernel_shape) + 2 (3 to 5)")
        lists = {"strides": self.strides, "dilations": self.dilations}
        for name, values in lists.items():
            if len(values) != spatial or any(v < 1 for v in values):
                raise BatchNormError(f"{OP}: {name} must be {spatial} values >= 1, got {list(values)}")
        if len(self.pads) != 2 * spatial or any(p < 0 for p in self.pads):
            raise BatchNormError(f"{OP}: pads must be {2 * spatial} values >= 0, got {list(self.pads)}")
        if self.group < 1 or x[1] % self.group or dy[1] % self.group or x[0] != dy[0]:
            raise BatchNormError(f"{OP}: X {x}, dY {dy} and group {self.group} do not fit (batch, channels / group)")
        expected = tuple(self.output_size(i) for i in range(spatial))
        if tuple(dy[2:]) != expected:
            raise BatchNormError(f"{OP}: dY has spatial shape {tuple(dy[2:])}, the Conv gives {expected}")

    def output_size(self, axis: int) -> int:
        spatial = len(self.kernel_shape)
        extent = self.x_shape[2 + axis] + self.pads[axis] + self.pads[axis + spatial]
        return (extent - self.dilations[axis] * (self.kernel_shape[axis] - 1) - 1) // self.strides[axis] + 1

    def core_values(self, x_block: int = 0) -> list[int]:
        """The geometry as the oneDNN core's bnfuse_conv_geometry fields (native/onednn_conv.h), flattened."""
        spatial, x, dy = len(self.kernel_shape), self.x_shape, self.dy_shape

        def padded(values: Sequence[int]) -> list[int]:
            return [*values, *(0,) * (MAX_SPATIAL - len(values))]

        return [
            spatial, x[0], x[1], dy[1], self.group,
            *padded(x[2:]), *padded(dy[2:]), *padded(self.kernel_shape), *padded(self.strides),
            *padded(self.dilations), *padded(self.pads[:spatial]), *padded(self.pads[spatial:]), x_block,
        ]  # fmt: skip


MAX_SPATIAL = 3  # onednn_conv.h's BNFUSE_ONEDNN_MAX_SPATIAL
# How a call splits its work (onednn_conv.h's BNFUSE_ONEDNN_SPLIT_*): images, channels, groups.
SPLIT_BATCH, SPLIT_CHANNELS, SPLIT_GROUPS = 0, 1, 2


def split(geometry: Geometry, threads: int, *, input_grad: bool = False) -> tuple[int, tuple[int, ...]]:
    """(axis, chunk extents) of a gradient of ``geometry`` run on ``threads`` threads: the core's choice
    (bnfuse_onednn_split), fixed by the shape and the thread count. Needs oneDNN."""
    axis, sizes = _extension().split(geometry.core_values(), input_grad, threads)
    return axis, tuple(sizes)


def weight_grad(
    x: np.ndarray,
    dy: np.ndarray,
    geometry: Geometry,
    out: np.ndarray | None = None,
    *,
    x_block: int = 0,
    context: Any = None,
) -> np.ndarray:
    """dW of ``geometry`` into ``out`` (float32): oneDNN where available, else NumPy (x_block: NumPy needs plain
    NCHW). With a kernel ``context`` the chunks run as tasks on its pool (``context.parallel_for``: onnxruntime's
    intra-op pool in a session), else in order on this thread; the bits depend on current_threads() only."""
    if out is None:
        out = np.empty(geometry.weight_shape, F32)
    for name, array, shape in (("X", x, geometry.x_shape), ("dY", dy, geometry.dy_shape), ("out", out, None)):
        wanted = geometry.weight_shape if shape is None else shape
        if array.dtype != F32 or not array.flags.c_contiguous or tuple(array.shape) != tuple(wanted):
            raise BatchNormError(f"{OP}: {name} must be a C-contiguous float32 array of shape {tuple(wanted)}")
    if run_core(False, geometry, x, dy, out, x_block, context):
        return out
    if x_block:
        raise BatchNormError(f"{OP}: a blocked (NCHWc) X needs oneDNN")
    from bnfuse.runtime import reference

    g = geometry
    out[...] = reference.conv_weight_grad(x, dy, g.kernel_shape, g.strides, g.dilations, g.pads, g.group)
    return out


def run_core(
    input_grad: bool, geometry: Geometry, first: np.ndarray, second: np.ndarray, out: np.ndarray, x_block: int,
    context: Any,
) -> bool:  # fmt: skip
    """One gradient on the oneDNN core: (X, dY) -> dW, or (dY, W) -> dX for input_grad; False where oneDNN is
    absent or has no implementation for the geometry (the core remembers which; the caller computes it with
    NumPy)."""
    extension = _extension()
    if extension is None:
        return False
    call = extension.input_grad if input_grad else extension.weight_grad
    try:
        call(
            _core_values(geometry, x_block),
            _address(first),
            _address(second),
            _address(out),
            current_threads(),
            context,
        )
    except NotImplementedError:
        return False
    return True


@functools.lru_cache(maxsize=1024)
def _core_values(geometry: Geometry, x_block: int) -> tuple[int, ...]:
    return tuple(geometry.core_values(x_block))


def _address(array: np.ndarray) -> int:
    return array.__array_interface__["data"][0]


def workspace_bytes() -> int:
    """Bytes the gradients' shared workspaces hold now: oneDNN's layouts of the operands and its scratchpads, one
    per thread whatever the number of cached geometries (the largest call's), and the weight gradient's partial
    sums."""
    extension = _extension()
    return 0 if extension is None else extension.workspace_bytes()


def release_workspaces() -> None:
    """Free the shared workspaces (the next gradient allocates what it needs again)."""
    extension = _extension()
    if extension is not None:
        extension.release_workspaces()


# -- the custom op ---------------------------------------------------------------------------------------


@dataclass
class ConvWeightGradKernel:
    """One node's kernel: its attributes, read once; the geometry checked once per input shapes."""

    node: str
    kernel_shape: tuple[int, ...]
    strides: tuple[int, ...] | None
    dilations: tuple[int, ...] | None
    pads: tuple[int, ...] | None
    group: int
    x_block: int = 0  # X in onnxruntime's NCHWc layout with this channel block (8 or 16), else plain NCHW
    _geometries: dict[tuple, Geometry] = field(default_factory=dict, init=False, repr=False)

    def geometry(self, x_shape: tuple[int, ...], dy_shape: tuple[int, ...]) -> Geometry:
        key = (x_shape, dy_shape)
        known = self._geometries.get(key)
        if known is None:
            spatial = len(self.kernel_shape)
            known = Geometry(
                x_shape,
                dy_shape,
                self.kernel_shape,
                self.strides or (1,) * spatial,
                self.dilations or (1,) * spatial,
                self.pads or (0,) * (2 * spatial),
                self.group,
            )
            known.check()
            if self.x_block and (x_shape[1] % self.x_block or self.group != 1 or len(x_shape) != 4):
                raise BatchNormError(
                    f"{OP}: a blocked X (x_block {self.x_block}) must be 2-D, ungrouped, with channels a multiple of "
                    f"the block; got X {x_shape}, group {self.group}"
                )
            if len(self._geometries) >= 16:
                self._geometries.clear()
            self._geometries[key] = known
        return known

    def compute(self, context: Any) -> None:
        x, dy = context.input_arrays(2)
        geometry = self.geometry(x.shape, dy.shape)
        (dw,) = context.output_arrays((geometry.weight_shape,), (F32,))
        weight_grad(x, dy, geometry, dw, x_block=self.x_block, context=context)


@dataclass(frozen=True)
class ConvWeightGradSpec:
    """The registered kernel (CPU, float32) in the shape ortabi.OpSpec describes."""

    name: str = OP
    provider: str = CPU
    input_dtypes: tuple[np.dtype, ...] = (F32, F32)
    output_dtypes: tuple[np.dtype, ...] = (F32,)
    optional_outputs: frozenset[int] = frozenset()

    def create_kernel(self, attributes: Any) -> ConvWeightGradKernel:
        kernel_shape = tuple(attributes.ints_attr("kernel_shape", ()))
        if not kernel_shape:
            raise BatchNormError(f"{OP}: attribute kernel_shape is required (node {attributes.node_name()!r})")
        optional = {name: tuple(attributes.ints_attr(name, ())) or None for name in ("strides", "dilations", "pads")}
        x_block = attributes.int_attr("x_block", 0)
        if x_block not in (0, 8, 16):
            raise BatchNormError(f"{OP}: x_block must be 0 (plain NCHW X), 8 or 16, got {x_block}")
        return ConvWeightGradKernel(
            attributes.node_name(), kernel_shape, group=attributes.int_attr("group", 1), x_block=x_block, **optional
        )


SPECS: tuple[ConvWeightGradSpec, ...] = (ConvWeightGradSpec(),)


def make_node(
    x: str,
    dy: str,
    dw: str,
    *,
    kernel_shape: Sequence[int],
    strides: Sequence[int],
    dilations: Sequence[int],
    pads: Sequence[int],
    group: int,
    name: str = "",
    x_block: int = 0,
) -> Any:
    """A bnfuse.ConvWeightGrad node (onnx.NodeProto); x_block: X in onnxruntime's NCHWc layout (needs oneDNN)."""
    from onnx import helper

    blocked = {"x_block": int(x_block)} if x_block else {}
    return helper.make_node(
        OP,
        [x, dy],
        [dw],
        name=name or dw,
        domain=DOMAIN,
        kernel_shape=list(kernel_shape),
        strides=list(strides),
        dilations=list(dilations),
        pads=list(pads),
        group=int(group),
        **blocked,
    )
