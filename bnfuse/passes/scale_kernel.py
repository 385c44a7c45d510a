"""``weight * factor`` along one channel axis, computed in float64 and rounded once: the hot loop of a fold.

NumPy's mixed-precision multiply (``dtype=float64`` into a float32 ``out``) buffers every element through a
cast and runs on one core; on an unaligned weight, such as a view of a mapped file (protobuf gives
raw_data no alignment), it takes its slow path and is several times slower still. This numba kernel makes
one pass over the weight on every core, checks finiteness on the way, and gives the same bits as the NumPy
expression. It is used for float32 / float64 weights of at least MIN_KERNEL_BYTES, so a small model never
pays numba's import.
"""

from __future__ import annotations

from functools import cache
from typing import Any

import numpy as np

MIN_KERNEL_BYTES = 1 << 20


def scaled_along_axis(weight: np.ndarray, factor: np.ndarray) -> tuple[np.ndarray, bool] | None:
    """(weight * factor rounded to weight's dtype, all finite) or None when the kernel does not apply.

    ``factor`` is float64 and broadcasts against ``weight`` along at most one axis (a per-channel scale).
    """
    if weight.dtype not in (np.float32, np.float64) or weight.nbytes < MIN_KERNEL_BYTES:
        return None
    if factor.dtype != np.float64 or factor.ndim != weight.ndim:
        return None
    axes = [i for i, n in enumerate(factor.shape) if n != 1]
    if len(axes) > 1 or (axes and factor.shape[axes[0]] != weight.shape[axes[0]]):
        return None
    axis = axes[0] if axes else 0
    outer = int(np.prod(weight.shape[:axis], dtype=np.int64))
    inner = int(np.prod(weight.shape[axis + 1 :], dtype=np.int64))
    channels = weight.shape[axis]
    rows = weight.reshape(outer, channels, inner)  # a view: weight is C-contiguous (a mapped or loaded tensor)
    if not np.shares_memory(rows, weight):
        return None
    out = np.empty(weight.shape, dtype=weight.dtype)
    scale = np.ascontiguousarray(np.broadcast_to(factor.reshape(-1), (channels,)))
    bad = _kernel()(rows, scale, out.reshape(outer, channels, inner))
    return out, bad == 0


@cache
def _kernel() -> Any:
    import numba as nb

    @nb.njit(parallel=True, cache=True, nogil=True, fastmath=False)
    def scale_rows(rows: np.ndarray, scale: np.ndarray, out: np.ndarray) -> int:
        outer, channels, inner = rows.shape
        bad = 0
        for row in nb.prange(outer * channels):
            o, c = row // channels, row % channels
            s = scale[c]
            row_bad = 0
            for i in range(inner):
                value = rows[o, c, i] * s  # float32 promotes to float64; the store rounds once
                out[o, c, i] = value
                if not np.isfinite(out[o, c, i]):
                    row_bad += 1
            bad += row_bad
        return bad

    return scale_rows
