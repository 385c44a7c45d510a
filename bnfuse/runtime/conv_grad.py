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
from collections.abc import Callable, Iterator, Sequence
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
# One thread per weight gradient unless onednn_threads() says otherwise. Inside a session the op's parallel form
# is batch chunks on onnxruntime's own intra-op pool (one OpenMP thread each): OpenMP workers beside ORT's pool spin
# after each call and fight it (measured on 2 shared cores, ResNet width 16 step at intra_op_num_threads=2: oneDNN
# on 2 OpenMP threads 3.4x the graph rule's step, on 1 thread 0.77x; bench/RESULTS.md). TrainingSession sets the
# count to its intra-op thread count.
DEFAULT_THREADS = 1


@contextlib.contextmanager
def onednn_threads(count: int) -> Iterator[None]:
    """Parallelism of the weight gradients this thread computes during the block (default 1). Inside an
    onnxruntime session: the op splits the batch into ``count`` chunks (fewer for a smaller batch), runs them as
    tasks on the session's intra-op pool and adds the partial gradients in chunk order (the bits depend on the
    count, not on the pool). Called directly (:func:`weight_grad`): ``count`` OpenMP threads for oneDNN (0:
    OpenMP's default, all cores), the calling thread's OpenMP setting restored after each call."""
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
    threads = current_threads()
    plan = _plan(geometry, x_block, threads) if available() else None
    if plan is None:
        if x_block:
            raise BatchNormError(f"{OP}: a blocked (NCHWc) X needs oneDNN")
        from bnfuse.runtime import reference

        g = geometry
        out[...] = reference.conv_weight_grad(x, dy, g.kernel_shape, g.strides, g.dilations, g.pads, g.group)
        return out
    run_plan(plan, x, dy, out, threads)
    return out


def run_plan(plan: Any, first: np.ndarray, second: np.ndarray, out: np.ndarray, threads: int) -> None:
    """One oneDNN call of ``plan``: (X, dY) -> dW for WEIGHTS, (dY, W) -> dX for DATA."""
    with _run_lock:  # the workspaces and the one oneDNN stream serve one call at a time
        _extension().run(
            plan, _address(first), _address(second), _address(out), threads,
            _workspace(0, _extension().workspace_size(plan)),
        )  # fmt: skip


def _address(array: np.ndarray) -> int:
    return array.__array_interface__["data"][0]


def chunk_addresses(array: np.ndarray, sizes: tuple[int, ...]) -> list[int]:
    """Where each batch chunk of ``sizes`` images starts in ``array`` (C-contiguous, batch first)."""
    step = array.nbytes // sum(sizes)
    return [_address(array) + start * step for start in np.cumsum((0, *sizes[:-1])).tolist()]


def run_job(
    context: Any,
    job: _Job,
    first: list[int],
    second: list[int],
    outputs: list[int],
    slots: int,
    finish: Callable[[], None] | None = None,
) -> None:
    """Run ``job``'s chunks on the kernel context's pool (``context.parallel_for``: onnxruntime's intra-op pool in a
    session) with these per-chunk addresses and ``slots`` workspaces; ``finish`` runs before the lock is released."""
    extension = _extension()
    with _run_lock:  # the job's plans (and partial buffers) and the workspaces serve one call at a time
        workspaces = [_workspace(slot, job.workspace) for slot in range(min(slots, len(job.sizes)))]
        address = extension.bind_job(job.handle, first, second, outputs, workspaces)
        context.parallel_for(extension.chunk_function(), len(job.sizes), address)
        extension.job_check(job.handle)
        if finish is not None:
            finish()


def pool_split(geometry: Geometry) -> tuple[int, int]:
    """(workspace slots, batch chunks) of a gradient run in a kernel: one chunk where oneDNN runs its own team."""
    threads = current_threads()  # 0: oneDNN's own OpenMP team, one call
    slots = max(1, min(threads, geometry.x_shape[0]))
    return slots, (chunk_count(geometry, slots) if threads else 1)


_run_lock = threading.Lock()
_WORKSPACE_ALIGN = 64
_workspaces: list[np.ndarray] = []  # per chunk slot; only used under _run_lock


def _workspace(slot: int, nbytes: int) -> int:
    """The address of chunk slot ``slot`` 's workspace, at least ``nbytes`` (64-byte aligned): oneDNN's blocked
    copies of X and dY and its scratchpads for one run. Every plan shares the slots (runs hold _run_lock, and chunks
    of one job use different slots), so the memory held between steps is the largest run's, not one copy of X and
    dY per cached geometry. Call under _run_lock."""
    while len(_workspaces) <= slot:
        _workspaces.append(np.empty(0, np.uint8))
    if _workspaces[slot].nbytes < nbytes + _WORKSPACE_ALIGN:
        _workspaces[slot] = np.empty(0, np.uint8)  # the old one goes first: never both at once
        _workspaces[slot] = np.empty(nbytes + _WORKSPACE_ALIGN, np.uint8)
    address = _workspaces[slot].__array_interface__["data"][0]
    return address + (-address) % _WORKSPACE_ALIGN


def workspace_bytes() -> int:
    """Bytes the weight gradients' shared workspaces hold now (see _workspace)."""
    return sum(w.nbytes for w in _workspaces)


