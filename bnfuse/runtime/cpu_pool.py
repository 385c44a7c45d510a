"""The CPU kernels' parallel loops as tasks for onnxruntime's intra-op thread pool.

Inside an onnxruntime session a bnfuse op runs on one of ORT's threads while the pool's other threads sleep (bnfuse
turns their spinning off). cpu.py's parallel loops (numba ``prange``) would start numba's own OpenMP team beside
that pool -- threads that spin after every kernel and fight ORT's for the cores, so TrainingSession kept them at one
thread. Here the same loops are numba ``cfunc`` s ``void task(void **data, size_t index)`` that the op hands to
``KernelContext_ParallelFor`` (ortabi.KernelContext.parallel_for): task ``index`` runs one range of channels or one
fixed row chunk on whichever pool thread takes it, without the GIL.

Same bits as cpu.py: a task runs the per-channel helpers (or the row-chunk loops) of cpu.py in the same order, and
the row chunks' partial sums are added in chunk order afterwards, exactly as cpu.py's loops do. Channel ranges
may be cut anywhere (channels are independent); row chunks come from the shape (cpu._chunks), never from the pool.

``data``: an array of addresses -- the arrays a loop reads and writes, then an int64 array and a float64 array of
its scalars. ``run(runner, task, arrays, ints, reals, count)`` builds it, keeps every array alive through the call
and runs ``count`` tasks with ``runner`` (the kernel context's ``parallel_for``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import numba as nb
import numpy as np
from numba import types

from bnfuse.runtime import cpu, numba_cache

Runner = Callable[[int, int, int], None]  # (task address, task count, data address)
_SIGNATURE = types.void(types.CPointer(types.voidptr), types.uintp)
_F32, _F64, _I64 = np.float32, np.float64, np.int64
MAX_CHANNEL_TASKS = 64  # channel ranges per loop: enough for dynamic balance on a many-core pool


@nb.njit(cache=True, nogil=True)
def _data(pointer, outer, channels, inner):  # pragma: no cover - compiled
    return nb.carray(pointer, (outer, channels, inner), _F32)


@nb.njit(cache=True, nogil=True)
def _rows(pointer, rows, width):  # pragma: no cover - compiled
    return nb.carray(pointer, (rows, width), _F32)


@nb.njit(cache=True, nogil=True)
def _vector(pointer, size):  # pragma: no cover - compiled
    return nb.carray(pointer, (size,), _F64)


@nb.njit(cache=True, nogil=True)
def _span(index, tasks, total):  # pragma: no cover - compiled
    """Task ``index`` of ``tasks`` covers [start, stop) of ``total`` items."""
    return index * total // tasks, (index + 1) * total // tasks


# -- tasks (data layouts: see each run_* function below) ------------------------------------------------------
# relu: the fused activation (ints' last field); act: the forward's activated output the backward masks dY by (the
# last array; dY itself, never read, without relu).


def _train_channels(data, index):  # pragma: no cover - compiled
    ints, reals = nb.carray(data[7], (5,), _I64), nb.carray(data[8], (3,), _F64)
    outer, channels, inner, tasks, relu = ints[0], ints[1], ints[2], ints[3], ints[4] != 0
    x, y = _data(data[0], outer, channels, inner), _data(data[6], outer, channels, inner)
    gamma, bias = _vector(data[1], channels), _vector(data[2], channels)
    mean, var, inv_std = _vector(data[3], channels), _vector(data[4], channels), _vector(data[5], channels)
    eps, alpha, beta = reals[0], reals[1], reals[2]
    count = outer * inner
    start, stop = _span(index, tasks, channels)
    for c in range(start, stop):  # cpu._train_channels_first's body, per channel
        mu = cpu._channel_sum(x, c) / count
        v = cpu._channel_sqdev(x, c, mu) / count
        r = 1.0 / np.sqrt(v + eps)
        mean[c] = mu
        var[c] = v
        inv_std[c] = r
        cpu._channel_affine(x, c, mu, gamma[c] * r, bias[c], alpha, beta, relu, y)


def _backward_channels(data, index):  # pragma: no cover - compiled
    ints, reals = nb.carray(data[9], (6,), _I64), nb.carray(data[10], (2,), _F64)
    outer, channels, inner, tasks, global_stats = ints[0], ints[1], ints[2], ints[3], ints[4] != 0
    relu = ints[5] != 0
    dy, x = _data(data[0], outer, channels, inner), _data(data[1], outer, channels, inner)
    center, inv_std, gamma = _vector(data[2], channels), _vector(data[3], channels), _vector(data[4], channels)
    sum_dy, sum_dy_xc = _vector(data[5], channels), _vector(data[6], channels)
    dx, act = _data(data[7], outer, channels, inner), _data(data[8], outer, channels, inner)
    alpha, beta = reals[0], reals[1]
    count = outer * inner
    start, stop = _span(index, tasks, channels)
    for c in range(start, stop):  # cpu._backward_channels_first's body, per channel
        s_dy, s_xc = cpu._channel_grad_sums(dy, x, c, center[c], act, relu)
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
        cpu._channel_dx(dy, x, c, center[c], k_dy, k_xc, k_add, alpha, beta, act, relu, dx)


def _affine_channels(data, index):  # pragma: no cover - compiled
    ints, reals = nb.carray(data[5], (5,), _I64), nb.carray(data[6], (2,), _F64)
    outer, channels, inner, tasks, relu = ints[0], ints[1], ints[2], ints[3], ints[4] != 0
    x, y = _data(data[0], outer, channels, inner), _data(data[4], outer, channels, inner)
    center, mul, add = _vector(data[1], channels), _vector(data[2], channels), _vector(data[3], channels)
    alpha, beta = reals[0], reals[1]
    start, stop = _span(index, tasks, outer * channels)
    for t in range(start, stop):  # cpu._affine_channels_first's body, per (outer, channel) row
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
            cpu._relu_row(y[o, c])


def _column_sums(data, index):  # pragma: no cover - compiled
    ints = nb.carray(data[3], (4,), _I64)
    rows, width, chunks, squared = ints[0], ints[1], ints[2], ints[3] != 0
    x = _rows(data[0], rows, width)
    center, part = _vector(data[1], width), nb.carray(data[2], (chunks, width), _F64)
    per_chunk = (rows + chunks - 1) // chunks
    cpu._rows_sums(x, index * per_chunk, min(rows, (index + 1) * per_chunk), center, squared, part[index])


def _grad_sums(data, index):  # pragma: no cover - compiled
    ints = nb.carray(data[6], (4,), _I64)
    rows, width, chunks, relu = ints[0], ints[1], ints[2], ints[3] != 0
    dy, x, act = _rows(data[0], rows, width), _rows(data[1], rows, width), _rows(data[5], rows, width)
    center = _vector(data[2], width)
    part_dy, part_xc = nb.carray(data[3], (chunks, width), _F64), nb.carray(data[4], (chunks, width), _F64)
    per_chunk = (rows + chunks - 1) // chunks
    stop = min(rows, (index + 1) * per_chunk)
    cpu._rows_grad_sums(dy, x, index * per_chunk, stop, center, act, relu, part_dy[index], part_xc[index])


def _affine_rows(data, index):  # pragma: no cover - compiled
    ints, reals = nb.carray(data[5], (4,), _I64), nb.carray(data[6], (1,), _F64)
    rows, width, chunks, relu = ints[0], ints[1], ints[2], ints[3] != 0
    x, y = _rows(data[0], rows, width), _rows(data[4], rows, width)
    center, a, b = _vector(data[1], width), _vector(data[2], width), _vector(data[3], width)
    beta = reals[0]
    per_chunk = (rows + chunks - 1) // chunks
    for r in range(index * per_chunk, min(rows, (index + 1) * per_chunk)):  # cpu._affine_rows' chunk body
        cpu._affine_row(x, center, a, b, beta, relu, r, y)


def _dx_rows(data, index):  # pragma: no cover - compiled
    ints, reals = nb.carray(data[8], (4,), _I64), nb.carray(data[9], (1,), _F64)
    rows, width, chunks, relu = ints[0], ints[1], ints[2], ints[3] != 0
    dy, x, dx = _rows(data[0], rows, width), _rows(data[1], rows, width), _rows(data[6], rows, width)
    act = _rows(data[7], rows, width)
    center, a, b, e = _vector(data[2], width), _vector(data[3], width), _vector(data[4], width), _vector(data[5], width)
    beta = reals[0]
    per_chunk = (rows + chunks - 1) // chunks
    for r in range(index * per_chunk, min(rows, (index + 1) * per_chunk)):  # cpu._dx_rows' chunk body
        cpu._dx_row(dy, x, center, a, b, e, beta, act, relu, r, dx)


@nb.njit(fastmath=False, cache=True, nogil=True)
def _add_chunks(part, out):  # pragma: no cover - compiled
    """out[f] = sum over chunks k, in order, of part[k, f] (cpu._column_sums' final loop)."""
    chunks, width = part.shape
    for f in range(width):
        out[f] = 0.0
    for k in range(chunks):
        for f in range(width):
            out[f] += part[k, f]


_TASKS = {
    "train_channels": _train_channels,
    "backward_channels": _backward_channels,
    "affine_channels": _affine_channels,
    "column_sums": _column_sums,
    "grad_sums": _grad_sums,
    "affine_rows": _affine_rows,
    "dx_rows": _dx_rows,
}


@functools.cache
def task_address(name: str) -> int:
    """The C address of a task (compiled on first use; numba's cache keeps it across processes)."""
    return numba_cache.cfunc(_TASKS[name], _SIGNATURE, depends_on=cpu, error_model="numpy").address


def run(
    runner: Runner, task: str, arrays: Sequence[np.ndarray], ints: Sequence[int], reals: Sequence[float], count: int
) -> None:
    """Run ``count`` tasks of ``task`` over ``arrays`` (C-contiguous; each stays alive through the call)."""
    ints_array = np.asarray(ints, _I64)
    reals_array = np.asarray(reals, _F64)
    keep = (*arrays, ints_array, reals_array)
    data = np.array([array.ctypes.data for array in keep], np.uintp)
    runner(task_address(task), count, data.ctypes.data)


def _channel_tasks(channels: int) -> int:
    return max(1, min(channels, MAX_CHANNEL_TASKS))


# -- the loops of cpu.py, on a pool -----------------------------------------------------------------------------
# activation: the loop's fused-activation arguments as cpu.py passes them -- forward (relu,), backward (y, relu).


def _relu(activation: tuple) -> int:
    return int(bool(activation and activation[-1]))


def _act(activation: tuple, dy: np.ndarray) -> np.ndarray:
    return activation[0] if activation and activation[-1] else dy


def train_channels_first(
    runner: Runner, x, gamma, bias, eps, alpha, beta, mean, var, inv_std, y, activation=()
) -> None:  # noqa: ANN001, E501
    outer, channels, inner = x.shape
    tasks = _channel_tasks(channels)
    run(
        runner, "train_channels", (x, gamma, bias, mean, var, inv_std, y),
        (outer, channels, inner, tasks, _relu(activation)), (eps, alpha, beta), tasks,
    )  # fmt: skip


def backward_channels_first(
    runner: Runner,
    dy,
    x,
    center,
    inv_std,
    gamma,
    global_stats,
    alpha,
    beta,
    sum_dy,
    sum_dy_xc,
    dx,
    activation=(),  # noqa: ANN001
) -> None:
    outer, channels, inner = x.shape
    tasks = _channel_tasks(channels)
    run(
        runner, "backward_channels", (dy, x, center, inv_std, gamma, sum_dy, sum_dy_xc, dx, _act(activation, dy)),
        (outer, channels, inner, tasks, int(global_stats), _relu(activation)), (alpha, beta), tasks,
    )  # fmt: skip


def affine_channels_first(runner: Runner, x, center, mul, add, alpha, beta, y, activation=()) -> None:  # noqa: ANN001
    outer, channels, inner = x.shape
    tasks = max(1, min(outer * channels, MAX_CHANNEL_TASKS))
    ints = (outer, channels, inner, tasks, _relu(activation))
    run(runner, "affine_channels", (x, center, mul, add, y), ints, (alpha, beta), tasks)


def column_sums(runner: Runner, x, center, squared, chunks, out) -> None:  # noqa: ANN001
    rows, width = x.shape
    part = np.empty((chunks, width))
    run(runner, "column_sums", (x, center, part), (rows, width, chunks, int(squared)), (), chunks)
    _add_chunks(part, out)


def grad_sums_rows(runner: Runner, dy, x, center, chunks, sum_dy, sum_dy_xc, activation=()) -> None:  # noqa: ANN001
    rows, width = x.shape
    part_dy, part_xc = np.empty((chunks, width)), np.empty((chunks, width))
    arrays = (dy, x, center, part_dy, part_xc, _act(activation, dy))
    run(runner, "grad_sums", arrays, (rows, width, chunks, _relu(activation)), (), chunks)
    _add_chunks(part_dy, sum_dy)
    _add_chunks(part_xc, sum_dy_xc)


def affine_rows(runner: Runner, x, center, mul, add, alpha, beta, chunks, y, activation=()) -> None:  # noqa: ANN001
    rows, width = x.shape
    a, b = mul * alpha, add * alpha  # as cpu._affine_rows computes them
    run(runner, "affine_rows", (x, center, a, b, y), (rows, width, chunks, _relu(activation)), (beta,), chunks)


def dx_rows(runner: Runner, dy, x, center, k_dy, k_xc, k_add, alpha, beta, chunks, dx, activation=()) -> None:  # noqa: ANN001
    rows, width = x.shape
    a, b, e = k_dy * alpha, k_xc * alpha, k_add * alpha  # as cpu._dx_rows computes them
    arrays = (dy, x, center, a, b, e, dx, _act(activation, dy))
    run(runner, "dx_rows", arrays, (rows, width, chunks, _relu(activation)), (beta,), chunks)
