// Backward: per-channel reductions sum(dy) and sum(dy * (x - mean)) (deterministic, same two-level shape as
// bn_stats.cu; sum dy and sum(x - mean) in float64, sum (dy - P)(x - mean) about a pivot P, the block's first
// dy, so a dy with a large offset per channel keeps its precision: bn_common.cu, BnGradSums), a per-channel
// finalize (dScale, dBias with their alpha/beta blending, and the dX coefficients), then an elementwise dX in
// the reference's form (the differences are taken before the scaling by g * inv_std, so they cancel exactly
// where they should, e.g. one element per channel):
//   dx = alpha * k_dy * ((dy + k_add) + k_add_lo + k_xc * (x - mean)) + beta * dx_prior
// batch statistics: k_dy = g * inv_std, k_add + k_add_lo = -dBias / M (float32 and the remainder: dy + k_add is
// exact near dy's mean), k_xc = -inv_std * dScale / M
// global statistics (DirectML): k_dy = g * inv_std, k_xc = k_add = k_add_lo = 0
// relu != 0 (the fused activation): every kernel reads dy as 0 where the forward's activated output act <= 0
// (PyTorch's ReLU backward: NaN in act keeps dy); act is never read otherwise.
#include "bn_common.cu"

template <typename T>
__device__ __forceinline__ float bn_masked(float g, const T* __restrict__ act, i64 at, int relu) {
    return relu && bn_to_float(act[at]) <= 0.f ? 0.f : g;
}

template <typename T, int VEC>
__device__ __forceinline__ void bn_grad_partial_cf_body(const T* __restrict__ dy, const T* __restrict__ x,
                                                        const T* __restrict__ act, const float* __restrict__ center,
                                                        i64 outer, i64 channels, i64 inner, i64 chunk, i64 chunks,
                                                        double* __restrict__ part, int relu) {
    i64 c = blockIdx.x / chunks;
    i64 b = blockIdx.x - c * chunks;
    i64 count = outer * inner;
    i64 start = b * chunk;
    i64 stop = start + chunk < count ? start + chunk : count;
    float m = center[c];
    i64 o0 = start / inner;  // start < count: every block has at least one element
    i64 at0 = (o0 * channels + c) * inner + (start - o0 * inner);
    float pivot = bn_pivot(bn_masked(bn_to_float(dy[at0]), act, at0, relu));
    BnGradSums acc = {0.0, 0.f, 0.0};
    // The walk over (row o, offset r) advances without a 64-bit division per step (a subroutine call, around
    // which ptxas spilled the accumulators on sm_80).
    i64 step = VEC * (i64)blockDim.x;
    i64 step_o = step / inner;
    i64 step_r = step - step_o * inner;
    i64 first = start + VEC * (i64)threadIdx.x;
    i64 o = first / inner;
    i64 r = first - o * inner;
    if (VEC == 4) {
        for (i64 e = first; e < stop; e += step) {
            i64 at = (o * channels + c) * inner + r;
            r += step_r;
            o += step_o;
            if (r >= inner) {
                r -= inner;
                ++o;
            }
            float4 g = bn_load4(dy + at);
            float4 xv = bn_load4(x + at);
            if (relu) {
                float4 a = bn_load4(act + at);
#pragma unroll
                for (int k = 0; k < 4; ++k) bn_lane(g, k) = bn_lane(a, k) <= 0.f ? 0.f : bn_lane(g, k);
            }
#pragma unroll
            for (int k = 0; k < 4; ++k) {
                float xc = bn_lane(xv, k) - m;
                acc.x += (double)bn_lane(g, k);
                acc.y += (bn_lane(g, k) - pivot) * xc;
                acc.z += (double)xc;
            }
        }
    } else {
        for (i64 e = first; e < stop; e += step) {
            i64 at = (o * channels + c) * inner + r;
            r += step_r;
            o += step_o;
            if (r >= inner) {
                r -= inner;
                ++o;
            }
            float g = bn_masked(bn_to_float(dy[at]), act, at, relu);
            float xc = bn_to_float(x[at]) - m;
            acc.x += (double)g;
            acc.y += (g - pivot) * xc;
            acc.z += (double)xc;
        }
    }
    acc = bn_block_reduce_grad(acc);
    if (threadIdx.x == 0) bn_write_grad_partial(part + 2 * (c * chunks + b), acc, pivot);
}

