/* bnfuse.runtime._onednn: the convolution weight gradient (dW) and input gradient (dX) on oneDNN's CPU engine, for
 * the bnfuse ops ConvWeightGrad (bnfuse/runtime/conv_grad.py) and ConvInputGrad (conv_input_grad.py).
 *
 * oneDNN is not linked: load(path) dlopen()s the libdnnl.so.3 of the installed `onednn-cpu-gomp` wheel at run
 * time, so building bnfuse needs neither oneDNN nor its headers, and a process without the wheel never loads
 * it. The declarations below are the few oneDNN 3.x C API prototypes and enum values this file calls, as the
 * public header oneapi/dnnl/dnnl.h (and dnnl_types.h) declares them; oneDNN's C ABI is stable within a major
 * version (soname libdnnl.so.3).
 *
 * A plan is one convolution geometry: a forward primitive descriptor (oneDNN needs it as a hint), the
 * backward-weights primitive with layouts of oneDNN's choosing (blocked, e.g. nChw8c on AVX2) and the reorders
 * between the caller's layout (plain NCHW, or NCHWc blocked input) and those, and a stream of its own. run() binds
 * the caller's buffers and executes with the GIL released.
 *
 * A job splits one gradient over the batch: chunk i runs its own plan (made for one OpenMP thread) on
 * X[n_i : n_i+1] and dY[n_i : n_i+1] into a partial dW (or dY[n_i : n_i+1] and W into dX[n_i : n_i+1]). run_chunk(job, i) is a plain C function: the caller hands
 * it to onnxruntime's intra-op pool (OrtApi KernelContext_ParallelFor), so the chunks run on the threads ORT
 * already has, with no OpenMP worker spinning beside them; the caller adds the partials in chunk order.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <dlfcn.h>
#include <sched.h>
#include <stdint.h>
#include <string.h>

/* -- oneDNN C API declarations (oneapi/dnnl/dnnl.h, dnnl_types.h; oneDNN 3.x) ------------------------- */
enum { DNNL_MAX_NDIMS = 12 };
typedef int64_t dnnl_dims_t[DNNL_MAX_NDIMS];
typedef int dnnl_status_t; /* dnnl_success = 0 */
typedef void *dnnl_engine_t, *dnnl_stream_t, *dnnl_memory_desc_t, *dnnl_primitive_desc_t, *dnnl_primitive_t,
    *dnnl_memory_t, *dnnl_primitive_attr_t;
typedef struct {
    int arg;
    dnnl_memory_t memory;
} dnnl_exec_arg_t;

enum {
    dnnl_f32 = 3,
    dnnl_cpu = 1,
    dnnl_stream_default_flags = 1,
    dnnl_forward_training = 64,
    dnnl_convolution_direct = 1,
    dnnl_format_tag_any = 1,
    dnnl_abc = 4, /* plain tags by rank 3..6 */
    dnnl_abcd = 5,
    dnnl_abcde = 6,
    dnnl_abcdef = 7,
    dnnl_aBc8b = 69, /* channel-blocked tags (NCHWc) by rank 3..5, blocks 8 and 16 */
    dnnl_aBcd8b = 102,
    dnnl_aBcde8b = 142,
    dnnl_aBc16b = 56,
    dnnl_aBcd16b = 78,
    dnnl_aBcde16b = 121,
    dnnl_query_src_md = 129,
    dnnl_query_diff_src_md = 130,
    dnnl_query_weights_md = 131,
    dnnl_query_diff_weights_md = 132,
    dnnl_query_diff_dst_md = 134,
    dnnl_query_scratchpad_md = 136,
    dnnl_scratchpad_mode_user = 1,
    DNNL_ARG_SCRATCHPAD = 80,
    DNNL_ARG_SRC = 1,
    DNNL_ARG_DST = 17,
    DNNL_ARG_WEIGHTS = 33,
    DNNL_ARG_DIFF_SRC = 129,
    DNNL_ARG_DIFF_DST = 145,
    DNNL_ARG_DIFF_WEIGHTS = 161,
};
#define DNNL_MEMORY_ALLOCATE ((void *)(size_t)-1)

