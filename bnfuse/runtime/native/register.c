/* RegisterCustomOps, the symbol onnxruntime looks up in a custom-op library: one domain "bnfuse" holding every native
 * CPU op (schema.h: the BN ops for each type pair, the optimizer steps), plus -- only when bnfuse's Python side has
 * installed its hook in this process (python_hook.c) -- the ops that stay in Python (CUDA kernels, MPI collectives),
 * added to the same domain: onnxruntime refuses a second domain of the same name.
 *
 * No Python is needed: a process that never imported bnfuse gets the native ops. */
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "cpukernels.h"
#include "native_ops.h"
#include "python_hook.h"

#define BNFUSE_EXPORT __attribute__((visibility("default")))

bnfuse_ort_api ort;

static const char cpu_provider[] = "CPUExecutionProvider";

enum { NATIVE_OP_COUNT = BN_BN_OPS * BN_TYPE_PAIR_COUNT + BN_OPTIMIZER_OPS + BN_CONV_OPS };

static bn_native_op native_ops[NATIVE_OP_COUNT];

static const bn_native_op *native(const bnfuse_custom_op *op) { return (const bn_native_op *)op; }

static const char *op_name(const bnfuse_custom_op *op) { return native(op)->schema->name; }
static const char *op_provider(const bnfuse_custom_op *op) { return native(op)->provider; }
static size_t op_input_count(const bnfuse_custom_op *op) { return (size_t)native(op)->schema->inputs; }
static size_t op_output_count(const bnfuse_custom_op *op) { return (size_t)native(op)->schema->outputs; }

static int value_type(const bn_native_op *op, const bn_value_schema *values, int count, size_t index) {
    if (op->schema->variadic || (int)index >= count) {
        return op->data_type;
    }
    return values[index].data ? op->data_type : op->param_type;
}

static int op_input_type(const bnfuse_custom_op *op, size_t index) {
    return value_type(native(op), native(op)->schema->input, native(op)->schema->inputs, index);
}

static int op_output_type(const bnfuse_custom_op *op, size_t index) {
    return value_type(native(op), native(op)->schema->output, native(op)->schema->outputs, index);
}

static int characteristic(const bn_native_op *op, const bn_value_schema *values, int count, size_t index) {
    if (op->schema->variadic) {
        return ORT_VARIADIC;
    }
    return (int)index < count && values[index].optional ? ORT_OPTIONAL : ORT_REQUIRED;
}

static int op_input_characteristic(const bnfuse_custom_op *op, size_t index) {
    return characteristic(native(op), native(op)->schema->input, native(op)->schema->inputs, index);
}

static int op_output_characteristic(const bnfuse_custom_op *op, size_t index) {
    return characteristic(native(op), native(op)->schema->output, native(op)->schema->outputs, index);
}

static int op_memory_type(const bnfuse_custom_op *op, size_t index) {
    (void)op;
    (void)index;
    return 0; /* OrtMemTypeDefault */
}

static int op_one(const bnfuse_custom_op *op) { /* variadic lists: at least one value, all of one type */
    (void)op;
    return 1;
}

static int64_t native_calls = 0;

typedef struct {
    const bn_native_op *op;
    void *state; /* bn_ops.c's, optimizer_ops.c's or conv_ops.c's kernel */
} native_kernel;

static int is_step(int code) { return code == BN_OP_SGD_STEP || code == BN_OP_ADAM_STEP; }
static int is_conv(int code) { return code == BN_OP_CONV_WEIGHT_GRAD || code == BN_OP_CONV_INPUT_GRAD; }

static ort_status create_kernel(const bnfuse_custom_op *base, const void *api, const void *info, void **kernel) {
    (void)api;
    const bn_native_op *op = native(base);
    native_kernel *made = calloc(1, sizeof *made);
    if (made == NULL) {
        return ort.CreateStatus(ORT_FAIL, "bnfuse: out of memory");
    }
    made->op = op;
    ort_status status = is_step(op->code)   ? step_create(op, info, &made->state)
                        : is_conv(op->code) ? conv_create(op, info, &made->state)
                                            : bn_create(op, info, &made->state);
    if (status != NULL) {
        free(made);
        return status;
    }
    *kernel = made;
    return NULL;
}

static ort_status compute(void *kernel, void *context) {
    native_kernel *k = kernel;
    __atomic_fetch_add(&native_calls, 1, __ATOMIC_RELAXED);
    const int code = k->op->code;
    return is_step(code) ? step_compute(k->state, context)
           : is_conv(code) ? conv_compute(k->state, context)
                           : bn_compute(k->state, context);
}

static void destroy_kernel(void *kernel) {
    native_kernel *k = kernel;
    if (k == NULL) {
        return;
    }
    if (is_step(k->op->code)) {
        step_destroy(k->state);
    } else {
        free(k->state);
    }
    free(k);
}