template <typename T>
__device__ __forceinline__ void bn_grad_partial_cl_body(const T* __restrict__ dy, const T* __restrict__ x,
                                                        const T* __restrict__ act, const float* __restrict__ center,
                                                        i64 rows, i64 channels, i64 rows_per_chunk,
                                                        double* __restrict__ part, int relu) {
    __shared__ BnGradSums tile[BN_CL_Y][BN_CL_X];
    i64 c = (i64)blockIdx.x * BN_CL_X + threadIdx.x;
    i64 b = blockIdx.y;
    i64 chunks = gridDim.y;
    i64 r0 = b * rows_per_chunk;
    i64 r1 = r0 + rows_per_chunk < rows ? r0 + rows_per_chunk : rows;
    float pivot = 0.f;
    BnGradSums acc = {0.0, 0.f, 0.0};
    if (c < channels) {  // r0 < rows: every chunk has at least one row
        float m = center[c];
        pivot = bn_pivot(bn_masked(bn_to_float(dy[r0 * channels + c]), act, r0 * channels + c, relu));
        for (i64 r = r0 + threadIdx.y; r < r1; r += BN_CL_Y) {
            float g = bn_masked(bn_to_float(dy[r * channels + c]), act, r * channels + c, relu);
            float xc = bn_to_float(x[r * channels + c]) - m;
            acc.x += (double)g;
            acc.y += (g - pivot) * xc;
            acc.z += (double)xc;
        }
    }
    tile[threadIdx.y][threadIdx.x] = acc;
    __syncthreads();
    if (threadIdx.y == 0 && c < channels) {
        for (int k = 1; k < BN_CL_Y; ++k) {
            acc.x += tile[k][threadIdx.x].x;
            acc.y += tile[k][threadIdx.x].y;
            acc.z += tile[k][threadIdx.x].z;
        }
        bn_write_grad_partial(part + 2 * (c * chunks + b), acc, pivot);
    }
}

template <typename T, int VEC>
__device__ __forceinline__ void bn_dx_body(const T* __restrict__ dy, const T* __restrict__ x,
                                           const T* __restrict__ act, T* dx, i64 total, i64 channels, i64 inner,
                                           const float* __restrict__ center, const float* __restrict__ k_dy,
                                           const float* __restrict__ k_xc, const float* __restrict__ k_add,
                                           const float* __restrict__ k_add_lo, float alpha, float beta, int relu) {
    i64 stride = (i64)gridDim.x * blockDim.x;
    i64 first = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    if (VEC == 4) {
        for (i64 v = first; v < total / 4; v += stride) {
            i64 e = 4 * v;
            float4 g = bn_load4(dy + e);
            float4 xv = bn_load4(x + e);
            float4 prior = beta != 0.f ? bn_load4(dx + e) : make_float4(0.f, 0.f, 0.f, 0.f);
            if (relu) {
                float4 a = bn_load4(act + e);
#pragma unroll
                for (int k = 0; k < 4; ++k) bn_lane(g, k) = bn_lane(a, k) <= 0.f ? 0.f : bn_lane(g, k);
            }
            BnChannelWalk walk(e, channels, inner);
#pragma unroll
            for (int k = 0; k < 4; ++k, walk.next(channels, inner)) {
                i64 c = walk.channel;
                float r = (bn_lane(g, k) + k_add[c]) + k_add_lo[c] + k_xc[c] * (bn_lane(xv, k) - center[c]);
                r = alpha * (k_dy[c] * r);
                bn_lane(g, k) = beta != 0.f ? r + beta * bn_lane(prior, k) : r;
            }
            bn_store4(dx + e, g);
        }
    } else {
        for (i64 e = first; e < total; e += stride) {
            i64 c = bn_channel_of(e, channels, inner);
            float g = bn_masked(bn_to_float(dy[e]), act, e, relu);
            float r = (g + k_add[c]) + k_add_lo[c] + k_xc[c] * (bn_to_float(x[e]) - center[c]);
            r = alpha * (k_dy[c] * r);
            if (beta != 0.f) r += beta * bn_to_float(dx[e]);
            dx[e] = bn_from_float<T>(r);
        }
    }
}

