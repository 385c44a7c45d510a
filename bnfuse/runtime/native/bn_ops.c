/* BatchNormalizationInference / Training / Grad on the CPU: attributes read and validated when onnxruntime creates
 * the kernel (the semantics of bnfuse/runtime/semantics.py, the messages of ops.parse_config), shapes checked on
 * every call, then the serial kernels (cpuserial.c) below BN_POOL_FROM_BYTES of X and the pooled loops
 * (bn_pooled.c) from there. float16 data or parameters are converted at the edges: the kernels compute on float32
 * data and float64 parameters, as cpu.py does. */
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

#include "bn_pooled.h"
#include "native_ops.h"

enum { BN_INPUTS = 5, BN_Y_INPUT = 5, BN_MAX_OUTPUTS = 6 };

typedef struct {
    bn_label label;
    const bn_native_op *op;
    int per_activation;
    int64_t axis, flags;
    double epsilon, weight;
} bn_kernel;

static const char *const conventions[][2] = {
    {"onnx", "onnx"}, {"pytorch", "pytorch"}, {"cudnn", "cudnn"}, {"mxnet", "onnx"}, {"mindspore", "pytorch"}};

/* Every attribute the op's schema lists, in its order (type errors first, as ops.parse_config), then the checks of
 * semantics.BatchNormConfig. */
