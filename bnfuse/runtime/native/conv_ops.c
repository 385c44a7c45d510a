/* ConvWeightGrad and ConvInputGrad (bnfuse/runtime/conv_grad.py, conv_input_grad.py describe them) on the oneDNN
 * core (onednn_conv.h), for hosts without bnfuse's Python side: where that side is in the process, it registers its
 * own kernels of these ops (the same core, with TrainingSession's thread count), and these are left out.
 *
 * oneDNN is found when the first kernel is created: BNFUSE_ONEDNN_LIBRARY (a path), else the onednn-cpu-gomp wheel's
 * libdnnl.so.3 in the lib directory of the Python prefix this library is installed under, else in $VIRTUAL_ENV/lib or
 * $CONDA_PREFIX/lib, else the dynamic loader's
 * libdnnl.so.3 (a system install). Without it, creating the kernel fails with one message saying so.
 *
 * Threads: the gradients split their work into chunks fixed by the shape and a thread count (the bits of a
 * batch-split weight gradient depend on it), run on onnxruntime's intra-op pool. The count is BNFUSE_ONEDNN_THREADS
 * (default 1, conv_grad.DEFAULT_THREADS); set it to the session's intra_op_num_threads for TrainingSession's bits. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "native_ops.h"
#include "onednn_conv.h"

typedef struct {
    bn_label label;
    int input_grad;
    int spatial;
    int64_t kernel[3], stride[3], dilation[3], pads[6], output[3], group, x_block;
} conv_kernel;

static pthread_once_t load_once = PTHREAD_ONCE_INIT;
static char load_error[512];
static int loaded = 0, threads = 1;

/* <prefix>/lib/libdnnl.so.3 for this library at <prefix>/lib/pythonX.Y/site-packages/bnfuse/runtime/ */
static int wheel_library(char *path, size_t size) {
    Dl_info info;
    if (dladdr((void *)&wheel_library, &info) == 0 || info.dli_fname == NULL) {
        return 0;
    }
    snprintf(path, size, "%s", info.dli_fname);
    for (int up = 0; up < 5; ++up) { /* the file, then runtime, bnfuse, site-packages, pythonX.Y */
        char *slash = strrchr(path, '/');
        if (slash == NULL) {
            return 0;
        }
        *slash = '\0';
    }
    const size_t used = strlen(path);
    snprintf(path + used, size - used, "/libdnnl.so.3");
    return access(path, R_OK) == 0;
}

/* <prefix>/lib/libdnnl.so.3 of the active virtual environment or conda prefix (an editable install keeps this
 * library in the source tree, away from the prefix the wheel installed oneDNN into) */
static int environment_library(char *path, size_t size) {
    const char *prefixes[] = {getenv("VIRTUAL_ENV"), getenv("CONDA_PREFIX")};
    for (size_t i = 0; i < sizeof prefixes / sizeof *prefixes; ++i) {
        if (prefixes[i] != NULL && prefixes[i][0] != '\0') {
            snprintf(path, size, "%s/lib/libdnnl.so.3", prefixes[i]);
            if (access(path, R_OK) == 0) {
                return 1;
            }
        }
    }
    return 0;
}

static void load(void) {
    char wheel[4096];
    const char *path = NULL; /* the core's search: BNFUSE_ONEDNN_LIBRARY, then the dynamic loader's */
    const char *chosen = getenv("BNFUSE_ONEDNN_LIBRARY");
    if ((chosen == NULL || chosen[0] == '\0') &&
        (wheel_library(wheel, sizeof wheel) || environment_library(wheel, sizeof wheel))) {
        path = wheel;
    }
    loaded = bnfuse_onednn_load(path, load_error, sizeof load_error) == BNFUSE_ONEDNN_OK;
    const char *count = getenv("BNFUSE_ONEDNN_THREADS");
    threads = count != NULL && atoi(count) >= 1 ? atoi(count) : 1;
}

static ort_status read_list(const void *info, conv_kernel *k, const char *name, int64_t *out, size_t wanted,
                            int64_t fallback, int64_t minimum) {
    size_t count = 0;
    BN_TRY(bn_attr_ints(info, &k->label, name, out, 6, &count));
    if (count == 0) {
        for (size_t i = 0; i < wanted; ++i) {
            out[i] = fallback;
        }
        return NULL;
    }
    for (size_t i = 0; i < count; ++i) {
        if (out[i] < minimum) {
            count = 0; /* reported below */
        }
    }
    if (count != wanted) {
        return bn_status(ORT_INVALID_ARGUMENT, "%s: %s must be %zu values >= %lld (node '%s')", k->label.op, name,
                         wanted, (long long)minimum, k->label.node);
    }
    return NULL;
}

static ort_status parse(const void *info, conv_kernel *k) {
    const char *name = k->label.op;
    size_t count = 0;
    BN_TRY(bn_attr_ints(info, &k->label, "kernel_shape", k->kernel, 3, &count));
    if (count < 1) {
        return bn_status(ORT_INVALID_ARGUMENT, "%s: attribute kernel_shape is required (node '%s')", name,
                         k->label.node);
    }
    k->spatial = (int)count;
    const size_t spatial = count;
    BN_TRY(read_list(info, k, "strides", k->stride, spatial, 1, 1));
    BN_TRY(read_list(info, k, "dilations", k->dilation, spatial, 1, 1));
    BN_TRY(read_list(info, k, "pads", k->pads, 2 * spatial, 0, 0));
    BN_TRY(bn_attr_int(info, &k->label, "group", 1, &k->group));
    if (k->input_grad) {
        BN_TRY(bn_attr_ints(info, &k->label, "output_shape", k->output, 3, &count));
        if (count != spatial) {
            return bn_status(ORT_INVALID_ARGUMENT,
                             "%s: attributes kernel_shape and output_shape (dX's spatial shape) are required, of one "
                             "length (node '%s')",
                             name, k->label.node);
        }
    } else {
        BN_TRY(bn_attr_int(info, &k->label, "x_block", 0, &k->x_block));
        if (k->x_block != 0 && k->x_block != 8 && k->x_block != 16) {
            return bn_status(ORT_INVALID_ARGUMENT, "%s: x_block must be 0 (plain NCHW X), 8 or 16, got %lld", name,
                             (long long)k->x_block);
        }
    }
    return NULL;
}

