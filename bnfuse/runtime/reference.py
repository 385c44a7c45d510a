"""NumPy reference BN kernels: float64 inside, written to be read. The oracle for the cpu and cuda backends.

Formulas (M = elements reduced per channel, x_hat = (x - mean) * inv_std, g = scale, or 1 with fix_gamma):

* forward:  y = g * x_hat + bias, blended as ``alpha * y + beta * y_prior`` (cuDNN; prior read only if beta != 0)
* training: mean, biased variance over the reduction axes (two-pass); running = running * (1 - w) + batch * w
  with w = config.batch_weight; the running variance takes M / (M - 1) * batch_var when unbiased_running_var.
* backward with batch statistics: dx = g * inv_std * (dy - sum(dy) / M - x_hat * sum(dy * x_hat) / M)
* backward with global statistics (DirectML): dx = dy * g * inv_std
* dscale = sum(dy * x_hat) (0 with fix_gamma), dbias = sum(dy)
* activation "relu" (fused BN -> ReLU, as PyTorch's and onnxruntime's Relu: relu(NaN) = NaN, relu(-0) = -0):
  the forward writes ``where(y < 0, 0, y)`` after the blend; the backward takes the forward's Y and uses
  ``where(Y <= 0, 0, dy)`` in place of dy everywhere (a NaN in Y passes dy, as PyTorch's threshold_backward)
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

import numpy as np

from bnfuse.runtime.kernel_types import (
    GradOutputs,
    TrainingOutputs,
    unbiased_factor,
    validate_backward,
    validate_inference,
    validate_training,
)
from bnfuse.runtime.semantics import BatchNormConfig, Mode, channel_axis, reduction_axes

DATA_DTYPES = ("float16", "float32", "float64", "bfloat16")
_EXTRA_PARAM_DTYPES = ("float64",)
F = TypeVar("F", bound=Callable[..., Any])


def _quiet(fn: F) -> F:
    """NaN / Inf propagate like plain floating point; NumPy's warnings about them are noise here."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
            return fn(*args, **kwargs)

    return wrapper  # type: ignore[return-value]


def _f64(array: np.ndarray) -> np.ndarray:
    return np.asarray(array).astype(np.float64)


def _param_view(param: np.ndarray, config: BatchNormConfig, ndim: int) -> np.ndarray:
    """A float64 copy of a parameter shaped to broadcast against the input."""
    value = _f64(param)
    if config.mode is Mode.SPATIAL:
        shape = [1] * ndim
        shape[channel_axis(config, ndim)] = value.shape[0]
        return value.reshape(shape)
    return value.reshape((1, *value.shape))


def _squeeze(value: np.ndarray, config: BatchNormConfig, ndim: int) -> np.ndarray:
    """Per-channel float64 statistics (kept dims) back to the parameter shape."""
    return value.reshape(value.shape[1:] if config.mode is Mode.PER_ACTIVATION else (-1,))


def _blend(value: np.ndarray, alpha: float, beta: float, prior: np.ndarray | None) -> np.ndarray:
    """cuDNN blending; the prior is not read when beta is 0 (so NaN garbage there cannot leak)."""
    result = alpha * value
    if beta != 0:
        result = result + beta * _f64(prior)
    return result


def _store(value: np.ndarray, dtype: np.dtype, out: np.ndarray | None) -> np.ndarray:
    if out is None:
        return value.astype(dtype)
    out[...] = value
    return out


def relu(value: np.ndarray) -> np.ndarray:
    """max(value, 0) keeping NaN and -0 (PyTorch's and onnxruntime's Relu)."""
    return np.where(value < 0, 0.0, value)


def relu_mask(dy: np.ndarray, y: np.ndarray) -> np.ndarray:
    """dy where the activated output y > 0 (or NaN), 0 where y <= 0 (PyTorch's ReLU backward)."""
    return np.where(_f64(y) <= 0, 0.0, dy)


def _gamma(scale: np.ndarray, config: BatchNormConfig) -> np.ndarray:
    return np.ones_like(scale) if config.fix_gamma else scale


