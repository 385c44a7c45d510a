"""The C CPU kernels against the float64 reference: modes, axes, ranks, dtypes, conventions, blending."""

from __future__ import annotations

import os

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bnfuse.runtime import cpu
from bnfuse.runtime import reference as ref
from bnfuse.runtime.kernel_types import GradOutputs, TrainingOutputs
from bnfuse.runtime.semantics import BatchNormConfig, BatchNormError, Mode, param_shape

DTYPES = [(np.float32, np.float32), (np.float16, np.float16), (np.float16, np.float32)]


def _inputs(config, shape, xdtype, pdtype, seed=0, loc=0.5, spread=2.0):
    rng = np.random.default_rng(seed)
    p = param_shape(config, shape)
    x = rng.normal(loc, spread, size=shape).astype(xdtype)
    dy = rng.normal(size=shape).astype(xdtype)
    scale = rng.uniform(0.5, 2.0, p).astype(pdtype)
    bias = rng.normal(size=p).astype(pdtype)
    mean = rng.normal(size=p).astype(pdtype)
    var = rng.uniform(0.5, 3.0, p).astype(pdtype)
    return x, dy, scale, bias, mean, var


def _close(got, want, dtype):
    got = np.asarray(got, dtype=np.float64)
    want = np.asarray(want, dtype=np.float64)
    assert got.shape == want.shape
    if np.dtype(dtype) == np.float16:
        tol = 2e-3 * max(1.0, float(np.nanmax(np.abs(want), initial=0.0)))
        np.testing.assert_allclose(got, want, rtol=2e-3, atol=tol)
    else:
        tol = 2e-6 * max(1.0, float(np.nanmax(np.abs(want), initial=0.0)))
        np.testing.assert_allclose(got, want, rtol=2e-6, atol=tol)


def check_backend(
    backend,
    config,
    shape,
    xdtype,
    pdtype,
    seed=0,
    *,
    blend=(1.0, 0.0),
    to_device=np.array,  # a copy: outputs written in place must not alter the reference's priors
    to_host=np.asarray,
    close=None,
    **kw,
):
    """A backend's forward_inference / forward_training / backward against the reference, every output.

    blend = (alpha, beta) for all three calls (data and parameter gradients alike); with beta != 0 the
    outputs are passed in ``out`` holding random priors. to_device / to_host move arrays (CuPy for cuda).
    """
    close = close or _close
    alpha, beta = blend
    x, dy, scale, bias, mean, var = _inputs(config, shape, xdtype, pdtype, seed, **kw)
    d = dict(
        zip(("x", "dy", "scale", "bias", "mean", "var"), map(to_device, (x, dy, scale, bias, mean, var)), strict=True)
    )
    rng = np.random.default_rng(seed + 1)
    prior_y = rng.normal(size=shape).astype(xdtype)
    prior_p = [rng.normal(size=scale.shape).astype(pdtype) for _ in range(2)]
    blending = beta != 0

    def priors(kind, device):
        move = to_device if device else np.array  # np.array: the reference gets its own copies
        if not blending:
            return None
        if kind == "y":
            return move(prior_y)
        if kind == "train":
            return TrainingOutputs(move(prior_y), *(move(np.zeros_like(scale)) for _ in range(5)))
        return GradOutputs(move(prior_y), *(move(p) for p in prior_p))

    args = (d["scale"], d["bias"], d["mean"], d["var"])
    got = backend.forward_inference(d["x"], *args, config, alpha=alpha, beta=beta, out=priors("y", True))
    want = ref.forward_inference(x, scale, bias, mean, var, config, alpha=alpha, beta=beta, out=priors("y", False))
    close(to_host(got), want, xdtype)
    got = backend.forward_training(d["x"], *args, config, alpha=alpha, beta=beta, out=priors("train", True))
    want = ref.forward_training(x, scale, bias, mean, var, config, alpha=alpha, beta=beta, out=priors("train", False))
    assert got.y.dtype == xdtype and got.running_mean.dtype == pdtype
    for field, a, b in zip(TrainingOutputs._fields, got, want, strict=True):
        close(to_host(a), b, xdtype if field == "y" else pdtype)
    kw_grad = {"alpha_data": alpha, "beta_data": beta, "alpha_param": alpha, "beta_param": beta}
    saved = (to_device(want.saved_mean), to_device(want.saved_inv_std))
    g = backend.backward(d["dy"], d["x"], d["scale"], *saved, config, out=priors("grad", True), **kw_grad)
    r = ref.backward(dy, x, scale, want.saved_mean, want.saved_inv_std, config, out=priors("grad", False), **kw_grad)
    for a, b, dt in zip(g, r, (xdtype, pdtype, pdtype), strict=True):
        close(to_host(a), b, dt if np.dtype(dt) == np.float16 else np.float32)


def _check_all(config, shape, xdtype, pdtype, seed=0, **kw):
    check_backend(cpu, config, shape, xdtype, pdtype, seed, **kw)


