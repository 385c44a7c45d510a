"""``weight * factor`` computed in float64 and rounded once: the hot loop of a fold, on every core.

NumPy's mixed-precision multiply (``dtype=float64`` into an ``out`` of the weight's type) casts through a
buffer and runs on one core, about 2.5 GB/s here. It releases the GIL, so a large weight is cut along its
first axis and the pieces run on a small thread pool: the same element-wise operation, the same bits.
(A numba kernel was about 3x faster on a warm process, but importing numba costs a one-shot
`bnfuse optimize` more than it saves on any model under a gigabyte.)
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from functools import cache

import numpy as np

# Below this a weight is scaled on the calling thread: handing work to the pool costs ~50 us.
MIN_PARALLEL_BYTES = 1 << 20


def scaled(weight: np.ndarray, factor: np.ndarray, limit: float = np.inf) -> tuple[np.ndarray, bool]:
    """(weight * factor rounded to weight's dtype, whether every value is finite and at most ``limit`` in size).

    ``factor`` broadcasts against ``weight`` (a per-channel scale with ones elsewhere); the result has the
    broadcast shape.
    """
    out = np.empty(np.broadcast_shapes(weight.shape, factor.shape), dtype=weight.dtype)
    workers = _workers()
    if out.nbytes < MIN_PARALLEL_BYTES or workers < 2 or out.ndim == 0 or out.shape[0] < 2:
        return out, _scale_part(weight, factor, out, slice(None), limit)
    bounds = np.linspace(0, out.shape[0], min(workers, out.shape[0]) + 1).astype(int)
    parts = [slice(a, b) for a, b in zip(bounds[:-1], bounds[1:], strict=True)]
    within = list(_pool().map(lambda part: _scale_part(weight, factor, out, part, limit), parts))
    return out, all(within)


def _scale_part(weight: np.ndarray, factor: np.ndarray, out: np.ndarray, part: slice, limit: float) -> bool:
    target = out[part]
    source = weight[part] if weight.ndim == out.ndim and weight.shape[0] == out.shape[0] else weight
    scale = factor[part] if factor.ndim == out.ndim and factor.shape[0] == out.shape[0] else factor
    with np.errstate(over="ignore", invalid="ignore"):
        np.multiply(source, scale, out=target, dtype=np.float64, casting="unsafe")
    if target.size == 0:
        return True
    largest = max(float(target.max()), -float(target.min()))  # NaN propagates and fails the comparison
    return bool(np.isfinite(largest)) and largest <= limit


def _workers() -> int:
    return min(4, os.cpu_count() or 1)


@cache
def _pool() -> ThreadPoolExecutor:
    return ThreadPoolExecutor(max_workers=_workers(), thread_name_prefix="bnfuse-scale")
