"""docs/exporting.md is true for the installed torch: what each exporter leaves of BN, and what bnfuse folds after it.

The table in the doc is parsed and every cell re-measured; then every export is optimized by bnfuse and
compared with PyTorch's own output in onnxruntime.
"""

from __future__ import annotations

import io
import re
import warnings
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest

import bnfuse
from bnfuse.cli import main

torch = pytest.importorskip("torch")
pytest.importorskip("onnxscript")  # the dynamo exporter needs it
nn = torch.nn

DOC = Path(__file__).resolve().parents[1] / "docs" / "exporting.md"


class ArcFaceHead(nn.Module):
    """iResNet / ArcFace embedding head: BN2d -> Flatten -> Dropout -> Linear -> BN1d."""

    def __init__(self) -> None:
        super().__init__()
        self.bn2d, self.dropout = nn.BatchNorm2d(8), nn.Dropout(0.4)
        self.fc, self.bn1d = nn.Linear(8 * 4 * 4, 16), nn.BatchNorm1d(16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.bn1d(self.fc(self.dropout(torch.flatten(self.bn2d(x), 1))))


class ReluBnConv(nn.Module):
    """ReLU -> BN -> Conv without padding (grouped when ``groups`` > 1)."""

    def __init__(self, groups: int = 1) -> None:
        super().__init__()
        self.bn, self.conv = nn.BatchNorm2d(8), nn.Conv2d(8, 8, 3, padding=0, groups=groups)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(self.bn(torch.relu(x)))


class ConvBnRelu(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv, self.bn = nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.bn(self.conv(x)))


class ReluBnDeconv(nn.Module):
    """ReLU -> BN -> ConvTranspose 1x1 (stride 1: every output sees one tap of each input, so exact)."""

    def __init__(self) -> None:
        super().__init__()
        self.bn, self.deconv = nn.BatchNorm2d(8), nn.ConvTranspose2d(8, 6, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.deconv(self.bn(torch.relu(x)))


class ConcatBn(nn.Module):
    """Two Conv branches -> cat -> BN (NASNet / Inception): the BN splits into both Convs."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Conv2d(8, 4, 3, padding=1), nn.Conv2d(8, 6, 1)
        self.bn = nn.BatchNorm2d(10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.bn(torch.cat([self.a(x), self.b(x)], 1)))


class PreActivation(nn.Module):
    """DenseNet-style BN -> ReLU -> Conv: no linear layer next to the BN (its scale moves through the ReLU)."""

    def __init__(self) -> None:
        super().__init__()
        self.bn, self.conv = nn.BatchNorm2d(8), nn.Conv2d(8, 8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(torch.relu(self.bn(x)))


MODULES = {
    "conv-bn-relu": ConvBnRelu,
    "arcface-head": ArcFaceHead,
    "relu-bn-conv": ReluBnConv,
    "relu-bn-grouped-conv": lambda: ReluBnConv(groups=4),
    "relu-bn-depthwise-conv": lambda: ReluBnConv(groups=8),
    "relu-bn-conv-transpose": ReluBnDeconv,
    "concat-bn": ConcatBn,
    "bn-relu-conv": PreActivation,
}
EXPORTERS = {
    "dynamo": {"dynamo": True},
    "dynamo optimize=False": {"dynamo": True, "optimize": False},
    "TorchScript": {"dynamo": False},
    "TorchScript do_constant_folding=False": {"dynamo": False, "do_constant_folding": False},
}
# After the dynamo exporter bnfuse leaves no BN: the pre-activation one becomes an Add (its scale moved into the Conv).
BNFUSE_LEFT = dict.fromkeys(MODULES, 0)
FORWARD = ("relu-bn-conv", "relu-bn-grouped-conv", "relu-bn-depthwise-conv", "relu-bn-conv-transpose")


def build(name: str) -> nn.Module:
    torch.manual_seed(0)
    module = MODULES[name]()
    for bn in (m for m in module.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)):
        bn.running_mean.uniform_(-1, 1)
        bn.running_var.uniform_(0.5, 2)
        bn.weight.data.uniform_(0.5, 2)
        bn.bias.data.uniform_(-1, 1)
    return module.eval()


def export(module: nn.Module, x: torch.Tensor, **options: object) -> onnx.ModelProto:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if options.get("dynamo"):
            return torch.onnx.export(module, (x,), verbose=False, **options).model_proto
        buffer = io.BytesIO()
        torch.onnx.export(module, (x,), buffer, **options)
        return onnx.load_from_string(buffer.getvalue())


def batchnorms(model: onnx.ModelProto) -> list[onnx.NodeProto]:
    return [n for n in model.graph.node if n.op_type == "BatchNormalization"]


def documented_table() -> dict[str, dict[str, int]]:
    """Rows of the 'What each exporter leaves' table: module -> exporter -> BN count."""
    text = DOC.read_text().split("## What each exporter leaves", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in text.splitlines() if line.startswith("|")]
    header = [c.strip().strip("`") for c in rows[0].strip("|").split("|")]
    table = {}
    for row in rows[2:]:
        cells = [c.strip().strip("`") for c in row.strip("|").split("|")]
        table[cells[0]] = {h: int(re.match(r"\d+", c).group()) for h, c in zip(header[1:], cells[1:], strict=True)}
    return table


def input_for(name: str) -> torch.Tensor:
    return torch.randn(2, 8, 4, 4 if name == "arcface-head" else 6, generator=torch.Generator().manual_seed(1))


def ort_run(model: onnx.ModelProto, x: np.ndarray) -> np.ndarray:
    model.ir_version = min(model.ir_version, 10)
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, {session.get_inputs()[0].name: x})[0]


_EXPORTS: dict[tuple[str, str], onnx.ModelProto] = {}


def exported(name: str, exporter: str) -> onnx.ModelProto:
    key = (name, exporter)
    if key not in _EXPORTS:
        _EXPORTS[key] = export(build(name), input_for(name), **EXPORTERS[exporter])
    return _EXPORTS[key]


def test_doc_table_covers_every_module_and_exporter() -> None:
    table = documented_table()
    assert set(table) == set(MODULES)
    assert all(set(row) == set(EXPORTERS) | {"bnfuse after dynamo"} for row in table.values())


@pytest.mark.parametrize("name", list(MODULES))
def test_documented_batchnorm_counts_match_the_installed_torch(name: str) -> None:
    row = documented_table()[name]
    for exporter in EXPORTERS:
        assert len(batchnorms(exported(name, exporter))) == row[exporter], (name, exporter)
    assert row["bnfuse after dynamo"] == BNFUSE_LEFT[name]


@pytest.mark.parametrize("name", list(MODULES))
@pytest.mark.parametrize("exporter", list(EXPORTERS))
def test_bnfuse_folds_what_every_exporter_leaves(name: str, exporter: str) -> None:
    model = exported(name, exporter)
    optimized, report = bnfuse.optimize(model, check=True)
    assert report.batchnorms_after == BNFUSE_LEFT[name]
    folded_forward = sum(1 for r in report.batchnorms if r.direction == "forward")
    if name in FORWARD or (name == "arcface-head" and len(batchnorms(model))):
        assert folded_forward == 1  # the BN before the linear layer; the head's BN1d folds backward
    x = input_for(name)
    with torch.no_grad():
        want = build(name)(x).numpy()
    got = ort_run(optimized, x.numpy())
    assert float(np.abs(got - want).max()) <= 1e-4 * float(np.abs(want).max())


def test_torchscript_training_mode_export_is_reset_to_inference_by_optimize() -> None:
    module = build("relu-bn-conv").train()
    model = export(module, input_for("relu-bn-conv"), dynamo=False, training=torch.onnx.TrainingMode.TRAINING)
    model.ir_version = min(model.ir_version, 10)
    assert [a.i for a in batchnorms(model)[0].attribute if a.name == "training_mode"] == [1]
    optimized, report = bnfuse.optimize(model, check=True)
    assert report.batchnorms_after == 0 and report.batchnorms[0].reset_from_training
    x = input_for("relu-bn-conv")
    with torch.no_grad():
        want = module.eval()(x).numpy()
    assert np.allclose(ort_run(optimized, x.numpy()), want, rtol=1e-4, atol=1e-5)


def test_train_graph_refuses_a_model_the_exporter_folded(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    model = exported("conv-bn-relu", "dynamo")
    assert batchnorms(model) == []
    source = tmp_path / "folded.onnx"
    source.write_bytes(model.SerializeToString())
    assert main(["train-graph", str(source), "-o", str(tmp_path / "train.onnx"), "--batch-size", "2"]) == 2
    error = capsys.readouterr().err.strip()
    assert "\n" not in error and "no BatchNormalization" in error and "optimize=False" in error
    assert not (tmp_path / "train.onnx").exists()
