// Backward: per-channel reductions sum(dy) and sum(dy * (x - mean)) (deterministic, same two-level shape as
// bn_stats.cu), a per-channel finalize (dScale, dBias with their alpha/beta blending, and the dX
// coefficients), then an elementwise dX in the reference's form (the differences are taken before the scaling
// by g * inv_std, so they cancel exactly where they should, e.g. one element per channel):
//   dx = alpha * k_dy * (dy + k_add + k_xc * (x - mean)) + beta * dx_prior
// batch statistics: k_dy = g * inv_std, k_add = -dBias / M, k_xc = -inv_std * dScale / M
// global statistics (DirectML): k_dy = g * inv_std, k_xc = k_add = 0
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
                                                        float* __restrict__ part, int relu) {
    i64 c = blockIdx.x / chunks;
    i64 b = blockIdx.x - c * chunks;
    i64 count = outer * inner;
    i64 start = b * chunk;
    i64 stop = start + chunk < count ? start + chunk : count;
    float m = center[c];
    float2 acc = make_float2(0.f, 0.f);
    if (VEC == 4) {
        for (i64 e = start + 4 * (i64)threadIdx.x; e < stop; e += 4 * (i64)blockDim.x) {
            i64 o = e / inner;
            i64 at = (o * channels + c) * inner + (e - o * inner);
            float4 g = bn_load4(dy + at);
            float4 xv = bn_load4(x + at);
            if (relu) {
                float4 a = bn_load4(act + at);
#pragma unroll
                for (int k = 0; k < 4; ++k) bn_lane(g, k) = bn_lane(a, k) <= 0.f ? 0.f : bn_lane(g, k);
            }
#pragma unroll
            for (int k = 0; k < 4; ++k) {
                acc.x += bn_lane(g, k);
                acc.y += bn_lane(g, k) * (bn_lane(xv, k) - m);
            }
        }
    } else {
        for (i64 e = start + threadIdx.x; e < stop; e += blockDim.x) {
            i64 o = e / inner;
            i64 at = (o * channels + c) * inner + (e - o * inner);
            float g = bn_masked(bn_to_float(dy[at]), act, at, relu);
            acc.x += g;
            acc.y += g * (bn_to_float(x[at]) - m);
        }
    }
    acc = bn_block_reduce_sum2(acc);
    if (threadIdx.x == 0) {
        part[2 * (c * chunks + b)] = acc.x;
        part[2 * (c * chunks + b) + 1] = acc.y;
    }
}

template <typename T>
__device__ __forceinline__ void bn_grad_partial_cl_body(const T* __restrict__ dy, const T* __restrict__ x,
                                                        const T* __restrict__ act, const float* __restrict__ center,
                                                        i64 rows, i64 channels, i64 rows_per_chunk,
                                                        float* __restrict__ part, int relu) {
    __shared__ float2 tile[BN_CL_Y][BN_CL_X];
    i64 c = (i64)blockIdx.x * BN_CL_X + threadIdx.x;
    i64 b = blockIdx.y;
    i64 chunks = gridDim.y;
    i64 r0 = b * rows_per_chunk;
    i64 r1 = r0 + rows_per_chunk < rows ? r0 + rows_per_chunk : rows;
    float2 acc = make_float2(0.f, 0.f);
    if (c < channels) {
        float m = center[c];
        for (i64 r = r0 + threadIdx.y; r < r1; r += BN_CL_Y) {
            float g = bn_masked(bn_to_float(dy[r * channels + c]), act, r * channels + c, relu);
            acc.x += g;
            acc.y += g * (bn_to_float(x[r * channels + c]) - m);
        }
    }
    tile[threadIdx.y][threadIdx.x] = acc;
    __syncthreads();
    if (threadIdx.y == 0 && c < channels) {
        for (int k = 1; k < BN_CL_Y; ++k) {
            acc.x += tile[k][threadIdx.x].x;
            acc.y += tile[k][threadIdx.x].y;
        }
        part[2 * (c * chunks + b)] = acc.x;
        part[2 * (c * chunks + b) + 1] = acc.y;
    }
}

template <typename T, int VEC>
__device__ __forceinline__ void bn_dx_body(const T* __restrict__ dy, const T* __restrict__ x,
                                           const T* __restrict__ act, T* dx, i64 total, i64 channels, i64 inner,
                                           const float* __restrict__ center, const float* __restrict__ k_dy,
                                           const float* __restrict__ k_xc, const float* __restrict__ k_add,
                                           float alpha, float beta, int relu) {
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
                float r = alpha * (k_dy[c] * (bn_lane(g, k) + k_add[c] + k_xc[c] * (bn_lane(xv, k) - center[c])));
                bn_lane(g, k) = beta != 0.f ? r + beta * bn_lane(prior, k) : r;
            }
            bn_store4(dx + e, g);
        }
    } else {
        for (i64 e = first; e < total; e += stride) {
            i64 c = bn_channel_of(e, channels, inner);
            float g = bn_masked(bn_to_float(dy[e]), act, e, relu);
            float r = alpha * (k_dy[c] * (g + k_add[c] + k_xc[c] * (bn_to_float(x[e]) - center[c])));
            if (beta != 0.f) r += beta * bn_to_float(dx[e]);
            dx[e] = bn_from_float<T>(r);
        }
    }
}