static struct {
    void *handle;
    dnnl_engine_t engine;
    dnnl_stream_t stream;
    dnnl_status_t (*engine_create)(dnnl_engine_t *, int, size_t);
    dnnl_status_t (*stream_create)(dnnl_stream_t *, dnnl_engine_t, unsigned);
    dnnl_status_t (*stream_wait)(dnnl_stream_t);
    dnnl_status_t (*stream_destroy)(dnnl_stream_t);
    dnnl_status_t (*memory_desc_create_with_tag)(dnnl_memory_desc_t *, int, const dnnl_dims_t, int, int);
    dnnl_status_t (*memory_desc_destroy)(dnnl_memory_desc_t);
    int (*memory_desc_equal)(const void *, const void *);
    const void *(*primitive_desc_query_md)(const void *, int, int);
    dnnl_status_t (*conv_fwd_pd_create)(dnnl_primitive_desc_t *, dnnl_engine_t, int, int, const void *, const void *,
                                        const void *, const void *, const dnnl_dims_t, const dnnl_dims_t,
                                        const dnnl_dims_t, const dnnl_dims_t, const void *);
    dnnl_status_t (*conv_bwd_weights_pd_create)(dnnl_primitive_desc_t *, dnnl_engine_t, int, const void *,
                                                const void *, const void *, const void *, const dnnl_dims_t,
                                                const dnnl_dims_t, const dnnl_dims_t, const dnnl_dims_t,
                                                const void *, const void *);
    dnnl_status_t (*conv_bwd_data_pd_create)(dnnl_primitive_desc_t *, dnnl_engine_t, int, const void *, const void *,
                                             const void *, const dnnl_dims_t, const dnnl_dims_t, const dnnl_dims_t,
                                             const dnnl_dims_t, const void *, const void *);
    dnnl_status_t (*reorder_pd_create)(dnnl_primitive_desc_t *, const void *, dnnl_engine_t, const void *,
                                       dnnl_engine_t, const void *);
    dnnl_status_t (*primitive_desc_destroy)(dnnl_primitive_desc_t);
    dnnl_status_t (*primitive_create)(dnnl_primitive_t *, const void *);
    dnnl_status_t (*primitive_destroy)(dnnl_primitive_t);
    dnnl_status_t (*primitive_execute)(const void *, dnnl_stream_t, int, const dnnl_exec_arg_t *);
    dnnl_status_t (*memory_create)(dnnl_memory_t *, const void *, dnnl_engine_t, void *);
    dnnl_status_t (*memory_set_data_handle)(dnnl_memory_t, void *);
    dnnl_status_t (*memory_destroy)(dnnl_memory_t);
    size_t (*memory_desc_get_size)(const void *);
    const void *(*version)(void);
    dnnl_status_t (*attr_create)(dnnl_primitive_attr_t *);
    dnnl_status_t (*attr_destroy)(dnnl_primitive_attr_t);
    dnnl_status_t (*attr_set_scratchpad_mode)(dnnl_primitive_attr_t, int);
    /* the OpenMP runtime libdnnl (gomp build) runs on: per-call thread count, restored after the call */
    int (*omp_get_max_threads)(void);
    void (*omp_set_num_threads)(int);
} dnnl;

static int check(dnnl_status_t status, const char *what) {
    if (status != 0) {
        PyErr_Format(PyExc_RuntimeError, "oneDNN %s failed (dnnl_status_t %d)", what, (int)status);
        return -1;
    }
    return 0;
}

#define CHECK(call, what)          \
    do {                           \
        if (check((call), what)) { \
            goto fail;             \
        }                          \
    } while (0)

static PyObject *load(PyObject *self, PyObject *args) {
    const char *path;
    if (!PyArg_ParseTuple(args, "s", &path)) {
        return NULL;
    }
    if (dnnl.handle != NULL) {
        Py_RETURN_NONE;
    }
    void *handle = dlopen(path, RTLD_NOW | RTLD_LOCAL);
    if (handle == NULL) {
        PyErr_Format(PyExc_OSError, "cannot load oneDNN from %s: %s", path, dlerror());
        return NULL;
    }
    struct {
        const char *name;
        void **slot;
    } symbols[] = {
        {"dnnl_engine_create", (void **)&dnnl.engine_create},
        {"dnnl_stream_create", (void **)&dnnl.stream_create},
        {"dnnl_stream_wait", (void **)&dnnl.stream_wait},
        {"dnnl_stream_destroy", (void **)&dnnl.stream_destroy},
        {"dnnl_memory_desc_create_with_tag", (void **)&dnnl.memory_desc_create_with_tag},
        {"dnnl_memory_desc_destroy", (void **)&dnnl.memory_desc_destroy},
        {"dnnl_memory_desc_equal", (void **)&dnnl.memory_desc_equal},
        {"dnnl_primitive_desc_query_md", (void **)&dnnl.primitive_desc_query_md},
        {"dnnl_convolution_forward_primitive_desc_create", (void **)&dnnl.conv_fwd_pd_create},
        {"dnnl_convolution_backward_weights_primitive_desc_create", (void **)&dnnl.conv_bwd_weights_pd_create},
        {"dnnl_convolution_backward_data_primitive_desc_create", (void **)&dnnl.conv_bwd_data_pd_create},
        {"dnnl_reorder_primitive_desc_create", (void **)&dnnl.reorder_pd_create},
        {"dnnl_primitive_desc_destroy", (void **)&dnnl.primitive_desc_destroy},
        {"dnnl_primitive_create", (void **)&dnnl.primitive_create},
        {"dnnl_primitive_destroy", (void **)&dnnl.primitive_destroy},
        {"dnnl_primitive_execute", (void **)&dnnl.primitive_execute},
        {"dnnl_memory_create", (void **)&dnnl.memory_create},
        {"dnnl_memory_set_data_handle", (void **)&dnnl.memory_set_data_handle},
        {"dnnl_memory_destroy", (void **)&dnnl.memory_destroy},
        {"dnnl_memory_desc_get_size", (void **)&dnnl.memory_desc_get_size},
        {"dnnl_version", (void **)&dnnl.version},
        {"dnnl_primitive_attr_create", (void **)&dnnl.attr_create},
        {"dnnl_primitive_attr_destroy", (void **)&dnnl.attr_destroy},
        {"dnnl_primitive_attr_set_scratchpad_mode", (void **)&dnnl.attr_set_scratchpad_mode},
        {"omp_get_max_threads", (void **)&dnnl.omp_get_max_threads},
        {"omp_set_num_threads", (void **)&dnnl.omp_set_num_threads},
    };
    for (size_t i = 0; i < sizeof(symbols) / sizeof(symbols[0]); i++) {
        *symbols[i].slot = dlsym(handle, symbols[i].name); /* searches libdnnl and its dependencies (libgomp) */
        if (*symbols[i].slot == NULL) {
            PyErr_Format(PyExc_OSError, "%s has no symbol %s (not a oneDNN 3.x OpenMP build?)", path, symbols[i].name);
            dlclose(handle);
            return NULL;
        }
    }
    if (check(dnnl.engine_create(&dnnl.engine, dnnl_cpu, 0), "engine_create")) {
        dlclose(handle);
        return NULL;
    }
    if (check(dnnl.stream_create(&dnnl.stream, dnnl.engine, dnnl_stream_default_flags), "stream_create")) {
        dlclose(handle);
        return NULL;
    }
    dnnl.handle = handle;
    Py_RETURN_NONE;
}

