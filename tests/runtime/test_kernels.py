"""Backend selection: by name and by array type."""

from __future__ import annotations

import numpy as np
import pytest

from bnfuse.runtime import cpu, kernels, reference
from bnfuse.runtime.semantics import BatchNormError


def test_backend_by_name():
    assert kernels.backend("reference") is reference
    assert kernels.backend("cpu") is cpu
    with pytest.raises(BatchNormError, match="unknown kernel backend 'tpu'"):
        kernels.backend("tpu")


def test_every_backend_has_the_same_api():
    for module in (reference, cpu):
        for name in ("forward_inference", "forward_training", "backward"):
            assert callable(getattr(module, name))


def test_for_array():
    assert kernels.for_array(np.zeros((2, 3), np.float32)) is cpu
    with pytest.raises(BatchNormError, match="no kernel backend for arrays of type builtins.list"):
        kernels.for_array([1.0])


def test_cuda_backend_imports_without_cupy():
    """bnfuse.runtime.cuda imports lazily: without CuPy the module loads and fails only when a kernel runs."""
    cuda = kernels.backend("cuda")
    assert callable(cuda.forward_training)
