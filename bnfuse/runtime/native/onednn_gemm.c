/* The gradients of a 2-D convolution on a small map as one matrix product each: X unrolled (im2col) into
 * [pixels, C * kh * kw], dY transposed into [O, pixels]; dW = dY^T x unrolled X, and dX folded back (col2im) from
 * dY x W [O, C * kh * kw], both by oneDNN's sgemm. Where the batch's output positions are few (a 512 -> 512 3x3
 * layer on a 2x2 map at batch 4: 16 of them), oneDNN's convolution primitive spends its time on layouts (its blocked
 * weights reordered back): 5.2 ms there, this 1.4 ms; 256 -> 256 on 4x4 (64 positions) 1.5 -> 1.35 ms; at 256
 * positions the primitive was faster (measured at 1 thread, bench/RESULTS.md session 35). The input gradient (at most 32 positions, at most 4 per image): 512 ->
 * 512 on 2x2 2.2 -> 1.35 ms, 256 -> 512 strided onto 2x2 2.2 -> 0.7 ms; on a 4x4 map (256 -> 256 at batch 2) the
 * primitive was 1.2x faster.
 *
 * Threads and determinism: the unrolling is exact, and each chunk of output channels (bnfuse_onednn_split: fixed by
 * the geometry and the thread count) is one sgemm call on one OpenMP thread over all positions, run as a task on the
 * host's pool. */
#include <stdlib.h>
#include <string.h>

#include "onednn_dnnl.h"
#include "onednn_gemm.h"

#define dnnl bnfuse_dnnl

enum {
    GEMM_MAX_PIXELS = 64,       /* output positions over the batch: at 256 oneDNN's primitive was faster */
    GEMM_MAX_INPUT_PIXELS = 32, /* the input gradient: at 64 the primitive was faster */
    GEMM_MAX_INPUT_MAP = 4,     /* and only on maps of at most 4 positions (256 -> 256 on 4x4 at batch 2: 1.2x) */
};

static int64_t pixels(const bnfuse_conv_geometry *g) {
    return g->batch * g->output[0] * g->output[1];
}

int bnfuse_gemm_weight_grad_applies(const bnfuse_conv_geometry *g) {
    return g->spatial == 2 && g->groups == 1 && g->kernel[0] * g->kernel[1] > 1 && pixels(g) <= GEMM_MAX_PIXELS;
}

int bnfuse_gemm_input_grad_applies(const bnfuse_conv_geometry *g) {
    return g->spatial == 2 && g->groups == 1 && g->kernel[0] * g->kernel[1] > 1 && g->x_block == 0 &&
           pixels(g) <= GEMM_MAX_INPUT_PIXELS && g->output[0] * g->output[1] <= GEMM_MAX_INPUT_MAP;
}

static size_t unrolled_floats(const bnfuse_conv_geometry *g) {
    return (size_t)(pixels(g) * g->in_channels * g->kernel[0] * g->kernel[1]);
}

static size_t aligned(size_t bytes) {
    return (bytes + WORKSPACE_ALIGN - 1) / WORKSPACE_ALIGN * WORKSPACE_ALIGN;
}

size_t bnfuse_gemm_scratch(const bnfuse_conv_geometry *g) {
    return aligned(4 * unrolled_floats(g)) + aligned(4 * (size_t)(g->out_channels * pixels(g)));
}

/* col[p][c * kh * kw + i * kw + j] = X[n, c, r * sh - ph + i * dh, q * sw - pw + j * dw] (0 in the padding), p over
 * (n, r, q); X plain NCHW or NCHWc (x_block). */