static PyObject *version(PyObject *self, PyObject *args) {
    if (dnnl.handle == NULL) {
        Py_RETURN_NONE;
    }
    const int *v = (const int *)dnnl.version(); /* dnnl_version_t: major, minor, patch, hash, cpu_runtime... */
    return Py_BuildValue("(iii)", v[0], v[1], v[2]);
}

/* -- plans ----------------------------------------------------------------------------------------------- */

/* A plan's three operands: two inputs and the result, in the caller's layouts (user) and oneDNN's (inner).
 * Weight gradient (PLAN_WEIGHTS): x -> src, dy -> diff_dst, diff_weights -> dw.
 * Input gradient (PLAN_DATA): dy -> diff_dst, w -> weights, diff_src -> dx. */
enum { PLAN_WEIGHTS = 0, PLAN_DATA = 1 };

typedef struct {
    dnnl_primitive_t conv;      /* backward weights or backward data */
    int arg[3];                 /* the convolution's execution argument of each operand */
    dnnl_primitive_t reorder[3]; /* inputs 0, 1 -> oneDNN's layouts, its result -> the caller's (NULL: same layout) */
    dnnl_memory_t user[3];      /* the caller's operands (handles set per call) */
    dnnl_memory_t inner[3];     /* oneDNN's layouts where they differ (in the workspace) */
    dnnl_memory_t scratch[4];   /* scratchpads of reorder[0..2] and conv: user mode (in the workspace) */
    dnnl_stream_t stream;       /* a plan runs on one thread at a time; plans may run side by side */
    size_t offset[7];           /* inner[0..2], then scratch[0..3]: byte offsets in the workspace */
    size_t workspace;           /* bytes of workspace a run needs */
} plan_t;

/* The inner buffers and scratchpads own no memory: every run is handed a workspace (the caller's buffer, shared by
 * every plan that runs at another time), so cached plans do not each hold a copy of X and dY between steps. */
enum { WORKSPACE_ALIGN = 64 };

static void reserve(plan_t *plan, int slot, const void *md) {
    plan->offset[slot] = plan->workspace;
    size_t bytes = dnnl.memory_desc_get_size(md);
    plan->workspace += (bytes + WORKSPACE_ALIGN - 1) / WORKSPACE_ALIGN * WORKSPACE_ALIGN;
}

static void plan_free(plan_t *plan) {
    if (plan->stream) {
        dnnl.stream_destroy(plan->stream);
    }
    if (plan->conv) {
        dnnl.primitive_destroy(plan->conv);
    }
    for (int i = 0; i < 4; i++) {
        if (plan->scratch[i]) {
            dnnl.memory_destroy(plan->scratch[i]);
        }
    }
    for (int i = 0; i < 3; i++) {
        if (plan->reorder[i]) {
            dnnl.primitive_destroy(plan->reorder[i]);
        }
        if (plan->user[i]) {
            dnnl.memory_destroy(plan->user[i]);
        }
        if (plan->inner[i]) {
            dnnl.memory_destroy(plan->inner[i]);
        }
    }
    PyMem_Free(plan);
}

static void plan_capsule_free(PyObject *capsule) {
    plan_t *plan = PyCapsule_GetPointer(capsule, "bnfuse.onednn.plan");
    if (plan != NULL) {
        plan_free(plan);
    }
}

