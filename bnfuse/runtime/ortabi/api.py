"""The ``OrtApi`` function table of the running onnxruntime, the versions bnfuse asks for, and its errors.

The table is declared from the order of the public header ``onnxruntime_c_api.h``. The table is append-only and
onnxruntime hands the same table to every requested version it supports, so indices never move;
:data:`API_VERSION` is the oldest version that has every entry (and custom-op struct field) used here, which
keeps old runtimes working.
"""

from __future__ import annotations

import ctypes
from typing import Any

API_VERSION = 16  # CreateKernelV2 / KernelComputeV2 appeared in custom-op version 16 (onnxruntime 1.16)
PARALLEL_FOR_VERSION = 17  # KernelContext_ParallelFor (onnxruntime 1.17): used where the runtime has it
CUSTOM_OP_VERSION = 16

CPU_PROVIDER = "CPUExecutionProvider"
CUDA_PROVIDER = "CUDAExecutionProvider"

# OrtErrorCode
ORT_FAIL = 1
ORT_INVALID_ARGUMENT = 2
ORT_RUNTIME_EXCEPTION = 6

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
