"""The arithmetic of folding a per-channel affine map into a linear producer.

Pure NumPy, no graph code. Every result is computed in float64 and rounded once to the producer's
dtype; a result that does not fit that dtype (overflow to inf, NaN) raises NotRepresentableError so
the caller can skip the fold instead of writing a broken model.

A per-channel affine map is ``y[:, c, ...] = scale[c] * x[:, c, ...] + shift[c]``. Batch
normalization in inference mode is one; so are Mul / Add / Sub / Div by a per-channel constant.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from bnfuse.passes.fold.scale_kernel import scaled


class InvalidStatisticsError(ValueError):
    """Batch-normalization statistics no model may carry (negative or NaN variance, bad epsilon)."""


class NotRepresentableError(ValueError):
    """A folded value does not fit the producer's dtype (overflow or NaN)."""


@dataclass(frozen=True)
class ChannelAffine:
    """``y = scale * x + shift`` per output channel, in float64."""

    scale: np.ndarray
    shift: np.ndarray

    @property
    def channels(self) -> int:
        return int(self.scale.shape[0])


def batchnorm_affine(
    scale: np.ndarray, bias: np.ndarray, mean: np.ndarray, var: np.ndarray, epsilon: float
) -> ChannelAffine:
    """Inference batch normalization as an affine map: a = scale / sqrt(var + eps), b = bias - mean * a."""
    with np.errstate(invalid="ignore"):  # a signalling NaN warns when widened; NaN is refused below all the same
        scale64, bias64, mean64, var64 = (np.asarray(p, dtype=np.float64).reshape(-1) for p in (scale, bias, mean, var))
    lengths = {p.shape[0] for p in (scale64, bias64, mean64, var64)}
    if len(lengths) != 1:
        raise InvalidStatisticsError(f"scale, bias, mean and variance lengths differ: {sorted(lengths)}")
    if np.isnan(var64).any() or (var64 < 0).any():
        raise InvalidStatisticsError("variance has negative or NaN entries")
    if not (np.isfinite(epsilon) and epsilon >= 0):
        raise InvalidStatisticsError(f"epsilon must be finite and >= 0, got {epsilon}")
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        factor = scale64 / np.sqrt(var64 + epsilon)
        shift = bias64 - mean64 * factor
    return ChannelAffine(factor, shift)


def constant_affine(op: str, constant: np.ndarray, channels: int, *, constant_first: bool) -> ChannelAffine:
    """The affine map of ``x <op> c`` (or ``c <op> x`` when ``constant_first``) for a per-channel c.

    ``constant`` must already be reduced to shape (channels,) or (1,). Raises ValueError for maps that are
    not affine in x (``c / x``) or not finite (division by zero).
    """
    c = np.broadcast_to(np.asarray(constant, dtype=np.float64).reshape(-1), (channels,))
    ones, zeros = np.ones(channels), np.zeros(channels)
    if op == "Mul":
        return ChannelAffine(c.copy(), zeros)
    if op == "Add":
        return ChannelAffine(ones, c.copy())
    if op == "Sub":
        return ChannelAffine(-ones, c.copy()) if constant_first else ChannelAffine(ones, -c)
    if op == "Div":
        if constant_first:
            raise ValueError("c / x is not affine in x")
        if not (np.all(c != 0) and np.all(np.isfinite(c))):
            raise ValueError("division by zero or by a non-finite constant")
        return ChannelAffine(1.0 / c, zeros)
    raise ValueError(f"{op} is not a per-channel affine operator")


def fold_conv(
    weight: np.ndarray, bias: np.ndarray | None, affine: ChannelAffine
) -> tuple[np.ndarray, np.ndarray | None]:
    """Conv (any rank, any group count): output channels are weight axis 0."""
    _expect_channels(weight.shape[0], affine)
    factor = affine.scale.reshape((-1,) + (1,) * (weight.ndim - 1))
    return _scaled(weight, factor), _folded_bias(bias, affine, weight.dtype)