static ort_status parse(const bn_native_op *op, const void *info, bn_kernel *k) {
    const bn_op_schema *schema = op->schema;
    const char *name = schema->name;
    float epsilon = 0.0f, momentum = 0.0f;
    int64_t flag_values[3] = {0, 0, 0};
    char mode[32] = "spatial", convention[32] = "onnx", activation[32] = "none";
    static const char *const flag_names[3] = {"unbiased_running_var", "fix_gamma", "use_global_stats"};
    static const int64_t flag_bits[3] = {UNBIASED, FIX_GAMMA, GLOBAL_STATS};
    k->axis = 1;
    for (int a = 0; a < schema->attributes; ++a) {
        const bn_attribute_schema *attr = &schema->attribute[a];
        if (strcmp(attr->name, "epsilon") == 0) {
            BN_TRY(bn_attr_float(info, &k->label, attr->name, (float)attr->real, &epsilon));
        } else if (strcmp(attr->name, "momentum") == 0) {
            BN_TRY(bn_attr_float(info, &k->label, attr->name, (float)attr->real, &momentum));
        } else if (strcmp(attr->name, "axis") == 0) {
            BN_TRY(bn_attr_int(info, &k->label, attr->name, attr->integer, &k->axis));
        } else if (strcmp(attr->name, "mode") == 0) {
            BN_TRY(bn_attr_string(info, &k->label, attr->name, attr->text, mode, sizeof mode));
        } else if (strcmp(attr->name, "momentum_convention") == 0) {
            BN_TRY(bn_attr_string(info, &k->label, attr->name, attr->text, convention, sizeof convention));
        } else if (strcmp(attr->name, "activation") == 0) {
            BN_TRY(bn_attr_string(info, &k->label, attr->name, attr->text, activation, sizeof activation));
        } else {
            for (int f = 0; f < 3; ++f) {
                if (strcmp(attr->name, flag_names[f]) == 0) {
                    BN_TRY(bn_attr_int(info, &k->label, attr->name, attr->integer, &flag_values[f]));
                }
            }
        }
    }
    for (int f = 0; f < 3; ++f) {
        if (flag_values[f] != 0 && flag_values[f] != 1) {
            return bn_status(ORT_INVALID_ARGUMENT, "%s: attribute %s must be 0 or 1, got %lld", name, flag_names[f],
                             (long long)flag_values[f]);
        }
        k->flags |= flag_values[f] ? flag_bits[f] : 0;
    }
    if (strcasecmp(mode, "spatial") != 0 && strcasecmp(mode, "per_activation") != 0) {
        return bn_status(ORT_INVALID_ARGUMENT, "%s: attribute mode must be 'spatial' or 'per_activation', got '%s'",
                         name, mode);
    }
    k->per_activation = strcasecmp(mode, "per_activation") == 0;
    const char *family = NULL;
    for (size_t c = 0; c < sizeof conventions / sizeof conventions[0]; ++c) {
        if (strcasecmp(convention, conventions[c][0]) == 0) {
            family = conventions[c][1];
        }
    }
    if (family == NULL) {
        return bn_status(ORT_INVALID_ARGUMENT,
                         "%s: unknown momentum convention '%s' (expected one of onnx, pytorch, cudnn, mxnet, mindspore)",
                         name, convention);
    }
    if (strcmp(activation, "none") != 0 && strcmp(activation, "relu") != 0) {
        return bn_status(ORT_INVALID_ARGUMENT, "%s: activation must be 'none' or 'relu', got '%s'", name, activation);
    }
    k->flags |= strcmp(activation, "relu") == 0 ? RELU : 0;
    if (op->code == BN_OP_BATCH_NORMALIZATION_INFERENCE) {
        /* not an attribute of the op, but looked up by name: a fused activation silently dropped gives wrong outputs */
        char given[32];
        BN_TRY(bn_attr_string(info, &k->label, "activation", "none", given, sizeof given));
        if (strcmp(given, "none") != 0) {
            return bn_status(ORT_INVALID_ARGUMENT,
                             "%s: has no attribute activation (fold BN into the preceding op instead)", name);
        }
    }
    char shown[64];
    bn_format_real(epsilon, shown, sizeof shown);
    if (!(isfinite(epsilon) && epsilon > 0.0f)) {
        return bn_status(ORT_INVALID_ARGUMENT, "%s: epsilon must be > 0, got %s", name, shown);
    }
    if (strcasecmp(convention, "mindspore") == 0 && epsilon > 1.0f) {
        return bn_status(ORT_INVALID_ARGUMENT, "%s: epsilon must be in (0, 1] (MindSpore's range), got %s", name, shown);
    }
    if (!(momentum >= 0.0f && momentum <= 1.0f)) {
        bn_format_real(momentum, shown, sizeof shown);
        return bn_status(ORT_INVALID_ARGUMENT, "%s: momentum must be in [0, 1], got %s", name, shown);
    }
    k->epsilon = (double)epsilon;
    k->weight = strcmp(family, "onnx") == 0 ? 1.0 - (double)momentum : (double)momentum;
    if (op->code == BN_OP_BATCH_NORMALIZATION_GRAD && !(k->flags & RELU)) {
        size_t inputs = 0;
        BN_TRY(ort.KernelInfo_GetInputCount(info, &inputs));
        if (inputs > BN_INPUTS) {
            return bn_status(ORT_INVALID_ARGUMENT, "%s: input Y goes with activation \"relu\" only (activation: none)",
                             name);
        }
    }
    return NULL;
}

ort_status bn_create(const bn_native_op *op, const void *info, void **kernel) {
    bn_kernel *k = calloc(1, sizeof *k);
    if (k == NULL) {
        return bn_status(ORT_FAIL, "%s: out of memory", op->schema->name);
    }
    k->op = op;
    k->label.op = op->schema->name;
    bn_read_node_name(info, &k->label);
    ort_status status = parse(op, info, k);
    if (status != NULL) {
        free(k);
        return status;
    }
    *kernel = k;
    return NULL;
}

/* -- one call ----------------------------------------------------------------------------------------------- */

typedef struct {
    void *data[BN_INPUTS + 1];
    int present[BN_INPUTS + 1]; /* given: an empty tensor (a rank's empty share of a batch) has no data pointer */
    bn_shape shape[BN_INPUTS + 1];
    bn_shape x, params;
    dims d;
    int64_t count; /* elements of X */
} bn_call;