static int read_dims(PyObject *sequence, int64_t *out, int count, const char *what) {
    PyObject *fast = PySequence_Fast(sequence, what);
    if (fast == NULL) {
        return -1;
    }
    if (PySequence_Fast_GET_SIZE(fast) != count) {
        PyErr_Format(PyExc_ValueError, "%s: expected %d values, got %zd", what, count, PySequence_Fast_GET_SIZE(fast));
        Py_DECREF(fast);
        return -1;
    }
    for (int i = 0; i < count; i++) {
        out[i] = PyLong_AsLongLong(PySequence_Fast_GET_ITEM(fast, i));
    }
    Py_DECREF(fast);
    return PyErr_Occurred() ? -1 : 0;
}

static int blocked_tag(int rank, long block) {
    static const int tags8[] = {dnnl_aBc8b, dnnl_aBcd8b, dnnl_aBcde8b};
    static const int tags16[] = {dnnl_aBc16b, dnnl_aBcd16b, dnnl_aBcde16b};
    if (block == 8) {
        return tags8[rank - 3];
    }
    if (block == 16) {
        return tags16[rank - 3];
    }
    return 0;
}

/* A primitive's own scratchpad (user scratchpad mode): plans never share one, whichever thread runs them. */
static int own_scratchpad(plan_t *plan, int slot, dnnl_primitive_desc_t pd) {
    const void *md = dnnl.primitive_desc_query_md(pd, dnnl_query_scratchpad_md, 0);
    if (md == NULL || dnnl.memory_desc_get_size(md) == 0) {
        return 0;
    }
    reserve(plan, 3 + slot, md);
    return check(dnnl.memory_create(&plan->scratch[slot], md, dnnl.engine, NULL), "memory_create");
}

/* The reorder between a user memory and oneDNN's chosen layout (to_inner: user -> inner, else inner -> user). */
static int link_layout(plan_t *plan, int slot, const void *user_md, const void *chosen_md, int to_inner,
                       dnnl_primitive_attr_t attr) {
    CHECK(dnnl.memory_create(&plan->user[slot], user_md, dnnl.engine, NULL), "memory_create");
    if (dnnl.memory_desc_equal(user_md, chosen_md)) {
        return 0;
    }
    dnnl_primitive_desc_t pd = NULL;
    CHECK(dnnl.memory_create(&plan->inner[slot], chosen_md, dnnl.engine, NULL), "memory_create");
    reserve(plan, slot, chosen_md);
    const void *from = to_inner ? user_md : chosen_md, *to = to_inner ? chosen_md : user_md;
    CHECK(dnnl.reorder_pd_create(&pd, from, dnnl.engine, to, dnnl.engine, attr), "reorder_primitive_desc_create");
    dnnl_status_t status = dnnl.primitive_create(&plan->reorder[slot], pd);
    if (status == 0 && own_scratchpad(plan, slot, pd)) {
        dnnl.primitive_desc_destroy(pd);
        return -1;
    }
    dnnl.primitive_desc_destroy(pd);
    CHECK(status, "primitive_create (reorder)");
    return 0;
fail:
    return -1;
}

/* plan(x_dims, dy_dims, w_dims, strides, dilations, pads_begin, pads_end, group, x_block, dy_block, threads[, kind])
 * w_dims is ONNX's [O, C/G, k...]; dilations as ONNX gives them (1 = dense); pads_end must make the
 * geometry exact: out = (in + begin + end - (k - 1) * d - 1) / s + 1 with no remainder.
 * x_block / dy_block: 0 for plain NCHW x (or dx) / dy, else the channel block of an NCHWc one (8 or 16).
 * threads: the OpenMP thread count the plan is made for and must run with (0: this thread's current setting).
 * kind: PLAN_WEIGHTS (default; run(plan, x, dy, dw)) or PLAN_DATA (run(plan, dy, w, dx)). */
