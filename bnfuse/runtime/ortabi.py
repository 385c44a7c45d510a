"""onnxruntime's C ABI for bnfuse's custom ops: the only module of bnfuse that touches ctypes.

How the pieces meet:

* ``ortentry.c`` (built as ``bnfuse/runtime/_ortentry*.so``) exports ``RegisterCustomOps``, the symbol
  ``SessionOptions.register_custom_ops_library`` looks for. It forwards to a Python callback that
  :func:`install` sets through ctypes; loading the same path gives the handle onnxruntime dlopens.
* The callback builds ``OrtCustomOp`` structs (version 16: ``CreateKernelV2`` / ``KernelComputeV2``,
  so a Python exception becomes an ``OrtStatus`` that onnxruntime raises with our message) for the op
  specs it is given, puts them in one custom-op domain and adds the domain to the session options. Every
  function pointer in a struct is the entry library's: onnxruntime's questions about the op (name, provider,
  types, characteristics) are answered in C from a description placed right after the struct
  (:class:`_OpDescription`); only creating, running and destroying a kernel reach Python.
* Kernels see ORT's own buffers: NumPy views over CPU tensors, CuPy arrays over CUDA device pointers,
  and the CUDA stream ORT computes on.
* Every kernel's ``KernelComputeV2`` is the entry library's ``bnfuse_compute``; ``op_kernel`` is a
  :class:`_Plan` made once when ORT creates the kernel. A kernel with a fast path (float32 on the CPU
  provider: ops.py decides) is served in C for small tensors: the library reads shapes and pointers,
  has ORT allocate the outputs and calls a numba ``cfunc`` -- no Python, no GIL. Everything else calls
  back into Python, whose hot path makes two C calls into the entry library (``bnfuse_read_inputs`` /
  ``bnfuse_make_outputs``, which call the OrtApi entries this module hands them: :class:`_HotPath`)
  instead of ~30 ctypes calls; views of an earlier call are reused when ORT passes the same buffers.
* Lifetime in someone else's process: onnxruntime calls the op structs, plans and callbacks for as long as a
  session using them exists, and sessions held in a runpy namespace, a cache or a reference cycle die in the
  interpreter's final garbage collection, after this module's globals are gone. So everything onnxruntime may
  call is kept for the life of the process (:func:`_keep_for_process`: the registry and the entry, never
  freed), and the entry library asks the interpreter before each call into Python: once it is finalizing,
  RegisterCustomOps, CreateKernelV2 and compute return an error status and KernelDestroy returns at once
  (ortentry.c, ``bnfuse_set_python``).
* OpenMP's settings belong to whoever else runs in the process (PyTorch reads ``omp_get_max_threads`` for its
  intra-op threads): :func:`openmp_settings_kept` puts back every loaded OpenMP runtime's thread count, dynamic
  adjustment and nesting after code that may change them (numba's OpenMP layer sets them when it starts).

The ``OrtApi`` function table is declared from the order of the public header
``onnxruntime_c_api.h``. The table is append-only and onnxruntime hands the same table to every
requested version it supports, so indices never move; :data:`API_VERSION` is the oldest version that
has every entry (and custom-op struct field) used here, which keeps old runtimes working.
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib.machinery
import os
import threading
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, Protocol

import numpy as np

API_VERSION = 16  # CreateKernelV2 / KernelComputeV2 appeared in custom-op version 16 (onnxruntime 1.16)
PARALLEL_FOR_VERSION = 17  # KernelContext_ParallelFor (onnxruntime 1.17): used where the runtime has it
CUSTOM_OP_VERSION = 16

CPU_PROVIDER = "CPUExecutionProvider"
CUDA_PROVIDER = "CUDAExecutionProvider"

# OrtErrorCode
ORT_FAIL = 1
ORT_INVALID_ARGUMENT = 2
ORT_RUNTIME_EXCEPTION = 6

# OrtCustomOpInputOutputCharacteristic
INPUT_OUTPUT_REQUIRED = 0
INPUT_OUTPUT_OPTIONAL = 1
INPUT_OUTPUT_VARIADIC = 2

# ONNXTensorElementDataType (= onnx TensorProto.DataType) for the dtypes bnfuse's kernels accept.
_ELEMENT_TYPES: dict[np.dtype, int] = {
    np.dtype(np.float32): 1,
    np.dtype(np.float16): 10,
    np.dtype(np.float64): 11,
    np.dtype(np.int64): 7,  # the collective ops' token and counts (sync_ops.py)
}
_DTYPES: dict[int, np.dtype] = {code: dtype for dtype, code in _ELEMENT_TYPES.items()}

# OrtApi entries in header order, up to the last one used here (index = position).
_API_ENTRIES = """
CreateStatus GetErrorCode GetErrorMessage CreateEnv CreateEnvWithCustomLogger EnableTelemetryEvents
DisableTelemetryEvents CreateSession CreateSessionFromArray Run CreateSessionOptions SetOptimizedModelFilePath
CloneSessionOptions SetSessionExecutionMode EnableProfiling DisableProfiling EnableMemPattern DisableMemPattern
EnableCpuMemArena DisableCpuMemArena SetSessionLogId SetSessionLogVerbosityLevel SetSessionLogSeverityLevel
SetSessionGraphOptimizationLevel SetIntraOpNumThreads SetInterOpNumThreads CreateCustomOpDomain CustomOpDomain_Add
AddCustomOpDomain RegisterCustomOpsLibrary SessionGetInputCount SessionGetOutputCount
SessionGetOverridableInitializerCount SessionGetInputTypeInfo SessionGetOutputTypeInfo
SessionGetOverridableInitializerTypeInfo SessionGetInputName SessionGetOutputName
SessionGetOverridableInitializerName CreateRunOptions RunOptionsSetRunLogVerbosityLevel
RunOptionsSetRunLogSeverityLevel RunOptionsSetRunTag RunOptionsGetRunLogVerbosityLevel
RunOptionsGetRunLogSeverityLevel RunOptionsGetRunTag RunOptionsSetTerminate RunOptionsUnsetTerminate
CreateTensorAsOrtValue CreateTensorWithDataAsOrtValue IsTensor GetTensorMutableData FillStringTensor
GetStringTensorDataLength GetStringTensorContent CastTypeInfoToTensorInfo GetOnnxTypeFromTypeInfo
CreateTensorTypeAndShapeInfo SetTensorElementType SetDimensions GetTensorElementType GetDimensionsCount
GetDimensions GetSymbolicDimensions GetTensorShapeElementCount GetTensorTypeAndShape GetTypeInfo GetValueType
CreateMemoryInfo CreateCpuMemoryInfo CompareMemoryInfo MemoryInfoGetName MemoryInfoGetId MemoryInfoGetMemType
MemoryInfoGetType AllocatorAlloc AllocatorFree AllocatorGetInfo GetAllocatorWithDefaultOptions
AddFreeDimensionOverride GetValue GetValueCount CreateValue CreateOpaqueValue GetOpaqueValue
KernelInfoGetAttribute_float KernelInfoGetAttribute_int64 KernelInfoGetAttribute_string
KernelContext_GetInputCount KernelContext_GetOutputCount KernelContext_GetInput KernelContext_GetOutput
ReleaseEnv ReleaseStatus ReleaseMemoryInfo ReleaseSession ReleaseValue ReleaseRunOptions ReleaseTypeInfo
ReleaseTensorTypeAndShapeInfo ReleaseSessionOptions ReleaseCustomOpDomain GetDenotationFromTypeInfo
CastTypeInfoToMapTypeInfo CastTypeInfoToSequenceTypeInfo GetMapKeyType GetMapValueType GetSequenceElementType
ReleaseMapTypeInfo ReleaseSequenceTypeInfo SessionEndProfiling SessionGetModelMetadata
ModelMetadataGetProducerName ModelMetadataGetGraphName ModelMetadataGetDomain ModelMetadataGetDescription
ModelMetadataLookupCustomMetadataMap ModelMetadataGetVersion ReleaseModelMetadata CreateEnvWithGlobalThreadPools
DisablePerSessionThreads CreateThreadingOptions ReleaseThreadingOptions ModelMetadataGetCustomMetadataMapKeys
AddFreeDimensionOverrideByName GetAvailableProviders ReleaseAvailableProviders GetStringTensorElementLength
GetStringTensorElement FillStringTensorElement AddSessionConfigEntry CreateAllocator ReleaseAllocator
RunWithBinding CreateIoBinding ReleaseIoBinding BindInput BindOutput BindOutputToDevice GetBoundOutputNames
GetBoundOutputValues ClearBoundInputs ClearBoundOutputs TensorAt CreateAndRegisterAllocator SetLanguageProjection
SessionGetProfilingStartTimeNs SetGlobalIntraOpNumThreads SetGlobalInterOpNumThreads SetGlobalSpinControl
AddInitializer CreateEnvWithCustomLoggerAndGlobalThreadPools SessionOptionsAppendExecutionProvider_CUDA
SessionOptionsAppendExecutionProvider_ROCM SessionOptionsAppendExecutionProvider_OpenVINO SetGlobalDenormalAsZero
CreateArenaCfg ReleaseArenaCfg ModelMetadataGetGraphDescription SessionOptionsAppendExecutionProvider_TensorRT
SetCurrentGpuDeviceId GetCurrentGpuDeviceId KernelInfoGetAttributeArray_float KernelInfoGetAttributeArray_int64
CreateArenaCfgV2 AddRunConfigEntry CreatePrepackedWeightsContainer ReleasePrepackedWeightsContainer
CreateSessionWithPrepackedWeightsContainer CreateSessionFromArrayWithPrepackedWeightsContainer
SessionOptionsAppendExecutionProvider_TensorRT_V2 CreateTensorRTProviderOptions UpdateTensorRTProviderOptions
GetTensorRTProviderOptionsAsString ReleaseTensorRTProviderOptions EnableOrtCustomOps RegisterAllocator
UnregisterAllocator IsSparseTensor CreateSparseTensorAsOrtValue FillSparseTensorCoo FillSparseTensorCsr
FillSparseTensorBlockSparse CreateSparseTensorWithValuesAsOrtValue UseCooIndices UseCsrIndices
UseBlockSparseIndices GetSparseTensorFormat GetSparseTensorValuesTypeAndShape GetSparseTensorValues
GetSparseTensorIndicesTypeShape GetSparseTensorIndices HasValue KernelContext_GetGPUComputeStream
GetTensorMemoryInfo GetExecutionProviderApi SessionOptionsSetCustomCreateThreadFn
SessionOptionsSetCustomThreadCreationOptions SessionOptionsSetCustomJoinThreadFn SetGlobalCustomCreateThreadFn
SetGlobalCustomThreadCreationOptions SetGlobalCustomJoinThreadFn SynchronizeBoundInputs SynchronizeBoundOutputs
SessionOptionsAppendExecutionProvider_CUDA_V2 CreateCUDAProviderOptions UpdateCUDAProviderOptions
GetCUDAProviderOptionsAsString ReleaseCUDAProviderOptions SessionOptionsAppendExecutionProvider_MIGraphX
AddExternalInitializers CreateOpAttr ReleaseOpAttr CreateOp InvokeOp ReleaseOp
SessionOptionsAppendExecutionProvider CopyKernelInfo ReleaseKernelInfo GetTrainingApi
SessionOptionsAppendExecutionProvider_CANN CreateCANNProviderOptions UpdateCANNProviderOptions
GetCANNProviderOptionsAsString ReleaseCANNProviderOptions MemoryInfoGetDeviceType UpdateEnvWithCustomLogLevel
SetGlobalIntraOpThreadAffinity RegisterCustomOpsLibrary_V2 RegisterCustomOpsUsingFunction KernelInfo_GetInputCount
KernelInfo_GetOutputCount KernelInfo_GetInputName KernelInfo_GetOutputName KernelInfo_GetInputTypeInfo
KernelInfo_GetOutputTypeInfo KernelInfoGetAttribute_tensor HasSessionConfigEntry GetSessionConfigEntry
SessionOptionsAppendExecutionProvider_Dnnl CreateDnnlProviderOptions UpdateDnnlProviderOptions
GetDnnlProviderOptionsAsString ReleaseDnnlProviderOptions KernelInfo_GetNodeName KernelInfo_GetLogger
KernelContext_GetLogger Logger_LogMessage Logger_GetLoggingSeverityLevel KernelInfoGetConstantInput_tensor
CastTypeInfoToOptionalTypeInfo GetOptionalContainedTypeInfo GetResizedStringTensorElementBuffer
KernelContext_GetAllocator GetBuildInfoString CreateROCMProviderOptions UpdateROCMProviderOptions
GetROCMProviderOptionsAsString ReleaseROCMProviderOptions CreateAndRegisterAllocatorV2 RunAsync
UpdateTensorRTProviderOptionsWithValue GetTensorRTProviderOptionsByName UpdateCUDAProviderOptionsWithValue
GetCUDAProviderOptionsByName KernelContext_GetResource SetUserLoggingFunction ShapeInferContext_GetInputCount
ShapeInferContext_GetInputTypeShape ShapeInferContext_GetAttribute ShapeInferContext_SetOutputTypeShape
SetSymbolicDimensions ReadOpAttr SetDeterministicCompute KernelContext_ParallelFor
""".split()
API_INDEX: dict[str, int] = {name: index for index, name in enumerate(_API_ENTRIES)}

_vp = ctypes.c_void_p
_p_vp = ctypes.POINTER(ctypes.c_void_p)
_p_size = ctypes.POINTER(ctypes.c_size_t)
# The functions used here: name -> (restype, argtypes). Every other pointer in the table is left alone.
_SIGNATURES: dict[str, tuple[Any, tuple[Any, ...]]] = {
    "CreateStatus": (_vp, (ctypes.c_int, ctypes.c_char_p)),
    "GetErrorCode": (ctypes.c_int, (_vp,)),
    "GetErrorMessage": (_vp, (_vp,)),
    "ReleaseStatus": (None, (_vp,)),
    "CreateCustomOpDomain": (_vp, (ctypes.c_char_p, _p_vp)),
    "CustomOpDomain_Add": (_vp, (_vp, _vp)),
    "AddCustomOpDomain": (_vp, (_vp, _vp)),
    "KernelInfoGetAttribute_float": (_vp, (_vp, ctypes.c_char_p, ctypes.POINTER(ctypes.c_float))),
    "KernelInfoGetAttribute_int64": (_vp, (_vp, ctypes.c_char_p, ctypes.POINTER(ctypes.c_int64))),
    "KernelInfoGetAttribute_string": (_vp, (_vp, ctypes.c_char_p, ctypes.c_char_p, _p_size)),
    "KernelInfo_GetNodeName": (_vp, (_vp, ctypes.c_char_p, _p_size)),
    "KernelInfo_GetInputCount": (_vp, (_vp, _p_size)),
    "KernelInfoGetAttributeArray_int64": (_vp, (_vp, ctypes.c_char_p, ctypes.POINTER(ctypes.c_int64), _p_size)),
    "KernelInfoGetAttributeArray_float": (_vp, (_vp, ctypes.c_char_p, ctypes.POINTER(ctypes.c_float), _p_size)),
    "KernelContext_GetInputCount": (_vp, (_vp, _p_size)),
    "KernelContext_GetOutputCount": (_vp, (_vp, _p_size)),
    "KernelContext_GetInput": (_vp, (_vp, ctypes.c_size_t, _p_vp)),
    "KernelContext_GetOutput": (_vp, (_vp, ctypes.c_size_t, ctypes.POINTER(ctypes.c_int64), ctypes.c_size_t, _p_vp)),
    "KernelContext_GetGPUComputeStream": (_vp, (_vp, _p_vp)),
    "GetTensorMutableData": (_vp, (_vp, _p_vp)),
    "GetTensorTypeAndShape": (_vp, (_vp, _p_vp)),
    "GetTensorElementType": (_vp, (_vp, ctypes.POINTER(ctypes.c_int))),
    "GetDimensionsCount": (_vp, (_vp, _p_size)),
    "GetDimensions": (_vp, (_vp, ctypes.POINTER(ctypes.c_int64), ctypes.c_size_t)),
    "ReleaseTensorTypeAndShapeInfo": (None, (_vp,)),
    "GetTensorMemoryInfo": (_vp, (_vp, _p_vp)),
    "MemoryInfoGetName": (_vp, (_vp, _p_vp)),
    "MemoryInfoGetId": (_vp, (_vp, ctypes.POINTER(ctypes.c_int))),
    "GetBuildInfoString": (_vp, ()),
}


class OrtError(RuntimeError):
    """An onnxruntime C API call returned a non-null OrtStatus."""


class OrtApi:
    """The OrtApi function table of the running onnxruntime, as typed Python callables.

    The prototypes are PYFUNCTYPE: the calls are short and never call back into Python, so they keep the
    GIL instead of paying for releasing and re-taking it on every call.
    """

    def __init__(self, table_address: int, version: int = API_VERSION) -> None:
        self.address = table_address
        # Only the entries the runtime's version has are read: the table ends after its last one.
        known = len(_API_ENTRIES) if version >= PARALLEL_FOR_VERSION else API_INDEX["GetBuildInfoString"] + 1
        self._slots = (ctypes.c_void_p * known).from_address(table_address)
        for name, (restype, argtypes) in _SIGNATURES.items():
            setattr(self, name, ctypes.PYFUNCTYPE(restype, *argtypes)(self.pointer(name)))
        # ORT's intra-op pool for a kernel's work (None on runtimes before 1.17). CFUNCTYPE: the GIL is released
        # while the pool runs the C tasks, so nothing in them may need it.
        self.KernelContext_ParallelFor = (
            ctypes.CFUNCTYPE(_vp, _vp, _vp, ctypes.c_size_t, ctypes.c_size_t, _vp)(
                self.pointer("KernelContext_ParallelFor")
            )
            if version >= PARALLEL_FOR_VERSION
            else None
        )

    def pointer(self, name: str) -> int:
        """The address of the table entry ``name`` (an index from the header's order)."""
        index = API_INDEX[name]
        if index >= len(self._slots) or not self._slots[index]:
            raise OrtError(f"onnxruntime's C API has no {name}")
        return int(self._slots[index])

    @classmethod
    def from_api_base(cls, api_base: int, version: int = API_VERSION) -> OrtApi:
        get_api = ctypes.PYFUNCTYPE(ctypes.c_void_p, ctypes.c_uint32)(ctypes.c_void_p.from_address(api_base).value)
        table = get_api(version)
        if not table:
            version_string = ctypes.PYFUNCTYPE(ctypes.c_char_p)(
                ctypes.c_void_p.from_address(api_base + ctypes.sizeof(ctypes.c_void_p)).value
            )()
            raise OrtError(
                f"onnxruntime {version_string.decode()} does not offer C API version {version} "
                "(bnfuse's custom ops need onnxruntime >= 1.16)"
            )
        newer = max(version, PARALLEL_FOR_VERSION)
        return cls(table, newer if get_api(newer) else version)

    # -- status -------------------------------------------------------------------------------------

    def check(self, status: int | None) -> None:
        """Raise OrtError for a non-null status (and release it)."""
        if status:
            message = self.status_message(status)
            self.ReleaseStatus(status)
            raise OrtError(message)

    def status_message(self, status: int) -> str:
        text = ctypes.string_at(self.GetErrorMessage(status))
        return text.decode("utf-8", "replace")

    def make_status(self, message: str, code: int = ORT_FAIL) -> int:
        """A new OrtStatus carrying ``message`` (onnxruntime copies the text and owns the status)."""
        return self.CreateStatus(code, message.encode("utf-8", "replace"))

    def build_info(self) -> str:
        return ctypes.string_at(self.GetBuildInfoString()).decode()


# -- tensors ------------------------------------------------------------------------------------------

# The table rows the entry library's hot-path helpers read and write (see ortentry.c): one int64 row per
# tensor, [data address, element type, rank, dims[8], OrtValue address]; rank -1 marks an absent tensor.
# For outputs the type field says whether ORT allocated the output (1) or the node does not have it (0).
ENTRY_ABI_VERSION = 5
MAX_RANK = 8
_DATA, _TYPE, _RANK, _DIMS = 0, 1, 2, 3
_VALUE = _DIMS + MAX_RANK
TENSOR_FIELDS = _VALUE + 1
_TABLE_ROWS = 8

# The OrtApi entries the helpers call, in the order of ortentry.c's bnfuse_tensor_api.
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
            raise OrtError("bnfuse's entry library does not match ortabi.py: rebuild it (pip install -e .)")
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


_hot: _HotPath | None = None

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


# onnxruntime's message for an attribute the node does not have (OpNodeProtoHelper::GetAttr). Any other failure
# (a type mismatch reads "Attribute name and type don't match") is an error in the model, never a default.
# The list look-ups (GetAttrs) say it as "No attribute with this name is defined."
_ABSENT_ATTRIBUTE = ("No attribute with name", "No attribute with this name is defined")


class KernelInfo:
    """Attributes of one node, read once when onnxruntime creates its kernel.

    A missing attribute gives the default; one of another type raises (naming op, node, attribute and both
    types). Unknown attribute names cannot be caught here: no OrtApi version lets a kernel list a node's
    attributes (OrtKernelInfo offers only look-up by name).
    """

    def __init__(self, api: OrtApi, info: int, op: str = "") -> None:
        self._api = api
        self._info = info
        self._op = op

    def _present(self, status: int | None, name: str, expected: str) -> bool:
        """True when the look-up succeeded, False when the node has no attribute ``name``; raises otherwise."""
        if not status:
            return True
        message = self._api.status_message(status)
        self._api.ReleaseStatus(status)
        if message.startswith(_ABSENT_ATTRIBUTE):
            return False
        raise OrtError(
            f"{self._op}: attribute {name} must be {expected}, got {self._kind(name)} "
            f"(node {self.node_name()!r}; onnxruntime: {message})"
        )

    def _kind(self, name: str) -> str:
        """What attribute ``name`` holds, found by asking for each scalar type in turn (for error messages)."""
        api, info, key = self._api, self._info, name.encode()
        probes: tuple[tuple[str, Callable[[], int | None]], ...] = (
            ("an int", lambda: api.KernelInfoGetAttribute_int64(info, key, ctypes.byref(ctypes.c_int64()))),
            ("a float", lambda: api.KernelInfoGetAttribute_float(info, key, ctypes.byref(ctypes.c_float()))),
            ("a string", lambda: api.KernelInfoGetAttribute_string(info, key, None, ctypes.byref(ctypes.c_size_t()))),
        )
        for kind, probe in probes:
            status = probe()
            if not status:
                return kind
            api.ReleaseStatus(status)
        return "another type (a list, tensor or graph)"

    def float_attr(self, name: str, default: float) -> float:
        value = ctypes.c_float()
        status = self._api.KernelInfoGetAttribute_float(self._info, name.encode(), ctypes.byref(value))
        return float(value.value) if self._present(status, name, "a float") else default

    def int_attr(self, name: str, default: int) -> int:
        value = ctypes.c_int64()
        status = self._api.KernelInfoGetAttribute_int64(self._info, name.encode(), ctypes.byref(value))
        return int(value.value) if self._present(status, name, "an int") else default

    def string_attr(self, name: str, default: str) -> str:
        size = ctypes.c_size_t(0)
        status = self._api.KernelInfoGetAttribute_string(self._info, name.encode(), None, ctypes.byref(size))
        if not self._present(status, name, "a string"):
            return default
        buffer = ctypes.create_string_buffer(size.value)
        self._api.check(self._api.KernelInfoGetAttribute_string(self._info, name.encode(), buffer, ctypes.byref(size)))
        return buffer.value.decode("utf-8", "replace")

    def floats_attr(self, name: str, default: Sequence[float]) -> tuple[float, ...]:
        array = self._array_attr(name, self._api.KernelInfoGetAttributeArray_float, ctypes.c_float, "a list of floats")
        return tuple(default) if array is None else tuple(float(v) for v in array)

    def ints_attr(self, name: str, default: Sequence[int]) -> tuple[int, ...]:
        array = self._array_attr(name, self._api.KernelInfoGetAttributeArray_int64, ctypes.c_int64, "a list of ints")
        return tuple(default) if array is None else tuple(int(v) for v in array)

    def _array_attr(self, name: str, getter: Callable[..., int | None], ctype: Any, kind: str) -> list[Any] | None:
        """A list attribute's values through ``getter`` (KernelInfoGetAttributeArray_*), None where it is absent."""
        size = ctypes.c_size_t(0)
        if not self._present(getter(self._info, name.encode(), None, ctypes.byref(size)), name, kind):
            return None
        values = (ctype * max(1, size.value))()
        self._api.check(getter(self._info, name.encode(), values, ctypes.byref(size)))
        return list(values[: size.value])

    def input_count(self) -> int:
        """How many inputs the node has (optional ones included)."""
        count = ctypes.c_size_t(0)
        self._api.check(self._api.KernelInfo_GetInputCount(self._info, ctypes.byref(count)))
        return count.value

    def node_name(self) -> str:
        size = ctypes.c_size_t(0)
        if not self._succeeded(self._api.KernelInfo_GetNodeName(self._info, None, ctypes.byref(size))):
            return ""
        if size.value <= 1:
            return ""
        buffer = ctypes.create_string_buffer(size.value)
        if not self._succeeded(self._api.KernelInfo_GetNodeName(self._info, buffer, ctypes.byref(size))):
            return ""
        return buffer.value.decode("utf-8", "replace")

    def _succeeded(self, status: int | None) -> bool:
        if status:  # the node name only labels messages: a failure leaves it empty
            self._api.ReleaseStatus(status)
            return False
        return True


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


# -- custom ops ---------------------------------------------------------------------------------------


class FastPath(Protocol):
    """What the entry library needs to serve a kernel's small calls in C (see ortentry.c's bnfuse_plan)."""

    entry: int  # address of the C function (cpu_entry.py)
    op: int  # 0 inference, 1 training, 2 grad
    per_activation: bool
    axis: int
    below_bytes: int
    flags: int
    epsilon: float
    weight: float
    hyper: tuple[float, ...]  # the fused optimizer steps' hyperparameters (op 3 SGD, 4 Adam), else ()
    parameters: int  # how many parameters an optimizer step updates, else 0


class Kernel(Protocol):
    fast_path: FastPath | None

    def compute(self, context: KernelContext) -> None: ...


class OpSpec(Protocol):
    """What ops.py describes for each op; ortabi turns it into an OrtCustomOp."""

    name: str
    provider: str
    input_dtypes: tuple[np.dtype, ...]
    output_dtypes: tuple[np.dtype, ...]
    optional_outputs: frozenset[int]

    def create_kernel(self, info: KernelInfo) -> Kernel: ...


_CREATE_KERNEL = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p)
_GET_STRING = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_void_p)  # never c_char_p: that restype leaks
_GET_TYPE = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t)
_GET_COUNT = ctypes.CFUNCTYPE(ctypes.c_size_t, ctypes.c_void_p)
_COMPUTE = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p)
_DESTROY = ctypes.CFUNCTYPE(None, ctypes.c_void_p)
_GET_INT = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p)
_CREATE_KERNEL_V2 = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, _p_vp)
_COMPUTE_V2 = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p)
_INFER_SHAPE = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p)


