"""The README's recalibration example: files for `bnfuse recalibrate`, and the accuracy of any model on them.

    python examples/recalibrate_digits.py prepare DIR [--epochs 15]
        trains bench/bench_recalibrate.py's CNN on scikit-learn's digits with PyTorch and writes
        DIR/digits_cnn.onnx (every BN kept), DIR/shifted_unlabeled.npz (the shifted training images as 'x', no
        labels) and DIR/shifted_test.npz (the shifted test images 'x' and their 'labels')
    python examples/recalibrate_digits.py accuracy MODEL.onnx DIR/shifted_test.npz

then, between the two:

    bnfuse recalibrate DIR/digits_cnn.onnx --data DIR/shifted_unlabeled.npz -o DIR/recal.onnx --batch-size 64
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.bench_recalibrate import digits, export, onnx_accuracy, shift, train  # noqa: E402
from bnfuse.io import save_model  # noqa: E402


def prepare(directory: Path, epochs: int) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    x_train, x_test, y_train, y_test = digits()
    model = export(train(x_train, y_train, epochs=epochs))
    save_model(model, directory / "digits_cnn.onnx")
    np.savez(directory / "shifted_unlabeled.npz", x=shift(x_train))
    np.savez(directory / "shifted_test.npz", x=shift(x_test), labels=y_test)
    print(f"clean test accuracy {onnx_accuracy(model, x_test, y_test):.4f}; wrote {directory}/digits_cnn.onnx, ")
    print(f"  {directory}/shifted_unlabeled.npz ({len(x_train)} images), {directory}/shifted_test.npz ({len(x_test)})")


def accuracy(model_path: Path, data: Path) -> None:
    import onnx

    with np.load(data) as arrays:
        x, labels = arrays["x"], arrays["labels"]
    print(f"{model_path}: accuracy {onnx_accuracy(onnx.load(model_path), x, labels):.4f} on {data}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    actions = parser.add_subparsers(dest="action", required=True)
    first = actions.add_parser("prepare")
    first.add_argument("directory", type=Path)
    first.add_argument("--epochs", type=int, default=15)
    second = actions.add_parser("accuracy")
    second.add_argument("model", type=Path)
    second.add_argument("data", type=Path)
    args = parser.parse_args()
    if args.action == "prepare":
        prepare(args.directory, args.epochs)
    else:
        accuracy(args.model, args.data)


if __name__ == "__main__":
    main()
