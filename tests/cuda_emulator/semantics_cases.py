"""Small kernels that exercise one emulator rule each; run by test_emulator.py in a subprocess (with the cupy
stand-in on the path). Prints a JSON object: case -> {"error": message or null, "out": list or null}."""

from __future__ import annotations

import json
import sys

import cuda_emu
import cupy
import numpy as np

SOURCE = r"""
typedef long long i64;
extern "C" __global__ void shfl_all(const float* x, float* out, int kind, int arg, int width) {
    float v = x[threadIdx.x];
    float r = kind == 0 ? __shfl_down_sync(0xffffffffu, v, arg, width)
            : kind == 1 ? __shfl_up_sync(0xffffffffu, v, arg, width)
            : kind == 2 ? __shfl_xor_sync(0xffffffffu, v, arg, width)
                        : __shfl_sync(0xffffffffu, v, arg, width);
    out[threadIdx.x] = r;
}
extern "C" __global__ void shfl_divergent(float* out) {
    float v = threadIdx.x;
    if (threadIdx.x & 1) v = __shfl_down_sync(0xffffffffu, v, 1);
    else v = __shfl_down_sync(0xffffffffu, v, 2);
    out[threadIdx.x] = v;
}
extern "C" __global__ void shfl_after_exit(float* out) {
    if (threadIdx.x == 5) return;
    out[threadIdx.x] = __shfl_xor_sync(0xffffffffu, 1.f, 1);
}
extern "C" __global__ void shfl_partial_mask(float* out) {
    if (threadIdx.x < 16) out[threadIdx.x] = __shfl_down_sync(0x0000ffffu, (float)threadIdx.x, 8, 16);
}
extern "C" __global__ void shfl_outside_mask(float* out) {  // lanes 8..15 would read lanes 16..23
    if (threadIdx.x < 16) out[threadIdx.x] = __shfl_down_sync(0x0000ffffu, (float)threadIdx.x, 8);
}
extern "C" __global__ void shfl_short_block(float* out) {  // launched with 48 threads: lanes 16..31 of warp 1
    out[threadIdx.x] = __shfl_down_sync(0xffffffffu, (float)threadIdx.x, 1);
}
extern "C" __global__ void barrier_divergent(float* out) {
    if (threadIdx.x < 32) {
        __syncthreads();
    } else {
        __syncthreads();
    }
    out[threadIdx.x] = 1.f;
}
extern "C" __global__ void barrier_after_exit(float* out) {
    if (threadIdx.x == 0) return;
    __syncthreads();
    out[threadIdx.x] = 1.f;
}
extern "C" __global__ void barrier_ok(float* out) {
    __shared__ float tile[64];
    tile[threadIdx.x] = threadIdx.x;
    __syncthreads();
    out[threadIdx.x] = tile[63 - threadIdx.x];
}
extern "C" __global__ void shared_uninitialized(float* out) {
    __shared__ float tile[64];
    if (threadIdx.x == 0) tile[0] = 1.f;
    __syncthreads();
    out[threadIdx.x] = tile[threadIdx.x];
}
extern "C" __global__ void cross_block_race(float* out) {
    if (threadIdx.x == 0) out[0] = blockIdx.x;
}
extern "C" __global__ void out_of_bounds(float* out, i64 n) {
    out[n + threadIdx.x] = 1.f;
}
extern "C" __global__ void stack_overflow(float* out) {  // 1 MiB of locals: past the fiber's 256 KiB stack
    volatile float big[262144];
    big[threadIdx.x] = 1.f;
    out[threadIdx.x] = big[threadIdx.x];
}
extern "C" __global__ void __launch_bounds__(64) bounded(float* out, i64 n, double d, int k) {
    out[threadIdx.x] = (float)(n + d + k);
}
"""


def main() -> None:
    module = cupy.RawModule(code=SOURCE, options=("--std=c++17",))
    results: dict[str, dict] = {}

    def run(case: str, name: str, grid, block, args, out=None) -> None:
        try:
            module.get_function(name)(grid, block, args)
            results[case] = {"error": None, "out": None if out is None else cupy.asnumpy(out).tolist()}
        except (cuda_emu.EmulatorError, TypeError) as exc:
            results[case] = {"error": str(exc), "out": None}

    x = cupy.asarray(np.arange(32, dtype=np.float32) * 10)
    for kind, kind_name in enumerate(("down", "up", "xor", "idx")):
        for arg, width in ((1, 32), (3, 8), (5, 32), (17, 16)):
            out = cupy.empty(32, np.float32)
            run(f"shfl_{kind_name}_{arg}_{width}", "shfl_all", (1,), (32,),
                (x, out, np.int32(kind), np.int32(arg), np.int32(width)), out)  # fmt: skip
    out = cupy.empty(64, np.float32)
    run("shfl_divergent", "shfl_divergent", (1,), (32,), (out,))
    run("shfl_after_exit", "shfl_after_exit", (1,), (32,), (out,))
    run("shfl_partial_mask", "shfl_partial_mask", (1,), (32,), (out,), out)
    run("shfl_outside_mask", "shfl_outside_mask", (1,), (32,), (out,))
    run("shfl_short_block", "shfl_short_block", (1,), (48,), (out,))
    run("barrier_divergent", "barrier_divergent", (1,), (64,), (out,))
    run("barrier_after_exit", "barrier_after_exit", (1,), (64,), (out,))
    run("barrier_ok", "barrier_ok", (1,), (64,), (out,), out)
    run("shared_uninitialized", "shared_uninitialized", (1,), (64,), (out,), out)
    run("cross_block_race", "cross_block_race", (7,), (32,), (out,))
    small = cupy.empty(40, np.float32)
    run("out_of_bounds", "out_of_bounds", (1,), (32,), (small, np.int64(20)))
    run("stack_overflow", "stack_overflow", (1,), (32,), (out,))
    args = (out, np.int64(1), np.float64(0.5), np.int32(2))
    run("bounded_ok", "bounded", (1,), (64,), args, out)
    run("over_launch_bounds", "bounded", (1,), (128,), args)
    run("grid_y_limit", "bounded", (1, 65536), (32,), args)
    run("scalar_size", "bounded", (1,), (64,), (out, np.int32(1), np.float64(0.5), np.int32(2)))
    run("python_float", "bounded", (1,), (64,), (out, np.int64(1), 0.5, np.int32(2)))
    run("pointer_dtype", "bounded", (1,), (64,), (cupy.empty(64, np.float64), *args[1:]))
    run("host_array", "bounded", (1,), (64,), (np.zeros(64, np.float32), *args[1:]))
    results["empty_is_nan"] = {"error": None, "out": [bool(np.isnan(cupy.asnumpy(cupy.empty(8, np.float32))).all())]}
    json.dump(results, sys.stdout)


if __name__ == "__main__":
    main()
