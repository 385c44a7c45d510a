"""The math of the moved folds (bnfuse.passes.fold.moves_math) against direct float64 NumPy references."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from bnfuse.passes.fold import moves_math
from bnfuse.passes.fold.fold_math import ChannelAffine, NotRepresentableError


def conv_nd(x: np.ndarray, w: np.ndarray, group: int, pads: list[int], strides: list[int], dilations: list[int]):
    """A direct float64 convolution of one sample x (C, *spatial) with zero padding: the reference."""
    rank = x.ndim - 1
    padded = np.pad(x, [(0, 0)] + [(pads[a], pads[a + rank]) for a in range(rank)])
    c_out, per_group = w.shape[:2]
    kernel = w.shape[2:]
    outs = [
        moves_math.conv_output_size(x.shape[a + 1], kernel[a], strides[a], dilations[a], pads[a], pads[a + rank])
        for a in range(rank)
    ]
    y = np.zeros([c_out, *outs])
    for o in range(c_out):
        first = (o // (c_out // group)) * per_group
        for pos in itertools.product(*(range(n) for n in outs)):
            total = 0.0
            for taps in itertools.product(*(range(k) for k in kernel)):
                at = tuple(pos[a] * strides[a] + taps[a] * dilations[a] for a in range(rank))
                total += float(np.dot(w[(o, slice(None), *taps)], padded[(slice(first, first + per_group), *at)]))
            y[(o, *pos)] = total
    return y


@pytest.mark.parametrize(
    ("rank", "group", "pads", "strides", "dilations"),
    [
        (2, 1, [1, 1, 1, 1], [1, 1], [1, 1]),
        (2, 2, [0, 2, 1, 0], [2, 1], [1, 2]),
        (1, 3, [2, 1], [3], [1]),
        (3, 1, [1, 0, 1, 1, 1, 0], [1, 2, 1], [1, 1, 2]),
    ],
)
def test_padded_conv_correction_is_what_the_border_misses(rank, group, pads, strides, dilations) -> None:  # noqa: ANN001
    rng = np.random.default_rng(rank + group)
    c_in, c_out, spatial = 6, 6, [5, 6, 4][:rank]
    w = rng.normal(size=(c_out, c_in // group, *([3] * rank)))
    shift = rng.normal(size=c_in)
    correction = moves_math.padded_conv_correction(w, shift, group, spatial, pads, strides, dilations)
    constant = np.broadcast_to(shift.reshape((-1,) + (1,) * rank), (c_in, *spatial))
    per_channel = w.reshape(c_out, c_in // group, -1).sum(axis=2)
    in_channel = (np.arange(c_out)[:, None] // (c_out // group)) * (c_in // group) + np.arange(c_in // group)
    full = (per_channel * shift[in_channel]).sum(axis=1).reshape((-1,) + (1,) * rank)
    want = conv_nd(constant, w, group, pads, strides, dilations) - full
    np.testing.assert_allclose(correction, want, rtol=0, atol=1e-12)
    assert np.any(correction != 0)


def test_same_pads_match_onnx_auto_pad() -> None:
    # SAME_UPPER puts the odd pixel at the end, SAME_LOWER at the beginning; output = ceil(size / stride)
    assert moves_math.same_pads(6, 3, 1, 1, True) == (1, 1)
    assert moves_math.same_pads(6, 4, 1, 1, True) == (1, 2)
    assert moves_math.same_pads(6, 4, 1, 1, False) == (2, 1)
    assert moves_math.same_pads(7, 3, 2, 1, True) == (1, 1)
    assert moves_math.conv_output_size(7, 3, 2, 1, 1, 1) == 4


def test_split_through_activation_divides_the_shift_by_a_positive_scale() -> None:
    affine = ChannelAffine(np.array([2.0, 0.5]), np.array([1.0, -3.0]))
    scale, inner = moves_math.split_through_activation(affine)
    np.testing.assert_array_equal(scale, [2.0, 0.5])
    np.testing.assert_array_equal(inner, [0.5, -6.0])
    x = np.linspace(-10, 10, 41)[:, None]
    np.testing.assert_allclose(np.maximum(x * scale + affine.shift, 0), scale * np.maximum(x + inner, 0))


@pytest.mark.parametrize("bad", [0.0, -1.0, np.nan])
def test_split_through_activation_refuses_a_non_positive_scale(bad: float) -> None:
    with pytest.raises(ValueError, match="channel 1 has scale"):
        moves_math.split_through_activation(ChannelAffine(np.array([1.0, bad]), np.zeros(2)))


def test_split_through_activation_refuses_a_shift_past_float64() -> None:
    with pytest.raises(NotRepresentableError):
        moves_math.split_through_activation(ChannelAffine(np.array([1e-300]), np.array([1e300])))


def test_dequantized_scale_multiplies_per_channel_and_refuses_a_negative_factor() -> None:
    np.testing.assert_array_equal(moves_math.dequantized_scale(np.array([0.5, 0.25]), np.array([2.0, 4.0]), 2), 1)
    with pytest.raises(ValueError, match="must stay positive"):
        moves_math.dequantized_scale(np.array([0.5, 0.25]), np.array([2.0, -4.0]), 2)
    with pytest.raises(ValueError, match="1 quantization scales for 2"):
        moves_math.dequantized_scale(np.array([0.5]), np.array([2.0, 4.0]), 2)


def test_requantized_bias_exact_when_the_shift_is_whole_steps() -> None:
    q, s = np.array([10, -4], dtype=np.int32), np.array([0.5, 0.25])
    affine = ChannelAffine(np.array([2.0, 4.0]), np.array([3.0, -2.0]))  # steps: 3 / 1 = 3, -2 / 1 = -2
    integers, scale = moves_math.requantized_bias(q, s, affine)
    np.testing.assert_array_equal(integers, [13, -6])
    np.testing.assert_array_equal(scale, [1.0, 1.0])
    np.testing.assert_allclose(integers * scale, affine.scale * q * s + affine.shift)


def test_requantized_bias_refuses_a_fraction_of_a_step() -> None:
    affine = ChannelAffine(np.array([2.0]), np.array([0.3]))
    with pytest.raises(ValueError, match="not a whole number"):
        moves_math.requantized_bias(np.array([10], dtype=np.int32), np.array([0.5]), affine)
