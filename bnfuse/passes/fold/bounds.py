"""The bounds that decide whether a fold is exact: magnitudes a folded layer reaches (see fold_math), and the
padding that makes a forward fold of a shift inexact. A refusal is a NotFoldable with the reason."""

from __future__ import annotations

import numpy as np
import onnx_graphsurgeon as gs

from bnfuse.attributes import float_attribute
from bnfuse.passes.fold import fold_math
from bnfuse.passes.fold.context import NotFoldable, Producer, describe
from bnfuse.passes.fold.fold_math import ChannelAffine, NotRepresentableError


def require_magnitudes(magnitudes: tuple[float, float], dtype: np.dtype, *, growth: bool = True) -> None:
    problem = fold_math.magnitude_problem(*magnitudes, dtype, growth=growth)
    if problem is not None:
        raise NotRepresentableError(problem)


def require_backward_magnitudes(
    producer: Producer, affine: ChannelAffine, spread: fold_math.InputSpread, dtype: np.dtype
) -> None:
    old_bias = producer.bias
    if old_bias is not None and producer.kind == "Gemm":
        old_bias = float_attribute(producer.node.attrs, "beta", 1.0) * np.asarray(old_bias, dtype=np.float64)
    try:
        require_magnitudes(fold_math.backward_magnitudes(affine, spread, old_bias), dtype, growth=False)
        problem = fold_math.rounding_problem(*fold_math.backward_rounding(affine, spread, old_bias), dtype)
        if problem is not None:
            raise NotRepresentableError(problem)
    except NotRepresentableError as exc:
        raise NotFoldable(f"{describe(producer.node)}: {exc}") from exc


def conv_border_effect(conv: gs.Node, weight: np.ndarray) -> str | None:
    """Why a Conv's output at the borders would differ after a forward fold (padding), or None."""
    auto_pad = conv.attrs.get("auto_pad", "NOTSET")
    auto_pad = auto_pad.decode() if isinstance(auto_pad, bytes) else auto_pad
    if auto_pad == "VALID":
        return None
    if auto_pad in ("SAME_UPPER", "SAME_LOWER"):
        return f"pads its input (auto_pad={auto_pad}): padded zeros are not normalized"
    if any(int(p) for p in conv.attrs.get("pads", [])):
        return "pads its input: padded zeros are not normalized"
    return None


def deconv_border_effect(conv: gs.Node, weight: np.ndarray) -> str | None:
    """A ConvTranspose adds a constant shift uniformly only when each output sees exactly one tap of each input:
    1x1 kernel, stride 1, no output_shape / output_padding (pads then only crop)."""
    pointwise = all(int(k) == 1 for k in weight.shape[2:]) and all(int(s) == 1 for s in conv.attrs.get("strides", []))
    if not pointwise:
        return "spreads a shift unevenly (kernel larger than 1 or stride above 1): not exact"
    if "output_shape" in conv.attrs or any(int(p) for p in conv.attrs.get("output_padding", [])):
        return "pads its output (output_shape / output_padding): not exact"
    return None
