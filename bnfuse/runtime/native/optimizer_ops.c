/* SGDStep and AdamStep (bnfuse/runtime/optimizer_ops.py describes them): every parameter of a training graph updated
 * by one node. Attributes read and checked when onnxruntime creates the kernel; the work cut into chunks run on
 * onnxruntime's intra-op pool. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "native_ops.h"

/* One node: its head {SGD: momentum, nesterov, 0 | Adam: beta1, beta2, epsilon} and per parameter its weight decay
 * and learning-rate multiplier. */
typedef struct {
    bn_label label;
    int op; /* BN_OP_SGD_STEP / BN_OP_ADAM_STEP */
    double hyper[3];
    size_t parameters;
    float *decays, *scales;
} step_kernel;

typedef step_kernel bnfuse_plan;
#define BNFUSE_ADAM BN_OP_ADAM_STEP


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

/* -- creating a node's kernel (optimizer_ops.parse_config) ------------------------------------------------- */

static ort_status parse(const bn_native_op *op, const void *info, step_kernel *k) {
    const char *name = op->schema->name;
    size_t decays = 0, scales = 0;
    BN_TRY(bn_attr_floats(info, &k->label, "weight_decays", &k->decays, &decays));
    BN_TRY(bn_attr_floats(info, &k->label, "lr_scales", &k->scales, &scales));
    if (decays == 0 || decays != scales) {
        return bn_status(ORT_INVALID_ARGUMENT,
                         "%s: weight_decays and lr_scales need one value per parameter, got %zu and %zu", name, decays,
                         scales);
    }
    for (size_t i = 0; i < decays; ++i) {
        if (!(k->decays[i] >= 0.0f)) {
            return bn_status(ORT_INVALID_ARGUMENT, "%s: weight_decays must be >= 0", name);
        }
    }
    k->parameters = decays;
    const bn_attribute_schema *attr = op->schema->attribute;
    if (op->code == BN_OP_SGD_STEP) {
        float momentum = 0.0f;
        int64_t nesterov = 0;
        BN_TRY(bn_attr_float(info, &k->label, "momentum", (float)attr[0].real, &momentum));
        BN_TRY(bn_attr_int(info, &k->label, "nesterov", attr[1].integer, &nesterov));
        if (!(momentum >= 0.0f) || (nesterov != 0 && nesterov != 1) || (nesterov && momentum == 0.0f)) {
            return bn_status(ORT_INVALID_ARGUMENT,
                             "%s: momentum must be >= 0 and nesterov 0 or 1 (1 needs momentum > 0)", name);
        }
        k->hyper[0] = momentum;
        k->hyper[1] = (double)nesterov;
        return NULL;
    }
    float head[3];
    for (int i = 0; i < 3; ++i) {
        BN_TRY(bn_attr_float(info, &k->label, attr[i].name, (float)attr[i].real, &head[i]));
        k->hyper[i] = head[i];
    }
    if (!(head[0] >= 0.0f && head[0] < 1.0f && head[1] >= 0.0f && head[1] < 1.0f) || !(head[2] > 0.0f)) {
        char shown[3][64];
        for (int i = 0; i < 3; ++i) {
            bn_format_real(head[i], shown[i], sizeof shown[i]);
        }
        return bn_status(ORT_INVALID_ARGUMENT, "%s: needs 0 <= beta1, beta2 < 1 and epsilon > 0, got (%s, %s, %s)",
                         name, shown[0], shown[1], shown[2]);
    }
    return NULL;
}

static void destroy(step_kernel *k) {
    free(k->decays);
    free(k->scales);
    free(k);
}

ort_status step_create(const bn_native_op *op, const void *info, void **kernel) {
    step_kernel *k = calloc(1, sizeof *k);
    if (k == NULL) {
        return bn_status(ORT_FAIL, "%s: out of memory", op->schema->name);
    }
    k->op = op->code;
    k->label.op = op->schema->name;
    bn_read_node_name(info, &k->label);
    ort_status status = parse(op, info, k);
    if (status != NULL) {
        destroy(k);
        return status;
    }
    *kernel = k;
    return NULL;
}

void step_destroy(void *kernel) {
    if (kernel != NULL) {
        destroy(kernel);
    }
}

/* -- one call ------------------------------------------------------------------------------------------------ */

/* Reads one parameter's float32 inputs (param, grad, state...) and has onnxruntime allocate its outputs (scratch
 * where the graph drops one, in *spare). */
