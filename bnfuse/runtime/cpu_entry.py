"""The CPU kernels' small-tensor path as C functions, for the entry library's per-call fast path.

onnxruntime calls ortentry.c's ``bnfuse_compute`` for every bnfuse kernel; for a float32 node on the CPU
provider whose X is under cpu.POOL_FROM_BYTES, it reads the tensors, checks their shapes, has ORT
allocate the outputs and calls one of these C functions (bnfuse/runtime/cpuserial.c's entry_*) -- no Python,
no GIL, no thread pool. They run the serial kernels cpu.py's direct calls run (with float32 parameters widened to
float64), so the fast path gives the bits the direct kernels give.

One C signature for all three: ``void f(void **tensors, const int64_t *ints, const double *reals)`` with
tensors = the op's inputs then its outputs (ops.INPUT_NAMES / OUTPUT_NAMES order; a fused Grad's Y last, slot 11),
ints = [outer, channels, inner, flags, batch_var present], reals = [epsilon, batch weight]; flags: FIX_GAMMA |
UNBIASED | GLOBAL_STATS | RELU.
"""

from __future__ import annotations

UNBIASED, FIX_GAMMA, GLOBAL_STATS, RELU = 1, 2, 4, 8  # cpukernels.h's flags; RELU: ortentry.c's BNFUSE_RELU


def entry_address(kernel: str) -> int:
    """The address of the C function standing in for cpu.<kernel> on small tensors."""
    from bnfuse.runtime import _cpukernels

    return _cpukernels.entries()[kernel]
