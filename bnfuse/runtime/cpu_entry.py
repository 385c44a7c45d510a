"""The CPU kernels' small-tensor path as C functions, for the entry library's per-call fast path.

onnxruntime calls ortentry.c's ``bnfuse_compute`` for every bnfuse kernel; for a float32 node on the CPU
provider whose X is under cpu.POOL_FROM_BYTES, it reads the tensors, checks their shapes, has ORT
allocate the outputs and calls one of these numba ``cfunc`` s -- no Python, no GIL, no thread pool. They
wrap cpu.serial_inference / serial_training / serial_backward, so the fast path gives the bits the direct
kernels give.

One C signature for all three: ``void f(void **tensors, const int64_t *ints, const double *reals)`` with
tensors = the op's inputs then its outputs (ops.INPUT_NAMES / OUTPUT_NAMES order; a fused Grad's Y last, slot 11),
ints = [outer, channels, inner, flags, batch_var present], reals = [epsilon, batch weight]; flags: FIX_GAMMA |
UNBIASED | GLOBAL_STATS | RELU.
"""

from __future__ import annotations

import functools

import numba as nb
import numpy as np
from numba import types

from bnfuse.runtime import cpu, numba_cache

UNBIASED, FIX_GAMMA, GLOBAL_STATS, RELU = 1, 2, 4, 8  # RELU: ortentry.c's BNFUSE_RELU
_Y_SLOT = 11  # Grad with RELU: Y after the 5 inputs and 6 output slots (ortentry.c's BNFUSE_Y_SLOT)
_SIGNATURE = types.void(types.CPointer(types.voidptr), types.CPointer(types.int64), types.CPointer(types.float64))
_F32 = np.float32


@nb.njit(cache=True, nogil=True)
def _data(pointer, outer, channels, inner):  # pragma: no cover - compiled
    return nb.carray(pointer, (outer, channels, inner), _F32)


@nb.njit(cache=True, nogil=True)
def _param(pointer, channels):  # pragma: no cover - compiled
    return nb.carray(pointer, (channels,), _F32)


def _inference(tensors, ints, reals):  # pragma: no cover - compiled
    outer, channels, inner, flags = ints[0], ints[1], ints[2], ints[3]
    x, y = _data(tensors[0], outer, channels, inner), _data(tensors[5], outer, channels, inner)
    scale, bias = _param(tensors[1], channels), _param(tensors[2], channels)
    mean, var = _param(tensors[3], channels), _param(tensors[4], channels)
    cpu.serial_inference(x, scale, bias, mean, var, reals[0], (flags & FIX_GAMMA) != 0, 1.0, 0.0, y)


def _training(tensors, ints, reals):  # pragma: no cover - compiled
    outer, channels, inner, flags = ints[0], ints[1], ints[2], ints[3]
    x, y = _data(tensors[0], outer, channels, inner), _data(tensors[5], outer, channels, inner)
    batch_var = _param(tensors[10], channels if ints[4] else 0)
    cpu.serial_training(
        x, _param(tensors[1], channels), _param(tensors[2], channels), _param(tensors[3], channels),
        _param(tensors[4], channels), reals[0], reals[1], (flags & UNBIASED) != 0, (flags & FIX_GAMMA) != 0,
        (flags & GLOBAL_STATS) != 0, 1.0, 0.0, (flags & RELU) != 0, y, _param(tensors[6], channels),
        _param(tensors[7], channels), _param(tensors[8], channels), _param(tensors[9], channels), batch_var,
    )  # fmt: skip


def _backward(tensors, ints, reals):  # pragma: no cover - compiled
    outer, channels, inner, flags = ints[0], ints[1], ints[2], ints[3]
    dy, x = _data(tensors[0], outer, channels, inner), _data(tensors[1], outer, channels, inner)
    relu = (flags & RELU) != 0
    y = _data(tensors[_Y_SLOT], outer, channels, inner) if relu else dy
    cpu.serial_backward(
        dy, x, _param(tensors[2], channels), _param(tensors[3], channels), _param(tensors[4], channels),
        (flags & FIX_GAMMA) != 0, (flags & GLOBAL_STATS) != 0, 1.0, 0.0, y, relu,
        _data(tensors[5], outer, channels, inner), _param(tensors[6], channels), _param(tensors[7], channels),
    )  # fmt: skip


_FUNCTIONS = {"forward_inference": _inference, "forward_training": _training, "backward": _backward}


@functools.cache
def entry_address(kernel: str) -> int:
    """The address of the C function standing in for cpu.<kernel> on small tensors (compiled on first use)."""
    return numba_cache.cfunc(_FUNCTIONS[kernel], _SIGNATURE, depends_on=cpu).address
