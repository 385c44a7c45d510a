/* Direct loops for the convolution gradients oneDNN runs slowly: the weight gradient of a depthwise-style 2-D
 * convolution (one input channel per group) that oneDNN's depthwise backward-weights kernel refuses (5x5 kernels, a
 * kernel larger than the map, channel multipliers > 1): its GEMM fallback loops over the groups, 5-15 ms for 1152
 * channels of 2x2 with a 5x5 kernel at batch 4 (loaded machine), where this loop takes 0.4-0.8 ms.
 *
 * Determinism: each output channel's kernel is summed over (image, output row, output column) in that order by one
 * task, and tasks are ranges of output channels, so the bits depend on neither the thread count nor the pool. */
#include <stdlib.h>
#include <string.h>

#include "onednn_direct.h"

enum { LANES = 16 /* output channels computed side by side: one vector each on AVX-512, two on AVX2 */ };

/* oneDNN's own depthwise kernel takes kernels up to 3x3 that the input holds, with pads of at most half the kernel,
 * one output channel per group (measured, batch 4: 0.04-0.5 ms, where this loop is 0.1-1.5 ms); every other
 * depthwise geometry falls to its GEMM loop over the groups. */
static int onednn_depthwise_kernel(const bnfuse_conv_geometry *g) {
    if (g->out_channels != g->groups) {
        return 0;
    }
    for (int i = 0; i < 2; i++) {
        if (g->kernel[i] > 3 || g->input[i] < g->kernel[i] || 2 * g->pad_begin[i] > g->kernel[i] ||
            2 * g->pad_end[i] > g->kernel[i]) {
            return 0;
        }
    }
    return 1;
}

int bnfuse_direct_weight_grad_applies(const bnfuse_conv_geometry *g) {
    return g->spatial == 2 && g->x_block == 0 && g->groups > 1 && g->in_channels == g->groups &&
           !onednn_depthwise_kernel(g);
}

typedef struct {
    const bnfuse_conv_geometry *g;
    const float *x, *dy;
    float *dw;
    int64_t blocks_per_task; /* blocks of LANES output channels */
    int failed;
} direct_call;

/* One task: blocks [index * blocks_per_task, ...) of LANES output channels. Per block and image, X (zero-padded)
 * and dY are laid out channels-last in scratch buffers, so every product is a LANES-wide multiply-add of one
 * spatial position; each lane sums its own channel's products in (image, output row, output column) order. */
#if defined(__x86_64__) && defined(__GNUC__)
/* the lanes' multiply-adds as AVX-512 / AVX2 vectors where the CPU has them (the same bits: no contraction) */
#define DIRECT_CLONES __attribute__((noinline, target_clones("avx512f", "avx2", "default")))
#else
#define DIRECT_CLONES
#endif

