"""Optional (extra `keras`): Keras applications converted by tf2onnx, tf2onnx's optimizers on and off.

Each model has random weights and random BN statistics (bench/keras_apps.py). bnfuse must prove its rewrite
in onnxruntime (check=True) and leave no more BatchNormalization, and no more per-channel Mul or Add (Keras 3's BN),
than onnxruntime's EXTENDED optimizer leaves. Skipped when tensorflow / tf-keras / tf2onnx are not installed.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from tests.loaders import bench_module
from tests.passes.test_light_models import compare_on_two_inputs, two_inputs, with_batchnorm_probes, with_logit_probes

pytest.importorskip("tensorflow")
pytest.importorskip("tf_keras")
pytest.importorskip("tf2onnx")

import bnfuse  # noqa: E402

keras_apps = bench_module("keras_apps", "keras_apps")  # bench/bn_left.py imports it by this name
bn_left = bench_module("bn_left", "bn_left")

# A few applications, each a different pattern: MobileNetV2 (depthwise Conv, ReLU6), ResNet50 (Conv -> BN on
# residual branches), NASNetMobile (BN after Concat, separable convs).
APPS = ("MobileNetV2", "ResNet50", "NASNetMobile")
CASES = [
    pytest.param(app, version, optimizers, id=f"{version}-{app}-{'opt' if optimizers else 'noopt'}")
    for app in APPS
    for version in keras_apps.KERAS_VERSIONS
    for optimizers in (True, False)
]


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Conversions take seconds each: BNFUSE_KERAS_ONNX names a folder to keep them in between runs."""
    kept = os.environ.get("BNFUSE_KERAS_ONNX")
    return Path(kept) if kept else tmp_path_factory.mktemp("keras_onnx")


def run_all(model: onnx.ModelProto, x: np.ndarray) -> list[np.ndarray]:
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    options.log_severity_level = 3
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    return session.run(None, {session.get_inputs()[0].name: x})


@pytest.mark.parametrize(("app", "version", "optimizers"), CASES)
def test_keras_application_folds_at_least_as_much_as_onnxruntime(
    app: str, version: str, optimizers: bool, cache: Path
) -> None:
    model = keras_apps.onnx_model(app, version, optimizers, cache=cache)
    batchnorms_in, muls_in, adds_in = bn_left.left(model)
    if version == "keras2" and not optimizers:
        assert batchnorms_in > 0  # tf2onnx keeps every Keras 2 BN when its optimizers are off
    if version == "keras3":
        # Keras 3 BN is x * scale + shift; grappler folds the scale into a plain Conv2D (not a depthwise one), and
        # tf2onnx's optimizers may fold the shift into the Conv's bias (ResNet50: nothing left to fold).
        assert batchnorms_in == 0
        if not optimizers:
            assert muls_in + adds_in > 0

    optimized, report = bnfuse.optimize(model, check=True)
    assert report.check is not None and report.check.passed
    assert report.batchnorms_before == batchnorms_in
    onnx.checker.check_model(optimized)

    # The outputs on two inputs of our own, and every BN output and Softmax logit exposed as graph outputs (folding
    # keeps their names): a tensor proves the rewrite only where the two inputs give different values (MobileNetV2's
    # final outputs are the same on every input, which `np.ptp(want) > 0` did not see).
    size = keras_apps.input_size(app)
    probed, _ = with_batchnorm_probes(model)
    probed, _ = with_logit_probes(probed)
    probed_optimized, _ = bnfuse.optimize(probed)

    def check(got: np.ndarray, want: np.ndarray) -> None:
        np.testing.assert_allclose(got, want, rtol=1e-3, atol=1e-4 * np.abs(want).max())

    inputs = two_inputs((1, size, size, 3), 3)
    varies = compare_on_two_inputs(probed, probed_optimized, inputs, run_all, check)
    assert any(varies), "no compared tensor depends on the input"

    batchnorms_left, muls_left, adds_left = bn_left.left(optimized)
    ort = bn_left.left(bn_left.onnxruntime_extended(model))
    assert batchnorms_left == report.batchnorms_after
    assert batchnorms_left <= ort[0], f"bnfuse left {batchnorms_left} BN, onnxruntime {ort[0]}"
    assert muls_left <= ort[1], f"bnfuse left {muls_left} per-channel Mul, onnxruntime {ort[1]}"
    assert adds_left <= ort[2], f"bnfuse left {adds_left} per-channel Add, onnxruntime {ort[2]}"


@pytest.mark.parametrize("app", APPS)
def test_keras2_optimizers_off_leave_no_more_batchnorm_than_on(app: str, cache: Path) -> None:
    """tf2onnx with its optimizers off wraps each NCHW op in Transposes, the activations and Concats between them in
    NHWC: bnfuse cancels those (layout.cancel_transpose_pairs), so NASNetMobile's BN after a Concat split into the
    Convs and DenseNet's pre-activation BN move as when tf2onnx had removed the Transposes itself."""
    left = {}
    for optimizers in (True, False):
        _, report = bnfuse.optimize(keras_apps.onnx_model(app, "keras2", optimizers, cache=cache))
        left[optimizers] = report.batchnorms_after
    assert left[False] <= left[True], f"optimizers off: {left[False]} BN left, on: {left[True]}"
