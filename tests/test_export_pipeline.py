"""PyTorch (eval mode) -> torch.onnx.export -> bnfuse.optimize -> onnxruntime: outputs equal PyTorch's."""

from __future__ import annotations

import io
import warnings
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest

import bnfuse
from bnfuse.io import ort_compatible
from bnfuse.passes.optimize import count_nodes
from tests.loaders import load_file

torch = pytest.importorskip("torch")
nn = torch.nn
EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "export_pytorch.py"


def export(net: nn.Module, x: torch.Tensor, **kwargs: object) -> onnx.ModelProto:
    buffer = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(
            net, (x,), buffer, dynamo=False, opset_version=17, input_names=["input"], output_names=["output"],
            dynamic_axes={"input": {0: "batch"}}, **kwargs,
        )  # fmt: skip
    return ort_compatible(onnx.load_from_string(buffer.getvalue()))


def onnx_output(model: onnx.ModelProto, x: torch.Tensor) -> np.ndarray:
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    return session.run(None, {"input": x.numpy()})[0]


def with_statistics(net: nn.Module, x_shape: tuple[int, ...], seed: int = 0) -> nn.Module:
    """Random BN affine parameters and running statistics from training-mode batches; then eval mode."""
    torch.manual_seed(seed)
    with torch.no_grad():
        for module in net.modules():
            if isinstance(module, nn.modules.batchnorm._BatchNorm):
                module.weight.uniform_(0.5, 1.5)
                module.bias.normal_(0.0, 0.3)
        net.train()
        for _ in range(4):
            net(torch.randn(*x_shape) * 1.5 + 0.3)
    return net.eval()


def assert_matches_torch(net: nn.Module, model: onnx.ModelProto, x: torch.Tensor) -> None:
    with torch.no_grad():
        want = net(x).numpy()
    got = onnx_output(model, x)
    assert got.shape == want.shape
    assert np.abs(got - want).max() <= 1e-4 * np.abs(want).max()


def small_resnet() -> nn.Module:
    class Block(nn.Module):
        def __init__(self, c: int) -> None:
            super().__init__()
            self.body = nn.Sequential(
                nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c), nn.ReLU(),
                nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c),
            )  # fmt: skip

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.relu(x + self.body(x))

    return nn.Sequential(
        nn.Conv2d(3, 16, 3, stride=2, padding=1, bias=False), nn.BatchNorm2d(16), nn.ReLU(),
        Block(16), Block(16), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, 10),
    )  # fmt: skip


@pytest.mark.parametrize("keep_batchnorm", [False, True])
def test_resnet_export_then_optimize(keep_batchnorm: bool) -> None:
    net = with_statistics(small_resnet(), (8, 3, 16, 16))
    x = torch.randn(3, 3, 16, 16)
    # Eval-mode export folds Conv+BN itself; with constant folding off every BN reaches ONNX.
    model = export(net, x, do_constant_folding=not keep_batchnorm)
    assert count_nodes(model.graph, "BatchNormalization") == (5 if keep_batchnorm else 0)
    optimized, report = bnfuse.optimize(model, check=True, full_check=True)
    assert report.batchnorms_after == 0 and report.count("folded") == (5 if keep_batchnorm else 0)
    assert_matches_torch(net, model, x)
    assert_matches_torch(net, optimized, x)


def test_batchnorms_pytorch_leaves_are_folded() -> None:
    """ConvTranspose -> BN, Linear -> BatchNorm1d, Conv1d -> BatchNorm1d survive PyTorch's own export folding."""

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.up = nn.Sequential(nn.ConvTranspose2d(4, 8, 2, stride=2), nn.BatchNorm2d(8), nn.ReLU())
            self.seq = nn.Sequential(nn.Conv1d(8, 8, 3, padding=1), nn.BatchNorm1d(8), nn.ReLU())
            self.head = nn.Sequential(nn.Linear(8, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, 5))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = self.up(x).flatten(2)
            return self.head(self.seq(y).mean(dim=2))

    net = with_statistics(Net(), (8, 4, 6, 6))
    x = torch.randn(2, 4, 6, 6)
    model = export(net, x)
    before = count_nodes(model.graph, "BatchNormalization")
    assert before >= 2
    optimized, report = bnfuse.optimize(model, check=True)
    assert report.batchnorms_after == 0 and report.count("folded") == before
    assert_matches_torch(net, optimized, x)


def test_preactivation_batchnorm_moves_its_scale_or_stays_with_a_reason_or_becomes_mul_add() -> None:
    net = with_statistics(
        nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.BatchNorm2d(8), nn.ReLU(), nn.Conv2d(8, 4, 1)), (8, 3, 10, 10)
    )
    x = torch.randn(2, 3, 10, 10)
    model = export(net, x)
    moved, report = bnfuse.optimize(model, check=True)
    (record,) = report.batchnorms
    assert record.direction == "moved" and report.batchnorms_after == 0
    assert_matches_torch(net, moved, x)
    with torch.no_grad():
        net[2].weight[0] = -net[2].weight[0]  # a negative scale does not commute with the ReLU
    model = export(net, x)
    kept, report = bnfuse.optimize(model)
    (record,) = report.batchnorms
    assert record.status == "skipped" and "(Relu) cannot absorb" in (record.reason or "")
    assert "only a positive scale commutes" in (record.reason or "")
    converted, report = bnfuse.optimize(model, standalone="scale-shift", check=True)
    assert report.count("converted") == 1 and report.batchnorms_after == 0
    assert_matches_torch(net, kept, x)
    assert_matches_torch(net, converted, x)


def test_example_script(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    example = load_file(EXAMPLE, "export_pytorch_example")
    errors = example.pipeline(tmp_path)
    assert set(errors) == {"exported", "folded", "scale_shift"} and max(errors.values()) <= 1e-4
    assert sorted(p.name for p in tmp_path.iterdir()) == ["exported.onnx", "folded.onnx", "scale_shift.onnx"]
    assert "3 folded (0 forward, 1 moved through an activation)" in capsys.readouterr().out
