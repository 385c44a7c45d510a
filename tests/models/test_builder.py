"""bnfuse.models.builder: channel rounding, weight scales, calibrated BN statistics."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
from onnx import helper, numpy_helper

from bnfuse.models.builder import GraphBuilder, make_divisible, scaled


@pytest.mark.parametrize(
    ("value", "expected"), [(32, 32), (32 * 0.5, 16), (24 * 0.35, 8), (1280 * 1.4, 1792), (3.0, 8), (92, 96)]
)
def test_make_divisible_follows_mobilenet(value: float, expected: int) -> None:
    assert make_divisible(value) == expected


def test_scaled_is_exact_at_width_one() -> None:
    assert scaled(100, 1.0) == 100 and scaled(100, 0.5) == 48 and scaled(64, 0.01) == 8


def two_conv_builder(dtype: str = "float32") -> tuple[GraphBuilder, str]:
    g = GraphBuilder("t", opset=17, dtype=dtype, seed=0)
    x = g.relu(g.batchnorm(g.conv("input", 3, 64, 3), 64))
    return g, g.batchnorm(g.conv(x, 64, 32, 3, stride=2), 32)


def test_conv_weights_are_he_normal() -> None:
    g, _ = two_conv_builder()
    weight = g.arrays["conv1.weight"]
    assert weight.shape == (32, 64, 3, 3)
    assert abs(weight.std() - np.sqrt(2 / (64 * 9))) < 0.03 * np.sqrt(2 / (64 * 9))


def test_calibrated_statistics_normalize_the_calibration_distribution() -> None:
    """On fresh standard-normal inputs each BN's input has (close to) the running mean / variance it stores."""
    g, y = two_conv_builder()
    model = g.model(["batch", 3, 16, 16], y, ["batch", 32, 8, 8], doc="", metadata={})
    inits = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    for name in ("conv0", "conv1"):
        model.graph.output.append(helper.make_empty_tensor_value_info(name))
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    x = np.random.default_rng(7).standard_normal((16, 3, 16, 16)).astype(np.float32)
    _, conv0, conv1 = session.run(None, {"input": x})
    for bn, activations in (("bn0", conv0), ("bn1", conv1)):
        mean, var = inits[f"{bn}.mean"], inits[f"{bn}.var"]
        assert np.abs(mean).max() > 0.05 and np.abs(var - 1).max() > 0.1  # not the trivial statistics
        np.testing.assert_allclose(activations.mean(axis=(0, 2, 3)), mean, atol=0.15 * np.sqrt(var).max())
        np.testing.assert_allclose(activations.var(axis=(0, 2, 3)), var, rtol=0.3)


def test_float16_model_stores_float16_everywhere() -> None:
    g, y = two_conv_builder("float16")
    model = g.model(["batch", 3, 16, 16], y, ["batch", 32, 8, 8], doc="", metadata={})
    assert {t.data_type for t in model.graph.initializer} == {10}
    assert model.graph.input[0].type.tensor_type.elem_type == 10