#define BN_BACKWARD_KERNELS(SUFFIX, T)                                                                            \
    extern "C" __global__ void __launch_bounds__(BN_BLOCK)                                                         \
        bn_grad_partial_cf_##SUFFIX(const T* dy, const T* x, const T* act, const float* center, i64 outer,        \
                                    i64 channels, i64 inner, i64 chunk, i64 chunks, float* part, int relu) {       \
        bn_grad_partial_cf_body<T, 1>(dy, x, act, center, outer, channels, inner, chunk, chunks, part, relu);     \
    }                                                                                                              \
    extern "C" __global__ void __launch_bounds__(BN_BLOCK)                                                         \
        bn_grad_partial_cf4_##SUFFIX(const T* dy, const T* x, const T* act, const float* center, i64 outer,       \
                                     i64 channels, i64 inner, i64 chunk, i64 chunks, float* part, int relu) {      \
        bn_grad_partial_cf_body<T, 4>(dy, x, act, center, outer, channels, inner, chunk, chunks, part, relu);     \
    }                                                                                                              \
    extern "C" __global__ void __launch_bounds__(BN_CL_X* BN_CL_Y)                                                 \
        bn_grad_partial_cl_##SUFFIX(const T* dy, const T* x, const T* act, const float* center, i64 rows,         \
                                    i64 channels, i64 rows_per_chunk, float* part, int relu) {                     \
        bn_grad_partial_cl_body<T>(dy, x, act, center, rows, channels, rows_per_chunk, part, relu);               \
    }                                                                                                              \
    extern "C" __global__ void __launch_bounds__(BN_BLOCK)                                                         \
        bn_dx_##SUFFIX(const T* dy, const T* x, const T* act, T* dx, i64 total, i64 channels, i64 inner,          \
                       const float* center, const float* k_dy, const float* k_xc, const float* k_add, float alpha, \
                       float beta, int relu) {                                                                     \
        bn_dx_body<T, 1>(dy, x, act, dx, total, channels, inner, center, k_dy, k_xc, k_add, alpha, beta, relu);   \
    }                                                                                                              \
    extern "C" __global__ void __launch_bounds__(BN_BLOCK)                                                         \
        bn_dx4_##SUFFIX(const T* dy, const T* x, const T* act, T* dx, i64 total, i64 channels, i64 inner,         \
                        const float* center, const float* k_dy, const float* k_xc, const float* k_add,             \
                        float alpha, float beta, int relu) {                                                       \
        bn_dx_body<T, 4>(dy, x, act, dx, total, channels, inner, center, k_dy, k_xc, k_add, alpha, beta, relu);   \
    }

BN_BACKWARD_KERNELS(f32, float)
BN_BACKWARD_KERNELS(f16, __half)
#ifndef BNFUSE_NO_BF16
BN_BACKWARD_KERNELS(bf16, __nv_bfloat16)
#endif

// One thread per channel: chunk partials summed in index order (float64), then dScale / dBias blended with
// alpha_param / beta_param (prior read only when beta_param != 0) and the dX coefficients.
extern "C" __global__ void bn_finalize_grad(const float* __restrict__ part, i64 channels, i64 chunks, double count,
                                            const float* __restrict__ gamma, const float* __restrict__ inv_std,
                                            int use_global_stats, int fix_gamma, float alpha_param,
                                            float beta_param, float* dscale, float* dbias, float* __restrict__ k_dy,
                                            float* __restrict__ k_xc, float* __restrict__ k_add) {
    i64 c = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= channels) return;
    double s_dy = 0.0, s_xc = 0.0;
    for (i64 k = 0; k < chunks; ++k) {
        s_dy += (double)part[2 * (c * chunks + k)];
        s_xc += (double)part[2 * (c * chunks + k) + 1];
    }
    double r = inv_std[c];
    double g = gamma[c];
    double ds = s_xc * r;
    double a = g * r;
    k_dy[c] = (float)a;
    k_xc[c] = use_global_stats ? 0.f : (float)(-r * ds / count);
    k_add[c] = use_global_stats ? 0.f : (float)(-s_dy / count);
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