class _Plan(ctypes.Structure):
    """``bnfuse_plan`` of ortentry.c: one kernel, decided when ORT creates it; its address is the op_kernel."""

    _fields_ = [
        ("python_compute", _COMPUTE_V2),
        ("fast", ctypes.c_void_p),
        ("op", ctypes.c_int64),
        ("per_activation", ctypes.c_int64),
        ("axis", ctypes.c_int64),
        ("below_bytes", ctypes.c_int64),
        ("flags", ctypes.c_int64),
        ("epsilon", ctypes.c_double),
        ("weight", ctypes.c_double),
        ("hyper", ctypes.POINTER(ctypes.c_double)),
        ("parameters", ctypes.c_int64),
    ]


def _plan(python_compute: Any, fast: FastPath | None) -> _Plan:
    plan = _Plan()
    plan.python_compute = python_compute
    if fast is not None:
        plan.fast = fast.entry
        plan.op, plan.per_activation, plan.axis = fast.op, int(fast.per_activation), fast.axis
        plan.below_bytes, plan.flags = fast.below_bytes, fast.flags
        plan.epsilon, plan.weight = fast.epsilon, fast.weight
        hyper = tuple(fast.hyper)
        if hyper:
            plan.keep_alive = (ctypes.c_double * len(hyper))(*hyper)  # the plan points into it
            plan.hyper = ctypes.cast(plan.keep_alive, ctypes.POINTER(ctypes.c_double))
            plan.parameters = int(fast.parameters)
    return plan


