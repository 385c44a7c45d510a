/* The entry point onnxruntime looks for in a custom-op library (RegisterCustomOps), every bnfuse
 * kernel's compute function (bnfuse_compute: a fast path for small float32 tensors and the fused optimizer
 * steps, else Python), and
 * two small helpers for the Python path.
 *
 * RegisterCustomOps only forwards to a Python callback installed through bnfuse_set_register_callback
 * (from the bnfuse/runtime/ortabi package, which loads this same shared object with ctypes and so gets the same
 * handle onnxruntime dlopens). The op definitions and the kernels live in Python; onnxruntime's questions
 * about an op (name, provider, types, characteristics) are answered here, from a description ortabi
 * places right after each OrtCustomOp struct (bnfuse_op_info), so creating a session calls Python only to
 * create the kernels.
 * The library links against neither onnxruntime nor Python.
 *
 * The hot-path helpers (bnfuse_read_inputs / bnfuse_make_outputs) replace ~30 ctypes calls per kernel
 * call by two. They call onnxruntime only through function pointers that ortabi takes from the
 * OrtApi table (ortabi/api.py owns the table layout) and hands over with bnfuse_set_tensor_api; the
 * prototypes below are those of the public header onnxruntime_c_api.h.
 *
 * The two structs below are the first members of onnxruntime's public OrtApiBase and OrtApi; both
 * are append-only, so these prefixes hold for every onnxruntime release.
 *
 * Lifetime: onnxruntime may call into this library for as long as a session that uses bnfuse's ops exists,
 * which in someone else's process can be after the interpreter has started finalizing (a session in a
 * runpy namespace, a cache or a cycle dies in Python's final garbage collection). Every entry that would
 * call into Python first asks the interpreter (bnfuse_set_python: a pointer to Py_IsFinalizing, handed over
 * by ortabi) and, once it is finalizing, answers without Python: an error status for RegisterCustomOps,
 * CreateKernelV2 and compute, nothing for KernelDestroy (the kernel's Python state is then left to the
 * exiting process). The structs onnxruntime holds (ops, plans) are kept alive by ortabi for the life of
 * the process.
 */
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>

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

static void *oldest_api_status(const void *api_base, const char *message) {
    const bnfuse_api_base_prefix *base = (const bnfuse_api_base_prefix *)api_base;
    const bnfuse_api_prefix *api = base ? (const bnfuse_api_prefix *)base->GetApi(BNFUSE_OLDEST_API) : NULL;
    return api == NULL ? NULL : api->CreateStatus(BNFUSE_ORT_FAIL, message);
}

