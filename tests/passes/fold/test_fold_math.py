"""Fold arithmetic in float64 against direct evaluation of the unfolded computation."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from bnfuse.passes.fold import fold_math
from bnfuse.passes.fold.fold_math import ChannelAffine, InvalidStatisticsError, NotRepresentableError


def random_affine(rng: np.random.Generator, channels: int) -> ChannelAffine:
    return ChannelAffine(rng.uniform(-2, 2, channels), rng.normal(0, 1, channels))


def test_batchnorm_affine_matches_the_inference_formula() -> None:
    rng = np.random.default_rng(0)
    scale, bias, mean = rng.normal(size=(3, 5))
    var = rng.uniform(0.1, 2, 5)
    x = rng.normal(size=(4, 5))
    affine = fold_math.batchnorm_affine(scale, bias, mean, var, 1e-3)
    expected = (x - mean) / np.sqrt(var + 1e-3) * scale + bias
    np.testing.assert_allclose(x * affine.scale + affine.shift, expected, rtol=1e-13, atol=1e-13)


@pytest.mark.parametrize("bad", [-0.5, np.nan])
def test_negative_or_nan_variance_is_rejected(bad: float) -> None:
    var = np.array([1.0, bad, 1.0])
    with pytest.raises(InvalidStatisticsError, match="negative or NaN"):
        fold_math.batchnorm_affine(np.ones(3), np.zeros(3), np.zeros(3), var, 1e-5)


def test_mismatched_parameter_lengths_are_rejected() -> None:
    with pytest.raises(InvalidStatisticsError, match="lengths differ"):
        fold_math.batchnorm_affine(np.ones(3), np.zeros(2), np.zeros(3), np.ones(3), 1e-5)


@pytest.mark.parametrize(
    ("op", "constant_first", "expected"),
    [
        ("Mul", False, lambda x, c: x * c),
        ("Add", True, lambda x, c: c + x),
        ("Sub", False, lambda x, c: x - c),
        ("Sub", True, lambda x, c: c - x),
        ("Div", False, lambda x, c: x / c),
    ],
)
def test_constant_affine_reproduces_the_operator(op: str, constant_first: bool, expected) -> None:
    rng = np.random.default_rng(1)
    c = rng.uniform(0.5, 2, 4)
    x = rng.normal(size=(3, 4))
    affine = fold_math.constant_affine(op, c, 4, constant_first=constant_first)
    np.testing.assert_allclose(x * affine.scale + affine.shift, expected(x, c), rtol=1e-14)


def test_constant_divided_by_x_and_division_by_zero_are_refused() -> None:
    with pytest.raises(ValueError, match="not affine"):
        fold_math.constant_affine("Div", np.ones(2), 2, constant_first=True)
    with pytest.raises(ValueError, match="division by zero"):
        fold_math.constant_affine("Div", np.array([1.0, 0.0]), 2, constant_first=False)


@pytest.mark.parametrize("rank", [1, 2, 3])
@pytest.mark.parametrize("groups", [1, 2, 4])
def test_fold_conv_matches_conv_then_affine(rank: int, groups: int) -> None:
    rng = np.random.default_rng(2)
    weight = rng.normal(size=(8, 4 // groups, *([3] * rank)))
    bias = rng.normal(size=8)
    x = torch.from_numpy(rng.normal(size=(2, 4, *([6] * rank))))
    affine = random_affine(rng, 8)
    conv = [torch.nn.functional.conv1d, torch.nn.functional.conv2d, torch.nn.functional.conv3d][rank - 1]
    reference = conv(x, torch.from_numpy(weight), torch.from_numpy(bias), groups=groups).numpy()
    reference = reference * affine.scale.reshape(-1, *([1] * rank)) + affine.shift.reshape(-1, *([1] * rank))
    new_w, new_b = fold_math.fold_conv(weight, bias, affine)
    folded = conv(x, torch.from_numpy(new_w), torch.from_numpy(new_b), groups=groups).numpy()
    np.testing.assert_allclose(folded, reference, rtol=1e-12, atol=1e-12)


@settings(max_examples=25, deadline=None)
@given(
    groups=st.sampled_from([1, 2, 3]),
    in_per_group=st.integers(1, 3),
    out_per_group=st.integers(1, 3),
    rank=st.integers(1, 3),
    with_bias=st.booleans(),
)
def test_fold_conv_transpose_scales_output_channel_g_times_cout_over_g_plus_j(
    groups: int, in_per_group: int, out_per_group: int, rank: int, with_bias: bool
) -> None:
    """ConvTranspose W is (C_in, C_out/g, k...); output channel o = g * (C_out/g) + j."""
    rng = np.random.default_rng(groups * 100 + in_per_group * 10 + out_per_group)
    c_in, c_out = in_per_group * groups, out_per_group * groups
    weight = rng.normal(size=(c_in, out_per_group, *([2] * rank)))
    bias = rng.normal(size=c_out) if with_bias else None
    affine = random_affine(rng, c_out)
    new_w, new_b = fold_math.fold_conv_transpose(weight, bias, affine, groups)
    expected = weight.copy()
    for g in range(groups):
        for i in range(in_per_group):
            for j in range(out_per_group):
                expected[g * in_per_group + i, j] *= affine.scale[g * out_per_group + j]
    np.testing.assert_allclose(new_w, expected, rtol=1e-15)
    np.testing.assert_allclose(new_b, (bias if with_bias else 0) * affine.scale + affine.shift, rtol=1e-15)


def test_fold_conv_transpose_matches_torch_with_groups() -> None:
    rng = np.random.default_rng(3)
    weight = rng.normal(size=(6, 2, 3, 3))  # 3 groups, 2 outputs per group
    x = torch.from_numpy(rng.normal(size=(1, 6, 4, 4)))
    affine = random_affine(rng, 6)
    reference = torch.nn.functional.conv_transpose2d(x, torch.from_numpy(weight), groups=3).numpy()
    reference = reference * affine.scale.reshape(-1, 1, 1) + affine.shift.reshape(-1, 1, 1)
    new_w, new_b = fold_math.fold_conv_transpose(weight, None, affine, 3)
    folded = torch.nn.functional.conv_transpose2d(x, torch.from_numpy(new_w), torch.from_numpy(new_b), groups=3)
    np.testing.assert_allclose(folded.numpy(), reference, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("trans_b", [False, True])
@pytest.mark.parametrize("c_shape", [None, (), (5,), (1, 5), (3, 5), (3, 1)])
@pytest.mark.parametrize("beta", [1.0, -0.5, 0.0])
def test_fold_gemm_matches_gemm_then_affine(trans_b: bool, c_shape: tuple | None, beta: float) -> None:
    rng = np.random.default_rng(4)
    a = rng.normal(size=(3, 4))
    b = rng.normal(size=(5, 4) if trans_b else (4, 5))
    c = None if c_shape is None else rng.normal(size=c_shape)
    alpha = 0.7
    affine = random_affine(rng, 5)
    bm = b.T if trans_b else b
    reference = (alpha * a @ bm + (0 if c is None else beta * c)) * affine.scale + affine.shift
    new_b, new_c = fold_math.fold_gemm(b, c, affine, trans_b=trans_b, beta=beta)
    folded = alpha * a @ (new_b.T if trans_b else new_b) + new_c  # beta becomes 1
    np.testing.assert_allclose(folded, reference, rtol=1e-12, atol=1e-12)


def test_fold_matmul_with_and_without_bias() -> None:
    rng = np.random.default_rng(5)
    x, w, bias = rng.normal(size=(3, 4)), rng.normal(size=(4, 6)), rng.normal(size=(1, 6))
    affine = random_affine(rng, 6)
    new_w, new_bias = fold_math.fold_matmul(w, bias, affine)
    np.testing.assert_allclose(x @ new_w + new_bias, (x @ w + bias) * affine.scale + affine.shift, rtol=1e-12)
    new_w, new_bias = fold_math.fold_matmul(w, None, affine)
    np.testing.assert_allclose(x @ new_w + new_bias, (x @ w) * affine.scale + affine.shift, rtol=1e-12)


def test_pure_scaling_of_a_biasless_producer_adds_no_bias() -> None:
    affine = ChannelAffine(np.array([2.0, 3.0]), np.zeros(2))
    _, bias = fold_math.fold_conv(np.ones((2, 1, 1, 1), np.float32), None, affine)
    assert bias is None


@pytest.mark.parametrize("dtype", [np.float16, np.float32, ml_dtypes.bfloat16])
def test_results_are_computed_in_float64_and_rounded_once(dtype: type) -> None:
    weight = np.array([[[[1.0]]], [[[3.0]]]], dtype=dtype)
    affine = ChannelAffine(np.array([1 / 3, 1 / 7]), np.array([0.1, 0.2]))
    new_w, new_b = fold_math.fold_conv(weight, None, affine)
    assert new_w.dtype == np.dtype(dtype) and new_b.dtype == np.dtype(dtype)
    expected = (weight.astype(np.float64).reshape(-1) * affine.scale).astype(dtype)
    np.testing.assert_array_equal(new_w.reshape(-1), expected)


def test_float16_overflow_raises_not_representable() -> None:
    weight = np.full((2, 1, 1, 1), 30000, dtype=np.float16)
    affine = ChannelAffine(np.array([1.0, 4.0]), np.zeros(2))
    with pytest.raises(NotRepresentableError, match="overflow float16"):
        fold_math.fold_conv(weight, None, affine)


@pytest.mark.parametrize("fold", ["conv", "gemm"])
def test_large_float32_overflow_raises_not_representable(fold: str) -> None:
    # large enough to be scaled in pieces on the thread pool (bnfuse.passes.fold.scale_kernel)
    weight = np.ones((512, 512, 3, 3) if fold == "conv" else (512, 1024), dtype=np.float32)
    scale = np.ones(512 if fold == "conv" else 1024)
    scale[5] = 1e39
    affine = ChannelAffine(scale, np.zeros_like(scale))
    with pytest.raises(NotRepresentableError, match="overflow float32"):
        if fold == "conv":
            fold_math.fold_conv(weight, None, affine)
        else:
            fold_math.fold_gemm(weight, None, affine, trans_b=False, beta=1.0)


def test_scale_shift_constants_broadcast_on_axis_1() -> None:
    affine = ChannelAffine(np.array([1.0, 2.0, 3.0]), np.array([0.0, 1.0, 2.0]))
    mul, add = fold_math.scale_shift_constants(affine, 4, np.dtype(np.float32))
    assert mul.shape == add.shape == (3, 1, 1) and mul.dtype == np.float32
    mul2, _ = fold_math.scale_shift_constants(affine, 2, np.dtype(np.float32))
    assert mul2.shape == (3,)


def test_float32_folds_keep_headroom_below_the_range() -> None:
    """A BN scale of 3e38 fits float32 once folded, but sums over such weights overflow where the original's
    do not (found by fuzzing): folded values past sqrt(float32 max) are refused."""
    weight = np.full((2, 3), 0.5, dtype=np.float32)
    affine = fold_math.batchnorm_affine(
        np.array([3e38, 1.0], np.float32), np.zeros(2, np.float32), np.zeros(2), np.ones(2), 0.0
    )
    with pytest.raises(NotRepresentableError, match="pass 1.8e\\+19"):
        fold_math.fold_conv(weight, None, affine)
    affine = fold_math.batchnorm_affine(np.array([1e18, 1.0], np.float32), np.zeros(2), np.zeros(2), np.ones(2), 0.0)
    folded, _ = fold_math.fold_conv(weight, None, affine)
    assert folded[0, 0] == np.float32(5e17)


# ----- magnitudes of the folded layer --------------------------------------------------------------------


def test_conv_weight_abs_sums_taps_per_input_output_pair_and_respects_groups() -> None:
    weight = np.arange(2 * 1 * 2 * 2, dtype=np.float64).reshape(2, 1, 2, 2) - 3  # Conv, 2 groups of 1 -> 1
    joined = fold_math.conv_weight_abs(weight, 2, transposed=False)
    np.testing.assert_array_equal(joined, [[3 + 2 + 1 + 0, 0], [0, 1 + 2 + 3 + 4]])
    deconv = np.ones((2, 3, 1, 1))  # ConvTranspose: 2 inputs, 2 groups of 3 outputs
    np.testing.assert_array_equal(
        fold_math.conv_weight_abs(deconv, 2, transposed=True), [[1, 1, 1, 0, 0, 0], [0, 0, 0, 1, 1, 1]]
    )
    # A dense Conv: the same as summing |W| over the taps, transposed to (inputs, outputs).
    dense = np.random.default_rng(0).normal(size=(4, 3, 3, 3))
    np.testing.assert_allclose(fold_math.conv_weight_abs(dense, 1, transposed=False), np.abs(dense).sum(axis=(2, 3)).T)


def test_forward_magnitudes_grow_with_the_mean_the_fold_moves_through_the_sum() -> None:
    weight_abs = np.ones((4, 2))
    affine = fold_math.batchnorm_affine(np.ones(4), np.zeros(4), np.full(4, 40000.0), np.full(4, 200.0**2), 0.0)
    spread = fold_math.input_spread(np.full(4, 40000.0), np.full(4, 200.0**2), 0.0)
    folded, original = fold_math.forward_magnitudes(weight_abs, affine, spread, None)
    # x <= 40000 + 4 * 200 per feature, scaled by 1/200, summed over 4: 816; the original sums |y| <= 4.
    assert folded == pytest.approx(4 * (40800 / 200)) and original == pytest.approx(16.0)
    problem = fold_math.magnitude_problem(folded, original, np.dtype(np.float16), growth=True)
    assert problem is not None and "float16" in problem and "51x" in problem
    assert fold_math.magnitude_problem(folded, original, np.dtype(np.float64), growth=True) is None
    centred = fold_math.input_spread(np.zeros(4), np.full(4, 200.0**2), 0.0)
    assert (
        fold_math.magnitude_problem(
            *fold_math.forward_magnitudes(weight_abs, affine, centred, None), np.dtype(np.float16), growth=True
        )
        is None
    )


def test_magnitudes_past_half_the_maximum_are_refused_where_the_original_stays_below() -> None:
    half = np.dtype(np.float16)
    problem = fold_math.magnitude_problem(40000.0, 1000.0, half, growth=False)
    assert problem is not None and "65504" in problem.replace(",", "").replace("6.55e+04", "65504")
    assert fold_math.magnitude_problem(40000.0, 40000.0, half, growth=False) is None  # the original is as large
    assert fold_math.magnitude_problem(4000.0, 10.0, half, growth=False) is None  # growth not asked
    # BN centring x ~ 400 +- 1 and scaling it by 100: the original computes x (404) and the BN's output (400)
    affine = fold_math.ChannelAffine(np.array([100.0]), np.array([-40000.0]))
    spread = fold_math.input_spread(np.array([400.0]), np.array([1.0]), 0.0)
    folded, original = fold_math.backward_magnitudes(affine, spread, np.array([0.0]))
    assert folded == pytest.approx(100 * 404) and original == pytest.approx(404)
    assert fold_math.magnitude_problem(folded, original, half, growth=False) is not None
    folded, _ = fold_math.backward_magnitudes(affine, spread, np.array([400.0]))  # the bias centres it
    assert folded == pytest.approx(400.0)
    # A BN whose output is itself that large (an amplifier): the folded sum loses nothing the original keeps
    amplifier = fold_math.ChannelAffine(np.array([100.0]), np.array([0.0]))
    magnitudes = fold_math.backward_magnitudes(amplifier, spread, None)
    assert fold_math.magnitude_problem(*magnitudes, half, growth=False) is None


def test_backward_rounding_refuses_a_bias_that_cancels_the_sum_in_float16_only() -> None:
    """The layer's output z = W x + b ~ 0.5 +- 0.4 with b = 200: W x ~ -200 cancels the bias. Folded, the layer
    rounds a * W x and a * b (~500) instead of z: 2^-11 * 500 against the original's 2^-11 * (a |z| + |y|)."""
    affine = fold_math.batchnorm_affine(np.array([1.0, 1.0]), np.array([0.0, 0.0]), np.array([0.5, 0.5]),
                                        np.array([0.16, 0.16]), 0.0)  # fmt: skip
    spread = fold_math.input_spread(np.array([0.5, 0.5]), np.array([0.16, 0.16]), 0.0)
    folded, original = fold_math.backward_rounding(affine, spread, np.array([0.0, 200.0]))
    assert folded.shape == original.shape == (2,)
    # channel 0 (no bias): within 2x the original's, always; channel 1: |a| (|0.5 - 200| + 1.6) + |a 200 + shift|
    assert folded[0] <= 2 * original[0]
    assert folded[1] == pytest.approx(2.5 * (199.5 + 1.6) + abs(2.5 * 200 - 2.5 * 0.5))
    problem = fold_math.rounding_problem(folded, original, np.dtype(np.float16))
    assert problem is not None and "channel 1" in problem and "float16" in problem and "cancels" in problem
    assert fold_math.rounding_problem(folded, original, np.dtype(ml_dtypes.bfloat16)) is not None
    for wide in (np.float32, np.float64):
        assert fold_math.rounding_problem(folded, original, np.dtype(wide)) is None
    # A bias the sum does not cancel (the BN's mean is near it) folds.
    centred = fold_math.input_spread(np.array([200.0, 200.0]), np.array([0.16, 0.16]), 0.0)
    shifted = fold_math.batchnorm_affine(np.ones(2), np.zeros(2), np.full(2, 200.0), np.full(2, 0.16), 0.0)
    assert fold_math.rounding_problem(*fold_math.backward_rounding(shifted, centred, np.full(2, 200.0)),
                                      np.dtype(np.float16)) is None  # fmt: skip


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 2**32 - 1))
def test_backward_rounding_of_a_biasless_layer_is_never_more_than_twice_the_originals(seed: int) -> None:
    rng = np.random.default_rng(seed)
    c = 5
    mean, var = rng.normal(0, 10.0 ** rng.uniform(-3, 4), c), 10.0 ** rng.uniform(-6, 6, c)
    affine = fold_math.batchnorm_affine(rng.normal(0, 10, c), rng.normal(0, 100, c), mean, var, 1e-5)
    folded, original = fold_math.backward_rounding(affine, fold_math.input_spread(mean, var, 1e-5), None)
    assert np.all(folded <= 2 * original * (1 + 1e-12))


