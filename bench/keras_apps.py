"""Keras applications as ONNX through tf2onnx: the models users bring from TensorFlow (test and bench input only).

Needs the optional extra `keras` (tensorflow, tf-keras, tf2onnx): large, so install it in its own venv
(`pip install -e '.[cpu,test,keras]'`). Nothing in bnfuse imports this module.

Each application is built with ``weights=None`` and random BN parameters and statistics (gamma, beta,
moving mean and variance), so a fold that dropped or mis-ordered any of them changes the outputs. Two Keras
generations, two tf2onnx settings:
- ``keras2``: tf-keras (Keras 2) through ``tf2onnx.convert.from_keras``; BN arrives as BatchNormalization.
- ``keras3``: Keras 3 (the ``keras`` package tensorflow installs) through ``tf2onnx.convert.from_function``;
  Keras 3 computes inference BN as ``x * scale + shift``, so it arrives as a per-channel Mul and Add.
- ``optimizers=True``: tf2onnx's ONNX optimizers on (the default: Transpose push-down, BN folding into Conv).
- ``optimizers=False``: ``optimizers={}``, every tf2onnx optimizer off: each NHWC Conv and BN is wrapped in
  NHWC <-> NCHW Transposes and each kernel is a Transpose of a constant.

    python bench/keras_apps.py OUT_DIR [MobileNetV2 ...]   # writes keras{2,3}_<App>_{opt,noopt}.onnx
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import numpy as np  # noqa: E402
import onnx  # noqa: E402

APPS = ("MobileNetV2", "ResNet50", "EfficientNetB0", "DenseNet121", "Xception", "NASNetMobile")
KERAS_VERSIONS = ("keras2", "keras3")
# The smallest square input each application accepts (ImageNet-style apps refuse fewer than 32 pixels;
# Xception 71, NASNetMobile's stride pattern 32): the folds do not depend on the spatial size.
MIN_SIZE = {"Xception": 71, "NASNetMobile": 32}
DEFAULT_SIZE = 64
OPSET = 13
IR_VERSION = 8  # what onnxruntime and onnx 1.23 both read


def input_size(app: str) -> int:
    return max(DEFAULT_SIZE, MIN_SIZE.get(app, 32))


def _keras_module(version: str):  # type: ignore[no-untyped-def]
    if version == "keras2":
        import tf_keras

        return tf_keras
    if version == "keras3":
        import keras

        return keras
    raise ValueError(f"keras version must be one of {KERAS_VERSIONS}, got {version!r}")


def build(app: str, version: str = "keras2", seed: int = 0):  # type: ignore[no-untyped-def]
    """The application with random weights and random BN statistics, for a (size, size, 3) NHWC input."""
    keras = _keras_module(version)
    size = input_size(app)
    model = getattr(keras.applications, app)(weights=None, input_shape=(size, size, 3), classes=10)
    rng = np.random.default_rng(seed)
    batchnorm = keras.layers.BatchNormalization
    for layer in model.layers:
        if isinstance(layer, batchnorm):
            channels = layer.moving_mean.shape
            layer.moving_mean.assign(rng.normal(0.0, 0.5, channels).astype(np.float32))
            layer.moving_variance.assign(rng.uniform(0.5, 2.0, channels).astype(np.float32))
            if layer.gamma is not None:
                layer.gamma.assign(rng.uniform(0.5, 1.5, channels).astype(np.float32))
            if layer.beta is not None:
                layer.beta.assign(rng.normal(0.0, 0.2, channels).astype(np.float32))
    return model


def convert(model, version: str, optimizers: bool) -> onnx.ModelProto:  # type: ignore[no-untyped-def]
    """tf2onnx's ONNX for ``model`` (batch 1), IR version readable by onnxruntime."""
    import tensorflow as tf
    import tf2onnx

    size = model.input_shape[1]
    spec = (tf.TensorSpec((1, size, size, 3), tf.float32, name="input"),)
    chosen = None if optimizers else {}  # None: tf2onnx's default optimizers; {}: none of them
    if version == "keras2":
        proto, _ = tf2onnx.convert.from_keras(model, input_signature=spec, opset=OPSET, optimizers=chosen)
    else:
        # from_function takes no optimizers argument: its steps, with optimize_graph given the choice.
        function = tf.function(lambda x: model(x, training=False), input_signature=spec)
        concrete = function.get_concrete_function(*spec)
        inputs = [t.name for t in concrete.inputs if t.dtype != tf.dtypes.resource]
        outputs = [t.name for t in concrete.outputs if t.dtype != tf.dtypes.resource]
        frozen = tf2onnx.tf_loader.from_function(concrete, inputs, outputs)
        with tf.Graph().as_default() as graph:
            tf.import_graph_def(frozen, name="")
            converted = tf2onnx.tfonnx.process_tf_graph(graph, opset=OPSET, input_names=inputs, output_names=outputs)
        proto = tf2onnx.optimizer.optimize_graph(converted, optimizers=chosen).make_model(model.name)
    proto.ir_version = IR_VERSION
    return proto


def onnx_model(app: str, version: str, optimizers: bool, cache: Path | None = None) -> onnx.ModelProto:
    """Build and convert, or load the conversion written earlier to ``cache`` (building takes seconds)."""
    path = cache / model_name(app, version, optimizers) if cache is not None else None
    if path is not None and path.exists():
        return onnx.load(str(path))
    proto = convert(build(app, version), version, optimizers)
    _keras_module(version).backend.clear_session()  # a test session converts a dozen models: free each graph
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        onnx.save(proto, str(path))
    return proto


def model_name(app: str, version: str, optimizers: bool) -> str:
    return f"{version}_{app}_{'opt' if optimizers else 'noopt'}.onnx"


def main(argv: list[str]) -> int:
    if not argv:
        print("usage: python bench/keras_apps.py OUT_DIR [APP ...]", file=sys.stderr)
        return 2
    out, apps = Path(argv[0]), argv[1:] or list(APPS)
    for app in apps:
        for version in KERAS_VERSIONS:
            for optimizers in (True, False):
                onnx_model(app, version, optimizers, cache=out)
                print(out / model_name(app, version, optimizers), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