BNFUSE_EXPORT void *RegisterCustomOps(void *session_options, const void *api_base) {
    if (registered_callback != NULL) {
        if (!bnfuse_python_usable()) {
            count_refused();
            return oldest_api_status(api_base, python_gone_message);
        }
        return registered_callback(session_options, api_base);
    }
    /* Loaded by onnxruntime without bnfuse's Python side: fail with a status, never crash. */
    return oldest_api_status(api_base,
                             "bnfuse custom ops: register the library through bnfuse.runtime.session_options() "
                             "or call bnfuse.runtime.library_path() in this process first");
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

/* A kernel's small-tensor function (cpuserial.c's entry_*, cpu_entry.py): tensors = the op's inputs then its
 * outputs, ints = {outer, channels, inner, flags, batch_var present}, reals = {epsilon, batch weight}. */
typedef void (*bnfuse_fast_fn)(void **tensors, const int64_t *ints, const double *reals);
typedef void *(*bnfuse_compute_fn)(void *kernel, void *context);

enum { BNFUSE_INFERENCE = 0, BNFUSE_TRAINING = 1, BNFUSE_GRAD = 2, BNFUSE_INPUTS = 5, BNFUSE_MAX_OUTPUTS = 6 };
/* The fused optimizer steps (bnfuse/runtime/optimizer_ops.py), computed in this file: no fast function. */
enum { BNFUSE_SGD = 3, BNFUSE_ADAM = 4, BNFUSE_HYPER_HEAD = 3 };
/* flags bit (cpu_entry.RELU): the fused activation; Grad then also reads input 5 (Y), passed as the last tensor */
enum { BNFUSE_RELU = 8, BNFUSE_Y_SLOT = BNFUSE_INPUTS + BNFUSE_MAX_OUTPUTS };
enum { BNFUSE_ORT_FLOAT = 1 };

/* One kernel, decided once when onnxruntime creates it (ortabi fills it in and owns the memory;
 * its address is the op_kernel onnxruntime hands back to bnfuse_compute). */
typedef struct {
    bnfuse_compute_fn python_compute; /* the general path, in Python */
    bnfuse_fast_fn fast;              /* NULL: every call takes the general path */
    int64_t op;                       /* BNFUSE_INFERENCE / TRAINING / GRAD */
    int64_t per_activation;           /* mode: statistics per activation (params shaped X.shape[1:]) */
    int64_t axis;                     /* channel axis (spatial mode); negative counts from the end */
    int64_t below_bytes;              /* fast path only for an X of fewer bytes */
    int64_t flags;                    /* passed through to the fast function */
    double epsilon, weight;
    /* Optimizer steps: {SGD: momentum, nesterov, 0 | Adam: beta1, beta2, epsilon}, then per parameter its
     * weight decay and learning-rate multiplier; parameters: how many the node updates. */
    const double *hyper;
    int64_t parameters;
} bnfuse_plan;

static volatile int fast_path_enabled = 1;
static int64_t fast_calls = 0;

/* Off while bnfuse.runtime.ops.record_addresses() records what the Python path sees. */
BNFUSE_EXPORT void bnfuse_set_fast_path(int enabled) { fast_path_enabled = enabled; }

/* How many calls the fast path has served in this process (tests prove it is taken). */
BNFUSE_EXPORT int64_t bnfuse_fast_calls(void) { return __atomic_load_n(&fast_calls, __ATOMIC_RELAXED); }

typedef struct {
    int64_t dims[BNFUSE_MAX_RANK];
    size_t rank;
} bnfuse_shape;

static int same_shape(const bnfuse_shape *a, const bnfuse_shape *b) {
    if (a->rank != b->rank) {
        return 0;
    }
    for (size_t i = 0; i < a->rank; ++i) {
        if (a->dims[i] != b->dims[i]) {
            return 0;
        }
    }
    return 1;
}

/* Input ``index`` if it is a float tensor of rank <= 8 (*ok = 1), its data into *data and shape into *shape. */
static void *read_float_input(void *context, size_t index, void **data, bnfuse_shape *shape, int *ok) {
    const void *value = NULL;
    void *info = NULL;
    int type = 0;
    *ok = 0;
    BNFUSE_TRY(tensor_api.KernelContext_GetInput(context, index, &value));
    if (value == NULL) {
        return NULL;
    }
    BNFUSE_TRY(tensor_api.GetTensorTypeAndShape(value, &info));
    void *status = tensor_api.GetTensorElementType(info, &type);
    if (status == NULL) {
        status = tensor_api.GetDimensionsCount(info, &shape->rank);
    }
    if (status == NULL && type == BNFUSE_ORT_FLOAT && shape->rank <= BNFUSE_MAX_RANK) {
        status = tensor_api.GetDimensions(info, shape->dims, shape->rank);
        *ok = status == NULL;
    }
    tensor_api.ReleaseTensorTypeAndShapeInfo(info);
    if (status == NULL && *ok) {
        status = tensor_api.GetTensorMutableData((void *)value, data);
    }
    return status;
}

/* The fast path: *taken = 1 when it served the call. Anything it does not handle -- a shape the op
 * refuses, an empty or large X -- is left to the Python path, which gives the errors and messages. */
static void *run_fast(const bnfuse_plan *plan, void *context, int *taken) {
    void *tensors[BNFUSE_Y_SLOT + 1] = {0};
    bnfuse_shape shapes[BNFUSE_INPUTS], params, y_shape;
    int ok = 0;
    *taken = 0;
    for (size_t index = 0; index < BNFUSE_INPUTS; ++index) {
        BNFUSE_TRY(read_float_input(context, index, &tensors[index], &shapes[index], &ok));
        if (!ok) {
            return NULL;
        }
    }
    const int with_y = plan->op == BNFUSE_GRAD && (plan->flags & BNFUSE_RELU);
    if (with_y) { /* a missing Y (not given, or past the node's inputs) reads as NULL: the Python path says so */
        BNFUSE_TRY(read_float_input(context, BNFUSE_INPUTS, &tensors[BNFUSE_Y_SLOT], &y_shape, &ok));
        if (!ok) {
            return NULL;
        }
    }
    const size_t data_inputs = plan->op == BNFUSE_GRAD ? 2 : 1;
    const bnfuse_shape *x = &shapes[data_inputs - 1]; /* X is the last data input (Grad: dY, X) */
    const int64_t rank = (int64_t)x->rank;
    const int64_t axis = plan->axis < 0 ? plan->axis + rank : plan->axis;
    if (rank < 2 || axis <= 0 || axis >= rank) {
        return NULL;
    }
    int64_t outer = 1, channels = 1, inner = 1;
    if (plan->per_activation) {
        outer = x->dims[0];
        params.rank = x->rank - 1;
        for (int64_t i = 1; i < rank; ++i) {
            channels *= x->dims[i];
            params.dims[i - 1] = x->dims[i];
        }
    } else {
        for (int64_t i = 0; i < rank; ++i) {
            if (i < axis) {
                outer *= x->dims[i];
            } else if (i > axis) {
                inner *= x->dims[i];
            }
        }
        channels = x->dims[axis];
        params.rank = 1;
        params.dims[0] = channels;
    }
    if (outer <= 0 || channels <= 0 || inner <= 0 || outer * channels * inner >= plan->below_bytes / 4) {
        return NULL;
    }
    for (size_t index = 0; index < BNFUSE_INPUTS; ++index) {
        if (!same_shape(&shapes[index], index < data_inputs ? x : &params)) {
            return NULL;
        }
    }
    if (with_y && !same_shape(&y_shape, x)) {
        return NULL;
    }
    size_t outputs = plan->op == BNFUSE_INFERENCE ? 1 : 3;
    if (plan->op == BNFUSE_TRAINING) {
        BNFUSE_TRY(tensor_api.KernelContext_GetOutputCount(context, &outputs));
        outputs = outputs > BNFUSE_MAX_OUTPUTS ? BNFUSE_MAX_OUTPUTS : outputs;
    }
    for (size_t index = 0; index < outputs; ++index) {
        const bnfuse_shape *shape = index == 0 ? x : &params; /* Y / dX, then per-channel outputs */
        void *value = NULL;
        BNFUSE_TRY(tensor_api.KernelContext_GetOutput(context, index, shape->dims, shape->rank, &value));
        if (value == NULL) {
            if (index == 5) {
                continue; /* Training's optional batch_var */
            }
            return NULL; /* the Python path asks again (same shapes: ORT hands back these outputs) */
        }
        BNFUSE_TRY(tensor_api.GetTensorMutableData(value, &tensors[BNFUSE_INPUTS + index]));
    }
    const int64_t ints[5] = {outer, channels, inner, plan->flags, tensors[BNFUSE_INPUTS + 5] != NULL};
    const double reals[2] = {plan->epsilon, plan->weight};
    plan->fast(tensors, ints, reals);
    __atomic_fetch_add(&fast_calls, 1, __ATOMIC_RELAXED);
    *taken = 1;
    return NULL;
}

/* -- fused optimizer steps ------------------------------------------------------------------------- */

/* float32 arithmetic in the order of the standard-ONNX update nodes (bnfuse/passes/training/optimizers.py),
 * one rounding per node, so the fused step gives their bits. setup.py builds this file with
 * -ffp-contract=off: no multiply and add may merge into an FMA (and -fno-math-errno, -fvect-cost-model=dynamic
 * so the loops vectorize; sqrtf stays correctly rounded). The loops are specialized per case so the
 * compiler vectorizes them; the work is cut into chunks run on onnxruntime's intra-op pool. */

enum { BNFUSE_CHUNK = 16384 }; /* elements per pool task: 64 KiB of each tensor */

typedef struct {
    const float *restrict p, *restrict g, *restrict s1, *restrict s2; /* param, grad, state (buffer | m, v) */
    float *restrict new_p, *restrict new_s1, *restrict new_s2;
    float decay, rate;
    size_t count;
} bnfuse_parameter;

typedef struct {
    const bnfuse_plan *plan;
    bnfuse_parameter *parameters;
    size_t *chunk_parameter, *chunk_begin; /* per chunk: which parameter, first element */
    float root;                            /* Adam: sqrt(1 - beta2^t) */
} bnfuse_step_job;

/* x86-64: an AVX2 clone picked at load time where the CPU has it (no FMA: contraction is off) */
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define BNFUSE_VECTOR_CLONES __attribute__((target_clones("avx2", "default")))
#else
#define BNFUSE_VECTOR_CLONES
#endif

BNFUSE_VECTOR_CLONES
static void sgd_range(const bnfuse_plan *plan, const bnfuse_parameter *a, size_t begin, size_t end) {
    const float m = (float)plan->hyper[0], decay = a->decay, rate = a->rate;
    const int nesterov = plan->hyper[1] != 0.0;
    const float *restrict p = a->p, *restrict g = a->g, *restrict buf = a->s1;
    float *restrict new_p = a->new_p, *restrict new_buf = a->new_s1;
    if (m == 0.0f && decay == 0.0f) {
        for (size_t k = begin; k < end; ++k) new_p[k] = p[k] - g[k] * rate;
    } else if (m == 0.0f) {
        for (size_t k = begin; k < end; ++k) new_p[k] = p[k] - (g[k] + p[k] * decay) * rate;
    } else if (decay == 0.0f && !nesterov) {
        for (size_t k = begin; k < end; ++k) {
            const float b = buf[k] * m + g[k];
            new_buf[k] = b;
            new_p[k] = p[k] - b * rate;
        }
    } else if (!nesterov) {
        for (size_t k = begin; k < end; ++k) {
            const float b = buf[k] * m + (g[k] + p[k] * decay);
            new_buf[k] = b;
            new_p[k] = p[k] - b * rate;
        }
    } else if (decay == 0.0f) { /* Nesterov */
        for (size_t k = begin; k < end; ++k) {
            const float b = buf[k] * m + g[k];
            new_buf[k] = b;
            new_p[k] = p[k] - (g[k] + b * m) * rate;
        }
    } else {
        for (size_t k = begin; k < end; ++k) {
            const float d = g[k] + p[k] * decay;
            const float b = buf[k] * m + d;
            new_buf[k] = b;
            new_p[k] = p[k] - (d + b * m) * rate;
        }
    }
}

/* decay 0 has no Add in the graph (p * 0 would also turn a -0 gradient into +0): a loop of its own */
BNFUSE_VECTOR_CLONES
static void adam_elements(const float *restrict p, const float *restrict g, const float *restrict m,
                          const float *restrict v, float *restrict new_p, float *restrict new_m, float *restrict new_v,
                          const float *constants, float decay, float rate, size_t count) {
    const float beta1 = constants[0], beta2 = constants[1], rest1 = constants[2], rest2 = constants[3];
    const float root = constants[4], eps = constants[5];
    if (decay != 0.0f) {
        for (size_t k = 0; k < count; ++k) {
            const float d = g[k] + p[k] * decay;
            const float m1 = m[k] * beta1 + d * rest1, v1 = v[k] * beta2 + (d * d) * rest2;
            new_m[k] = m1;
            new_v[k] = v1;
            new_p[k] = p[k] - (m1 / (sqrtf(v1) / root + eps)) * rate;
        }
    } else {
        for (size_t k = 0; k < count; ++k) {
            const float d = g[k];
            const float m1 = m[k] * beta1 + d * rest1, v1 = v[k] * beta2 + (d * d) * rest2;
            new_m[k] = m1;
            new_v[k] = v1;
            new_p[k] = p[k] - (m1 / (sqrtf(v1) / root + eps)) * rate;
        }
    }
}

static void adam_range(const bnfuse_plan *plan, const bnfuse_parameter *a, float root, size_t begin, size_t end) {
    const float constants[6] = {(float)plan->hyper[0], (float)plan->hyper[1], (float)(1.0 - plan->hyper[0]),
                                (float)(1.0 - plan->hyper[1]), root, (float)plan->hyper[2]};
    adam_elements(a->p + begin, a->g + begin, a->s1 + begin, a->s2 + begin, a->new_p + begin, a->new_s1 + begin,
                  a->new_s2 + begin, constants, a->decay, a->rate, end - begin);
}

static void run_step_chunk(void *data, size_t chunk) {
    const bnfuse_step_job *job = (const bnfuse_step_job *)data;
    const bnfuse_parameter *a = &job->parameters[job->chunk_parameter[chunk]];
    const size_t begin = job->chunk_begin[chunk];
    const size_t end = begin + BNFUSE_CHUNK < a->count ? begin + BNFUSE_CHUNK : a->count;
    if (job->plan->op == BNFUSE_ADAM) {
        adam_range(job->plan, a, job->root, begin, end);
    } else {
        sgd_range(job->plan, a, begin, end);
    }
}

static size_t element_count(const bnfuse_shape *shape) {
    size_t count = 1;
    for (size_t i = 0; i < shape->rank; ++i) {
        count *= (size_t)shape->dims[i];
    }
    return count;
}

/* Reads one parameter's inputs (param, grad, state...) and has ORT allocate its outputs; *usable = 0 when
 * something does not fit (the Python path then says what). */
static void *bind_parameter(const bnfuse_plan *plan, void *context, size_t index, size_t lead, size_t states,
                            float lr, bnfuse_parameter *a, int *usable) {
    const float *given[4] = {0};
    float *made[3] = {0};
    bnfuse_shape shape, own;
    int ok = 0;
    const size_t per_input = 2 + states, per_output = 1 + states;
    for (size_t j = 0; j < per_input; ++j) {
        BNFUSE_TRY(read_float_input(context, lead + index * per_input + j, (void **)&given[j], j ? &own : &shape, &ok));
        if (!ok || (j && !same_shape(&own, &shape))) {
            *usable = 0;
            return NULL;
        }
    }
    for (size_t j = 0; j < per_output; ++j) {
        void *value = NULL;
        BNFUSE_TRY(tensor_api.KernelContext_GetOutput(context, index * per_output + j, shape.dims, shape.rank, &value));
        if (value == NULL) { /* an output the graph drops: left to the Python path */
            *usable = 0;
            return NULL;
        }
        BNFUSE_TRY(tensor_api.GetTensorMutableData(value, (void **)&made[j]));
    }
    const double *hyper = plan->hyper + BNFUSE_HYPER_HEAD + 2 * index;
    *a = (bnfuse_parameter){given[0], given[1], given[2], given[3], made[0], made[1], made[2], (float)hyper[0],
                            hyper[1] == 1.0 ? lr : lr * (float)hyper[1], element_count(&shape)};
    return NULL;
}

/* One optimizer node: inputs {SGD: lr | Adam: step_size, root} then per parameter (param, grad, state...),
 * outputs per parameter (new param, new state...), all float32. */
static void *run_optimizer(const bnfuse_plan *plan, void *context, int *taken) {
    const int adam = plan->op == BNFUSE_ADAM;
    const size_t states = adam ? 2 : (plan->hyper[0] != 0.0 ? 1 : 0), lead = adam ? 2 : 1;
    const size_t parameters = (size_t)plan->parameters;
    size_t inputs = 0, outputs = 0;
    *taken = 0;
    BNFUSE_TRY(tensor_api.KernelContext_GetInputCount(context, &inputs));
    BNFUSE_TRY(tensor_api.KernelContext_GetOutputCount(context, &outputs));
    if (inputs != lead + (2 + states) * parameters || outputs != (1 + states) * parameters) {
        return NULL;
    }
    float scalars[2] = {0.0f, 0.0f};
    for (size_t j = 0; j < lead; ++j) {
        bnfuse_shape shape;
        void *data = NULL;
        int ok = 0;
        BNFUSE_TRY(read_float_input(context, j, &data, &shape, &ok));
        if (!ok || element_count(&shape) != 1) {
            return NULL;
        }
        scalars[j] = *(const float *)data;
    }
    bnfuse_step_job job = {plan, calloc(parameters + 1, sizeof(bnfuse_parameter)), NULL, NULL, scalars[1]};
    void *status = NULL;
    int usable = job.parameters != NULL;
    size_t chunks = 0;
    for (size_t i = 0; usable && status == NULL && i < parameters; ++i) {
        status = bind_parameter(plan, context, i, lead, states, scalars[0], &job.parameters[i], &usable);
        chunks += (job.parameters[i].count + BNFUSE_CHUNK - 1) / BNFUSE_CHUNK;
    }
    if (usable && status == NULL) {
        job.chunk_parameter = malloc(sizeof(size_t) * (chunks + 1));
        job.chunk_begin = malloc(sizeof(size_t) * (chunks + 1));
        usable = job.chunk_parameter != NULL && job.chunk_begin != NULL;
    }
    if (usable && status == NULL) {
        size_t chunk = 0;
        for (size_t i = 0; i < parameters; ++i) {
            for (size_t begin = 0; begin < job.parameters[i].count; begin += BNFUSE_CHUNK, ++chunk) {
                job.chunk_parameter[chunk] = i;
                job.chunk_begin[chunk] = begin;
            }
        }
        if (tensor_api.KernelContext_ParallelFor != NULL && chunks > 1) {
            status = tensor_api.KernelContext_ParallelFor(context, run_step_chunk, chunks, 0, &job);
        } else {
            for (size_t c = 0; c < chunks; ++c) {
                run_step_chunk(&job, c);
            }
        }
        if (status == NULL) {
            __atomic_fetch_add(&fast_calls, 1, __ATOMIC_RELAXED);
            *taken = 1;
        }
    } else if (status == NULL && job.parameters == NULL) {
        status = tensor_api.CreateStatus(BNFUSE_ORT_FAIL, "bnfuse optimizer step: out of memory");
    }
    free(job.parameters);
    free(job.chunk_parameter);
    free(job.chunk_begin);
    return status;
}

/* KernelComputeV2 of every bnfuse op: the fast path where the plan has one and the call fits it, else
 * the Python callback. Nothing runs once the interpreter finalizes: the fast path's kernels live in an
 * extension module whose state Python's teardown may release. */
BNFUSE_EXPORT void *bnfuse_compute(void *kernel, void *context) {
    const bnfuse_plan *plan = (const bnfuse_plan *)kernel;
    if (!bnfuse_python_usable()) {
        count_refused();
        return tensor_api.CreateStatus(BNFUSE_ORT_FAIL, python_gone_message);
    }
    const int optimizer = plan->op == BNFUSE_SGD || plan->op == BNFUSE_ADAM;
    if ((plan->fast != NULL || optimizer) && fast_path_enabled) {
        int taken = 0;
        void *status = optimizer ? run_optimizer(plan, context, &taken) : run_fast(plan, context, &taken);
        if (status != NULL || taken) {
            return status;
        }
    }
    return plan->python_compute(kernel, context);
}
