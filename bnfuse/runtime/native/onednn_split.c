/* The geometry side of the oneDNN convolution-gradient core: checking a geometry, choosing how a call splits its
 * work over the host's threads (bnfuse_onednn_split), and the sub-convolution (plan_spec_t) and operand offsets of
 * each chunk. Everything here depends on the geometry and the thread count alone, so the bits do too. */
#include <string.h>

#include "onednn_gemm.h"
#include "onednn_split.h"

/* A batch chunk's X and dY together stay under this (more chunks than threads above it): the workspace then holds
 * oneDNN's copies of that much per thread, not of the whole batch. A channel split needs the whole batch's X and dY
 * under it (every chunk copies all of X, or all of dY, into its workspace). */
enum { CHUNK_BYTES = 16 << 20, CHANNEL_UNIT = 16 /* a channel chunk: a multiple of oneDNN's widest block */ };

static int64_t product(const int64_t *values, int count) {
    int64_t result = 1;
    for (int i = 0; i < count; i++) {
        result *= values[i];
    }
    return result;
}

int bnfuse_onednn_check_geometry(const bnfuse_conv_geometry *g, char *error, size_t error_size) {
    const char *op = "oneDNN convolution gradient";
    if (g == NULL || g->spatial < 1 || g->spatial > BNFUSE_ONEDNN_MAX_SPATIAL) {
        bnfuse_set_error(error, error_size, "%s: 1-D to 3-D convolutions only (spatial rank %d)", op,
                         g ? g->spatial : 0);
        return BNFUSE_ONEDNN_ERROR;
    }
    if (g->batch < 1 || g->in_channels < 1 || g->out_channels < 1 || g->groups < 1 ||
        g->in_channels % g->groups || g->out_channels % g->groups) {
        bnfuse_set_error(error, error_size,
                         "%s: batch %lld, in_channels %lld, out_channels %lld and groups %lld do not fit (all >= 1, "
                         "channels divisible by groups)",
                         op, (long long)g->batch, (long long)g->in_channels, (long long)g->out_channels,
                         (long long)g->groups);
        return BNFUSE_ONEDNN_ERROR;
    }
    for (int i = 0; i < g->spatial; i++) {
        if (g->input[i] < 1 || g->kernel[i] < 1 || g->stride[i] < 1 || g->dilation[i] < 1 || g->pad_begin[i] < 0 ||
            g->pad_end[i] < 0) {
            bnfuse_set_error(error, error_size,
                             "%s: axis %d: input %lld, kernel %lld, stride %lld, dilation %lld must be >= 1 and pads "
                             "%lld, %lld >= 0",
                             op, i, (long long)g->input[i], (long long)g->kernel[i], (long long)g->stride[i],
                             (long long)g->dilation[i], (long long)g->pad_begin[i], (long long)g->pad_end[i]);
            return BNFUSE_ONEDNN_ERROR;
        }
        int64_t extent = g->input[i] + g->pad_begin[i] + g->pad_end[i] - g->dilation[i] * (g->kernel[i] - 1) - 1;
        int64_t expected = extent < 0 ? 0 : extent / g->stride[i] + 1;
        if (extent < 0 || g->output[i] != expected) {
            bnfuse_set_error(error, error_size, "%s: axis %d: dY has %lld positions, the Conv gives %lld", op, i,
                             (long long)g->output[i], (long long)expected);
            return BNFUSE_ONEDNN_ERROR;
        }
    }
    if (g->x_block != 0 && (g->x_block != 8 && g->x_block != 16)) {
        bnfuse_set_error(error, error_size, "%s: x_block must be 0 (plain NCHW X), 8 or 16, got %d", op, g->x_block);
        return BNFUSE_ONEDNN_ERROR;
    }
    if (g->x_block && (g->spatial != 2 || g->groups != 1 || g->in_channels % g->x_block)) {
        bnfuse_set_error(error, error_size,
                         "%s: a blocked X (x_block %d) must be 2-D, ungrouped, with channels a multiple of the block",
                         op, g->x_block);
        return BNFUSE_ONEDNN_ERROR;
    }
    return BNFUSE_ONEDNN_OK;
}

/* Sizes of `parts` consecutive slices covering `total` units (the first total % parts one larger). */
static void even_parts(int64_t total, int parts, int64_t sizes[]) {
    for (int i = 0; i < parts; i++) {
        sizes[i] = total / parts + (i < total % parts);
    }
}

