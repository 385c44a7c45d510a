/* Plans of the oneDNN convolution-gradient core: one (sub-)convolution geometry as a backward-weights or
 * backward-data primitive, with layouts of oneDNN's choosing (blocked, e.g. nChw8c on AVX2), the reorders between
 * the caller's memory (plain, possibly a strided slice of a larger tensor, or NCHWc X) and those, and a stream of
 * its own. The inner buffers and scratchpads own no memory: every run is handed a workspace (shared by every plan
 * that runs at another time), so cached plans hold no copy of the operands between steps. */
#include <stdlib.h>
#include <string.h>

#include "onednn_dnnl.h"

#define dnnl bnfuse_dnnl

static void reserve(plan_t *plan, int slot, const void *md) {
    plan->offset[slot] = plan->workspace;
    size_t bytes = dnnl.memory_desc_get_size(md);
    plan->workspace += (bytes + WORKSPACE_ALIGN - 1) / WORKSPACE_ALIGN * WORKSPACE_ALIGN;
}

void bnfuse_plan_free(plan_t *plan) {
    if (plan == NULL) {
        return;
    }
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
    free(plan);
}

static int blocked_tag(int rank, int block) {
    static const int tags8[] = {dnnl_aBc8b, dnnl_aBcd8b, dnnl_aBcde8b};
    static const int tags16[] = {dnnl_aBc16b, dnnl_aBcd16b, dnnl_aBcde16b};
    return block == 8 ? tags8[rank - 3] : block == 16 ? tags16[rank - 3] : 0;
}

/* The failing oneDNN call, for the message. */
typedef struct {
    const char *what;
    dnnl_status_t status;
} failure_t;

#define CHECK(call, name)                 \
    do {                                  \
        dnnl_status_t status_ = (call);   \
        if (status_ != 0) {               \
            failed->what = (name);        \
            failed->status = status_;     \
            goto fail;                    \
        }                                 \
    } while (0)

/* A primitive's own scratchpad (user scratchpad mode): plans never share one, whichever thread runs them. */
static int own_scratchpad(plan_t *plan, int slot, dnnl_primitive_desc_t pd, failure_t *failed) {
    const void *md = dnnl.primitive_desc_query_md(pd, dnnl_query_scratchpad_md, 0);
    if (md == NULL || dnnl.memory_desc_get_size(md) == 0) {
        return 0;
    }
    reserve(plan, 3 + slot, md);
    CHECK(dnnl.memory_create(&plan->scratch[slot], md, dnnl.engine, NULL), "memory_create (scratchpad)");
    return 0;
fail:
    return -1;
}

/* The reorder between a user memory and oneDNN's chosen layout (to_inner: user -> inner, else inner -> user). */
static int link_layout(plan_t *plan, int slot, const void *user_md, const void *chosen_md, int to_inner,
                       dnnl_primitive_attr_t attr, failure_t *failed) {
    dnnl_primitive_desc_t pd = NULL;
    CHECK(dnnl.memory_create(&plan->user[slot], user_md, dnnl.engine, NULL), "memory_create");
    if (dnnl.memory_desc_equal(user_md, chosen_md)) {
        return 0;
    }
    CHECK(dnnl.memory_create(&plan->inner[slot], chosen_md, dnnl.engine, NULL), "memory_create");
    reserve(plan, slot, chosen_md);
    const void *from = to_inner ? user_md : chosen_md, *to = to_inner ? chosen_md : user_md;
    CHECK(dnnl.reorder_pd_create(&pd, from, dnnl.engine, to, dnnl.engine, attr), "reorder_primitive_desc_create");
    CHECK(dnnl.primitive_create(&plan->reorder[slot], pd), "primitive_create (reorder)");
    if (own_scratchpad(plan, slot, pd, failed)) {
        goto fail;
    }
    dnnl.primitive_desc_destroy(pd);
    return 0;
fail:
    if (pd) {
        dnnl.primitive_desc_destroy(pd);
    }
    return -1;
}

/* The forward (oneDNN's hint) and backward primitive descriptors of a spec with these operand descriptors; on
 * failure both NULL and *what the call that failed. */
