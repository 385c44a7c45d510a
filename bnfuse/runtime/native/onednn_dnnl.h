/* Internal to the oneDNN convolution-gradient core (onednn_load.c, onednn_plan.c, onednn_conv.c): the few oneDNN
 * 3.x C API prototypes and enum values the core calls, as the public header oneapi/dnnl/dnnl.h (and dnnl_types.h)
 * declares them (oneDNN's C ABI is stable within a major version, soname libdnnl.so.3; the enum values are those
 * of release 3.2, which bnfuse_onednn_load() checks), the table of functions it dlsym()s, and plans. */
#ifndef BNFUSE_ONEDNN_DNNL_H
#define BNFUSE_ONEDNN_DNNL_H

#include <stddef.h>
#include <stdint.h>

#include "onednn_conv.h"

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

struct dnnl_api {
    void *handle;
    dnnl_engine_t engine;
    dnnl_status_t (*engine_create)(dnnl_engine_t *, int, size_t);
    dnnl_status_t (*stream_create)(dnnl_stream_t *, dnnl_engine_t, unsigned);
    dnnl_status_t (*stream_wait)(dnnl_stream_t);
    dnnl_status_t (*stream_destroy)(dnnl_stream_t);
    dnnl_status_t (*memory_desc_create_with_tag)(dnnl_memory_desc_t *, int, const dnnl_dims_t, int, int);
    dnnl_status_t (*memory_desc_create_with_strides)(dnnl_memory_desc_t *, int, const dnnl_dims_t, int,
                                                     const dnnl_dims_t);
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
    /* row-major C = alpha * op(A) op(B) + beta * C (onednn_gemm.c) */
    dnnl_status_t (*sgemm)(char, char, int64_t, int64_t, int64_t, float, const float *, int64_t, const float *, int64_t,
                           float, float *, int64_t);
    /* the OpenMP runtime libdnnl (gomp build) runs on: per-call thread count, restored after the call */
    int (*omp_get_max_threads)(void);
    void (*omp_set_num_threads)(int);
};

extern struct dnnl_api bnfuse_dnnl;

/* A plan's kinds: the weight gradient (operands x -> src, dy -> diff_dst, result diff_weights -> dw) and the input
 * gradient (dy -> diff_dst, w -> weights, result diff_src -> dx). */
enum { PLAN_WEIGHTS = 0, PLAN_DATA = 1 };

/* One sub-convolution for a plan: its dims (ONNX's weight [O, C/G, k...]) and the strides (in elements) of the
 * caller's memory of each operand, which may be a slice of a larger tensor (a chunk of channels or groups). */
typedef struct {
    int kind, rank; /* rank: spatial + 2 */
    int64_t group;
    dnnl_dims_t x_dims, dy_dims, w_dims;
    dnnl_dims_t x_strides, dy_strides, w_strides;
    dnnl_dims_t strides, dilations, pads_begin, pads_end; /* dilations as ONNX's; pads_end exact (maybe < 0) */
    int x_block;  /* 0, or the NCHWc channel block of X (then x_strides is unused) */
    int plain_weights; /* the convolution on the weights in the caller's layout (else oneDNN's choice) */
    int threads;  /* the OpenMP thread count the plan is made for and runs with (0: the calling thread's) */
} plan_spec_t;

typedef struct {
    dnnl_primitive_t conv;       /* backward weights or backward data */
    int arg[3];                  /* the convolution's execution argument of each operand */
    dnnl_primitive_t reorder[3]; /* inputs 0, 1 -> oneDNN's layouts, its result -> the caller's (NULL: same) */
    dnnl_memory_t user[3];       /* the caller's operands (handles set per call) */
    dnnl_memory_t inner[3];      /* oneDNN's layouts where they differ (in the workspace) */
    dnnl_memory_t scratch[4];    /* scratchpads of reorder[0..2] and conv: user mode (in the workspace) */
    dnnl_stream_t stream;        /* a plan runs on one thread at a time; plans may run side by side */
    size_t offset[7];            /* inner[0..2], then scratch[0..3]: byte offsets in the workspace */
    size_t workspace;            /* bytes of workspace a run needs */
    int threads;
} plan_t;

enum { WORKSPACE_ALIGN = 64 };

/* A plan, or NULL with the message in error (the primitive descriptors fail, dnnl_unimplemented, where oneDNN has no
 * implementation for the geometry). */
plan_t *bnfuse_plan_create(const plan_spec_t *spec, char *error, size_t error_size);
void bnfuse_plan_free(plan_t *plan);
/* Bind the operands (in the plan's order) and the workspace, and run the plan on the calling thread with the
 * plan's OpenMP thread count (this thread's setting restored). */
dnnl_status_t bnfuse_plan_run(plan_t *plan, const void *first, const void *second, void *result, void *workspace);

void bnfuse_set_error(char *error, size_t error_size, const char *format, ...)
    __attribute__((format(printf, 3, 4)));

#endif
