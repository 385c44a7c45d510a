"""`bnfuse optimize`: exit codes (0 ok, 1 check failed, 2 bad input), one-line errors, no partial output."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from bnfuse.cli import main

ROOT = Path(__file__).resolve().parents[1]


def write_conv_bn(path: Path, *, var: float = 1.0, opset: int = 17) -> Path:
    rng = np.random.default_rng(0)
    inits = [
        numpy_helper.from_array(rng.normal(0, 1, (4, 3, 3, 3)).astype(np.float32), "w"),
        numpy_helper.from_array(np.full(4, 1.5, np.float32), "s"),
        numpy_helper.from_array(np.full(4, 0.1, np.float32), "b"),
        numpy_helper.from_array(np.full(4, 0.2, np.float32), "m"),
        numpy_helper.from_array(np.array([var, 1, 1, 1], np.float32), "v"),
    ]
    graph = helper.make_graph(
        [
            helper.make_node("Conv", ["x", "w"], ["c"], name="conv"),
            helper.make_node("BatchNormalization", ["c", "s", "b", "m", "v"], ["y"], name="bn"),
        ],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 3, "h", "w"])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 4, "h2", "w2"])],
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 8
    onnx.save_model(model, str(path))
    return path


def test_optimize_writes_output_report_and_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    source = write_conv_bn(tmp_path / "m.onnx")
    before = source.read_bytes()
    out, report = tmp_path / "o.onnx", tmp_path / "r.json"
    code = main(
        ["optimize", str(source), "-o", str(out), "--check", "--json", str(report), "--input-shape", "x:2x3x10x12"]
    )
    assert code == 0
    text = capsys.readouterr().out
    assert "folded     bn into conv" in text and "check passed" in text and "x=2x3x10x12" in text
    assert source.read_bytes() == before
    optimized = onnx.load(str(out))
    assert [n.op_type for n in optimized.graph.node] == ["Conv"]
    data = json.loads(report.read_text())
    assert data["summary"]["folded"] == 1 and data["check"]["passed"] is True
    assert data["check"]["input_shapes"] == {"x": [2, 3, 10, 12]}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.onnx", "o.onnx", "r.json"]


def test_default_output_name_is_input_stem_in_cwd(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    source = write_conv_bn(tmp_path / "net.onnx")
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    assert main(["optimize", str(source)]) == 0
    assert (work / "net.bnfuse.onnx").exists()


def test_scale_shift_option(tmp_path: Path) -> None:
    source = tmp_path / "m.onnx"
    write_conv_bn(source)
    model = onnx.load(str(source))
    model.graph.node[0].op_type = "Relu"  # nothing to fold into: x -> Relu -> BN
    del model.graph.node[0].input[1:]
    model.graph.output[0].CopyFrom(helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 3, "h", "w"]))
    for name in ("s", "b", "m", "v"):
        tensor = next(t for t in model.graph.initializer if t.name == name)
        tensor.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(tensor)[:3], name))
    model.graph.initializer.remove(next(t for t in model.graph.initializer if t.name == "w"))
    onnx.save_model(model, str(source))
    out = tmp_path / "o.onnx"
    assert main(["optimize", str(source), "-o", str(out), "--standalone", "scale-shift", "--check"]) == 0
    assert [n.op_type for n in onnx.load(str(out)).graph.node] == ["Relu", "Mul", "Add"]


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (None, "no such file"),
        (b"not a protobuf \xff\xff", "not a readable ONNX model"),
        ("truncated", "not a readable ONNX model"),
        ("negative-var", "variance has negative or NaN entries"),
        ("nan-var", "variance has negative or NaN entries"),
        ("opset-6", "unsupported opset 6"),
        ("opset-future", "unsupported opset"),
        ("invalid-graph", "invalid ONNX model"),
    ],
)
def test_bad_input_is_one_line_exit_2_and_writes_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], content: object, message: str
) -> None:
    source = tmp_path / "in.onnx"
    if isinstance(content, bytes):
        source.write_bytes(content)
    elif content == "truncated":
        source.write_bytes(write_conv_bn(source).read_bytes()[:-40])
    elif content in ("negative-var", "nan-var"):
        write_conv_bn(source, var=-1.0 if content == "negative-var" else float("nan"))
    elif content in ("opset-6", "opset-future"):
        write_conv_bn(source, opset=6 if content == "opset-6" else onnx.defs.onnx_opset_version() + 1)
    elif content == "invalid-graph":
        model = onnx.load(str(write_conv_bn(source)))
        model.graph.node[1].input[0] = "missing"
        onnx.save_model(model, str(source))
    before = source.read_bytes() if source.exists() else None
    out = tmp_path / "out.onnx"
    code = main(["optimize", str(source), "-o", str(out), "--json", str(tmp_path / "r.json")])
    err = capsys.readouterr().err
    assert code == 2
    assert err.count("\n") == 1 and message in err and err.startswith("bnfuse optimize: error:")
    assert not out.exists() and not (tmp_path / "r.json").exists()
    assert (source.read_bytes() if source.exists() else None) == before
    assert [p.name for p in tmp_path.iterdir() if p.name != "in.onnx"] == []


def test_bad_input_shape_option_is_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    source = write_conv_bn(tmp_path / "m.onnx")
    assert main(["optimize", str(source), "-o", str(tmp_path / "o.onnx"), "--input-shape", "x=1"]) == 2
    assert "expected NAME:DIMS" in capsys.readouterr().err


def test_check_failure_is_exit_1_and_writes_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A zero tolerance: folding changes float32 rounding, so the proof must fail."""
    import bnfuse.passes.check as check

    monkeypatch.setitem(check.TOLERANCES, TensorProto.FLOAT, 0.0)
    source = write_conv_bn(tmp_path / "m.onnx")
    out = tmp_path / "o.onnx"
    code = main(["optimize", str(source), "-o", str(out), "--check", "--json", str(tmp_path / "r.json")])
    captured = capsys.readouterr()
    assert code == 1
    assert "check FAILED" in captured.out and "check failed" in captured.err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.onnx"]


