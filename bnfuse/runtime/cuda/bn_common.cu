// Shared device helpers for bnfuse's batch-normalization kernels (included by the other .cu files).
// Written for NVRTC (CuPy RawModule) and nvcc alike: no host code, no C++ standard library headers.
#ifndef BNFUSE_BN_COMMON_CU
#define BNFUSE_BN_COMMON_CU

// bfloat16 kernels are built only when asked for: CuPy bundles cuda_fp16.h but not cuda_bf16.h (not
// redistributable), so the float32 / float16 build must not depend on it. -DBNFUSE_NO_BF16 leaves them out.
#include <cuda_fp16.h>
#ifndef BNFUSE_NO_BF16
#include <cuda_bf16.h>
#endif

typedef long long i64;

#define BN_FULL_MASK 0xffffffffu
// Launch geometry, defined once in cuda.py (KERNEL_DEFINES) and passed as -D options, so the launches and
// the __launch_bounds__ / shared tiles below cannot drift apart:
//   BN_BLOCK: threads per block of the 1-D kernels; BN_CL_X x BN_CL_Y: the channels-last reduction blocks
//   (BN_CL_X neighbouring columns per warp, coalesced; BN_CL_Y row lanes).
#if !defined(BN_BLOCK) || !defined(BN_CL_X) || !defined(BN_CL_Y)
#error "compile with cuda.py's KERNEL_DEFINES: -DBN_BLOCK=... -DBN_CL_X=... -DBN_CL_Y=..."
#endif
// The block reductions are warp trees: every warp full (blockDim.x % 32 == 0, also checked at launch).
static_assert(BN_BLOCK % 32 == 0 && BN_BLOCK <= 1024, "BN_BLOCK: a multiple of 32, at most 1024");
static_assert(BN_CL_X == 32 && BN_CL_X * BN_CL_Y <= 1024, "BN_CL_X: one warp of columns");
#define BN_NAN __int_as_float(0x7fc00000)  // quiet NaN, spelled out: no extra header for NVRTC to find

// ---- element conversions: all arithmetic is float32 ------------------------------------------------------
__device__ __forceinline__ float bn_to_float(float v) { return v; }
__device__ __forceinline__ float bn_to_float(__half v) { return __half2float(v); }
#ifndef BNFUSE_NO_BF16
__device__ __forceinline__ float bn_to_float(__nv_bfloat16 v) { return __bfloat162float(v); }
#endif

template <typename T> __device__ __forceinline__ T bn_from_float(float v);
template <> __device__ __forceinline__ float bn_from_float<float>(float v) { return v; }
template <> __device__ __forceinline__ __half bn_from_float<__half>(float v) { return __float2half_rn(v); }
#ifndef BNFUSE_NO_BF16
template <> __device__ __forceinline__ __nv_bfloat16 bn_from_float<__nv_bfloat16>(float v) {
    return __float2bfloat16_rn(v);
}
#endif

// ---- 4-wide vector loads and stores (callers guarantee alignment: 16 B for float, 8 B for 16-bit types) ----
// Values travel as float4 by value (no address-taken local arrays: those made ptxas spill on sm_90).
__device__ __forceinline__ float4 bn_load4(const float* p) { return *reinterpret_cast<const float4*>(p); }
__device__ __forceinline__ float4 bn_load4(const __half* p) {
    uint2 q = *reinterpret_cast<const uint2*>(p);
    float2 a = __half22float2(*reinterpret_cast<const __half2*>(&q.x));
    float2 b = __half22float2(*reinterpret_cast<const __half2*>(&q.y));
    return make_float4(a.x, a.y, b.x, b.y);
}
#ifndef BNFUSE_NO_BF16
__device__ __forceinline__ float4 bn_load4(const __nv_bfloat16* p) {
    uint2 q = *reinterpret_cast<const uint2*>(p);
    float2 a = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&q.x));
    float2 b = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&q.y));
    return make_float4(a.x, a.y, b.x, b.y);
}
#endif
__device__ __forceinline__ void bn_store4(float* p, float4 v) { *reinterpret_cast<float4*>(p) = v; }
__device__ __forceinline__ void bn_store4(__half* p, float4 v) {
    __half2 a = __floats2half2_rn(v.x, v.y);
    __half2 b = __floats2half2_rn(v.z, v.w);
    uint2 q;
    q.x = *reinterpret_cast<unsigned int*>(&a);
    q.y = *reinterpret_cast<unsigned int*>(&b);
    *reinterpret_cast<uint2*>(p) = q;
}
#ifndef BNFUSE_NO_BF16
__device__ __forceinline__ void bn_store4(__nv_bfloat16* p, float4 v) {
    __nv_bfloat162 a = __floats2bfloat162_rn(v.x, v.y);
    __nv_bfloat162 b = __floats2bfloat162_rn(v.z, v.w);
    uint2 q;
    q.x = *reinterpret_cast<unsigned int*>(&a);
    q.y = *reinterpret_cast<unsigned int*>(&b);
    *reinterpret_cast<uint2*>(p) = q;
}
#endif
// Lane k of a float4 (k is a compile-time constant after unrolling).
__device__ __forceinline__ float& bn_lane(float4& v, int k) { return k == 0 ? v.x : k == 1 ? v.y : k == 2 ? v.z : v.w; }