CONFIGS = {
    "spatial_nchw": ((4, 3, 6, 7), BatchNormConfig()),  # inner 42: channels-first path
    "spatial_nhwc": ((3, 5, 4, 6), BatchNormConfig(axis=-1)),  # rows path
    "spatial_2d": ((9, 5), BatchNormConfig(epsilon=1e-3)),
    "axis2_rank5": ((2, 3, 4, 5, 2), BatchNormConfig(axis=2)),
    "per_activation": ((7, 3, 4), BatchNormConfig(mode=Mode.PER_ACTIVATION)),
    "per_activation_rank2": ((6, 5), BatchNormConfig(mode=Mode.PER_ACTIVATION)),
    "pytorch_unbiased": (
        (4, 3, 40),
        BatchNormConfig(momentum=0.1, momentum_convention="pytorch", unbiased_running_var=True),
    ),
    "cudnn_cma": ((4, 3, 40), BatchNormConfig(momentum=1 / 3, momentum_convention="cudnn")),
    "fix_gamma": ((4, 3, 40), BatchNormConfig(fix_gamma=True)),
    "global_stats_cf": ((4, 3, 40), BatchNormConfig(use_global_stats=True)),
    "global_stats_rows": ((4, 5, 3), BatchNormConfig(use_global_stats=True, axis=-1, fix_gamma=True)),
    "rank6_nhwc": ((2, 3, 2, 2, 3, 4), BatchNormConfig(axis=-1)),
    "rank7_axis3": ((2, 2, 3, 5, 2, 1, 3), BatchNormConfig(axis=3)),
    "rank8": ((2, 3, 2, 1, 2, 2, 1, 3), BatchNormConfig()),
    "mindspore_nhwc": ((3, 4, 5, 6), BatchNormConfig(momentum=0.1, momentum_convention="mindspore", axis=-1)),
}

# Hypothesis strategies (shared with test_cuda.py): conventions with their typical momentum, blending pairs.
CONVENTIONS = [("onnx", 0.9), ("mxnet", 0.75), ("pytorch", 0.1), ("mindspore", 0.2), ("cudnn", 1 / 3)]
BLENDS = [(1.0, 0.0), (0.5, 0.0), (2.0, 0.25), (0.5, -1.5)]


@st.composite
def bn_configs(draw, ndim: int) -> BatchNormConfig:
    """Any valid config for a rank-ndim input: axis (either sign), mode, convention, flags, epsilon."""
    axis = draw(st.integers(1, ndim - 1))
    convention, momentum = draw(st.sampled_from(CONVENTIONS))
    return BatchNormConfig(
        epsilon=draw(st.sampled_from([1e-5, 1e-3])),
        momentum=momentum,
        momentum_convention=convention,
        mode=draw(st.sampled_from(list(Mode))),
        axis=axis - ndim if draw(st.booleans()) else axis,
        unbiased_running_var=draw(st.booleans()),
        fix_gamma=draw(st.booleans()),
        use_global_stats=draw(st.booleans()),
    )


@st.composite
def bn_cases(draw, max_rank: int = 5) -> dict:
    """Keyword arguments for check_backend: shape, config, dtypes, blend, seed, data location."""
    shape = draw(st.lists(st.integers(1, 5), min_size=2, max_size=max_rank).map(tuple))
    if draw(st.booleans()):  # a long trailing axis exercises the channels-first loops
        shape = (*shape[:-1], 33 + shape[-1])
    xdtype, pdtype = draw(st.sampled_from(DTYPES))
    return {
        "config": draw(bn_configs(len(shape))),
        "shape": shape,
        "xdtype": xdtype,
        "pdtype": pdtype,
        "blend": draw(st.sampled_from(BLENDS)),
        "seed": draw(st.integers(0, 2**16)),
        "loc": draw(st.sampled_from([0.0, 3.0, -50.0])),
    }


@pytest.mark.parametrize("xdtype, pdtype", DTYPES, ids=["f32", "f16", "f16_f32params"])
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_matches_reference(name, xdtype, pdtype):
    shape, config = CONFIGS[name]
    _check_all(config, shape, xdtype, pdtype)


@settings(max_examples=30, deadline=None)
@given(case=bn_cases())
def test_matches_reference_hypothesis(case):
    """Shapes, axes, modes, conventions, fix_gamma / use_global_stats, float32 / float16, blending."""
    check_backend(cpu, **case)


