"""What bnfuse's Python side adds to the custom-op library's domain when onnxruntime calls RegisterCustomOps (through
the hook in native/python_hook.c): the kernels that stay in Python. The library registers the native CPU ops itself
(schema.NATIVE_CPU_OPS), with or without Python.

Imports run one way: this module reads the ops' modules (ops.py, sync_ops.py, conv_grad.py, conv_input_grad.py);
none of them reads it.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

from bnfuse.runtime import conv_grad, conv_input_grad, schema
from bnfuse.runtime.ops import CPU, CUDA, DOMAIN, DTYPE_PAIRS, OP_NAMES, OpSpec
from bnfuse.runtime.sync_ops import sync_op_specs


def available_providers() -> tuple[str, ...]:
    """The providers bnfuse has kernels for here: CPU, and CUDA where this onnxruntime has it and CuPy is
    installed (the CUDA kernels are CuPy kernels)."""
    import importlib.util

    import onnxruntime

    cuda = CUDA in onnxruntime.get_available_providers() and importlib.util.find_spec("cupy") is not None
    return (CPU, CUDA) if cuda else (CPU,)


_SPECS: dict[tuple[str, ...], tuple[OpSpec, ...]] = {}


def op_specs(providers: Iterable[str]) -> tuple[Any, ...]:
    """Every kernel to register for ``providers`` (the same objects on every call)."""
    key = tuple(p for p in (CPU, CUDA) if p in set(providers))
    if key not in _SPECS:
        _SPECS[key] = tuple(
            OpSpec(name, provider, data, param) for provider in key for name in OP_NAMES for data, param in DTYPE_PAIRS
        ) + sync_op_specs(key)  # the collective ops (SyncBN, all-reduce): see sync_ops.py
    return _SPECS[key]


_requested = threading.local()


@contextlib.contextmanager
def registering_for(providers: Iterable[str]) -> Iterator[None]:
    """Make RegisterCustomOps calls made by this thread register kernels for ``providers`` only."""
    previous = getattr(_requested, "providers", None)
    _requested.providers = tuple(providers)
    try:
        yield
    finally:
        _requested.providers = previous


@contextlib.contextmanager
def python_cpu_kernels() -> Iterator[None]:
    """Sessions made by this thread during the block run the BN ops on the CPU through the Python glue (cpu.py's
    kernels, BatchNormKernel) instead of the native library's C ops. For tests of the glue the CUDA kernels go
    through, on machines without a GPU; never needed otherwise."""
    previous = getattr(_requested, "python_cpu", False)
    _requested.python_cpu = True
    try:
        yield
    finally:
        _requested.python_cpu = previous


def registration() -> tuple[str, Sequence[OpSpec], bool]:
    """What ortabi adds to the library's domain when onnxruntime calls RegisterCustomOps, and whether the native BN
    ops join them (not under :func:`python_cpu_kernels`): the kernels that stay in Python -- the BN ops on CUDA, the
    collective ops (sync_ops.py), and on the CPU ConvWeightGrad (bnfuse/runtime/conv_grad.py) and ConvInputGrad
    (conv_input_grad.py). The library itself registers the native CPU ops (schema.NATIVE_CPU_OPS: the BN ops and the
    optimizer steps), with or without Python."""
    providers = getattr(_requested, "providers", None) or available_providers()
    specs = (*op_specs(providers), *conv_grad.SPECS, *conv_input_grad.SPECS)
    if getattr(_requested, "python_cpu", False):
        return DOMAIN, specs, False
    return DOMAIN, tuple(s for s in specs if not (s.provider == CPU and s.name in schema.NATIVE_BESIDE_PYTHON)), True
