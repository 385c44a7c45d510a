"""bnfuse.passes.scale_kernel: the same bits as NumPy's float64 multiply rounded once, on any alignment."""

from __future__ import annotations

import numpy as np
import pytest

from bnfuse.passes.scale_kernel import MIN_KERNEL_BYTES, scaled_along_axis


def _numpy(weight: np.ndarray, factor: np.ndarray) -> np.ndarray:
    out = np.empty(weight.shape, dtype=weight.dtype)
    with np.errstate(over="ignore", invalid="ignore"):
        np.multiply(weight, factor, out=out, dtype=np.float64, casting="unsafe")
    return out


def _unaligned(array: np.ndarray) -> np.ndarray:
    raw = bytearray(array.nbytes + 1)
    raw[1:] = array.tobytes()
    view = np.frombuffer(raw, dtype=array.dtype, offset=1).reshape(array.shape)
    assert not view.flags.aligned
    return view


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize(
    ("shape", "axis"), [((256, 128, 3, 3), 0), ((1024, 512), 1), ((512, 1024), 0), ((4, 96, 32, 32), 1)]
)
@pytest.mark.parametrize("aligned", [True, False])
def test_bits_match_numpy(dtype: type, shape: tuple[int, ...], axis: int, aligned: bool) -> None:
    rng = np.random.default_rng(sum(shape))
    weight = (rng.standard_normal(shape) * 10).astype(dtype)
    factor_shape = [1] * len(shape)
    factor_shape[axis] = -1
    factor = (rng.standard_normal(shape[axis]) * rng.uniform(0.001, 100, shape[axis])).reshape(factor_shape)
    result = scaled_along_axis(weight if aligned else _unaligned(weight), factor)
    assert result is not None
    got, finite = result
    assert finite and got.dtype == dtype
    want = _numpy(weight, factor)
    assert np.array_equal(got.view(f"u{got.itemsize}"), want.view(f"u{want.itemsize}"))


def test_overflow_and_nan_are_reported() -> None:
    weight = np.ones((512, 512), dtype=np.float32)
    factor = np.ones((512, 1))
    factor[7] = 1e39  # beyond float32
    assert scaled_along_axis(weight, factor)[1] is False
    factor[7] = np.nan
    assert scaled_along_axis(weight, factor)[1] is False
    factor[7] = 3.0
    assert scaled_along_axis(weight, factor)[1] is True


@pytest.mark.parametrize(
    ("weight", "factor"),
    [
        (np.ones((16, 16), np.float32), np.ones((16, 1))),  # under MIN_KERNEL_BYTES: not worth numba
        (np.ones((1024, 1024), np.float16), np.ones((1024, 1))),  # float16: NumPy path
        (np.ones((64, 64, 64), np.float32), np.ones((64, 1, 64))),  # scales along two axes
        (np.ones((1024, 1024), np.float32), np.ones((1024, 1), np.float32)),  # factor not float64
    ],
)
def test_not_applicable_returns_none(weight: np.ndarray, factor: np.ndarray) -> None:
    assert scaled_along_axis(weight, factor) is None


def test_threshold_sits_between_the_small_and_large_cases() -> None:
    assert 16 * 16 * 4 < MIN_KERNEL_BYTES <= 1024 * 1024 * 2
