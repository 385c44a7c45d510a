"""CuPy CUDA kernels against the float64 reference. Skipped without CuPy or a GPU (CI has neither)."""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest

from bnfuse.runtime import cuda
from bnfuse.runtime import reference as ref
from bnfuse.runtime.kernel_types import GradOutputs, TrainingOutputs
from bnfuse.runtime.semantics import BatchNormConfig, BatchNormError, Mode, param_shape


def _gpu_available() -> bool:
    if importlib.util.find_spec("cupy") is None:
        return False
    import cupy

    try:
        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:  # noqa: BLE001 - CUDA driver missing or broken: no usable GPU
        return False


needs_gpu = pytest.mark.skipif(not _gpu_available(), reason="needs CuPy and a CUDA GPU")


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

    got = cupy.asnumpy(got).astype(np.float64)
    want = np.asarray(want, dtype=np.float64)
    scale = max(1.0, float(np.nanmax(np.abs(want), initial=0.0)))
    tol = 3e-3 if np.dtype(dtype) == np.float16 else 2e-5
    np.testing.assert_allclose(got, want, rtol=tol, atol=tol * scale)


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


@needs_gpu
@pytest.mark.parametrize("axis", [1, -1])
def test_variance_stable_for_large_mean(axis):
    import cupy

    rng = np.random.default_rng(7)
    shape = (16, 8, 32, 32) if axis == 1 else (16, 32, 32, 8)
    x = (1e4 + rng.normal(size=shape)).astype(np.float32)
    config = BatchNormConfig(axis=axis)
    ones, zeros = cupy.ones(8, np.float32), cupy.zeros(8, np.float32)
    got = cuda.forward_training(cupy.asarray(x), ones, zeros, zeros, ones, config)
    want = ref.forward_training(
        x, *(np.ones(8, np.float32), np.zeros(8, np.float32), np.zeros(8, np.float32), np.ones(8, np.float32)), config
    )
    np.testing.assert_allclose(cupy.asnumpy(got.batch_var), want.batch_var, rtol=1e-3)


# -- the GPU statistics algorithm, emulated in NumPy float32 (runs everywhere) ----------------------------------
# bn_stats.cu: Welford per thread over a fixed slice (thread t takes elements t, t + 256, ...), a warp
# shuffle tree and a block tree of Chan merges in float32, then float64 merges of the chunks in order.
# This checks the algorithm's numerics where no GPU exists (FMA contraction aside, the same operations).


def _merge(a, b):
    n_a, mean_a, m2_a = a
    n_b, mean_b, m2_b = b
    with np.errstate(invalid="ignore", divide="ignore"):
        n = n_a + n_b
        delta = mean_b - mean_a
        w_b = np.where(n > 0, n_b / np.where(n > 0, n, 1), np.float32(0))
        mean = np.where(n_b == 0, mean_a, np.where(n_a == 0, mean_b, mean_a + delta * w_b))
        m2 = np.where(n_b == 0, m2_a, np.where(n_a == 0, m2_b, m2_a + m2_b + delta * delta * n_a * w_b))
    return n.astype(np.float32), mean.astype(np.float32), m2.astype(np.float32)


def _emulated_channel_stats(values: np.ndarray, chunk: int, block: int = 256) -> tuple[float, float]:
    parts = []
    for start in range(0, values.size, chunk):
        piece = values[start : start + chunk]
        per_thread = -(-piece.size // block)
        padded = np.full(per_thread * block, np.nan, np.float32)
        padded[: piece.size] = piece
        lanes = padded.reshape(per_thread, block)  # row k holds element t + k * block for thread t
        n = np.zeros(block, np.float32)
        mean = np.zeros(block, np.float32)
        m2 = np.zeros(block, np.float32)
        for row in lanes:
            valid = ~np.isnan(row)
            n_new = np.where(valid, n + 1, n).astype(np.float32)
            d = np.where(valid, row - mean, 0).astype(np.float32)
            mean = np.where(valid, mean + d / np.where(valid, n_new, 1), mean).astype(np.float32)
            m2 = np.where(valid, m2 + d * (np.where(valid, row, 0) - mean), m2).astype(np.float32)
            n = n_new
        state = (n, mean, m2)
        width = block
        while width > 1:  # warp and block trees: lane i merges lane i + width / 2
            half = width // 2
            state = _merge(tuple(s[:half] for s in state), tuple(s[half:width] for s in state))
            width = half
        parts.append(tuple(float(s[0]) for s in state))
    n = mu = m2 = 0.0
    for bn, bmean, bm2 in parts:  # bn_finalize_training, float64
        total = n + bn
        delta = bmean - mu
        mu += delta * bn / total
        m2 += bm2 + delta * delta * n * bn / total
        n = total
    return mu, m2 / n


@pytest.mark.parametrize("loc", [0.0, 1e4, -3e3])
def test_gpu_statistics_algorithm_is_stable_emulated(loc):
    """|mean| / std = 1e4 in float32: variance within 1e-3 of the float64 value (naive E[x^2]-E[x]^2 fails)."""
    rng = np.random.default_rng(11)
    values = (loc + rng.normal(size=40000)).astype(np.float32)
    mean, var = _emulated_channel_stats(values, chunk=16384)
    exact = values.astype(np.float64)
    assert mean == pytest.approx(exact.mean(), rel=1e-6, abs=1e-6)
    assert var == pytest.approx(exact.var(), rel=1e-3)
    naive = np.float32(np.mean(np.square(values, dtype=np.float32), dtype=np.float32) - np.float32(values.mean()) ** 2)
    if loc == 1e4:
        assert abs(naive / exact.var() - 1) > 1e-3  # the check has teeth