static PyObject *plan(PyObject *self, PyObject *args) {
    PyObject *x_obj, *dy_obj, *w_obj, *s_obj, *d_obj, *pb_obj, *pe_obj;
    long group, x_block, dy_block;
    int threads, kind = PLAN_WEIGHTS;
    if (!PyArg_ParseTuple(args, "OOOOOOOllli|i", &x_obj, &dy_obj, &w_obj, &s_obj, &d_obj, &pb_obj, &pe_obj, &group,
                          &x_block, &dy_block, &threads, &kind)) {
        return NULL;
    }
    if (kind != PLAN_WEIGHTS && kind != PLAN_DATA) {
        return PyErr_Format(PyExc_ValueError, "oneDNN plan kind %d: 0 (weight gradient) or 1 (input gradient)", kind);
    }
    if (dnnl.handle == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "oneDNN is not loaded");
        return NULL;
    }
    Py_ssize_t rank_size = PySequence_Size(x_obj);
    if (rank_size < 3 || rank_size > 5 || group < 1) {
        PyErr_SetString(PyExc_ValueError, "oneDNN convolution gradient: 1-D to 3-D convolutions, group >= 1");
        return NULL;
    }
    int rank = (int)rank_size, spatial = rank - 2;
    dnnl_dims_t x_dims = {0}, dy_dims = {0}, w_dims = {0}, strides = {0}, dilations = {0}, pb = {0}, pe = {0};
    if (read_dims(x_obj, x_dims, rank, "x_dims") || read_dims(dy_obj, dy_dims, rank, "dy_dims") ||
        read_dims(w_obj, w_dims, rank, "w_dims") || read_dims(s_obj, strides, spatial, "strides") ||
        read_dims(d_obj, dilations, spatial, "dilations") || read_dims(pb_obj, pb, spatial, "pads_begin") ||
        read_dims(pe_obj, pe, spatial, "pads_end")) {
        return NULL;
    }
    for (int i = 0; i < spatial; i++) {
        dilations[i] -= 1; /* oneDNN counts the holes: 0 = dense */
    }
    /* grouped weights as oneDNN's [G, O/G, C/G, k...]: the same bytes as ONNX's [O, C/G, k...] */
    dnnl_dims_t w_onednn = {0};
    int w_rank = rank;
    if (group > 1) {
        w_onednn[0] = group;
        w_onednn[1] = w_dims[0] / group;
        for (int i = 1; i < rank; i++) {
            w_onednn[i + 1] = w_dims[i];
        }
        w_rank = rank + 1;
    } else {
        memcpy(w_onednn, w_dims, sizeof(dnnl_dims_t));
    }
    static const int plain[] = {dnnl_abc, dnnl_abcd, dnnl_abcde, dnnl_abcdef};
    int x_tag = x_block ? blocked_tag(rank, x_block) : plain[rank - 3];
    int dy_tag = dy_block ? blocked_tag(rank, dy_block) : plain[rank - 3];
    if (x_tag == 0 || dy_tag == 0) {
        PyErr_SetString(PyExc_ValueError, "oneDNN convolution gradient: channel blocks of 8 or 16 only");
        return NULL;
    }
    dnnl_memory_desc_t x_md = NULL, dy_md = NULL, w_md = NULL, any_x = NULL, any_dy = NULL, any_w = NULL;
    dnnl_primitive_desc_t fwd = NULL, bwd = NULL;
    dnnl_primitive_attr_t attr = NULL;
    plan_t *result = PyMem_Calloc(1, sizeof(plan_t));
    if (result == NULL) {
        return PyErr_NoMemory();
    }
    /* oneDNN sizes its work split by the OpenMP thread count when the primitive is created: create it under the
     * count it will run with (this thread's setting restored below) */
    int saved_threads = dnnl.omp_get_max_threads();
    if (threads > 0) {
        dnnl.omp_set_num_threads(threads);
    }
    CHECK(dnnl.attr_create(&attr), "primitive_attr_create");
    CHECK(dnnl.attr_set_scratchpad_mode(attr, dnnl_scratchpad_mode_user), "primitive_attr_set_scratchpad_mode");
    CHECK(dnnl.memory_desc_create_with_tag(&x_md, rank, x_dims, dnnl_f32, x_tag), "memory_desc_create (x)");
    CHECK(dnnl.memory_desc_create_with_tag(&dy_md, rank, dy_dims, dnnl_f32, dy_tag), "memory_desc_create (dy)");
    CHECK(dnnl.memory_desc_create_with_tag(&w_md, w_rank, w_onednn, dnnl_f32, plain[w_rank - 3]),
          "memory_desc_create (dw)");
    CHECK(dnnl.memory_desc_create_with_tag(&any_x, rank, x_dims, dnnl_f32, dnnl_format_tag_any), "memory_desc_create");
    CHECK(dnnl.memory_desc_create_with_tag(&any_dy, rank, dy_dims, dnnl_f32, dnnl_format_tag_any),
          "memory_desc_create");
    CHECK(dnnl.memory_desc_create_with_tag(&any_w, w_rank, w_onednn, dnnl_f32, dnnl_format_tag_any),
          "memory_desc_create");
    CHECK(dnnl.conv_fwd_pd_create(&fwd, dnnl.engine, dnnl_forward_training, dnnl_convolution_direct, any_x, any_w,
                                  NULL, any_dy, strides, dilations, pb, pe, NULL),
          "convolution_forward_primitive_desc_create");
    if (kind == PLAN_WEIGHTS) {
        CHECK(dnnl.conv_bwd_weights_pd_create(&bwd, dnnl.engine, dnnl_convolution_direct, any_x, any_w, NULL,
                                              any_dy, strides, dilations, pb, pe, fwd, attr),
              "convolution_backward_weights_primitive_desc_create");
    } else {
        CHECK(dnnl.conv_bwd_data_pd_create(&bwd, dnnl.engine, dnnl_convolution_direct, any_x, any_w, any_dy, strides,
                                           dilations, pb, pe, fwd, attr),
              "convolution_backward_data_primitive_desc_create");
    }
    CHECK(dnnl.primitive_create(&result->conv, bwd), "primitive_create (convolution)");
    if (own_scratchpad(result, 3, bwd)) {
        goto fail;
    }
    CHECK(dnnl.stream_create(&result->stream, dnnl.engine, dnnl_stream_default_flags), "stream_create");
    if (kind == PLAN_WEIGHTS) {
        result->arg[0] = DNNL_ARG_SRC;
        result->arg[1] = DNNL_ARG_DIFF_DST;
        result->arg[2] = DNNL_ARG_DIFF_WEIGHTS;
        if (link_layout(result, 0, x_md, dnnl.primitive_desc_query_md(bwd, dnnl_query_src_md, 0), 1, attr) ||
            link_layout(result, 1, dy_md, dnnl.primitive_desc_query_md(bwd, dnnl_query_diff_dst_md, 0), 1, attr) ||
            link_layout(result, 2, w_md, dnnl.primitive_desc_query_md(bwd, dnnl_query_diff_weights_md, 0), 0, attr)) {
            goto fail;
        }
    } else {
        result->arg[0] = DNNL_ARG_DIFF_DST;
        result->arg[1] = DNNL_ARG_WEIGHTS;
        result->arg[2] = DNNL_ARG_DIFF_SRC;
        if (link_layout(result, 0, dy_md, dnnl.primitive_desc_query_md(bwd, dnnl_query_diff_dst_md, 0), 1, attr) ||
            link_layout(result, 1, w_md, dnnl.primitive_desc_query_md(bwd, dnnl_query_weights_md, 0), 1, attr) ||
            link_layout(result, 2, x_md, dnnl.primitive_desc_query_md(bwd, dnnl_query_diff_src_md, 0), 0, attr)) {
            goto fail;
        }
    }
    dnnl.omp_set_num_threads(saved_threads);
    dnnl.attr_destroy(attr);
    dnnl.primitive_desc_destroy(bwd);
    dnnl.primitive_desc_destroy(fwd);
    dnnl_memory_desc_t mds[] = {x_md, dy_md, w_md, any_x, any_dy, any_w};
    for (int i = 0; i < 6; i++) {
        dnnl.memory_desc_destroy(mds[i]);
    }
    return PyCapsule_New(result, "bnfuse.onednn.plan", plan_capsule_free);
