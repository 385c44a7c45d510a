"""`bnfuse optimize`: exit codes (0 ok, 1 check failed, 2 bad input), one-line errors, no partial output."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from bnfuse.cli import _ProgressBar, main

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
        [
            "optimize",
            str(source),
            "-o",
            str(out),
            "--check",
            "-v",
            "--json",
            str(report),
            "--input-shape",
            "x:2x3x10x12",
        ]
    )
    assert code == 0
    text = capsys.readouterr().out
    assert "folded     bn into conv: at 'y' max abs" in text and "check passed" in text and "x=2x3x10x12" in text
    assert source.read_bytes() == before
    optimized = onnx.load(str(out))
    assert [n.op_type for n in optimized.graph.node] == ["Conv"]
    data = json.loads(report.read_text())
    assert data["summary"]["folded"] == 1 and data["check"]["passed"] is True
    assert data["check"]["input_shapes"] == {"x": [2, 3, 10, 12]}
    (fold,) = data["check"]["folds"]
    assert fold["node"] == "bn" and fold["tensor"] == "y" and fold["outcome"] == "ok"
    assert 0 < fold["error"]["max_rel"] <= fold["error"]["tolerance"] == 1e-4  # y is also the graph output
    assert fold["entry"] == "x" and fold["isolated"]["outcome"] == "ok"  # alone, on random data at the conv
    assert 0 < fold["isolated"]["max_rel"] <= fold["isolated"]["tolerance"] == 1e-4
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
    import bnfuse.passes.check.compare as check

    monkeypatch.setitem(check.TOLERANCES, TensorProto.FLOAT, 0.0)
    source = write_conv_bn(tmp_path / "m.onnx")
    out = tmp_path / "o.onnx"
    code = main(["optimize", str(source), "-o", str(out), "--check", "--json", str(tmp_path / "r.json")])
    captured = capsys.readouterr()
    assert code == 1
    assert "check FAILED" in captured.out and "check failed" in captured.err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.onnx"]


def write_offset_chain(path: Path) -> Path:
    """Conv -> BN -> Relu three times; block 1's conv output sits near 1e5 and its BN subtracts a 1e5 mean.

    The fold moves that subtraction into the bias, ahead of float32 rounding at 1e5 (ulp 0.008): the folded
    model differs from the original by ~2e-3 relative at bn1's output, far past the 1e-4 tolerance.
    """
    rng = np.random.default_rng(0)
    inits, nodes, source = [], [], "x"
    for i in range(3):
        shift = 1e5 if i == 1 else 0.0
        inits += [
            numpy_helper.from_array(rng.normal(0, 0.5, (4, 3 if i == 0 else 4, 3, 3)).astype(np.float32), f"w{i}"),
            numpy_helper.from_array(np.full(4, shift, np.float32), f"cb{i}"),
            numpy_helper.from_array(rng.uniform(0.5, 1.5, 4).astype(np.float32), f"s{i}"),
            numpy_helper.from_array(rng.normal(0, 0.1, 4).astype(np.float32), f"b{i}"),
            numpy_helper.from_array((shift + rng.normal(0, 0.1, 4)).astype(np.float32), f"m{i}"),
            numpy_helper.from_array(rng.uniform(0.5, 2, 4).astype(np.float32), f"v{i}"),
        ]
        nodes += [
            helper.make_node("Conv", [source, f"w{i}", f"cb{i}"], [f"c{i}"], name=f"conv{i}", pads=[1] * 4),
            helper.make_node(
                "BatchNormalization", [f"c{i}", f"s{i}", f"b{i}", f"m{i}", f"v{i}"], [f"y{i}"], name=f"bn{i}"
            ),
            helper.make_node("Relu", [f"y{i}"], [f"r{i}"], name=f"relu{i}"),
        ]
        source = f"r{i}"
    graph = helper.make_graph(
        nodes,
        "chain",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 8, 8])],
        [helper.make_tensor_value_info("r2", TensorProto.FLOAT, [1, 4, 8, 8])],
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save_model(model, str(path))
    return path


def test_a_failing_fold_is_named_exit_1_and_nothing_is_written(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    source = write_offset_chain(tmp_path / "m.onnx")
    before = source.read_bytes()
    out, report = tmp_path / "o.onnx", tmp_path / "r.json"
    assert main(["optimize", str(source), "-o", str(out), "--check", "--json", str(report)]) == 1
    captured = capsys.readouterr()
    assert captured.err.count("\n") == 1
    assert "check failed: fold of BatchNormalization 'bn1' into 'conv1' fails: 'y1' differs" in captured.err
    assert "(1 later fold(s) fail too) (nothing written)" in captured.err
    assert re.search(r"per fold +1 +0 +2 +0 ", captured.out) and "check FAILED" in captured.out
    assert source.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.onnx"]
    # Without --check the same model is written: the check is what stands between it and the user.
    assert main(["optimize", str(source), "-o", str(out)]) == 0 and out.exists()


def test_default_report_is_a_summary_and_json_lists_every_bn(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    source = write_offset_chain(tmp_path / "m.onnx")
    model = onnx.load(str(source))
    for tensor in model.graph.initializer:  # no offset: every fold passes
        if tensor.name in ("cb1", "m1"):
            tensor.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(tensor) - np.float32(1e5), tensor.name))
    onnx.save_model(model, str(source))
    out, report = tmp_path / "o.onnx", tmp_path / "r.json"
    assert main(["optimize", str(source), "-o", str(out), "--check", "--json", str(report)]) == 0
    text = capsys.readouterr().out
    assert re.search(r"BatchNormalization +3 +0 +3 folded", text) and re.search(r"per fold +3 +0 +0 +0 ", text)
    assert "folded     bn" not in text and "-v" in text
    data = json.loads(report.read_text())
    assert [(f["node"], f["tensor"], f["outcome"]) for f in data["check"]["folds"]] == [
        ("bn0", "y0", "ok"),
        ("bn1", "y1", "ok"),
        ("bn2", "y2", "ok"),
    ]
    assert data["check"]["summary"]["folds"] == {"ok": 3, "constant": 0, "failed": 0, "not compared": 0}
    assert [b["replacement"] for b in data["batchnorms"]] == ["y0", "y1", "y2"]
    assert main(["optimize", str(source), "-o", str(out), "--check", "-v"]) == 0
    verbose = capsys.readouterr().out
    assert all(f"folded     bn{i} into conv{i}: at 'y{i}' max abs" in verbose for i in range(3))


def test_light_resnet50_check_warns_that_its_output_proves_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["optimize", "--check", "-o", str(tmp_path / "o.onnx")]) == 0
    text = capsys.readouterr().out
    assert re.search(r"per fold +53 +0 +0 +0 ", text) and re.search(r"outputs +0 +1 +0 +0 ", text)
    assert "warning: output 'gpu_0/softmax_1' is the same on every random input" in text
    assert "the 53 per-fold comparisons carry the proof" in text


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
    assert "light_resnet50.onnx" in text and re.search(r"BatchNormalization +53 +0 ", text)
    assert (tmp_path / "light_resnet50.bnfuse.onnx").exists()


def test_unwritable_output_is_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    source = write_conv_bn(tmp_path / "m.onnx")
    blocker = tmp_path / "file"
    blocker.write_text("")
    assert main(["optimize", str(source), "-o", str(blocker / "sub" / "o.onnx")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("bnfuse optimize: error: cannot write") and err.count("\n") == 1


@pytest.mark.parametrize("blocker", ["file_as_parent", "directory_as_target"])
def test_failed_json_write_leaves_no_model(tmp_path: Path, capsys: pytest.CaptureFixture[str], blocker: str) -> None:
    source = write_conv_bn(tmp_path / "m.onnx")
    out = tmp_path / "out.onnx"
    if blocker == "file_as_parent":
        (tmp_path / "blk").write_text("")
        target = tmp_path / "blk" / "r.json"
        reason = f"{tmp_path / 'blk'} is not a directory"
    else:
        (tmp_path / "r.json").mkdir()
        target = tmp_path / "r.json"
        reason = "Is a directory"
    before = sorted(p.name for p in tmp_path.iterdir())
    assert main(["optimize", str(source), "-o", str(out), "--json", str(target)]) == 2
    err = capsys.readouterr().err
    assert err == f"bnfuse optimize: error: cannot write {target}: {reason}\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # no out.onnx, no temporaries
    assert not out.exists()


def test_json_and_model_written_into_new_directories_together(tmp_path: Path) -> None:
    source = write_conv_bn(tmp_path / "m.onnx")
    out, report = tmp_path / "a" / "b" / "o.onnx", tmp_path / "c" / "r.json"
    assert main(["optimize", str(source), "-o", str(out), "--json", str(report)]) == 0
    assert json.loads(report.read_text())["summary"]["folded"] == 1
    assert [n.op_type for n in onnx.load(str(out)).graph.node] == ["Conv"]
    assert sorted(p.name for p in out.parent.iterdir()) == ["o.onnx"]


def test_json_over_the_input_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    source = write_conv_bn(tmp_path / "m.onnx")
    before = source.read_bytes()
    assert main(["optimize", str(source), "-o", str(tmp_path / "o.onnx"), "--json", str(source)]) == 2
    assert "refusing to overwrite the input model" in capsys.readouterr().err
    assert source.read_bytes() == before and not (tmp_path / "o.onnx").exists()


def test_shape_error_in_the_input_is_blamed_on_the_input(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A BN with 5 statistics after a 4-channel Conv: onnx's shape inference rejects the input itself."""
    source = write_conv_bn(tmp_path / "m.onnx")
    model = onnx.load(str(source))
    for tensor in model.graph.initializer:
        if tensor.name in ("s", "b", "m", "v"):
            tensor.CopyFrom(numpy_helper.from_array(np.ones(5, np.float32), tensor.name))
    onnx.checker.check_model(model)  # structurally fine: only shape inference sees the mismatch
    onnx.save_model(model, str(source))
    out = tmp_path / "o.onnx"
    assert main(["optimize", str(source), "-o", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"bnfuse optimize: error: {source}: invalid ONNX model (") and err.count("\n") == 1
    assert "optimized model" not in err and "BatchNormalization" in err and "node name: bn" in err
    assert not out.exists()


@pytest.mark.parametrize("where", ["constant_in_function", "initializer_passed_in"])
def test_bad_variance_inside_a_local_function_is_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], where: str
) -> None:
    """Functions are not rewritten, but a negative variance there is still a broken model."""
    source = write_conv_bn(tmp_path / "m.onnx", var=-1.0)
    model = onnx.load(str(source))
    body = [helper.make_node("BatchNormalization", ["fx", "fs", "fb", "fm", "fv"], ["fy"], name="fn_bn")]
    inputs = ["fx", "fs", "fb", "fm", "fv"]
    if where == "constant_in_function":
        bad = numpy_helper.from_array(np.array([1, -2, 1, 1], np.float32), "cv")
        body.insert(0, helper.make_node("Constant", [], ["fv"], value=bad))
        inputs = inputs[:4]
        # the main graph's variance is fine here: only the function's own constant is negative
        model.graph.initializer.remove(next(t for t in model.graph.initializer if t.name == "v"))
        model.graph.initializer.append(numpy_helper.from_array(np.ones(4, np.float32), "v"))
    function = helper.make_function("custom", "Norm", inputs, ["fy"], body, [helper.make_opsetid("", 17)])
    model.functions.append(function)
    model.opset_import.append(helper.make_opsetid("custom", 1))
    model.graph.node[1].CopyFrom(
        helper.make_node("Norm", ["c", "s", "b", "m", "v"][: len(inputs)], ["y"], domain="custom")
    )
    onnx.checker.check_model(model, full_check=True)
    onnx.save_model(model, str(source))
    assert main(["optimize", str(source), "-o", str(tmp_path / "o.onnx")]) == 2
    err = capsys.readouterr().err
    assert err == (
        f"bnfuse optimize: error: {source}: BatchNormalization 'fn_bn' in function custom:Norm: "
        "variance has negative or NaN entries\n"
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.onnx"]


def test_external_data_input_gives_external_data_output(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    source = write_conv_bn(tmp_path / "m.onnx")
    model = onnx.load(str(source))
    weight = np.random.default_rng(1).normal(0, 1, (4, 3, 5, 5)).astype(np.float32)  # 1200 bytes: over 1 KiB
    model.graph.initializer[0].CopyFrom(numpy_helper.from_array(weight, "w"))
    onnx.save_model(model, str(source), save_as_external_data=True, location="weights.bin", size_threshold=64)
    before = source.read_bytes(), (tmp_path / "weights.bin").read_bytes()
    out = tmp_path / "out" / "o.onnx"
    assert main(["optimize", str(source), "-o", str(out), "--check"]) == 0
    assert f"wrote {out} (tensors in o.onnx.data)" in capsys.readouterr().out
    assert sorted(p.name for p in out.parent.iterdir()) == ["o.onnx", "o.onnx.data"]
    assert (source.read_bytes(), (tmp_path / "weights.bin").read_bytes()) == before
    stored = onnx.load(str(out), load_external_data=False)
    (external,) = [t for t in stored.graph.initializer if t.data_location == TensorProto.EXTERNAL]
    assert external.name == "w" and {e.key: e.value for e in external.external_data}["location"] == "o.onnx.data"
    assert (out.parent / "o.onnx.data").stat().st_size == weight.nbytes
    import onnxruntime as ort

    x = np.random.default_rng(0).standard_normal((1, 3, 8, 8)).astype(np.float32)
    want = ort.InferenceSession(str(source), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    got = ort.InferenceSession(str(out), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


def _run_cli(args: list[str], cwd: Path, *, stderr_tty: bool) -> tuple[int, str]:
    """Run `python -m bnfuse.cli` with stderr on a pseudo-terminal (or a pipe); return (code, stderr)."""
    import pty

    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    command = [sys.executable, "-m", "bnfuse.cli", *args]
    if not stderr_tty:
        done = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True)
        return done.returncode, done.stderr
    master, slave = pty.openpty()
    try:
        process = subprocess.Popen(command, cwd=cwd, env=env, stdout=subprocess.DEVNULL, stderr=slave)
        os.close(slave)
        chunks = []
        while True:
            try:
                chunk = os.read(master, 65536)
            except OSError:  # EIO: the child closed its end
                break
            if not chunk:
                break
            chunks.append(chunk)
        return process.wait(timeout=120), b"".join(chunks).decode(errors="replace")
    finally:
        os.close(master)


def test_progress_bar_is_drawn_on_a_terminal_only(tmp_path: Path) -> None:
    """The default model (light_resnet50, 53 BN) is over the bar's 50-BN threshold."""
    code, err = _run_cli(["optimize", "-o", "tty.onnx"], tmp_path, stderr_tty=True)
    assert code == 0
    assert "folding [" in err and "53/53" in err and "#" * _ProgressBar.WIDTH in err
    frames = err.split("\r")
    assert frames[-1] == "" and frames[-2].strip() == ""  # the bar is blanked out when done
    code, err = _run_cli(["optimize", "-o", "piped.onnx"], tmp_path, stderr_tty=False)
    assert code == 0 and err == ""
    assert (tmp_path / "tty.onnx").exists() and (tmp_path / "piped.onnx").exists()


def test_progress_bar_draws_only_for_many_batchnorms(capsys: pytest.CaptureFixture[str]) -> None:
    small = _ProgressBar()
    small.update(1, 3)
    small.close()
    assert capsys.readouterr().err == ""
    large = _ProgressBar()
    large.update(30, 60)
    assert "30/60" in capsys.readouterr().err
    large.close()
    assert capsys.readouterr().err.startswith("\r")
