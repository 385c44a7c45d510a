"""Optional (extra `keras`): Keras applications through tf2onnx, its optimizers on and off, fold completely.

tf2onnx with its optimizers off wraps every Conv and BN in NHWC <-> NCHW Transposes and writes each kernel
as Reshape + Transpose of a constant; bnfuse cancels the Transpose pairs and folds every BN.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import onnx
import pytest

import bnfuse
from bnfuse.passes.optimize import count_nodes

pytest.importorskip("tensorflow")
pytest.importorskip("tf2onnx")

_spec = importlib.util.spec_from_file_location(
    "bnfuse_keras_convert", Path(__file__).resolve().parents[2] / "bench" / "keras_convert.py"
)
keras_convert = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(keras_convert)


@pytest.mark.parametrize("name", ["MobileNetV2"])
def test_keras_application_folds_every_batchnorm(name: str, tmp_path: Path) -> None:
    import numpy as np

    for path in keras_convert.convert(name, str(tmp_path), np.random.default_rng(0)):
        model = onnx.load(path)
        model.ir_version = min(model.ir_version, 10)
        optimized, report = bnfuse.optimize(model, check=True)
        assert report.check is not None and report.check.passed
        assert report.batchnorms_after == 0, path
        assert count_nodes(optimized.graph, "BatchNormalization") == 0
        if path.endswith("_noopt.onnx"):
            assert report.count("folded") == 52 and report.transposes_cancelled > 0