class OrtCustomOp(ctypes.Structure):
    """``struct OrtCustomOp`` as in the public header; fields after InferOutputShapeFn are read by
    onnxruntime only for versions above 16 and stay NULL."""

    _fields_ = [
        ("version", ctypes.c_uint32),
        ("CreateKernel", _CREATE_KERNEL),
        ("GetName", _GET_STRING),
        ("GetExecutionProviderType", _GET_STRING),
        ("GetInputType", _GET_TYPE),
        ("GetInputTypeCount", _GET_COUNT),
        ("GetOutputType", _GET_TYPE),
        ("GetOutputTypeCount", _GET_COUNT),
        ("KernelCompute", _COMPUTE),
        ("KernelDestroy", _DESTROY),
        ("GetInputCharacteristic", _GET_TYPE),
        ("GetOutputCharacteristic", _GET_TYPE),
        ("GetInputMemoryType", _GET_TYPE),
        ("GetVariadicInputMinArity", _GET_INT),
        ("GetVariadicInputHomogeneity", _GET_INT),
        ("GetVariadicOutputMinArity", _GET_INT),
        ("GetVariadicOutputHomogeneity", _GET_INT),
        ("CreateKernelV2", _CREATE_KERNEL_V2),
        ("KernelComputeV2", _COMPUTE_V2),
        ("InferOutputShapeFn", _INFER_SHAPE),
        ("GetStartVersion", _GET_INT),
        ("GetEndVersion", _GET_INT),
        ("GetMayInplace", ctypes.c_void_p),
        ("ReleaseMayInplace", ctypes.c_void_p),
        ("GetAliasMap", ctypes.c_void_p),
        ("ReleaseAliasMap", ctypes.c_void_p),
    ]


