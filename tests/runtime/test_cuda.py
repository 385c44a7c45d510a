"""CuPy CUDA kernels against the float64 reference.

On a machine with CuPy and a GPU the GPU tests run on the GPU. Elsewhere (CI) test_gpu_tests_on_the_emulator
runs this same file in a subprocess whose ``cupy`` is tests/cuda_emulator's stand-in: the exact .cu sources,
compiled by g++ and run one fiber per CUDA thread with strict barrier / shuffle semantics (tests/README.md).
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
import xml.etree.ElementTree as ElementTree
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bnfuse.runtime import cuda
from bnfuse.runtime import reference as ref
from bnfuse.runtime.kernel_types import GradOutputs, Layout, TrainingOutputs
from bnfuse.runtime.semantics import BatchNormConfig, BatchNormError, Mode, param_shape
from tests.loaders import load_file


def _gpu_available() -> bool:
    if importlib.util.find_spec("cupy") is None:
        return False
    import cupy

    try:
        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:  # noqa: BLE001 - CUDA driver missing or broken: no usable GPU
        return False


needs_gpu = pytest.mark.skipif(
    not _gpu_available(),
    reason="no CuPy / GPU here: test_gpu_tests_on_the_emulator runs this test on the CUDA emulator (subprocess)",
)
EMULATOR_DIR = Path(__file__).resolve().parents[1] / "cuda_emulator"
# Set in the subprocess that runs this file on the emulator.
EMULATED_RUN = os.environ.get("BNFUSE_CUDA_EMULATED_RUN") == "1"
# CI (.ci/run) sets BNFUSE_REQUIRE_CUDA_EMULATOR=1: there a missing g++ / CUDA toolkit fails instead of skipping.
REQUIRE_EMULATOR = os.environ.get("BNFUSE_REQUIRE_CUDA_EMULATOR", "") not in ("", "0")


@pytest.mark.skipif(importlib.util.find_spec("cupy") is not None, reason="CuPy is installed")
def test_clear_error_without_cupy():
    x = np.zeros((2, 3), np.float32)
    with pytest.raises(BatchNormError, match="need CuPy"):
        cuda.forward_inference(x, *[np.ones(3, np.float32)] * 4, BatchNormConfig())


def test_validation_happens_before_cupy_is_needed():
    with pytest.raises(BatchNormError, match="rank must be 2 to 8"):
        cuda.forward_inference(np.zeros(3, np.float32), *[np.ones(3, np.float32)] * 4, BatchNormConfig())


def _inputs(config, shape, xdtype, pdtype, seed=0, loc=0.5):
    rng = np.random.default_rng(seed)
    p = param_shape(config, shape)
    return (
        rng.normal(loc, 2.0, size=shape).astype(xdtype),
        rng.normal(size=shape).astype(xdtype),
        rng.uniform(0.5, 2.0, p).astype(pdtype),
        rng.normal(size=p).astype(pdtype),
        rng.normal(size=p).astype(pdtype),
        rng.uniform(0.5, 3.0, p).astype(pdtype),
    )


def _close(got, want, dtype):
    import cupy

    _close_host(cupy.asnumpy(got), want, dtype)


def _close_host(got, want, dtype):
    got = np.asarray(got).astype(np.float64)
    want = np.asarray(want, dtype=np.float64)
    assert got.shape == want.shape
    finite = np.isfinite(want)  # Inf / NaN (e.g. a float16 gradient past 65504) must match exactly, and must
    np.testing.assert_array_equal(got[~finite], want[~finite])  # not make the tolerance below infinite
    scale = max(1.0, float(np.max(np.abs(want[finite]), initial=0.0)))
    tol = 3e-3 if np.dtype(dtype) == np.float16 else 2e-5
    np.testing.assert_allclose(got[finite], want[finite], rtol=tol, atol=tol * scale)


CONFIGS = {
    "nchw": ((4, 6, 9, 8), BatchNormConfig()),  # inner 72: vectorized channels-first
    "nchw_odd": ((3, 5, 7, 3), BatchNormConfig()),  # inner 21: scalar channels-first
    "nhwc": ((4, 9, 8, 6), BatchNormConfig(axis=-1)),  # channels-last kernels
    "per_activation": ((33, 5, 7), BatchNormConfig(mode=Mode.PER_ACTIVATION)),
    "rank2": ((300, 7), BatchNormConfig(epsilon=1e-3)),
    "pytorch_unbiased": (
        (4, 3, 40),
        BatchNormConfig(momentum=0.1, momentum_convention="pytorch", unbiased_running_var=True),
    ),
    "fix_gamma_global": ((4, 3, 40), BatchNormConfig(fix_gamma=True, use_global_stats=True)),
    "big": ((8, 16, 64, 64), BatchNormConfig()),  # several chunks per channel
}


@needs_gpu
@pytest.mark.parametrize(
    "xdtype, pdtype", [(np.float32, np.float32), (np.float16, np.float16), (np.float16, np.float32)]
)
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_matches_reference(name, xdtype, pdtype):
    import cupy

    shape, config = CONFIGS[name]
    x, dy, scale, bias, mean, var = _inputs(config, shape, xdtype, pdtype)
    d = [cupy.asarray(a) for a in (x, dy, scale, bias, mean, var)]
    _close(
        cuda.forward_inference(d[0], *d[2:], config), ref.forward_inference(x, scale, bias, mean, var, config), xdtype
    )
    got = cuda.forward_training(d[0], *d[2:], config)
    want = ref.forward_training(x, scale, bias, mean, var, config)
    for field, a, b in zip(TrainingOutputs._fields, got, want, strict=True):
        _close(a, b, xdtype if field == "y" else pdtype)
    saved = [cupy.asarray(want.saved_mean), cupy.asarray(want.saved_inv_std)]
    g = cuda.backward(d[1], d[0], d[2], *saved, config)
    r = ref.backward(dy, x, scale, want.saved_mean, want.saved_inv_std, config)
    for a, b in zip(g, r, strict=True):
        _close(a, b, xdtype)


@needs_gpu
def test_blending_out_and_determinism():
    import cupy

    config = BatchNormConfig()
    x, dy, scale, bias, mean, var = _inputs(config, (8, 16, 32, 32), np.float32, np.float32)
    d = [cupy.asarray(a) for a in (x, dy, scale, bias, mean, var)]
    prior = np.random.default_rng(1).normal(size=x.shape).astype(np.float32)
    out = TrainingOutputs(cupy.asarray(prior), *(cupy.empty(16, np.float32) for _ in range(5)))
    got = cuda.forward_training(d[0], *d[2:], config, alpha=0.5, beta=2.0, out=out)
    assert all(a is b for a, b in zip(got, out, strict=True))
    want = ref.forward_training(
        x,
        scale,
        bias,
        mean,
        var,
        config,
        alpha=0.5,
        beta=2.0,
        out=TrainingOutputs(prior.copy(), *(np.empty(16, np.float32) for _ in range(5))),
    )
    for a, b in zip(got, want, strict=True):
        _close(a, b, np.float32)
    gp = GradOutputs(cupy.asarray(prior), cupy.ones(16, np.float32), cupy.ones(16, np.float32))
    cuda.backward(
        d[1],
        d[0],
        d[2],
        got.saved_mean,
        got.saved_inv_std,
        config,
        alpha_data=2.0,
        beta_data=1.0,
        alpha_param=1.0,
        beta_param=-1.0,
        out=gp,
    )
    r = ref.backward(
        dy,
        x,
        scale,
        want.saved_mean,
        want.saved_inv_std,
        config,
        alpha_data=2.0,
        beta_data=1.0,
        alpha_param=1.0,
        beta_param=-1.0,
        out=GradOutputs(prior.copy(), np.ones(16, np.float32), np.ones(16, np.float32)),
    )
    for a, b in zip(gp, r, strict=True):
        _close(a, b, np.float32)
    runs = [cuda.forward_training(d[0], *d[2:], config) for _ in range(3)]
    grads = [cuda.backward(d[1], d[0], d[2], runs[0].saved_mean, runs[0].saved_inv_std, config) for _ in range(3)]
    for later in runs[1:]:
        for a, b in zip(runs[0], later, strict=True):
            assert cupy.asnumpy(a).tobytes() == cupy.asnumpy(b).tobytes()
    for later in grads[1:]:
        for a, b in zip(grads[0], later, strict=True):
            assert cupy.asnumpy(a).tobytes() == cupy.asnumpy(b).tobytes()


# Statistics at any offset: channel means 0, 1e3 and 1e4 at std 1 and 1e-2 (|mean| / std up to 1e6), on each
# reduction family with several blocks per channel. A float32 running mean of 1e4 is only known to ~5e-4, so
# the kernels work on x - pivot and centre y on the float64 mean (bn_stats.cu, cuda.forward_training); the
# backward sums dy - pivot and subtracts dy's mean in two parts (bn_backward.cu).
OFFSETS = (0.0, 1e3, 1e4)
SPREADS = (1.0, 1e-2)
OFFSET_SHAPES = {
    "cf4": ((2, 2, 96, 96), 1),  # inner 9216: vectorized channels-first, 2 chunks per channel
    "cf": ((2, 2, 9, 1023), 1),  # inner 9207: scalar channels-first, 2 chunks per channel
    "columns": ((20, 8, 8, 32), -1),  # channels-last columns kernels: 10 chunks of 128 rows
}
VARIANCE_RTOL = 1e-5  # float32 inputs: what the issue asks; fp16 / bf16 values convert to float32 exactly


def _offset_data(shape, axis, offset, spread, dtype, seed=5):
    """x at mean ``offset``, std ``spread``; dy at the same offset, std 1 (a gradient with a common part)."""
    rng = np.random.default_rng(seed)
    x = (offset + spread * rng.normal(size=shape)).astype(dtype)
    dy = (offset + rng.normal(size=shape)).astype(dtype)
    c = shape[axis]
    return x, dy, rng.uniform(0.5, 2.0, c).astype(np.float32), rng.normal(size=c).astype(np.float32)


@needs_gpu
@pytest.mark.parametrize("path", sorted(OFFSET_SHAPES))
@pytest.mark.parametrize("dtype_name", ["float32", "float16", "bfloat16"])
def test_statistics_exact_at_any_offset(dtype_name, path):
    """Variance within 1e-5 relative of float64 (exactly 0 where the data is constant), the mean within one
    float32 ulp plus 1e-6 std, y and the backward within the data type's error bound, at every offset and spread
    (dy at the same offset as x: the backward's sums and dX's mean subtraction hold a gradient's offset too)."""
    import cupy

    dtype = next((d for d in _data_dtypes() if d.name == dtype_name), None)
    if dtype is None:
        pytest.skip(f"no {dtype_name} here (ml_dtypes, or CuPy without bfloat16 arrays)")
    shape, axis = OFFSET_SHAPES[path]
    config = BatchNormConfig(axis=axis)
    channels = shape[axis]
    from bnfuse.runtime.kernel_types import layout

    assert cuda.use_columns_kernels(layout(config, shape)) is (path == "columns")
    running = (np.zeros(channels, np.float32), np.ones(channels, np.float32))
    for offset in OFFSETS:
        for spread in SPREADS:
            where = f"{path} {dtype_name} mean {offset:g} std {spread:g}"
            x, dy, scale, bias = _offset_data(shape, axis, offset, spread, dtype)
            per_channel = np.moveaxis(x.astype(np.float64), axis, 0).reshape(channels, -1)
            mean64, var64 = per_channel.mean(axis=1), per_channel.var(axis=1)
            d = [cupy.asarray(a) for a in (x, dy, scale, bias, *running)]
            got = cuda.forward_training(d[0], *d[2:], config)
            want = ref.forward_training(x, scale, bias, *running, config)
            var = cupy.asnumpy(got.batch_var).astype(np.float64)
            assert np.all(np.abs(var - var64) <= VARIANCE_RTOL * var64), (where, var, var64)
            mean = cupy.asnumpy(got.saved_mean).astype(np.float64)
            rounding = np.spacing(np.abs(mean64).astype(np.float32)).astype(np.float64)  # the float32 output's ulp
            assert np.all(np.abs(mean - mean64) <= rounding + 1e-6 * np.sqrt(var64)), (where, mean, mean64)
            for field, a, b in zip(TrainingOutputs._fields, got, want, strict=True):
                bound = ERROR_BOUNDS[dtype_name if field == "y" else "float32"]
                assert _relative_error(cupy.asnumpy(a), b) <= bound, (where, field)
            saved = (want.saved_mean, want.saved_inv_std)
            g = cuda.backward(d[1], d[0], d[2], *(cupy.asarray(a) for a in saved), config)
            r = ref.backward(dy, x, scale, *saved, config)
            for field, a, b in zip(GradOutputs._fields, g, r, strict=True):
                bound = ERROR_BOUNDS[dtype_name if field == "dx" else "float32"]
                assert _relative_error(cupy.asnumpy(a), b) <= bound, (where, field)


# -- the CPU tests' configurations and hypothesis strategies, on the GPU -------------------------------------------


cpu_tests = load_file(Path(__file__).with_name("test_cpu.py"), "_bnfuse_cpu_tests")  # its configs and strategies


def _device_io() -> dict:
    import cupy

    return {"to_device": cupy.asarray, "to_host": cupy.asnumpy, "close": _close_host}


@needs_gpu
@pytest.mark.parametrize("xdtype, pdtype", cpu_tests.DTYPES, ids=["f32", "f16", "f16_f32params"])
@pytest.mark.parametrize("name", sorted(cpu_tests.CONFIGS))
def test_matches_reference_cpu_configs(name, xdtype, pdtype):
    """axis=2, ranks 5-8, cudnn / mindspore conventions, fix_gamma alone, use_global_stats alone, ..."""
    shape, config = cpu_tests.CONFIGS[name]
    cpu_tests.check_backend(cuda, config, shape, xdtype, pdtype, **_device_io())


# The CPU tests' locations plus large offsets: the CUDA statistics hold any |mean| / std (small draws give
# ratios far past 1e4), so no case is assumed away.
GPU_LOCS = (0.0, 3.0, -50.0, 1e3, -1e4)


@needs_gpu
@settings(max_examples=25, deadline=None)
@given(case=cpu_tests.bn_cases(max_rank=8), loc=st.sampled_from(GPU_LOCS))
def test_matches_reference_hypothesis(case, loc):
    cpu_tests.check_backend(cuda, **{**case, "loc": loc}, **_device_io())


@needs_gpu
@pytest.mark.parametrize("blend", [(0.5, -1.5), (2.0, 0.25)])
@pytest.mark.parametrize(
    "shape, axis", [((4, 6, 9, 8), 1), ((3, 5, 7, 3), 1), ((4, 9, 8, 6), -1), ((5, 7, 3), -1)], ids=str
)
@pytest.mark.parametrize("xdtype", [np.float32, np.float16])
def test_blending_every_call_and_layout(shape, axis, blend, xdtype):
    """forward_inference, forward_training and backward blend alike: vectorized, scalar and channels-last."""
    cpu_tests.check_backend(cuda, BatchNormConfig(axis=axis), shape, xdtype, xdtype, blend=blend, **_device_io())


@needs_gpu
@pytest.mark.parametrize("shape", [(1, 34), (1, 7), (1, 5, 1, 1)], ids=str)
def test_one_element_per_channel_backward_cancels_exactly(shape):
    """M = 1: x equals its mean and dy its mean, so dx is exactly 0 (the reference's value). Found by hypothesis
    on the emulator: the old dx = k_dy * dy + k_add form left float32 rounding of g * inv_std * dy (~3e-5)."""
    import cupy

    config = BatchNormConfig()
    x, dy, scale, bias, mean, var = (cupy.asarray(a) for a in _inputs(config, shape, np.float32, np.float32))
    t = cuda.forward_training(x, scale, bias, mean, var, config)
    g = cuda.backward(dy, x, scale, t.saved_mean, t.saved_inv_std, config)
    assert np.array_equal(cupy.asnumpy(t.saved_mean), cupy.asnumpy(x).reshape(-1))
    assert np.all(cupy.asnumpy(g.dx) == 0.0)


@needs_gpu
@pytest.mark.parametrize("shape, axis", [((64, 16, 16, 40), -1), ((300, 7), 1), ((33, 5, 7), 1)])
def test_channels_last_bitwise_deterministic(shape, axis):
    import cupy

    mode = Mode.PER_ACTIVATION if len(shape) == 3 else Mode.SPATIAL
    config = BatchNormConfig(axis=axis, mode=mode)
    x, dy, scale, bias, mean, var = (cupy.asarray(a) for a in _inputs(config, shape, np.float32, np.float32))

    def run() -> list[bytes]:
        t = cuda.forward_training(x, scale, bias, mean, var, config)
        g = cuda.backward(dy, x, scale, t.saved_mean, t.saved_inv_std, config)
        return [cupy.asnumpy(a).tobytes() for a in (*t, *g)]

    first = run()
    for _ in range(3):
        assert run() == first


@needs_gpu
@pytest.mark.parametrize(
    "shape, axis", [((4, 3, 9, 8), 1), ((3, 3, 7, 3), 1), ((8, 3, 64, 64), 1), ((300, 5, 3), -1)], ids=str
)
@pytest.mark.parametrize("first", [True, False], ids=["inf_first", "inf_later"])
def test_nan_and_inf_propagate_like_reference(shape, axis, first):
    """Channel 0 gets a NaN, channel 1 a +Inf (first element or late): mean +Inf, var NaN, as a plain sum gives."""
    import cupy

    config = BatchNormConfig(axis=axis)
    x, dy, scale, bias, mean, var = _inputs(config, shape, np.float32, np.float32)
    per_channel = np.moveaxis(x, axis, 0)  # a view: writes through .flat land in x
    per_channel[0].flat[3] = np.nan
    per_channel[1].flat[0 if first else per_channel[1].size - 2] = np.inf
    got = cuda.forward_training(*(cupy.asarray(a) for a in (x, scale, bias, mean, var)), config)
    want = ref.forward_training(x, scale, bias, mean, var, config)
    assert want.saved_mean[1] == np.inf and np.isnan(want.batch_var[1])
    for a, b in zip(got, want, strict=True):
        a = cupy.asnumpy(a)
        np.testing.assert_array_equal(np.isnan(a), np.isnan(b))
        np.testing.assert_array_equal(np.isinf(a), np.isinf(b))
        np.testing.assert_array_equal(np.sign(a[np.isinf(a)]), np.sign(b[np.isinf(b)]))
    finite = np.isfinite(want.saved_mean)
    np.testing.assert_allclose(cupy.asnumpy(got.saved_mean)[finite], want.saved_mean[finite], rtol=2e-5, atol=2e-5)


@needs_gpu
@pytest.mark.parametrize(
    "shape", [(4, 3, 40), (3, 5, 7, 3), (300, 7)], ids=["channels_first_vector", "columns_scalar", "channels_first"]
)
def test_bfloat16_where_supported(shape):
    ml_dtypes = pytest.importorskip("ml_dtypes")
    import cupy

    try:
        cupy.asarray(np.zeros(4, ml_dtypes.bfloat16))
    except Exception as exc:  # noqa: BLE001 - this CuPy has no bfloat16 arrays
        pytest.skip(f"CuPy cannot hold bfloat16 arrays: {exc}")
    config = BatchNormConfig()
    x, dy, scale, bias, mean, var = _inputs(config, shape, np.float32, np.float32)
    xb, dyb = x.astype(ml_dtypes.bfloat16), dy.astype(ml_dtypes.bfloat16)
    d = [cupy.asarray(a) for a in (xb, dyb, scale, bias, mean, var)]
    got = cuda.forward_training(d[0], *d[2:], config)
    want = ref.forward_training(xb, scale, bias, mean, var, config)
    assert got.y.dtype == xb.dtype
    for a, b in zip(got, want, strict=True):
        np.testing.assert_allclose(cupy.asnumpy(a).astype(np.float64), b.astype(np.float64), rtol=1e-2, atol=2e-2)
    g = cuda.backward(d[1], d[0], d[2], cupy.asarray(want.saved_mean), cupy.asarray(want.saved_inv_std), config)
    r = ref.backward(dyb, xb, scale, want.saved_mean, want.saved_inv_std, config)
    for a, b in zip(g, r, strict=True):
        tol = 2e-2 * float(np.abs(b.astype(np.float64)).max())
        np.testing.assert_allclose(cupy.asnumpy(a).astype(np.float64), b.astype(np.float64), rtol=1e-2, atol=tol)


# -- the GPU statistics algorithm, emulated in NumPy float32 (runs everywhere) ----------------------------------
# Follows bn_stats.cu / bn_common.cu step by step: per-thread Welford over the thread's strided elements minus
# the block's pivot (bn_stat_add), a warp tree of Chan merges by __shfl_down_sync offsets 16..1 (a lane whose
# source is past lane 31 merges its own value), warp 0 merging the 8 warp results the same way (lanes >= 8
# empty), or for channels-last the column of 8 row lanes merged in order; then bn_finalize_training's float64
# merge of the chunks in index order (pivot added back). Chunk geometry comes from cuda.py itself. FMA
# contraction aside, the same operations. fixed=False replays the old formulas (no non-finite branch), which
# turned an Inf mean into NaN; shift=False the kernels before the pivot.

F32 = np.float32
BnState = tuple[np.ndarray, np.ndarray, np.ndarray]  # n, mean, M2: float32 arrays of one shape


def _empty(shape) -> BnState:
    return np.zeros(shape, F32), np.zeros(shape, F32), np.zeros(shape, F32)


def _add(s: BnState, x: np.ndarray, valid: np.ndarray, fixed: bool) -> BnState:
    n, mean, m2 = s
    with np.errstate(all="ignore"):
        n1 = n + F32(1)
        d = x - mean
        mean1 = mean + d / n1
        m21 = m2 + d * (x - mean1)
        if fixed:  # bn_stat_add: once the mean is non-finite, add as a plain sum; M2 is NaN
            bad = ~np.isfinite(mean)
            mean1 = np.where(bad, mean + x, mean1)
            m21 = np.where(bad, F32(np.nan), m21)
    return np.where(valid, n1, n), np.where(valid, mean1, mean), np.where(valid, m21, m2)


def _merge(a: BnState, b: BnState, fixed: bool = True) -> BnState:
    (n_a, mean_a, m2_a), (n_b, mean_b, m2_b) = a, b
    with np.errstate(all="ignore"):
        n = n_a + n_b
        delta = mean_b - mean_a
        w_b = n_b / np.where(n > 0, n, F32(1))
        mean = mean_a + delta * w_b
        m2 = m2_a + m2_b + delta * delta * n_a * w_b
        if fixed:  # bn_stat_merge: a plain sum's result when either mean is non-finite
            bad = ~(np.isfinite(mean_a) & np.isfinite(mean_b))
            mean = np.where(bad, mean_a + mean_b, mean)
            m2 = np.where(bad, F32(np.nan), m2)
    mean = np.where(n_b == 0, mean_a, np.where(n_a == 0, mean_b, mean))
    m2 = np.where(n_b == 0, m2_a, np.where(n_a == 0, m2_b, m2))
    return n, mean.astype(F32), m2.astype(F32)


def _warp_tree(s: BnState, fixed: bool) -> BnState:
    """Fields shaped (warps, 32): for offset 16..1 lane i merges lane i + offset (its own value past 31)."""
    lanes = np.arange(32)
    for offset in (16, 8, 4, 2, 1):
        src = np.where(lanes + offset < 32, lanes + offset, lanes)
        s = _merge(s, tuple(f[:, src] for f in s), fixed)
    return s


def _block_reduce(s: BnState, fixed: bool) -> tuple[float, float, float]:
    """bn_block_reduce_stat over 256 threads: warp trees, then warp 0 over the warps' lane-0 results."""
    s = _warp_tree(tuple(f.reshape(-1, 32) for f in s), fixed)
    warps = s[0].shape[0]
    s = tuple(np.concatenate([f[:, 0], np.zeros(32 - warps, F32)])[None, :] for f in s)
    s = _warp_tree(s, fixed)
    return tuple(float(f[0, 0]) for f in s)


def _pivot(first: np.ndarray, shift: bool) -> np.ndarray:
    """bn_pivot: a block's first element, 0 where it is not finite (or when replaying the unshifted kernels)."""
    return np.where(np.isfinite(first) & shift, first, F32(0)).astype(F32)


def _cf_partial(piece: np.ndarray, vec: int, fixed: bool, shift: bool = True) -> tuple[float, float, float]:
    """bn_stats_partial_cf_body: thread t adds elements t, t + 256, ... (vec 4: 4t..4t+3, then + 1024), each
    minus the pivot; bn_write_partial adds the pivot back in float64."""
    pivot = _pivot(piece[0], shift)
    with np.errstate(invalid="ignore"):
        piece = piece - pivot
    block = cuda.BLOCK
    per_step = block * vec
    steps = -(-piece.size // per_step)
    padded = np.zeros(steps * per_step, F32)
    padded[: piece.size] = piece
    valid = np.arange(steps * per_step) < piece.size
    shape = (steps, block, vec)  # [k, t, j] = element k * 256 * vec + t * vec + j
    padded, valid = padded.reshape(shape), valid.reshape(shape)
    s = _empty(block)
    for k in range(steps):
        for j in range(vec):
            s = _add(s, padded[k, :, j], valid[k, :, j], fixed)
    n, mean, m2 = _block_reduce(s, fixed)
    return n, float(np.float64(pivot) + mean), m2


def _finalize(parts, fixed: bool) -> tuple[float, float]:
    """bn_finalize_training: float64 Chan merges of the chunks in index order; (mean, biased variance)."""
    n = mu = m2 = 0.0
    with np.errstate(all="ignore"):
        for bn, bmean, bm2 in parts:
            if bn == 0:
                continue
            total = n + bn
            if fixed and n > 0 and not (np.isfinite(mu) and np.isfinite(bmean)):
                mu, m2, n = mu + bmean, np.nan, total
                continue
            delta = np.float64(bmean) - mu
            w = bn / total
            mu += delta * w
            m2 += bm2 + delta * delta * n * w
            n = total
        return float(mu), float(np.float64(m2) / n)


def _emulated_channel_stats(
    values: np.ndarray, vec: int = 1, fixed: bool = True, shift: bool = True
) -> tuple[float, float]:
    """One channel's (mean, var) as bn_stats_partial_cf{,4} + bn_finalize_training compute them."""
    values = values.astype(F32)
    chunk, chunks = cuda._chunks_channels_first(values.size)
    parts = [_cf_partial(values[b * chunk : (b + 1) * chunk], vec, fixed, shift) for b in range(chunks)]
    return _finalize(parts, fixed)


def _emulated_rows_stats(x: np.ndarray, fixed: bool = True, shift: bool = True) -> list[tuple[float, float]]:
    """(rows, channels) channels-last: bn_stats_partial_cl_body's 8 row lanes (x minus the chunk's first row,
    per column), merged in order per chunk."""
    x = x.astype(F32)
    rows, channels = x.shape
    rows_per_chunk, chunks = cuda._chunks_rows(rows)
    parts = []
    for b in range(chunks):
        r0, r1 = b * rows_per_chunk, min(rows, (b + 1) * rows_per_chunk)
        pivot = _pivot(x[r0], shift)
        with np.errstate(invalid="ignore"):
            shifted = x - pivot
        s = _empty((cuda.CL_Y, channels))  # [y, c]: thread (c, y) adds rows r0 + y, r0 + y + 8, ...
        for r in range(r0, r1, cuda.CL_Y):
            lane_rows = r + np.arange(cuda.CL_Y)
            valid = (lane_rows < r1)[:, None]
            s = _add(s, shifted[np.minimum(lane_rows, r1 - 1)], np.broadcast_to(valid, s[0].shape), fixed)
        n, mean, m2 = tuple(f[0] for f in s)
        for k in range(1, cuda.CL_Y):
            n, mean, m2 = _merge((n, mean, m2), tuple(f[k] for f in s), fixed)
        parts.append((n, pivot.astype(np.float64) + mean, m2))
    return [_finalize([tuple(float(f[c]) for f in p) for p in parts], fixed) for c in range(channels)]


@pytest.mark.parametrize("path", ["cf", "cf4", "rows"])
@pytest.mark.parametrize("spread", [1.0, 1e-2])
@pytest.mark.parametrize("loc", [0.0, 1e3, 1e4, -3e3])
def test_gpu_statistics_algorithm_is_stable_emulated(loc, spread, path):
    """|mean| / std up to 1e6 in float32: variance within 1e-5 of the float64 value, mean within float64 rounding
    of the spread; the unshifted kernels (a float32 running mean of the offset) miss at 1e4 / 1e-2."""
    rng = np.random.default_rng(11)

    def run(shift: bool) -> tuple[list[np.ndarray], list[tuple[float, float]]]:
        if path == "rows":
            x = (loc + spread * rng.normal(size=(3000, 3))).astype(np.float32)  # 24 chunks of 125 rows
            return [x[:, c] for c in range(x.shape[1])], _emulated_rows_stats(x, shift=shift)
        values = (loc + spread * rng.normal(size=40000)).astype(np.float32)  # 3 chunks of 13336
        return [values], [_emulated_channel_stats(values, vec=4 if path == "cf4" else 1, shift=shift)]

    columns, got = run(shift=True)
    for values, (mean, var) in zip(columns, got, strict=True):
        exact = values.astype(np.float64)
        assert abs(mean - exact.mean()) <= 1e-6 * exact.std()
        assert var == pytest.approx(exact.var(), rel=1e-5)
    if loc == 1e4 and spread == 1e-2:  # the check has teeth: the kernels before the pivot fail it
        columns, got = run(shift=False)
        errors = [abs(var / values.astype(np.float64).var() - 1) for values, (_, var) in zip(columns, got, strict=True)]
        assert max(errors) > 1e-5


# Non-finite values at various places: first / middle / last element, a thread's last element, a later chunk.
NONFINITE_CASES = {
    "inf_first": ({0: np.inf}, np.inf),
    "inf_middle": ({20000: np.inf}, np.inf),
    "inf_thread_last": ({39999 - 255: np.inf}, np.inf),
    "minus_inf_late_chunk": ({39000: -np.inf}, -np.inf),
    "two_inf_same_sign": ({5: np.inf, 30000: np.inf}, np.inf),
    "inf_minus_inf": ({5: np.inf, 30000: -np.inf}, np.nan),
    "nan": ({777: np.nan}, np.nan),
}


@pytest.mark.parametrize("path", ["cf", "cf4", "rows"])
@pytest.mark.parametrize("case", sorted(NONFINITE_CASES))
def test_gpu_statistics_nonfinite_like_a_plain_sum_emulated(case, path):
    """An Inf among finite values gives mean = Inf and var = NaN, as the float64 reference (a plain sum) does."""
    positions, want_mean = NONFINITE_CASES[case]
    values = np.random.default_rng(3).normal(size=40000).astype(np.float32)
    for index, value in positions.items():
        values[index] = value
    with np.errstate(invalid="ignore"):
        assert np.array_equal(np.float64(values).mean(), want_mean, equal_nan=True)  # the reference's answer

    def run(fixed: bool) -> tuple[float, float]:
        if path == "rows":  # (rows, 4) channels-last; the channel holding the values
            columns = values.reshape(4, -1).T.copy()
            return _emulated_rows_stats(columns, fixed)[min(positions) // columns.shape[0]]
        return _emulated_channel_stats(values, vec=4 if path == "cf4" else 1, fixed=fixed)

    if path == "rows":
        column = values.reshape(4, -1)[min(positions) // 10000]
        with np.errstate(invalid="ignore"):
            want_mean = np.float64(column).mean()
    mean, var = run(fixed=True)
    assert np.array_equal(mean, want_mean, equal_nan=True), (mean, want_mean)
    assert np.isnan(var)
    if np.isinf(want_mean):
        assert np.isnan(run(fixed=False)[0])  # the old formulas computed Inf - Inf: the test has teeth


# -- errors against the float64 reference, per data type (printed in the test output) ---------------------------

ERROR_BOUNDS = {"float32": 2e-5, "float16": 4e-3, "bfloat16": 3e-2}  # max |got - want| / max(1, max |want|)
ERROR_SHAPES = {
    "nchw (8,16,32,32)": ((8, 16, 32, 32), BatchNormConfig()),
    "nchw_odd (6,5,7,3)": ((6, 5, 7, 3), BatchNormConfig()),
    "nhwc (16,9,9,40)": ((16, 9, 9, 40), BatchNormConfig(axis=-1)),
}


def _data_dtypes() -> list:
    """float32, float16 and bfloat16 where ml_dtypes gives NumPy the type and CuPy can hold it on the device."""
    out = [np.dtype(np.float32), np.dtype(np.float16)]
    if importlib.util.find_spec("ml_dtypes") is not None:
        import cupy
        import ml_dtypes

        try:
            cupy.asarray(np.zeros(4, ml_dtypes.bfloat16))
        except Exception:  # noqa: BLE001 - this CuPy has no bfloat16 arrays: the bf16 rows are left out
            return out
        out.append(np.dtype(ml_dtypes.bfloat16))
    return out


def _relative_error(got, want) -> float:
    """max |got - want| / max(1, max |want|) over want's finite values; inf unless got has the same Inf / NaN
    elsewhere (a float16 output past 65504 is Inf in the reference too)."""
    got = np.asarray(got).astype(np.float64)
    want = np.asarray(want).astype(np.float64)
    finite = np.isfinite(want)
    if not np.array_equal(got[~finite], want[~finite], equal_nan=True):
        return float("inf")
    if not finite.any():
        return 0.0
    return float(np.max(np.abs(got[finite] - want[finite])) / max(1.0, float(np.max(np.abs(want[finite])))))


@needs_gpu
def test_error_table_against_float64_reference():
    """fp32 / fp16 / bf16 data (float32 parameters): every output's error vs the float64 reference, bounded."""
    import cupy

    rows = []
    for dtype in _data_dtypes():
        for label, (shape, config) in ERROR_SHAPES.items():
            x, dy, scale, bias, mean, var = _inputs(config, shape, np.float32, np.float32)
            x, dy = x.astype(dtype), dy.astype(dtype)
            d = [cupy.asarray(a) for a in (x, dy, scale, bias, mean, var)]
            errors = {"inference y": _relative_error(
                cupy.asnumpy(cuda.forward_inference(d[0], *d[2:], config)),
                ref.forward_inference(x, scale, bias, mean, var, config))}  # fmt: skip
            got = cuda.forward_training(d[0], *d[2:], config)
            want = ref.forward_training(x, scale, bias, mean, var, config)
            for field, a, b in zip(TrainingOutputs._fields, got, want, strict=True):
                errors[f"training {field}"] = _relative_error(cupy.asnumpy(a), b)
            saved = [cupy.asarray(want.saved_mean), cupy.asarray(want.saved_inv_std)]
            g = cuda.backward(d[1], d[0], d[2], *saved, config)
            r = ref.backward(dy, x, scale, want.saved_mean, want.saved_inv_std, config)
            for field, a, b in zip(GradOutputs._fields, g, r, strict=True):
                errors[f"backward {field}"] = _relative_error(cupy.asnumpy(a), b)
            rows += [{"dtype": dtype.name, "shape": label, "output": k, "error": v} for k, v in errors.items()]
    worst = {}
    for row in rows:
        worst[row["dtype"]] = max(worst.get(row["dtype"], 0.0), row["error"])
    print("\n".join(f"{r['dtype']:>9} {r['shape']:<20} {r['output']:<24} {r['error']:.3e}" for r in rows))
    if os.environ.get("BNFUSE_CUDA_ERROR_REPORT"):
        Path(os.environ["BNFUSE_CUDA_ERROR_REPORT"]).write_text(json.dumps(rows))
    for dtype, error in worst.items():
        assert error <= ERROR_BOUNDS[dtype], (dtype, error)
    assert {"float32", "float16"} <= set(worst)


# -- the GPU tests above, on the CUDA emulator (CI) ----------------------------------------------------------------


def test_ci_requires_the_emulator():
    """.ci/run exports BNFUSE_REQUIRE_CUDA_EMULATOR before the test command, so CI never skips the emulated run."""
    lines = (Path(__file__).resolve().parents[2] / ".ci" / "run").read_text().splitlines()
    test_line = next(i for i, line in enumerate(lines) if "pytest" in line and not line.startswith("#"))
    assert "export BNFUSE_REQUIRE_CUDA_EMULATOR=1" in lines[:test_line]


ALLOWED_EMULATED_SKIPS = {"test_clear_error_without_cupy", "test_gpu_tests_on_the_emulator"}


def _emulator_problem() -> str | None:
    spec = importlib.util.spec_from_file_location(
        "_bnfuse_cuda_emu", EMULATOR_DIR / "cuda_emu" / "__init__.py", submodule_search_locations=[]
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module.available()


@pytest.mark.skipif(EMULATED_RUN, reason="this is the emulator run")
@pytest.mark.skipif(_gpu_available(), reason="a real GPU runs the GPU tests directly")
def test_gpu_tests_on_the_emulator(tmp_path, report_lines):
    """Every GPU test of this file passes on the emulator, in a subprocess (a fault cannot take the suite down),
    every kernel cuda.py names is launched at least once, and the error table is reported."""
    problem = _emulator_problem()
    if problem:
        if REQUIRE_EMULATOR:
            pytest.fail(f"BNFUSE_REQUIRE_CUDA_EMULATOR is set but the CUDA emulator cannot run: {problem}")
        pytest.skip(f"CUDA emulator unavailable: {problem}")
    root = Path(__file__).resolve().parents[2]
    junit, launches, errors = tmp_path / "junit.xml", tmp_path / "launches.txt", tmp_path / "errors.json"
    path = [str(EMULATOR_DIR), *filter(None, [os.environ.get("PYTHONPATH")])]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(path), "BNFUSE_CUDA_EMULATED_RUN": "1",
           "BNFUSE_EMU_LAUNCH_LOG": str(launches), "BNFUSE_CUDA_ERROR_REPORT": str(errors)}  # fmt: skip
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={junit}",
               str(Path(__file__).resolve())]  # fmt: skip
    run = subprocess.run(command, cwd=root, env=env, capture_output=True, text=True, timeout=3000)
    assert run.returncode == 0, run.stdout[-8000:] + run.stderr[-4000:]
    outcomes = {}
    for case in ElementTree.parse(junit).iter("testcase"):
        kind = next((child.tag for child in case if child.tag in ("skipped", "failure", "error")), "passed")
        outcomes[case.get("name")] = kind
    skipped = {re.sub(r"\[.*", "", name) for name, kind in outcomes.items() if kind == "skipped"}
    assert skipped <= ALLOWED_EMULATED_SKIPS, skipped
    assert set(outcomes.values()) <= {"passed", "skipped"}
    passed = sum(kind == "passed" for kind in outcomes.values())
    assert passed >= 100, outcomes  # every GPU test ran (not skipped) on the emulator
    launched = set(launches.read_text().split())
    expected = {name for names in cuda.kernel_names().values() for name in names}
    assert expected <= launched, f"kernels never launched on the emulator: {sorted(expected - launched)}"
    rows = json.loads(errors.read_text())
    report_lines.append(f"CUDA kernels on the emulator: {passed} tests passed, {len(launched)} kernels launched")
    report_lines.append("max error vs the float64 reference, max |got - want| / max(1, max |want|):")
    for dtype in sorted({r["dtype"] for r in rows}):
        for output in dict.fromkeys(r["output"] for r in rows):
            worst = max(r["error"] for r in rows if r["dtype"] == dtype and r["output"] == output)
            report_lines.append(f"  {dtype:>9}  {output:<22} {worst:.2e}")


@pytest.mark.parametrize(
    "shape, axis, columns",
    [
        ((8, 64, 56, 56), 1, False),  # inner 3136: channels-first
        ((8, 64, 7, 7), 1, False),  # inner 49 >= 32: channels-first
        ((8, 64, 3, 3), 1, True),  # inner 9: whole rows of 576 columns
        ((8, 3, 2, 2), 1, False),  # 12 columns: a columns warp would idle 20 lanes
        ((64, 7, 7, 256), -1, True),  # channels-last
        ((1000, 7), 1, False),  # 7 channels, inner 1: channels-first keeps every lane busy
        ((1000, 40), 1, True),
    ],
)
def test_reduction_kernels_chosen_by_shape(shape, axis, columns):
    from bnfuse.runtime.kernel_types import layout

    assert cuda.use_columns_kernels(layout(BatchNormConfig(axis=axis), shape)) is columns


def test_kernel_geometry_is_defined_once():
    """bn_common.cu takes BN_BLOCK / BN_CL_X / BN_CL_Y only from cuda.py's -D options."""
    text = (cuda.SOURCE_DIR / "bn_common.cu").read_text()
    assert not re.search(r"#define\s+BN_(BLOCK|CL_X|CL_Y)\b", text)
    assert cuda.KERNEL_DEFINES == (f"-DBN_BLOCK={cuda.BLOCK}", f"-DBN_CL_X={cuda.CL_X}", f"-DBN_CL_Y={cuda.CL_Y}")
    assert set(cuda.KERNEL_DEFINES) <= set(cuda.NVRTC_OPTIONS)


def test_launch_refuses_partial_warps():
    """The block reductions are warp trees: a block whose x size is not a multiple of 32 never launches."""
    with pytest.raises(BatchNormError, match="blockDim.x = 48, not a multiple of 32"):
        cuda._launch("bn_stats.cu", "bn_stats_partial_cf_f32", (1,), (48,), ())
    with pytest.raises(BatchNormError, match="2\\^42"):
        cuda._partial("stats", (np.zeros(1, np.float32),), None, Layout((2**21, 1, 2**21), (1,), 2**21, 1, 2**21))


# Fused ReLU: channels-first vectorized (inner 40) and scalar (inner 21), channels-last columns, fp16.
RELU_CASES = {
    "cf4": ((4, 3, 40), 1),
    "cf_scalar": ((3, 5, 21), 1),
    "columns": ((64, 6, 3), -1),
    "rank2": ((300, 7), 1),
}


@needs_gpu
@pytest.mark.parametrize("blend", [(1.0, 0.0), (0.5, -1.5)], ids=["plain", "blended"])
@pytest.mark.parametrize("xdtype", [np.float32, np.float16])
@pytest.mark.parametrize("case", sorted(RELU_CASES))
def test_fused_relu_matches_reference(case, xdtype, blend):
    """activation "relu": y = max(blended y, 0) and dY masked where Y <= 0, on every kernel family, against the
    float64 reference (itself checked against the unfused reference in tests/runtime/test_cpu.py)."""
    import cupy

    shape, axis = RELU_CASES[case]
    config = BatchNormConfig(axis=axis, activation="relu")
    alpha, beta = blend
    x, dy, scale, bias, mean, var = _inputs(config, shape, xdtype, np.float32)
    prior = np.random.default_rng(7).normal(size=shape).astype(xdtype)

    def outs(kind, device):
        if beta == 0:
            return None
        wrap = cupy.asarray if device else np.array
        zeros = [wrap(np.zeros_like(scale)) for _ in range(5)]
        if kind == "train":
            return TrainingOutputs(wrap(prior.copy()), *zeros)
        return GradOutputs(wrap(prior.copy()), zeros[0], zeros[1])

    d = [cupy.asarray(a) for a in (x, dy, scale, bias, mean, var)]
    got = cuda.forward_training(d[0], *d[2:], config, alpha=alpha, beta=beta, out=outs("train", True))
    want = ref.forward_training(x, scale, bias, mean, var, config, alpha=alpha, beta=beta, out=outs("train", False))
    for field, a, b in zip(TrainingOutputs._fields, got, want, strict=True):
        _close(a, b, xdtype if field == "y" else np.float32)
    y = cupy.asnumpy(got.y)
    assert 0.2 < np.mean(y <= 0) < 0.8 and np.all(y >= 0)
    blends = {"alpha_data": alpha, "beta_data": beta, "alpha_param": alpha, "beta_param": beta}
    saved = (want.saved_mean, want.saved_inv_std)
    g = cuda.backward(d[1], d[0], d[2], *(cupy.asarray(a) for a in saved), config, got.y, out=outs("grad", True),
                      **blends)  # fmt: skip
    r = ref.backward(dy, x, scale, *saved, config, y, out=outs("grad", False), **blends)
    for a, b, dt in zip(g, r, (xdtype, np.float32, np.float32), strict=True):
        _close(a, b, dt)
    if beta == 0:  # where Y <= 0, dX sees no dY: the same as plain BN's backward of the masked dY
        plain = BatchNormConfig(axis=axis)
        masked = cupy.asarray(np.where(y <= 0, 0, dy).astype(xdtype))
        unfused = cuda.backward(masked, d[0], d[2], *(cupy.asarray(a) for a in saved), plain)
        for a, b in zip(g, unfused, strict=True):
            np.testing.assert_array_equal(cupy.asnumpy(a), cupy.asnumpy(b))
