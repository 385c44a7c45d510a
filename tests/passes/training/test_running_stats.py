"""Running-statistics plan: conventions, PyTorch detection (momentum 1.0 = momentum=None), estimator defaults."""

from __future__ import annotations

import onnx
import pytest

from bnfuse.errors import BnfuseError
from bnfuse.passes.training.running_stats import plan
from bnfuse.runtime.semantics import MomentumConvention


def _model(producer: str) -> onnx.ModelProto:
    model = onnx.ModelProto()
    model.producer_name = producer
    return model


@pytest.mark.parametrize(
    ("producer", "convention", "momentum", "unbiased"),
    [
        ("pytorch", None, None, True),  # a PyTorch export: PyTorch's estimator
        ("tf2onnx", None, None, False),  # others: ONNX's reference (biased)
        ("tf2onnx", "pytorch", 0.1, True),
        ("tf2onnx", "cudnn", 0.1, True),
        ("tf2onnx", "mindspore", 0.1, False),
        ("pytorch", "onnx", None, False),  # an explicit ONNX convention: ONNX's estimator
        ("tf2onnx", "cumulative", None, True),
    ],
)
def test_running_variance_default(producer: str, convention: str | None, momentum: float | None, unbiased: bool):
    assert plan(_model(producer), momentum, convention, None).unbiased is unbiased
    assert plan(_model(producer), momentum, convention, not unbiased).unbiased is (not unbiased)  # given: kept


def test_node_momenta_and_pytorch_momentum_none() -> None:
    pytorch = plan(_model("pytorch"), None, None, None)
    assert pytorch.for_node(0.9) == (0.9, MomentumConvention.ONNX, False)
    assert pytorch.for_node(1.0) == (1.0, MomentumConvention.PYTORCH, True)  # momentum=None: cumulative
    other = plan(_model("tf2onnx"), None, None, None)
    assert other.for_node(1.0) == (1.0, MomentumConvention.ONNX, False)  # ONNX momentum 1: never updates
    explicit = plan(_model("pytorch"), None, "onnx", None)
    assert explicit.for_node(1.0) == (1.0, MomentumConvention.ONNX, False)
    given = plan(_model("pytorch"), 0.3, "pytorch", None)
    assert given.for_node(1.0) == (0.3, MomentumConvention.PYTORCH, False)
    cumulative = plan(_model("tf2onnx"), None, "cumulative", None)
    assert cumulative.for_node(0.9) == (1.0, MomentumConvention.PYTORCH, True)
    assert pytorch.describe(2, 3)[0].endswith("2 of 3 with momentum 1.0 = PyTorch momentum=None: cumulative")


@pytest.mark.parametrize(
    ("momentum", "convention", "message"),
    [
        (1.5, None, r"momentum must be in \[0, 1\]"),
        (0.1, "cumulative", "takes no momentum"),
        (None, "pytorch", "'pytorch' given without a momentum"),
        (None, "keras", "unknown momentum convention"),
    ],
)
def test_bad_settings_are_one_line_errors(momentum: float | None, convention: str | None, message: str) -> None:
    with pytest.raises(BnfuseError, match=message):
        plan(_model("pytorch"), momentum, convention, None)
