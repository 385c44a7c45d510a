"""Tensors as onnxruntime hands them to a kernel: element types, NumPy / CuPy views over ORT's buffers, the
entry library's per-call helpers (:class:`_HotPath`) and their tensor tables, and :class:`KernelContext`."""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from typing import Any

import numpy as np

from bnfuse.runtime.ortabi.api import OrtApi, OrtError

# ONNXTensorElementDataType (= onnx TensorProto.DataType) for the dtypes bnfuse's kernels accept.
_ELEMENT_TYPES: dict[np.dtype, int] = {
    np.dtype(np.float32): 1,
    np.dtype(np.float16): 10,
    np.dtype(np.float64): 11,
    np.dtype(np.int64): 7,  # the collective ops' token and counts (sync_ops.py)
}
_DTYPES: dict[int, np.dtype] = {code: dtype for dtype, code in _ELEMENT_TYPES.items()}


# The table rows the entry library's hot-path helpers read and write (see native/python_hook.c): one int64 row per
# tensor, [data address, element type, rank, dims[8], OrtValue address]; rank -1 marks an absent tensor.
# For outputs the type field says whether ORT allocated the output (1) or the node does not have it (0).
ENTRY_ABI_VERSION = 5
MAX_RANK = 8
_DATA, _TYPE, _RANK, _DIMS = 0, 1, 2, 3
_VALUE = _DIMS + MAX_RANK
TENSOR_FIELDS = _VALUE + 1
_TABLE_ROWS = 8

# The OrtApi entries the helpers call, in the order of native/python_hook.c's bnfuse_tensor_api.
_TENSOR_API = (
    "CreateStatus",
    "KernelContext_GetInput",
    "KernelContext_GetOutput",
    "GetTensorTypeAndShape",
    "GetTensorElementType",
    "GetDimensionsCount",
    "GetDimensions",
    "ReleaseTensorTypeAndShapeInfo",
    "GetTensorMutableData",
    "KernelContext_GetOutputCount",
    "KernelContext_GetInputCount",
    "KernelContext_ParallelFor",  # NULL where the runtime predates it
)
_OPTIONAL_TENSOR_API = frozenset({"KernelContext_ParallelFor"})


class _TensorApi(ctypes.Structure):
    _fields_ = [(name, ctypes.c_void_p) for name in _TENSOR_API]


_TABLE_CALL = ctypes.PYFUNCTYPE(ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p)


class _HotPath:
    """The entry library's two per-call helpers, bound once onnxruntime has handed over its API table."""

    def __init__(self, library: ctypes.CDLL, api: OrtApi) -> None:
        fields, abi = getattr(library, "bnfuse_tensor_fields", None), getattr(library, "bnfuse_abi_version", None)
        for function in (fields, abi):
            if function is not None:
                function.restype, function.argtypes = ctypes.c_int, ()
        if fields is None or abi is None or fields() != TENSOR_FIELDS or abi() != ENTRY_ABI_VERSION:
            raise OrtError("bnfuse's entry library does not match bnfuse.runtime.ortabi: rebuild it (pip install -e .)")
        self.table_api = _TensorApi(*(_entry_address(api, name) for name in _TENSOR_API))
        setter = library.bnfuse_set_tensor_api
        setter.restype, setter.argtypes = None, (ctypes.POINTER(_TensorApi),)
        setter(ctypes.byref(self.table_api))
        self.read_inputs = _TABLE_CALL(ctypes.cast(library.bnfuse_read_inputs, ctypes.c_void_p).value)
        self.make_outputs = _TABLE_CALL(ctypes.cast(library.bnfuse_make_outputs, ctypes.c_void_p).value)


def _entry_address(api: OrtApi, name: str) -> int:
    if name in _OPTIONAL_TENSOR_API and getattr(api, name, None) is None:
        return 0
    return api.pointer(name)


_hot: _HotPath | None = None  # set once, by bind_hot_path; read by every KernelContext


def bind_hot_path(library: ctypes.CDLL, api: OrtApi) -> None:
    """Bind the entry library's helpers once onnxruntime has handed over its API table (entry.py)."""
    global _hot
    _hot = _HotPath(library, api)


# Scratch tables for the helpers. A pool, not thread-local storage: ORT's own threads (parallel execution
# mode) get a fresh Python thread state on every callback, which would drop thread-local data each time.
_tables: list[tuple[np.ndarray, int]] = []
# Output rows by requested shapes, made once: kernels ask for the same few shapes over and over.
_output_rows: dict[tuple[Any, ...], np.ndarray] = {}
_PADDING = tuple((0,) * (MAX_RANK - rank) for rank in range(MAX_RANK + 1))