DIRECT_CLONES static void weight_grad_blocks(void *user, size_t index) {
    direct_call *call = user;
    const bnfuse_conv_geometry *g = call->g;
    const int64_t out_channels = g->out_channels, multiplier = out_channels / g->groups;
    const int64_t ih = g->input[0], iw = g->input[1], oh = g->output[0], ow = g->output[1];
    const int64_t kh = g->kernel[0], kw = g->kernel[1], sh = g->stride[0], sw = g->stride[1];
    const int64_t dh = g->dilation[0], dwl = g->dilation[1], ph = g->pad_begin[0], pw = g->pad_begin[1];
    /* the padded extent every window reads (end pads may be cropped below ONNX's: the last window's reach) */
    const int64_t hp = (oh - 1) * sh + (kh - 1) * dh + 1, wp = (ow - 1) * sw + (kw - 1) * dwl + 1;
    const int64_t blocks = (out_channels + LANES - 1) / LANES;
    const int64_t first = (int64_t)index * call->blocks_per_task;
    int64_t last = first + call->blocks_per_task;
    last = last < blocks ? last : blocks;
    if (first >= last) {
        return;
    }
    const size_t x_floats = (size_t)(hp * wp) * LANES, dy_floats = (size_t)(oh * ow) * LANES;
    const size_t acc_floats = (size_t)(kh * kw) * LANES;
    float *scratch = malloc(sizeof(float) * (x_floats + dy_floats + acc_floats));
    if (scratch == NULL) {
        __atomic_store_n(&call->failed, 1, __ATOMIC_RELAXED);
        return;
    }
    float *xs = scratch, *dys = scratch + x_floats, *acc = dys + dy_floats;
    for (int64_t block = first; block < last; block++) {
        const int64_t o0 = block * LANES;
        const int64_t width = out_channels - o0 < LANES ? out_channels - o0 : LANES;
        memset(xs, 0, sizeof(float) * x_floats); /* the padding and the unused lanes stay 0 */
        memset(dys, 0, sizeof(float) * dy_floats);
        memset(acc, 0, sizeof(float) * acc_floats);
        for (int64_t n = 0; n < g->batch; n++) {
            for (int64_t lane = 0; lane < width; lane++) {
                const int64_t o = o0 + lane, c = o / multiplier; /* the group's one input channel */
                const float *x = call->x + (n * g->in_channels + c) * ih * iw;
                const float *dy = call->dy + (n * out_channels + o) * oh * ow;
                for (int64_t r = 0; r < hp; r++) {
                    const int64_t row = r - ph;
                    if (row < 0 || row >= ih) {
                        continue;
                    }
                    for (int64_t q = 0; q < wp; q++) {
                        const int64_t col = q - pw;
                        if (col >= 0 && col < iw) {
                            xs[(r * wp + q) * LANES + lane] = x[row * iw + col];
                        }
                    }
                }
                for (int64_t p = 0; p < oh * ow; p++) {
                    dys[p * LANES + lane] = dy[p];
                }
            }
            for (int64_t i = 0; i < kh; i++) {
                for (int64_t j = 0; j < kw; j++) {
                    float sum[LANES];
                    memcpy(sum, acc + (i * kw + j) * LANES, sizeof sum);
                    for (int64_t r = 0; r < oh; r++) {
                        const float *restrict xv = xs + ((r * sh + i * dh) * wp + j * dwl) * LANES;
                        const float *restrict dv = dys + r * ow * LANES;
                        for (int64_t q = 0; q < ow; q++) {
                            for (int lane = 0; lane < LANES; lane++) {
                                sum[lane] += xv[q * sw * LANES + lane] * dv[q * LANES + lane];
                            }
                        }
                    }
                    memcpy(acc + (i * kw + j) * LANES, sum, sizeof sum);
                }
            }
        }
        for (int64_t lane = 0; lane < width; lane++) {
            float *kernel = call->dw + (o0 + lane) * kh * kw;
            for (int64_t k = 0; k < kh * kw; k++) {
                kernel[k] = acc[k * LANES + lane];
            }
        }
    }
    free(scratch);
}

int bnfuse_direct_weight_grad(const bnfuse_conv_geometry *g, const float *x, const float *dy, float *dw,
                              const bnfuse_thread_pool *pool) {
    const int threads = pool != NULL ? pool->threads : 0;
    const int64_t blocks = (g->out_channels + LANES - 1) / LANES;
    direct_call call = {g, x, dy, dw, blocks, 0};
    size_t tasks = 1;
    if (threads > 1 && pool->parallel_for != NULL && blocks > 1) {
        call.blocks_per_task = (blocks + threads - 1) / threads;
        tasks = (size_t)((blocks + call.blocks_per_task - 1) / call.blocks_per_task);
    }
    if (tasks > 1) {
        if (pool->parallel_for(pool->pool, weight_grad_blocks, &call, tasks)) {
            return BNFUSE_ONEDNN_ERROR;
        }
    } else {
        weight_grad_blocks(&call, 0);
    }
    return call.failed ? BNFUSE_ONEDNN_ERROR : BNFUSE_ONEDNN_OK;
}
