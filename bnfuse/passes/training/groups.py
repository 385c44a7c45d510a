"""Parameter groups: per-pattern weight decay and learning-rate multipliers (PyTorch's optimizer param groups).

A rule matches parameters by initializer-name glob (fnmatch) or by role: ``@bn`` (BatchNormalization scales
and biases) and ``@1d`` (every 1-D parameter: biases and normalization scales, the usual "no decay" set).
Weight-decay rules are applied in the order given and the last match wins, so ``--weight-decay 1e-4
--no-decay @1d`` decays only the weights of rank >= 2; learning-rate multipliers likewise.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from bnfuse.errors import BnfuseError

ROLES = ("@bn", "@1d")


@dataclass(frozen=True)
class GroupRule:
    """Parameters matching ``pattern`` get ``weight_decay`` (None: unchanged) and ``lr_scale`` (None: unchanged)."""

    pattern: str
    weight_decay: float | None = None
    lr_scale: float | None = None

    def __post_init__(self) -> None:
        if self.pattern.startswith("@") and self.pattern not in ROLES:
            raise BnfuseError(f"unknown parameter role {self.pattern!r} (expected one of {', '.join(ROLES)})")
        if self.weight_decay is not None and not self.weight_decay >= 0:
            raise BnfuseError(f"weight decay for {self.pattern!r} must be >= 0, got {self.weight_decay}")
        if self.lr_scale is not None and not self.lr_scale >= 0:
            raise BnfuseError(f"learning-rate multiplier for {self.pattern!r} must be >= 0, got {self.lr_scale}")


def parse_rule(text: str, kind: str) -> GroupRule:
    """``GLOB=VALUE`` (kind "weight_decay" or "lr_scale") -> GroupRule; a one-line error otherwise."""
    pattern, sep, value = text.rpartition("=")
    try:
        number = float(value)
    except ValueError:
        number = None
    if not sep or not pattern or number is None:
        raise BnfuseError(f"expected PATTERN=VALUE, got {text!r}")
    return GroupRule(pattern, **{kind: number})


@dataclass(frozen=True)
class Hyper:
    """One parameter's optimizer settings."""

    weight_decay: float
    lr_scale: float = 1.0


def resolve(
    parameters: Sequence[str],
    rules: Sequence[GroupRule],
    default_decay: float,
    *,
    bn_parameters: set[str],
    ranks: Mapping[str, int],
) -> dict[str, Hyper]:
    """Each parameter's weight decay and learning-rate multiplier; a rule matching no parameter is an error."""
    decay = dict.fromkeys(parameters, default_decay)
    scale = dict.fromkeys(parameters, 1.0)
    for rule in rules:
        matched = [p for p in parameters if _matches(rule.pattern, p, bn_parameters, ranks)]
        if not matched:
            raise BnfuseError(f"parameter group {rule.pattern!r} matches no trainable parameter")
        for name in matched:
            if rule.weight_decay is not None:
                decay[name] = rule.weight_decay
            if rule.lr_scale is not None:
                scale[name] = rule.lr_scale
    return {name: Hyper(decay[name], scale[name]) for name in parameters}


def _matches(pattern: str, name: str, bn_parameters: set[str], ranks: Mapping[str, int]) -> bool:
    if pattern == "@bn":
        return name in bn_parameters
    if pattern == "@1d":
        return ranks.get(name, 0) <= 1
    return fnmatch.fnmatchcase(name, pattern)


def describe(hypers: Mapping[str, Hyper]) -> str:
    """'1e-4 on 12 tensors, 0 on 8 tensors' (weight decay) plus learning-rate multipliers other than 1."""
    by_decay: dict[float, int] = {}
    by_scale: dict[float, int] = {}
    for hyper in hypers.values():
        by_decay[hyper.weight_decay] = by_decay.get(hyper.weight_decay, 0) + 1
        if hyper.lr_scale != 1.0:
            by_scale[hyper.lr_scale] = by_scale.get(hyper.lr_scale, 0) + 1
    text = ", ".join(f"{value:g} on {count} tensors" for value, count in sorted(by_decay.items(), reverse=True))
    if by_scale:
        text += "; lr x" + ", x".join(f"{value:g} on {count} tensors" for value, count in sorted(by_scale.items()))
    return text