int bnfuse_onednn_split(const bnfuse_conv_geometry *g, int input_grad, int threads, int *axis, int64_t sizes[],
                        char *error, size_t error_size) {
    if (bnfuse_onednn_check_geometry(g, error, error_size) != BNFUSE_ONEDNN_OK) {
        return 0;
    }
    *axis = BNFUSE_ONEDNN_SPLIT_BATCH;
    if (threads <= 0) { /* one call on oneDNN's own OpenMP team */
        sizes[0] = g->batch;
        return 1;
    }
    if (bnfuse_gemm_applies(g, input_grad)) {
        /* one matrix product (onednn_gemm.c): ranges of output (dW) or input (dX) channels, nothing summed */
        int64_t channels = input_grad ? g->in_channels : g->out_channels;
        int64_t parts = channels / CHANNEL_UNIT, chunks = threads < parts ? threads : parts;
        if (chunks < 2) {
            sizes[0] = g->batch;
            return 1;
        }
        *axis = BNFUSE_ONEDNN_SPLIT_CHANNELS;
        even_parts(parts, (int)chunks, sizes);
        for (int i = 0; i < chunks; i++) {
            sizes[i] *= CHANNEL_UNIT;
        }
        sizes[chunks - 1] += channels % CHANNEL_UNIT;
        return (int)chunks;
    }
    int64_t in_size = product(g->input, g->spatial), out_size = product(g->output, g->spatial);
    int64_t x_bytes = 4 * g->batch * g->in_channels * in_size, dy_bytes = 4 * g->batch * g->out_channels * out_size;
    int64_t w_bytes = 4 * g->out_channels * (g->in_channels / g->groups) * product(g->kernel, g->spatial);

    /* the batch: one chunk per thread, or the next multiple of the threads that keeps a chunk under CHUNK_BYTES */
    int64_t slots = threads < g->batch ? threads : g->batch;
    int64_t wanted = (x_bytes + dy_bytes + CHUNK_BYTES - 1) / CHUNK_BYTES;
    int64_t chunks = (wanted + slots - 1) / slots * slots;
    chunks = chunks < slots ? slots : chunks;
    chunks = chunks > g->batch ? g->batch : chunks;
    chunks = chunks > BNFUSE_ONEDNN_MAX_CHUNKS ? BNFUSE_ONEDNN_MAX_CHUNKS : chunks;

    /* channels (or groups): no partial sums and no weight-sized copy per chunk, but every chunk reads all of X
     * (weight gradient) or all of dY (input gradient) when the convolution is ungrouped */
    int64_t parts, duplicated;
    if (g->groups > 1) {
        parts = g->groups;
        duplicated = 0;
    } else {
        parts = (input_grad ? g->in_channels : g->out_channels) / CHANNEL_UNIT;
        duplicated = input_grad ? dy_bytes : x_bytes;
    }
    int64_t channel_chunks = threads < parts ? threads : parts;
    if (channel_chunks >= 2 && x_bytes + dy_bytes <= CHUNK_BYTES) {
        /* what the batch split costs beyond the work: a weight-sized reorder (and, for dW, a partial sum) per
         * further chunk; the channel split: a copy of the duplicated operand per further chunk */
        int use_channels = channel_chunks > slots ||
                           (channel_chunks == slots && (channel_chunks - 1) * duplicated < (slots - 1) * w_bytes);
        if (use_channels) {
            if (g->groups > 1) {
                *axis = BNFUSE_ONEDNN_SPLIT_GROUPS;
                even_parts(g->groups, (int)channel_chunks, sizes);
            } else {
                *axis = BNFUSE_ONEDNN_SPLIT_CHANNELS;
                even_parts(parts, (int)channel_chunks, sizes);
                for (int i = 0; i < channel_chunks; i++) {
                    sizes[i] *= CHANNEL_UNIT;
                }
                sizes[channel_chunks - 1] += (input_grad ? g->in_channels : g->out_channels) % CHANNEL_UNIT;
            }
            return (int)channel_chunks;
        }
    }
    even_parts(g->batch, (int)chunks, sizes);
    return (int)chunks;
}

