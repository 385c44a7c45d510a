// Batch statistics for forward training: deterministic two-level reduction, no atomics.
//  1. bn_stats_partial_*: one block per (channel, chunk) computes count / mean / M2 of a fixed slice of the
//     channel's elements (Welford per thread, fixed-shape tree per block); partials are float64 (n exact).
//     The float32 arithmetic runs on x - pivot, pivot = the slice's first element (bn_pivot, bn_common.cu): the
//     values it accumulates are then of the data's spread, not of its offset, so a mean of 1e4 at std 1e-2
//     keeps the precision a float64 two-pass keeps (a float32 running mean of 1e4 is only known to 5e-4). The
//     pivot is added back in float64 when the partial is written.
//  2. bn_finalize_training: one thread per channel merges its chunks in index order (Chan, float64) and
//     writes mean, biased variance, inverse std and the updated running statistics.
// Layout: x is (outer, channels, inner), C-contiguous. The channels-first kernels use 1-D blocks over a
// channel's elements; the columns kernels (_cl) see x as (rows, columns) and use 32 x 8 blocks whose warps
// read 32 neighbouring columns of a row (coalesced). cuda.py picks by shape: columns = channels (inner == 1)
// or channels * inner (small inner), then the finalize merges a channel's columns and chunks.
#include "bn_common.cu"

// A block's (n, mean, M2) of x - pivot, written as float64 (n, mean of x, M2): pivot + mean is exact in
// float64 (two floats), so the offset never passes through float32 arithmetic.
__device__ __forceinline__ void bn_write_partial(double* __restrict__ p, BnStat s, float pivot) {
    p[0] = (double)s.n;
    p[1] = (double)pivot + (double)s.mean;
    p[2] = s.m2;
}

template <typename T, int VEC>
__device__ __forceinline__ void bn_stats_partial_cf_body(const T* __restrict__ x, i64 outer, i64 channels, i64 inner,
                                                         i64 chunk, i64 chunks, double* __restrict__ part) {
    i64 c = blockIdx.x / chunks;
    i64 b = blockIdx.x - c * chunks;
    i64 count = outer * inner;
    i64 start = b * chunk;
    i64 stop = start + chunk < count ? start + chunk : count;
    i64 o0 = start / inner;  // start < count: every block has at least one element
    float pivot = bn_pivot(bn_to_float(x[(o0 * channels + c) * inner + (start - o0 * inner)]));
    BnStat s = bn_stat_empty();
    if (VEC == 4) {  // inner % 4 == 0 and chunk % 4 == 0: a vector never leaves its row
        for (i64 m = start + 4 * (i64)threadIdx.x; m < stop; m += 4 * (i64)blockDim.x) {
            i64 o = m / inner;
            float4 v = bn_load4(x + (o * channels + c) * inner + (m - o * inner));
            bn_stat_add(s, v.x - pivot);
            bn_stat_add(s, v.y - pivot);
            bn_stat_add(s, v.z - pivot);
            bn_stat_add(s, v.w - pivot);
        }
    } else {
        for (i64 m = start + threadIdx.x; m < stop; m += blockDim.x) {
            i64 o = m / inner;
            bn_stat_add(s, bn_to_float(x[(o * channels + c) * inner + (m - o * inner)]) - pivot);
        }
    }
    s = bn_block_reduce_stat(s);
    if (threadIdx.x == 0) bn_write_partial(part + 3 * (c * chunks + b), s, pivot);
}

template <typename T>
__device__ __forceinline__ void bn_stats_partial_cl_body(const T* __restrict__ x, i64 rows, i64 channels,
                                                         i64 rows_per_chunk, double* __restrict__ part) {
    __shared__ BnStat tile[BN_CL_Y][BN_CL_X];
    i64 c = (i64)blockIdx.x * BN_CL_X + threadIdx.x;
    i64 b = blockIdx.y;
    i64 chunks = gridDim.y;
    i64 r0 = b * rows_per_chunk;
    i64 r1 = r0 + rows_per_chunk < rows ? r0 + rows_per_chunk : rows;
    float pivot = 0.f;
    BnStat s = bn_stat_empty();
    if (c < channels) {  // r0 < rows: every chunk has at least one row
        pivot = bn_pivot(bn_to_float(x[r0 * channels + c]));
        for (i64 r = r0 + threadIdx.y; r < r1; r += BN_CL_Y) {
            bn_stat_add(s, bn_to_float(x[r * channels + c]) - pivot);
        }
    }
    tile[threadIdx.y][threadIdx.x] = s;
    __syncthreads();
    if (threadIdx.y == 0 && c < channels) {
        for (int k = 1; k < BN_CL_Y; ++k) s = bn_stat_merge(s, tile[k][threadIdx.x]);
        bn_write_partial(part + 3 * (c * chunks + b), s, pivot);
    }
}

