/* The part of onnxruntime's C API the native library uses, declared here (no onnxruntime header is needed).
 *
 * The OrtApi is a table of function pointers, append-only across releases: an entry's index never moves. The
 * indices below are positions in the public header's order (bnfuse/runtime/ortabi/api.py keeps the whole order;
 * tests/runtime/test_native.py checks these against it). Every OrtStatus* is a void* here.
 *
 * OrtCustomOp is the public struct a custom op fills in; bnfuse fills in the fields of version 16
 * (CreateKernelV2 / KernelComputeV2) and leaves the later ones NULL. */
#ifndef BNFUSE_ORT_API_H
#define BNFUSE_ORT_API_H

#include <stddef.h>
#include <stdint.h>

enum {
    ORT_API_CreateStatus = 0,
    ORT_API_GetErrorCode = 1,
    ORT_API_GetErrorMessage = 2,
    ORT_API_CreateCustomOpDomain = 26,
    ORT_API_CustomOpDomain_Add = 27,
    ORT_API_AddCustomOpDomain = 28,
    ORT_API_GetTensorMutableData = 51,
    ORT_API_GetTensorElementType = 60,
    ORT_API_GetDimensionsCount = 61,
    ORT_API_GetDimensions = 62,
    ORT_API_GetTensorTypeAndShape = 65,
    ORT_API_KernelInfoGetAttribute_float = 85,
    ORT_API_KernelInfoGetAttribute_int64 = 86,
    ORT_API_KernelInfoGetAttribute_string = 87,
    ORT_API_KernelContext_GetInputCount = 88,
    ORT_API_KernelContext_GetOutputCount = 89,
    ORT_API_KernelContext_GetInput = 90,
    ORT_API_KernelContext_GetOutput = 91,
    ORT_API_ReleaseStatus = 93,
    ORT_API_ReleaseTensorTypeAndShapeInfo = 99,
    ORT_API_KernelInfoGetAttributeArray_float = 162,
    ORT_API_KernelInfoGetAttributeArray_int64 = 163,
    ORT_API_KernelInfo_GetInputCount = 230,
    ORT_API_KernelInfo_GetNodeName = 244,
    ORT_API_KernelContext_ParallelFor = 274,
};

/* the oldest table with CreateKernelV2 (custom-op version 16), and the first with KernelContext_ParallelFor */
enum { ORT_API_VERSION_NEEDED = 16, ORT_API_VERSION_PARALLEL_FOR = 17, ORT_CUSTOM_OP_VERSION = 16 };

/* OrtErrorCode */
enum { ORT_FAIL = 1, ORT_INVALID_ARGUMENT = 2, ORT_RUNTIME_EXCEPTION = 6 };

/* ONNXTensorElementDataType */
enum { ORT_TYPE_FLOAT = 1, ORT_TYPE_FLOAT16 = 10 };

/* OrtCustomOpInputOutputCharacteristic */
enum { ORT_REQUIRED = 0, ORT_OPTIONAL = 1, ORT_VARIADIC = 2 };

typedef void *ort_status;
typedef void (*ort_parallel_fn)(void *data, size_t index);

