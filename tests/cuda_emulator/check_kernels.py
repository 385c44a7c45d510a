"""Runs bnfuse's cuda.py on the CUDA emulator against the float64 reference, with kernel sources from a
directory (a mutated copy, for tests/cuda_emulator/test_mutations.py). Exit 0 when every case matches, else 1
with the first failure (an emulator error or a wrong value) on stderr.

    PYTHONPATH=tests/cuda_emulator:. python tests/cuda_emulator/check_kernels.py SOURCE_DIR
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

from bnfuse.runtime import cuda
from bnfuse.runtime import reference as ref
from bnfuse.runtime.semantics import BatchNormConfig, Mode, param_shape

# Each reduction kernel family, vector and scalar elementwise paths, several chunks with a ragged last chunk,
# channel counts that are not multiples of 32 and row walks that wrap inside a 4-wide vector.
CASES = [
    ((4, 6, 9, 8), BatchNormConfig()),  # channels-first, vectorized (inner 72)
    ((3, 5, 7, 11), BatchNormConfig()),  # channels-first, scalar (inner 77)
    ((5, 3, 63, 65), BatchNormConfig()),  # two chunks per channel, the last one short
    ((4, 6, 5, 2), BatchNormConfig()),  # columns (inner 10); 4-wide vectors cross rows
    ((37, 40), BatchNormConfig()),  # columns: 40 channels, a partly filled second warp of columns
    ((33, 5, 7), BatchNormConfig(mode=Mode.PER_ACTIVATION)),
    ((300, 7), BatchNormConfig(epsilon=1e-3)),  # channels-first with inner 1
]


def check(dtype: np.dtype) -> None:
    import cupy

    for shape, config in CASES:
        rng = np.random.default_rng(0)
        p = param_shape(config, shape)
        x, dy = (rng.normal(0.5, 2.0, size=shape).astype(dtype) for _ in range(2))
        scale, bias, mean = (rng.normal(size=p).astype(np.float32) for _ in range(3))
        var = rng.uniform(0.5, 3.0, p).astype(np.float32)
        d = [cupy.asarray(a) for a in (x, dy, scale, bias, mean, var)]
        tol = 2e-5 if dtype == np.float32 else 4e-3

        def close(got, want, what, shape=shape, tol=tol):
            got, want = cupy.asnumpy(got).astype(np.float64), np.asarray(want, np.float64)
            scale_ = max(1.0, float(np.max(np.abs(want))))
            if not np.allclose(got, want, rtol=tol, atol=tol * scale_):
                worst = float(np.max(np.abs(got - want)))
                raise AssertionError(f"{what} {shape} {dtype.name}: max error {worst:.3g} vs the reference")

        close(cuda.forward_inference(d[0], *d[2:], config), ref.forward_inference(x, scale, bias, mean, var, config),
              "forward_inference")  # fmt: skip
        got = cuda.forward_training(d[0], *d[2:], config)
        want = ref.forward_training(x, scale, bias, mean, var, config)
        for field, a, b in zip(got._fields, got, want, strict=True):
            close(a, b, f"forward_training {field}")
        saved = [cupy.asarray(want.saved_mean), cupy.asarray(want.saved_inv_std)]
        g = cuda.backward(d[1], d[0], d[2], *saved, config)
        r = ref.backward(dy, x, scale, want.saved_mean, want.saved_inv_std, config)
        for field, a, b in zip(g._fields, g, r, strict=True):
            close(a, b, f"backward {field}")


def main(source_dir: str) -> int:
    directory = Path(source_dir).resolve()
    cuda.SOURCE_DIR = directory
    cuda.NVRTC_OPTIONS = tuple(f"-I{directory}" if o.startswith("-I") else o for o in cuda.NVRTC_OPTIONS)
    try:
        for dtype in (np.float32, np.float16):
            check(np.dtype(dtype))
    except Exception as exc:  # noqa: BLE001 - any failure is the verdict, reported in one line
        print(f"{type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
