"""Backend selection: by name and by array type."""

from __future__ import annotations

import importlib.util
import inspect

import numpy as np
import pytest

from bnfuse.runtime import cpu, kernels, reference
from bnfuse.runtime.semantics import BatchNormConfig, BatchNormError


def test_backend_by_name():
    assert kernels.backend("reference") is reference
    assert kernels.backend("cpu") is cpu
    with pytest.raises(BatchNormError, match="unknown kernel backend 'tpu'"):
        kernels.backend("tpu")


@pytest.mark.parametrize("name", ["forward_inference", "forward_training", "backward"])
def test_every_backend_has_the_same_api(name):
    """Same parameter names, kinds, defaults and order in reference, cpu and cuda (cuda imports without CuPy)."""
    cuda = kernels.backend("cuda")

    def params(module):
        sig = inspect.signature(inspect.unwrap(getattr(module, name)))
        return [(p.name, p.kind, p.default) for p in sig.parameters.values()]

    want = params(reference)
    assert want[-1] == ("out", inspect.Parameter.KEYWORD_ONLY, None)  # the comparison sees real parameters
    assert "config" in [p[0] for p in want]
    assert params(cpu) == want
    assert params(cuda) == want


def test_for_array():
    assert kernels.for_array(np.zeros((2, 3), np.float32)) is cpu
    with pytest.raises(BatchNormError, match="no kernel backend for arrays of type builtins.list"):
        kernels.for_array([1.0])


def test_cuda_backend_imports_without_cupy():
    """bnfuse.runtime.cuda imports lazily: without CuPy the module loads and fails only when a kernel runs."""
    cuda = kernels.backend("cuda")
    assert cuda.__name__ == "bnfuse.runtime.cuda"
    assert cuda.SOURCE_DIR.is_dir() and all((cuda.SOURCE_DIR / s).is_file() for s in cuda.SOURCES)
    if importlib.util.find_spec("cupy") is None:
        with pytest.raises(BatchNormError, match="need CuPy"):
            cuda.forward_inference(np.zeros((2, 3), np.float32), *[np.ones(3, np.float32)] * 4, BatchNormConfig())