fail:
    dnnl.omp_set_num_threads(saved_threads);
    if (attr) {
        dnnl.attr_destroy(attr);
    }
    if (bwd) {
        dnnl.primitive_desc_destroy(bwd);
    }
    if (fwd) {
        dnnl.primitive_desc_destroy(fwd);
    }
    dnnl_memory_desc_t all[] = {x_md, dy_md, w_md, any_x, any_dy, any_w};
    for (int i = 0; i < 6; i++) {
        if (all[i]) {
            dnnl.memory_desc_destroy(all[i]);
        }
    }
    plan_free(result);
    return NULL;
}

static dnnl_status_t bind(plan_t *plan, uintptr_t x, uintptr_t dy, uintptr_t dw, uintptr_t workspace) {
    dnnl_status_t status = 0;
    for (int i = 0; i < 7 && status == 0; i++) {
        dnnl_memory_t memory = i < 3 ? plan->inner[i] : plan->scratch[i - 3];
        if (memory) {
            status = dnnl.memory_set_data_handle(memory, (char *)workspace + plan->offset[i]);
        }
    }
    if (status == 0) {
        status = dnnl.memory_set_data_handle(plan->user[0], (void *)x);
    }
    if (status == 0) {
        status = dnnl.memory_set_data_handle(plan->user[1], (void *)dy);
    }
    if (status == 0) {
        status = dnnl.memory_set_data_handle(plan->user[2], (void *)dw);
    }
    return status;
}

static dnnl_status_t execute(plan_t *plan) {
    dnnl_status_t status = 0;
    for (int slot = 0; slot < 2 && status == 0; slot++) {
        if (plan->reorder[slot]) {
            dnnl_exec_arg_t args[] = {{DNNL_ARG_SRC, plan->user[slot]},
                                      {DNNL_ARG_DST, plan->inner[slot]},
                                      {DNNL_ARG_SCRATCHPAD, plan->scratch[slot]}};
            status = dnnl.primitive_execute(plan->reorder[slot], plan->stream, plan->scratch[slot] ? 3 : 2, args);
        }
    }
    if (status == 0) {
        dnnl_exec_arg_t args[] = {
            {plan->arg[0], plan->inner[0] ? plan->inner[0] : plan->user[0]},
            {plan->arg[1], plan->inner[1] ? plan->inner[1] : plan->user[1]},
            {plan->arg[2], plan->inner[2] ? plan->inner[2] : plan->user[2]},
            {DNNL_ARG_SCRATCHPAD, plan->scratch[3]},
        };
        status = dnnl.primitive_execute(plan->conv, plan->stream, plan->scratch[3] ? 4 : 3, args);
    }
    if (status == 0 && plan->reorder[2]) {
        dnnl_exec_arg_t args[] = {
            {DNNL_ARG_SRC, plan->inner[2]}, {DNNL_ARG_DST, plan->user[2]}, {DNNL_ARG_SCRATCHPAD, plan->scratch[2]}};
        status = dnnl.primitive_execute(plan->reorder[2], plan->stream, plan->scratch[2] ? 3 : 2, args);
    }
    if (status == 0) {
        status = dnnl.stream_wait(plan->stream);
    }
    return status;
}

