"""A stand-in for the part of CuPy that bnfuse/runtime/cuda.py (and sync_ops.py's array math) uses, backed by
NumPy and the CUDA emulator.

Only for bnfuse's tests: this directory goes on PYTHONPATH of a subprocess (tests/runtime/test_cuda.py), so
cuda.py imports it as ``cupy`` and runs unchanged. Device arrays live in emulator allocations (guard page
after the last byte, new memory NaN-filled); like CuPy, a device array never converts to a NumPy array
implicitly, and NumPy arrays are not accepted where device arrays are expected.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import numpy as np
from numpy.lib.mixins import NDArrayOperatorsMixin

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import cuda_emu  # noqa: E402

from . import cuda  # noqa: E402

__version__ = "0.0.0+bnfuse-cuda-emulator"
EMULATED = True
float16, float32, float64, int32, int64 = np.float16, np.float32, np.float64, np.int32, np.int64


class _Flags:
    def __init__(self, array: np.ndarray):
        self.c_contiguous = bool(array.flags.c_contiguous)
        self.f_contiguous = bool(array.flags.f_contiguous)


class _Pointer:
    def __init__(self, ptr: int):
        self.ptr = ptr


class ndarray(NDArrayOperatorsMixin):  # noqa: N801 - CuPy's name
    """A device array: a NumPy view of emulator memory, reachable only through device operations."""

    def __init__(self, view: np.ndarray, allocation: cuda_emu.Allocation):
        self._view = view
        self._allocation = allocation

    # -- what kernels and cuda.py read --
    def __cuda_emu_device__(self) -> tuple[cuda_emu.Allocation, int]:
        return self._allocation, self._view.ctypes.data

    shape = property(lambda self: self._view.shape)
    dtype = property(lambda self: self._view.dtype)
    size = property(lambda self: self._view.size)
    ndim = property(lambda self: self._view.ndim)
    nbytes = property(lambda self: self._view.nbytes)
    itemsize = property(lambda self: self._view.itemsize)
    strides = property(lambda self: self._view.strides)
    flags = property(lambda self: _Flags(self._view))
    data = property(lambda self: _Pointer(self._view.ctypes.data))
    device = property(lambda self: cuda.Device(0))

    def __len__(self) -> int:
        return len(self._view)

    def __repr__(self) -> str:
        return f"cupy-emulated array({self._view!r})"

    def __array__(self, *args: Any, **kwargs: Any) -> np.ndarray:
        raise TypeError("Implicit conversion to a NumPy array is not allowed. Please use `.get()` to construct a "
                        "NumPy array explicitly.")  # fmt: skip

    def get(self) -> np.ndarray:
        return self._view.copy()

    def _wrap_view(self, view: np.ndarray) -> ndarray:
        if view.size and not np.shares_memory(view, self._view):
            return _to_device(view)
        return ndarray(view, self._allocation)

    def reshape(self, *shape: Any, order: str = "C") -> ndarray:
        return self._wrap_view(self._view.reshape(*shape, order=order))

    def ravel(self) -> ndarray:
        return self._wrap_view(self._view.ravel())

    def view(self, dtype: Any = None) -> ndarray:
        return ndarray(self._view.view(dtype), self._allocation)

    def astype(self, dtype: Any, copy: bool = True, order: str = "K") -> ndarray:
        if not copy and self._view.dtype == np.dtype(dtype):
            return self
        return _to_device(self._view.astype(dtype, order=order))

    def copy(self) -> ndarray:
        return _to_device(self._view)

    def fill(self, value: Any) -> None:
        self._view.fill(value)

    # -- reductions (sync_ops.py's float64 moments), results on the device as CuPy's --
    def sum(self, axis: Any = None, dtype: Any = None, keepdims: bool = False) -> ndarray:
        return _to_device(self._view.sum(axis=axis, dtype=dtype, keepdims=keepdims))

    def mean(self, axis: Any = None, dtype: Any = None, keepdims: bool = False) -> ndarray:
        return _to_device(self._view.mean(axis=axis, dtype=dtype, keepdims=keepdims))

    def __float__(self) -> float:  # CuPy copies a one-element array to the host for float()
        if self._view.size != 1:
            raise TypeError("only length-1 arrays can be converted to Python scalars")
        return float(self._view.reshape(-1)[0])

    def __getitem__(self, key: Any) -> ndarray:
        return self._wrap_view(self._view[_unwrap_key(key)])

    def __setitem__(self, key: Any, value: Any) -> None:
        self._view[_unwrap_key(key)] = value._view if isinstance(value, ndarray) else value

    def __array_ufunc__(self, ufunc: np.ufunc, method: str, *inputs: Any, **kwargs: Any) -> Any:
        if method != "__call__":
            return NotImplemented
        args = [_unwrap_operand(a) for a in inputs]
        out = kwargs.pop("out", None)
        if out is not None:
            targets = tuple(_unwrap_operand(o) for o in out)
            ufunc(*args, out=targets, **kwargs)
            return out[0] if len(out) == 1 else out
        result = ufunc(*args, **kwargs)
        return tuple(_to_device(r) for r in result) if isinstance(result, tuple) else _to_device(result)


def _unwrap_operand(value: Any) -> Any:
    if isinstance(value, ndarray):
        return value._view
    if isinstance(value, np.ndarray):
        raise TypeError("Unsupported type <class 'numpy.ndarray'>")  # as CuPy: no host arrays in device math
    return value


def _unwrap_key(key: Any) -> Any:
    if isinstance(key, tuple):
        return tuple(_unwrap_key(k) for k in key)
    return key._view if isinstance(key, ndarray) else key


def _allocate(shape: Any, dtype: Any) -> ndarray:
    dtype = np.dtype(dtype)
    shape = (shape,) if isinstance(shape, int | np.integer) else tuple(int(s) for s in shape)
    count = int(np.prod(shape, dtype=np.int64))
    allocation = cuda_emu.Allocation(count * dtype.itemsize)
    return ndarray(allocation.bytes.view(dtype).reshape(shape), allocation)


def _to_device(host: Any, dtype: Any = None) -> ndarray:
    host = np.asarray(host, dtype=dtype)
    array = _allocate(host.shape, host.dtype)
    array._view[...] = host
    return array


def empty(shape: Any, dtype: Any = float) -> ndarray:
    return _allocate(shape, dtype)  # NaN-filled (0xff bytes): reading what a kernel never wrote shows


def empty_like(a: ndarray, dtype: Any = None) -> ndarray:
    return _allocate(a.shape, dtype or a.dtype)


def zeros(shape: Any, dtype: Any = float) -> ndarray:
    out = _allocate(shape, dtype)
    out._view[...] = 0
    return out


def ones(shape: Any, dtype: Any = float) -> ndarray:
    out = _allocate(shape, dtype)
    out._view[...] = 1
    return out


def zeros_like(a: ndarray, dtype: Any = None) -> ndarray:
    return zeros(a.shape, dtype or a.dtype)


def einsum(subscripts: str, *operands: ndarray) -> ndarray:
    return _to_device(np.einsum(subscripts, *(_unwrap_operand(o) for o in operands)))


def asarray(a: Any, dtype: Any = None) -> ndarray:
    if isinstance(a, ndarray):
        return a if dtype is None or a.dtype == np.dtype(dtype) else a.astype(dtype)
    return _to_device(a, dtype)


array = asarray


def ascontiguousarray(a: Any, dtype: Any = None) -> ndarray:
    if not isinstance(a, ndarray):
        raise TypeError(f"Unsupported type {type(a)}")
    if a.flags.c_contiguous and (dtype is None or a.dtype == np.dtype(dtype)):
        return a
    return _to_device(np.ascontiguousarray(a._view, dtype=dtype))


def asnumpy(a: Any) -> np.ndarray:
    return a.get() if isinstance(a, ndarray) else np.asarray(a)


def repeat(a: ndarray, repeats: int, axis: Any = None) -> ndarray:
    return _to_device(np.repeat(a._view, repeats, axis=axis))


def __getattr__(name: str) -> Any:
    """NumPy's ufuncs (cupy.sqrt, ...) on device arrays."""
    function = getattr(np, name, None)
    if isinstance(function, np.ufunc):
        return function  # dispatches to ndarray.__array_ufunc__
    raise AttributeError(f"the cupy stand-in has no {name!r} (bnfuse's cuda.py should not need it)")


class RawModule:
    """CuPy's RawModule: the same source text and NVRTC options, compiled by g++ for the emulator."""

    def __init__(self, code: str, options: tuple[str, ...] = (), **kwargs: Any):
        if kwargs:
            raise TypeError(f"RawModule options the stand-in does not emulate: {sorted(kwargs)}")
        self._module = cuda_emu.compile_module(code, tuple(options))

    def get_function(self, name: str) -> cuda_emu.Kernel:
        return self._module.get_function(name)