// ---- running statistics of a set of values: count, mean, sum of squared deviations (Welford / Chan) ------
// Stable for |mean| >> std (no E[x^2] - E[x]^2). NaN and Inf propagate as a plain sum would: once a mean is
// non-finite the updates add instead (the delta form computes Inf - Inf = NaN for an Inf mean).
// The count is an integer: a float count stops growing at 2^24 elements. 32 bits: one block's slice (a
// channel's chunk, at most 1/1024 of the channel above 16M elements) stays below 2^32 for any tensor under
// 2^42 elements; 64 bits made ptxas spill in the columns kernels (sm_80). Partials leave the block as float64.
struct BnStat {
    unsigned int n;
    float mean;
    float m2;
};

__device__ __forceinline__ BnStat bn_stat_empty() {
    BnStat s;
    s.n = 0;
    s.mean = 0.f;
    s.m2 = 0.f;
    return s;
}

__device__ __forceinline__ void bn_stat_add(BnStat& s, float x) {
    s.n += 1;
    if (!isfinite(s.mean)) {  // Inf + (-Inf) would turn an Inf mean into NaN: add as a plain sum does
        s.mean += x;
        s.m2 = BN_NAN;  // a plain two-pass variance about a non-finite mean is NaN
        return;
    }
    float d = x - s.mean;
    // __fdividef (2 ulp, no call): IEEE division's slow-path subroutine made ptxas spill around the call (sm_80).
    // The mean's step d / n only needs to be close: M2's update uses the mean it produced, so M2 stays exact to
    // first order, and the mean's drift is a few ulps of the spread (the data is pivot-shifted, bn_stats.cu).
    s.mean += __fdividef(d, (float)s.n);
    s.m2 += d * (x - s.mean);
}

__device__ __forceinline__ BnStat bn_stat_merge(BnStat a, BnStat b) {
    if (b.n == 0) return a;  // an empty side must not turn an Inf mean into NaN (0 * Inf)
    if (a.n == 0) return b;
    BnStat r;
    r.n = a.n + b.n;
    if (!isfinite(a.mean) || !isfinite(b.mean)) {  // a plain sum's result: Inf + finite = Inf, Inf - Inf = NaN
        r.mean = a.mean + b.mean;
        r.m2 = BN_NAN;
        return r;
    }
    float delta = b.mean - a.mean;
    float wb = (float)b.n / (float)r.n;
    r.mean = a.mean + delta * wb;
    r.m2 = a.m2 + b.m2 + delta * delta * (float)a.n * wb;
    return r;
}

__device__ __forceinline__ BnStat bn_shfl_down(BnStat s, int offset) {
    BnStat o;
    o.n = __shfl_down_sync(BN_FULL_MASK, s.n, offset);
    o.mean = __shfl_down_sync(BN_FULL_MASK, s.mean, offset);
    o.m2 = __shfl_down_sync(BN_FULL_MASK, s.m2, offset);
    return o;
}

