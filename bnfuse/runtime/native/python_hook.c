/* The hook for the ops that stay in Python (the CuPy CUDA kernels, the MPI collective ops): when bnfuse's Python side
 * runs in this process (bnfuse/runtime/ortabi) it installs a callback here, and RegisterCustomOps (register.c) then
 * lets it add those ops to the same domain as the native ones. Without it, nothing is added and nothing fails.
 *
 * onnxruntime's questions about a Python op (name, provider, types, characteristics) are answered here, from a
 * description ortabi places right after each OrtCustomOp struct (bnfuse_op_info), so creating a session calls Python
 * only to create the kernels. Two helpers (bnfuse_read_inputs / bnfuse_make_outputs) replace ~30 ctypes calls per
 * Python kernel call by two; they call onnxruntime through function pointers ortabi hands over
 * (bnfuse_set_tensor_api).
 *
 * Lifetime: onnxruntime may call into this library for as long as a session exists, which in someone else's process
 * can be after the interpreter has started finalizing. Every entry that would call into Python first asks the
 * interpreter (bnfuse_set_python: a pointer to Py_IsFinalizing, handed over by ortabi) and, once it is finalizing,
 * answers without Python: RegisterCustomOps then registers the native ops only, CreateKernelV2 and compute of a
 * Python op give an error status, KernelDestroy leaves the kernel's Python state to the exiting process. No Python
 * symbol is linked: every call into Python goes through a pointer ortabi installed. */
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>

#include "python_hook.h"

#define BNFUSE_EXPORT __attribute__((visibility("default")))

typedef void *(*bnfuse_register_fn)(void *session_options, const void *api_base, void *domain, int *with_native);

typedef struct {
    void *(*CreateStatus)(int code, const char *message);
} bnfuse_api_prefix;

enum { BNFUSE_ORT_FAIL = 1, BNFUSE_ORT_INVALID_ARGUMENT = 2, BNFUSE_MAX_RANK = 8 };

static bnfuse_register_fn registered_callback = NULL;

BNFUSE_EXPORT void bnfuse_set_register_callback(bnfuse_register_fn callback) { registered_callback = callback; }

BNFUSE_EXPORT int bnfuse_has_register_callback(void) { return registered_callback != NULL; }

/* -- the interpreter's lifetime ------------------------------------------------------------------ */

/* What onnxruntime asks of an op, filled in by ortabi at op_info_offset bytes after the OrtCustomOp. */
typedef struct {
    const char *name;
    const char *provider;
    int64_t inputs, outputs;                  /* formal input / output counts (1 each for a variadic op) */
    const int32_t *input_types, *output_types; /* ONNXTensorElementDataType per formal input / output */
    const int32_t *input_characteristics, *output_characteristics; /* required 0, optional 1, variadic 2 */
} bnfuse_op_info;

static size_t op_info_offset = 0;

static const bnfuse_op_info *op_info(const void *op) {
    return (const bnfuse_op_info *)((const char *)op + op_info_offset);
}

/* entry ``index`` of a per-input (or per-output) table; past the end, the last entry (a variadic list's) */
static int32_t entry_of(const int32_t *table, int64_t count, size_t index) {
    if (count <= 0) {
        return 0;
    }
    return table[(int64_t)index < count ? (int64_t)index : count - 1];
}

BNFUSE_EXPORT const char *bnfuse_op_name(const void *op) { return op_info(op)->name; }
BNFUSE_EXPORT const char *bnfuse_op_provider(const void *op) { return op_info(op)->provider; }
BNFUSE_EXPORT size_t bnfuse_op_input_count(const void *op) { return (size_t)op_info(op)->inputs; }
BNFUSE_EXPORT size_t bnfuse_op_output_count(const void *op) { return (size_t)op_info(op)->outputs; }

BNFUSE_EXPORT int bnfuse_op_input_type(const void *op, size_t index) {
    return entry_of(op_info(op)->input_types, op_info(op)->inputs, index);
}

BNFUSE_EXPORT int bnfuse_op_output_type(const void *op, size_t index) {
    return entry_of(op_info(op)->output_types, op_info(op)->outputs, index);
}

BNFUSE_EXPORT int bnfuse_op_input_characteristic(const void *op, size_t index) {
    return entry_of(op_info(op)->input_characteristics, op_info(op)->inputs, index);
}

BNFUSE_EXPORT int bnfuse_op_output_characteristic(const void *op, size_t index) {
    return entry_of(op_info(op)->output_characteristics, op_info(op)->outputs, index);
}

/* OrtMemTypeDefault: the provider's own memory (device memory on CUDA) */
BNFUSE_EXPORT int bnfuse_op_input_memory_type(const void *op, size_t index) {
    (void)op;
    (void)index;
    return 0;
}

/* variadic lists: at least one value, all of one type */
BNFUSE_EXPORT int bnfuse_op_one(const void *op) {
    (void)op;
    return 1;
}

typedef int (*bnfuse_flag_fn)(void);
typedef void *(*bnfuse_create_kernel_fn)(const void *op, const void *api, const void *info, void **kernel);
typedef void (*bnfuse_destroy_kernel_fn)(void *kernel);

static bnfuse_flag_fn interpreter_finalizing = NULL; /* Py_IsFinalizing: callable without the GIL */
static bnfuse_create_kernel_fn python_create_kernel = NULL;
static bnfuse_destroy_kernel_fn python_destroy_kernel = NULL;