static void unroll(const bnfuse_conv_geometry *g, const float *x, float *col) {
    const int64_t ih = g->input[0], iw = g->input[1], oh = g->output[0], ow = g->output[1];
    const int64_t kh = g->kernel[0], kw = g->kernel[1], channels = g->in_channels, block = g->x_block;
    const int64_t row = channels * kh * kw;
    for (int64_t n = 0; n < g->batch; n++) {
        for (int64_t r = 0; r < oh; r++) {
            for (int64_t q = 0; q < ow; q++) {
                float *out = col + ((n * oh + r) * ow + q) * row;
                for (int64_t c = 0; c < channels; c++) {
                    const float *plane = block ? x + ((n * (channels / block) + c / block) * ih * iw) * block + c % block
                                               : x + (n * channels + c) * ih * iw;
                    const int64_t step = block ? block : 1;
                    for (int64_t i = 0; i < kh; i++) {
                        const int64_t h = r * g->stride[0] - g->pad_begin[0] + i * g->dilation[0];
                        for (int64_t j = 0; j < kw; j++) {
                            const int64_t w = q * g->stride[1] - g->pad_begin[1] + j * g->dilation[1];
                            const int inside = h >= 0 && h < ih && w >= 0 && w < iw;
                            *out++ = inside ? plane[(h * iw + w) * step] : 0.0f;
                        }
                    }
                }
            }
        }
    }
}

/* dX[n, c, h, w] += col[p][c * kh * kw + i * kw + j] over the positions (p, i, j) that read X[n, c, h, w]
 * (im2col's adjoint), for channels [first, last); dX's channels there zeroed first. */
static void fold(const bnfuse_conv_geometry *g, const float *col, float *dx, int64_t first, int64_t last) {
    const int64_t ih = g->input[0], iw = g->input[1], oh = g->output[0], ow = g->output[1];
    const int64_t kh = g->kernel[0], kw = g->kernel[1], channels = g->in_channels, row = channels * kh * kw;
    for (int64_t n = 0; n < g->batch; n++) {
        memset(dx + (n * channels + first) * ih * iw, 0, sizeof(float) * (size_t)((last - first) * ih * iw));
    }
    for (int64_t n = 0; n < g->batch; n++) {
        for (int64_t r = 0; r < oh; r++) {
            for (int64_t q = 0; q < ow; q++) {
                const float *in = col + ((n * oh + r) * ow + q) * row;
                for (int64_t c = first; c < last; c++) {
                    float *plane = dx + (n * channels + c) * ih * iw;
                    const float *taps = in + c * kh * kw;
                    for (int64_t i = 0; i < kh; i++) {
                        const int64_t h = r * g->stride[0] - g->pad_begin[0] + i * g->dilation[0];
                        for (int64_t j = 0; j < kw; j++) {
                            const int64_t w = q * g->stride[1] - g->pad_begin[1] + j * g->dilation[1];
                            if (h >= 0 && h < ih && w >= 0 && w < iw) {
                                plane[h * iw + w] += taps[i * kw + j];
                            }
                        }
                    }
                }
            }
        }
    }
}

typedef struct {
    const bnfuse_conv_geometry *g;
    const float *dyt, *col, *w; /* dW: dY transposed and X unrolled; dX: dY transposed and W */
    float *out, *dcol;          /* dW; or dX and the unrolled dX */
    int input_grad;
    int64_t first[BNFUSE_ONEDNN_MAX_CHUNKS + 1]; /* task i: output (dW) or input (dX) channels [first[i], first[i+1]) */
    int threads; /* OpenMP threads of each sgemm call (0: the calling thread's setting) */
    int failed;
} gemm_call;

static void chunk_task(void *user, size_t index) {
    gemm_call *call = user;
    const bnfuse_conv_geometry *g = call->g;
    const int64_t first = call->first[index], count = call->first[index + 1] - first;
    const int64_t p = pixels(g), taps = g->kernel[0] * g->kernel[1], row = g->in_channels * taps;
    int saved = call->threads > 0 ? dnnl.omp_get_max_threads() : 0;
    if (call->threads > 0) {
        dnnl.omp_set_num_threads(call->threads);
    }
    dnnl_status_t status;
    if (call->input_grad) { /* dcol[:, these channels' taps] = dY^T W[:, the same columns] */
        status = dnnl.sgemm('T', 'N', p, count * taps, g->out_channels, 1.0f, call->dyt, p, call->w + first * taps,
                            row, 0.0f, call->dcol + first * taps, row);
    } else { /* dW[these rows] = dY^T[these rows] X unrolled */
        status = dnnl.sgemm('N', 'N', count, row, p, 1.0f, call->dyt + first * p, p, call->col, row, 0.0f,
                            call->out + first * row, row);
    }
    if (call->threads > 0) {
        dnnl.omp_set_num_threads(saved);
    }
    if (status != 0) {
        __atomic_store_n(&call->failed, 1, __ATOMIC_RELAXED);
    } else if (call->input_grad) {
        fold(g, call->dcol, call->out, first, first + count);
    }
}