class _Kernels(dict):
    """Live kernels by plan address. A plan's fast path stands in for the kernel it was made for: replacing
    an entry (a wrapper that observes calls) sends that kernel's calls through Python from then on."""

    def __init__(self, plans: dict[int, _Plan]) -> None:
        super().__init__()
        self._plans = plans

    def __setitem__(self, handle: int, entry: tuple[Kernel, bool, ViewCache, ViewCache]) -> None:
        plan = self._plans.get(handle)
        if plan is not None and handle in self and self[handle][0] is not entry[0]:
            plan.fast = None
        super().__setitem__(handle, entry)


class _Registry:
    """Everything onnxruntime may call back into, kept alive for the life of the process.

    Structs, name buffers and callbacks are created once per op spec; kernels are keyed by the address
    of their :class:`_Plan` (what ORT stores as ``void* op_kernel``).
    """

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.api: OrtApi | None = None
        self.ops: dict[int, tuple[OrtCustomOp, OpSpec, ctypes.Array, ctypes.Array]] = {}
        self.plans: dict[int, _Plan] = {}  # by kernel handle: each kernel's plan lives as long as the kernel
        self.kernels: dict[int, tuple[Kernel, bool, ViewCache, ViewCache]] = _Kernels(self.plans)
        self.entry_functions: dict[str, int] = {}  # OrtCustomOp field -> the entry library's function (install())
        self.domains: dict[tuple[str, tuple[int, ...]], int] = {}
        self.callbacks = self._make_callbacks()

    def _make_callbacks(self) -> dict[str, Any]:
        """The three entries that need Python: making, running and destroying a kernel. The entry library calls
        them (and only while the interpreter is not finalizing); it answers everything else about an op itself."""

        def spec(op: int) -> OpSpec:
            return self.ops[op][1]

        def create_kernel_v2(op: int, api: int, info: int, kernel_out: Any) -> int | None:
            try:
                definition = spec(op)
                kernel = definition.create_kernel(KernelInfo(self.ortapi(), info, definition.name))
                plan = _plan(self.callbacks["KernelComputeV2"], getattr(kernel, "fast_path", None))
                handle = ctypes.addressof(plan)
                on_gpu = definition.provider != CPU_PROVIDER
                self.plans[handle] = plan
                self.kernels[handle] = (kernel, on_gpu, ViewCache(), ViewCache())
                kernel_out[0] = handle
                return None
            except BaseException as exc:  # noqa: B036 - nothing may unwind into onnxruntime
                return self.ortapi().make_status(_describe(exc), ORT_INVALID_ARGUMENT)

        def compute_v2(handle: int, context: int) -> int | None:
            try:
                kernel, on_gpu, inputs, outputs = self.kernels[handle]
                kernel.compute(KernelContext(self.api, context, on_gpu, inputs, outputs))
                return None
            except BaseException as exc:  # noqa: B036 - nothing may unwind into onnxruntime
                return self.ortapi().make_status(_describe(exc), ORT_RUNTIME_EXCEPTION)

        def destroy(handle: int) -> None:
            self.kernels.pop(handle, None)
            self.plans.pop(handle, None)

        return {
            "CreateKernelV2": _CREATE_KERNEL_V2(create_kernel_v2),
            "KernelComputeV2": _COMPUTE_V2(compute_v2),
            "KernelDestroy": _DESTROY(destroy),
        }

    def ortapi(self) -> OrtApi:
        assert self.api is not None, "onnxruntime has not called RegisterCustomOps yet"
        return self.api

    def custom_op(self, spec: OpSpec) -> int:
        """The address of the OrtCustomOp struct for ``spec`` (built on first use, then reused)."""
        for address, (_, known, _, _) in self.ops.items():
            if known is spec:
                return address
        description = _describe_op(spec)
        struct = description.op
        struct.version = CUSTOM_OP_VERSION
        # Every entry is the entry library's: it answers from the description, and calls the Python callbacks
        # (kernels) only while the interpreter is not finalizing.
        for field, function in self.entry_functions.items():
            setattr(struct, field, type(getattr(struct, field))(function))
        address = ctypes.addressof(struct)
        self.ops[address] = (struct, spec, description.keep_alive[0], description.keep_alive[1])
        return address

    def domain(self, api: OrtApi, name: str, specs: Sequence[OpSpec]) -> int:
        """One OrtCustomOpDomain per (name, op set), shared by every session options that asks for it.

        Domains are never released: sessions created from the options keep pointing at them.
        """
        ops = tuple(self.custom_op(spec) for spec in specs)
        key = (name, ops)
        if key not in self.domains:
            domain = ctypes.c_void_p()
            api.check(api.CreateCustomOpDomain(name.encode(), ctypes.byref(domain)))
            for op in ops:
                api.check(api.CustomOpDomain_Add(domain, op))
            self.domains[key] = domain.value or 0
        return self.domains[key]