static dnnl_status_t create_descriptors(const plan_spec_t *spec, const int64_t *dilations, const void *x,
                                        const void *w, const void *dy, dnnl_primitive_attr_t attr,
                                        dnnl_primitive_desc_t *fwd, dnnl_primitive_desc_t *bwd, const char **what) {
    *fwd = *bwd = NULL;
    *what = "convolution_forward_primitive_desc_create";
    dnnl_status_t status = dnnl.conv_fwd_pd_create(fwd, dnnl.engine, dnnl_forward_training, dnnl_convolution_direct,
                                                   x, w, NULL, dy, spec->strides, dilations, spec->pads_begin,
                                                   spec->pads_end, NULL);
    if (status == 0 && spec->kind == PLAN_WEIGHTS) {
        *what = "convolution_backward_weights_primitive_desc_create";
        status = dnnl.conv_bwd_weights_pd_create(bwd, dnnl.engine, dnnl_convolution_direct, x, w, NULL, dy,
                                                 spec->strides, dilations, spec->pads_begin, spec->pads_end, *fwd,
                                                 attr);
    } else if (status == 0) {
        *what = "convolution_backward_data_primitive_desc_create";
        status = dnnl.conv_bwd_data_pd_create(bwd, dnnl.engine, dnnl_convolution_direct, x, w, dy, spec->strides,
                                              dilations, spec->pads_begin, spec->pads_end, *fwd, attr);
    }
    if (status != 0) {
        if (*fwd) {
            dnnl.primitive_desc_destroy(*fwd);
        }
        if (*bwd) {
            dnnl.primitive_desc_destroy(*bwd);
        }
        *fwd = *bwd = NULL;
    }
    return status;
}