@_quiet
def forward_inference(
    x: np.ndarray,
    scale: np.ndarray,
    bias: np.ndarray,
    mean: np.ndarray,
    var: np.ndarray,
    config: BatchNormConfig,
    *,
    alpha: float = 1.0,
    beta: float = 0.0,
    out: np.ndarray | None = None,
) -> np.ndarray:
    """y = alpha * (g * (x - mean) / sqrt(var + eps) + bias) + beta * y_prior."""
    params = {"scale": scale, "bias": bias, "mean": mean, "var": var}
    validate_inference(x, params, config, alpha, beta, out, DATA_DTYPES, _EXTRA_PARAM_DTYPES)
    ndim = x.ndim
    g, b, m, v = (_param_view(p, config, ndim) for p in (scale, bias, mean, var))
    y = _gamma(g, config) * (_f64(x) - m) / np.sqrt(v + config.epsilon) + b
    return _store(_blend(y, alpha, beta, out), x.dtype, out)


@_quiet
def forward_training(
    x: np.ndarray,
    scale: np.ndarray,
    bias: np.ndarray,
    running_mean: np.ndarray,
    running_var: np.ndarray,
    config: BatchNormConfig,
    *,
    alpha: float = 1.0,
    beta: float = 0.0,
    out: TrainingOutputs | None = None,
) -> TrainingOutputs:
    """Normalize with batch statistics (or the running ones with use_global_stats) and update the running ones."""
    params = {"scale": scale, "bias": bias, "running_mean": running_mean, "running_var": running_var}
    lay, pdtype = validate_training(x, params, config, alpha, beta, out, DATA_DTYPES, _EXTRA_PARAM_DTYPES)
    ndim = x.ndim
    axes = reduction_axes(config, ndim)
    xf = _f64(x)
    g, b, rm, rv = (_param_view(p, config, ndim) for p in (scale, bias, running_mean, running_var))
    if config.use_global_stats:
        mean, var = rm, rv
        new_rm, new_rv = rm, rv
    else:
        mean = xf.mean(axis=axes, keepdims=True)
        var = np.square(xf - mean).mean(axis=axes, keepdims=True)  # two-pass: stable for |mean| >> std
        w = config.batch_weight
        running_var_sample = var * unbiased_factor(lay.count) if config.unbiased_running_var else var
        new_rm = rm * (1.0 - w) + mean * w
        new_rv = rv * (1.0 - w) + running_var_sample * w
    inv_std = 1.0 / np.sqrt(var + config.epsilon)
    y = _gamma(g, config) * (xf - mean) * inv_std + b
    outs = out if out is not None else TrainingOutputs(None, None, None, None, None, None)
    y = _blend(y, alpha, beta, outs.y)
    return TrainingOutputs(
        _store(relu(y) if config.activation == "relu" else y, x.dtype, outs.y),
        _store(_squeeze(new_rm, config, ndim), pdtype, outs.running_mean),
        _store(_squeeze(new_rv, config, ndim), pdtype, outs.running_var),
        _store(_squeeze(mean, config, ndim), pdtype, outs.saved_mean),
        _store(_squeeze(inv_std, config, ndim), pdtype, outs.saved_inv_std),
        _store(_squeeze(var, config, ndim), pdtype, outs.batch_var),
    )


@_quiet
def backward(
    dy: np.ndarray,
    x: np.ndarray,
    scale: np.ndarray,
    saved_mean: np.ndarray,
    saved_inv_std: np.ndarray,
    config: BatchNormConfig,
    y: np.ndarray | None = None,
    *,
    alpha_data: float = 1.0,
    beta_data: float = 0.0,
    alpha_param: float = 1.0,
    beta_param: float = 0.0,
    out: GradOutputs | None = None,
) -> GradOutputs:
    """dX (full gradient through the batch statistics, or DirectML's with global statistics), dScale, dBias.
    With activation "relu", ``y`` is the forward's activated output and dy is masked by it first."""
    params = {"scale": scale, "saved_mean": saved_mean, "saved_inv_std": saved_inv_std}
    blends = (alpha_data, beta_data, alpha_param, beta_param)
    lay, pdtype = validate_backward(dy, x, params, config, blends, out, DATA_DTYPES, _EXTRA_PARAM_DTYPES, y)
    ndim = x.ndim
    axes = reduction_axes(config, ndim)
    dyf, xf = _f64(dy), _f64(x)
    if config.activation == "relu":
        dyf = relu_mask(dyf, y)
    g, mean, inv_std = (_param_view(p, config, ndim) for p in (scale, saved_mean, saved_inv_std))
    g = _gamma(g, config)
    x_hat = (xf - mean) * inv_std
    dbias = dyf.sum(axis=axes, keepdims=True)
    dscale = (dyf * x_hat).sum(axis=axes, keepdims=True)
    if config.use_global_stats:
        dx = dyf * g * inv_std
    else:
        m = float(lay.count)
        dx = g * inv_std * (dyf - dbias / m - x_hat * dscale / m)
    if config.fix_gamma:
        dscale = np.zeros_like(dscale)
    outs = out if out is not None else GradOutputs(None, None, None)
    return GradOutputs(
        _store(_blend(dx, alpha_data, beta_data, outs.dx), x.dtype, outs.dx),
        _store(_blend(_squeeze(dscale, config, ndim), alpha_param, beta_param, outs.dscale), pdtype, outs.dscale),
        _store(_blend(_squeeze(dbias, config, ndim), alpha_param, beta_param, outs.dbias), pdtype, outs.dbias),
    )


