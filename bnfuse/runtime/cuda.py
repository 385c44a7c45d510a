"""CUDA BN kernels through CuPy: RawModules compiled from bnfuse/runtime/cuda/*.cu (NVRTC).

Same API as reference.py and cpu.py, on CuPy arrays, on CuPy's current device and stream (ops.py makes
that ORT's compute stream). CuPy is imported on first use, so ``import bnfuse`` works without it.

Work per call (x viewed as (outer, channels, inner), see kernel_types.Layout):

* statistics / gradient sums: a deterministic two-level reduction (bn_stats.cu, bn_backward.cu): blocks
  reduce fixed slices of each channel in a fixed-shape tree, then one thread per channel merges the slices
  in index order (float64). No atomics, so repeated runs are bitwise identical. Two kernel families, chosen
  by shape (_reduction_plan): channels-first (1-D blocks over one channel's elements) for large inner sizes
  or few columns, and columns (x seen as (outer, channels * inner), coalesced 32-column warps) for
  channels-last / per-activation data and small inner sizes.
* normalize and dX: grid-stride elementwise kernels (bn_forward.cu, bn_backward.cu), 4-wide vector
  loads and stores when the data is aligned and the element count divisible by 4.

Data float32, float16 or bfloat16 (when the array library has that dtype; those kernels are compiled
separately, only for bfloat16 data, as they need the CUDA toolkit's cuda_bf16.h); arithmetic float32
(per-channel finalization float64); parameters float32 or the data's type, converted to float32.
Any offset: the statistics kernels accumulate x - pivot (a block's first element) and add the pivot back in
float64, and the normalize centres on the float64 mean (float32 mean plus the remainder folded into its
additive term), so a channel at mean 1e4, std 1e-2 keeps float32 precision relative to its spread. The backward
sums dy and x - mean in float64 and (dy - pivot) * (x - mean) in float32, and dX subtracts dy's mean as a float32
value plus its remainder, so a gradient with a large offset per channel keeps its precision too.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import numpy as np

from bnfuse.runtime import reference
from bnfuse.runtime.kernel_types import (
    GradOutputs,
    Layout,
    TrainingOutputs,
    unbiased_factor,
    validate_backward,
    validate_inference,
    validate_training,
)
from bnfuse.runtime.semantics import BatchNormConfig, BatchNormError

SOURCE_DIR = Path(__file__).with_name("cuda")
SOURCES = ("bn_stats.cu", "bn_forward.cu", "bn_backward.cu")
BLOCK = 256  # threads per block of the 1-D kernels
CL_X, CL_Y = 32, 8  # columns reductions: 32 columns (one warp) x 8 row lanes per block
# The kernels get their geometry from here (bn_common.cu has no defaults), so the two cannot drift apart.
KERNEL_DEFINES = (f"-DBN_BLOCK={BLOCK}", f"-DBN_CL_X={CL_X}", f"-DBN_CL_Y={CL_Y}")
NVRTC_OPTIONS = ("--std=c++17", f"-I{SOURCE_DIR}", *KERNEL_DEFINES)
NO_BF16 = "-DBNFUSE_NO_BF16"  # float32 / float16 build: needs only cuda_fp16.h, which CuPy bundles
DATA_DTYPES = ("float32", "float16", "bfloat16")
SUFFIXES = {"float32": "f32", "float16": "f16", "bfloat16": "bf16"}
TARGET_CHUNK = 16384  # channels-first reductions: elements per block
CL_ROWS_PER_CHUNK = 128  # channels-last reductions: rows per block (at least)
MAX_CHUNKS = 1024
MAX_ELEMENTWISE_BLOCKS = 65535
MAX_CHANNEL_COUNT = 2**42  # a block's 32-bit element count (bn_common.cu BnStat) holds 1/1024 of this
SMALL_INNER = 32  # below this, channels-first warps read short runs: the columns kernels read whole rows


def kernel_names() -> dict[str, tuple[str, ...]]:
    """Every kernel this module launches, by source file (tests check the compiled PTX has them)."""
    per_type = {
        "bn_stats.cu": ("bn_stats_partial_cf_{}", "bn_stats_partial_cf4_{}", "bn_stats_partial_cl_{}"),
        "bn_forward.cu": ("bn_affine_{}", "bn_affine4_{}"),
        "bn_backward.cu": (
            "bn_grad_partial_cf_{}",
            "bn_grad_partial_cf4_{}",
            "bn_grad_partial_cl_{}",
            "bn_dx_{}",
            "bn_dx4_{}",
        ),
    }
    extra = {"bn_stats.cu": ("bn_finalize_training",), "bn_forward.cu": (), "bn_backward.cu": ("bn_finalize_grad",)}
    return {
        src: tuple(n.format(s) for n in names for s in SUFFIXES.values()) + extra[src]
        for src, names in per_type.items()
    }


# -- CuPy plumbing ------------------------------------------------------------------------------------------


def _cupy() -> Any:
    try:
        import cupy
    except ImportError as exc:
        raise BatchNormError("the cuda kernels need CuPy and a CUDA GPU (pip install 'bnfuse[gpu]')") from exc
    return cupy


@functools.cache
def _module(source: str, bf16: bool) -> Any:
    """One RawModule per source file and variant; CuPy compiles it (NVRTC) on first use and caches it.

    The bfloat16 variant needs cuda_bf16.h from a CUDA toolkit; float32 / float16 never depend on it.
    """
    cp = _cupy()
    options = NVRTC_OPTIONS if bf16 else (*NVRTC_OPTIONS, NO_BF16)
    return cp.RawModule(code=(SOURCE_DIR / source).read_text(), options=options)


def _launch(source: str, name: str, grid: tuple[int, ...], block: tuple[int, ...], args: tuple[Any, ...]) -> None:
    # The block reductions are warp trees over full warps (bn_common.cu).
    if block[0] % 32:
        raise BatchNormError(f"internal error: {name} launched with blockDim.x = {block[0]}, not a multiple of 32")
    _module(source, name.endswith("_bf16")).get_function(name)(grid, block, args)


def _i64(value: int) -> np.int64:
    return np.int64(value)


def _aligned(arrays: tuple[Any, ...], count: int) -> bool:
    """4-wide vector access is safe: count % 4 == 0 and every pointer aligned to 4 elements."""
    return count % 4 == 0 and all(a.data.ptr % (4 * a.dtype.itemsize) == 0 for a in arrays)


def _elementwise_grid(work: int) -> tuple[int]:
    return (max(1, min(MAX_ELEMENTWISE_BLOCKS, -(-work // BLOCK))),)


def _chunks_channels_first(count: int) -> tuple[int, int]:
    """(chunk, chunks): fixed slices of a channel's elements, a function of the shape only; chunk % 4 == 0."""
    chunks = max(1, min(MAX_CHUNKS, -(-count // TARGET_CHUNK)))
    chunk = -(-count // chunks)
    chunk += -chunk % 4
    return chunk, max(1, -(-count // chunk))


def _chunks_rows(rows: int) -> tuple[int, int]:
    """(rows_per_chunk, chunks) for the channels-last reductions."""
    chunks = max(1, min(MAX_CHUNKS, -(-rows // CL_ROWS_PER_CHUNK)))
    rows_per_chunk = -(-rows // chunks)
    return rows_per_chunk, max(1, -(-rows // rows_per_chunk))


class _ParamOut:
    """A float32 per-channel buffer for a kernel to write; ``out`` itself when it is float32 and contiguous."""

    def __init__(self, cp: Any, out: Any, channels: int, prior: bool = False):
        self.out = out
        if out is not None and out.dtype == np.float32 and out.flags.c_contiguous:
            self.buffer = out.reshape(channels)
        elif prior:
            self.buffer = cp.ascontiguousarray(out, dtype=np.float32).reshape(channels)
        else:
            self.buffer = cp.empty(channels, np.float32)

    def result(self, dtype: Any, shape: tuple[int, ...]) -> Any:
        if self.out is None:
            return self.buffer.reshape(shape).astype(dtype, copy=False)
        if self.buffer.data.ptr != self.out.data.ptr:
            self.out[...] = self.buffer.reshape(shape)
        return self.out


class _DataOut:
    """Where a data-shaped result is computed: ``out`` itself when contiguous (it always has x's dtype)."""

    def __init__(self, cp: Any, out: Any, like: Any, prior: bool):
        self.out = out
        if out is not None and out.flags.c_contiguous:
            self.buffer = out
        elif out is not None and prior:
            self.buffer = cp.ascontiguousarray(out)
        else:
            self.buffer = cp.empty(like.shape, like.dtype)

    def result(self) -> Any:
        if self.out is not None and self.buffer is not self.out:
            self.out[...] = self.buffer
            return self.out
        return self.buffer


def _f32(cp: Any, array: Any) -> Any:
    return cp.ascontiguousarray(array, dtype=np.float32).reshape(-1)


# -- launches -----------------------------------------------------------------------------------------------


def use_columns_kernels(lay: Layout) -> bool:
    """Columns kernels when a warp can read 32 neighbouring columns of a row: inner < 32 (channels-first warps
    would read runs shorter than a warp) and at least 32 columns (else most of each warp would idle)."""
    return lay.inner < SMALL_INNER and lay.channels * lay.inner >= CL_X


def _partial(
    kind: str, arrays: tuple[Any, ...], center: Any, lay: Layout, tail: tuple[Any, ...] = ()
) -> tuple[Any, int]:
    """Per-channel partials, shaped (channels, slices, width), float64: kind "stats" -> (n, mean, M2), kind
    "grad" -> (sum dy, sum dy*(x-c)); the finalize kernels merge a channel's slices in index order.
    ``tail``: the kernel's arguments after ``part`` (grad: the fused-ReLU flag)."""
    if lay.count >= MAX_CHANNEL_COUNT:
        raise BatchNormError(f"{lay.count} elements per channel: the CUDA reductions count up to 2^42")
    cp = _cupy()
    suffix = SUFFIXES[arrays[0].dtype.name]
    stats = kind == "stats"
    source, prefix, width = (
        ("bn_stats.cu", "bn_stats_partial", 3) if stats else ("bn_backward.cu", "bn_grad_partial", 2)
    )
    dtype = np.float64
    if use_columns_kernels(lay):
        # x as (outer, columns), column = channel * inner + i: partials (columns, chunks) = (channels,
        # inner * chunks) in memory, so a channel's slices are its columns' chunks.
        columns = lay.channels * lay.inner
        lead = () if center is None else (center if lay.inner == 1 else cp.repeat(center, lay.inner),)
        rows_per_chunk, chunks = _chunks_rows(lay.outer)
        part = cp.empty((lay.channels, lay.inner * chunks, width), dtype)
        grid = (-(-columns // CL_X), chunks)
        args = (*arrays, *lead, _i64(lay.outer), _i64(columns), _i64(rows_per_chunk), part, *tail)
        _launch(source, f"{prefix}_cl_{suffix}", grid, (CL_X, CL_Y), args)
        return part, lay.inner * chunks
    lead = () if center is None else (center,)
    chunk, chunks = _chunks_channels_first(lay.count)
    part = cp.empty((lay.channels, chunks, width), dtype)
    vector = lay.inner % 4 == 0 and _aligned(arrays, 4)
    name = f"{prefix}_cf{'4' if vector else ''}_{suffix}"
    args = (
        *arrays, *lead, _i64(lay.outer), _i64(lay.channels), _i64(lay.inner), _i64(chunk), _i64(chunks), part, *tail
    )  # fmt: skip
    _launch(source, name, (lay.channels * chunks,), (BLOCK,), args)
    return part, chunks


def _affine(
    x: Any, y: Any, lay: Layout, center: Any, mul: Any, add: Any, alpha: float, beta: float, relu: bool = False
) -> None:
    suffix = SUFFIXES[x.dtype.name]
    vector = _aligned((x, y), x.size)
    name = f"bn_affine{'4' if vector else ''}_{suffix}"
    work = x.size // 4 if vector else x.size
    args = (
        x,
        y,
        _i64(x.size),
        _i64(lay.channels),
        _i64(lay.inner),
        center,
        mul,
        add,
        np.float32(alpha),
        np.float32(beta),
        np.int32(relu),
    )
    _launch("bn_forward.cu", name, _elementwise_grid(work), (BLOCK,), args)


def _channel_grid(channels: int) -> tuple[int]:
    return (-(-channels // BLOCK),)


def _host_fallback(fn: Any, arrays: list[Any], out: Any, **kwargs: Any) -> Any:
    """Empty tensors: nothing for a kernel to do; the reference defines the (NaN) statistics."""
    cp = _cupy()
    host_out = None
    if out is not None:
        host_out = type(out)(*(cp.asnumpy(a) for a in out)) if isinstance(out, tuple) else cp.asnumpy(out)
    result = fn(*(cp.asnumpy(a) if not isinstance(a, BatchNormConfig) else a for a in arrays), out=host_out, **kwargs)
    if out is None:
        return type(result)(*(cp.asarray(a) for a in result)) if isinstance(result, tuple) else cp.asarray(result)
    if isinstance(out, tuple):
        for device, host in zip(out, result, strict=True):
            device[...] = cp.asarray(host)
        return out
    out[...] = cp.asarray(result)
    return out


def _gamma(cp: Any, scale: Any, config: BatchNormConfig, channels: int) -> Any:
    return cp.ones(channels, np.float32) if config.fix_gamma else _f32(cp, scale)


# -- public kernels ---------------------------------------------------------------------------------------


def forward_inference(
    x: Any,
    scale: Any,
    bias: Any,
    mean: Any,
    var: Any,
    config: BatchNormConfig,
    *,
    alpha: float = 1.0,
    beta: float = 0.0,
    out: Any = None,
) -> Any:
    params = {"scale": scale, "bias": bias, "mean": mean, "var": var}
    lay = validate_inference(x, params, config, alpha, beta, out, DATA_DTYPES, ())
    if x.size == 0:
        return _host_fallback(
            reference.forward_inference, [x, scale, bias, mean, var, config], out, alpha=alpha, beta=beta
        )
    cp = _cupy()
    x = cp.ascontiguousarray(x)
    inv_std = (1.0 / cp.sqrt(_f32(cp, var).astype(np.float64) + config.epsilon)).astype(np.float32)
    mul = _gamma(cp, scale, config, lay.channels) * inv_std
    sink = _DataOut(cp, out, x, prior=beta != 0)
    _affine(x, sink.buffer, lay, _f32(cp, mean), mul, _f32(cp, bias), alpha, beta)
    return sink.result()


def forward_training(
    x: Any,
    scale: Any,
    bias: Any,
    running_mean: Any,
    running_var: Any,
    config: BatchNormConfig,
    *,
    alpha: float = 1.0,
    beta: float = 0.0,
    out: TrainingOutputs | None = None,
) -> TrainingOutputs:
    params = {"scale": scale, "bias": bias, "running_mean": running_mean, "running_var": running_var}
    lay, pdtype = validate_training(x, params, config, alpha, beta, out, DATA_DTYPES, ())
    if x.size == 0:
        args = [x, scale, bias, running_mean, running_var, config]
        return _host_fallback(reference.forward_training, args, out, alpha=alpha, beta=beta)
    cp = _cupy()
    x = cp.ascontiguousarray(x)
    channels = lay.channels
    outs = out if out is not None else TrainingOutputs(None, None, None, None, None, None)
    rm, rv = _f32(cp, running_mean), _f32(cp, running_var)
    targets = [_ParamOut(cp, a, channels) for a in outs[1:]]
    new_rm, new_rv, mean, inv_std, var = (t.buffer for t in targets)
    mean_lo = None  # batch statistics: the float64 mean's remainder after rounding to float32 (bn_finalize_training)
    if config.use_global_stats:
        inv = (1.0 / cp.sqrt(rv.astype(np.float64) + config.epsilon)).astype(np.float32)
        for target, value in zip((mean, var, inv_std, new_rm, new_rv), (rm, rv, inv, rm, rv), strict=True):
            if target.data.ptr != value.data.ptr:
                target[...] = value
    else:
        part, chunks = _partial("stats", (x,), None, lay)
        weight = float(config.batch_weight)
        unbiased = unbiased_factor(lay.count) if config.unbiased_running_var else 1.0
        mean_lo = cp.empty(channels, np.float32)
        args = (part, _i64(channels), _i64(chunks), rm, rv, np.float64(config.epsilon), np.float64(weight),
                np.float64(unbiased), mean, var, inv_std, new_rm, new_rv, mean_lo)  # fmt: skip
        _launch("bn_stats.cu", "bn_finalize_training", _channel_grid(channels), (BLOCK,), args)
    mul = _gamma(cp, scale, config, channels) * inv_std
    add = _f32(cp, bias)
    if mean_lo is not None:
        # y = (x - mean32) * mul + (bias - mean_lo * mul): x - mean32 is exact near the mean, so y is centred on
        # the float64 mean even where float32 cannot hold it (a mean of 1e4 at std 1e-2).
        add = add - mean_lo * mul
    sink = _DataOut(cp, outs.y, x, prior=beta != 0)
    _affine(x, sink.buffer, lay, mean, mul, add, alpha, beta, relu=config.activation == "relu")
    shape = lay.param_shape
    return TrainingOutputs(sink.result(), *(t.result(pdtype, shape) for t in targets))


def backward(
    dy: Any,
    x: Any,
    scale: Any,
    saved_mean: Any,
    saved_inv_std: Any,
    config: BatchNormConfig,
    y: Any = None,
    *,
    alpha_data: float = 1.0,
    beta_data: float = 0.0,
    alpha_param: float = 1.0,
    beta_param: float = 0.0,
    out: GradOutputs | None = None,
) -> GradOutputs:
    params = {"scale": scale, "saved_mean": saved_mean, "saved_inv_std": saved_inv_std}
    blends = (alpha_data, beta_data, alpha_param, beta_param)
    lay, pdtype = validate_backward(dy, x, params, config, blends, out, DATA_DTYPES, (), y)
    blend = {"alpha_data": alpha_data, "beta_data": beta_data, "alpha_param": alpha_param, "beta_param": beta_param}
    if x.size == 0:
        activated = [] if y is None else [y]
        args = [dy, x, scale, saved_mean, saved_inv_std, config, *activated]
        return _host_fallback(reference.backward, args, out, **blend)
    cp = _cupy()
    x, dy = cp.ascontiguousarray(x), cp.ascontiguousarray(dy)
    relu = config.activation == "relu"
    act = cp.ascontiguousarray(y) if relu else dy  # the fused ReLU's mask source (never read without it)
    channels = lay.channels
    outs = out if out is not None else GradOutputs(None, None, None)
    center, inv_std = _f32(cp, saved_mean), _f32(cp, saved_inv_std)
    part, chunks = _partial("grad", (dy, x, act), center, lay, (np.int32(relu),))
    dscale = _ParamOut(cp, outs.dscale, channels, prior=beta_param != 0)
    dbias = _ParamOut(cp, outs.dbias, channels, prior=beta_param != 0)
    k_dy, k_xc, k_add, k_add_lo = (cp.empty(channels, np.float32) for _ in range(4))
    args = (part, _i64(channels), _i64(chunks), np.float64(lay.count), _gamma(cp, scale, config, channels), inv_std,
            np.int32(config.use_global_stats), np.int32(config.fix_gamma), np.float32(alpha_param),
            np.float32(beta_param), dscale.buffer, dbias.buffer, k_dy, k_xc, k_add, k_add_lo)  # fmt: skip
    _launch("bn_backward.cu", "bn_finalize_grad", _channel_grid(channels), (BLOCK,), args)
    sink = _DataOut(cp, outs.dx, x, prior=beta_data != 0)
    vector = _aligned((dy, x, act, sink.buffer), x.size)
    name = f"bn_dx{'4' if vector else ''}_{SUFFIXES[x.dtype.name]}"
    work = x.size // 4 if vector else x.size
    args = (dy, x, act, sink.buffer, _i64(x.size), _i64(channels), _i64(lay.inner), center, k_dy, k_xc, k_add,
            k_add_lo, np.float32(alpha_data), np.float32(beta_data), np.int32(relu))  # fmt: skip
    _launch("bn_backward.cu", name, _elementwise_grid(work), (BLOCK,), args)
    shape = lay.param_shape
    return GradOutputs(sink.result(), dscale.result(pdtype, shape), dbias.result(pdtype, shape))