def fold_conv_transpose(
    weight: np.ndarray, bias: np.ndarray | None, affine: ChannelAffine, group: int
) -> tuple[np.ndarray, np.ndarray | None]:
    """ConvTranspose: W is (C_in, C_out/group, k...); output channel o = g * (C_out/group) + j."""
    c_in, per_group = weight.shape[0], weight.shape[1]
    if group < 1 or c_in % group:
        raise ValueError(f"group {group} does not divide the {c_in} input channels")
    _expect_channels(per_group * group, affine)
    grouped = weight.reshape((group, c_in // group, per_group) + weight.shape[2:])
    factor = affine.scale.reshape((group, 1, per_group) + (1,) * (weight.ndim - 2))
    return _scaled(grouped, factor).reshape(weight.shape), _folded_bias(bias, affine, weight.dtype)


def fold_gemm(
    b_matrix: np.ndarray, c: np.ndarray | None, affine: ChannelAffine, *, trans_b: bool, beta: float
) -> tuple[np.ndarray, np.ndarray | None]:
    """Gemm ``alpha * A' B' + beta * C`` followed by a per-column affine map.

    Returns (B', C'') for a Gemm with the same alpha and beta = 1: B' has its output columns scaled,
    C'' = beta * C * scale + shift (C absent counts as 0; its broadcast shape is kept or widened to (N,)).
    C'' is None when C is absent and the shift is zero.
    """
    columns = b_matrix.shape[0] if trans_b else b_matrix.shape[1]
    _expect_channels(columns, affine)
    factor = affine.scale.reshape((-1, 1) if trans_b else (1, -1))
    new_b = _scaled(b_matrix, factor)
    if c is None:
        if not affine.shift.any():
            return new_b, None
        new_c = affine.shift
    else:
        new_c = beta * np.asarray(c, dtype=np.float64) * affine.scale + affine.shift
    return new_b, _cast_checked(new_c, b_matrix.dtype)


def fold_matmul(
    weight: np.ndarray, bias: np.ndarray | None, affine: ChannelAffine
) -> tuple[np.ndarray, np.ndarray | None]:
    """MatMul by a constant (K, N) weight, optional bias of rank <= 2: columns are the channels."""
    _expect_channels(weight.shape[1], affine)
    new_w = _scaled(weight, affine.scale.reshape(1, -1))
    if bias is None:
        return new_w, _cast_checked(affine.shift, weight.dtype) if affine.shift.any() else None
    new_bias = np.asarray(bias, dtype=np.float64) * affine.scale + affine.shift
    return new_w, _cast_checked(new_bias, weight.dtype)


# ----- forward folds: the map is applied to the *input* of a linear consumer ------------------------
# y = W (scale * x + shift) + b = (W scale) x + (W shift + b). The scale goes into W along its input axis;
# the shift goes through W into the bias, which is exact only where every output sums W over all its taps
# (the caller rules out padding, which feeds unnormalized zeros).


def repeat_channels(affine: ChannelAffine, inner: int) -> ChannelAffine:
    """The map per feature of a (N, C, d1, ...) tensor flattened to (N, C * inner): channel c covers ``inner``."""
    if inner < 1:
        raise ValueError(f"{inner} features per channel")
    return ChannelAffine(np.repeat(affine.scale, inner), np.repeat(affine.shift, inner))


def split_channels(affine: ChannelAffine, sizes: list[int]) -> list[ChannelAffine]:
    """The map cut into consecutive channel blocks (a Concat's inputs along the channel axis)."""
    if sum(sizes) != affine.channels or any(n < 1 for n in sizes):
        raise ValueError(f"blocks {sizes} do not cover {affine.channels} channels")
    cuts = np.cumsum(sizes)[:-1]
    return [
        ChannelAffine(scale, shift)
        for scale, shift in zip(np.split(affine.scale, cuts), np.split(affine.shift, cuts), strict=True)
    ]


_WHOLE_AXIS = 2**31 - 1  # a Slice end at or past this keeps the rest of the axis (exporters write INT_MAX / INT64_MAX)


def slice_channels(
    starts: list[int], ends: list[int], axes: list[int] | None, steps: list[int] | None, rank: int, channels: int
) -> tuple[int, int]:
    """The channels [begin, end) an ONNX Slice keeps on axis 1 of a rank-``rank`` tensor of ``channels`` channels;
    ValueError where it keeps anything else than one block of whole channels (a step, another axis cut)."""
    axes = list(range(len(starts))) if axes is None else [a + rank if a < 0 else a for a in axes]
    steps = [1] * len(starts) if steps is None else list(steps)
    if not (len(starts) == len(ends) == len(axes) == len(steps)):
        raise ValueError("starts, ends, axes and steps of different lengths")
    begin, end = 0, channels
    for start, stop, axis, step in zip(starts, ends, axes, steps, strict=True):
        if step != 1:
            raise ValueError(f"a step of {step} on axis {axis}")
        if axis != 1:
            if start != 0 or stop < _WHOLE_AXIS:
                raise ValueError(f"it also cuts axis {axis}")
            continue
        begin = min(max(start + channels if start < 0 else start, 0), channels)
        end = min(max(stop + channels if stop < 0 else stop, 0), channels)
    if begin >= end:
        raise ValueError(f"it keeps no channel ({begin}:{end})")
    return begin, end


def split_channels_ranges(sizes: list[int] | None, outputs: int, channels: int) -> list[tuple[int, int]]:
    """The channel block [begin, end) of each output of an ONNX Split along axis 1 (``sizes`` None: equal parts)."""
    if sizes is None:
        if outputs < 1 or channels % outputs:
            raise ValueError(f"{channels} channels do not split into {outputs} equal parts")
        sizes = [channels // outputs] * outputs
    if len(sizes) != outputs or sum(sizes) != channels or any(n < 0 for n in sizes):
        raise ValueError(f"split {list(sizes)} does not cut {channels} channels into {outputs} outputs")
    edges = np.concatenate([[0], np.cumsum(sizes)]).astype(int)
    return [(int(a), int(b)) for a, b in zip(edges[:-1], edges[1:], strict=True)]


def concat_inputs_covering(sizes: list[int], begin: int, end: int) -> tuple[int, int]:
    """The Concat inputs [first, last) (of ``sizes`` channels each) that hold exactly channels [begin, end);
    ValueError where that block cuts an input."""
    edges = [0, *np.cumsum(sizes).astype(int).tolist()]
    if begin not in edges or end not in edges:
        raise ValueError(f"channels {begin}:{end} cut a Concat input (its inputs end at channels {edges[1:]})")
    return edges.index(begin), edges.index(end)


def forward_conv(
    weight: np.ndarray, bias: np.ndarray | None, affine: ChannelAffine, group: int
) -> tuple[np.ndarray, np.ndarray | None]:
    """Conv reading the mapped tensor: W is (C_out, C_in/group, k...); W[o, i] reads input channel
    (o // (C_out/group)) * (C_in/group) + i."""
    c_out, per_group = weight.shape[0], weight.shape[1]
    if group < 1 or c_out % group:
        raise ValueError(f"group {group} does not divide the {c_out} output channels")
    _expect_channels(per_group * group, affine)
    in_channel = (np.arange(c_out)[:, None] // (c_out // group)) * per_group + np.arange(per_group)[None, :]
    factor = affine.scale[in_channel].reshape(weight.shape[:2] + (1,) * (weight.ndim - 2))
    taps = np.asarray(weight, dtype=np.float64).reshape(c_out, per_group, -1).sum(axis=2)
    through = (taps * affine.shift[in_channel]).sum(axis=1)
    return _scaled(weight, factor), _bias_plus(bias, through, weight.dtype)


def forward_conv_transpose(
    weight: np.ndarray, bias: np.ndarray | None, affine: ChannelAffine, group: int
) -> tuple[np.ndarray, np.ndarray | None]:
    """ConvTranspose reading the mapped tensor: W is (C_in, C_out/group, k...), input channels on axis 0."""
    c_in, per_out = weight.shape[0], weight.shape[1]
    if group < 1 or c_in % group:
        raise ValueError(f"group {group} does not divide the {c_in} input channels")
    _expect_channels(c_in, affine)
    factor = affine.scale.reshape((-1,) + (1,) * (weight.ndim - 1))
    taps = np.asarray(weight, dtype=np.float64).reshape(group, c_in // group, per_out, -1).sum(axis=3)
    through = np.einsum("gij,gi->gj", taps, affine.shift.reshape(group, c_in // group)).reshape(-1)
    return _scaled(weight, factor), _bias_plus(bias, through, weight.dtype)


def forward_gemm(
    b_matrix: np.ndarray, c: np.ndarray | None, affine: ChannelAffine, *, trans_b: bool, alpha: float, beta: float
) -> tuple[np.ndarray, np.ndarray | None]:
    """Gemm ``alpha * A B' + beta * C`` whose A (not transposed) is mapped per column.

    Returns (B'', C'') for the same alpha and beta = 1: the rows of B' scaled, C'' = beta * C + alpha * shift B'.
    """
    rows = b_matrix.shape[1] if trans_b else b_matrix.shape[0]
    _expect_channels(rows, affine)
    b64 = np.asarray(b_matrix, dtype=np.float64)
    through = alpha * (affine.shift @ (b64.T if trans_b else b64))
    new_b = _scaled(b_matrix, affine.scale.reshape((1, -1) if trans_b else (-1, 1)))
    if c is None:
        return new_b, _cast_checked(through, b_matrix.dtype) if through.any() else None
    return new_b, _cast_checked(beta * np.asarray(c, dtype=np.float64) + through, b_matrix.dtype)


def forward_matmul(
    weight: np.ndarray, bias: np.ndarray | None, affine: ChannelAffine
) -> tuple[np.ndarray, np.ndarray | None]:
    """MatMul x @ W (W constant (K, N)) whose 2-D x is mapped per column; bias of rank <= 2 or None."""
    _expect_channels(weight.shape[0], affine)
    through = affine.shift @ np.asarray(weight, dtype=np.float64)
    new_w = _scaled(weight, affine.scale.reshape(-1, 1))
    if bias is None:
        return new_w, _cast_checked(through, weight.dtype) if through.any() else None
    return new_w, _cast_checked(np.asarray(bias, dtype=np.float64) + through, weight.dtype)


def _bias_plus(bias: np.ndarray | None, through: np.ndarray, dtype: np.dtype) -> np.ndarray | None:
    if bias is None:
        return _cast_checked(through, dtype) if through.any() else None
    return _cast_checked(np.asarray(bias, dtype=np.float64).reshape(-1) + through, dtype)


def scale_shift_constants(affine: ChannelAffine, rank: int, dtype: np.dtype) -> tuple[np.ndarray, np.ndarray]:
    """Mul and Add constants that apply ``affine`` on axis 1 of a rank-``rank`` tensor: shape (C, 1, ..., 1)."""
    shape = (affine.channels,) + (1,) * max(rank - 2, 0)
    return _cast_checked(affine.scale.reshape(shape), dtype), _cast_checked(affine.shift.reshape(shape), dtype)


def per_activation_constants(
    scale: np.ndarray, bias: np.ndarray, mean: np.ndarray, var: np.ndarray, epsilon: float, dtype: np.dtype
) -> tuple[np.ndarray, np.ndarray]:
    """Mul and Add constants of a legacy ``spatial=0`` BatchNormalization (parameters shaped (C, D1, ..., Dn)).

    They keep the parameters' shape, which broadcasts against (N, C, D1, ..., Dn) from the right.
    """
    shapes = {np.shape(p) for p in (scale, bias, mean, var)}
    if len(shapes) != 1:
        raise InvalidStatisticsError(f"scale, bias, mean and variance shapes differ: {sorted(shapes)}")
    scale64, bias64, mean64, var64 = (np.asarray(p, dtype=np.float64) for p in (scale, bias, mean, var))
    if np.isnan(var64).any() or (var64 < 0).any():
        raise InvalidStatisticsError("variance has negative or NaN entries")
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        factor = scale64 / np.sqrt(var64 + epsilon)
        shift = bias64 - mean64 * factor
    return _cast_checked(factor, dtype), _cast_checked(shift, dtype)


# ----- magnitudes: what a folded layer computes before its bias, bounded from the BN's statistics --------
# A fold moves the BN's shift through the layer's sum: folded forward, the consumer sums x * W * a (x the BN's
# input) and then adds b - W (a * mean), where the original summed a * (x - mean) * W, already centred. When
# |mean| is large against the spread of x, the folded sum is much larger than anything the original computes:
# in float16 it can overflow (the original gives +-5e3, the folded model NaN), and in any precision its
# rounding grows by the same ratio. The BN's statistics bound x: |x| <= |mean| + SIGMAS * sqrt(var + eps).
SIGMAS = 4.0
# Largest accepted growth of the folded layer's magnitudes over the original's, by precision: it multiplies
# the layer's rounding error (float16 / bfloat16: 2 bits; float32: 256 x 6e-8 = 1.5e-5 of the result, a
# tenth of the check's tolerance; float64: 1e6 x 1.1e-16).
GROWTH_LIMITS = {"float16": 4.0, "bfloat16": 4.0, "float32": 256.0, "float64": 1e6}


@dataclass(frozen=True)
class InputSpread:
    """The BN's input per channel: mean and standard deviation (sqrt(var + eps)), from its statistics."""

    mean: np.ndarray
    std: np.ndarray

    def repeated(self, inner: int) -> InputSpread:
        return InputSpread(np.repeat(self.mean, inner), np.repeat(self.std, inner))

    def split(self, sizes: list[int]) -> list[InputSpread]:
        cuts = np.cumsum(sizes)[:-1]
        return [InputSpread(m, s) for m, s in zip(np.split(self.mean, cuts), np.split(self.std, cuts), strict=True)]


def input_spread(mean: np.ndarray, var: np.ndarray, epsilon: float) -> InputSpread:
    mean64 = np.asarray(mean, dtype=np.float64).reshape(-1)
    with np.errstate(invalid="ignore"):
        std = np.sqrt(np.asarray(var, dtype=np.float64).reshape(-1) + epsilon)
    return InputSpread(mean64, std)


def forward_magnitudes(
    weight_abs: np.ndarray, affine: ChannelAffine, spread: InputSpread, new_bias: np.ndarray | None
) -> tuple[float, float]:
    """(folded, original): the largest magnitude a forward-folded consumer computes, and the original's.

    ``weight_abs`` is (input features, outputs): the sum of |W| over every tap joining a feature to an output.
    Folded: sum_i |x_i| |a_i| |W_io| and |b'_o|; original: sum_i |y_i| |W_io| with |y| <= |a| SIGMAS std + |beta|.
    """
    with np.errstate(over="ignore", invalid="ignore"):
        scale = np.abs(affine.scale)
        beta = np.abs(affine.shift + affine.scale * spread.mean)
        x = np.abs(spread.mean) + SIGMAS * spread.std
        y = scale * SIGMAS * spread.std + beta
        folded = float(np.max((x * scale) @ weight_abs, initial=0.0))
        if new_bias is not None and np.size(new_bias):
            folded = max(folded, float(np.max(np.abs(np.asarray(new_bias, dtype=np.float64)))))
        original = float(np.max(y @ weight_abs, initial=0.0))
    return folded, original


def backward_magnitudes(affine: ChannelAffine, spread: InputSpread, old_bias: np.ndarray | None) -> tuple[float, float]:
    """(folded, original) for a backward fold: the producer's sum before its bias, a * (x - b), against the
    larger of x and the BN's output, which the original both computes."""
    centre = np.abs(spread.mean)
    if old_bias is not None and np.size(old_bias):
        bias = np.asarray(old_bias, dtype=np.float64).reshape(-1)
        # a bias broadcasting per channel shifts the centre; any other (a Gemm's per-row C) may add its largest
        centre = np.abs(spread.mean - bias) if bias.size in (1, centre.size) else centre + np.max(np.abs(bias))
    with np.errstate(over="ignore", invalid="ignore"):
        folded = np.abs(affine.scale) * (centre + SIGMAS * spread.std)
        # the original computes the producer's output x and the BN's output a * x + shift
        produced = np.abs(spread.mean) + SIGMAS * spread.std
        normalized = np.abs(affine.scale) * SIGMAS * spread.std + np.abs(affine.shift + affine.scale * spread.mean)
        original = np.maximum(produced, normalized)
    return float(np.max(folded, initial=0.0)), float(np.max(original, initial=0.0))


def backward_rounding(
    affine: ChannelAffine, spread: InputSpread, old_bias: np.ndarray | None
) -> tuple[np.ndarray, np.ndarray]:
    """(folded, original) per channel, at the BN's output: the magnitudes whose rounding each model carries there.

    Folded: the layer's weights scaled by a and its new bias b' = a * b + shift, each rounded once, so its
    error scales with |a| * (the sum before the bias, |mean - b| + SIGMAS std) + |b'|. Original: the layer's
    output (|mean| + SIGMAS std) rounded, times |a|, plus the BN's output rounded (|a| SIGMAS std + |beta|). The
    layer's own weights are rounded the same in both (a times theirs), so they cancel out of the comparison;
    what a fold can add is a producer's bias cancelled by its sum (|b| >> |mean|), moved after the scaling.
    """
    channels = affine.channels
    bias = np.zeros(channels)
    if old_bias is not None and np.size(old_bias):
        values = np.asarray(old_bias, dtype=np.float64).reshape(-1)
        # a bias broadcasting per channel; any other (a Gemm's per-row C) counts its largest for every channel
        bias = values if values.size == channels else np.full(channels, float(np.max(np.abs(values))))
    scale, std = np.abs(affine.scale), SIGMAS * spread.std
    with np.errstate(over="ignore", invalid="ignore"):
        folded = scale * (np.abs(spread.mean - bias) + std) + np.abs(affine.scale * bias + affine.shift)
        beta = np.abs(affine.shift + affine.scale * spread.mean)
        original = scale * (np.abs(spread.mean) + std) + scale * std + beta
    return folded, original


def rounding_problem(folded: np.ndarray, original: np.ndarray, dtype: np.dtype) -> str | None:
    """Why a float16 / bfloat16 fold would round more than GROWTH_LIMITS times what the original rounds at the
    BN's output, in some channel (None when it does not, or for float32 / float64)."""
    name = np.dtype(dtype).name
    info = _finfo(dtype)
    if name not in ("float16", "bfloat16") or info is None:
        return None
    with np.errstate(divide="ignore", invalid="ignore"):
        ratio = np.asarray(folded, dtype=np.float64) / np.maximum(original, float(info.tiny))
    worst = int(np.argmax(np.where(np.isnan(ratio), np.inf, ratio))) if ratio.size else 0
    if not ratio.size or ratio[worst] <= GROWTH_LIMITS[name]:
        return None
    return (
        f"folded, channel {worst}'s rounding at the BN's output grows {ratio[worst]:.3g}x (the layer's bias "
        f"cancels its sum: ~{folded[worst]:.3g} against the original's ~{original[worst]:.3g}, bound from the "
        f"BN's statistics; limit {GROWTH_LIMITS[name]:g}x in {name})"
    )


def conv_weight_abs(weight: np.ndarray, group: int, *, transposed: bool) -> np.ndarray:
    """(input channels, output channels): sum of |W| over the kernel taps joining them (zero across groups)."""
    taps = np.abs(np.asarray(weight, dtype=np.float64)).reshape(weight.shape[0], weight.shape[1], -1).sum(axis=2)
    if transposed:  # ConvTranspose W: (C_in, C_out / group, k...)
        c_in, per_out = taps.shape
        out = np.zeros((c_in, per_out * group))
        rows = np.arange(c_in)
        for j in range(per_out):
            out[rows, (rows // (c_in // group)) * per_out + j] = taps[:, j]
        return out
    c_out, per_in = taps.shape  # Conv W: (C_out, C_in / group, k...)
    out = np.zeros((per_in * group, c_out))
    cols = np.arange(c_out)
    for i in range(per_in):
        out[(cols // (c_out // group)) * per_in + i, cols] = taps[:, i]
    return out


def magnitude_problem(folded: float, original: float, dtype: np.dtype, *, growth: bool) -> str | None:
    """Why the folded layer's magnitudes lose what the original keeps in ``dtype`` (None when they do not):
    past half the dtype's maximum where the original is not, or (``growth``) more than GROWTH_LIMITS larger."""
    name = np.dtype(dtype).name
    info = _finfo(dtype)
    if info is None:
        return None
    largest = float(info.max) / 2
    if not np.isfinite(folded) or (folded > largest and not original > largest):
        return (
            f"folded, the layer's sums reach magnitude ~{folded:.3g} (bound from the BN's statistics), past "
            f"{name}'s maximum {float(info.max):.4g} / 2, where the original's stay at ~{original:.3g}"
        )
    limit = GROWTH_LIMITS.get(name)
    if growth and limit is not None and folded > limit * max(original, float(info.tiny)):
        return (
            f"folded, the layer's sums reach magnitude ~{folded:.3g} against the original's ~{original:.3g} "
            f"(bound from the BN's statistics): {folded / max(original, float(info.tiny)):.3g}x its rounding in "
            f"{name} (limit {limit:g}x)"
        )
    return None


def _finfo(dtype: np.dtype) -> np.finfo | None:
    if np.dtype(dtype).kind == "f":
        return np.finfo(dtype)
    if np.dtype(dtype).name == "bfloat16":  # ml_dtypes' type (onnx depends on it): numpy's finfo refuses it
        import ml_dtypes

        return ml_dtypes.finfo(dtype)
    return None


def _expect_channels(channels: int, affine: ChannelAffine) -> None:
    if channels != affine.channels:
        raise ValueError(f"{affine.channels} per-channel values for {channels} output channels")


def _scaled(weight: np.ndarray, factor: np.ndarray) -> np.ndarray:
    """weight * factor computed in float64 and rounded once, without a float64 copy of the whole weight."""
    out, representable = scaled(weight, factor, _headroom(weight.dtype))
    if not representable:
        raise _overflow(out.dtype)
    return out


def _folded_bias(bias: np.ndarray | None, affine: ChannelAffine, dtype: np.dtype) -> np.ndarray | None:
    """The new bias; None when there was none and the shift is zero (a pure scaling needs no bias)."""
    if bias is None:
        return _cast_checked(affine.shift, dtype) if affine.shift.any() else None
    return _cast_checked(np.asarray(bias, dtype=np.float64).reshape(-1) * affine.scale + affine.shift, dtype)


def rounded(values: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """Folded float64 ``values`` rounded once to the model's ``dtype``; NotRepresentableError where they do not
    fit (overflow, NaN, past the headroom)."""
    return _cast_checked(values, dtype)


def _cast_checked(values: np.ndarray, dtype: np.dtype) -> np.ndarray:
    with np.errstate(over="ignore", invalid="ignore"):
        out = np.asarray(values, dtype=np.float64).astype(dtype)
    _require_finite(out)
    return out


def _require_finite(values: np.ndarray) -> None:
    if not np.isfinite(values).all() or (values.size and np.abs(values).max() > _headroom(values.dtype)):
        raise _overflow(values.dtype)


def _headroom(dtype: np.dtype) -> float:
    """The largest folded value accepted: float32 / float64 keep the square root of their range.

    A fold moves the BN's scaling before the producer's sums: folded weights near float32's maximum make
    those sums overflow where the original's did not (a BN scale of 3e38 did, in fuzzing). No real network
    comes near 1.8e19; float16's range is too small for such a margin, and its overflow is caught as is.
    """
    info = np.finfo(dtype) if np.dtype(dtype).kind == "f" else None
    if info is None or float(info.max) < 1e38:
        return float("inf")
    return float(np.sqrt(float(info.max)))


def _overflow(dtype: np.dtype) -> NotRepresentableError:
    return NotRepresentableError(
        f"folded values overflow {np.dtype(dtype).name} (or are NaN, or pass {_headroom(dtype):.1e}, where sums "
        "over them could overflow)"
    )