class _OpInfo(ctypes.Structure):
    """``bnfuse_op_info`` of ortentry.c: what onnxruntime asks of an op, answered in C."""

    _fields_ = [
        ("name", ctypes.c_void_p),
        ("provider", ctypes.c_void_p),
        ("inputs", ctypes.c_int64),
        ("outputs", ctypes.c_int64),
        ("input_types", ctypes.POINTER(ctypes.c_int32)),
        ("output_types", ctypes.POINTER(ctypes.c_int32)),
        ("input_characteristics", ctypes.POINTER(ctypes.c_int32)),
        ("output_characteristics", ctypes.POINTER(ctypes.c_int32)),
    ]


class _OpDescription(ctypes.Structure):
    """An OrtCustomOp (what onnxruntime holds a pointer to) followed by its description."""

    _fields_ = [("op", OrtCustomOp), ("info", _OpInfo)]


OP_INFO_OFFSET = _OpDescription.info.offset

# OrtCustomOp field -> the entry library's function onnxruntime calls there
_ENTRY_FUNCTIONS = {
    "GetName": "bnfuse_op_name",
    "GetExecutionProviderType": "bnfuse_op_provider",
    "GetInputType": "bnfuse_op_input_type",
    "GetInputTypeCount": "bnfuse_op_input_count",
    "GetOutputType": "bnfuse_op_output_type",
    "GetOutputTypeCount": "bnfuse_op_output_count",
    "GetInputCharacteristic": "bnfuse_op_input_characteristic",
    "GetOutputCharacteristic": "bnfuse_op_output_characteristic",
    "GetInputMemoryType": "bnfuse_op_input_memory_type",
    "GetVariadicInputMinArity": "bnfuse_op_one",
    "GetVariadicInputHomogeneity": "bnfuse_op_one",
    "GetVariadicOutputMinArity": "bnfuse_op_one",
    "GetVariadicOutputHomogeneity": "bnfuse_op_one",
    "CreateKernelV2": "bnfuse_create_kernel",
    "KernelComputeV2": "bnfuse_compute",
    "KernelDestroy": "bnfuse_destroy_kernel",
}


