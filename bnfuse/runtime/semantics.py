"""The one batch-normalization semantics every bnfuse kernel implements.

It is the union of four reference APIs; their conventions are named, never implied:

* cuDNN: spatial / per-activation modes, alpha-beta blending of outputs, an exponential averaging
  factor for the running statistics (``factor = 1 / (1 + n)`` gives the cumulative moving average),
  saved mean and saved inverse standard deviation for the backward pass.
* DirectML BN-grad: ``dScale = sum(dY * x_hat)``, ``dBias = sum(dY)``; with global statistics
  ``dX = dY * scale / sqrt(var + eps)``; 1 to 8 dimensions; float16.
* MXNet: channel ``axis``, ``fix_gamma``, ``use_global_stats``, ``output_mean_var``; momentum 0.9
  meaning ``running = running * m + batch * (1 - m)`` (also ONNX's BatchNormalization convention).
* MindSpore (and PyTorch): momentum 0.1 meaning ``running = running * (1 - m) + batch * m``;
  epsilon in (0, 1], momentum in [0, 1]; NCHW / NHWC.
"""

from __future__ import annotations

import enum
import math
import numbers
from dataclasses import dataclass

import numpy as np

from bnfuse.errors import BnfuseError


class BatchNormError(BnfuseError, ValueError):
    """Invalid batch-normalization arguments (attribute, shape or dtype)."""


class Mode(str, enum.Enum):
    """cuDNN's normalization modes."""

    SPATIAL = "spatial"  # statistics per channel over batch and spatial axes; params shaped (C,)
    PER_ACTIVATION = "per_activation"  # statistics over the batch axis only; params shaped x.shape[1:]


class MomentumConvention(str, enum.Enum):
    """How ``momentum`` weighs the running statistics against the batch statistics."""

    ONNX = "onnx"  # also MXNet: running = running * m + batch * (1 - m); default m = 0.9
    PYTORCH = "pytorch"  # also MindSpore: running = running * (1 - m) + batch * m; default m = 0.1
    CUDNN = "cudnn"  # m is cuDNN's exponentialAverageFactor: same formula as PYTORCH

    @classmethod
    def parse(cls, name: str) -> MomentumConvention:
        aliases = {"mxnet": cls.ONNX, "mindspore": cls.PYTORCH}
        key = name.lower()
        if key in aliases:
            return aliases[key]
        try:
            return cls(key)
        except ValueError:
            names = ", ".join([c.value for c in cls] + list(aliases))
            raise BatchNormError(f"unknown momentum convention {name!r} (expected one of {names})") from None


ACTIVATIONS = ("none", "relu")


@dataclass(frozen=True)
class BatchNormConfig:
    """Attributes of a batch normalization, shared by forward and backward."""

    epsilon: float = 1e-5
    momentum: float = 0.9
    momentum_convention: MomentumConvention = MomentumConvention.ONNX
    mode: Mode = Mode.SPATIAL
    axis: int = 1  # channel axis; -1 is channels-last (NHWC)
    unbiased_running_var: bool = False  # running variance updated with M / (M - 1) * batch variance
    fix_gamma: bool = False  # scale treated as 1 and its gradient is 0 (MXNet)
    use_global_stats: bool = False  # normalize with the running statistics, even in training
    strict_epsilon: bool = False  # MindSpore's range check: epsilon must also be <= 1 (implied by "mindspore")
    activation: str = "none"  # "relu": the forward writes relu(BN(X)); the backward masks dY where Y <= 0

    def __post_init__(self) -> None:
        conv = self.momentum_convention
        if isinstance(conv, str) and not isinstance(conv, MomentumConvention):
            if conv.lower() == "mindspore":  # the alias is lost by parsing; MindSpore's epsilon range is not
                object.__setattr__(self, "strict_epsilon", True)
            object.__setattr__(self, "momentum_convention", MomentumConvention.parse(conv))
        elif not isinstance(conv, MomentumConvention):
            raise BatchNormError(f"momentum_convention must be a string or MomentumConvention, got {conv!r}")
        try:
            object.__setattr__(self, "mode", Mode(self.mode))
        except ValueError:
            choices = " or ".join(repr(m.value) for m in Mode)
            raise BatchNormError(f"mode must be {choices}, got {self.mode!r}") from None
        # bool is an int subclass: momentum=True or axis=False are almost surely mistakes, not numbers
        for name in ("epsilon", "momentum"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, numbers.Real):
                raise BatchNormError(f"{name} must be a real number, got {value!r} ({type(value).__name__})")
            object.__setattr__(self, name, float(value))
        if isinstance(self.axis, bool) or not isinstance(self.axis, numbers.Integral):
            raise BatchNormError(f"axis must be an integer, got {self.axis!r} ({type(self.axis).__name__})")
        object.__setattr__(self, "axis", int(self.axis))
        for name in ("unbiased_running_var", "fix_gamma", "use_global_stats", "strict_epsilon"):
            value = getattr(self, name)
            if not (isinstance(value, (bool, np.bool_)) or (isinstance(value, numbers.Integral) and value in (0, 1))):
                raise BatchNormError(f"{name} must be a bool (or 0 / 1), got {value!r} ({type(value).__name__})")
            object.__setattr__(self, name, bool(value))
        if self.activation not in ACTIVATIONS:
            choices = " or ".join(repr(a) for a in ACTIVATIONS)
            raise BatchNormError(f"activation must be {choices}, got {self.activation!r}")
        if not (math.isfinite(self.epsilon) and self.epsilon > 0):
            raise BatchNormError(f"epsilon must be > 0, got {self.epsilon}")
        if self.strict_epsilon and self.epsilon > 1:
            raise BatchNormError(f"epsilon must be in (0, 1] (MindSpore's range), got {self.epsilon}")
        if not (0.0 <= self.momentum <= 1.0):
            raise BatchNormError(f"momentum must be in [0, 1], got {self.momentum}")

    @property
    def batch_weight(self) -> float:
        """Weight of the batch statistic in the running update: running*(1-w) + batch*w."""
        if self.momentum_convention is MomentumConvention.ONNX:
            return 1.0 - self.momentum
        return self.momentum


def cumulative_average_factor(updates_so_far: int) -> float:
    """cuDNN's factor for a cumulative moving average after ``updates_so_far`` earlier updates."""
    if updates_so_far < 0:
        raise BatchNormError(f"update count must be >= 0, got {updates_so_far}")
    return 1.0 / (1.0 + updates_so_far)


def channel_axis(config: BatchNormConfig, ndim: int) -> int:
    """The normalized channel axis for a tensor of rank ``ndim`` (2 to 8)."""
    if not 2 <= ndim <= 8:
        raise BatchNormError(f"input rank must be 2 to 8, got {ndim}")
    axis = config.axis + ndim if config.axis < 0 else config.axis
    if not 0 < axis < ndim:
        raise BatchNormError(f"channel axis {config.axis} is out of range for rank {ndim} (batch is axis 0)")
    return axis


def param_shape(config: BatchNormConfig, x_shape: tuple[int, ...]) -> tuple[int, ...]:
    """Shape of scale, bias, mean and variance for an input of shape ``x_shape``."""
    axis = channel_axis(config, len(x_shape))
    if config.mode is Mode.SPATIAL:
        return (x_shape[axis],)
    return tuple(x_shape[1:])


def reduction_axes(config: BatchNormConfig, ndim: int) -> tuple[int, ...]:
    """Axes the statistics are reduced over."""
    axis = channel_axis(config, ndim)
    if config.mode is Mode.SPATIAL:
        return tuple(a for a in range(ndim) if a != axis)
    return (0,)
