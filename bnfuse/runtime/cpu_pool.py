"""The CPU kernels' parallel loops as C tasks, run on onnxruntime's intra-op pool or on the C extension's own.

Every parallel loop of cpu.py is a C function ``void task(void **data, size_t index)`` (bnfuse/runtime/cpuloops.c)
of which task ``index`` runs one range of channels or one fixed row chunk, without the GIL. Inside an onnxruntime
session the op hands the tasks to ``KernelContext_ParallelFor`` (ortabi.KernelContext.parallel_for): they run on the
session's own threads (bnfuse turns their spinning off), with no second pool beside them. Called directly, the same
tasks run on the C extension's small pthread pool with a given thread count.

Same bits either way: channel ranges may be cut anywhere (channels are independent); row chunks come from the shape
(cpu._chunks), never from the pool, and their partial sums are added here in chunk order.

``data``: an array of addresses -- the arrays a loop reads and writes, then an int64 array and a float64 array of
its scalars (the layouts: each function below, and cpuloops.c's task_* functions). ``run(how, task, arrays, ints,
reals, count)`` builds it in C, keeps every array alive through the call and runs ``count`` tasks: ``how`` is a
runner (the kernel context's ``parallel_for``) or a thread count for the C pool.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from bnfuse.runtime import _cpukernels

Runner = Callable[[int, int, int], None]  # (task address, task count, data address)
How = Runner | int  # a runner, or the C pool's thread count
MAX_CHANNEL_TASKS = 64  # channel ranges per loop: enough for dynamic balance on a many-core pool
_TASKS = _cpukernels.addresses()


def task_address(name: str) -> int:
    """The C address of a task."""
    return _TASKS[name]


def run(
    how: How, task: str, arrays: Sequence[np.ndarray], ints: Sequence[int], reals: Sequence[float], count: int
) -> None:
    """Run ``count`` tasks of ``task`` over ``arrays`` (C-contiguous; each stays alive through the call)."""
    _cpukernels.run(_TASKS[task], count, tuple(arrays), tuple(ints), tuple(reals), how)


def _add_chunks(part: np.ndarray, out: np.ndarray) -> None:
    """out[f] = sum over chunks k, in order, of part[k, f] (what the serial kernels do too)."""
    out[...] = 0.0
    for k in range(part.shape[0]):
        np.add(out, part[k], out=out)


def _channel_tasks(channels: int) -> int:
    return max(1, min(channels, MAX_CHANNEL_TASKS))


# -- the loops of cpu.py, on a pool -----------------------------------------------------------------------------
# activation: the loop's fused-activation arguments as cpu.py passes them -- forward (relu,), backward (y, relu).


def _relu(activation: tuple) -> int:
    return int(bool(activation and activation[-1]))


def _act(activation: tuple, dy: np.ndarray) -> np.ndarray:
    return activation[0] if activation and activation[-1] else dy


def train_channels_first(runner: How, x, gamma, bias, eps, alpha, beta, mean, var, inv_std, y, activation=()) -> None:  # noqa: ANN001, E501
    outer, channels, inner = x.shape
    tasks = _channel_tasks(channels)
    run(
        runner, "train_channels", (x, gamma, bias, mean, var, inv_std, y),
        (outer, channels, inner, tasks, _relu(activation)), (eps, alpha, beta), tasks,
    )  # fmt: skip


def backward_channels_first(
    runner: How,
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


def affine_channels_first(runner: How, x, center, mul, add, alpha, beta, y, activation=()) -> None:  # noqa: ANN001
    outer, channels, inner = x.shape
    tasks = max(1, min(outer * channels, MAX_CHANNEL_TASKS))
    ints = (outer, channels, inner, tasks, _relu(activation))
    run(runner, "affine_channels", (x, center, mul, add, y), ints, (alpha, beta), tasks)


def column_sums(runner: How, x, center, squared, chunks, out) -> None:  # noqa: ANN001
    rows, width = x.shape
    part = np.empty((chunks, width))
    run(runner, "column_sums", (x, center, part), (rows, width, chunks, int(squared)), (), chunks)
    _add_chunks(part, out)


def grad_sums_rows(runner: How, dy, x, center, chunks, sum_dy, sum_dy_xc, activation=()) -> None:  # noqa: ANN001
    rows, width = x.shape
    part_dy, part_xc = np.empty((chunks, width)), np.empty((chunks, width))
    arrays = (dy, x, center, part_dy, part_xc, _act(activation, dy))
    run(runner, "grad_sums", arrays, (rows, width, chunks, _relu(activation)), (), chunks)
    _add_chunks(part_dy, sum_dy)
    _add_chunks(part_xc, sum_dy_xc)


def affine_rows(runner: How, x, center, mul, add, alpha, beta, chunks, y, activation=()) -> None:  # noqa: ANN001
    rows, width = x.shape
    a, b = mul * alpha, add * alpha  # as cpu._affine_rows computes them
    run(runner, "affine_rows", (x, center, a, b, y), (rows, width, chunks, _relu(activation)), (beta,), chunks)


def dx_rows(runner: How, dy, x, center, k_dy, k_xc, k_add, alpha, beta, chunks, dx, activation=()) -> None:  # noqa: ANN001
    rows, width = x.shape
    a, b, e = k_dy * alpha, k_xc * alpha, k_add * alpha  # as cpu._dx_rows computes them
    arrays = (dy, x, center, a, b, e, dx, _act(activation, dy))
    run(runner, "dx_rows", arrays, (rows, width, chunks, _relu(activation)), (beta,), chunks)
