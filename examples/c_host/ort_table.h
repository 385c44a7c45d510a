/* The part of onnxruntime's C API that train.c uses, declared here: the onnxruntime wheel ships
 * libonnxruntime.so but no header.
 *
 * OrtGetApiBase() gives the API base, whose GetApi(version) returns the OrtApi struct: a table of function
 * pointers in the order of onnxruntime_c_api.h. The table is append-only, so an entry's index never moves; the
 * indices below are positions in that order (tests/test_example_c_host.py checks each against the table
 * bnfuse/runtime/ortabi/api.py keeps). Each entry is called through ORT(name, prototype).
 */
#ifndef BNFUSE_EXAMPLE_ORT_TABLE_H
#define BNFUSE_EXAMPLE_ORT_TABLE_H

#include <stddef.h>
#include <stdint.h>

typedef void (*ort_function)(void);
typedef struct OrtStatus OrtStatus; /* opaque handles */
typedef struct OrtEnv OrtEnv;
typedef struct OrtSessionOptions OrtSessionOptions;
typedef struct OrtSession OrtSession;
typedef struct OrtValue OrtValue;
typedef struct OrtMemoryInfo OrtMemoryInfo;
typedef struct OrtAllocator OrtAllocator;
typedef struct OrtModelMetadata OrtModelMetadata;
typedef struct OrtTypeInfo OrtTypeInfo;
typedef struct OrtTensorTypeAndShapeInfo OrtTensorTypeAndShapeInfo;

typedef struct {
    const ort_function *(*GetApi)(uint32_t version);
    const char *(*GetVersionString)(void);
} OrtApiBase;

const OrtApiBase *OrtGetApiBase(void); /* exported by libonnxruntime.so */

/* The oldest API version with every entry used here (RegisterCustomOpsLibrary_V2 came with 13). */
enum { ORT_API_VERSION_USED = 16 };

/* positions in the OrtApi table */
enum {
    ORT_GetErrorMessage = 2,
    ORT_CreateEnv = 3,
    ORT_CreateSession = 7,
    ORT_Run = 9,
    ORT_CreateSessionOptions = 10,
    ORT_SetIntraOpNumThreads = 24,
    ORT_SetInterOpNumThreads = 25,
    ORT_SessionGetInputCount = 30,
    ORT_SessionGetInputTypeInfo = 33,
    ORT_SessionGetInputName = 36,
    ORT_CreateTensorWithDataAsOrtValue = 49,
    ORT_GetTensorMutableData = 51,
    ORT_CastTypeInfoToTensorInfo = 55,
    ORT_GetTensorElementType = 60,
    ORT_GetDimensionsCount = 61,
    ORT_GetDimensions = 62,
    ORT_GetTensorTypeAndShape = 65,
    ORT_CreateCpuMemoryInfo = 69,
    ORT_AllocatorFree = 76,
    ORT_GetAllocatorWithDefaultOptions = 78,
    ORT_ReleaseEnv = 92,
    ORT_ReleaseStatus = 93,
    ORT_ReleaseMemoryInfo = 94,
    ORT_ReleaseSession = 95,
    ORT_ReleaseValue = 96,
    ORT_ReleaseTypeInfo = 98,
    ORT_ReleaseTensorTypeAndShapeInfo = 99,
    ORT_ReleaseSessionOptions = 100,
    ORT_SessionGetModelMetadata = 111,
    ORT_ModelMetadataLookupCustomMetadataMap = 116,
    ORT_ReleaseModelMetadata = 118,
    ORT_RegisterCustomOpsLibrary_V2 = 228,
};

/* ONNXTensorElementDataType values used here */
enum { ORT_TENSOR_FLOAT = 1, ORT_TENSOR_INT32 = 6, ORT_TENSOR_INT64 = 7 };
enum { ORT_LOGGING_ERROR = 3 };                  /* OrtLoggingLevel */
enum { ORT_DEVICE_ALLOCATOR = 0 };               /* OrtAllocatorType */
enum { ORT_MEM_TYPE_DEFAULT = 0 };               /* OrtMemType */

/* Call entry `name` of the table `api` with the C prototype `type` (a function pointer type). */
#define ORT(api, name, type) ((type)(api)[ORT_##name])

#endif
