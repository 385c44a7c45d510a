"""Fast CPU BN kernels: C (bnfuse/runtime/cpu{reduce,loops,serial}.c), parallel over channels (or fixed row chunks),
deterministic, stable. This module checks and converts the arguments and calls the C code.

The input is viewed as (outer, channels, inner) (kernel_types.Layout). Two loop shapes:

* channels-first (inner >= _MIN_INNER, e.g. NCHW): tasks over channel ranges; each channel's statistics
  are two-pass (mean, then sum of squared deviations: stable for |mean| >> std) and, fused, the channel
  is normalized (or its dX computed) right away while its data is still in L2.
* rows (small inner: NHWC, per-activation, (N, C)): the tensor is (rows, F) with F = channels * inner;
  a fixed number of row chunks (from the shape, never from the thread count) run as tasks, each producing
  per-column partial sums that are then added in chunk order.

Threads: every parallel loop is a C task ``void task(void **data, size_t index)`` (cpu_pool.py). Inside an
onnxruntime session (:func:`on_pool`: the Python glue) the tasks run on the session's own intra-op pool; called
directly they run on the C extension's small pthread pool (the caller's thread takes tasks too;
:func:`kernel_threads` sets how many threads, per calling thread; GIL released). No OpenMP runtime and no other
library's thread setting is involved. Inputs under SERIAL_BELOW_BYTES are one serial C call (serial_inference /
_training / _backward) running the same loops in the same order, so the bits do not depend on the path; the native
custom-op library (native/bn_ops.c) calls the same serial code.

Determinism: no atomics; every sum has one order fixed by the shape and the compiled code, so repeated
runs are bitwise identical whatever the thread count. The channel reductions run in vector lanes added in a
fixed tree, AVX-512, AVX2 or portable code picked once per process (cpureduce.c; ``_cpukernels.reductions()``);
NaN and Inf propagate. Results may differ in the last bits between CPUs with different vector widths, never
between runs. Elementwise kernels are strict IEEE. Accumulation is float64; x and y are float32 inside the
kernels (16-bit I/O is converted at the edges). Measured against the numba kernels they replace:
bench/RESULTS.md, "BN CPU kernels: C against numba".
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Callable, Iterator

import numpy as np

from bnfuse.runtime import _cpukernels, cpu_pool, reference
from bnfuse.runtime.kernel_types import (
    GradOutputs,
    Layout,
    TrainingOutputs,
    unbiased_factor,
    validate_backward,
    validate_inference,
    validate_training,
)
from bnfuse.runtime.semantics import BatchNormConfig

UNBIASED, FIX_GAMMA, GLOBAL_STATS, RELU = 1, 2, 4, 8  # the C kernels' flags (native/cpukernels.h)
DATA_DTYPES = ("float16", "float32", "bfloat16")  # 16-bit types are converted to float32 at the edges
_MIN_INNER = 32  # below this, per-channel rows are too short for the channels-first loops
_ROW_BLOCK_ELEMENTS = 16384  # rows path: at least this many elements per parallel chunk
_MAX_CHUNKS = 64
# Below this many input bytes the kernels run on one thread: waking the pool's workers costs more than the
# work, and on a busy 2-core machine a worker waiting for its core costs a scheduler time slice.
SERIAL_BELOW_BYTES = 256 * 1024
# Inside an onnxruntime session (on_pool): below POOL_FROM_BYTES the entry library's C path runs the serial
# functions (no Python at all); from there the parallel loops run as tasks on the session's pool, the row-chunk
# loops only from POOL_ROWS_FROM_BYTES. Measured on 2 cores, one op in a session at intra_op_num_threads=2, the
# other core partly busy (load 1.2): the serial C path won up to 2 MiB (32x16x32x32 training 0.22 ms vs 0.29 ms on
# the pool; 1024x512 0.30 vs 0.47), tied at 4 MiB channels-first (training 0.44 vs 0.43, grad 0.72 vs 0.53 for
# the pool) and still won at 4 MiB on the rows path (2048x512 grad 0.74 vs 0.88).
POOL_FROM_BYTES = 4 * 1024 * 1024
POOL_ROWS_FROM_BYTES = 8 * 1024 * 1024
_ROWS_LOOPS = frozenset({"column_sums", "grad_sums_rows", "affine_rows", "dx_rows"})


# -- views and plumbing -------------------------------------------------------------------------------------


def _flags(config: BatchNormConfig) -> int:
    """The C kernels' flags word."""
    return (
        UNBIASED * bool(config.unbiased_running_var)
        + FIX_GAMMA * bool(config.fix_gamma)
        + GLOBAL_STATS * bool(config.use_global_stats)
        + RELU * (config.activation == "relu")
    )