#define BN_BACKWARD_KERNELS(SUFFIX, T)                                                                            \
    extern "C" __global__ void __launch_bounds__(BN_BLOCK)                                                         \
        bn_grad_partial_cf_##SUFFIX(const T* dy, const T* x, const T* act, const float* center, i64 outer,        \
                                    i64 channels, i64 inner, i64 chunk, i64 chunks, double* part, int relu) {       \
        bn_grad_partial_cf_body<T, 1>(dy, x, act, center, outer, channels, inner, chunk, chunks, part, relu);     \
    }                                                                                                              \
    extern "C" __global__ void __launch_bounds__(BN_BLOCK)                                                         \
        bn_grad_partial_cf4_##SUFFIX(const T* dy, const T* x, const T* act, const float* center, i64 outer,       \
                                     i64 channels, i64 inner, i64 chunk, i64 chunks, double* part, int relu) {      \
        bn_grad_partial_cf_body<T, 4>(dy, x, act, center, outer, channels, inner, chunk, chunks, part, relu);     \
    }                                                                                                              \
    extern "C" __global__ void __launch_bounds__(BN_CL_X* BN_CL_Y)                                                 \
        bn_grad_partial_cl_##SUFFIX(const T* dy, const T* x, const T* act, const float* center, i64 rows,         \
                                    i64 channels, i64 rows_per_chunk, double* part, int relu) {                     \
        bn_grad_partial_cl_body<T>(dy, x, act, center, rows, channels, rows_per_chunk, part, relu);               \
    }                                                                                                              \
    extern "C" __global__ void __launch_bounds__(BN_BLOCK)                                                         \
        bn_dx_##SUFFIX(const T* dy, const T* x, const T* act, T* dx, i64 total, i64 channels, i64 inner,          \
                       const float* center, const float* k_dy, const float* k_xc, const float* k_add,             \
                       const float* k_add_lo, float alpha, float beta, int relu) {                                 \
        bn_dx_body<T, 1>(dy, x, act, dx, total, channels, inner, center, k_dy, k_xc, k_add, k_add_lo, alpha, beta, \
                         relu);                                                                                    \
    }                                                                                                              \
    extern "C" __global__ void __launch_bounds__(BN_BLOCK)                                                         \
        bn_dx4_##SUFFIX(const T* dy, const T* x, const T* act, T* dx, i64 total, i64 channels, i64 inner,         \
                        const float* center, const float* k_dy, const float* k_xc, const float* k_add,             \
                        const float* k_add_lo, float alpha, float beta, int relu) {                                \
        bn_dx_body<T, 4>(dy, x, act, dx, total, channels, inner, center, k_dy, k_xc, k_add, k_add_lo, alpha, beta, \
                         relu);                                                                                    \
    }

BN_BACKWARD_KERNELS(f32, float)
BN_BACKWARD_KERNELS(f16, __half)
#ifndef BNFUSE_NO_BF16
BN_BACKWARD_KERNELS(bf16, __nv_bfloat16)
#endif

// One thread per channel: chunk partials (float64) summed in index order, then dScale / dBias blended with
// alpha_param / beta_param (prior read only when beta_param != 0) and the dX coefficients.
extern "C" __global__ void bn_finalize_grad(const double* __restrict__ part, i64 channels, i64 chunks, double count,
                                            const float* __restrict__ gamma, const float* __restrict__ inv_std,
                                            int use_global_stats, int fix_gamma, float alpha_param,
                                            float beta_param, float* dscale, float* dbias, float* __restrict__ k_dy,
                                            float* __restrict__ k_xc, float* __restrict__ k_add,
                                            float* __restrict__ k_add_lo) {
    i64 c = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= channels) return;
    double s_dy = 0.0, s_xc = 0.0;
    for (i64 k = 0; k < chunks; ++k) {
        s_dy += part[2 * (c * chunks + k)];
        s_xc += part[2 * (c * chunks + k) + 1];
    }
    double r = inv_std[c];
    double g = gamma[c];
    double ds = s_xc * r;
    double a = g * r;
    double add = -s_dy / count;
    float add32 = (float)add;
    k_dy[c] = (float)a;
    k_xc[c] = use_global_stats ? 0.f : (float)(-r * ds / count);
    k_add[c] = use_global_stats ? 0.f : add32;
    k_add_lo[c] = use_global_stats || !isfinite(add32) ? 0.f : (float)(add - (double)add32);
    double ds_out = fix_gamma ? 0.0 : ds;
    double new_ds = alpha_param * ds_out;
    double new_db = alpha_param * s_dy;
    if (beta_param != 0.f) {
        new_ds += beta_param * (double)dscale[c];
        new_db += beta_param * (double)dbias[c];
    }
    dscale[c] = (float)new_ds;
    dbias[c] = (float)new_db;
}
