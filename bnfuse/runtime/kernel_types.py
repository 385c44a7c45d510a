"""What every BN kernel backend (reference, cpu, cuda) returns, and the argument checks they share.

The checks read only ``.shape``, ``.dtype`` and ``.ndim``, so they serve NumPy and CuPy arrays alike.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np

from bnfuse.runtime.semantics import BatchNormConfig, BatchNormError, Mode, channel_axis, param_shape


class TrainingOutputs(NamedTuple):
    """forward_training's results; running_* are the UPDATED running statistics, batch_var is biased.

    With use_global_stats the running statistics pass through unchanged and saved_mean, saved_inv_std and
    batch_var describe the statistics used to normalize: running_mean, 1 / sqrt(running_var + eps), running_var.
    """

    y: Any
    running_mean: Any
    running_var: Any
    saved_mean: Any
    saved_inv_std: Any
    batch_var: Any


class GradOutputs(NamedTuple):
    """backward's results: gradients of the input, the scale and the bias."""

    dx: Any
    dscale: Any
    dbias: Any


F16 = np.dtype(np.float16)
F32 = np.dtype(np.float32)
F64 = np.dtype(np.float64)


@dataclass(frozen=True)
class Layout:
    """An input viewed as (outer, channels, inner): statistics are per channel over outer and inner.

    Spatial mode with channel axis ``a``: outer = prod(shape[:a]), inner = prod(shape[a+1:]).
    Per-activation mode: every feature of one sample is a "channel": outer = N, channels = prod(shape[1:]),
    inner = 1. Fast backends reduce over this 3-D view of a C-contiguous array.
    """

    x_shape: tuple[int, ...]
    param_shape: tuple[int, ...]
    outer: int
    channels: int
    inner: int

    @property
    def count(self) -> int:
        """Elements reduced per channel (M)."""
        return self.outer * self.inner


def layout(config: BatchNormConfig, x_shape: tuple[int, ...]) -> Layout:
    shape = tuple(int(d) for d in x_shape)
    axis = channel_axis(config, len(shape))
    pshape = param_shape(config, shape)
    if config.mode is Mode.SPATIAL:
        return Layout(shape, pshape, math.prod(shape[:axis]), shape[axis], math.prod(shape[axis + 1 :]))
    return Layout(shape, pshape, shape[0], math.prod(shape[1:]), 1)


def unbiased_factor(count: int) -> float:
    """M / (M - 1) for the unbiased running variance; 1 when M <= 1 (a single sample has no spread)."""
    return count / (count - 1) if count > 1 else 1.0


@functools.lru_cache(maxsize=64)
def _dtype_name(dtype: Any) -> str:
    return np.dtype(dtype).name  # cached: numpy's dtype.name is slow, and kernels check dtypes on every call


def check_data_dtype(x: Any, allowed: tuple[str, ...]) -> None:
    name = _dtype_name(x.dtype)
    if name not in allowed:
        raise BatchNormError(f"input dtype {name} is not supported (expected one of {', '.join(allowed)})")


def check_params(x: Any, params: dict[str, Any], expected_shape: tuple[int, ...], allowed: tuple[str, ...]) -> Any:
    """Parameters share one dtype, float32 or x's dtype (or one of ``allowed``), and the expected shape."""
    dtypes = {_dtype_name(p.dtype) for p in params.values()}
    if len(dtypes) != 1:
        listing = ", ".join(f"{k}={_dtype_name(v.dtype)}" for k, v in params.items())
        raise BatchNormError(f"parameters must share one dtype, got {listing}")
    (name,) = dtypes
    if name not in {"float32", _dtype_name(x.dtype), *allowed}:
        raise BatchNormError(f"parameter dtype {name} must be float32 or the input's dtype {_dtype_name(x.dtype)}")
    for key, array in params.items():
        if tuple(array.shape) != expected_shape:
            raise BatchNormError(f"{key} has shape {tuple(array.shape)}, expected {expected_shape}")
    return next(iter(params.values())).dtype


def check_same(name: str, array: Any, like: Any) -> None:
    if tuple(array.shape) != tuple(like.shape) or array.dtype != like.dtype:
        raise BatchNormError(
            f"{name} must have shape {tuple(like.shape)} and dtype {_dtype_name(like.dtype)}, "
            f"got {tuple(array.shape)} {_dtype_name(array.dtype)}"
        )


