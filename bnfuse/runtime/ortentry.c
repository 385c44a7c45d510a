/* The entry point onnxruntime looks for in a custom-op library (RegisterCustomOps), plus two small
 * helpers for the per-call hot path of bnfuse's kernels.
 *
 * RegisterCustomOps only forwards to a Python callback installed through bnfuse_set_register_callback
 * (from bnfuse/runtime/ortabi.py, which loads this same shared object with ctypes and so gets the same
 * handle onnxruntime dlopens). Everything else -- the op definitions, the kernels -- lives in Python.
 * The library links against neither onnxruntime nor Python.
 *
 * The hot-path helpers (bnfuse_read_inputs / bnfuse_make_outputs) replace ~30 ctypes calls per kernel
 * call by two. They call onnxruntime only through function pointers that ortabi.py takes from the
 * OrtApi table (ortabi.py owns the table layout) and hands over with bnfuse_set_tensor_api; the
 * prototypes below are those of the public header onnxruntime_c_api.h.
 *
 * The two structs below are the first members of onnxruntime's public OrtApiBase and OrtApi; both
 * are append-only, so these prefixes hold for every onnxruntime release.
 */
#include <stddef.h>
#include <stdint.h>

#define BNFUSE_EXPORT __attribute__((visibility("default")))

typedef void *(*bnfuse_register_fn)(void *session_options, const void *api_base);

typedef struct {
    const void *(*GetApi)(uint32_t version);
    const char *(*GetVersionString)(void);
} bnfuse_api_base_prefix;

typedef struct {
    void *(*CreateStatus)(int code, const char *message);
} bnfuse_api_prefix;

enum { BNFUSE_ORT_FAIL = 1, BNFUSE_ORT_INVALID_ARGUMENT = 2, BNFUSE_OLDEST_API = 1, BNFUSE_MAX_RANK = 8 };

static bnfuse_register_fn registered_callback = NULL;

BNFUSE_EXPORT void bnfuse_set_register_callback(bnfuse_register_fn callback) { registered_callback = callback; }

BNFUSE_EXPORT int bnfuse_has_register_callback(void) { return registered_callback != NULL; }

BNFUSE_EXPORT void *RegisterCustomOps(void *session_options, const void *api_base) {
    if (registered_callback != NULL) {
        return registered_callback(session_options, api_base);
    }
    /* Loaded by onnxruntime without bnfuse's Python side: fail with a status, never crash. */
    const bnfuse_api_base_prefix *base = (const bnfuse_api_base_prefix *)api_base;
    const bnfuse_api_prefix *api = base ? (const bnfuse_api_prefix *)base->GetApi(BNFUSE_OLDEST_API) : NULL;
    if (api == NULL) {
        return NULL;
    }
    return api->CreateStatus(BNFUSE_ORT_FAIL,
                             "bnfuse custom ops: register the library through bnfuse.runtime.session_options() "
                             "or call bnfuse.runtime.library_path() in this process first");
}

/* -- hot path ------------------------------------------------------------------------------------ */

/* The OrtApi entries the helpers call, in this order (OrtStatus* is returned as void*). */
typedef struct {
    void *(*CreateStatus)(int code, const char *message);
    void *(*KernelContext_GetInput)(const void *context, size_t index, const void **out);
    void *(*KernelContext_GetOutput)(void *context, size_t index, const int64_t *dims, size_t count, void **out);
    void *(*GetTensorTypeAndShape)(const void *value, void **out);
    void *(*GetTensorElementType)(const void *info, int *out);
    void *(*GetDimensionsCount)(const void *info, size_t *out);
    void *(*GetDimensions)(const void *info, int64_t *dims, size_t count);
    void (*ReleaseTensorTypeAndShapeInfo)(void *info);
    void *(*GetTensorMutableData)(void *value, void **out);
} bnfuse_tensor_api;

/* One tensor as int64 fields, so Python reads a whole table with one NumPy call:
 * [data address, element type (outputs: 1 if allocated), rank, dims[8], OrtValue address]. rank -1: absent. */
enum { BNFUSE_DATA, BNFUSE_TYPE, BNFUSE_RANK, BNFUSE_DIMS, BNFUSE_VALUE = BNFUSE_DIMS + BNFUSE_MAX_RANK, BNFUSE_FIELDS };