/* run(plan, x_address, dy_address, dw_address, threads, workspace_address): dW into the caller's buffer, the
 * workspace (workspace_size(plan) bytes, 64-byte aligned) for oneDNN's layouts and scratchpads. threads > 0 sets
 * the OpenMP thread count of this call only (the calling thread's setting is restored afterwards). */
static PyObject *run(PyObject *self, PyObject *args) {
    PyObject *capsule;
    unsigned long long x, dy, dw, workspace;
    int threads;
    if (!PyArg_ParseTuple(args, "OKKKiK", &capsule, &x, &dy, &dw, &threads, &workspace)) {
        return NULL;
    }
    plan_t *plan = PyCapsule_GetPointer(capsule, "bnfuse.onednn.plan");
    if (plan == NULL) {
        return NULL;
    }
    dnnl_status_t status;
    Py_BEGIN_ALLOW_THREADS;
    status = bind(plan, (uintptr_t)x, (uintptr_t)dy, (uintptr_t)dw, (uintptr_t)workspace);
    if (status == 0) {
        int saved = threads > 0 ? dnnl.omp_get_max_threads() : 0;
        if (threads > 0) {
            dnnl.omp_set_num_threads(threads);
        }
        status = execute(plan);
        if (threads > 0) {
            dnnl.omp_set_num_threads(saved);
        }
    }
    Py_END_ALLOW_THREADS;
    if (check(status, "primitive_execute")) {
        return NULL;
    }
    Py_RETURN_NONE;
}

/* -- jobs: one weight gradient in batch chunks, for a thread pool ---------------------------------------- */

enum { MAX_CHUNKS = 64 };

typedef struct {
    int count;
    plan_t *plans[MAX_CHUNKS];
    uintptr_t x[MAX_CHUNKS], dy[MAX_CHUNKS], dw[MAX_CHUNKS];
    dnnl_status_t status[MAX_CHUNKS];
    int slots;                       /* workspaces: as many as chunks can run at once (the pool's threads) */
    uintptr_t workspace[MAX_CHUNKS]; /* per slot */
    int busy[MAX_CHUNKS];            /* per slot, taken and given back atomically */
} job_t;

/* A free workspace slot (spins, yielding, while every slot is taken: only when more chunks run at once than the
 * caller gave slots for). */
static int take_slot(job_t *job) {
    for (;;) {
        for (int slot = 0; slot < job->slots; slot++) {
            int expected = 0;
            if (__atomic_compare_exchange_n(&job->busy[slot], &expected, 1, 0, __ATOMIC_ACQUIRE, __ATOMIC_RELAXED)) {
                return slot;
            }
        }
        sched_yield();
    }
}

/* One chunk, on whichever thread the pool gives it: one OpenMP thread for oneDNN (this thread's setting is
 * restored), so no OpenMP team is started beside the pool. Touches no Python. */
static void run_chunk(void *data, size_t index) {
    job_t *job = data;
    if (index >= (size_t)job->count) {
        return;
    }
    plan_t *plan = job->plans[index];
    int slot = take_slot(job);
    int saved = dnnl.omp_get_max_threads();
    dnnl.omp_set_num_threads(1);
    dnnl_status_t status = bind(plan, job->x[index], job->dy[index], job->dw[index], job->workspace[slot]);
    if (status == 0) {
        status = execute(plan);
    }
    dnnl.omp_set_num_threads(saved);
    __atomic_store_n(&job->busy[slot], 0, __ATOMIC_RELEASE);
    job->status[index] = status;
}

static void job_capsule_free(PyObject *capsule) { PyMem_Free(PyCapsule_GetPointer(capsule, "bnfuse.onednn.job")); }

/* job(plans): a job over these plans (a sequence of plan capsules, one per chunk; the caller keeps them alive
 * as long as the job). */
static PyObject *job(PyObject *self, PyObject *args) {
    PyObject *plans_obj;
    if (!PyArg_ParseTuple(args, "O", &plans_obj)) {
        return NULL;
    }
    PyObject *fast = PySequence_Fast(plans_obj, "plans");
    if (fast == NULL) {
        return NULL;
    }
    Py_ssize_t count = PySequence_Fast_GET_SIZE(fast);
    if (count < 1 || count > MAX_CHUNKS) {
        Py_DECREF(fast);
        return PyErr_Format(PyExc_ValueError, "a job has 1 to %d chunks, got %zd", MAX_CHUNKS, count);
    }
    job_t *result = PyMem_Calloc(1, sizeof(job_t));
    if (result == NULL) {
        Py_DECREF(fast);
        return PyErr_NoMemory();
    }
    result->count = (int)count;
    for (Py_ssize_t i = 0; i < count; i++) {
        result->plans[i] = PyCapsule_GetPointer(PySequence_Fast_GET_ITEM(fast, i), "bnfuse.onednn.plan");
        if (result->plans[i] == NULL) {
            Py_DECREF(fast);
            PyMem_Free(result);
            return NULL;
        }
    }
    Py_DECREF(fast);
    return PyCapsule_New(result, "bnfuse.onednn.job", job_capsule_free);
}

