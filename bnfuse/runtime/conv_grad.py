"""bnfuse.ConvWeightGrad: the weight gradient of a Conv as one custom op, computed by oneDNN on the CPU.

The training pass emits it (instead of its Slice / Pad / Gemm graph rule) where oneDNN can run it
(:func:`available`); docs/ops.md documents the op. oneDNN comes from the ``onednn-cpu-gomp`` wheel: the small
extension ``bnfuse.runtime._onednn`` (bnfuse/runtime/onednn.c) dlopen()s its ``libdnnl.so.3`` at first use,
so nothing links against oneDNN and a process without the wheel never loads it. Where oneDNN is absent at
run time (a graph built elsewhere), the kernel computes the same gradient with NumPy (float64, slow).

``BNFUSE_ONEDNN=0`` in the environment turns oneDNN off for the process: the pass then keeps its graph rule
and the op's kernel uses NumPy. ``BNFUSE_ONEDNN_LIBRARY`` names another libdnnl.so.3 (oneDNN 3.2, OpenMP build:
the release whose enum values onednn.c declares; any other is not used).
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
    if path is None:
        return None
    try:
        from bnfuse.runtime import _onednn  # type: ignore[attr-defined]

        _onednn.load(str(path))
    except (ImportError, OSError, RuntimeError):
        return None
    # onednn.c declares the enum values of oneDNN 3.2's headers; other releases may number them differently
    return _onednn if tuple(_onednn.version()[:2]) == VERIFIED_VERSION else None


def available() -> bool:
    """Whether oneDNN runs ConvWeightGrad in this process."""
    return _extension() is not None


def version() -> tuple[int, int, int] | None:
    """The loaded oneDNN's version, or None."""
    extension = _extension()
    return None if extension is None else extension.version()


_settings = threading.local()
# One OpenMP thread per oneDNN call unless onednn_threads() says otherwise: inside a session, onnxruntime's pool
# already has the cores, and OpenMP workers that spin after each call fight it (measured on 2 shared cores,
# ResNet width 16 step at intra_op_num_threads=2: oneDNN on 2 threads 3.4x the graph rule's step, on 1 thread
# 0.77x; bench/RESULTS.md).
DEFAULT_THREADS = 1


@contextlib.contextmanager
def onednn_threads(count: int) -> Iterator[None]:
    """OpenMP threads of the oneDNN calls this thread makes during the block (default 1; 0: OpenMP's default,
    all cores).
    The calling thread's OpenMP setting is restored after each call: nothing else in the process sees it."""
    previous = getattr(_settings, "threads", DEFAULT_THREADS)
    _settings.threads = max(0, int(count))
    try:
        yield
    finally:
        _settings.threads = previous


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

    def exact_end_pads(self) -> tuple[int, ...]:
        """End pads that make the geometry exact (oneDNN requires it): input past the last window is unused,
        so the end pad shrinks by it, possibly below zero (oneDNN crops then)."""
        spatial = len(self.kernel_shape)
        return tuple(
            (self.dy_shape[2 + i] - 1) * self.strides[i]
            + self.dilations[i] * (self.kernel_shape[i] - 1)
            + 1
            - self.x_shape[2 + i]
            - self.pads[i]
            for i in range(spatial)
        )


def weight_grad(
    x: np.ndarray, dy: np.ndarray, geometry: Geometry, out: np.ndarray | None = None, *, x_block: int = 0
) -> np.ndarray:
    """dW of ``geometry`` into ``out`` (float32): oneDNN where available, else NumPy (x_block: NumPy needs plain
    NCHW). Plans are cached per geometry."""
    if out is None:
        out = np.empty(geometry.weight_shape, F32)
    for name, array, shape in (("X", x, geometry.x_shape), ("dY", dy, geometry.dy_shape), ("out", out, None)):
        wanted = geometry.weight_shape if shape is None else shape
        if array.dtype != F32 or not array.flags.c_contiguous or tuple(array.shape) != tuple(wanted):
            raise BatchNormError(f"{OP}: {name} must be a C-contiguous float32 array of shape {tuple(wanted)}")
    threads = getattr(_settings, "threads", DEFAULT_THREADS)
    plan = _plan(geometry, x_block, threads) if available() else None
    if plan is None:
        if x_block:
            raise BatchNormError(f"{OP}: a blocked (NCHWc) X needs oneDNN")
        from bnfuse.runtime import reference

        g = geometry
        out[...] = reference.conv_weight_grad(x, dy, g.kernel_shape, g.strides, g.dilations, g.pads, g.group)
        return out
    with _run_lock:  # a plan's buffers and the one oneDNN stream serve one call at a time
        _extension().run(
            plan,
            x.__array_interface__["data"][0],
            dy.__array_interface__["data"][0],
            out.__array_interface__["data"][0],
            threads,
        )
    return out


_run_lock = threading.Lock()


@functools.lru_cache(maxsize=256)
def _plan(geometry: Geometry, x_block: int, threads: int) -> Any:
    """A oneDNN plan; per thread count, since oneDNN splits the work at creation by the count it sees then."""
    g = geometry
    spatial = len(g.kernel_shape)
    weight = g.weight_shape
    try:
        return _extension().plan(
            g.x_shape, g.dy_shape, weight, g.strides, g.dilations, g.pads[:spatial], g.exact_end_pads(), g.group,
            x_block, 0, threads,
        )  # fmt: skip
    except RuntimeError:  # a geometry oneDNN has no implementation for: NumPy computes it
        return None


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
            if len(self._geometries) >= 16:
                self._geometries.clear()
            self._geometries[key] = known
        return known

    def compute(self, context: Any) -> None:
        x, dy = context.input_arrays(2)
        geometry = self.geometry(x.shape, dy.shape)
        (dw,) = context.output_arrays((geometry.weight_shape,), (F32,))
        weight_grad(x, dy, geometry, dw)


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
        return ConvWeightGradKernel(
            attributes.node_name(), kernel_shape, group=attributes.int_attr("group", 1), **optional
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
) -> Any:
    """A bnfuse.ConvWeightGrad node (onnx.NodeProto)."""
    from onnx import helper

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
    )