def check_out(names: tuple[str, ...], out: tuple[Any, ...], shapes_dtypes: tuple[tuple[tuple, Any], ...]) -> None:
    """``out`` arrays must match the results they receive exactly (the kernels never reallocate them)."""
    for name, array, (shape, dtype) in zip(names, out, shapes_dtypes, strict=True):
        if array is None:
            raise BatchNormError(f"out.{name} is missing")
        if tuple(array.shape) != tuple(shape) or np.dtype(array.dtype) != np.dtype(dtype):
            raise BatchNormError(
                f"out.{name} must have shape {tuple(shape)} and dtype {_dtype_name(dtype)}, "
                f"got {tuple(array.shape)} {_dtype_name(array.dtype)}"
            )


def check_blend(alpha: float, beta: float, has_prior: bool, what: str) -> None:
    if not (math.isfinite(alpha) and math.isfinite(beta)):
        raise BatchNormError(f"{what} alpha and beta must be finite, got {alpha}, {beta}")
    if beta != 0 and not has_prior:
        raise BatchNormError(f"{what} beta={beta} blends with prior values: pass them in `out`")


# ----- the argument checks every backend runs before its kernels (one contract, three implementations) -----


def validate_inference(
    x: Any,
    params: dict[str, Any],
    config: BatchNormConfig,
    alpha: float,
    beta: float,
    out: Any,
    dtypes: tuple,
    extra: tuple,
) -> Layout:
    """Checks of forward_inference; ``dtypes``: the backend's data dtypes, ``extra``: its extra parameter dtypes."""
    lay = _validate_common(x, config, dtypes)
    if config.activation != "none":
        raise BatchNormError(f"forward_inference has no fused activation (got {config.activation!r})")
    check_params(x, params, lay.param_shape, extra)
    check_blend(alpha, beta, out is not None, "forward")
    if out is not None:
        check_out(("y",), (out,), ((x.shape, x.dtype),))
    return lay


def validate_training(
    x: Any,
    params: dict[str, Any],
    config: BatchNormConfig,
    alpha: float,
    beta: float,
    out: Any,
    dtypes: tuple,
    extra: tuple,
) -> tuple[Layout, Any]:
    """Checks of forward_training; returns the layout and the parameters' dtype."""
    lay = _validate_common(x, config, dtypes)
    pdtype = check_params(x, params, lay.param_shape, extra)
    check_blend(alpha, beta, out is not None, "forward")
    if out is not None:
        check_out(TrainingOutputs._fields, tuple(out), ((x.shape, x.dtype),) + ((lay.param_shape, pdtype),) * 5)
    return lay, pdtype


def validate_backward(
    dy: Any,
    x: Any,
    params: dict[str, Any],
    config: BatchNormConfig,
    blends: tuple[float, float, float, float],
    out: Any,
    dtypes: tuple,
    extra: tuple,
    y: Any = None,
) -> tuple[Layout, Any]:
    """Checks of backward; ``blends``: (alpha_data, beta_data, alpha_param, beta_param); ``y``: the forward's
    activated output, required with activation "relu" (and only then)."""
    lay = _validate_common(x, config, dtypes)
    check_same("dy", dy, x)
    if config.activation == "relu":
        if y is None:
            raise BatchNormError('backward with activation "relu" needs y, the forward\'s activated output')
        check_same("y", y, x)
    elif y is not None:
        raise BatchNormError('backward takes y only with activation "relu"')
    pdtype = check_params(x, params, lay.param_shape, extra)
    check_blend(blends[0], blends[1], out is not None, "backward data")
    check_blend(blends[2], blends[3], out is not None, "backward parameter")
    if out is not None:
        shapes = ((x.shape, x.dtype), (lay.param_shape, pdtype), (lay.param_shape, pdtype))
        check_out(GradOutputs._fields, tuple(out), shapes)
    return lay, pdtype


def _validate_common(x: Any, config: BatchNormConfig, dtypes: tuple) -> Layout:
    if not isinstance(config, BatchNormConfig):
        raise BatchNormError(f"config must be a BatchNormConfig, got {type(config).__name__}")
    check_data_dtype(x, dtypes)
    return layout(config, x.shape)
