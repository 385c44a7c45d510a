// Force-included (g++ -include) ahead of an unmodified .cu file: CUDA device code compiled as host C++.
// The CUDA toolkit's own cuda_fp16.h / cuda_bf16.h / vector types compile as host C++, so half and bfloat16
// conversions are NVIDIA's code, bit for bit. Everything a kernel sees of the GPU (thread / block indices,
// __syncthreads, warp shuffles) goes through the fiber scheduler in fibers.cpp, one fiber per CUDA thread.
#ifndef BNFUSE_CUDA_EMU_H
#define BNFUSE_CUDA_EMU_H

#ifdef BNFUSE_EMU_SCAN
// Signature scan (g++ -E): kernels keep visible markers so cuda_emu.py can read names, bounds and parameters.
#define __global__ BNFUSE_GLOBAL
#define __launch_bounds__(...) BNFUSE_LAUNCH_BOUNDS(__VA_ARGS__)
#else
#define __global__
#define __launch_bounds__(...)
#endif
#define __shared__ static  // one instance per kernel module; blocks run one at a time and it is re-poisoned

#include <cuda_fp16.h>
#ifndef BNFUSE_NO_BF16
#include <cuda_bf16.h>
#endif
#include <vector_functions.h>
#include <vector_types.h>

#include <cmath>
#include <cstdint>
#include <cstring>

using std::isfinite;
using std::isinf;
using std::isnan;

namespace bnemu {

enum ShflKind { SHFL_DOWN = 0, SHFL_UP = 1, SHFL_XOR = 2, SHFL_IDX = 3 };

// The scheduler's view of the running CUDA thread (set on every fiber switch).
extern const uint3* current_thread_idx;
extern uint3 block_idx, block_dim, grid_dim;

void syncthreads(const char* file, int line);
uint64_t shfl(int kind, const char* file, int line, unsigned mask, uint64_t bits, int arg, int width);

template <typename T>
inline T shfl_typed(int kind, const char* file, int line, unsigned mask, T var, int arg, int width = 32) {
    static_assert(sizeof(T) <= 8, "a warp shuffle moves at most 64 bits");
    uint64_t bits = 0;
    std::memcpy(&bits, &var, sizeof(T));
    bits = shfl(kind, file, line, mask, bits, arg, width);
    T out;
    std::memcpy(&out, &bits, sizeof(T));
    return out;
}

template <typename To, typename From>
inline To bit_cast(From v) {
    static_assert(sizeof(To) == sizeof(From), "same size");
    To out;
    std::memcpy(&out, &v, sizeof(To));
    return out;
}

}  // namespace bnemu

#define threadIdx (*::bnemu::current_thread_idx)
#define blockIdx (static_cast<const uint3&>(::bnemu::block_idx))
#define blockDim (static_cast<const uint3&>(::bnemu::block_dim))
#define gridDim (static_cast<const uint3&>(::bnemu::grid_dim))
#define warpSize 32

// Each call site is one "instruction": threads meet in a barrier or a shuffle only at the same site.
#define __syncthreads() ::bnemu::syncthreads(__FILE__, __LINE__)
#define __shfl_down_sync(mask, var, ...) \
    ::bnemu::shfl_typed(::bnemu::SHFL_DOWN, __FILE__, __LINE__, mask, var, __VA_ARGS__)
#define __shfl_up_sync(mask, var, ...) ::bnemu::shfl_typed(::bnemu::SHFL_UP, __FILE__, __LINE__, mask, var, __VA_ARGS__)
#define __shfl_xor_sync(mask, var, ...) \
    ::bnemu::shfl_typed(::bnemu::SHFL_XOR, __FILE__, __LINE__, mask, var, __VA_ARGS__)
#define __shfl_sync(mask, var, ...) ::bnemu::shfl_typed(::bnemu::SHFL_IDX, __FILE__, __LINE__, mask, var, __VA_ARGS__)

inline float __int_as_float(int v) { return bnemu::bit_cast<float>(v); }
inline int __float_as_int(float v) { return bnemu::bit_cast<int>(v); }
inline double __longlong_as_double(long long v) { return bnemu::bit_cast<double>(v); }
inline long long __double_as_longlong(double v) { return bnemu::bit_cast<long long>(v); }
// The GPU's fast division is within 2 ulp of this (CUDA C Programming Guide, intrinsic functions).
inline float __fdividef(float a, float b) { return a / b; }

#endif  // BNFUSE_CUDA_EMU_H