/* X's layout and the parameters' shape (semantics.channel_axis / param_shape), or the error ops._check_shapes gives */
static ort_status layout(const bn_kernel *k, bn_call *call) {
    const bn_shape *x = &call->x;
    const char *name = k->label.op;
    char shown[160]; /* X's shape, for the messages only */
    if (x->rank < 2 || x->rank > 8) {
        bn_format_shape(x, shown, sizeof shown);
        return bn_status(ORT_RUNTIME_EXCEPTION, "%s: X has shape %s: input rank must be 2 to 8, got %zu", name, shown,
                         x->rank);
    }
    const int64_t rank = (int64_t)x->rank, axis = k->axis < 0 ? k->axis + rank : k->axis;
    if (axis <= 0 || axis >= rank) {
        bn_format_shape(x, shown, sizeof shown);
        return bn_status(ORT_RUNTIME_EXCEPTION,
                         "%s: X has shape %s: channel axis %lld is out of range for rank %lld (batch is axis 0)", name,
                         shown, (long long)k->axis, (long long)rank);
    }
    dims d = {1, 1, 1};
    if (k->per_activation) {
        d.outer = x->dims[0];
        call->params.rank = x->rank - 1;
        for (int64_t i = 1; i < rank; ++i) {
            d.channels *= x->dims[i];
            call->params.dims[i - 1] = x->dims[i];
        }
    } else {
        for (int64_t i = 0; i < rank; ++i) {
            if (i < axis) {
                d.outer *= x->dims[i];
            } else if (i > axis) {
                d.inner *= x->dims[i];
            }
        }
        d.channels = x->dims[axis];
        call->params.rank = 1;
        call->params.dims[0] = d.channels;
    }
    call->d = d;
    call->count = bn_element_count(x);
    return NULL;
}

static ort_status read_inputs(const bn_kernel *k, void *context, bn_call *call) {
    const bn_op_schema *schema = k->op->schema;
    const int grad = k->op->code == BN_OP_BATCH_NORMALIZATION_GRAD;
    size_t count = 0;
    BN_TRY(ort.KernelContext_GetInputCount(context, &count));
    for (int i = 0; i < schema->inputs; ++i) {
        int type = 0;
        if ((size_t)i < count) {
            BN_TRY(bn_read_input(context, (size_t)i, &call->data[i], &type, &call->shape[i]));
        }
        /* no input of these ops is a scalar: a given tensor has dimensions, also an empty one (no data pointer) */
        call->present[i] = call->data[i] != NULL || call->shape[i].rank > 0;
        if (!call->present[i] && !schema->input[i].optional) {
            return bn_status(ORT_RUNTIME_EXCEPTION, "%s: input %s is missing", k->label.op, schema->input[i].name);
        }
    }
    call->x = call->shape[grad ? 1 : 0];
    BN_TRY(layout(k, call));
    for (int i = 0; i < schema->inputs; ++i) {
        const bn_shape *wanted = schema->input[i].data ? &call->x : &call->params;
        if (call->present[i] && !bn_same_shape(&call->shape[i], wanted)) {
            char got[160], expected[160], x[160];
            bn_format_shape(&call->shape[i], got, sizeof got);
            bn_format_shape(wanted, expected, sizeof expected);
            bn_format_shape(&call->x, x, sizeof x);
            return bn_status(ORT_RUNTIME_EXCEPTION, "%s: %s has shape %s, expected %s (mode %s, axis %lld, X shape %s)",
                             k->label.op, schema->input[i].name, got, expected,
                             k->per_activation ? "per_activation" : "spatial", (long long)k->axis, x);
        }
    }
    if (grad && call->present[BN_Y_INPUT] != ((k->flags & RELU) != 0)) {
        return bn_status(ORT_RUNTIME_EXCEPTION, "%s: input Y goes with activation \"relu\" only (activation: '%s')",
                         k->label.op, (k->flags & RELU) ? "relu" : "none");
    }
    return NULL;
}

/* -- float16 edges ------------------------------------------------------------------------------------------ */

