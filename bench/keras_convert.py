"""Convert Keras applications to ONNX with tf2onnx, its optimizers on and off, for bench_fold_coverage.py.

Needs tensorflow-cpu, tf-keras and tf2onnx (`pip install -e '.[keras]'`, best in a separate venv: they are
large). Weights are random (weights=None) and every BN gets random moving statistics, so a fold that
dropped or mis-ordered them would show in the proof. Keras 2 (tf-keras) is used, as tf2onnx supports it.

    python bench/keras_convert.py OUT_DIR [MobileNetV2 ResNet50 ...]
    BNFUSE_KERAS_ONNX=OUT_DIR python bench/bench_fold_coverage.py
"""

from __future__ import annotations

import os
import sys

os.environ["TF_CPP_MIN_LOG_LEVEL"] = "3"
os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")  # tf.keras is tf-keras (Keras 2), which tf2onnx converts

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
import tf2onnx  # noqa: E402

APPS = ("MobileNetV2", "ResNet50", "EfficientNetB0", "DenseNet121", "Xception", "NASNetMobile")
SIZE = 96  # small inputs: the folds do not depend on the spatial size


def randomize_batchnorm(model: tf.keras.Model, rng: np.random.Generator) -> None:
    for layer in model.layers:
        if isinstance(layer, tf.keras.layers.BatchNormalization):
            layer.moving_mean.assign(rng.normal(0, 0.5, layer.moving_mean.shape).astype(np.float32))
            layer.moving_variance.assign(rng.uniform(0.5, 2.0, layer.moving_variance.shape).astype(np.float32))


def convert(name: str, out_dir: str, rng: np.random.Generator) -> list[str]:
    model = getattr(tf.keras.applications, name)(weights=None, input_shape=(SIZE, SIZE, 3), classes=10)
    randomize_batchnorm(model, rng)
    spec = (tf.TensorSpec((1, SIZE, SIZE, 3), tf.float32, name="input"),)
    paths = []
    for label, optimizers in (("opt", None), ("noopt", {})):  # {}: every tf2onnx optimizer off
        path = os.path.join(out_dir, f"keras_{name}_{label}.onnx")
        tf2onnx.convert.from_keras(model, input_signature=spec, opset=13, output_path=path, optimizers=optimizers)
        paths.append(path)
    return paths


def main(argv: list[str]) -> int:
    out_dir, names = argv[0], argv[1:] or list(APPS)
    os.makedirs(out_dir, exist_ok=True)
    rng = np.random.default_rng(0)
    for name in names:
        for path in convert(name, out_dir, rng):
            print(path, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