def release_workspaces() -> None:
    """Free the shared workspaces (the next weight gradient allocates what it needs again)."""
    with _run_lock:
        _workspaces.clear()


def batch_chunks(batch: int, chunks: int) -> tuple[int, ...]:
    """Sizes of ``chunks`` consecutive batch slices covering ``batch`` (the first ``batch % chunks`` one larger)."""
    base, extra = divmod(batch, chunks)
    return tuple(base + (index < extra) for index in range(chunks))


# A batch chunk's X and dY together stay under this (one chunk per pool thread below it): the workspace then holds
# oneDNN's copies of that much per thread, not of the whole batch (at width 32, batch 128, 64x64: 32 MiB, not 128).
CHUNK_BYTES = 16 * 2**20


def chunk_count(geometry: Geometry, slots: int) -> int:
    """Batch chunks of a weight gradient run on ``slots`` pool threads: ``slots``, or the next multiple of it that
    keeps a chunk's X and dY under CHUNK_BYTES (never more chunks than images, or than a job takes)."""
    batch = geometry.x_shape[0]
    per_image = 4 * (int(np.prod(geometry.x_shape[1:])) + int(np.prod(geometry.dy_shape[1:])))
    wanted = -(-batch * per_image // CHUNK_BYTES)
    chunks = max(slots, -(-wanted // slots) * slots)
    return max(1, min(chunks, batch, MAX_CHUNKS))


MAX_CHUNKS = 64  # onednn.c's


@dataclass
class _Job:
    """A weight gradient split over the batch: a oneDNN plan per chunk (own buffers and stream), the job that runs
    them from a thread pool, the partial-gradient buffers of chunks 1.. (chunk 0 writes the output) and the
    workspace bytes each chunk slot needs (the largest plan's)."""

    plans: tuple[Any, ...]
    handle: Any
    sizes: tuple[int, ...]
    partials: tuple[np.ndarray, ...]
    workspace: int


# onednn.c's plan kinds: the weight gradient (run(plan, x, dy, dw)) and the input gradient (run(plan, dy, w, dx))
WEIGHTS, DATA = 0, 1


@functools.lru_cache(maxsize=64)
def _job(geometry: Geometry, x_block: int, chunks: int, kind: int = WEIGHTS) -> _Job | None:
    """A batch-chunked job; for the input gradient (DATA) each chunk writes its own rows of dX: no partials."""
    sizes = batch_chunks(geometry.x_shape[0], chunks)
    plans = []
    for index, size in enumerate(sizes):
        part = Geometry(
            (size, *geometry.x_shape[1:]), (size, *geometry.dy_shape[1:]), geometry.kernel_shape, geometry.strides,
            geometry.dilations, geometry.pads, geometry.group,
        )  # fmt: skip
        plan = _plan.__wrapped__(part, x_block, 1, kind)  # a plan per chunk, not shared: chunks run side by side
        if plan is None:
            return None
        plans.append(plan)
        del index
    handle = _extension().job(plans)
    partials = tuple(np.empty(geometry.weight_shape, F32) for _ in sizes[1:]) if kind == WEIGHTS else ()
    workspace = max(_extension().workspace_size(plan) for plan in plans)
    return _Job(tuple(plans), handle, sizes, partials, workspace)


def pooled_weight_grad(
    context: Any,
    x: np.ndarray,
    dy: np.ndarray,
    geometry: Geometry,
    out: np.ndarray,
    chunks: int,
    *,
    x_block: int = 0,
    slots: int | None = None,
) -> bool:
    """dW into ``out`` as ``chunks`` batch chunks run on the kernel context's thread pool
    (``context.parallel_for``, onnxruntime's intra-op pool inside a session), with ``slots`` workspaces (default:
    one per chunk; fewer when no more than that many chunks run at once); False where oneDNN has no plan for the
    geometry (the caller computes it another way)."""
    job = _job(geometry, x_block, chunks)
    if job is None:
        return False

    def add_partials() -> None:
        for partial in job.partials:  # in chunk order: the same bits whatever thread ran which chunk
            np.add(out, partial, out=out)

    targets = [_address(target) for target in (out, *job.partials)]
    run_job(
        context, job, chunk_addresses(x, job.sizes), chunk_addresses(dy, job.sizes), targets, slots or chunks,
        add_partials,
    )  # fmt: skip
    return True


@functools.lru_cache(maxsize=256)
def _plan(geometry: Geometry, x_block: int, threads: int, kind: int = WEIGHTS) -> Any:
    """A oneDNN plan (``kind``: WEIGHTS or DATA); per thread count, since oneDNN splits the work at creation by the
    count it sees then."""
    g = geometry
    spatial = len(g.kernel_shape)
    weight = g.weight_shape
    try:
        return _extension().plan(
            g.x_shape, g.dy_shape, weight, g.strides, g.dilations, g.pads[:spatial], g.exact_end_pads(), g.group,
            x_block, 0, threads, kind,
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
        slots, chunks = pool_split(geometry)
        block = self.x_block
        if (
            chunks > 1
            and available()
            and pooled_weight_grad(context, x, dy, geometry, dw, chunks, x_block=block, slots=slots)
        ):
            return
        weight_grad(x, dy, geometry, dw, x_block=block)


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