/* Plain (row-major) strides of dims[0..rank). */
static void dense_strides(const int64_t *dims, int rank, int64_t *strides) {
    int64_t step = 1;
    for (int i = rank - 1; i >= 0; i--) {
        strides[i] = step;
        step *= dims[i];
    }
}

void bnfuse_chunk_spec(const bnfuse_conv_geometry *g, int kind, int axis, int64_t start, int64_t extent, int threads,
                       plan_spec_t *spec, size_t offsets[3]) {
    memset(spec, 0, sizeof(*spec));
    int spatial = g->spatial, rank = spatial + 2;
    spec->kind = kind;
    spec->rank = rank;
    spec->group = g->groups;
    spec->x_block = g->x_block;
    spec->threads = threads;
    int64_t kernel = product(g->kernel, spatial), cg = g->in_channels / g->groups, og = g->out_channels / g->groups;
    int64_t in_size = product(g->input, spatial), out_size = product(g->output, spatial);
    /* the whole tensors: their dims give the strides every slice keeps */
    dnnl_dims_t x_full = {g->batch, g->in_channels}, dy_full = {g->batch, g->out_channels};
    dnnl_dims_t w_full = {g->out_channels, cg};
    for (int i = 0; i < spatial; i++) {
        x_full[2 + i] = g->input[i];
        dy_full[2 + i] = g->output[i];
        w_full[2 + i] = g->kernel[i];
        spec->strides[i] = g->stride[i];
        spec->dilations[i] = g->dilation[i];
        spec->pads_begin[i] = g->pad_begin[i];
        /* exact end pads (oneDNN requires them): input past the last window is unused, so the end pad shrinks by
         * it, possibly below zero (oneDNN crops then) */
        spec->pads_end[i] = (g->output[i] - 1) * g->stride[i] + g->dilation[i] * (g->kernel[i] - 1) + 1 -
                            g->input[i] - g->pad_begin[i];
    }
    /* 1x1 kernels: the weight gradient in the plain layout (oneDNN's blocked one reordered back cost 1-15x the
     * gradient on resnet50's 1x1 layers at batch 4, 64x64: 1024x512 14 -> 0.8 ms, 2048x512 17.7 -> 1.2 ms) */
    spec->plain_weights = kind == PLAN_WEIGHTS && kernel == 1;
    dense_strides(x_full, rank, spec->x_strides);
    dense_strides(dy_full, rank, spec->dy_strides);
    dense_strides(w_full, rank, spec->w_strides);
    memcpy(spec->x_dims, x_full, sizeof(dnnl_dims_t));
    memcpy(spec->dy_dims, dy_full, sizeof(dnnl_dims_t));
    memcpy(spec->w_dims, w_full, sizeof(dnnl_dims_t));
    size_t x_offset = 0, dy_offset = 0, w_offset = 0;
    if (axis == BNFUSE_ONEDNN_SPLIT_BATCH) {
        spec->x_dims[0] = spec->dy_dims[0] = extent;
        x_offset = (size_t)(start * g->in_channels * in_size);
        dy_offset = (size_t)(start * g->out_channels * out_size);
    } else if (axis == BNFUSE_ONEDNN_SPLIT_GROUPS) {
        spec->group = extent;
        spec->x_dims[1] = extent * cg;
        spec->dy_dims[1] = extent * og;
        spec->w_dims[0] = extent * og;
        x_offset = (size_t)(start * cg * in_size);
        dy_offset = (size_t)(start * og * out_size);
        w_offset = (size_t)(start * og * cg * kernel);
    } else if (kind == PLAN_WEIGHTS) { /* output channels: dY's and dW's */
        spec->dy_dims[1] = spec->w_dims[0] = extent;
        dy_offset = (size_t)(start * out_size);
        w_offset = (size_t)(start * cg * kernel);
    } else { /* input channels: dX's and W's */
        spec->x_dims[1] = spec->w_dims[1] = extent;
        x_offset = (size_t)(start * in_size);
        w_offset = (size_t)(start * kernel);
    }
    /* operands in the plan's order: (X, dY) -> dW, or (dY, W) -> dX */
    offsets[0] = kind == PLAN_WEIGHTS ? x_offset : dy_offset;
    offsets[1] = kind == PLAN_WEIGHTS ? dy_offset : w_offset;
    offsets[2] = kind == PLAN_WEIGHTS ? w_offset : x_offset;
}