static bnfuse_tensor_api tensor_api;

BNFUSE_EXPORT void bnfuse_set_tensor_api(const bnfuse_tensor_api *api) { tensor_api = *api; }

BNFUSE_EXPORT int bnfuse_tensor_fields(void) { return BNFUSE_FIELDS; }

/* Bumped whenever the helpers' contract with ortabi.py changes: a stale build is refused, not misread. */
BNFUSE_EXPORT int bnfuse_abi_version(void) { return 2; }

#define BNFUSE_TRY(call)             \
    do {                             \
        void *status_ = (call);      \
        if (status_ != NULL) {       \
            return status_;          \
        }                            \
    } while (0)

static void *read_tensor(const void *value, int64_t *row) {
    void *info = NULL, *data = NULL;
    int type = 0;
    size_t rank = 0;
    BNFUSE_TRY(tensor_api.GetTensorTypeAndShape(value, &info));
    void *status = tensor_api.GetTensorElementType(info, &type);
    if (status == NULL) {
        status = tensor_api.GetDimensionsCount(info, &rank);
    }
    if (status == NULL && rank > BNFUSE_MAX_RANK) {
        status = tensor_api.CreateStatus(BNFUSE_ORT_INVALID_ARGUMENT, "bnfuse's ops take tensors of at most 8 dimensions");
    }
    if (status == NULL) {
        status = tensor_api.GetDimensions(info, row + BNFUSE_DIMS, rank);
    }
    tensor_api.ReleaseTensorTypeAndShapeInfo(info);
    if (status != NULL) {
        return status;
    }
    BNFUSE_TRY(tensor_api.GetTensorMutableData((void *)value, &data));
    row[BNFUSE_DATA] = (int64_t)(intptr_t)data;
    row[BNFUSE_TYPE] = type;
    row[BNFUSE_RANK] = (int64_t)rank;
    row[BNFUSE_VALUE] = (int64_t)(intptr_t)value;
    return NULL;
}

/* Inputs 0..count-1 of a kernel call into table rows; returns an OrtStatus* on failure. */
BNFUSE_EXPORT void *bnfuse_read_inputs(const void *context, size_t count, int64_t *table) {
    for (size_t index = 0; index < count; ++index) {
        int64_t *row = table + index * BNFUSE_FIELDS;
        const void *value = NULL;
        BNFUSE_TRY(tensor_api.KernelContext_GetInput(context, index, &value));
        if (value == NULL) {
            row[BNFUSE_DATA] = 0;
            row[BNFUSE_RANK] = -1;
            row[BNFUSE_VALUE] = 0;
            continue;
        }
        BNFUSE_TRY(read_tensor(value, row));
    }
    return NULL;
}

/* Have onnxruntime allocate outputs 0..count-1 with the rank and dims given in each row (rank -1:
 * skip); fills in the data and OrtValue addresses (0 where the node does not use the output) and sets
 * the type field to 1 where an output was allocated, 0 where not. */
BNFUSE_EXPORT void *bnfuse_make_outputs(void *context, size_t count, int64_t *table) {
    for (size_t index = 0; index < count; ++index) {
        int64_t *row = table + index * BNFUSE_FIELDS;
        void *value = NULL, *data = NULL;
        row[BNFUSE_DATA] = 0;
        row[BNFUSE_TYPE] = 0;
        row[BNFUSE_VALUE] = 0;
        if (row[BNFUSE_RANK] < 0) {
            continue;
        }
        if (row[BNFUSE_RANK] > BNFUSE_MAX_RANK) {
            return tensor_api.CreateStatus(BNFUSE_ORT_INVALID_ARGUMENT, "bnfuse's ops take tensors of at most 8 dimensions");
        }
        BNFUSE_TRY(tensor_api.KernelContext_GetOutput(context, index, row + BNFUSE_DIMS, (size_t)row[BNFUSE_RANK], &value));
        if (value == NULL) {
            continue;
        }
        BNFUSE_TRY(tensor_api.GetTensorMutableData(value, &data));
        row[BNFUSE_DATA] = (int64_t)(intptr_t)data;
        row[BNFUSE_TYPE] = 1;
        row[BNFUSE_VALUE] = (int64_t)(intptr_t)value;
    }
    return NULL;
}