def conv_weight_grad(
    x: np.ndarray,
    dy: np.ndarray,
    kernel_shape: tuple[int, ...],
    strides: tuple[int, ...],
    dilations: tuple[int, ...],
    pads: tuple[int, ...],
    group: int,
) -> np.ndarray:
    """The weight gradient of an ONNX Conv (1-D to 3-D), float64:
    dW[o, c, k...] = sum over n and output positions p of dY[n, o, p] * Xpad[n, g(o) * C/G + c, p * s + k * d],
    shaped like the weight [O, C/G, k...]. Xpad is X zero-padded by ``pads`` (ONNX order: begins, then ends)."""
    spatial = x.ndim - 2
    n, channels = x.shape[:2]
    out_channels, out = dy.shape[1], dy.shape[2:]
    widths = [(0, 0), (0, 0)] + [(pads[i], pads[i + spatial]) for i in range(spatial)]
    padded = np.pad(_f64(x), widths)
    grouped_dy = _f64(dy).reshape(n, group, out_channels // group, -1)
    grad = np.zeros((group, out_channels // group, channels // group, *kernel_shape))
    for offset in np.ndindex(*kernel_shape):
        window = tuple(
            slice(k * d, k * d + (o - 1) * s + 1, s) for k, d, o, s in zip(offset, dilations, out, strides, strict=True)
        )
        patch = padded[(slice(None), slice(None), *window)].reshape(n, group, channels // group, -1)
        grad[(slice(None), slice(None), slice(None), *offset)] = np.einsum("ngop,ngcp->goc", grouped_dy, patch)
    return grad.reshape(out_channels, channels // group, *kernel_shape)


def conv_input_grad(
    dy: np.ndarray,
    w: np.ndarray,
    x_spatial: tuple[int, ...],
    strides: tuple[int, ...],
    dilations: tuple[int, ...],
    pads: tuple[int, ...],
    group: int,
) -> np.ndarray:
    """The input gradient of an ONNX Conv (1-D to 3-D), float64: dX[n, g * C/G + c, i] = sum over the output positions
    p and kernel offsets k with p * s + k * d = i + pad of dY[n, g * O/G + o, p] * W[g * O/G + o, c, k], shaped like X
    [N, C, x_spatial...] (positions no window reads get zero). ``pads`` in ONNX order: begins, then ends."""
    spatial = dy.ndim - 2
    n, out_channels, out = dy.shape[0], dy.shape[1], dy.shape[2:]
    per_group, kernel_shape = w.shape[1], w.shape[2:]
    padded_shape = [x_spatial[i] + pads[i] + pads[i + spatial] for i in range(spatial)]
    grouped_dy = _f64(dy).reshape(n, group, out_channels // group, -1)
    grouped_w = _f64(w).reshape(group, out_channels // group, per_group, *kernel_shape)
    padded = np.zeros((n, group, per_group, *padded_shape))
    for offset in np.ndindex(*kernel_shape):
        window = tuple(
            slice(k * d, k * d + (o - 1) * s + 1, s) for k, d, o, s in zip(offset, dilations, out, strides, strict=True)
        )
        taps = grouped_w[(slice(None), slice(None), slice(None), *offset)]  # [G, O/G, C/G]
        contribution = np.einsum("ngop,goc->ngcp", grouped_dy, taps).reshape(n, group, per_group, *out)
        padded[(slice(None), slice(None), slice(None), *window)] += contribution
    inside = tuple(slice(pads[i], pads[i] + x_spatial[i]) for i in range(spatial))
    return padded[(slice(None), slice(None), slice(None), *inside)].reshape(n, group * per_group, *x_spatial)
