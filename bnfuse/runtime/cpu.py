"""Fast CPU BN kernels: numba, parallel over channels (or fixed row chunks), deterministic, stable.

The input is viewed as (outer, channels, inner) (kernel_types.Layout). Two loop shapes:

* channels-first (inner >= _MIN_INNER, e.g. NCHW): ``prange`` over channels; each channel's statistics
  are two-pass (mean, then sum of squared deviations: stable for |mean| >> std) and, fused, the channel
  is normalized (or its dX computed) right away while its data is still in L2.
* rows (small inner: NHWC, per-activation, (N, C)): the tensor is (rows, F) with F = channels * inner;
  a fixed number of row chunks (from the shape, never from the thread count) run in parallel, each
  producing per-column partial sums that are then added in chunk order.

Threads: numba's parallel layer (OpenMP here). A caller-participating pool of Python threads running
GIL-free range kernels was tried as well: side by side in one process it was as fast alone and inside an
ORT session, 5x faster to compile, and much better when another process keeps the second core busy
(4.3 ms vs 8 ms: OpenMP's barrier then waits a scheduler time slice); but interleaved with onnxruntime's
and PyTorch's spinning thread pools, as the benchmark runs, it lost (forward training 3.6-5.2 ms vs
3.2-4.2 ms, backward 5.4-5.9 ms vs 3.5-3.9 ms), so prange stayed. numba's OpenMP layer sets the OpenMP
runtime's thread count and nesting when it starts, in whichever runtime the process resolves first (PyTorch's
libgomp once torch is imported: ``torch.get_num_threads()`` reads it); this module starts it once, on import,
and puts those settings back (:func:`_start_numba_threads`). Inputs under
SERIAL_BELOW_BYTES never touch numba's pool: each op is one serial call (serial_inference / _training /
_backward) running the same loops in the same order, so the bits do not depend on the path; the entry
library's fast path calls those same functions as C callbacks (cpu_entry.py).

Determinism: no atomics; every sum has one order fixed by the shape and the compiled code, so repeated
runs are bitwise identical whatever the thread count. The reductions are compiled with fastmath
``reassoc`` only (no nnan/ninf: NaN and Inf propagate): LLVM then vectorizes them, which measured 6x
faster than strict-order loops (8.1 ms vs 1.3 ms for the statistics of 32x64x56x56 on 2 cores). Reassoc
fixes the summation order at compile time, not at run time, so it does not break run-to-run
determinism; results may differ in the last bits between CPUs with different vector widths.
Elementwise kernels are strict IEEE. Accumulation is float64; x and y are float32 inside the kernels
(16-bit I/O is converted at the edges). Numba compiles once (cache=True) and only for float32 data and
float64 parameters, to keep compile time low; the serial functions also for float32 parameters, as the entry
library's C callbacks (cpu_entry.py: about 13 s more on a first run without numba's cache, measured on the
loaded 2-core machine; nothing once cached).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator

import numba as nb
import numpy as np

from bnfuse.runtime import ortabi, reference
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

DATA_DTYPES = ("float16", "float32", "bfloat16")  # 16-bit types are converted to float32 at the edges
_MIN_INNER = 32  # below this, per-channel rows are too short for the channels-first loops
_ROW_BLOCK_ELEMENTS = 16384  # rows path: at least this many elements per parallel chunk
_MAX_CHUNKS = 64
# Below this many input bytes the kernels run on one thread: waking numba's workers costs more than the
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


def _start_numba_threads() -> None:
    """Start numba's threading layer now, leaving OpenMP's settings as they were.

    numba starts it on first use (numba.get_num_threads, a parallel kernel's first call or compile) and its
    OpenMP layer then calls ``omp_set_num_threads(NUMBA_NUM_THREADS)`` and raises the nesting levels, on the
    calling thread, in the OpenMP runtime the process resolves first: PyTorch's, once torch is imported, so a
    caller's ``torch.set_num_threads(1)`` became 2. Started here, once, that change is undone at once; numba
    does not touch OpenMP's settings again (its kernels pass their thread count per parallel region).
    """
    with ortabi.openmp_settings_kept():
        try:
            nb.get_num_threads()
        except Exception:  # noqa: BLE001 - no usable threading layer: numba says so where its threads are needed
            pass


_start_numba_threads()

# Reductions may reassociate (LLVM vectorizes them then; 6x faster here, see the module docstring);
# nothing else of fastmath is on, so NaN / Inf propagate. Elementwise kernels keep strict IEEE order.
_REDUCE = {"fastmath": {"reassoc"}, "cache": True, "nogil": True}
_PARALLEL = {"parallel": True, "fastmath": False, "cache": True, "nogil": True}


# -- numba kernels ----------------------------------------------------------------------------------------
# prange bodies only call serial helpers for the reductions: numba's parfor lowering of a reduction loop
# written inline in the prange body ran several times slower in measurements.


@nb.njit(**_REDUCE)
def _channel_sum(x, c):  # pragma: no cover - compiled
    outer, _, inner = x.shape
    total = 0.0
    for o in range(outer):
        for i in range(inner):
            total += x[o, c, i]
    return total


@nb.njit(**_REDUCE)
def _channel_sqdev(x, c, mu):  # pragma: no cover - compiled
    outer, _, inner = x.shape
    total = 0.0
    for o in range(outer):
        for i in range(inner):
            d = x[o, c, i] - mu
            total += d * d
    return total


@nb.njit(**_REDUCE)
def _channel_grad_sums(dy, x, c, mu, y, relu):  # pragma: no cover - compiled
    """sum(dy) and sum(dy * (x - mu)) of channel c; with relu, dy is 0 where the forward's y <= 0."""
    outer, _, inner = x.shape
    s_dy = 0.0
    s_dy_xc = 0.0
    if relu:  # loops apart: each stays one vectorized select / multiply-add
        for o in range(outer):
            for i in range(inner):
                g = 0.0 if y[o, c, i] <= 0.0 else dy[o, c, i]
                s_dy += g
                s_dy_xc += g * (x[o, c, i] - mu)
        return s_dy, s_dy_xc
    for o in range(outer):
        for i in range(inner):
            g = dy[o, c, i]
            s_dy += g
            s_dy_xc += g * (x[o, c, i] - mu)
    return s_dy, s_dy_xc


@nb.njit(**_PARALLEL)
def _train_channels_first(x, gamma, bias, eps, alpha, beta, relu, mean, var, inv_std, y):  # pragma: no cover
    """Fused per channel: two-pass statistics, then y = alpha * (gamma * x_hat + bias) + beta * y.

    One channel's data is normalized right after its statistics, while it is still in L2 (fewer DRAM reads).
    """
    outer, channels, inner = x.shape
    count = outer * inner
    for c in nb.prange(channels):
        mu = _channel_sum(x, c) / count
        v = _channel_sqdev(x, c, mu) / count
        r = 1.0 / np.sqrt(v + eps)
        mean[c] = mu
        var[c] = v
        inv_std[c] = r
        _channel_affine(x, c, mu, gamma[c] * r, bias[c], alpha, beta, relu, y)


@nb.njit(fastmath=False, cache=True, nogil=True)
def _channel_affine(x, c, center, mul, add, alpha, beta, relu, y):  # pragma: no cover - compiled
    outer, _, inner = x.shape
    a = mul * alpha
    b = add * alpha
    for o in range(outer):
        if relu and beta == 0.0:  # relu as a select in the write: NaN and -0 kept (not v < 0)
            for i in range(inner):
                v = (x[o, c, i] - center) * a + b
                y[o, c, i] = 0.0 if v < 0.0 else v
            continue
        if beta == 0.0:
            for i in range(inner):
                y[o, c, i] = (x[o, c, i] - center) * a + b
        else:
            for i in range(inner):
                y[o, c, i] = (x[o, c, i] - center) * a + b + beta * y[o, c, i]
        if relu:  # on the row just written, still in L1
            _relu_row(y[o, c])


@nb.njit(fastmath=False, cache=True, nogil=True)
def _relu_row(row):  # pragma: no cover - compiled
    """relu in place, keeping NaN and -0 (as PyTorch's and onnxruntime's Relu)."""
    for i in range(row.shape[0]):
        if row[i] < 0.0:
            row[i] = 0.0


@nb.njit(fastmath=False, cache=True, nogil=True)
def _channel_dx(dy, x, c, center, k_dy, k_xc, k_add, alpha, beta, y, relu, dx):  # pragma: no cover - compiled
    outer, _, inner = x.shape
    a = k_dy * alpha
    b = k_xc * alpha
    e = k_add * alpha
    for o in range(outer):
        if relu and beta == 0.0:
            for i in range(inner):
                dx[o, c, i] = a * (0.0 if y[o, c, i] <= 0.0 else dy[o, c, i]) + b * (x[o, c, i] - center) + e
        elif relu:
            for i in range(inner):
                g = 0.0 if y[o, c, i] <= 0.0 else dy[o, c, i]
                dx[o, c, i] = a * g + b * (x[o, c, i] - center) + e + beta * dx[o, c, i]
        elif beta == 0.0:
            for i in range(inner):
                dx[o, c, i] = a * dy[o, c, i] + b * (x[o, c, i] - center) + e
        else:
            for i in range(inner):
                dx[o, c, i] = a * dy[o, c, i] + b * (x[o, c, i] - center) + e + beta * dx[o, c, i]


@nb.njit(**_PARALLEL)
def _backward_channels_first(
    dy, x, center, inv_std, gamma, global_stats, alpha, beta, y, relu, sum_dy, sum_dy_xc, dx
):  # pragma: no cover
    """Fused per channel: sum(dy), sum(dy * (x - mean)), then dx while the channel is still in L2."""
    outer, channels, inner = x.shape
    count = outer * inner
    for c in nb.prange(channels):
        s_dy, s_xc = _channel_grad_sums(dy, x, c, center[c], y, relu)
        sum_dy[c] = s_dy
        sum_dy_xc[c] = s_xc
        r = inv_std[c]
        k_dy = gamma[c] * r
        if global_stats:
            k_xc = 0.0
            k_add = 0.0
        else:
            k_xc = -k_dy * r * (s_xc * r) / count
            k_add = -k_dy * s_dy / count
        _channel_dx(dy, x, c, center[c], k_dy, k_xc, k_add, alpha, beta, y, relu, dx)


@nb.njit(**_REDUCE)
def _rows_sums(x, r0, r1, center, squared, acc):  # pragma: no cover - compiled
    """acc[f] = sum over rows r0:r1 of (x - center) (or its square), column by column."""
    width = x.shape[1]
    for f in range(width):
        acc[f] = 0.0
    for r in range(r0, r1):
        for f in range(width):
            d = x[r, f] - center[f]
            acc[f] += d * d if squared else d


@nb.njit(**_REDUCE)
def _rows_grad_sums(dy, x, r0, r1, center, y, relu, acc_dy, acc_xc):  # pragma: no cover - compiled
    width = x.shape[1]
    for f in range(width):
        acc_dy[f] = 0.0
        acc_xc[f] = 0.0
    if relu:
        for r in range(r0, r1):
            for f in range(width):
                g = 0.0 if y[r, f] <= 0.0 else dy[r, f]
                acc_dy[f] += g
                acc_xc[f] += g * (x[r, f] - center[f])
        return
    for r in range(r0, r1):
        for f in range(width):
            g = dy[r, f]
            acc_dy[f] += g
            acc_xc[f] += g * (x[r, f] - center[f])


@nb.njit(**_PARALLEL)
def _column_sums(x, center, squared, chunks, out):  # pragma: no cover - compiled
    """Column sums of (x - center) or its square over (rows, F); fixed chunks added in order."""
    rows, width = x.shape
    per_chunk = (rows + chunks - 1) // chunks
    part = np.zeros((chunks, width))
    for k in nb.prange(chunks):
        _rows_sums(x, k * per_chunk, min(rows, (k + 1) * per_chunk), center, squared, part[k])
    for f in range(width):
        out[f] = 0.0
    for k in range(chunks):
        for f in range(width):
            out[f] += part[k, f]


@nb.njit(**_PARALLEL)
def _grad_sums_rows(dy, x, center, y, relu, chunks, sum_dy, sum_dy_xc):  # pragma: no cover - compiled
    """Per column of (rows, F): sum(dy) and sum(dy * (x - center)); chunk partials added in order."""
    rows, width = x.shape
    per_chunk = (rows + chunks - 1) // chunks
    part_dy = np.zeros((chunks, width))
    part_xc = np.zeros((chunks, width))
    for k in nb.prange(chunks):
        r0, r1 = k * per_chunk, min(rows, (k + 1) * per_chunk)
        _rows_grad_sums(dy, x, r0, r1, center, y, relu, part_dy[k], part_xc[k])
    for f in range(width):
        sum_dy[f] = 0.0
        sum_dy_xc[f] = 0.0
    for k in range(chunks):
        for f in range(width):
            sum_dy[f] += part_dy[k, f]
            sum_dy_xc[f] += part_xc[k, f]


@nb.njit(**_PARALLEL)
def _affine_channels_first(x, center, mul, add, alpha, beta, relu, y):  # pragma: no cover - compiled
    """y = alpha * ((x - center) * mul + add) + beta * y, per channel of x (outer, C, inner)."""
    outer, channels, inner = x.shape
    for t in nb.prange(outer * channels):
        o = t // channels
        c = t - o * channels
        m = center[c]
        a = mul[c] * alpha
        b = add[c] * alpha
        if relu and beta == 0.0:
            for i in range(inner):
                v = (x[o, c, i] - m) * a + b
                y[o, c, i] = 0.0 if v < 0.0 else v
            continue
        if beta == 0.0:
            for i in range(inner):
                y[o, c, i] = (x[o, c, i] - m) * a + b
        else:
            for i in range(inner):
                y[o, c, i] = (x[o, c, i] - m) * a + b + beta * y[o, c, i]
        if relu:
            _relu_row(y[o, c])


@nb.njit(**_PARALLEL)
def _affine_rows(x, center, mul, add, alpha, beta, relu, chunks, y):  # pragma: no cover - compiled
    """y = alpha * ((x - center) * mul + add) + beta * y, per column of x (rows, F)."""
    rows, width = x.shape
    a = mul * alpha
    b = add * alpha
    per_chunk = (rows + chunks - 1) // chunks
    for k in nb.prange(chunks):
        for r in range(k * per_chunk, min(rows, (k + 1) * per_chunk)):
            _affine_row(x, center, a, b, beta, relu, r, y)


@nb.njit(fastmath=False, cache=True, nogil=True)
def _affine_row(x, center, a, b, beta, relu, r, y):  # pragma: no cover - compiled
    """Row r of _affine_rows (and of cpu_pool's task): y = (x - center) * a + b [+ beta * y], then relu."""
    width = x.shape[1]
    if relu and beta == 0.0:
        for f in range(width):
            v = (x[r, f] - center[f]) * a[f] + b[f]
            y[r, f] = 0.0 if v < 0.0 else v
        return
    if beta == 0.0:
        for f in range(width):
            y[r, f] = (x[r, f] - center[f]) * a[f] + b[f]
    else:
        for f in range(width):
            y[r, f] = (x[r, f] - center[f]) * a[f] + b[f] + beta * y[r, f]
    if relu:
        _relu_row(y[r])


@nb.njit(**_PARALLEL)
def _dx_rows(dy, x, center, k_dy, k_xc, k_add, alpha, beta, y, relu, chunks, dx):  # pragma: no cover - compiled
    rows, width = x.shape
    a = k_dy * alpha
    b = k_xc * alpha
    e = k_add * alpha
    per_chunk = (rows + chunks - 1) // chunks
    for k in nb.prange(chunks):
        for r in range(k * per_chunk, min(rows, (k + 1) * per_chunk)):
            _dx_row(dy, x, center, a, b, e, beta, y, relu, r, dx)


@nb.njit(fastmath=False, cache=True, nogil=True)
def _dx_row(dy, x, center, a, b, e, beta, y, relu, r, dx):  # pragma: no cover - compiled
    """Row r of _dx_rows (and of cpu_pool's task): dx = a * dy' + b * (x - center) + e [+ beta * dx], dy' = dy
    masked where y <= 0 with relu."""
    width = x.shape[1]
    if relu and beta == 0.0:
        for f in range(width):
            g = 0.0 if y[r, f] <= 0.0 else dy[r, f]
            dx[r, f] = a[f] * g + b[f] * (x[r, f] - center[f]) + e[f]
    elif relu:
        for f in range(width):
            g = 0.0 if y[r, f] <= 0.0 else dy[r, f]
            dx[r, f] = a[f] * g + b[f] * (x[r, f] - center[f]) + e[f] + beta * dx[r, f]
    elif beta == 0.0:
        for f in range(width):
            dx[r, f] = a[f] * dy[r, f] + b[f] * (x[r, f] - center[f]) + e[f]
    else:
        for f in range(width):
            dx[r, f] = a[f] * dy[r, f] + b[f] * (x[r, f] - center[f]) + e[f] + beta * dx[r, f]


# -- small tensors: one serial call per op ------------------------------------------------------------------
# Below SERIAL_BELOW_BYTES each public kernel is one call of one of these (no numba thread pool at all), and
# the entry library's fast path (cpu_entry.py) calls the same functions as C callbacks. They run the loops of
# the parallel path in the same order on one thread -- the channel helpers, the row chunks, then NumPy's
# pairwise sum over ``inner`` -- so a small input gets the same bits either way.

_SERIAL = {"fastmath": False, "cache": True, "nogil": True, "error_model": "numpy"}


@nb.njit(**_SERIAL)
def _pairwise_sum(a, start, n):  # pragma: no cover - compiled
    """NumPy's pairwise summation of a[start:start + n] (a row of ``col.reshape(C, inner).sum(axis=1)``), n <= 128."""
    if n < 8:
        total = -0.0
        for i in range(n):
            total += a[start + i]
        return total
    r = np.empty(8)
    for j in range(8):
        r[j] = a[start + j]
    i = 8
    while i < n - n % 8:
        for j in range(8):
            r[j] += a[start + i + j]
        i += 8
    total = ((r[0] + r[1]) + (r[2] + r[3])) + ((r[4] + r[5]) + (r[6] + r[7]))
    while i < n:
        total += a[start + i]
        i += 1
    return total


@nb.njit(**_SERIAL)
def _serial_chunks(rows, width):  # pragma: no cover - compiled
    """_chunks(_rows_geometry(...)) of the rows path."""
    rows_per_block = max(1, _ROW_BLOCK_ELEMENTS // width)
    return max(1, min(_MAX_CHUNKS, -(-rows // rows_per_block)))


@nb.njit(**_SERIAL)
def _serial_column_sums(x2, center, squared, out):  # pragma: no cover - compiled
    """_column_sums on one thread: the same chunks, each summed by _rows_sums, added in chunk order."""
    rows, width = x2.shape
    chunks = _serial_chunks(rows, width)
    per_chunk = (rows + chunks - 1) // chunks
    part = np.zeros(width)
    for f in range(width):
        out[f] = 0.0
    for k in range(chunks):
        _rows_sums(x2, k * per_chunk, min(rows, (k + 1) * per_chunk), center, squared, part)
        for f in range(width):
            out[f] += part[f]


@nb.njit(**_SERIAL)
def _serial_mean_var(x3, mean, var):  # pragma: no cover - compiled
    """Per-channel mean and biased variance (two-pass), as the parallel path computes them for this layout."""
    outer, channels, inner = x3.shape
    count = outer * inner
    if inner >= _MIN_INNER:
        for c in range(channels):
            mu = _channel_sum(x3, c) / count
            mean[c] = mu
            var[c] = _channel_sqdev(x3, c, mu) / count
        return
    width = channels * inner
    x2 = x3.reshape(outer, width)
    col = np.empty(width)
    center = np.zeros(width)
    _serial_column_sums(x2, center, False, col)
    for c in range(channels):
        mean[c] = _pairwise_sum(col, c * inner, inner) / count
        for i in range(inner):
            center[c * inner + i] = mean[c]
    _serial_column_sums(x2, center, True, col)
    for c in range(channels):
        var[c] = _pairwise_sum(col, c * inner, inner) / count


@nb.njit(**_SERIAL)
def _serial_grad_sums(dy3, x3, center, y3, relu, sum_dy, sum_dy_xc):  # pragma: no cover - compiled
    """Per-channel sum(dy) and sum(dy * (x - center)), as the parallel path computes them for this layout."""
    outer, channels, inner = x3.shape
    if inner >= _MIN_INNER:
        for c in range(channels):
            sum_dy[c], sum_dy_xc[c] = _channel_grad_sums(dy3, x3, c, center[c], y3, relu)
        return
    width = channels * inner
    dy2, x2, y2 = dy3.reshape(outer, width), x3.reshape(outer, width), y3.reshape(outer, width)
    wide_center = np.empty(width)
    for f in range(width):
        wide_center[f] = center[f // inner]
    chunks = _serial_chunks(outer, width)
    per_chunk = (outer + chunks - 1) // chunks
    part_dy, part_xc = np.zeros(width), np.zeros(width)
    col_dy, col_xc = np.zeros(width), np.zeros(width)
    for k in range(chunks):
        r0, r1 = k * per_chunk, min(outer, (k + 1) * per_chunk)
        _rows_grad_sums(dy2, x2, r0, r1, wide_center, y2, relu, part_dy, part_xc)
        for f in range(width):
            col_dy[f] += part_dy[f]
            col_xc[f] += part_xc[f]
    for c in range(channels):
        sum_dy[c] = _pairwise_sum(col_dy, c * inner, inner)
        sum_dy_xc[c] = _pairwise_sum(col_xc, c * inner, inner)


@nb.njit(**_SERIAL)
def _serial_affine(x3, center, mul, add, alpha, beta, relu, y3):  # pragma: no cover - compiled
    """y = alpha * ((x - center[c]) * mul[c] + add[c]) + beta * y in memory order -- channel rows for a long inner,
    else rows of (outer, C * inner) with per-column factors, so the innermost loop is long and vectorizes; each
    element as the parallel loops compute it. relu: then y = 0 where y < 0 (NaN and -0 kept), in the same loop."""
    outer, channels, inner = x3.shape
    if inner >= _MIN_INNER:
        for o in range(outer):
            for c in range(channels):
                _serial_affine_row(x3, y3, o, c, center[c], mul[c] * alpha, add[c] * alpha, beta, relu)
        return
    m, a, b = _per_column(center, inner), _per_column(mul * alpha, inner), _per_column(add * alpha, inner)
    x2, y2 = x3.reshape(outer, channels * inner), y3.reshape(outer, channels * inner)
    width = channels * inner
    if relu and beta == 0.0:
        for o in range(outer):
            for f in range(width):
                v = (x2[o, f] - m[f]) * a[f] + b[f]
                y2[o, f] = 0.0 if v < 0.0 else v
    elif relu:
        for o in range(outer):
            for f in range(width):
                v = (x2[o, f] - m[f]) * a[f] + b[f] + beta * y2[o, f]
                y2[o, f] = 0.0 if v < 0.0 else v
    elif beta == 0.0:
        for o in range(outer):
            for f in range(width):
                y2[o, f] = (x2[o, f] - m[f]) * a[f] + b[f]
    else:
        for o in range(outer):
            for f in range(width):
                y2[o, f] = (x2[o, f] - m[f]) * a[f] + b[f] + beta * y2[o, f]


@nb.njit(**_SERIAL)
def _serial_affine_row(x3, y3, o, c, m, a, b, beta, relu):  # pragma: no cover - compiled
    inner = x3.shape[2]
    if relu and beta == 0.0:
        for i in range(inner):
            v = (x3[o, c, i] - m) * a + b
            y3[o, c, i] = 0.0 if v < 0.0 else v
    elif relu:
        for i in range(inner):
            v = (x3[o, c, i] - m) * a + b + beta * y3[o, c, i]
            y3[o, c, i] = 0.0 if v < 0.0 else v
    elif beta == 0.0:
        for i in range(inner):
            y3[o, c, i] = (x3[o, c, i] - m) * a + b
    else:
        for i in range(inner):
            y3[o, c, i] = (x3[o, c, i] - m) * a + b + beta * y3[o, c, i]


@nb.njit(**_SERIAL)
def _serial_dx_row(dy3, x3, dx3, o, c, m, a, b, e, beta, y3, relu):  # pragma: no cover - compiled
    inner = x3.shape[2]
    if relu and beta == 0.0:
        for i in range(inner):
            g = 0.0 if y3[o, c, i] <= 0.0 else dy3[o, c, i]
            dx3[o, c, i] = a * g + b * (x3[o, c, i] - m) + e
    elif relu:
        for i in range(inner):
            g = 0.0 if y3[o, c, i] <= 0.0 else dy3[o, c, i]
            dx3[o, c, i] = a * g + b * (x3[o, c, i] - m) + e + beta * dx3[o, c, i]
    elif beta == 0.0:
        for i in range(inner):
            dx3[o, c, i] = a * dy3[o, c, i] + b * (x3[o, c, i] - m) + e
    else:
        for i in range(inner):
            dx3[o, c, i] = a * dy3[o, c, i] + b * (x3[o, c, i] - m) + e + beta * dx3[o, c, i]


@nb.njit(**_SERIAL)
def _per_column(values, inner):  # pragma: no cover - compiled
    """A per-channel vector repeated ``inner`` times (np.repeat), for the (outer, C * inner) view."""
    wide = np.empty(values.shape[0] * inner)
    for f in range(wide.shape[0]):
        wide[f] = values[f // inner]
    return wide


@nb.njit(**_SERIAL)
def serial_inference(x3, scale, bias, mean, var, eps, fix_gamma, alpha, beta, y3):  # pragma: no cover
    """forward_inference of a (outer, C, inner) float32 view into y3; parameters of any float type."""
    channels = x3.shape[1]
    center, mul, add = np.empty(channels), np.empty(channels), np.empty(channels)
    for c in range(channels):
        gamma = 1.0 if fix_gamma else np.float64(scale[c])
        mul[c] = gamma / np.sqrt(np.float64(var[c]) + eps)
        center[c] = np.float64(mean[c])
        add[c] = np.float64(bias[c])
    _serial_affine(x3, center, mul, add, alpha, beta, False, y3)


@nb.njit(**_SERIAL)
def serial_training(
    x3, scale, bias, running_mean, running_var, eps, weight, unbiased, fix_gamma, global_stats, alpha, beta,
    relu, y3, new_mean, new_var, saved_mean, saved_inv_std, batch_var,
):  # fmt: skip  # pragma: no cover - compiled
    """forward_training into y3 and the five per-channel outputs (any float type; batch_var may be empty)."""
    outer, channels, inner = x3.shape
    count = outer * inner
    mean, var = np.empty(channels), np.empty(channels)
    if global_stats:
        for c in range(channels):
            mean[c] = running_mean[c]
            var[c] = running_var[c]
    else:
        _serial_mean_var(x3, mean, var)
    factor = count / (count - 1) if unbiased and count > 1 else 1.0
    keep = 1.0 - weight
    mul, add = np.empty(channels), np.empty(channels)
    for c in range(channels):
        inv_std = 1.0 / np.sqrt(var[c] + eps)
        gamma = 1.0 if fix_gamma else np.float64(scale[c])
        mul[c] = gamma * inv_std
        add[c] = np.float64(bias[c])
        if global_stats:
            new_mean[c] = running_mean[c]
            new_var[c] = running_var[c]
        else:
            new_mean[c] = np.float64(running_mean[c]) * keep + mean[c] * weight
            new_var[c] = np.float64(running_var[c]) * keep + var[c] * factor * weight
        saved_mean[c] = mean[c]
        saved_inv_std[c] = inv_std
        if batch_var.shape[0]:
            batch_var[c] = var[c]
    _serial_affine(x3, mean, mul, add, alpha, beta, relu, y3)


@nb.njit(**_SERIAL)
def serial_backward(
    dy3, x3, scale, saved_mean, saved_inv_std, fix_gamma, global_stats, alpha, beta, y3, relu, dx3, dscale, dbias
):  # pragma: no cover - compiled
    """backward into dx3, dscale and dbias (unblended: alpha_param 1, beta_param 0); with relu, dy3 masked
    where the forward's y3 <= 0 (y3 is not read otherwise)."""
    outer, channels, inner = x3.shape
    count = outer * inner
    center = np.empty(channels)
    for c in range(channels):
        center[c] = saved_mean[c]
    sum_dy, sum_dy_xc = np.empty(channels), np.empty(channels)
    _serial_grad_sums(dy3, x3, center, y3, relu, sum_dy, sum_dy_xc)
    a, b, e = np.empty(channels), np.empty(channels), np.empty(channels)
    for c in range(channels):
        r = np.float64(saved_inv_std[c])
        k_dy = (1.0 if fix_gamma else np.float64(scale[c])) * r
        if global_stats:
            k_xc = 0.0
            k_add = 0.0
        else:
            k_xc = -k_dy * r * (sum_dy_xc[c] * r) / count
            k_add = -k_dy * sum_dy[c] / count
        a[c], b[c], e[c] = k_dy * alpha, k_xc * alpha, k_add * alpha
        dscale[c] = 0.0 if fix_gamma else sum_dy_xc[c] * r
        dbias[c] = sum_dy[c]
    if inner >= _MIN_INNER:  # memory order (see _serial_affine)
        for o in range(outer):
            for c in range(channels):
                _serial_dx_row(dy3, x3, dx3, o, c, center[c], a[c], b[c], e[c], beta, y3, relu)
        return
    width = channels * inner
    m, aw, bw, ew = _per_column(center, inner), _per_column(a, inner), _per_column(b, inner), _per_column(e, inner)
    dy2, x2, dx2 = dy3.reshape(outer, width), x3.reshape(outer, width), dx3.reshape(outer, width)
    y2 = y3.reshape(outer, width)
    if relu and beta == 0.0:
        for o in range(outer):
            for f in range(width):
                g = 0.0 if y2[o, f] <= 0.0 else dy2[o, f]
                dx2[o, f] = aw[f] * g + bw[f] * (x2[o, f] - m[f]) + ew[f]
    elif relu:
        for o in range(outer):
            for f in range(width):
                g = 0.0 if y2[o, f] <= 0.0 else dy2[o, f]
                dx2[o, f] = aw[f] * g + bw[f] * (x2[o, f] - m[f]) + ew[f] + beta * dx2[o, f]
    elif beta == 0.0:
        for o in range(outer):
            for f in range(width):
                dx2[o, f] = aw[f] * dy2[o, f] + bw[f] * (x2[o, f] - m[f]) + ew[f]
    else:
        for o in range(outer):
            for f in range(width):
                dx2[o, f] = aw[f] * dy2[o, f] + bw[f] * (x2[o, f] - m[f]) + ew[f] + beta * dx2[o, f]


# -- views and plumbing -------------------------------------------------------------------------------------


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
            _affine_channels_first, "affine_channels_first", x3, center, mul, add, float(alpha), float(beta),
            sink.view, fused=(6, (relu,)),
        )  # fmt: skip
        return
    rows, width, rows_per_block = _rows_geometry(lay)
    _parallel(
        _affine_rows,
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
    _parallel(_column_sums, "column_sums", x2, np.zeros(width), False, chunks, col)
    mean = col.reshape(lay.channels, lay.inner).sum(axis=1) / lay.count
    _parallel(_column_sums, "column_sums", x2, np.repeat(mean, lay.inner), True, chunks, col)
    return mean, col.reshape(lay.channels, lay.inner).sum(axis=1) / lay.count


def _gamma(scale: np.ndarray, config: BatchNormConfig) -> np.ndarray:
    return np.ones_like(scale) if config.fix_gamma else scale


_pool = threading.local()


@contextlib.contextmanager
def on_pool(runner: Callable[[int, int, int], None] | None) -> Iterator[None]:
    """Run the parallel loops of the kernels this thread calls during the block as tasks of ``runner`` (an
    onnxruntime kernel context's ``parallel_for``: the session's intra-op pool; cpu_pool.py) instead of numba's
    threads. None: numba's threads. Same bits either way."""
    previous = getattr(_pool, "runner", None)
    _pool.runner = runner
    try:
        yield
    finally:
        _pool.runner = previous


def _parallel(loop, pooled: str, *args, fused: tuple[int, tuple] | None = None) -> None:  # noqa: ANN001
    """``loop(*args)`` on numba's threads, or its cpu_pool twin on the pool :func:`on_pool` set (args[0]: the
    data, whose size decides). ``fused`` = (index, (y, relu) or (relu,)): the loop's activation arguments, inserted
    into its arguments at index (the pool twins take them as ``activation``)."""
    runner = getattr(_pool, "runner", None)
    small = args[0].nbytes < (POOL_ROWS_FROM_BYTES if pooled in _ROWS_LOOPS else POOL_FROM_BYTES)
    if runner is None or small:
        if fused is not None:
            args = (*args[: fused[0]], *fused[1], *args[fused[0] :])
        loop(*args)
        return
    from bnfuse.runtime import cpu_pool

    activation = {} if fused is None else {"activation": fused[1]}
    getattr(cpu_pool, pooled)(runner, *args, **activation)


@contextlib.contextmanager
def kernel_threads(count: int | None) -> Iterator[int]:
    """numba threads for the kernels this thread calls during the block (None: all of numba's); yields the count.

    numba keeps the count per calling thread, so kernels other threads run are unaffected.
    """
    previous = nb.get_num_threads()
    nb.set_num_threads(max(1, min(count or nb.config.NUMBA_NUM_THREADS, nb.config.NUMBA_NUM_THREADS)))
    try:
        yield nb.get_num_threads()
    finally:
        nb.set_num_threads(previous)


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
        serial_inference(
            _data32(x, lay), _per_channel(scale), _per_channel(bias), center, _per_channel(var),
            float(config.epsilon), bool(config.fix_gamma), float(alpha), float(beta), sink.view,
        )  # fmt: skip
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
        serial_training(
            x3, _per_channel(scale), shift, rm, rv, float(config.epsilon), float(config.batch_weight),
            bool(config.unbiased_running_var), bool(config.fix_gamma), bool(config.use_global_stats),
            float(alpha), float(beta), relu, sink.view, new_rm, new_rv, mean, inv_std, var,
        )  # fmt: skip
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
                _train_channels_first,
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
        flags = (bool(config.fix_gamma), bool(config.use_global_stats), float(alpha_data), float(beta_data))
        serial_backward(dy3, x3, _per_channel(scale), center, inv_std, *flags, y3, relu, sink.view, dscale, sum_dy)
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
    """dX into ``sink`` on numba's threads; returns (dscale, dbias) unblended."""
    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
        if _channels_first(lay):
            sum_dy, sum_dy_xc = np.empty(lay.channels), np.empty(lay.channels)
            flags = (bool(config.use_global_stats), float(alpha_data), float(beta_data))
            _parallel(
                _backward_channels_first, "backward_channels_first",
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
        _grad_sums_rows,
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
        _dx_rows,
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


# The public kernels as defined here: the entry library's fast path (cpu_entry.py) stands in for exactly these.
DEFINED_KERNELS = {"forward_inference": forward_inference, "forward_training": forward_training, "backward": backward}