def _int32s(values: Sequence[int]) -> ctypes.Array:
    return (ctypes.c_int32 * max(1, len(values)))(*values)


def _describe_op(spec: OpSpec) -> _OpDescription:
    """The OrtCustomOp struct of ``spec`` with its description after it (the arrays it points into are kept on it)."""
    variadic = getattr(spec, "variadic", False)  # one homogeneous list of at least one input / output

    def characteristics(count: int, optional: frozenset[int]) -> list[int]:
        if variadic:
            return [INPUT_OUTPUT_VARIADIC] * count
        return [INPUT_OUTPUT_OPTIONAL if i in optional else INPUT_OUTPUT_REQUIRED for i in range(count)]

    inputs, outputs = len(spec.input_dtypes), len(spec.output_dtypes)
    name = ctypes.create_string_buffer(spec.name.encode())
    provider = ctypes.create_string_buffer(spec.provider.encode())
    arrays = (
        _int32s([element_type(d) for d in spec.input_dtypes]),
        _int32s([element_type(d) for d in spec.output_dtypes]),
        _int32s(characteristics(inputs, getattr(spec, "optional_inputs", frozenset()))),
        _int32s(characteristics(outputs, spec.optional_outputs)),
    )
    description = _OpDescription()
    info = description.info
    info.name, info.provider = ctypes.addressof(name), ctypes.addressof(provider)
    info.inputs, info.outputs = inputs, outputs
    pointers = (ctypes.cast(a, ctypes.POINTER(ctypes.c_int32)) for a in arrays)
    info.input_types, info.output_types, info.input_characteristics, info.output_characteristics = pointers
    description.keep_alive = (name, provider, *arrays)
    return description