static void to_float(const void *from, int type, float *to, int64_t n) {
    for (int64_t i = 0; i < n; ++i) {
        to[i] = type == ORT_TYPE_FLOAT ? ((const float *)from)[i] : bn_half_to_float(((const uint16_t *)from)[i]);
    }
}

static void to_double(const void *from, int type, double *to, int64_t n) {
    for (int64_t i = 0; i < n; ++i) {
        to[i] = type == ORT_TYPE_FLOAT ? (double)((const float *)from)[i]
                                       : (double)bn_half_to_float(((const uint16_t *)from)[i]);
    }
}

static void from_double(const double *from, int type, void *to, int64_t n) {
    for (int64_t i = 0; i < n; ++i) {
        if (type == ORT_TYPE_FLOAT) {
            ((float *)to)[i] = (float)from[i];
        } else {
            ((uint16_t *)to)[i] = bn_double_to_half(from[i]);
        }
    }
}

static void from_float(const float *from, uint16_t *to, int64_t n) {
    for (int64_t i = 0; i < n; ++i) {
        to[i] = bn_float_to_half(from[i]);
    }
}

/* -- compute -------------------------------------------------------------------------------------------------- */

/* Outputs on an empty batch (ops._empty_batch): running statistics passed through, every other one zero. */
static void empty_batch(const bn_kernel *k, const bn_call *call, void **outputs, int count) {
    const int64_t n = bn_element_count(&call->params);
    const size_t size = k->op->param_type == ORT_TYPE_FLOAT ? 4 : 2;
    for (int o = 1; o < count; ++o) {
        if (outputs[o] == NULL) {
            continue;
        }
        const int running = k->op->code == BN_OP_BATCH_NORMALIZATION_TRAINING && o <= 2;
        if (running && n > 0) {
            memcpy(outputs[o], call->data[2 + o], (size_t)n * size);
        } else {
            memset(outputs[o], 0, (size_t)n * size);
        }
    }
}

static ort_status run(const bn_kernel *k, void *context, const bn_call *call, void **outputs, int output_count) {
    const bn_native_op *op = k->op;
    const int grad = op->code == BN_OP_BATCH_NORMALIZATION_GRAD, half_data = op->data_type != ORT_TYPE_FLOAT;
    const int64_t n = call->d.channels, count = call->count;
    const int data_inputs = grad ? 2 : 1, params = grad ? 3 : 4, with_y = grad && (k->flags & RELU);
    /* scratch: the float32 data (16-bit inputs and the data output), the float64 parameters and per-channel outputs */
    const size_t floats = half_data ? (size_t)count * (size_t)(data_inputs + with_y + 1) : 0;
    char *scratch = malloc(floats * sizeof(float) + (size_t)(params + 5) * (size_t)n * sizeof(double) + 16);
    if (scratch == NULL) {
        return bn_status(ORT_FAIL, "%s: out of memory", k->label.op);
    }
    double *p = (double *)scratch, *out = p + (size_t)params * (size_t)n;
    float *f = (float *)(out + 5 * (size_t)n);
    const float *x[3] = {NULL, NULL, NULL}; /* the data inputs, then Y */
    for (int i = 0; i < data_inputs + with_y; ++i) {
        const void *given = call->data[i < data_inputs ? i : BN_Y_INPUT];
        if (half_data) {
            to_float(given, op->data_type, f + (size_t)i * (size_t)count, count);
            x[i] = f + (size_t)i * (size_t)count;
        } else {
            x[i] = given;
        }
    }
    float *y = half_data ? f + (size_t)(data_inputs + with_y) * (size_t)count : outputs[0];
    for (int i = 0; i < params; ++i) {
        to_double(call->data[data_inputs + i], op->param_type, p + (size_t)i * (size_t)n, n);
    }
    const int pooled = count * 4 >= BN_POOL_FROM_BYTES;
    ort_status status = NULL;
    int failed = 0;
    const dims d = call->d;
    if (op->code == BN_OP_BATCH_NORMALIZATION_INFERENCE) {
        const int fix_gamma = 0; /* Inference reads no fix_gamma (ops.ATTRIBUTES) */
        if (pooled) {
            status = bn_pooled_inference(context, x[0], d, p, p + n, p + 2 * n, p + 3 * n, k->epsilon, fix_gamma, y);
        } else {
            failed = serial_inference(x[0], d, p, p + n, p + 2 * n, p + 3 * n, k->epsilon, fix_gamma, 1.0, 0.0, y);
        }
    } else if (!grad) {
        double *batch_var = output_count > 5 && outputs[5] != NULL ? out + 4 * n : NULL;
        if (pooled) {
            status = bn_pooled_training(context, x[0], d, p, p + n, p + 2 * n, p + 3 * n, k->epsilon, k->weight,
                                        k->flags, y, out, out + n, out + 2 * n, out + 3 * n, batch_var);
        } else {
            failed = serial_training(x[0], d, p, p + n, p + 2 * n, p + 3 * n, k->epsilon, k->weight, k->flags, 1.0, 0.0,
                                     y, out, out + n, out + 2 * n, out + 3 * n, batch_var);
        }
    } else {
        const float *masked_by = with_y ? x[2] : x[0];
        if (pooled) {
            status = bn_pooled_backward(context, x[0], x[1], d, p, p + n, p + 2 * n, k->flags, masked_by, y, out,
                                        out + n);
        } else {
            failed = serial_backward(x[0], x[1], d, p, p + n, p + 2 * n, k->flags, 1.0, 0.0, masked_by, y, out,
                                     out + n);
        }
    }
    if (status == NULL && failed) {
        status = bn_status(ORT_FAIL, "%s: out of memory", k->label.op);
    }
    if (status == NULL) {
        if (half_data) {
            from_float(y, outputs[0], count);
        }
        for (int o = 1; o < output_count; ++o) {
            if (outputs[o] != NULL) {
                from_double(out + (size_t)(o - 1) * (size_t)n, op->param_type, outputs[o], n);
            }
        }
    }
    free(scratch);
    return status;
}