@pytest.mark.parametrize("shape, axis", [((4, 3, 50), 1), ((4, 50, 3), -1)], ids=["channels_first", "rows"])
def test_blending_and_out_written_in_place(shape, axis):
    config = BatchNormConfig(axis=axis)
    x, dy, scale, bias, mean, var = _inputs(config, shape, np.float32, np.float32)
    rng = np.random.default_rng(5)
    prior = rng.normal(size=shape).astype(np.float32)
    out = prior.copy()
    assert cpu.forward_inference(x, scale, bias, mean, var, config, alpha=0.5, beta=-2.0, out=out) is out
    _close(
        out,
        ref.forward_inference(x, scale, bias, mean, var, config, alpha=0.5, beta=-2.0, out=prior.copy()),
        np.float32,
    )
    t_out = TrainingOutputs(prior.copy(), *(np.empty_like(scale) for _ in range(5)))
    got = cpu.forward_training(x, scale, bias, mean, var, config, alpha=2.0, beta=0.25, out=t_out)
    assert all(a is b for a, b in zip(got, t_out, strict=True))
    want = ref.forward_training(
        x,
        scale,
        bias,
        mean,
        var,
        config,
        alpha=2.0,
        beta=0.25,
        out=TrainingOutputs(prior.copy(), *(np.empty_like(scale) for _ in range(5))),
    )
    for a, b in zip(got, want, strict=True):
        _close(a, b, np.float32)
    priors = (prior, rng.normal(size=scale.shape).astype(np.float32), rng.normal(size=scale.shape).astype(np.float32))
    kw = {"alpha_data": 0.5, "beta_data": 1.5, "alpha_param": 2.0, "beta_param": -1.0}
    g_out = GradOutputs(*(p.copy() for p in priors))
    got = cpu.backward(dy, x, scale, want.saved_mean, want.saved_inv_std, config, out=g_out, **kw)
    assert all(a is b for a, b in zip(got, g_out, strict=True))
    r = ref.backward(
        dy, x, scale, want.saved_mean, want.saved_inv_std, config, out=GradOutputs(*(p.copy() for p in priors)), **kw
    )
    for a, b in zip(got, r, strict=True):
        _close(a, b, np.float32)


def test_float16_out_and_noncontiguous_input():
    config = BatchNormConfig()
    x, dy, scale, bias, mean, var = _inputs(config, (4, 3, 40), np.float16, np.float16)
    out = TrainingOutputs(np.full(x.shape, np.nan, np.float16), *(np.empty_like(scale) for _ in range(5)))
    cpu.forward_training(x, scale, bias, mean, var, config, out=out)
    for a, b in zip(out, ref.forward_training(x, scale, bias, mean, var, config), strict=True):
        _close(a, b, np.float16)
    xt = np.asfortranarray(x.astype(np.float32))
    _close(
        cpu.forward_inference(xt, scale.astype(np.float32), *(p.astype(np.float32) for p in (bias, mean, var)), config),
        ref.forward_inference(xt, scale.astype(np.float32), *(p.astype(np.float32) for p in (bias, mean, var)), config),
        np.float32,
    )


def test_inputs_not_modified_and_running_stats_may_alias_out():
    config = BatchNormConfig()
    x, dy, scale, bias, mean, var = _inputs(config, (4, 3, 40), np.float32, np.float32)
    copies = [a.copy() for a in (x, dy, scale, bias, mean, var)]
    fresh = cpu.forward_training(x, scale, bias, mean, var, config)
    cpu.backward(dy, x, scale, fresh.saved_mean, fresh.saved_inv_std, config)
    for before, after in zip(copies, (x, dy, scale, bias, mean, var), strict=True):
        np.testing.assert_array_equal(before, after)
    rm, rv = mean.copy(), var.copy()
    cpu.forward_training(
        x,
        scale,
        bias,
        rm,
        rv,
        config,
        out=TrainingOutputs(np.empty_like(x), rm, rv, *(np.empty_like(rm) for _ in range(3))),
    )
    np.testing.assert_array_equal(rm, fresh.running_mean)
    np.testing.assert_array_equal(rv, fresh.running_var)


@pytest.mark.parametrize("shape, axis", [((8, 2, 4096), 1), ((8, 64, 2), -1)], ids=["channels_first", "rows"])
def test_variance_stable_for_large_mean(shape, axis):
    """|mean| / std = 1e4 in float32: naive E[x^2] - E[x]^2 fails this; two-pass holds."""
    rng = np.random.default_rng(7)
    x = (1e4 + rng.normal(size=shape)).astype(np.float32)
    config = BatchNormConfig(axis=axis)
    p = param_shape(config, shape)
    got = cpu.forward_training(
        x, np.ones(p, np.float32), np.zeros(p, np.float32), np.zeros(p, np.float32), np.ones(p, np.float32), config
    )
    moved = np.moveaxis(x.astype(np.float64), axis, -1).reshape(-1, p[0])
    np.testing.assert_allclose(got.batch_var, moved.var(axis=0), rtol=1e-3)
    np.testing.assert_allclose(got.saved_mean, moved.mean(axis=0), rtol=1e-7)