/* The entries used, typed. */
typedef struct {
    ort_status (*CreateStatus)(int code, const char *message);
    const char *(*GetErrorMessage)(const void *status);
    void (*ReleaseStatus)(void *status);
    ort_status (*CreateCustomOpDomain)(const char *domain, void **out);
    ort_status (*CustomOpDomain_Add)(void *domain, const void *op);
    ort_status (*AddCustomOpDomain)(void *options, void *domain);
    ort_status (*GetTensorMutableData)(void *value, void **out);
    ort_status (*GetTensorElementType)(const void *info, int *out);
    ort_status (*GetDimensionsCount)(const void *info, size_t *out);
    ort_status (*GetDimensions)(const void *info, int64_t *dims, size_t count);
    ort_status (*GetTensorTypeAndShape)(const void *value, void **out);
    ort_status (*KernelInfoGetAttribute_float)(const void *info, const char *name, float *out);
    ort_status (*KernelInfoGetAttribute_int64)(const void *info, const char *name, int64_t *out);
    ort_status (*KernelInfoGetAttribute_string)(const void *info, const char *name, char *out, size_t *size);
    ort_status (*KernelContext_GetInputCount)(const void *context, size_t *out);
    ort_status (*KernelContext_GetOutputCount)(const void *context, size_t *out);
    ort_status (*KernelContext_GetInput)(const void *context, size_t index, const void **out);
    ort_status (*KernelContext_GetOutput)(void *context, size_t index, const int64_t *dims, size_t count, void **out);
    void (*ReleaseTensorTypeAndShapeInfo)(void *info);
    ort_status (*KernelInfoGetAttributeArray_float)(const void *info, const char *name, float *out, size_t *size);
    ort_status (*KernelInfoGetAttributeArray_int64)(const void *info, const char *name, int64_t *out, size_t *size);
    ort_status (*KernelInfo_GetInputCount)(const void *info, size_t *out);
    ort_status (*KernelInfo_GetNodeName)(const void *info, char *out, size_t *size);
    /* NULL on runtimes before 1.17: the work then runs on the calling thread */
    ort_status (*KernelContext_ParallelFor)(const void *context, ort_parallel_fn fn, size_t total, size_t batches,
                                            void *data);
} bnfuse_ort_api;

/* OrtApiBase: the argument of RegisterCustomOps */
typedef struct {
    const void *const *(*GetApi)(uint32_t version);
    const char *(*GetVersionString)(void);
} bnfuse_ort_api_base;

typedef struct bnfuse_custom_op bnfuse_custom_op;

/* struct OrtCustomOp, fields in the public header's order */
struct bnfuse_custom_op {
    uint32_t version;
    void *(*CreateKernel)(const bnfuse_custom_op *op, const void *api, const void *info);
    const char *(*GetName)(const bnfuse_custom_op *op);
    const char *(*GetExecutionProviderType)(const bnfuse_custom_op *op);
    int (*GetInputType)(const bnfuse_custom_op *op, size_t index);
    size_t (*GetInputTypeCount)(const bnfuse_custom_op *op);
    int (*GetOutputType)(const bnfuse_custom_op *op, size_t index);
    size_t (*GetOutputTypeCount)(const bnfuse_custom_op *op);
    void (*KernelCompute)(void *kernel, void *context);
    void (*KernelDestroy)(void *kernel);
    int (*GetInputCharacteristic)(const bnfuse_custom_op *op, size_t index);
    int (*GetOutputCharacteristic)(const bnfuse_custom_op *op, size_t index);
    int (*GetInputMemoryType)(const bnfuse_custom_op *op, size_t index);
    int (*GetVariadicInputMinArity)(const bnfuse_custom_op *op);
    int (*GetVariadicInputHomogeneity)(const bnfuse_custom_op *op);
    int (*GetVariadicOutputMinArity)(const bnfuse_custom_op *op);
    int (*GetVariadicOutputHomogeneity)(const bnfuse_custom_op *op);
    ort_status (*CreateKernelV2)(const bnfuse_custom_op *op, const void *api, const void *info, void **kernel);
    ort_status (*KernelComputeV2)(void *kernel, void *context);
    void *InferOutputShapeFn;
    int (*GetStartVersion)(const bnfuse_custom_op *op);
    int (*GetEndVersion)(const bnfuse_custom_op *op);
    void *GetMayInplace, *ReleaseMayInplace, *GetAliasMap, *ReleaseAliasMap;
};

/* The running onnxruntime's entries (bound once by RegisterCustomOps: native/register.c). */
extern bnfuse_ort_api ort;

/* Bind ``ort`` from the API base; returns the version bound, or 0 when the runtime is too old. */
uint32_t bnfuse_bind_ort(const bnfuse_ort_api_base *base);

#endif
