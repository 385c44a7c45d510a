"""Pick a BN kernel backend by name or by the kind of array at hand.

Every backend module exposes the same three functions (see bnfuse/runtime/kernel_types.py):
``forward_inference``, ``forward_training`` and ``backward``.
"""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Any

from bnfuse.runtime.semantics import BatchNormError

BACKENDS = ("reference", "cpu", "cuda")


def backend(name: str) -> ModuleType:
    """The kernel module ``bnfuse.runtime.<name>``; "cuda" needs CuPy (imported when first called)."""
    if name not in BACKENDS:
        raise BatchNormError(f"unknown kernel backend {name!r} (expected one of {', '.join(BACKENDS)})")
    return importlib.import_module(f"bnfuse.runtime.{name}")


def for_array(x: Any) -> ModuleType:
    """The fast backend for where ``x`` lives: cuda for CuPy arrays, cpu for NumPy arrays."""
    module = type(x).__module__.split(".")[0]
    if module == "cupy":
        return backend("cuda")
    if module == "numpy":
        return backend("cpu")
    raise BatchNormError(f"no kernel backend for arrays of type {type(x).__module__}.{type(x).__name__}")
