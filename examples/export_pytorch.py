"""PyTorch -> ONNX -> bnfuse.optimize -> onnxruntime, with outputs checked against PyTorch.

    python examples/export_pytorch.py [--output DIR]

The network mixes the BatchNormalization placements found in practice: Conv -> BN (PyTorch's exporter
folds those itself in eval mode), ConvTranspose -> BN and Linear -> BatchNorm1d (it does not: bnfuse
does), and a pre-activation BN -> ReLU -> Conv (nobody can fold it into a producer; bnfuse moves its positive
scale through the ReLU into the Conv and keeps its shift as an Add). torch.onnx.export runs with dynamo=False:
the newer exporter needs onnxscript. PyTorch is needed only here, never by bnfuse itself.
"""

from __future__ import annotations

import argparse
import io
import warnings
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import torch
from torch import nn

import bnfuse
from bnfuse.io import ort_compatible, save_model


class Net(nn.Module):
    """Conv-BN, pre-activation BN-ReLU-Conv, ConvTranspose-BN, and Linear-BN1d on a [N, 3, 32, 32] image."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 16, 3, stride=2, padding=1, bias=False), nn.BatchNorm2d(16), nn.ReLU())
        self.pre = nn.Sequential(nn.BatchNorm2d(32), nn.ReLU(), nn.Conv2d(32, 32, 3, padding=1))
        self.up = nn.Sequential(nn.ConvTranspose2d(32, 16, 2, stride=2, bias=False), nn.BatchNorm2d(16), nn.ReLU())
        self.head = nn.Sequential(nn.Linear(16, 64), nn.BatchNorm1d(64), nn.ReLU(), nn.Linear(64, 10))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.stem(x)
        y = self.pre(torch.cat([y, torch.relu(y)], dim=1))
        y = self.up(y)
        return self.head(y.mean(dim=(2, 3)))


def trained_net(seed: int = 0) -> Net:
    """A Net with random weights and BN running statistics from a few training-mode batches, in eval mode."""
    torch.manual_seed(seed)
    net = Net()
    with torch.no_grad():
        for module in net.modules():
            if isinstance(module, nn.BatchNorm2d | nn.BatchNorm1d):
                module.weight.uniform_(0.5, 1.5)
                module.bias.normal_(0.0, 0.2)
        net.train()
        for _ in range(5):
            net(torch.randn(16, 3, 32, 32) * 2 + 0.5)
    return net.eval()


def export(net: nn.Module, example: torch.Tensor) -> onnx.ModelProto:
    """torch.onnx.export (TorchScript exporter, eval mode) with a dynamic batch dimension."""
    buffer = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the TorchScript exporter's deprecation notice
        torch.onnx.export(
            net, (example,), buffer, dynamo=False, opset_version=17, input_names=["input"], output_names=["output"],
            dynamic_axes={"input": {0: "batch"}, "output": {0: "batch"}},
        )  # fmt: skip
    return ort_compatible(onnx.load_from_string(buffer.getvalue()))


def run_onnx(model: onnx.ModelProto, x: np.ndarray) -> np.ndarray:
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, {"input": x})[0]


def pipeline(output: Path | None = None) -> dict[str, float]:
    """Export, optimize, run; returns the max relative error of each ONNX model against PyTorch."""
    net = trained_net()
    x = torch.randn(4, 3, 32, 32)
    with torch.no_grad():
        expected = net(x).numpy()
    exported = export(net, x)
    folded, report = bnfuse.optimize(exported, check=True)
    converted, converted_report = bnfuse.optimize(exported, standalone="scale-shift", check=True)
    print(report.format_text())
    print(f"with standalone='scale-shift': {converted_report.batchnorms_after} BatchNormalization left")
    if output is not None:
        for name, model in [("exported", exported), ("folded", folded), ("scale_shift", converted)]:
            print(f"wrote {save_model(model, output / f'{name}.onnx')}")
    scale = float(np.abs(expected).max())
    errors = {
        name: float(np.abs(run_onnx(model, x.numpy()) - expected).max()) / scale
        for name, model in [("exported", exported), ("folded", folded), ("scale_shift", converted)]
    }
    for name, error in errors.items():
        print(f"{name:12s} onnxruntime vs PyTorch: max relative error {error:.2e}")
    return errors


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", type=Path, help="directory to write the three ONNX models to")
    args = parser.parse_args()
    errors = pipeline(args.output)
    if max(errors.values()) > 1e-4:
        raise SystemExit("outputs differ from PyTorch beyond 1e-4 relative")


if __name__ == "__main__":
    main()
