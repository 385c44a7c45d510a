// Elementwise normalize: y = alpha * ((x - center) * mul + add) + beta * y_prior (cuDNN blending; the prior
// is read only when beta != 0). Forward inference passes center = mean, mul = gamma / sqrt(var + eps),
// add = bias; forward training passes the batch statistics. Grid-stride loop over a flat (outer, channels,
// inner) tensor; the 4-wide variant needs total % 4 == 0 and aligned x / y. relu != 0: the fused activation,
// y = max(y, 0) after the blending, keeping NaN and -0 (PyTorch's and onnxruntime's Relu).
#include "bn_common.cu"

template <typename T, int VEC>
__device__ __forceinline__ void bn_affine_body(const T* __restrict__ x, T* y, i64 total, i64 channels, i64 inner,
                                               const float* __restrict__ center, const float* __restrict__ mul,
                                               const float* __restrict__ add, float alpha, float beta, int relu) {
    i64 stride = (i64)gridDim.x * blockDim.x;
    i64 first = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    if (VEC == 4) {
        for (i64 v = first; v < total / 4; v += stride) {
            i64 e = 4 * v;
            float4 xv = bn_load4(x + e);
            float4 yv = beta != 0.f ? bn_load4(y + e) : make_float4(0.f, 0.f, 0.f, 0.f);
            BnChannelWalk walk(e, channels, inner);
#pragma unroll
            for (int k = 0; k < 4; ++k, walk.next(channels, inner)) {
                i64 c = walk.channel;
                float r = alpha * ((bn_lane(xv, k) - center[c]) * mul[c] + add[c]);
                r = beta != 0.f ? r + beta * bn_lane(yv, k) : r;
                bn_lane(xv, k) = relu && r < 0.f ? 0.f : r;
            }
            bn_store4(y + e, xv);
        }
    } else {
        for (i64 e = first; e < total; e += stride) {
            i64 c = bn_channel_of(e, channels, inner);
            float r = alpha * ((bn_to_float(x[e]) - center[c]) * mul[c] + add[c]);
            if (beta != 0.f) r += beta * bn_to_float(y[e]);
            if (relu && r < 0.f) r = 0.f;
            y[e] = bn_from_float<T>(r);
        }
    }
}

#define BN_AFFINE_KERNELS(SUFFIX, T)                                                                              \
    extern "C" __global__ void __launch_bounds__(BN_BLOCK)                                                         \
        bn_affine_##SUFFIX(const T* x, T* y, i64 total, i64 channels, i64 inner, const float* center,             \
                           const float* mul, const float* add, float alpha, float beta, int relu) {                \
        bn_affine_body<T, 1>(x, y, total, channels, inner, center, mul, add, alpha, beta, relu);                  \
    }                                                                                                              \
    extern "C" __global__ void __launch_bounds__(BN_BLOCK)                                                         \
        bn_affine4_##SUFFIX(const T* x, T* y, i64 total, i64 channels, i64 inner, const float* center,            \
                            const float* mul, const float* add, float alpha, float beta, int relu) {               \
        bn_affine_body<T, 4>(x, y, total, channels, inner, center, mul, add, alpha, beta, relu);                  \
    }

BN_AFFINE_KERNELS(f32, float)
BN_AFFINE_KERNELS(f16, __half)
#ifndef BNFUSE_NO_BF16
BN_AFFINE_KERNELS(bf16, __nv_bfloat16)
#endif