@pytest.mark.parametrize("shape, axis", [((4, 3, 300), 1), ((300, 7), 1), ((4, 30, 3), -1)])
def test_bitwise_deterministic_across_runs_and_thread_counts(shape, axis, monkeypatch):
    config = BatchNormConfig(axis=axis)
    x, dy, scale, bias, mean, var = _inputs(config, shape, np.float32, np.float32)

    def run():
        t = cpu.forward_training(x, scale, bias, mean, var, config)
        return (*t, *cpu.backward(dy, x, scale, t.saved_mean, t.saved_inv_std, config))

    serial = run()  # small input: runs on the calling thread only
    monkeypatch.setattr(cpu, "SERIAL_BELOW_BYTES", 0)  # force the parallel loops (the C pool's tasks)
    with cpu.kernel_threads(1):
        single = run()
    for _ in range(3):
        for a, b, c in zip(serial, run(), single, strict=True):
            assert a.tobytes() == b.tobytes() == c.tobytes()


def test_nan_and_inf_propagate_like_reference():
    config = BatchNormConfig()
    x, dy, scale, bias, mean, var = _inputs(config, (3, 3, 40), np.float32, np.float32)
    x[1, 0, 5] = np.nan
    x[2, 1, 7] = np.inf
    got = cpu.forward_training(x, scale, bias, mean, var, config)
    with np.errstate(invalid="ignore"):
        want = ref.forward_training(x, scale, bias, mean, var, config)
    for a, b in zip(got, want, strict=True):
        np.testing.assert_array_equal(np.isnan(a), np.isnan(b))
        np.testing.assert_array_equal(np.isinf(a), np.isinf(b))


@pytest.mark.filterwarnings("ignore:Mean of empty slice:RuntimeWarning")  # the reference's 0 / 0, on purpose
@pytest.mark.parametrize("use_global_stats", [False, True])
def test_empty_batch_matches_reference(use_global_stats):
    """No elements: batch statistics are NaN (0 / 0), running ones blend in NaN; shapes and NaN positions as ref."""
    config = BatchNormConfig(use_global_stats=use_global_stats)
    x, dy, scale, bias, mean, var = _inputs(config, (0, 3, 4), np.float32, np.float32)
    y = cpu.forward_inference(x, scale, bias, mean, var, config)
    assert y.shape == (0, 3, 4) and y.dtype == np.float32
    got = cpu.forward_training(x, scale, bias, mean, var, config)
    want = ref.forward_training(x, scale, bias, mean, var, config)
    assert np.isnan(want.saved_mean).all() != use_global_stats  # the comparison below has NaN to match
    for a, b in zip(got, want, strict=True):
        assert a.shape == b.shape and a.dtype == b.dtype
        np.testing.assert_array_equal(a, b)  # NaN compares equal to NaN here: positions must match
    g = cpu.backward(dy, x, scale, want.saved_mean, want.saved_inv_std, config)
    r = ref.backward(dy, x, scale, want.saved_mean, want.saved_inv_std, config)
    assert g.dx.shape == (0, 3, 4)
    for a, b in zip(g, r, strict=True):
        assert a.shape == b.shape and a.dtype == b.dtype
        np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(g.dbias, np.zeros(3, np.float32))  # empty sums are 0, not NaN


def test_validation_errors():
    config = BatchNormConfig()
    x, dy, scale, bias, mean, var = _inputs(config, (2, 3, 4), np.float32, np.float32)
    with pytest.raises(BatchNormError, match="input dtype float64"):
        cpu.forward_inference(x.astype(np.float64), scale, bias, mean, var, config)
    with pytest.raises(BatchNormError, match="float32 or the input's dtype"):
        cpu.forward_inference(x, *(p.astype(np.float16) for p in (scale, bias, mean, var)), config)
    with pytest.raises(BatchNormError, match="share one dtype"):
        cpu.forward_inference(x, scale.astype(np.float16), bias, mean, var, config)
    with pytest.raises(BatchNormError, match=r"running_var has shape \(4,\)"):
        cpu.forward_training(x, scale, bias, mean, np.ones(4, np.float32), config)
    with pytest.raises(BatchNormError, match="out.dscale"):
        cpu.backward(
            dy,
            x,
            scale,
            mean,
            var,
            config,
            out=GradOutputs(np.empty_like(x), np.empty(4, np.float32), np.empty_like(scale)),
        )
    with pytest.raises(BatchNormError, match="config must be a BatchNormConfig"):
        cpu.forward_inference(x, scale, bias, mean, var, {"epsilon": 1e-5})