def _describe(exc: BaseException) -> str:
    message = str(exc) or type(exc).__name__
    return message if isinstance(exc, ValueError | OrtError) else f"{type(exc).__name__}: {message}"


def _keep_for_process(thing: object) -> None:
    """Keep ``thing`` (and all it references) alive until the process exits, whatever the order of teardown.

    One reference no object holds: neither clearing this module's globals at shutdown nor the final garbage
    collection frees it, so memory onnxruntime points into (op structs, plans, callbacks) outlives every session.
    """
    ctypes.PYFUNCTYPE(None, ctypes.py_object)(("Py_IncRef", ctypes.pythonapi))(thing)


def _finalizing_function() -> int:
    """The address of the interpreter's ``Py_IsFinalizing`` (``_Py_IsFinalizing`` before Python 3.13)."""
    for name in ("Py_IsFinalizing", "_Py_IsFinalizing"):
        function = getattr(ctypes.pythonapi, name, None)
        if function is not None:
            return ctypes.cast(function, ctypes.c_void_p).value or 0
    raise OrtError("this Python exports neither Py_IsFinalizing nor _Py_IsFinalizing")


_registry = _Registry()
_keep_for_process(_registry)
_REGISTER = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p)
_SET_PYTHON = (ctypes.c_void_p, _CREATE_KERNEL_V2, _DESTROY, ctypes.c_size_t)

# The op specs to register for a given session options: ops.py supplies the function.
OpsProvider = Callable[[], tuple[str, Sequence[OpSpec]]]


class _Entry:
    """The loaded entry library and the RegisterCustomOps callback installed into it."""

    def __init__(self, path: Path, provider: OpsProvider) -> None:
        self.path = path
        self.provider = provider
        self.library = ctypes.CDLL(str(path))
        functions = {field: getattr(self.library, name, None) for field, name in _ENTRY_FUNCTIONS.items()}
        set_python = getattr(self.library, "bnfuse_set_python", None)
        if set_python is None or None in functions.values():
            raise OrtError("bnfuse's entry library does not match ortabi.py: rebuild it (pip install -e .)")
        _keep_for_process(self)  # the library's callbacks into Python live as long as the process
        set_python.argtypes, set_python.restype = _SET_PYTHON, None
        callbacks = _registry.callbacks
        set_python(_finalizing_function(), callbacks["CreateKernelV2"], callbacks["KernelDestroy"], OP_INFO_OFFSET)
        self.callback = _REGISTER(self._register)
        self.library.bnfuse_set_register_callback.argtypes = (_REGISTER,)
        self.library.bnfuse_set_register_callback.restype = None
        self.library.bnfuse_set_register_callback(self.callback)
        _registry.entry_functions = {
            field: ctypes.cast(function, ctypes.c_void_p).value or 0 for field, function in functions.items()
        }

    def _register(self, session_options: int, api_base: int) -> int | None:
        try:
            api = _registry.api
            if api is None:
                api = OrtApi.from_api_base(api_base)
                global _hot
                _hot = _HotPath(self.library, api)
                _registry.api = api
        except BaseException:  # noqa: B036 - without the API no status can be made; the C side has one
            return _fallback_status(api_base)
        try:
            with _registry.lock:
                domain_name, specs = self.provider()
                domain = _registry.domain(api, domain_name, specs)
            api.check(api.AddCustomOpDomain(session_options, domain))
            return None
        except BaseException as exc:  # noqa: B036 - nothing may unwind into onnxruntime
            return api.make_status(f"bnfuse custom ops: {_describe(exc)}")


