"""Re-parameterization arithmetic in float64 against PyTorch's float64 Conv / AveragePool on the branches."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from bnfuse.passes.fold import reparam_math
from bnfuse.passes.fold.reparam_math import Kernel, NotMergeable


def run(kernel: Kernel, x: np.ndarray) -> np.ndarray:
    """The kernel as PyTorch computes a Conv with its (possibly asymmetric) pads, in float64."""
    rank = kernel.rank
    pads = []
    for axis in reversed(range(rank)):  # F.pad lists the last axis first
        pads += [kernel.pads[axis], kernel.pads[rank + axis]]
    padded = F.pad(torch.from_numpy(x), pads)
    conv = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}[rank]
    out = conv(padded, torch.from_numpy(kernel.weight), torch.from_numpy(kernel.bias), stride=kernel.strides,
               dilation=kernel.dilations, groups=kernel.groups)  # fmt: skip
    return out.numpy()


def conv(rng: np.random.Generator, c_out: int, c_in: int, window: tuple[int, ...], **geometry) -> Kernel:
    groups = geometry.get("groups", 1)
    weight = rng.normal(size=(c_out, c_in // groups, *window))
    return reparam_math.conv_kernel(weight, rng.normal(size=c_out), **geometry)


def assert_merge_is_sum(kernels: list[Kernel], x: np.ndarray) -> Kernel:
    merged = reparam_math.merge(kernels)
    expected = sum(run(k, x) for k in kernels)
    np.testing.assert_allclose(run(merged, x), expected, rtol=1e-12, atol=1e-12)
    return merged


@pytest.mark.parametrize("stride", [1, 2])
def test_repvgg_block_is_one_3x3_conv(stride: int) -> None:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(2, 4, 7, 6))
    kxk = conv(rng, 4, 4, (3, 3), strides=(stride, stride), pads=(1, 1, 1, 1))
    one = conv(rng, 4, 4, (1, 1), strides=(stride, stride))
    branches = [kxk, one] + ([reparam_math.then_affine(reparam_math.identity_kernel(4, 2), rng.normal(size=4),
                                                      rng.normal(size=4))] if stride == 1 else [])  # fmt: skip
    merged = assert_merge_is_sum(branches, x)
    assert merged.weight.shape == (4, 4, 3, 3) and merged.groups == 1 and merged.pads == (1, 1, 1, 1)


def test_mobileone_depthwise_block_stays_depthwise() -> None:
    rng = np.random.default_rng(1)
    x = rng.normal(size=(1, 6, 5, 5))
    branches = [conv(rng, 6, 6, (3, 3), groups=6, pads=(1, 1, 1, 1)) for _ in range(4)]
    branches += [conv(rng, 6, 6, (1, 1), groups=6), reparam_math.identity_kernel(6, 2)]
    merged = assert_merge_is_sum(branches, x)
    assert merged.groups == 6 and merged.weight.shape == (6, 1, 3, 3)


def test_mixed_groups_coarsen_to_their_gcd() -> None:
    rng = np.random.default_rng(2)
    x = rng.normal(size=(1, 12, 5, 5))
    branches = [conv(rng, 12, 12, (3, 3), groups=4, pads=(1, 1, 1, 1)), conv(rng, 12, 12, (1, 1), groups=6)]
    merged = assert_merge_is_sum(branches + [reparam_math.identity_kernel(12, 2)], x)
    assert merged.groups == 2


def test_acnet_asymmetric_kernels_and_average_pool() -> None:
    rng = np.random.default_rng(3)
    x = rng.normal(size=(2, 3, 6, 7))
    square = conv(rng, 3, 3, (3, 3), pads=(1, 1, 1, 1))
    row = conv(rng, 3, 3, (1, 3), pads=(0, 1, 0, 1))
    column = conv(rng, 3, 3, (3, 1), pads=(1, 0, 1, 0))
    pool = reparam_math.average_pool_kernel(3, (3, 3), pads=(1, 1, 1, 1), count_include_pad=True)
    assert_merge_is_sum([square, row, column, pool], x)


def test_dilation_of_a_one_tap_axis_does_not_matter_and_5x5_absorbs_3x3() -> None:
    rng = np.random.default_rng(4)
    x = rng.normal(size=(1, 2, 9, 9))
    wide = conv(rng, 2, 2, (3, 3), dilations=(2, 2), pads=(2, 2, 2, 2))
    one = conv(rng, 2, 2, (1, 1), dilations=(1, 1))
    merged = assert_merge_is_sum([wide, one], x)
    assert merged.dilations == (2, 2) and merged.weight.shape[2:] == (3, 3)
    assert_merge_is_sum([conv(rng, 2, 2, (5, 5), pads=(2,) * 4), conv(rng, 2, 2, (3, 3), pads=(1,) * 4)], x)
    shifted = assert_merge_is_sum(
        [conv(rng, 2, 2, (3, 3), pads=(2, 2, 0, 0)), conv(rng, 2, 2, (3, 3), pads=(1,) * 4)], x
    )
    assert shifted.weight.shape[2:] == (4, 4) and shifted.pads == (2, 2, 1, 1)  # same size, windows one apart


def test_1d_and_3d_convs() -> None:
    rng = np.random.default_rng(5)
    assert_merge_is_sum([conv(rng, 3, 3, (3,), pads=(1, 1)), reparam_math.identity_kernel(3, 1)],
                        rng.normal(size=(2, 3, 8)))  # fmt: skip
    assert_merge_is_sum([conv(rng, 2, 2, (3, 3, 3), pads=(1,) * 6), conv(rng, 2, 2, (1, 1, 1))],
                        rng.normal(size=(1, 2, 4, 4, 4)))  # fmt: skip


def test_compose_pointwise_then_window_and_window_then_pointwise() -> None:
    rng = np.random.default_rng(6)
    x = rng.normal(size=(2, 4, 6, 6))
    first = conv(rng, 5, 4, (1, 1))
    second = conv(rng, 3, 5, (3, 3))  # no padding: the 1x1's bias goes through every tap
    composed = reparam_math.compose(first, second)
    np.testing.assert_allclose(run(composed, x), run(second, run(first, x)), rtol=1e-12, atol=1e-12)
    padded = conv(rng, 3, 5, (3, 3), pads=(1,) * 4)
    unbiased = reparam_math.conv_kernel(first.weight, None)
    composed = reparam_math.compose(unbiased, padded)
    np.testing.assert_allclose(run(composed, x), run(padded, run(unbiased, x)), rtol=1e-12, atol=1e-12)
    with pytest.raises(NotMergeable, match="zero padding is not its bias"):
        reparam_math.compose(first, padded)
    window, after = conv(rng, 6, 4, (3, 3), strides=(2, 2), pads=(1,) * 4, groups=2), conv(rng, 4, 6, (1, 1), groups=2)
    composed = reparam_math.compose(window, after)
    assert composed.groups == 2
    np.testing.assert_allclose(run(composed, x), run(after, run(window, x)), rtol=1e-12, atol=1e-12)
    pool = reparam_math.average_pool_kernel(5, (2, 2), strides=(2, 2))
    composed = reparam_math.compose(first, pool)
    np.testing.assert_allclose(run(composed, x), run(pool, run(first, x)), rtol=1e-12, atol=1e-12)


def test_refusals_name_the_reason() -> None:
    rng = np.random.default_rng(7)
    with pytest.raises(NotMergeable, match="strides differ"):
        reparam_math.merge([conv(rng, 2, 2, (3, 3), strides=(2, 2), pads=(1,) * 4), conv(rng, 2, 2, (1, 1))])
    with pytest.raises(NotMergeable, match="padding does not line up"):  # output 4x4 against 6x6
        reparam_math.merge([conv(rng, 2, 2, (3, 3)), conv(rng, 2, 2, (1, 1))])
    with pytest.raises(NotMergeable, match="padding does not line up"):  # one row and column fewer
        reparam_math.merge([conv(rng, 2, 2, (3, 3), pads=(1, 1, 0, 0)), conv(rng, 2, 2, (3, 3), pads=(1,) * 4)])
    with pytest.raises(NotMergeable, match="padding does not line up"):  # dilation 2: taps on odd offsets
        reparam_math.merge([conv(rng, 2, 2, (3, 3), dilations=(2, 2), pads=(2,) * 4),
                            conv(rng, 2, 2, (2, 2), dilations=(2, 2), pads=(1,) * 4)])  # fmt: skip
    with pytest.raises(NotMergeable, match="count_include_pad"):
        reparam_math.average_pool_kernel(2, (3, 3), pads=(1,) * 4)
    with pytest.raises(NotMergeable, match="ceil_mode"):
        reparam_math.average_pool_kernel(2, (3, 3), ceil_mode=True)
    with pytest.raises(NotMergeable, match="channel counts"):
        reparam_math.merge([conv(rng, 2, 2, (1, 1)), conv(rng, 3, 2, (1, 1))])
    with pytest.raises(NotMergeable, match="does not fit float16"):
        reparam_math.rounded(np.array([1e6]), np.dtype(np.float16))


@settings(max_examples=60, deadline=None)
@given(
    st.integers(1, 3), st.sampled_from([1, 2]), st.sampled_from([1, 2]), st.integers(0, 2**31 - 1),
    st.lists(st.sampled_from(["3x3", "1x1", "1x3", "3x1", "5x5", "id", "pool"]), min_size=2, max_size=5),
)  # fmt: skip
def test_random_branch_sums_match_the_branches(per_group, groups, stride, seed, kinds) -> None:  # noqa: ANN001
    rng = np.random.default_rng(seed)
    channels = per_group * groups
    x = rng.normal(size=(1, channels, 7, 8))
    branches = []
    for kind in kinds:
        if kind in ("id", "pool") and stride != 1:
            continue
        if kind == "id":
            branches.append(reparam_math.then_affine(reparam_math.identity_kernel(channels, 2),
                                                     rng.normal(size=channels), rng.normal(size=channels)))  # fmt: skip
        elif kind == "pool":
            branches.append(reparam_math.average_pool_kernel(channels, (3, 3), pads=(1,) * 4, count_include_pad=True))
        else:
            kh, kw = (int(k) for k in kind.split("x"))
            pads = (kh // 2, kw // 2, kh // 2, kw // 2)
            branches.append(conv(rng, channels, channels, (kh, kw), groups=groups, strides=(stride,) * 2, pads=pads))
    if branches:
        assert_merge_is_sum(branches, x)


def test_a_pad_by_the_bias_of_a_1x1_moves_onto_its_input() -> None:
    """DBB's 1 x 1 -> BN -> pad with the BN's bias -> unpadded k x k, against PyTorch computing it as written (the
    pad value in every channel the 1 x 1 -> BN's bias, then the k x k); a Pad(0) before a BN writes the same."""
    rng = np.random.default_rng(12)
    x = rng.normal(size=(2, 4, 6, 5))
    value = 0.375
    one = reparam_math.conv_kernel(rng.normal(size=(6, 4, 1, 1)), np.full(6, value))  # its bias: the pad value
    three = conv(rng, 5, 6, (3, 3), strides=(2, 2))
    pads = (1, 2, 1, 0)  # begins (H, W), then ends: asymmetric, as a Pad may be
    moved = reparam_math.padded(one, pads, value, np.dtype(np.float32))
    assert moved.pads == pads and moved.one_by_one and not moved.pointwise
    torch_pads = [pads[1], pads[3], pads[0], pads[2]]  # F.pad: last axis first
    written = F.pad(torch.from_numpy(run(one, x)), torch_pads, value=value).numpy()
    expected = run(three, written)
    composed = reparam_math.compose(moved, three)
    assert composed.pads == pads and composed.strides == (2, 2) and composed.weight.shape == (5, 4, 3, 3)
    np.testing.assert_allclose(run(composed, x), expected, rtol=1e-12, atol=1e-12)
    # within one float32 ulp of the value (the exporter rounded the BN's bias once): still the same border
    nudged = reparam_math.conv_kernel(one.weight, np.full(6, np.nextafter(np.float32(value), np.float32(1))))
    assert reparam_math.padded(nudged, pads, value, np.dtype(np.float32)).pads == pads
    with pytest.raises(NotMergeable, match="the border is not the branch's value"):
        reparam_math.padded(one, pads, 0.0, np.dtype(np.float32))  # zero padding is not its bias
    with pytest.raises(NotMergeable, match="after a window or a stride"):
        reparam_math.padded(three, pads, 0.0, np.dtype(np.float32))
    with pytest.raises(NotMergeable, match="cropping"):
        reparam_math.padded(one, (1, -1, 1, 1), value, np.dtype(np.float32))
