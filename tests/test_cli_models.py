"""`bnfuse models list` and `bnfuse models write`: output files, messages, one-line errors with exit 2."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import onnx
import onnxruntime as ort
import pytest

from bnfuse.cli import main
from bnfuse.models import names


def test_list_names_every_model(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["models", "list"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in lines] == names()
    assert any("ResNet-50" in line and "25.6 M" in line for line in lines)


def test_write_with_every_option(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "m.onnx"
    args = ["--opset", "13", "--dtype", "float16", "--batch", "2", "--size", "64", "--width", "0.25", "--seed", "5"]
    assert main(["models", "write", "resnet18", str(out), *args]) == 0
    message = capsys.readouterr().out
    assert message.startswith(f"wrote {out}: resnet18,") and "float16, opset 13" in message
    model = onnx.load(str(out))
    onnx.checker.check_model(model, full_check=True)
    assert model.opset_import[0].version == 13
    assert [d.dim_value for d in model.graph.input[0].type.tensor_type.shape.dim] == [2, 3, 64, 64]
    assert model.graph.input[0].type.tensor_type.elem_type == onnx.TensorProto.FLOAT16
    props = {p.key: p.value for p in model.metadata_props}
    assert props["bnfuse.seed"] == "5" and props["bnfuse.width"] == "0.25"
    ort.InferenceSession(str(out), providers=["CPUExecutionProvider"])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.onnx"]  # no temporary left behind


def test_written_model_feeds_optimize(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    model = tmp_path / "mlp.onnx"
    assert main(["models", "write", "mlp_matmul", str(model), "--width", "0.25", "--size", "32"]) == 0
    assert main(["optimize", str(model), "-o", str(tmp_path / "out.onnx"), "--check"]) == 0
    assert re.search(r"BatchNormalization +3 +0 ", capsys.readouterr().out)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["write", "vgg", "x.onnx"], "unknown model 'vgg'"),
        (["write", "unet", "x.onnx", "--size", "33"], "multiple of 16"),
        (["write", "resnet18", "x.onnx", "--opset", "2"], "opset must be between"),
        (["write", "resnet18", "x.onnx", "--batch", "0"], "batch must be >= 1"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(
    args: list[str], message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    assert main(["models", *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("bnfuse models: error: ") and message in err and err.count("\n") == 1
    assert not list(tmp_path.iterdir())


def test_unwritable_output_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    assert main(["models", "write", "mlp_gemm", str(blocker / "m.onnx"), "--width", "0.25"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"bnfuse models: error: cannot write {blocker / 'm.onnx'}") and err.count("\n") == 1


def test_console_entry_point(tmp_path: Path) -> None:
    out = tmp_path / "a.onnx"
    command = ["models", "write", "audio1d", str(out), "--size", "1024", "--width", "0.25"]
    done = subprocess.run([sys.executable, "-m", "bnfuse.cli", *command], capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr
    assert out.exists() and done.stderr == ""