def _take_table(rows: int) -> tuple[np.ndarray, int]:
    """A scratch table of at least ``rows`` rows: a pooled one, or one made for this call for a node with more
    tensors than the pooled tables hold (the fused optimizer steps' Python path)."""
    if rows <= _TABLE_ROWS:
        try:
            return _tables.pop()
        except IndexError:
            pass
    table = np.zeros((max(rows, _TABLE_ROWS), TENSOR_FIELDS), np.int64)
    return table, table.ctypes.data


def _give_table(table: np.ndarray, address: int) -> None:
    if len(table) == _TABLE_ROWS:  # only the usual size goes back to the pool
        _tables.append((table, address))


def _rows_for(shapes: tuple[Any, ...]) -> np.ndarray:
    rows = _output_rows.get(shapes)
    if rows is None:
        for shape in shapes:
            if shape is not None and len(shape) > MAX_RANK:
                raise OrtError(f"bnfuse's ops take tensors of at most {MAX_RANK} dimensions, got rank {len(shape)}")
        rows = np.array(
            [
                [0, 0, -1] + [0] * (MAX_RANK + 1)
                if shape is None
                else [0, 0, len(shape), *shape, *_PADDING[len(shape)], 0]
                for shape in shapes
            ],
            np.int64,
        )
        if len(_output_rows) > 256:  # bounded: shapes of a long-running process may keep changing
            _output_rows.clear()
        _output_rows[shapes] = rows
    return rows


class _ArrayInterface:
    """A throwaway object exposing a raw buffer through NumPy's array interface (no copy)."""

    __slots__ = ("__array_interface__",)


def numpy_view(address: int, shape: tuple[int, ...], dtype: np.dtype, *, writable: bool) -> np.ndarray:
    """A C-contiguous NumPy array over memory owned by someone else (here: onnxruntime)."""
    if address == 0 or 0 in shape:
        array = np.empty(shape, dtype)
        array.flags.writeable = writable
        return array
    holder = _ArrayInterface()
    holder.__array_interface__ = {
        "data": (address, not writable),
        "shape": shape,
        "typestr": dtype.str,
        "version": 3,
    }
    return np.asarray(holder)


def cupy_view(address: int, shape: tuple[int, ...], dtype: np.dtype, device_id: int, owner: object) -> Any:
    """A CuPy array over a CUDA device pointer owned by onnxruntime (no copy)."""
    import cupy  # the GPU path only; bnfuse imports without CuPy

    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    memory = cupy.cuda.UnownedMemory(address, nbytes, owner, device_id)
    return cupy.ndarray(shape, dtype, cupy.cuda.MemoryPointer(memory, 0))


def element_type(dtype: np.dtype | type | str) -> int:
    return _ELEMENT_TYPES[np.dtype(dtype)]


def dtype_of(code: int) -> np.dtype:
    try:
        return _DTYPES[code]
    except KeyError:
        raise OrtError(f"tensor element type {code} is not supported by bnfuse") from None


class ViewCache(dict):
    """Arrays of one kernel call by its tensor table (addresses, types, shapes): ORT hands a kernel the same
    few buffers call after call, and then the arrays of an earlier call serve again.

    A view only names memory (it owns nothing), so reusing one for the same address, type and shape is
    the same as making it again. Bounded; one per kernel and direction (read-only inputs, writable outputs).
    """

    __slots__ = ()
    LIMIT = 64

    def remember(self, key: bytes, views: tuple[Any, ...]) -> None:
        if len(self) >= self.LIMIT:
            self.clear()
        self[key] = views


_TASK = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_size_t)


def run_tasks(task: int, count: int, data: int) -> None:
    """Run the C function ``task(data, i)`` for i in 0..count-1 in order on this thread (GIL released)."""
    function = _TASK(task)
    for index in range(count):
        function(data, index)