def _channels_first(lay: Layout) -> bool:
    return lay.inner >= _MIN_INNER


def _rows_geometry(lay: Layout) -> tuple[int, int, int]:
    """(rows, width, rows per block) of the rows view; width = channels * inner."""
    width = lay.channels * lay.inner
    return lay.outer, width, max(1, _ROW_BLOCK_ELEMENTS // width)


def _chunks(rows: int, rows_per_block: int) -> int:
    """Parallel row chunks: a function of the shape only, so the summation order never changes."""
    return max(1, min(_MAX_CHUNKS, -(-rows // rows_per_block)))


def _data32(array: np.ndarray, lay: Layout) -> np.ndarray:
    """A C-contiguous float32 (outer, C, inner) view of the data (copy only if it must)."""
    return np.ascontiguousarray(array, dtype=np.float32).reshape(lay.outer, lay.channels, lay.inner)


def _per_channel(param: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(param, dtype=np.float64).reshape(-1)


class _Sink:
    """Where a data-shaped float32 result is computed: ``out`` itself when it is float32 and contiguous."""

    def __init__(self, out: np.ndarray | None, shape: tuple[int, ...], dtype: np.dtype, lay: Layout, prior: bool):
        self.out = out
        self.dtype = dtype
        direct = out is not None and out.dtype == np.float32 and out.flags.c_contiguous
        if direct:
            self.buffer = out
        elif prior:
            self.buffer = np.ascontiguousarray(out, dtype=np.float32)
        else:
            self.buffer = np.empty(shape, np.float32)
        self.view = self.buffer.reshape(lay.outer, lay.channels, lay.inner)

    def result(self) -> np.ndarray:
        if self.out is None:
            return self.buffer if self.dtype == np.float32 else self.buffer.astype(self.dtype)
        if self.buffer is not self.out:
            self.out[...] = self.buffer
        return self.out


def _store(value: np.ndarray, dtype: np.dtype, out: np.ndarray | None, shape: tuple[int, ...]) -> np.ndarray:
    value = value.reshape(shape)
    if out is None:
        return value.astype(dtype)
    out[...] = value
    return out


def _blend_param(value: np.ndarray, alpha: float, beta: float, prior: np.ndarray | None) -> np.ndarray:
    result = alpha * value
    if beta != 0:
        result = result + beta * np.asarray(prior, dtype=np.float64).reshape(-1)
    return result


def _affine(
    x3: np.ndarray, lay: Layout, center, mul, add, alpha: float, beta: float, sink: _Sink, relu: bool = False
) -> None:
    if _channels_first(lay):
        _parallel(
            "affine_channels_first", x3, center, mul, add, float(alpha), float(beta),
            sink.view, fused=(6, (relu,)),
        )  # fmt: skip
        return
    rows, width, rows_per_block = _rows_geometry(lay)
    _parallel(
        "affine_rows",
        x3.reshape(rows, width),
        np.repeat(center, lay.inner),
        np.repeat(mul, lay.inner),
        np.repeat(add, lay.inner),
        float(alpha),
        float(beta),
        _chunks(rows, rows_per_block),
        sink.view.reshape(rows, width),
        fused=(6, (relu,)),
    )


def _statistics(x3: np.ndarray, lay: Layout) -> tuple[np.ndarray, np.ndarray]:
    """Per-channel float64 mean and biased variance on the rows path (two-pass: stable for |mean| >> std)."""
    rows, width, rows_per_block = _rows_geometry(lay)
    x2 = x3.reshape(rows, width)
    chunks = _chunks(rows, rows_per_block)
    col = np.empty(width)
    _parallel("column_sums", x2, np.zeros(width), False, chunks, col)
    mean = col.reshape(lay.channels, lay.inner).sum(axis=1) / lay.count
    _parallel("column_sums", x2, np.repeat(mean, lay.inner), True, chunks, col)
    return mean, col.reshape(lay.channels, lay.inner).sum(axis=1) / lay.count


def _gamma(scale: np.ndarray, config: BatchNormConfig) -> np.ndarray:
    return np.ones_like(scale) if config.fix_gamma else scale


_local = threading.local()  # per calling thread: the pool runner (on_pool) and the kernel thread count


def _available_threads() -> int:
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # not Linux
        return max(1, os.cpu_count() or 1)


MAX_THREADS = _available_threads()  # the pool's threads: the cores this process may run on


@contextlib.contextmanager
def on_pool(runner: Callable[[int, int, int], None] | None) -> Iterator[None]:
    """Run the parallel loops of the kernels this thread calls during the block as tasks of ``runner`` (an
    onnxruntime kernel context's ``parallel_for``: the session's intra-op pool; cpu_pool.py) instead of the C
    extension's own pool. None: the C pool. Same bits either way."""
    previous = getattr(_local, "runner", None)
    _local.runner = runner
    try:
        yield
    finally:
        _local.runner = previous


def _parallel(pooled: str, *args, fused: tuple[int, tuple] | None = None) -> None:  # noqa: ANN001
    """cpu_pool.<pooled>(runner, *args): on the pool :func:`on_pool` set (args[0]: the data, whose size decides), else
    on the C pool with :func:`kernel_thread_count` threads. ``fused`` = (index, (y, relu) or (relu,)): the loop's
    activation arguments (the pool functions take them as ``activation``)."""
    runner = getattr(_local, "runner", None)
    small = args[0].nbytes < (POOL_ROWS_FROM_BYTES if pooled in _ROWS_LOOPS else POOL_FROM_BYTES)
    how = kernel_thread_count() if runner is None or small else runner
    activation = {} if fused is None else {"activation": fused[1]}
    getattr(cpu_pool, pooled)(how, *args, **activation)


def kernel_thread_count() -> int:
    """Threads the kernels this thread calls use outside a session's pool (default: all of MAX_THREADS)."""
    return getattr(_local, "threads", MAX_THREADS)


@contextlib.contextmanager
def kernel_threads(count: int | None) -> Iterator[int]:
    """Threads for the kernels this thread calls during the block (None: all of MAX_THREADS); yields the count.

    The count is kept per calling thread, so kernels other threads run are unaffected; no OpenMP or other
    library setting is touched.
    """
    previous = kernel_thread_count()
    _local.threads = max(1, min(count or MAX_THREADS, MAX_THREADS))
    try:
        yield _local.threads
    finally:
        _local.threads = previous


_SERIAL_TASKS = {
    name: _cpukernels.addresses()[name] for name in ("serial_inference", "serial_training", "serial_backward")
}


def _serial(name: str, arrays: tuple, ints: tuple, reals: tuple) -> None:
    """One serial C kernel on this thread (GIL released)."""
    _cpukernels.run(_SERIAL_TASKS[name], 1, arrays, ints, reals, 1)


# -- public kernels ---------------------------------------------------------------------------------------


def forward_inference(
    x: np.ndarray,
    scale: np.ndarray,
    bias: np.ndarray,
    mean: np.ndarray,
    var: np.ndarray,
    config: BatchNormConfig,
    *,
    alpha: float = 1.0,
    beta: float = 0.0,
    out: np.ndarray | None = None,
) -> np.ndarray:
    params = {"scale": scale, "bias": bias, "mean": mean, "var": var}
    lay = validate_inference(x, params, config, alpha, beta, out, DATA_DTYPES, ())
    if x.size == 0:
        return reference.forward_inference(x, scale, bias, mean, var, config, alpha=alpha, beta=beta, out=out)
    center = _per_channel(mean)
    sink = _Sink(out, x.shape, x.dtype, lay, prior=beta != 0)
    if x.nbytes < SERIAL_BELOW_BYTES:
        _serial(
            "serial_inference",
            (_data32(x, lay), _per_channel(scale), _per_channel(bias), center, _per_channel(var), sink.view),
            (lay.outer, lay.channels, lay.inner, FIX_GAMMA * bool(config.fix_gamma)),
            (float(config.epsilon), float(alpha), float(beta)),
        )
        return sink.result()
    with np.errstate(invalid="ignore", divide="ignore"):
        mul = _gamma(_per_channel(scale), config) / np.sqrt(_per_channel(var) + config.epsilon)
    _affine(_data32(x, lay), lay, center, mul, _per_channel(bias), alpha, beta, sink)
    return sink.result()


def forward_training(
    x: np.ndarray,
    scale: np.ndarray,
    bias: np.ndarray,
    running_mean: np.ndarray,
    running_var: np.ndarray,
    config: BatchNormConfig,
    *,
    alpha: float = 1.0,
    beta: float = 0.0,
    out: TrainingOutputs | None = None,
) -> TrainingOutputs:
    params = {"scale": scale, "bias": bias, "running_mean": running_mean, "running_var": running_var}
    lay, pdtype = validate_training(x, params, config, alpha, beta, out, DATA_DTYPES, ())
    if x.size == 0:
        return reference.forward_training(
            x, scale, bias, running_mean, running_var, config, alpha=alpha, beta=beta, out=out
        )
    x3 = _data32(x, lay)
    rm, rv = _per_channel(running_mean), _per_channel(running_var)
    gamma, shift = _gamma(_per_channel(scale), config), _per_channel(bias)
    outs = out if out is not None else TrainingOutputs(None, None, None, None, None, None)
    sink = _Sink(outs.y, x.shape, x.dtype, lay, prior=beta != 0)
    shape = lay.param_shape
    relu = config.activation == "relu"
    if x.nbytes < SERIAL_BELOW_BYTES:
        new_rm, new_rv, mean, inv_std, var = (np.empty(lay.channels) for _ in range(5))
        _serial(
            "serial_training",
            (x3, _per_channel(scale), shift, rm, rv, sink.view, new_rm, new_rv, mean, inv_std, var),
            (lay.outer, lay.channels, lay.inner, _flags(config)),
            (float(config.epsilon), float(config.batch_weight), float(alpha), float(beta)),
        )
        return TrainingOutputs(
            sink.result(),
            _store(new_rm, pdtype, outs.running_mean, shape),
            _store(new_rv, pdtype, outs.running_var, shape),
            _store(mean, pdtype, outs.saved_mean, shape),
            _store(inv_std, pdtype, outs.saved_inv_std, shape),
            _store(var, pdtype, outs.batch_var, shape),
        )
    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
        if config.use_global_stats:
            mean, var = rm, rv
            inv_std = 1.0 / np.sqrt(var + config.epsilon)
            _affine(x3, lay, mean, gamma * inv_std, shift, alpha, beta, sink, relu)
        elif _channels_first(lay):
            mean, var, inv_std = np.empty(lay.channels), np.empty(lay.channels), np.empty(lay.channels)
            eps, a, b = float(config.epsilon), float(alpha), float(beta)
            _parallel(
                "train_channels_first",
                x3,
                gamma,
                shift,
                eps,
                a,
                b,
                mean,
                var,
                inv_std,
                sink.view,
                fused=(6, (relu,)),
            )
        else:
            mean, var = _statistics(x3, lay)
            inv_std = 1.0 / np.sqrt(var + config.epsilon)
            _affine(x3, lay, mean, gamma * inv_std, shift, alpha, beta, sink, relu)
        if config.use_global_stats:
            new_rm, new_rv = rm, rv
        else:
            w = config.batch_weight
            sample_var = var * unbiased_factor(lay.count) if config.unbiased_running_var else var
            new_rm = rm * (1.0 - w) + mean * w
            new_rv = rv * (1.0 - w) + sample_var * w
    return TrainingOutputs(
        sink.result(),
        _store(new_rm, pdtype, outs.running_mean, shape),
        _store(new_rv, pdtype, outs.running_var, shape),
        _store(mean, pdtype, outs.saved_mean, shape),
        _store(inv_std, pdtype, outs.saved_inv_std, shape),
        _store(var, pdtype, outs.batch_var, shape),
    )


def backward(
    dy: np.ndarray,
    x: np.ndarray,
    scale: np.ndarray,
    saved_mean: np.ndarray,
    saved_inv_std: np.ndarray,
    config: BatchNormConfig,
    y: np.ndarray | None = None,
    *,
    alpha_data: float = 1.0,
    beta_data: float = 0.0,
    alpha_param: float = 1.0,
    beta_param: float = 0.0,
    out: GradOutputs | None = None,
) -> GradOutputs:
    params = {"scale": scale, "saved_mean": saved_mean, "saved_inv_std": saved_inv_std}
    blends = (alpha_data, beta_data, alpha_param, beta_param)
    lay, pdtype = validate_backward(dy, x, params, config, blends, out, DATA_DTYPES, (), y)
    if x.size == 0:
        return reference.backward(
            dy, x, scale, saved_mean, saved_inv_std, config, y,
            alpha_data=alpha_data, beta_data=beta_data, alpha_param=alpha_param, beta_param=beta_param, out=out,
        )  # fmt: skip
    x3, dy3 = _data32(x, lay), _data32(dy, lay)
    relu = config.activation == "relu"
    y3 = _data32(y, lay) if relu else dy3  # read only with relu
    center, inv_std = _per_channel(saved_mean), _per_channel(saved_inv_std)
    g = _gamma(_per_channel(scale), config)
    outs = out if out is not None else GradOutputs(None, None, None)
    sink = _Sink(outs.dx, x.shape, x.dtype, lay, prior=beta_data != 0)
    if x.nbytes < SERIAL_BELOW_BYTES:
        dscale, sum_dy = np.empty(lay.channels), np.empty(lay.channels)
        _serial(
            "serial_backward",
            (dy3, x3, _per_channel(scale), center, inv_std, y3, sink.view, dscale, sum_dy),
            (lay.outer, lay.channels, lay.inner, _flags(config)),
            (float(alpha_data), float(beta_data)),
        )
    else:
        dscale, sum_dy = _parallel_backward(
            dy3, x3, center, inv_std, g, config, lay, alpha_data, beta_data, sink, y3, relu
        )
    shape = lay.param_shape
    return GradOutputs(
        sink.result(),
        _store(_blend_param(dscale, alpha_param, beta_param, outs.dscale), pdtype, outs.dscale, shape),
        _store(_blend_param(sum_dy, alpha_param, beta_param, outs.dbias), pdtype, outs.dbias, shape),
    )


def _parallel_backward(
    dy3,
    x3,
    center,
    inv_std,
    g,
    config: BatchNormConfig,
    lay: Layout,
    alpha_data: float,
    beta_data: float,
    sink: _Sink,
    y3: np.ndarray,
    relu: bool,
) -> tuple[np.ndarray, np.ndarray]:
    """dX into ``sink`` by the parallel loops; returns (dscale, dbias) unblended."""
    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
        if _channels_first(lay):
            sum_dy, sum_dy_xc = np.empty(lay.channels), np.empty(lay.channels)
            flags = (bool(config.use_global_stats), float(alpha_data), float(beta_data))
            _parallel(
                "backward_channels_first",
                dy3, x3, center, inv_std, g, *flags, sum_dy, sum_dy_xc, sink.view, fused=(8, (y3, relu)),
            )  # fmt: skip
        else:
            sum_dy, sum_dy_xc = _grad_sums_rows_view(dy3, x3, center, lay, y3, relu)
            k_dy = g * inv_std
            if config.use_global_stats:
                k_xc, k_add = np.zeros_like(k_dy), np.zeros_like(k_dy)
            else:
                k_xc = -k_dy * inv_std * (sum_dy_xc * inv_std) / lay.count
                k_add = -k_dy * sum_dy / lay.count
            _dx_rows_view(dy3, x3, lay, center, k_dy, k_xc, k_add, alpha_data, beta_data, sink, y3, relu)
        dscale = sum_dy_xc * inv_std
    if config.fix_gamma:
        dscale = np.zeros_like(dscale)
    return dscale, sum_dy


def _grad_sums_rows_view(
    dy3: np.ndarray, x3: np.ndarray, center: np.ndarray, lay: Layout, y3: np.ndarray, relu: bool
) -> tuple[np.ndarray, np.ndarray]:
    rows, width, rows_per_block = _rows_geometry(lay)
    col_dy = np.empty(width)
    col_xc = np.empty(width)
    _parallel(
        "grad_sums_rows",
        dy3.reshape(rows, width),
        x3.reshape(rows, width),
        np.repeat(center, lay.inner),
        _chunks(rows, rows_per_block),
        col_dy,
        col_xc,
        fused=(3, (y3.reshape(rows, width), relu)),
    )
    return col_dy.reshape(lay.channels, lay.inner).sum(axis=1), col_xc.reshape(lay.channels, lay.inner).sum(axis=1)


def _dx_rows_view(
    dy3, x3, lay: Layout, center, k_dy, k_xc, k_add, alpha: float, beta: float, sink: _Sink, y3, relu: bool
) -> None:
    rows, width, rows_per_block = _rows_geometry(lay)
    _parallel(
        "dx_rows",
        dy3.reshape(rows, width),
        x3.reshape(rows, width),
        *(np.repeat(v, lay.inner) for v in (center, k_dy, k_xc, k_add)),
        float(alpha),
        float(beta),
        _chunks(rows, rows_per_block),
        sink.view.reshape(rows, width),
        fused=(8, (y3.reshape(rows, width), relu)),
    )