static ort_status bind_parameter(const step_kernel *k, void *context, size_t index, size_t lead, size_t states,
                                 float lr, bnfuse_parameter *a, float **spare) {
    const float *given[4] = {0};
    float *made[3] = {0};
    bn_shape shape, own;
    const size_t per_input = 2 + states, per_output = 1 + states;
    for (size_t j = 0; j < per_input; ++j) {
        int type = 0;
        BN_TRY(bn_read_input(context, lead + index * per_input + j, (void **)&given[j], &type, j ? &own : &shape));
        if (given[j] == NULL || type != ORT_TYPE_FLOAT) {
            return bn_status(ORT_RUNTIME_EXCEPTION, "%s node '%s': parameter %zu's input %zu is missing or not float32",
                             k->label.op, k->label.node, index, j);
        }
        if (j && !bn_same_shape(&own, &shape)) {
            char wanted[160], got[160];
            bn_format_shape(&shape, wanted, sizeof wanted);
            bn_format_shape(&own, got, sizeof got);
            return bn_status(ORT_RUNTIME_EXCEPTION,
                             "%s node '%s': parameter %zu's gradient and state must have its shape %s, got %s",
                             k->label.op, k->label.node, index, wanted, got);
        }
    }
    const size_t count = (size_t)bn_element_count(&shape);
    for (size_t j = 0; j < per_output; ++j) {
        BN_TRY(bn_make_output(context, index * per_output + j, &shape, (void **)&made[j]));
        if (made[j] == NULL) { /* an output the graph drops */
            made[j] = spare[j] = malloc((count ? count : 1) * sizeof(float));
            if (made[j] == NULL) {
                return bn_status(ORT_FAIL, "%s: out of memory", k->label.op);
            }
        }
    }
    const float scale = k->scales[index];
    *a = (bnfuse_parameter){given[0], given[1], given[2], given[3], made[0], made[1], made[2], k->decays[index],
                            scale == 1.0f ? lr : lr * scale, count};
    return NULL;
}

/* inputs {SGD: lr | Adam: step_size, root} then per parameter (param, grad, state...); outputs per parameter (new
 * param, new state...), all float32 */
static ort_status run_step(const step_kernel *k, void *context, bnfuse_step_job *job, float **spare) {
    const int adam = k->op == BN_OP_ADAM_STEP;
    const size_t states = adam ? 2 : (k->hyper[0] != 0.0 ? 1 : 0), lead = adam ? 2 : 1;
    size_t inputs = 0, outputs = 0;
    BN_TRY(ort.KernelContext_GetInputCount(context, &inputs));
    BN_TRY(ort.KernelContext_GetOutputCount(context, &outputs));
    if (inputs != lead + (2 + states) * k->parameters) {
        return bn_status(ORT_RUNTIME_EXCEPTION,
                         "%s node '%s': %zu inputs, expected %zu (%zu scalar(s), then %zu per parameter for %zu "
                         "parameters)",
                         k->label.op, k->label.node, inputs, lead + (2 + states) * k->parameters, lead, 2 + states,
                         k->parameters);
    }
    if (outputs != (1 + states) * k->parameters) {
        return bn_status(ORT_RUNTIME_EXCEPTION, "%s node '%s': %zu outputs, expected %zu", k->label.op, k->label.node,
                         outputs, (1 + states) * k->parameters);
    }
    float scalars[2] = {0.0f, 0.0f};
    for (size_t j = 0; j < lead; ++j) {
        bn_shape shape;
        void *data = NULL;
        int type = 0;
        BN_TRY(bn_read_input(context, j, &data, &type, &shape));
        if (data == NULL || type != ORT_TYPE_FLOAT || bn_element_count(&shape) != 1) {
            return bn_status(ORT_RUNTIME_EXCEPTION, "%s node '%s': the first %zu input(s) must be float32 scalars",
                             k->label.op, k->label.node, lead);
        }
        scalars[j] = *(const float *)data;
    }
    job->root = scalars[1];
    size_t chunks = 0;
    for (size_t i = 0; i < k->parameters; ++i) {
        BN_TRY(bind_parameter(k, context, i, lead, states, scalars[0], &job->parameters[i], spare + 3 * i));
        chunks += (job->parameters[i].count + BNFUSE_CHUNK - 1) / BNFUSE_CHUNK;
    }
    job->chunk_parameter = malloc(sizeof(size_t) * (chunks + 1));
    job->chunk_begin = malloc(sizeof(size_t) * (chunks + 1));
    if (job->chunk_parameter == NULL || job->chunk_begin == NULL) {
        return bn_status(ORT_FAIL, "%s: out of memory", k->label.op);
    }
    size_t chunk = 0;
    for (size_t i = 0; i < k->parameters; ++i) {
        for (size_t begin = 0; begin < job->parameters[i].count; begin += BNFUSE_CHUNK, ++chunk) {
            job->chunk_parameter[chunk] = i;
            job->chunk_begin[chunk] = begin;
        }
    }
    return bn_run_tasks(context, run_step_chunk, job, chunks);
}

ort_status step_compute(void *kernel, void *context) {
    const step_kernel *k = kernel;
    bnfuse_step_job job = {k, calloc(k->parameters + 1, sizeof(bnfuse_parameter)), NULL, NULL, 0.0f};
    float **spare = calloc(3 * k->parameters + 1, sizeof(float *));
    ort_status status = job.parameters == NULL || spare == NULL ? bn_status(ORT_FAIL, "%s: out of memory", k->label.op)
                                                                : run_step(k, context, &job, spare);
    for (size_t i = 0; spare != NULL && i < 3 * k->parameters; ++i) {
        free(spare[i]);
    }
    free(spare);
    free(job.parameters);
    free(job.chunk_parameter);
    free(job.chunk_begin);
    return status;
}