def _fallback_status(api_base: int) -> int | None:
    """An OrtStatus made through the oldest API table, for runtimes too old for :data:`API_VERSION`."""
    get_api = ctypes.PYFUNCTYPE(ctypes.c_void_p, ctypes.c_uint32)(ctypes.c_void_p.from_address(api_base).value)
    table = get_api(1)
    if not table:
        return None
    create_status = ctypes.PYFUNCTYPE(ctypes.c_void_p, ctypes.c_int, ctypes.c_char_p)(
        ctypes.c_void_p.from_address(table).value
    )
    return create_status(ORT_FAIL, f"bnfuse custom ops need onnxruntime C API version {API_VERSION}".encode())


_entry: _Entry | None = None
_entry_lock = threading.Lock()


def entry_library_path() -> Path:
    """The built entry library next to this module (``_ortentry`` + the interpreter's extension suffix)."""
    here = Path(__file__).resolve().parent
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        candidate = here / f"_ortentry{suffix}"
        if candidate.is_file():
            return candidate
    raise FileNotFoundError(
        f"bnfuse's onnxruntime entry library is not built in {here} (run `pip install -e .` or reinstall bnfuse)"
    )


def install(provider: OpsProvider) -> Path:
    """Load the entry library and install the RegisterCustomOps callback; returns the library's path.

    Idempotent: later calls keep the first callback (and its op set provider).
    """
    global _entry
    with _entry_lock:
        if _entry is None:
            _entry = _Entry(entry_library_path(), provider)
        return _entry.path


def set_fast_path(enabled: bool) -> None:
    """Let the entry library serve small calls in C (default), or send every call through Python."""
    if _entry is not None:
        _entry.library.bnfuse_set_fast_path(ctypes.c_int(int(enabled)))


def fast_call_count() -> int:
    """How many kernel calls the entry library's fast path has served in this process."""
    if _entry is None:
        return 0
    function = _entry.library.bnfuse_fast_calls
    function.restype, function.argtypes = ctypes.c_int64, ()
    return int(function())


def ort_api() -> OrtApi:
    """The OrtApi table once onnxruntime has registered the library in some session options."""
    return _registry.ortapi()


def live_kernel_count() -> int:
    """How many kernels onnxruntime currently holds (created and not yet destroyed)."""
    return len(_registry.kernels)


def refused_call_count() -> int:
    """How many calls the entry library answered without Python because the interpreter was finalizing."""
    if _entry is None:
        return 0
    function = _entry.library.bnfuse_refused_calls
    function.restype, function.argtypes = ctypes.c_int64, ()
    return int(function())


# -- OpenMP settings of the process ---------------------------------------------------------------------------

# Shared-object names of the OpenMP runtimes in the wild: GNU (PyTorch's and numba's wheels), Intel, LLVM.
_OPENMP_LIBRARIES = ("libgomp", "libiomp5", "libomp")
_openmp_handles: dict[str, ctypes.CDLL] = {}


def _loaded_openmp_runtimes() -> dict[str, ctypes.CDLL]:
    """Every OpenMP runtime this process has loaded, by path (Linux: from /proc/self/maps), opened without
    loading anything. Several copies may be loaded at once (wheels bundle their own); each has its own settings."""
    try:
        with open("/proc/self/maps", encoding="utf-8", errors="replace") as maps:
            paths = {parts[5].strip() for parts in (line.split(None, 5) for line in maps) if len(parts) == 6}
    except OSError:  # not Linux: nothing to read the settings through
        return {}
    found: dict[str, ctypes.CDLL] = {}
    for path in sorted(paths):
        name = os.path.basename(path)
        if not (name.startswith(_OPENMP_LIBRARIES) and ".so" in name):
            continue
        handle = _openmp_handles.get(path)
        if handle is None:
            try:
                handle = ctypes.CDLL(path, mode=os.RTLD_NOLOAD | os.RTLD_LAZY)
                getattr(handle, "omp_get_max_threads")  # noqa: B009 - a library named like one, without OpenMP
            except (OSError, AttributeError):
                continue
            _openmp_handles[path] = handle
        found[path] = handle
    return found


def _openmp_settings_of(handle: ctypes.CDLL) -> tuple[int, int, int]:
    """(omp_get_max_threads, omp_get_dynamic, omp_get_max_active_levels) of one runtime, for the calling thread."""
    levels = getattr(handle, "omp_get_max_active_levels", None) or handle.omp_get_nested
    return int(handle.omp_get_max_threads()), int(handle.omp_get_dynamic()), int(levels())


def openmp_settings() -> dict[str, tuple[int, int, int]]:
    """The calling thread's OpenMP settings in every loaded OpenMP runtime, by library path: (max threads,
    dynamic adjustment, max active levels). Empty where none is loaded (or on a system without /proc)."""
    return {path: _openmp_settings_of(handle) for path, handle in _loaded_openmp_runtimes().items()}


@contextlib.contextmanager
def openmp_settings_kept() -> Iterator[None]:
    """Put back, on the calling thread, the settings every OpenMP runtime loaded before the block had then
    (only changed values are written). A runtime first loaded inside the block had no settings anyone could
    have set; it is left as the block leaves it."""
    saved = {path: (handle, _openmp_settings_of(handle)) for path, handle in _loaded_openmp_runtimes().items()}
    try:
        yield
    finally:
        for handle, (threads, dynamic, levels) in saved.values():
            now_threads, now_dynamic, now_levels = _openmp_settings_of(handle)
            if now_threads != threads:
                handle.omp_set_num_threads(threads)
            if now_dynamic != dynamic:
                handle.omp_set_dynamic(dynamic)
            if now_levels != levels:
                setter = getattr(handle, "omp_set_max_active_levels", None)
                if setter is not None:
                    setter(levels)
                else:
                    handle.omp_set_nested(levels > 1)