/* dY [N, O, pixels] -> [O, N * pixels] */
static void transpose_dy(const bnfuse_conv_geometry *g, const float *dy, float *dyt) {
    const int64_t p = pixels(g), out_size = g->output[0] * g->output[1], o_count = g->out_channels;
    for (int64_t n = 0; n < g->batch; n++) {
        for (int64_t o = 0; o < o_count; o++) {
            memcpy(dyt + o * p + n * out_size, dy + (n * o_count + o) * out_size, sizeof(float) * (size_t)out_size);
        }
    }
}

/* The chunks bnfuse_onednn_split gives this geometry (channel ranges, or one), run as tasks on the host's pool. */
static int run_chunks(gemm_call *call, const bnfuse_thread_pool *pool) {
    const bnfuse_conv_geometry *g = call->g;
    const int threads = pool != NULL ? pool->threads : 0;
    int axis;
    int64_t sizes[BNFUSE_ONEDNN_MAX_CHUNKS];
    int count = bnfuse_onednn_split(g, call->input_grad, threads, &axis, sizes, NULL, 0);
    if (count < 2 || axis != BNFUSE_ONEDNN_SPLIT_CHANNELS) {
        count = 1;
        sizes[0] = call->input_grad ? g->in_channels : g->out_channels;
    }
    call->threads = threads > 0 ? 1 : 0;
    call->first[0] = 0;
    for (int i = 0; i < count; i++) {
        call->first[i + 1] = call->first[i] + sizes[i];
    }
    if (count > 1 && pool->parallel_for != NULL) {
        if (pool->parallel_for(pool->pool, chunk_task, call, (size_t)count)) {
            return BNFUSE_ONEDNN_ERROR;
        }
    } else {
        for (int i = 0; i < count; i++) {
            chunk_task(call, (size_t)i);
        }
    }
    return call->failed ? BNFUSE_ONEDNN_ERROR : BNFUSE_ONEDNN_OK;
}

int bnfuse_gemm_weight_grad(const bnfuse_conv_geometry *g, const float *x, const float *dy, float *dw, void *scratch,
                            const bnfuse_thread_pool *pool) {
    float *col = scratch, *dyt = (float *)((char *)scratch + aligned(4 * unrolled_floats(g)));
    unroll(g, x, col);
    transpose_dy(g, dy, dyt);
    gemm_call call = {.g = g, .dyt = dyt, .col = col, .out = dw};
    return run_chunks(&call, pool);
}

int bnfuse_gemm_input_grad(const bnfuse_conv_geometry *g, const float *dy, const float *w, float *dx, void *scratch,
                           const bnfuse_thread_pool *pool) {
    float *dcol = scratch, *dyt = (float *)((char *)scratch + aligned(4 * unrolled_floats(g)));
    transpose_dy(g, dy, dyt);
    gemm_call call = {.g = g, .dyt = dyt, .w = w, .out = dx, .dcol = dcol, .input_grad = 1};
    return run_chunks(&call, pool);
}

int bnfuse_gemm_applies(const bnfuse_conv_geometry *g, int input_grad) {
    return input_grad ? bnfuse_gemm_input_grad_applies(g) : bnfuse_gemm_weight_grad_applies(g);
}

int bnfuse_gemm_gradient(const bnfuse_conv_geometry *g, int input_grad, const float *first, const float *second,
                         float *result, void *scratch, const bnfuse_thread_pool *pool) {
    return input_grad ? bnfuse_gemm_input_grad(g, first, second, result, scratch, pool)
                      : bnfuse_gemm_weight_grad(g, first, second, result, scratch, pool);
}