def test_subprocess_error_has_no_traceback_unless_debug(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    missing = str(tmp_path / "missing.onnx")
    plain = subprocess.run(
        [sys.executable, "-m", "bnfuse.cli", "optimize", missing], capture_output=True, text=True, env=env
    )
    assert plain.returncode == 2 and "Traceback" not in plain.stderr
    assert plain.stderr.strip() == f"bnfuse optimize: error: {missing}: no such file"
    debug = subprocess.run(
        [sys.executable, "-m", "bnfuse.cli", "optimize", missing, "--debug"], capture_output=True, text=True, env=env
    )
    assert debug.returncode != 0 and "Traceback" in debug.stderr


def test_no_input_uses_light_resnet50(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    monkeypatch.chdir(tmp_path)
    assert main(["optimize"]) == 0
    text = capsys.readouterr().out
    assert "light_resnet50.onnx" in text and "BatchNormalization: 53 -> 0" in text
    assert (tmp_path / "light_resnet50.bnfuse.onnx").exists()


def test_unwritable_output_is_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    source = write_conv_bn(tmp_path / "m.onnx")
    blocker = tmp_path / "file"
    blocker.write_text("")
    assert main(["optimize", str(source), "-o", str(blocker / "sub" / "o.onnx")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("bnfuse optimize: error: cannot write") and err.count("\n") == 1


def test_progress_bar_draws_only_for_many_batchnorms(capsys: pytest.CaptureFixture[str]) -> None:
    from bnfuse.cli import _ProgressBar

    small = _ProgressBar()
    small.update(1, 3)
    small.close()
    assert capsys.readouterr().err == ""
    large = _ProgressBar()
    large.update(30, 60)
    assert "30/60" in capsys.readouterr().err
    large.close()
    assert capsys.readouterr().err.startswith("\r")