plan_t *bnfuse_plan_create(const plan_spec_t *spec, char *error, size_t error_size) {
    int rank = spec->rank, spatial = rank - 2;
    dnnl_dims_t dilations = {0}, w_dims = {0}, w_strides = {0};
    for (int i = 0; i < spatial; i++) {
        dilations[i] = spec->dilations[i] - 1; /* oneDNN counts the holes: 0 = dense */
    }
    /* grouped weights as oneDNN's [G, O/G, C/G, k...]: the same memory as ONNX's [O, C/G, k...] */
    int w_rank = rank;
    if (spec->group > 1) {
        w_dims[0] = spec->group;
        w_dims[1] = spec->w_dims[0] / spec->group;
        w_strides[0] = spec->w_strides[0] * w_dims[1];
        w_strides[1] = spec->w_strides[0];
        for (int i = 1; i < rank; i++) {
            w_dims[i + 1] = spec->w_dims[i];
            w_strides[i + 1] = spec->w_strides[i];
        }
        w_rank = rank + 1;
    } else {
        memcpy(w_dims, spec->w_dims, sizeof(dnnl_dims_t));
        memcpy(w_strides, spec->w_strides, sizeof(dnnl_dims_t));
    }
    failure_t failure = {NULL, 0}, *failed = &failure;
    dnnl_memory_desc_t x_md = NULL, dy_md = NULL, w_md = NULL, any_x = NULL, any_dy = NULL, any_w = NULL;
    dnnl_primitive_desc_t fwd = NULL, bwd = NULL;
    dnnl_primitive_attr_t attr = NULL;
    plan_t *plan = calloc(1, sizeof(plan_t));
    if (plan == NULL) {
        bnfuse_set_error(error, error_size, "oneDNN convolution gradient: out of memory");
        return NULL;
    }
    plan->threads = spec->threads;
    /* oneDNN sizes its work split by the OpenMP thread count when the primitive is created: create it under the
     * count it will run with (this thread's setting restored below) */
    int saved_threads = dnnl.omp_get_max_threads();
    if (spec->threads > 0) {
        dnnl.omp_set_num_threads(spec->threads);
    }
    CHECK(dnnl.attr_create(&attr), "primitive_attr_create");
    CHECK(dnnl.attr_set_scratchpad_mode(attr, dnnl_scratchpad_mode_user), "primitive_attr_set_scratchpad_mode");
    if (spec->x_block) {
        CHECK(dnnl.memory_desc_create_with_tag(&x_md, rank, spec->x_dims, dnnl_f32, blocked_tag(rank, spec->x_block)),
              "memory_desc_create (x)");
    } else {
        CHECK(dnnl.memory_desc_create_with_strides(&x_md, rank, spec->x_dims, dnnl_f32, spec->x_strides),
              "memory_desc_create (x)");
    }
    CHECK(dnnl.memory_desc_create_with_strides(&dy_md, rank, spec->dy_dims, dnnl_f32, spec->dy_strides),
          "memory_desc_create (dy)");
    CHECK(dnnl.memory_desc_create_with_strides(&w_md, w_rank, w_dims, dnnl_f32, w_strides), "memory_desc_create (w)");
    CHECK(dnnl.memory_desc_create_with_tag(&any_x, rank, spec->x_dims, dnnl_f32, dnnl_format_tag_any),
          "memory_desc_create");
    CHECK(dnnl.memory_desc_create_with_tag(&any_dy, rank, spec->dy_dims, dnnl_f32, dnnl_format_tag_any),
          "memory_desc_create");
    CHECK(dnnl.memory_desc_create_with_tag(&any_w, w_rank, w_dims, dnnl_f32, dnnl_format_tag_any),
          "memory_desc_create");
    /* the weights in the caller's plain layout where the spec asks (the weight gradient of 1x1 kernels: oneDNN's
     * reorder of a blocked diff_weights back to plain cost 1-15x the gradient itself there), else oneDNN's choice;
     * the choice if oneDNN has no implementation for the plain one */
    const char *what = NULL;
    dnnl_status_t made = create_descriptors(spec, dilations, any_x, spec->plain_weights ? w_md : any_w, any_dy, attr,
                                            &fwd, &bwd, &what);
    if (made != 0 && spec->plain_weights) {
        made = create_descriptors(spec, dilations, any_x, any_w, any_dy, attr, &fwd, &bwd, &what);
    }
    CHECK(made, what);
    CHECK(dnnl.primitive_create(&plan->conv, bwd), "primitive_create (convolution)");
    if (own_scratchpad(plan, 3, bwd, failed)) {
        goto fail;
    }
    CHECK(dnnl.stream_create(&plan->stream, dnnl.engine, dnnl_stream_default_flags), "stream_create");
    if (spec->kind == PLAN_WEIGHTS) {
        plan->arg[0] = DNNL_ARG_SRC;
        plan->arg[1] = DNNL_ARG_DIFF_DST;
        plan->arg[2] = DNNL_ARG_DIFF_WEIGHTS;
        if (link_layout(plan, 0, x_md, dnnl.primitive_desc_query_md(bwd, dnnl_query_src_md, 0), 1, attr, failed) ||
            link_layout(plan, 1, dy_md, dnnl.primitive_desc_query_md(bwd, dnnl_query_diff_dst_md, 0), 1, attr,
                        failed) ||
            link_layout(plan, 2, w_md, dnnl.primitive_desc_query_md(bwd, dnnl_query_diff_weights_md, 0), 0, attr,
                        failed)) {
            goto fail;
        }
    } else {
        plan->arg[0] = DNNL_ARG_DIFF_DST;
        plan->arg[1] = DNNL_ARG_WEIGHTS;
        plan->arg[2] = DNNL_ARG_DIFF_SRC;
        if (link_layout(plan, 0, dy_md, dnnl.primitive_desc_query_md(bwd, dnnl_query_diff_dst_md, 0), 1, attr,
                        failed) ||
            link_layout(plan, 1, w_md, dnnl.primitive_desc_query_md(bwd, dnnl_query_weights_md, 0), 1, attr, failed) ||
            link_layout(plan, 2, x_md, dnnl.primitive_desc_query_md(bwd, dnnl_query_diff_src_md, 0), 0, attr,
                        failed)) {
            goto fail;
        }
    }
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
    dnnl_memory_desc_t mds[] = {x_md, dy_md, w_md, any_x, any_dy, any_w};
    for (int i = 0; i < 6; i++) {
        if (mds[i]) {
            dnnl.memory_desc_destroy(mds[i]);
        }
    }
    if (failure.what != NULL) {
        bnfuse_set_error(error, error_size, "oneDNN %s failed (dnnl_status_t %d)", failure.what, failure.status);
        bnfuse_plan_free(plan);
        return NULL;
    }
    return plan;
}

static dnnl_status_t bind(plan_t *plan, const void *first, const void *second, void *result, void *workspace) {
    dnnl_status_t status = 0;
    for (int i = 0; i < 7 && status == 0; i++) {
        dnnl_memory_t memory = i < 3 ? plan->inner[i] : plan->scratch[i - 3];
        if (memory) {
            status = dnnl.memory_set_data_handle(memory, (char *)workspace + plan->offset[i]);
        }
    }
    const void *operands[3] = {first, second, result};
    for (int i = 0; i < 3 && status == 0; i++) {
        status = dnnl.memory_set_data_handle(plan->user[i], (void *)operands[i]);
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

dnnl_status_t bnfuse_plan_run(plan_t *plan, const void *first, const void *second, void *result, void *workspace) {
    dnnl_status_t status = bind(plan, first, second, result, workspace);
    if (status == 0) {
        int saved = plan->threads > 0 ? dnnl.omp_get_max_threads() : 0;
        if (plan->threads > 0) {
            dnnl.omp_set_num_threads(plan->threads);
        }
        status = execute(plan);
        if (plan->threads > 0) {
            dnnl.omp_set_num_threads(saved);
        }
    }
    return status;
}