@pytest.mark.parametrize("axis", [1, -1])
def test_gradients_match_pytorch_float32(axis):
    torch = pytest.importorskip("torch")
    config = BatchNormConfig(axis=axis, momentum=0.1, momentum_convention="pytorch", unbiased_running_var=True)
    x, dy, scale, bias, mean, var = _inputs(config, (4, 6, 5, 7), np.float32, np.float32)
    res = cpu.forward_training(x, scale, bias, mean, var, config)
    grads = cpu.backward(dy, x, scale, res.saved_mean, res.saved_inv_std, config)
    perm = (0, 3, 1, 2) if axis == -1 else (0, 1, 2, 3)
    tx = torch.tensor(np.ascontiguousarray(x.transpose(perm)), requires_grad=True)
    tw, tb = torch.tensor(scale, requires_grad=True), torch.tensor(bias, requires_grad=True)
    trm, trv = torch.tensor(mean), torch.tensor(var)
    ty = torch.nn.functional.batch_norm(tx, trm, trv, tw, tb, training=True, momentum=0.1, eps=1e-5)
    ty.backward(torch.tensor(np.ascontiguousarray(dy.transpose(perm))))
    inv = np.argsort(perm)
    np.testing.assert_allclose(res.y, ty.detach().numpy().transpose(inv), rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(res.running_var, trv.numpy(), rtol=1e-5)
    np.testing.assert_allclose(grads.dx, tx.grad.numpy().transpose(inv), rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(grads.dscale, tw.grad.numpy(), rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(grads.dbias, tb.grad.numpy(), rtol=1e-4, atol=1e-4)


def test_bfloat16_io():
    ml_dtypes = pytest.importorskip("ml_dtypes")
    config = BatchNormConfig()
    x, dy, scale, bias, mean, var = _inputs(config, (4, 3, 40), np.float32, np.float32)
    xb, dyb = x.astype(ml_dtypes.bfloat16), dy.astype(ml_dtypes.bfloat16)
    got = cpu.forward_training(xb, scale, bias, mean, var, config)
    want = ref.forward_training(xb, scale, bias, mean, var, config)
    assert got.y.dtype == xb.dtype
    for a, b in zip(got, want, strict=True):
        np.testing.assert_allclose(a.astype(np.float64), b.astype(np.float64), rtol=1e-2, atol=2e-2)
    g = cpu.backward(dyb, xb, scale, want.saved_mean, want.saved_inv_std, config)
    r = ref.backward(dyb, xb, scale, want.saved_mean, want.saved_inv_std, config)
    for a, b in zip(g, r, strict=True):
        np.testing.assert_allclose(a.astype(np.float64), b.astype(np.float64), rtol=1e-2, atol=2e-2 * np.abs(b).max())


@settings(max_examples=30, deadline=None)
@given(
    data=st.data(),
    shape=st.sampled_from([(3, 2, 40), (5, 4), (2, 6, 3), (4, 2, 3, 12)]),
    axis=st.sampled_from([1, -1]),
    convention=st.sampled_from(CONVENTIONS),
    fix_gamma=st.booleans(),
    use_global_stats=st.booleans(),
)
def test_arbitrary_values_match_reference(data, shape, axis, convention, fix_gamma, use_global_stats):
    """Hypothesis-drawn values (duplicates, constants, wide ranges) in float32, any convention and flags."""
    from hypothesis.extra.numpy import arrays

    config = BatchNormConfig(
        axis=axis,
        momentum=convention[1],
        momentum_convention=convention[0],
        fix_gamma=fix_gamma,
        use_global_stats=use_global_stats,
    )
    p = param_shape(config, shape)
    values = st.floats(-1e3, 1e3, width=32)
    x = data.draw(arrays(np.float32, shape, elements=values))
    dy = data.draw(arrays(np.float32, shape, elements=st.floats(-10, 10, width=32)))
    scale = data.draw(arrays(np.float32, p, elements=st.floats(-4, 4, width=32)))
    bias = data.draw(arrays(np.float32, p, elements=values))
    rm = data.draw(arrays(np.float32, p, elements=values))
    rv = data.draw(arrays(np.float32, p, elements=st.floats(0, 1e3, width=32)))
    got = cpu.forward_training(x, scale, bias, rm, rv, config)
    want = ref.forward_training(x, scale, bias, rm, rv, config)
    for a, b in zip(got, want, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5 * max(1.0, float(np.abs(b).max())))
    g = cpu.backward(dy, x, scale, want.saved_mean, want.saved_inv_std, config)
    r = ref.backward(dy, x, scale, want.saved_mean, want.saved_inv_std, config)
    for a, b in zip(g, r, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4 * max(1.0, float(np.abs(b).max())))


def test_concurrent_callers_get_exact_results(monkeypatch):
    """ORT may run kernels from several threads at once: each call still gets its own, exact result."""
    import threading

    monkeypatch.setattr(cpu, "SERIAL_BELOW_BYTES", 0)  # the C pool's parallel loops, entered from 4 threads
    config = BatchNormConfig()
    inputs = [_inputs(config, (4, 8, 50), np.float32, np.float32, seed=s) for s in range(4)]
    expected = [cpu.forward_training(x, s, b, m, v, config).y for x, _, s, b, m, v in inputs]
    failures = []

    def call(index: int) -> None:
        x, _, s, b, m, v = inputs[index]
        for _ in range(20):
            if cpu.forward_training(x, s, b, m, v, config).y.tobytes() != expected[index].tobytes():
                failures.append(index)

    threads = [threading.Thread(target=call, args=(i,)) for i in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not failures


# -- fused ReLU (activation "relu") -------------------------------------------------------------------------

RELU_CASES = {
    "serial_channels_first": ((4, 3, 40), 1),
    "serial_rows": ((6, 5, 3), -1),
    "parallel_channels_first": ((8, 16, 1024), 1),  # 512 KiB of float32: above cpu.SERIAL_BELOW_BYTES
    "parallel_rows": ((64, 32, 48), -1),
}


@pytest.mark.parametrize("blend", [(1.0, 0.0), (0.5, -1.5)], ids=["plain", "blended"])
@pytest.mark.parametrize("xdtype, pdtype", DTYPES, ids=["f32", "f16", "f16_f32params"])
@pytest.mark.parametrize("case", sorted(RELU_CASES))
def test_fused_relu_matches_reference(case, xdtype, pdtype, blend):
    """Forward and backward with activation "relu" against the reference, on the serial and both parallel paths;
    the reference itself against the unfused reference with an independent NumPy ReLU."""
    shape, axis = RELU_CASES[case]
    if case.startswith("parallel") and np.dtype(xdtype) == np.float16:
        shape = (2 * shape[0], *shape[1:])  # still above the serial threshold in 16-bit
    assert (np.prod(shape) * np.dtype(xdtype).itemsize >= cpu.SERIAL_BELOW_BYTES) == case.startswith("parallel")
    config = BatchNormConfig(axis=axis, activation="relu")
    plain = BatchNormConfig(axis=axis)
    alpha, beta = blend
    x, dy, scale, bias, mean, var = _inputs(config, shape, xdtype, pdtype)
    prior = np.random.default_rng(7).normal(size=shape).astype(xdtype)

    def outs(kind):
        if beta == 0:
            return None
        if kind == "train":
            return TrainingOutputs(prior.copy(), *(np.zeros_like(scale) for _ in range(5)))
        return GradOutputs(prior.copy(), np.zeros_like(scale), np.zeros_like(scale))

    kw = {"alpha": alpha, "beta": beta}
    got = cpu.forward_training(x, scale, bias, mean, var, config, out=outs("train"), **kw)
    want = ref.forward_training(x, scale, bias, mean, var, config, out=outs("train"), **kw)
    unfused = ref.forward_training(x, scale, bias, mean, var, plain, out=outs("train"), **kw)
    np.testing.assert_array_equal(want.y, np.maximum(unfused.y, 0))  # an independent ReLU
    for field, a, b, c in zip(TrainingOutputs._fields, got, want, unfused, strict=True):
        _close(a, b, xdtype if field == "y" else pdtype)
        if field != "y":
            np.testing.assert_array_equal(b, c)  # the statistics are those of plain BN
    y = got.y
    assert 0.2 < np.mean(y <= 0) < 0.8
    kw_grad = {"alpha_data": alpha, "beta_data": beta, "alpha_param": alpha, "beta_param": beta}
    saved = (want.saved_mean, want.saved_inv_std)
    g = cpu.backward(dy, x, scale, *saved, config, y, out=outs("grad"), **kw_grad)
    r = ref.backward(dy, x, scale, *saved, config, y, out=outs("grad"), **kw_grad)
    masked = (dy.astype(np.float64) * (y.astype(np.float64) > 0)).astype(xdtype)  # no NaN in y here
    u = ref.backward(masked, x, scale, *saved, plain, out=outs("grad"), **kw_grad)
    for a, b, c, dt in zip(g, r, u, (xdtype, pdtype, pdtype), strict=True):
        _close(a, b, dt if np.dtype(dt) == np.float16 else np.float32)
        np.testing.assert_allclose(b, c, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("case", sorted(RELU_CASES))
def test_fused_relu_nan_and_negative_zero_follow_pytorch(case):
    """relu(NaN) = NaN and relu(-0) = -0 (PyTorch's and onnxruntime's Relu); the backward masks dY where
    Y <= 0 (so -0 and 0 block it) and passes it where Y is NaN (PyTorch's threshold_backward)."""
    shape, axis = RELU_CASES[case]
    config = BatchNormConfig(axis=axis, activation="relu", use_global_stats=True)  # y = x * 1 + 0: exact
    x, dy, _, _, _, _ = _inputs(config, shape, np.float32, np.float32)
    ones, zeros = np.ones(param_shape(config, shape), np.float32), np.zeros(param_shape(config, shape), np.float32)
    x.flat[:4] = (np.nan, -0.0, 0.0, -3.0)
    config_eps = BatchNormConfig(axis=axis, activation="relu", use_global_stats=True, epsilon=1e-30)
    for kernels in (cpu, ref):  # bias -0 keeps BN's output of -0 at -0 (and of +0 at +0); inv_std is exactly 1
        y = kernels.forward_training(x, ones, -zeros, zeros, ones, config_eps).y
        assert np.isnan(y.flat[0]) and np.signbit(y.flat[1]) and y.flat[1] == 0
        assert not np.signbit(y.flat[2]) and y.flat[3] == 0 and not np.signbit(y.flat[3])
        g = kernels.backward(dy, x, ones, zeros, ones, config_eps, y)
        np.testing.assert_array_equal(g.dx.flat[1:4], (0, 0, 0))  # dX at the NaN is NaN anyway (x - mean)
        kept = np.moveaxis(np.where(y <= 0, 0.0, dy.astype(np.float64)), axis, 0)  # NaN in y keeps dY
        np.testing.assert_allclose(g.dbias, kept.reshape(kept.shape[0], -1).sum(axis=1), rtol=1e-5, atol=1e-4)
    torch = pytest.importorskip("torch")
    tx = torch.tensor(x.flat[:4].copy(), requires_grad=True)
    torch.relu(tx).backward(torch.tensor(dy.flat[:4].copy()))
    np.testing.assert_array_equal(tx.grad.numpy(), (dy.flat[0], 0, 0, 0))


@pytest.mark.parametrize("axis", [1, -1])
def test_fused_relu_gradients_match_pytorch_float32(axis):
    """cpu's fused forward / backward against PyTorch's batch_norm followed by relu, autograd."""
    torch = pytest.importorskip("torch")
    config = BatchNormConfig(axis=axis, momentum=0.1, momentum_convention="pytorch", activation="relu")
    x, dy, scale, bias, mean, var = _inputs(config, (4, 6, 5, 7), np.float32, np.float32)
    res = cpu.forward_training(x, scale, bias, mean, var, config)
    grads = cpu.backward(dy, x, scale, res.saved_mean, res.saved_inv_std, config, res.y)
    perm = (0, 3, 1, 2) if axis == -1 else (0, 1, 2, 3)
    tx = torch.tensor(np.ascontiguousarray(x.transpose(perm)), requires_grad=True)
    tw, tb = torch.tensor(scale, requires_grad=True), torch.tensor(bias, requires_grad=True)
    ty = torch.relu(
        torch.nn.functional.batch_norm(tx, torch.tensor(mean), torch.tensor(var), tw, tb, training=True, momentum=0.1)
    )
    ty.backward(torch.tensor(np.ascontiguousarray(dy.transpose(perm))))
    inv = np.argsort(perm)
    np.testing.assert_allclose(res.y, ty.detach().numpy().transpose(inv), rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(grads.dx, tx.grad.numpy().transpose(inv), rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(grads.dscale, tw.grad.numpy(), rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(grads.dbias, tb.grad.numpy(), rtol=1e-4, atol=1e-4)


def test_fused_relu_y_argument_checked():
    config = BatchNormConfig(activation="relu")
    x, dy, scale, _, mean, var = _inputs(config, (4, 3, 5), np.float32, np.float32)
    for kernels in (cpu, ref):
        with pytest.raises(BatchNormError, match='activation "relu" needs y'):
            kernels.backward(dy, x, scale, mean, var, config)
        with pytest.raises(BatchNormError, match="takes y only with"):
            kernels.backward(dy, x, scale, mean, var, BatchNormConfig(), dy)
        with pytest.raises(BatchNormError, match="y must have shape"):
            kernels.backward(dy, x, scale, mean, var, config, dy[:2])
        with pytest.raises(BatchNormError, match="forward_inference has no fused activation"):
            kernels.forward_inference(x, scale, scale, mean, var, config)


# -- no JIT in the process ----------------------------------------------------------------------------------

_WITHOUT_NUMBA = """
import json, sys
import numpy as np
import onnxruntime as ort
from bnfuse.models import registry
from bnfuse.passes.training import build_training_graph
from bnfuse.runtime import cpu, ops, reference, session_options
from bnfuse.runtime.semantics import BatchNormConfig
from bnfuse.training import TrainingSession

train, _ = build_training_graph(registry.build("resnet18", size=32, width=0.125, seed=2), batch_size=4)
session = TrainingSession(train, lr=0.05)
rng = np.random.default_rng(1)
losses = [session.step(rng.standard_normal((4, 3, 32, 32)).astype(np.float32), rng.integers(0, 10, 4))
          for _ in range(2)]
options = session_options(["CPUExecutionProvider"])
options.intra_op_num_threads = 2
inference = ort.InferenceSession(ops.single_op_model(ops.INFERENCE).SerializeToString(), options,
                                 providers=["CPUExecutionProvider"])
errors = []
for shape in ((4, 3, 5), (8, 64, 48, 48)):  # the serial kernels; the loops as tasks on the session's pool
    x = rng.standard_normal(shape).astype(np.float32)
    params = [(rng.random(shape[1]) + 0.5).astype(np.float32) for _ in range(4)]
    y = inference.run(None, dict(zip(ops.INPUT_NAMES[ops.INFERENCE], (x, *params))))[0]
    want = reference.forward_inference(x, *params, BatchNormConfig())
    errors.append(float(np.abs(y - want).max()))
x = rng.standard_normal((8, 64, 48, 48)).astype(np.float32)
ones, zeros = np.ones(64, np.float32), np.zeros(64, np.float32)
direct = cpu.forward_training(x, ones, zeros, zeros, ones, BatchNormConfig())  # the C pool, all cores
want = reference.forward_training(x, ones, zeros, zeros, ones, BatchNormConfig()).y
errors.append(float(np.abs(direct.y - want).max()))
print(json.dumps({"losses": losses, "errors": errors,
                  "loaded": [name for name in ("numba", "llvmlite", "scipy") if name in sys.modules]}))
"""


def test_sessions_and_kernels_run_without_numba_or_scipy() -> None:
    """A training step, an inference session (serial kernels and pool tasks) and a direct parallel call, in a fresh
    process: right results, and neither numba, llvmlite nor SciPy is ever imported (issue 22: their ~125 MiB)."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[2]
    result = subprocess.run(
        [sys.executable, "-c", _WITHOUT_NUMBA], capture_output=True, text=True, timeout=300,
        env={**os.environ, "PYTHONPATH": str(repo)},
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["loaded"] == []
    assert all(np.isfinite(loss) for loss in report["losses"])
    assert max(report["errors"]) < 1e-4, report["errors"]


_FORCED_REDUCTIONS = """
import json
import numpy as np
from bnfuse.runtime import _cpukernels, cpu, reference
from bnfuse.runtime.semantics import BatchNormConfig

rng = np.random.default_rng(5)
worst = 0.0
for shape, axis, relu in (((4, 3, 45), 1, False), ((8, 16, 1024), 1, True), ((6, 5, 3), -1, True)):
    config = BatchNormConfig(axis=axis, activation="relu" if relu else "none")
    x = (rng.standard_normal(shape) * 2 + 3).astype(np.float32)
    dy = rng.standard_normal(shape).astype(np.float32)
    channels = shape[axis]
    scale, bias = (rng.random(channels) + 0.5).astype(np.float32), rng.standard_normal(channels).astype(np.float32)
    zeros, ones = np.zeros(channels, np.float32), np.ones(channels, np.float32)
    got = cpu.forward_training(x, scale, bias, zeros, ones, config)
    want = reference.forward_training(x, scale, bias, zeros, ones, config)
    grads = cpu.backward(dy, x, scale, want.saved_mean, want.saved_inv_std, config, want.y if relu else None)
    wants = reference.backward(dy, x, scale, want.saved_mean, want.saved_inv_std, config, want.y if relu else None)
    for a, b in zip((*got, *grads), (*want, *wants)):
        worst = max(worst, float(np.abs(a.astype(np.float64) - b).max() / max(1.0, float(np.abs(b).max()))))
print(json.dumps({"reductions": _cpukernels.reductions(), "worst": worst}))
"""


@pytest.mark.parametrize("reductions", ["portable", "avx2"])
def test_each_reduction_implementation_matches_the_reference(reductions: str) -> None:
    """The portable and AVX2 channel reductions (picked on CPUs without AVX-512 / AVX2; forced here by
    BNFUSE_CPU_REDUCTIONS) give the reference's results on the serial, parallel and rows paths, forward and backward,
    fused ReLU included. This process runs the best one the CPU has (the rest of this file tests it)."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    from bnfuse.runtime import _cpukernels

    assert _cpukernels.reductions() in ("avx512", "avx2", "portable")
    if reductions == "avx2" and _cpukernels.reductions() == "portable":
        pytest.skip("this CPU has no AVX2")
    repo = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": str(repo), "BNFUSE_CPU_REDUCTIONS": reductions}
    result = subprocess.run(
        [sys.executable, "-c", _FORCED_REDUCTIONS], capture_output=True, text=True, timeout=120, env=env
    )
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["reductions"] == reductions
    assert report["worst"] < 1e-5, report


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_the_c_pool_works_in_a_forked_child() -> None:
    """A child forked after the C pool's workers started has none of them: the pool starts its own, same bits."""
    config = BatchNormConfig()
    x = np.random.default_rng(0).standard_normal((8, 64, 48, 48)).astype(np.float32)
    ones, zeros = np.ones(64, np.float32), np.zeros(64, np.float32)
    assert x.nbytes >= cpu.SERIAL_BELOW_BYTES
    with cpu.kernel_threads(2):
        y = cpu.forward_training(x, ones, zeros, zeros, ones, config).y
        pid = os.fork()
        if pid == 0:  # pragma: no cover - the child reports through its exit code
            same = cpu.forward_training(x, ones, zeros, zeros, ones, config).y.tobytes() == y.tobytes()
            os._exit(0 if same else 3)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