ort_status conv_create(const bn_native_op *op, const void *info, void **kernel) {
    pthread_once(&load_once, load);
    if (!loaded) {
        return bn_status(ORT_FAIL,
                         "%s needs oneDNN (libdnnl.so.3, oneDNN 3.2): install bnfuse[cpu] (onednn-cpu-gomp), set "
                         "BNFUSE_ONEDNN_LIBRARY to its path, or install it on the system (%s)",
                         op->schema->name, load_error);
    }
    conv_kernel *k = calloc(1, sizeof *k);
    if (k == NULL) {
        return bn_status(ORT_FAIL, "%s: out of memory", op->schema->name);
    }
    k->label.op = op->schema->name;
    k->input_grad = op->code == BN_OP_CONV_INPUT_GRAD;
    bn_read_node_name(info, &k->label);
    ort_status status = parse(info, k);
    if (status != NULL) {
        free(k);
        return status;
    }
    *kernel = k;
    return NULL;
}

/* onednn_conv.h's parallel-for over KernelContext_ParallelFor */
static int parallel_for(void *pool, void (*task)(void *user, size_t index), void *user, size_t count) {
    ort_status status = bn_run_tasks(pool, task, user, count);
    if (status != NULL) {
        ort.ReleaseStatus(status);
        return 1;
    }
    return 0;
}

ort_status conv_compute(void *kernel, void *context) {
    const conv_kernel *k = kernel;
    void *first = NULL, *second = NULL;
    bn_shape a, b;
    int type_a = 0, type_b = 0;
    BN_TRY(bn_read_input(context, 0, &first, &type_a, &a));
    BN_TRY(bn_read_input(context, 1, &second, &type_b, &b));
    const size_t rank = (size_t)k->spatial + 2;
    if (first == NULL || second == NULL || a.rank != rank || b.rank != rank) {
        return bn_status(ORT_RUNTIME_EXCEPTION, "%s: both inputs must have rank len(kernel_shape) + 2 = %zu (node '%s')",
                         k->label.op, rank, k->label.node);
    }
    /* weight gradient: a = X [N, C, in...], b = dY [N, O, out...]; input gradient: a = dY, b = W [O, C/G, k...] */
    bnfuse_conv_geometry g = {0};
    g.spatial = k->spatial;
    g.batch = a.dims[0];
    g.groups = k->group;
    g.in_channels = k->input_grad ? b.dims[1] * k->group : a.dims[1];
    g.out_channels = k->input_grad ? a.dims[1] : b.dims[1];
    for (int i = 0; i < k->spatial; ++i) {
        g.input[i] = k->input_grad ? k->output[i] : a.dims[2 + i];
        g.output[i] = k->input_grad ? a.dims[2 + i] : b.dims[2 + i];
        g.kernel[i] = k->kernel[i];
        g.stride[i] = k->stride[i];
        g.dilation[i] = k->dilation[i];
        g.pad_begin[i] = k->pads[i];
        g.pad_end[i] = k->pads[k->spatial + i];
    }
    g.x_block = (int)k->x_block;
    char error[512] = "";
    if ((!k->input_grad && a.dims[0] != b.dims[0]) ||
        (k->input_grad && (b.dims[0] != g.out_channels || g.in_channels % k->group))) {
        return bn_status(ORT_RUNTIME_EXCEPTION, "%s: the inputs' batch or channels do not fit (node '%s')", k->label.op,
                         k->label.node);
    }
    if (bnfuse_onednn_check_geometry(&g, error, sizeof error) != BNFUSE_ONEDNN_OK) {
        return bn_status(ORT_RUNTIME_EXCEPTION, "%s: %s (node '%s')", k->label.op, error, k->label.node);
    }
    bn_shape out = {.rank = rank};
    out.dims[0] = k->input_grad ? g.batch : g.out_channels;
    out.dims[1] = k->input_grad ? g.in_channels : g.in_channels / g.groups;
    for (int i = 0; i < k->spatial; ++i) {
        out.dims[2 + i] = k->input_grad ? g.input[i] : g.kernel[i];
    }
    void *result = NULL;
    BN_TRY(bn_make_output(context, 0, &out, &result));
    if (result == NULL || bn_element_count(&out) == 0) {
        return NULL;
    }
    const bnfuse_thread_pool pool = {parallel_for, context, threads};
    const int code = k->input_grad ? bnfuse_onednn_input_grad(&g, first, second, result, &pool, error, sizeof error)
                                   : bnfuse_onednn_weight_grad(&g, first, second, result, &pool, error, sizeof error);
    if (code != BNFUSE_ONEDNN_OK) {
        return bn_status(ORT_RUNTIME_EXCEPTION, "%s: %s (node '%s')", k->label.op, error, k->label.node);
    }
    return NULL;
}