/* bind_job(job, x, dy, dw, workspaces): the buffer addresses of every chunk (sequences of job.count ints) and the
 * workspaces (1 to job.count of them, each big enough for any chunk's plan: a chunk takes whichever is free);
 * returns the job's address, the data pointer for run_chunk. Clears the chunk statuses. */
static PyObject *bind_job(PyObject *self, PyObject *args) {
    PyObject *capsule, *lists[4];
    if (!PyArg_ParseTuple(args, "OOOOO", &capsule, &lists[0], &lists[1], &lists[2], &lists[3])) {
        return NULL;
    }
    job_t *target = PyCapsule_GetPointer(capsule, "bnfuse.onednn.job");
    if (target == NULL) {
        return NULL;
    }
    int64_t values[4][MAX_CHUNKS];
    Py_ssize_t slots = PySequence_Size(lists[3]);
    if (slots < 1 || slots > target->count) {
        if (!PyErr_Occurred()) {
            PyErr_Format(PyExc_ValueError, "workspaces: 1 to %d of them, got %zd", target->count, slots);
        }
        return NULL;
    }
    if (read_dims(lists[0], values[0], target->count, "x") || read_dims(lists[1], values[1], target->count, "dy") ||
        read_dims(lists[2], values[2], target->count, "dw") ||
        read_dims(lists[3], values[3], (int)slots, "workspaces")) {
        return NULL;
    }
    target->slots = (int)slots;
    for (int i = 0; i < (int)slots; i++) {
        target->workspace[i] = (uintptr_t)values[3][i];
        target->busy[i] = 0;
    }
    for (int i = 0; i < target->count; i++) {
        target->x[i] = (uintptr_t)values[0][i];
        target->dy[i] = (uintptr_t)values[1][i];
        target->dw[i] = (uintptr_t)values[2][i];
        target->status[i] = -1; /* not run */
    }
    return PyLong_FromVoidPtr(target);
}

/* job_check(job): raise if a chunk failed or did not run. */
static PyObject *job_check(PyObject *self, PyObject *args) {
    PyObject *capsule;
    if (!PyArg_ParseTuple(args, "O", &capsule)) {
        return NULL;
    }
    job_t *target = PyCapsule_GetPointer(capsule, "bnfuse.onednn.job");
    if (target == NULL) {
        return NULL;
    }
    for (int i = 0; i < target->count; i++) {
        if (target->status[i] == -1) {
            return PyErr_Format(PyExc_RuntimeError, "oneDNN convolution gradient: chunk %d of %d did not run", i,
                                target->count);
        }
        if (check(target->status[i], "primitive_execute")) {
            return NULL;
        }
    }
    Py_RETURN_NONE;
}

/* workspace_size(plan): the bytes of workspace a run of this plan needs. */
static PyObject *workspace_size(PyObject *self, PyObject *args) {
    PyObject *capsule;
    if (!PyArg_ParseTuple(args, "O", &capsule)) {
        return NULL;
    }
    plan_t *plan = PyCapsule_GetPointer(capsule, "bnfuse.onednn.plan");
    if (plan == NULL) {
        return NULL;
    }
    return PyLong_FromSize_t(plan->workspace);
}

static PyObject *chunk_function(PyObject *self, PyObject *args) { return PyLong_FromVoidPtr((void *)run_chunk); }

static PyMethodDef methods[] = {
    {"load", load, METH_VARARGS, "load(path): dlopen libdnnl.so.3 and make the CPU engine and stream."},
    {"version", version, METH_NOARGS, "The loaded oneDNN's (major, minor, patch), or None."},
    {"plan", plan, METH_VARARGS, "A weight-gradient plan for one convolution geometry (see onednn.c)."},
    {"run", run, METH_VARARGS, "run(plan, x, dy, dw, threads, workspace): execute a plan on buffer addresses."},
    {"workspace_size", workspace_size, METH_VARARGS, "workspace_size(plan): bytes of workspace a run needs."},
    {"job", job, METH_VARARGS, "job(plans): one weight gradient in batch chunks, a plan per chunk."},
    {"bind_job", bind_job, METH_VARARGS, "bind_job(job, xs, dys, dws, workspaces): returns the job's address."},
    {"job_check", job_check, METH_VARARGS, "job_check(job): raise if a chunk failed or did not run."},
    {"chunk_function", chunk_function, METH_NOARGS, "The address of run_chunk(void *job, size_t chunk)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_onednn", NULL, -1, methods};

PyMODINIT_FUNC PyInit__onednn(void) { return PyModule_Create(&module); }