static void define(bn_native_op *op, int code, int data_type, int param_type) {
    memset(op, 0, sizeof *op);
    op->schema = &bn_schema[code];
    op->code = code;
    op->data_type = data_type;
    op->param_type = param_type;
    op->provider = cpu_provider;
    bnfuse_custom_op *base = &op->base;
    base->version = ORT_CUSTOM_OP_VERSION;
    base->GetName = op_name;
    base->GetExecutionProviderType = op_provider;
    base->GetInputType = op_input_type;
    base->GetInputTypeCount = op_input_count;
    base->GetOutputType = op_output_type;
    base->GetOutputTypeCount = op_output_count;
    base->KernelDestroy = destroy_kernel;
    base->GetInputCharacteristic = op_input_characteristic;
    base->GetOutputCharacteristic = op_output_characteristic;
    base->GetInputMemoryType = op_memory_type;
    base->GetVariadicInputMinArity = op_one;
    base->GetVariadicInputHomogeneity = op_one;
    base->GetVariadicOutputMinArity = op_one;
    base->GetVariadicOutputHomogeneity = op_one;
    base->CreateKernelV2 = create_kernel;
    base->KernelComputeV2 = compute;
}

static uint32_t bound_version = 0;
static pthread_once_t once = PTHREAD_ONCE_INIT;
static const bnfuse_ort_api_base *once_base = NULL;

#define BIND(name) ort.name = (void *)table[ORT_API_##name]

static void bind_once(void) {
    const void *const *table = once_base->GetApi(ORT_API_VERSION_PARALLEL_FOR);
    uint32_t version = ORT_API_VERSION_PARALLEL_FOR;
    if (table == NULL) {
        table = once_base->GetApi(ORT_API_VERSION_NEEDED);
        version = ORT_API_VERSION_NEEDED;
    }
    if (table == NULL) {
        return;
    }
    BIND(CreateStatus);
    BIND(GetErrorMessage);
    BIND(ReleaseStatus);
    BIND(CreateCustomOpDomain);
    BIND(CustomOpDomain_Add);
    BIND(AddCustomOpDomain);
    BIND(GetTensorMutableData);
    BIND(GetTensorElementType);
    BIND(GetDimensionsCount);
    BIND(GetDimensions);
    BIND(GetTensorTypeAndShape);
    BIND(KernelInfoGetAttribute_float);
    BIND(KernelInfoGetAttribute_int64);
    BIND(KernelInfoGetAttribute_string);
    BIND(KernelContext_GetInputCount);
    BIND(KernelContext_GetOutputCount);
    BIND(KernelContext_GetInput);
    BIND(KernelContext_GetOutput);
    BIND(ReleaseTensorTypeAndShapeInfo);
    BIND(KernelInfoGetAttributeArray_float);
    BIND(KernelInfoGetAttributeArray_int64);
    BIND(KernelInfo_GetInputCount);
    BIND(KernelInfo_GetNodeName);
    if (version >= ORT_API_VERSION_PARALLEL_FOR) {
        BIND(KernelContext_ParallelFor);
    }
    pick_reductions();
    int index = 0;
    for (int code = 0; code < BN_OP_COUNT; ++code) { /* the steps and convolution gradients: float32 only */
        const int pairs = is_step(code) || is_conv(code) ? 1 : BN_TYPE_PAIR_COUNT;
        for (int pair = 0; pair < pairs; ++pair) {
            define(&native_ops[index++], code, bn_type_pairs[pair][0], bn_type_pairs[pair][1]);
        }
    }
    bound_version = version;
}

uint32_t bnfuse_bind_ort(const bnfuse_ort_api_base *base) {
    once_base = base;
    pthread_once(&once, bind_once);
    return bound_version;
}

/* A status from the oldest table every runtime has (for a runtime too old for the rest). */
static ort_status oldest_api_status(const bnfuse_ort_api_base *base, const char *message) {
    const void *const *table = base ? base->GetApi(1) : NULL;
    if (table == NULL) {
        return NULL;
    }
    ort_status (*create_status)(int, const char *) = (ort_status(*)(int, const char *))table[ORT_API_CreateStatus];
    return create_status(ORT_FAIL, message);
}

BNFUSE_EXPORT ort_status RegisterCustomOps(void *session_options, const bnfuse_ort_api_base *api_base) {
    if (bnfuse_bind_ort(api_base) == 0) {
        return oldest_api_status(api_base, "bnfuse custom ops need onnxruntime C API version 16 (onnxruntime >= 1.16)");
    }
    void *domain = NULL;
    int with_native = 1, python_ran = 0;
    BN_TRY(ort.CreateCustomOpDomain(BN_DOMAIN, &domain));
    /* nothing without bnfuse's Python side */
    BN_TRY(bnfuse_python_register(session_options, api_base, domain, &with_native, &python_ran));
    for (int i = 0; i < NATIVE_OP_COUNT; ++i) {
        const int code = native_ops[i].code;
        /* the convolution gradients: the Python side's own kernels where it ran; the BN ops: unless it asked */
        const int wanted = is_conv(code) ? !python_ran : (is_step(code) || with_native);
        if (wanted) {
            BN_TRY(ort.CustomOpDomain_Add(domain, &native_ops[i].base));
        }
    }
    /* the domain stays alive for the process: sessions made from these options point into it */
    return ort.AddCustomOpDomain(session_options, domain);
}

/* How many native kernel calls onnxruntime has made in this process (tests prove the native path ran). */
BNFUSE_EXPORT int64_t bnfuse_native_calls(void) { return __atomic_load_n(&native_calls, __ATOMIC_RELAXED); }