static const char python_gone_message[] =
    "bnfuse custom ops: the Python interpreter is shutting down; bnfuse's kernels no longer run in this process";

/* The Python side's entries, the interpreter's finalization flag and where each op's bnfuse_op_info lies
 * (ortabi, once per process). */
BNFUSE_EXPORT void bnfuse_set_python(bnfuse_flag_fn finalizing, bnfuse_create_kernel_fn create,
                                     bnfuse_destroy_kernel_fn destroy, size_t info_offset) {
    op_info_offset = info_offset;
    interpreter_finalizing = finalizing;
    python_create_kernel = create;
    python_destroy_kernel = destroy;
}

/* 1 while Python may be called: the interpreter is not finalizing. */
BNFUSE_EXPORT int bnfuse_python_usable(void) {
    return interpreter_finalizing != NULL && !interpreter_finalizing();
}

/* How many calls were answered without Python because the interpreter was finalizing (tests read it). */
static int64_t refused_calls = 0;

BNFUSE_EXPORT int64_t bnfuse_refused_calls(void) { return __atomic_load_n(&refused_calls, __ATOMIC_RELAXED); }

static void count_refused(void) { __atomic_fetch_add(&refused_calls, 1, __ATOMIC_RELAXED); }

/* Called by RegisterCustomOps with the domain it fills: the Python side adds its ops (none when bnfuse's Python side
 * is not in this process, or the interpreter is finalizing). *with_native stays 1 unless the Python side registers
 * its own CPU BN kernels instead (ops.python_cpu_kernels(): tests of the Python glue the CUDA kernels go through). */
void *bnfuse_python_register(void *session_options, const void *api_base, void *domain, int *with_native,
                             int *python_ran) {
    if (registered_callback == NULL) {
        return NULL;
    }
    if (!bnfuse_python_usable()) {
        count_refused();
        return NULL;
    }
    *python_ran = 1;
    return registered_callback(session_options, api_base, domain, with_native);
}

/* CreateKernelV2 of every bnfuse op: the kernel is made in Python (ORT passes its OrtApi: the status comes
 * from there when Python is gone). */
BNFUSE_EXPORT void *bnfuse_create_kernel(const void *op, const void *api, const void *info, void **kernel) {
    if (python_create_kernel == NULL || !bnfuse_python_usable()) {
        count_refused();
        return ((const bnfuse_api_prefix *)api)->CreateStatus(BNFUSE_ORT_FAIL, python_gone_message);
    }
    return python_create_kernel(op, api, info, kernel);
}

/* KernelDestroy of every bnfuse op. A session that dies while the interpreter finalizes (its last reference
 * dropped in the final garbage collection) leaves its kernels' Python state to the exiting process. */
BNFUSE_EXPORT void bnfuse_destroy_kernel(void *kernel) {
    if (python_destroy_kernel == NULL || !bnfuse_python_usable()) {
        count_refused();
        return;
    }
    python_destroy_kernel(kernel);
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
    void *(*KernelContext_GetOutputCount)(const void *context, size_t *out);
    void *(*KernelContext_GetInputCount)(const void *context, size_t *out);
    /* NULL on runtimes before 1.17 (ortabi): the optimizer steps then run on the calling thread */
    void *(*KernelContext_ParallelFor)(const void *context, void (*fn)(void *, size_t), size_t total,
                                       size_t batches, void *data);
} bnfuse_tensor_api;

/* One tensor as int64 fields, so Python reads a whole table with one NumPy call:
 * [data address, element type (outputs: 1 if allocated), rank, dims[8], OrtValue address]. rank -1: absent. */
enum { BNFUSE_DATA, BNFUSE_TYPE, BNFUSE_RANK, BNFUSE_DIMS, BNFUSE_VALUE = BNFUSE_DIMS + BNFUSE_MAX_RANK, BNFUSE_FIELDS };

static bnfuse_tensor_api tensor_api;

BNFUSE_EXPORT void bnfuse_set_tensor_api(const bnfuse_tensor_api *api) { tensor_api = *api; }

BNFUSE_EXPORT int bnfuse_tensor_fields(void) { return BNFUSE_FIELDS; }

/* Bumped whenever the helpers' contract with ortabi changes: a stale build is refused, not misread. */
BNFUSE_EXPORT int bnfuse_abi_version(void) { return 5; }

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

/* -- compute ------------------------------------------------------------------------------------- */

typedef void *(*bnfuse_compute_fn)(void *kernel, void *context);

/* One Python kernel (ortabi fills it in and owns the memory; its address is the op_kernel onnxruntime hands back to
 * bnfuse_compute). The fields after python_compute are no longer read. */
typedef struct {
    bnfuse_compute_fn python_compute;
} bnfuse_plan;

/* KernelComputeV2 of every Python op. Nothing runs once the interpreter finalizes. */
BNFUSE_EXPORT void *bnfuse_compute(void *kernel, void *context) {
    const bnfuse_plan *plan = (const bnfuse_plan *)kernel;
    if (!bnfuse_python_usable()) {
        count_refused();
        return tensor_api.CreateStatus(BNFUSE_ORT_FAIL, python_gone_message);
    }
    return plan->python_compute(kernel, context);
}
