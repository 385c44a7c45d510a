"""The float64 NumPy reference: formulas, conventions, gradients (finite differences, PyTorch), validation."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bnfuse.runtime import reference as ref
from bnfuse.runtime.kernel_types import GradOutputs, TrainingOutputs, layout
from bnfuse.runtime.semantics import BatchNormConfig, BatchNormError, Mode, cumulative_average_factor, param_shape

RNG = np.random.default_rng(0)


def _params(config: BatchNormConfig, shape: tuple[int, ...], dtype=np.float64, rng=RNG):
    p = param_shape(config, shape)
    scale = rng.uniform(0.5, 2.0, p).astype(dtype)
    bias = rng.normal(size=p).astype(dtype)
    mean = rng.normal(size=p).astype(dtype)
    var = rng.uniform(0.5, 3.0, p).astype(dtype)
    return scale, bias, mean, var


def test_inference_matches_formula_channels_first_and_last():
    x = RNG.normal(size=(3, 4, 5, 2))
    for axis in (1, -1, 2):
        config = BatchNormConfig(epsilon=1e-3, axis=axis)
        scale, bias, mean, var = _params(config, x.shape)
        y = ref.forward_inference(x, scale, bias, mean, var, config)
        moved = np.moveaxis(x, axis, -1)
        expected = np.moveaxis(scale * (moved - mean) / np.sqrt(var + 1e-3) + bias, -1, axis)
        np.testing.assert_allclose(y, expected, rtol=1e-12)


def test_training_statistics_and_conventions():
    x = RNG.normal(2.0, 3.0, size=(4, 3, 6))
    scale, bias, rm, rv = _params(BatchNormConfig(), x.shape)
    batch_mean = x.mean(axis=(0, 2))
    batch_var = x.var(axis=(0, 2))
    cases = [
        (BatchNormConfig(momentum=0.9), 0.9 * rm + 0.1 * batch_mean, 0.9 * rv + 0.1 * batch_var),
        (
            BatchNormConfig(momentum=0.1, momentum_convention="mindspore"),
            0.9 * rm + 0.1 * batch_mean,
            0.9 * rv + 0.1 * batch_var,
        ),
        (
            BatchNormConfig(momentum=0.25, momentum_convention="pytorch", unbiased_running_var=True),
            0.75 * rm + 0.25 * batch_mean,
            0.75 * rv + 0.25 * x.var(axis=(0, 2), ddof=1),
        ),
        # cuDNN cumulative moving average after 3 updates: factor 1/4
        (
            BatchNormConfig(momentum=cumulative_average_factor(3), momentum_convention="cudnn"),
            0.75 * rm + 0.25 * batch_mean,
            0.75 * rv + 0.25 * batch_var,
        ),
        # first cumulative update (factor 1) replaces the running statistics
        (BatchNormConfig(momentum=cumulative_average_factor(0), momentum_convention="cudnn"), batch_mean, batch_var),
    ]
    for config, want_rm, want_rv in cases:
        res = ref.forward_training(x, scale, bias, rm, rv, config)
        np.testing.assert_allclose(res.running_mean, want_rm, rtol=1e-12)
        np.testing.assert_allclose(res.running_var, want_rv, rtol=1e-12)
        np.testing.assert_allclose(res.saved_mean, batch_mean, rtol=1e-12)
        np.testing.assert_allclose(res.batch_var, batch_var, rtol=1e-12)
        np.testing.assert_allclose(res.saved_inv_std, 1 / np.sqrt(batch_var + config.epsilon), rtol=1e-12)
        x_hat = (x - batch_mean[:, None]) / np.sqrt(batch_var[:, None] + config.epsilon)
        np.testing.assert_allclose(res.y, scale[:, None] * x_hat + bias[:, None], rtol=1e-12, atol=1e-12)


def test_per_activation_reduces_over_batch_only():
    x = RNG.normal(size=(5, 3, 4))
    config = BatchNormConfig(mode=Mode.PER_ACTIVATION)
    scale, bias, rm, rv = _params(config, x.shape)
    assert scale.shape == (3, 4)
    res = ref.forward_training(x, scale, bias, rm, rv, config)
    np.testing.assert_allclose(res.saved_mean, x.mean(axis=0), rtol=1e-12)
    np.testing.assert_allclose(res.batch_var, x.var(axis=0), rtol=1e-12)
    np.testing.assert_allclose(res.y, scale * (x - x.mean(0)) / np.sqrt(x.var(0) + 1e-5) + bias, rtol=1e-10)


def test_use_global_stats_and_fix_gamma():
    x = RNG.normal(size=(4, 3, 5))
    config = BatchNormConfig(use_global_stats=True, fix_gamma=True)
    scale, bias, rm, rv = _params(config, x.shape)
    res = ref.forward_training(x, scale, bias, rm, rv, config)
    np.testing.assert_array_equal(res.running_mean, rm)
    np.testing.assert_array_equal(res.running_var, rv)
    np.testing.assert_array_equal(res.saved_mean, rm)
    np.testing.assert_allclose(res.saved_inv_std, 1 / np.sqrt(rv + 1e-5))
    # fix_gamma: scale treated as 1
    np.testing.assert_allclose(res.y, (x - rm[:, None]) / np.sqrt(rv[:, None] + 1e-5) + bias[:, None], rtol=1e-12)
    dy = RNG.normal(size=x.shape)
    grads = ref.backward(dy, x, scale, res.saved_mean, res.saved_inv_std, config)
    np.testing.assert_allclose(grads.dx, dy / np.sqrt(rv[:, None] + 1e-5), rtol=1e-12)  # DirectML, gamma = 1
    np.testing.assert_array_equal(grads.dscale, np.zeros(3))
    np.testing.assert_allclose(grads.dbias, dy.sum(axis=(0, 2)), rtol=1e-12)


def test_blending_forward_and_backward():
    x = RNG.normal(size=(2, 3, 4))
    config = BatchNormConfig()
    scale, bias, mean, var = _params(config, x.shape)
    plain = ref.forward_inference(x, scale, bias, mean, var, config)
    prior = RNG.normal(size=x.shape)
    out = prior.copy()
    got = ref.forward_inference(x, scale, bias, mean, var, config, alpha=0.5, beta=2.0, out=out)
    assert got is out
    np.testing.assert_allclose(out, 0.5 * plain + 2.0 * prior, rtol=1e-12)
    # beta == 0: the prior is never read, so NaN there does not leak
    out = np.full(x.shape, np.nan)
    ref.forward_inference(x, scale, bias, mean, var, config, alpha=1.0, beta=0.0, out=out)
    np.testing.assert_allclose(out, plain)
    train = ref.forward_training(x, scale, bias, mean, var, config)
    dy = RNG.normal(size=x.shape)
    plain_g = ref.backward(dy, x, scale, train.saved_mean, train.saved_inv_std, config)
    priors = GradOutputs(RNG.normal(size=x.shape), RNG.normal(size=3), RNG.normal(size=3))
    out_g = GradOutputs(*(p.copy() for p in priors))
    got = ref.backward(
        dy, x, scale, train.saved_mean, train.saved_inv_std, config,
        alpha_data=2.0, beta_data=0.5, alpha_param=-1.0, beta_param=3.0, out=out_g,
    )  # fmt: skip
    assert all(a is b for a, b in zip(got, out_g, strict=True))
    np.testing.assert_allclose(out_g.dx, 2.0 * plain_g.dx + 0.5 * priors.dx, rtol=1e-12)
    np.testing.assert_allclose(out_g.dscale, -plain_g.dscale + 3.0 * priors.dscale, rtol=1e-12)
    np.testing.assert_allclose(out_g.dbias, -plain_g.dbias + 3.0 * priors.dbias, rtol=1e-12)


def test_training_out_written_in_place_and_inputs_untouched():
    x = RNG.normal(size=(3, 2, 4)).astype(np.float32)
    config = BatchNormConfig()
    scale, bias, rm, rv = _params(config, x.shape, np.float32)
    copies = [a.copy() for a in (x, scale, bias, rm, rv)]
    out = TrainingOutputs(np.empty_like(x), *(np.empty_like(rm) for _ in range(5)))
    got = ref.forward_training(x, scale, bias, rm, rv, config, out=out)
    assert all(a is b for a, b in zip(got, out, strict=True))
    for before, after in zip(copies, (x, scale, bias, rm, rv), strict=True):
        np.testing.assert_array_equal(before, after)
    fresh = ref.forward_training(x, scale, bias, rm, rv, config)
    for a, b in zip(fresh, out, strict=True):
        np.testing.assert_array_equal(a, b)
    # running statistics updated in place (out aliases the inputs) give the same result
    rm2, rv2 = rm.copy(), rv.copy()
    alias = TrainingOutputs(np.empty_like(x), rm2, rv2, *(np.empty_like(rm) for _ in range(3)))
    ref.forward_training(x, scale, bias, rm2, rv2, config, out=alias)
    np.testing.assert_array_equal(rm2, fresh.running_mean)
    np.testing.assert_array_equal(rv2, fresh.running_var)


def _loss(x, scale, bias, dy, config):
    rm = np.zeros(param_shape(config, x.shape))
    return float((ref.forward_training(x, scale, bias, rm, rm + 1, config).y * dy).sum())


@pytest.mark.parametrize(
    "config",
    [
        BatchNormConfig(epsilon=1e-3),
        BatchNormConfig(epsilon=1e-3, axis=-1),
        BatchNormConfig(epsilon=1e-3, mode=Mode.PER_ACTIVATION),
        BatchNormConfig(epsilon=1e-3, fix_gamma=True),
    ],
    ids=["spatial", "channels_last", "per_activation", "fix_gamma"],
)
def test_gradients_match_finite_differences(config):
    rng = np.random.default_rng(1)
    x = rng.normal(size=(3, 2, 3))
    dy = rng.normal(size=x.shape)
    p = param_shape(config, x.shape)
    scale, bias = rng.uniform(0.5, 2, p), rng.normal(size=p)
    res = ref.forward_training(x, scale, bias, np.zeros(p), np.ones(p), config)
    grads = ref.backward(dy, x, scale, res.saved_mean, res.saved_inv_std, config)
    h = 1e-6

    def numeric(array, index, which):
        plus, minus = array.copy(), array.copy()
        plus[index] += h
        minus[index] -= h
        args = {"x": x, "scale": scale, "bias": bias}
        lp = _loss(**{**args, which: plus}, dy=dy, config=config)
        lm = _loss(**{**args, which: minus}, dy=dy, config=config)
        return (lp - lm) / (2 * h)

    for index in np.ndindex(x.shape):
        assert numeric(x, index, "x") == pytest.approx(grads.dx[index], rel=1e-5, abs=1e-7)
    for index in np.ndindex(p):
        want_scale = 0.0 if config.fix_gamma else numeric(scale, index, "scale")
        assert want_scale == pytest.approx(grads.dscale[index], rel=1e-5, abs=1e-7)
        assert numeric(bias, index, "bias") == pytest.approx(grads.dbias[index], rel=1e-5, abs=1e-7)


def test_global_stats_gradient_matches_finite_differences():
    rng = np.random.default_rng(2)
    config = BatchNormConfig(use_global_stats=True)
    x, dy = rng.normal(size=(2, 3, 2)), rng.normal(size=(2, 3, 2))
    scale, bias, rm, rv = _params(config, x.shape, rng=rng)
    res = ref.forward_training(x, scale, bias, rm, rv, config)
    grads = ref.backward(dy, x, scale, res.saved_mean, res.saved_inv_std, config)
    h = 1e-6
    for index in np.ndindex(x.shape):
        plus, minus = x.copy(), x.copy()
        plus[index] += h
        minus[index] -= h
        f = [(ref.forward_training(v, scale, bias, rm, rv, config).y * dy).sum() for v in (plus, minus)]
        assert (f[0] - f[1]) / (2 * h) == pytest.approx(grads.dx[index], rel=1e-6)


@pytest.mark.parametrize("shape", [(4, 3), (2, 3, 5), (2, 3, 4, 5), (2, 3, 2, 2, 2)])
def test_matches_pytorch_training_forward_and_autograd(shape):
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(3)
    x, dy = rng.normal(1.0, 2.0, size=shape), rng.normal(size=shape)
    config = BatchNormConfig(momentum=0.1, momentum_convention="pytorch", unbiased_running_var=True)
    scale, bias, rm, rv = _params(config, shape, rng=rng)
    res = ref.forward_training(x, scale, bias, rm, rv, config)
    grads = ref.backward(dy, x, scale, res.saved_mean, res.saved_inv_std, config)
    tx = torch.tensor(x, requires_grad=True)
    tw, tb = torch.tensor(scale, requires_grad=True), torch.tensor(bias, requires_grad=True)
    trm, trv = torch.tensor(rm), torch.tensor(rv)
    ty = torch.nn.functional.batch_norm(tx, trm, trv, tw, tb, training=True, momentum=0.1, eps=1e-5)
    ty.backward(torch.tensor(dy))
    np.testing.assert_allclose(res.y, ty.detach().numpy(), rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(res.running_mean, trm.numpy(), rtol=1e-10)
    np.testing.assert_allclose(res.running_var, trv.numpy(), rtol=1e-10)
    np.testing.assert_allclose(grads.dx, tx.grad.numpy(), rtol=1e-8, atol=1e-10)
    np.testing.assert_allclose(grads.dscale, tw.grad.numpy(), rtol=1e-8, atol=1e-10)
    np.testing.assert_allclose(grads.dbias, tb.grad.numpy(), rtol=1e-8, atol=1e-10)


def test_variance_stable_for_large_mean_float32():
    rng = np.random.default_rng(4)
    x = (1e4 + rng.normal(size=(8, 2, 64))).astype(np.float32)
    config = BatchNormConfig()
    scale, bias, rm, rv = _params(config, x.shape, np.float32)
    res = ref.forward_training(x, scale, bias, rm, rv, config)
    exact = x.astype(np.float64).var(axis=(0, 2))
    np.testing.assert_allclose(res.batch_var, exact, rtol=1e-6)


def test_float16_io_with_float32_params_and_bfloat16():
    x = RNG.normal(size=(4, 3, 5)).astype(np.float16)
    config = BatchNormConfig()
    scale, bias, rm, rv = _params(config, x.shape, np.float32)
    res = ref.forward_training(x, scale, bias, rm, rv, config)
    assert res.y.dtype == np.float16 and res.running_mean.dtype == np.float32
    ml_dtypes = pytest.importorskip("ml_dtypes")
    xb = x.astype(ml_dtypes.bfloat16)
    yb = ref.forward_inference(xb, scale, bias, rm, rv, config)
    assert yb.dtype == xb.dtype
    np.testing.assert_allclose(
        yb.astype(np.float64),
        ref.forward_inference(xb.astype(np.float64), scale, bias, rm, rv, config),
        rtol=1e-2,
        atol=1e-2,
    )


def test_nan_and_inf_propagate():
    x = RNG.normal(size=(3, 2, 4))
    x[1, 0, 2] = np.nan
    x[0, 1, 1] = np.inf
    config = BatchNormConfig()
    scale, bias, rm, rv = _params(config, x.shape)
    res = ref.forward_training(x, scale, bias, rm, rv, config)
    assert np.isnan(res.saved_mean[0]) and np.isnan(res.y[:, 0]).all()
    assert np.isinf(res.saved_mean[1]) and np.isnan(res.batch_var[1])


def test_config_normalizes_numbers_and_mindspore_epsilon():
    """NumPy scalars become Python numbers; MindSpore's convention keeps epsilon = 1 and implies the range check."""
    config = BatchNormConfig(epsilon=np.float32(0.5), momentum=np.float64(0.25), axis=np.int64(-1), fix_gamma=1)
    assert (type(config.epsilon), type(config.momentum), type(config.axis)) == (float, float, int)
    assert (config.epsilon, config.momentum, config.axis, config.fix_gamma) == (0.5, 0.25, -1, True)
    ms = BatchNormConfig(epsilon=1.0, momentum=0.1, momentum_convention="mindspore")
    assert ms.strict_epsilon and ms.momentum_convention.value == "pytorch" and ms.batch_weight == 0.1
    assert not BatchNormConfig(epsilon=2.0, momentum_convention="pytorch").strict_epsilon  # PyTorch has no bound


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda: BatchNormConfig(epsilon=0.0), "epsilon must be > 0"),
        (lambda: BatchNormConfig(epsilon=2.0, strict_epsilon=True), r"epsilon must be in \(0, 1\]"),
        (lambda: BatchNormConfig(epsilon=2.0, momentum_convention="mindspore"), r"epsilon must be in \(0, 1\]"),
        (lambda: BatchNormConfig(epsilon=1.5, momentum_convention="MindSpore"), r"epsilon must be in \(0, 1\]"),
        (lambda: BatchNormConfig(momentum=True), r"momentum must be a real number, got True \(bool\)"),
        (lambda: BatchNormConfig(epsilon="1e-5"), r"epsilon must be a real number, got '1e-5' \(str\)"),
        (lambda: BatchNormConfig(mode="bogus"), r"mode must be 'spatial' or 'per_activation', got 'bogus'"),
        (lambda: BatchNormConfig(axis=1.5), r"axis must be an integer, got 1.5 \(float\)"),
        (lambda: BatchNormConfig(axis=True), r"axis must be an integer, got True \(bool\)"),
        (lambda: BatchNormConfig(momentum_convention=3), "momentum_convention must be a string"),
        (lambda: BatchNormConfig(fix_gamma="yes"), r"fix_gamma must be a bool \(or 0 / 1\)"),
        (lambda: BatchNormConfig(momentum=1.5), r"momentum must be in \[0, 1\]"),
        (lambda: ref.forward_inference(np.zeros((2, 3)), *[np.zeros(4)] * 4, BatchNormConfig()), "expected"),
        (lambda: ref.forward_inference(np.zeros(3), *[np.zeros(3)] * 4, BatchNormConfig()), "rank must be 2 to 8"),
        (lambda: ref.forward_inference(np.zeros((2, 3), np.int32), *[np.zeros(3)] * 4, BatchNormConfig()), "dtype"),
        (
            lambda: ref.forward_inference(
                np.zeros((2, 3), np.float16), *[np.zeros(3, np.float64)] * 4, BatchNormConfig()
            ),
            None,
        ),
        (
            lambda: ref.forward_inference(np.zeros((2, 3)), *[np.zeros(3)] * 4, BatchNormConfig(), beta=1.0),
            "pass them in `out`",
        ),
        (
            lambda: ref.backward(np.zeros((2, 4)), np.zeros((2, 3)), *[np.zeros(3)] * 3, BatchNormConfig()),
            "dy must have shape",
        ),
        (
            lambda: ref.forward_inference(
                np.zeros((2, 3)), *[np.zeros(3)] * 4, BatchNormConfig(), out=np.zeros((2, 3), np.float32)
            ),
            "out.y must have",
        ),
        (lambda: ref.forward_inference(np.zeros((2, 3)), *[np.zeros(3)] * 4, BatchNormConfig(axis=2)), "out of range"),
    ],
)
def test_validation_errors(call, message):
    if message is None:  # float64 params with float16 data are accepted by the reference (oracle use)
        call()
        return
    with pytest.raises(BatchNormError, match=message):
        call()