#define BN_STATS_KERNELS(SUFFIX, T)                                                                             \
    extern "C" __global__ void __launch_bounds__(BN_BLOCK)                                                       \
        bn_stats_partial_cf_##SUFFIX(const T* x, i64 outer, i64 channels, i64 inner, i64 chunk, i64 chunks,     \
                                     double* part) {                                                              \
        bn_stats_partial_cf_body<T, 1>(x, outer, channels, inner, chunk, chunks, part);                         \
    }                                                                                                            \
    extern "C" __global__ void __launch_bounds__(BN_BLOCK)                                                       \
        bn_stats_partial_cf4_##SUFFIX(const T* x, i64 outer, i64 channels, i64 inner, i64 chunk, i64 chunks,    \
                                      double* part) {                                                             \
        bn_stats_partial_cf_body<T, 4>(x, outer, channels, inner, chunk, chunks, part);                         \
    }                                                                                                            \
    extern "C" __global__ void __launch_bounds__(BN_CL_X* BN_CL_Y)                                               \
        bn_stats_partial_cl_##SUFFIX(const T* x, i64 rows, i64 channels, i64 rows_per_chunk, double* part) {    \
        bn_stats_partial_cl_body<T>(x, rows, channels, rows_per_chunk, part);                                   \
    }

BN_STATS_KERNELS(f32, float)
BN_STATS_KERNELS(f16, __half)
#ifndef BNFUSE_NO_BF16
BN_STATS_KERNELS(bf16, __nv_bfloat16)
#endif

// One thread per channel. Reads the running statistics before writing the new ones, so the outputs may
// alias the inputs (in-place update). weight: the batch statistic's weight w in running*(1-w) + batch*w;
// unbiased: M / (M - 1) or 1. mean_lo: what float32 rounding took off the mean (mu - (float)mu, 0 when mu
// is not finite as a float): the normalize folds it into its additive term, so y is centred on the float64 mean.
extern "C" __global__ void bn_finalize_training(const double* __restrict__ part, i64 channels, i64 chunks,
                                                const float* running_mean, const float* running_var, double eps,
                                                double weight, double unbiased, float* __restrict__ mean,
                                                float* __restrict__ var, float* __restrict__ inv_std,
                                                float* new_running_mean, float* new_running_var,
                                                float* __restrict__ mean_lo) {
    i64 c = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= channels) return;
    double n = 0.0, mu = 0.0, m2 = 0.0;
    for (i64 k = 0; k < chunks; ++k) {
        const double* p = part + 3 * (c * chunks + k);
        double bn = p[0];
        if (bn == 0.0) continue;
        double total = n + bn;
        if (n > 0.0 && (!isfinite(mu) || !isfinite((double)p[1]))) {  // as bn_stat_merge: plain-sum semantics
            mu += (double)p[1];
            m2 = __longlong_as_double(0x7ff8000000000000LL);  // variance about a non-finite mean: NaN
            n = total;
            continue;
        }
        double delta = (double)p[1] - mu;
        double w = bn / total;
        mu += delta * w;
        m2 += (double)p[2] + delta * delta * n * w;
        n = total;
    }
    double v = m2 / n;
    double rm = running_mean[c];
    double rv = running_var[c];
    float mu32 = (float)mu;
    mean[c] = mu32;
    mean_lo[c] = isfinite(mu32) ? (float)(mu - (double)mu32) : 0.f;
    var[c] = (float)v;
    inv_std[c] = (float)(1.0 / sqrt(v + eps));
    new_running_mean[c] = (float)(rm * (1.0 - weight) + mu * weight);
    new_running_var[c] = (float)(rv * (1.0 - weight) + v * unbiased * weight);
}