def test_slice_and_split_channel_blocks_and_the_concat_inputs_they_cover() -> None:
    """What a Slice / Split keeps along the channels (checked against NumPy slicing), and which Concat inputs
    that block is made of."""
    x = np.arange(2 * 9 * 2).reshape(2, 9, 2)
    end = 2**63 - 1
    for starts, ends, axes in (([0], [4], [1]), ([-5], [end], [1]), ([0, 2], [end, -1], None), ([3], [100], [-2])):
        begin, stop = fold_math.slice_channels(starts, ends, axes, None, 3, 9)
        index = [slice(None)] * 3
        for s, e, a in zip(starts, ends, axes or range(len(starts)), strict=True):
            index[a] = slice(s, e)
        np.testing.assert_array_equal(x[tuple(index)], x[:, begin:stop])
    for bad, match in ((([0], [4], [1], [2]), "step"), (([0, 1], [4, 2], [1, 2], None), "cuts axis 2"),
                       (([4], [4], [1], None), "no channel")):  # fmt: skip
        with pytest.raises(ValueError, match=match):
            fold_math.slice_channels(*bad, 3, 9)
    assert fold_math.split_channels_ranges([4, 2, 3], 3, 9) == [(0, 4), (4, 6), (6, 9)]
    assert fold_math.split_channels_ranges(None, 3, 9) == [(0, 3), (3, 6), (6, 9)]
    with pytest.raises(ValueError, match="equal parts"):
        fold_math.split_channels_ranges(None, 2, 9)
    assert fold_math.concat_inputs_covering([4, 2, 3], 4, 9) == (1, 3)
    with pytest.raises(ValueError, match="cut a Concat input"):
        fold_math.concat_inputs_covering([4, 2, 3], 0, 5)