class KernelContext:
    """One kernel invocation: inputs as views over ORT's memory, outputs allocated by ORT.

    On the CPU provider the arrays are NumPy views (inputs read-only); on CUDA they are CuPy arrays
    over ORT's device memory. Nothing is copied either way.
    """

    __slots__ = ("_api", "_context", "on_gpu", "_device_id", "_inputs", "_outputs")

    def __init__(
        self,
        api: OrtApi,
        context: int,
        on_gpu: bool,
        input_views: ViewCache | None = None,
        output_views: ViewCache | None = None,
    ) -> None:
        self._api = api
        self._context = context
        self.on_gpu = on_gpu
        self._device_id: int | None = None
        self._inputs = input_views if input_views is not None else ViewCache()
        self._outputs = output_views if output_views is not None else ViewCache()

    def input_count(self) -> int:
        count = ctypes.c_size_t()
        self._api.check(self._api.KernelContext_GetInputCount(self._context, ctypes.byref(count)))
        return count.value

    def output_count(self) -> int:
        count = ctypes.c_size_t()
        self._api.check(self._api.KernelContext_GetOutputCount(self._context, ctypes.byref(count)))
        return count.value

    def input_arrays(self, count: int) -> tuple[Any, ...]:
        """Inputs ``0 .. count-1`` as arrays over ORT's buffers (None for a missing optional input)."""
        table, address = _take_table(count)
        try:
            status = _hot.read_inputs(self._context, count, address)  # type: ignore[union-attr]
            if status:
                self._api.check(status)
            key = table[:count, :_VALUE].tobytes()  # the OrtValue address may change with the same buffer
            views = None if self.on_gpu else self._inputs.get(key)
            if views is not None:
                return views
            rows = table[:count].tolist()
        finally:
            _give_table(table, address)
        views = tuple(self._view(row, dtype_of(row[_TYPE]), False) if row[_RANK] >= 0 else None for row in rows)
        if not self.on_gpu:
            self._inputs.remember(key, views)
        return views

    def output_arrays(self, shapes: tuple[tuple[int, ...] | None, ...], dtypes: Sequence[np.dtype]) -> tuple[Any, ...]:
        """Have ORT allocate output ``i`` with ``shapes[i]`` (skipped where None) and view it as an array.

        ``dtypes`` are the registered output types (ORT allocates exactly those). An output the node does
        not use comes back as None.
        """
        count = len(shapes)
        table, address = _take_table(count)
        try:
            table[:count] = _rows_for(shapes)
            status = _hot.make_outputs(self._context, count, address)  # type: ignore[union-attr]
            if status:
                self._api.check(status)
            key = table[:count, :_VALUE].tobytes()  # the type field says which outputs ORT allocated
            views = None if self.on_gpu else self._outputs.get(key)
            if views is not None:
                return views
            rows = table[:count].tolist()
        finally:
            _give_table(table, address)
        views = tuple(self._view(row, dtypes[i], True) if row[_TYPE] else None for i, row in enumerate(rows))
        if not self.on_gpu:
            self._outputs.remember(key, views)
        return views

    def gpu_stream(self) -> int:
        """The cudaStream_t ORT runs this kernel on (0 on the CPU execution provider)."""
        stream = ctypes.c_void_p()
        self._api.check(self._api.KernelContext_GetGPUComputeStream(self._context, ctypes.byref(stream)))
        return stream.value or 0

    def parallel_for(self, task: int, count: int, data: int) -> None:
        """Run the C function ``task(data, i)`` for i in 0..count-1 on onnxruntime's intra-op pool (the calling
        thread takes part; the pool's threads otherwise sleep while a custom op runs). The tasks run without
        the GIL and must not touch Python. Serially on this thread where the runtime predates the call."""
        if self._api.KernelContext_ParallelFor is None or count < 2:
            run_tasks(task, count, data)
            return
        self._api.check(self._api.KernelContext_ParallelFor(self._context, task, count, 0, data))

    def _view(self, row: list[int], dtype: np.dtype, writable: bool) -> Any:
        shape = tuple(row[_DIMS : _DIMS + row[_RANK]])
        if self.on_gpu:
            return cupy_view(row[_DATA], shape, dtype, self._device(row[_VALUE]), self)
        return numpy_view(row[_DATA], shape, dtype, writable=writable)

    def _device(self, value: int) -> int:
        """The CUDA device of an ORT value (asked once per call: one kernel runs on one device)."""
        if self._device_id is None:
            info = ctypes.c_void_p()
            self._api.check(self._api.GetTensorMemoryInfo(value, ctypes.byref(info)))
            device = ctypes.c_int()
            self._api.check(self._api.MemoryInfoGetId(info, ctypes.byref(device)))
            self._device_id = device.value
        return self._device_id