@settings(max_examples=30, deadline=None)
@given(
    shape=st.lists(st.integers(1, 4), min_size=2, max_size=5).map(tuple),
    axis_pick=st.integers(0, 10),
    per_activation=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_backward_identities_hold(shape, axis_pick, per_activation, seed):
    """Sum of dx over the reduction axes is 0 and dx is orthogonal to x_hat (batch statistics)."""
    rng = np.random.default_rng(seed)
    axis = 1 + axis_pick % (len(shape) - 1)
    config = BatchNormConfig(axis=axis, mode=Mode.PER_ACTIVATION if per_activation else Mode.SPATIAL)
    x, dy = rng.normal(size=shape), rng.normal(size=shape)
    scale, bias, rm, rv = _params(config, shape, rng=rng)
    res = ref.forward_training(x, scale, bias, rm, rv, config)
    grads = ref.backward(dy, x, scale, res.saved_mean, res.saved_inv_std, config)
    lay = layout(config, shape)
    if lay.count > 1:
        axes = (0,) if per_activation else tuple(a for a in range(len(shape)) if a != axis)
        scale_b = ref._param_view(scale, config, len(shape))
        np.testing.assert_allclose(grads.dx.sum(axis=axes), 0, atol=1e-9 * np.abs(dy).sum() * scale_b.max() * 1e3)
        # dx . x_hat = g * inv_std * sum(dy * x_hat) * (1 - mean(x_hat^2)): 0 but for epsilon's share of var + eps
        inv_std = ref._param_view(res.saved_inv_std, config, len(shape))
        x_hat = (x - ref._param_view(res.saved_mean, config, len(shape))) * inv_std
        got = (grads.dx * x_hat).sum(axis=axes)
        residual = (scale_b * inv_std).reshape(got.shape) * (1 - np.square(x_hat).mean(axis=axes)) * grads.dscale
        # float64 rounding over M terms of size |g * inv_std * dy * x_hat| (x_hat^2 <= M)
        size = float(lay.count) * float((np.abs(scale_b * inv_std * dy) * np.abs(x_hat) * (1 + np.square(x_hat))).max())
        # plus the rounding of the two sides' own magnitudes (N = 2 makes both large: |x_hat| -> 1)
        np.testing.assert_allclose(got, residual, rtol=1e-12, atol=64 * np.finfo(np.float64).eps * size)