// Fixed-shape tree over a 1-D block: the merge order depends only on blockDim, so results are bitwise
// reproducible run to run (no atomics). The result is valid in thread 0.
__device__ __forceinline__ BnStat bn_block_reduce_stat(BnStat s) {
    __shared__ BnStat warp_stats[32];
    for (int offset = 16; offset > 0; offset >>= 1) s = bn_stat_merge(s, bn_shfl_down(s, offset));
    int lane = threadIdx.x & 31;
    int warp = threadIdx.x >> 5;
    if (lane == 0) warp_stats[warp] = s;
    __syncthreads();
    if (warp == 0) {
        int warps = (blockDim.x + 31) >> 5;
        s = lane < warps ? warp_stats[lane] : bn_stat_empty();
        for (int offset = 16; offset > 0; offset >>= 1) s = bn_stat_merge(s, bn_shfl_down(s, offset));
    }
    return s;
}

// A block's shift for its sums: a value from its slice (the first), or 0 when that is Inf / NaN (x - Inf would
// turn every finite element into -Inf or NaN; with 0 the non-finite values propagate as a plain sum's do).
__device__ __forceinline__ float bn_pivot(float first) { return isfinite(first) ? first : 0.f; }

// The backward's per-block sums, with P a pivot of dy and m the saved mean: x = sum dy and z = sum (x - m) in
// float64, y = sum (dy - P) * (x - m) in float32. Then sum dy (x - m) = y + P z: a gradient with a large offset
// per channel no longer passes its offset through float32 sums (sum dy (x - m) would carry offset * sum (x - m)
// at float32 precision), and sum dy, from which dX subtracts dy's mean, is exact whatever the offset (a float32
// sum about a pivot would lose |P - mean| * n * eps instead, more than a plain float32 sum at mean 0).
struct BnGradSums {
    double x;
    float y;
    double z;
};

// Same fixed tree as bn_block_reduce_stat, for the backward's sums.
__device__ __forceinline__ BnGradSums bn_block_reduce_grad(BnGradSums v) {
    __shared__ BnGradSums warp_sums[32];
    for (int offset = 16; offset > 0; offset >>= 1) {
        v.x += __shfl_down_sync(BN_FULL_MASK, v.x, offset);
        v.y += __shfl_down_sync(BN_FULL_MASK, v.y, offset);
        v.z += __shfl_down_sync(BN_FULL_MASK, v.z, offset);
    }
    int lane = threadIdx.x & 31;
    int warp = threadIdx.x >> 5;
    if (lane == 0) warp_sums[warp] = v;
    __syncthreads();
    if (warp == 0) {
        int warps = (blockDim.x + 31) >> 5;
        if (lane < warps) {
            v = warp_sums[lane];
        } else {
            v.x = 0.0;
            v.y = 0.f;
            v.z = 0.0;
        }
        for (int offset = 16; offset > 0; offset >>= 1) {
            v.x += __shfl_down_sync(BN_FULL_MASK, v.x, offset);
            v.y += __shfl_down_sync(BN_FULL_MASK, v.y, offset);
            v.z += __shfl_down_sync(BN_FULL_MASK, v.z, offset);
        }
    }
    return v;
}

// A block's backward partial as two float64 sums: (sum dy, sum dy * (x - m)).
__device__ __forceinline__ void bn_write_grad_partial(double* __restrict__ p, BnGradSums v, float pivot) {
    p[0] = v.x;
    p[1] = (double)v.y + (double)pivot * v.z;
}

// Channel of flat element e in an (outer, channels, inner) tensor.
__device__ __forceinline__ i64 bn_channel_of(i64 e, i64 channels, i64 inner) { return (e / inner) % channels; }

// Walks the channels of consecutive elements with one division for the first (64-bit division is slow).
struct BnChannelWalk {
    i64 channel;
    i64 offset;  // position inside the current row of `inner` elements
    __device__ __forceinline__ BnChannelWalk(i64 e, i64 channels, i64 inner) {
        i64 row = e / inner;
        channel = row % channels;
        offset = e - row * inner;
    }
    __device__ __forceinline__ void next(i64 channels, i64 inner) {
        if (++offset == inner) {
            offset = 0;
            if (++channel == channels) channel = 0;
        }
    }
};

#endif  // BNFUSE_BN_COMMON_CU
