"""bnfuse.passes.fold.scale_kernel: the pool-parallel multiply gives the bits of one NumPy float64 multiply."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from bnfuse.passes.fold.scale_kernel import MIN_PARALLEL_BYTES, scaled


def _numpy(weight: np.ndarray, factor: np.ndarray) -> np.ndarray:
    out = np.empty(np.broadcast_shapes(weight.shape, factor.shape), dtype=weight.dtype)
    with np.errstate(over="ignore", invalid="ignore"):
        np.multiply(weight, factor, out=out, dtype=np.float64, casting="unsafe")
    return out


def _unaligned(array: np.ndarray) -> np.ndarray:
    """A view at an odd address, like a weight mapped straight from a protobuf file."""
    raw = bytearray(array.nbytes + 1)
    raw[1:] = array.tobytes()
    view = np.frombuffer(raw, dtype=array.dtype, offset=1).reshape(array.shape)
    assert not view.flags.aligned
    return view


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.float16, ml_dtypes.bfloat16])
@pytest.mark.parametrize(
    ("shape", "factor_shape"),
    [
        ((256, 128, 3, 3), (256, 1, 1, 1)),  # Conv: output channels on axis 0
        ((1024, 512), (1, 512)),  # Gemm / MatMul columns
        ((512, 1024), (512, 1)),  # Gemm transB rows
        ((4, 96, 32, 32), (4, 1, 32, 1)),  # grouped ConvTranspose: two scaled axes
        ((3, 5), (3, 1)),  # small: the calling thread alone
    ],
)
@pytest.mark.parametrize("aligned", [True, False])
def test_bits_match_one_numpy_multiply(dtype: type, shape: tuple, factor_shape: tuple, aligned: bool) -> None:
    rng = np.random.default_rng(sum(shape))
    weight = (rng.standard_normal(shape) * 10).astype(dtype)
    factor = rng.standard_normal(factor_shape) * rng.uniform(0.01, 10, factor_shape)
    got, finite = scaled(weight if aligned else _unaligned(weight), factor)
    want = _numpy(weight, factor)
    assert finite and got.dtype == np.dtype(dtype) and got.shape == want.shape
    width = f"u{got.dtype.itemsize}"
    assert np.array_equal(got.view(width), want.view(width))


@pytest.mark.parametrize("bad_row", [0, 300, 511])  # in the first piece, a middle one, the last
def test_non_finite_results_in_any_piece_are_reported(bad_row: int) -> None:
    weight = np.ones((512, 1024), dtype=np.float32)
    assert weight.nbytes >= MIN_PARALLEL_BYTES
    factor = np.ones((512, 1))
    factor[bad_row] = 1e39  # beyond float32
    assert scaled(weight, factor)[1] is False
    factor[bad_row] = np.nan
    assert scaled(weight, factor)[1] is False
    factor[bad_row] = 3.0
    out, finite = scaled(weight, factor)
    assert finite and out[bad_row, 0] == 3.0 and out[bad_row - 1, 0] == 1.0