ort_status bn_compute(void *kernel, void *context) {
    const bn_kernel *k = kernel;
    bn_call call;
    memset(&call, 0, sizeof call);
    BN_TRY(read_inputs(k, context, &call));
    size_t wanted = 0;
    BN_TRY(ort.KernelContext_GetOutputCount(context, &wanted));
    const int output_count = (int)(wanted < (size_t)k->op->schema->outputs ? wanted : (size_t)k->op->schema->outputs);
    void *outputs[BN_MAX_OUTPUTS] = {NULL};
    for (int o = 0; o < output_count; ++o) {
        BN_TRY(bn_make_output(context, (size_t)o, o == 0 ? &call.x : &call.params, &outputs[o]));
    }
    /* the data output is always there for the kernels to write: scratch where the graph drops it */
    void *dropped = NULL;
    if (outputs[0] == NULL && call.count > 0) {
        outputs[0] = dropped = malloc((size_t)call.count * sizeof(float));
        if (dropped == NULL) {
            return bn_status(ORT_FAIL, "%s: out of memory", k->label.op);
        }
    }
    ort_status status = NULL;
    double *missing = NULL; /* Training's running statistics etc. the graph drops still get computed */
    if (call.count == 0) {
        empty_batch(k, &call, outputs, output_count);
    } else {
        const int64_t n = call.d.channels;
        for (int o = 1; o < output_count && o < 5; ++o) {
            if (outputs[o] == NULL) {
                if (missing == NULL && (missing = malloc(4 * (size_t)(n ? n : 1) * sizeof(double))) == NULL) {
                    free(dropped);
                    return bn_status(ORT_FAIL, "%s: out of memory", k->label.op);
                }
                outputs[o] = missing + (size_t)(o - 1) * (size_t)n; /* wide enough for either parameter type */
            }
        }
        status = run(k, context, &call, outputs, output_count);
    }
    free(missing);
    free(dropped);
    return status;
}
