"""`bnfuse recalibrate`: the file written, --fold, 1 vs 3 ranks under mpiexec, one-line errors (exit 2), the
input never modified."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

import bnfuse
from bnfuse.cli import main

LIMIT_S = 240  # 2 shared cores: each rank imports onnxruntime


def write_model(path: Path) -> Path:
    """x [n, 3, 6, 6] -> Conv -> BN -> Relu -> Conv -> BN -> GlobalAveragePool -> Flatten -> MatMul -> BN."""
    rng = np.random.default_rng(0)
    arrays = {
        "w1": rng.normal(0, 0.5, (4, 3, 3, 3)),
        "w2": rng.normal(0, 0.5, (5, 4, 3, 3)),
        "fc": rng.normal(0, 0.5, (5, 3)),
    }
    for k, c in ((1, 4), (2, 5), (3, 3)):
        arrays |= {
            f"s{k}": rng.uniform(0.5, 1.5, c),
            f"b{k}": rng.normal(0, 0.2, c),
            f"m{k}": rng.normal(0, 1, c),
            f"v{k}": rng.uniform(0.5, 2, c),
        }
    nodes = [
        helper.make_node("Conv", ["x", "w1"], ["c1"], name="conv1", pads=[1, 1, 1, 1]),
        helper.make_node("BatchNormalization", ["c1", "s1", "b1", "m1", "v1"], ["n1"], name="bn1"),
        helper.make_node("Relu", ["n1"], ["r1"]),
        helper.make_node("Conv", ["r1", "w2"], ["c2"], name="conv2"),
        helper.make_node("BatchNormalization", ["c2", "s2", "b2", "m2", "v2"], ["n2"], name="bn2"),
        helper.make_node("GlobalAveragePool", ["n2"], ["p"]),
        helper.make_node("Flatten", ["p"], ["f"]),
        helper.make_node("MatMul", ["f", "fc"], ["h"]),
        helper.make_node("BatchNormalization", ["h", "s3", "b3", "m3", "v3"], ["y"], name="bn3"),
    ]
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 3, 6, 6])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 3])],
        [numpy_helper.from_array(v.astype(np.float32), k) for k, v in arrays.items()],
    )
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)
    return path


def write_data(path: Path, count: int = 50, **extra: np.ndarray) -> Path:
    rng = np.random.default_rng(1)
    x = (rng.standard_normal((count, 3, 6, 6)) * 1.5 + 0.3).astype(np.float32)
    np.savez(path, x=x, labels=np.zeros(count, np.int64), **extra)
    return path


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def stats(path: Path) -> dict[str, np.ndarray]:
    return {t.name: numpy_helper.to_array(t) for t in onnx.load(path).graph.initializer}


@pytest.mark.parametrize("mode", ["update-bn", "exact"])
def test_recalibrate_writes_what_the_api_computes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], mode: str
) -> None:
    model, data = write_model(tmp_path / "m.onnx"), write_data(tmp_path / "d.npz")
    before = digest(model), digest(data)
    out = tmp_path / "out.onnx"
    assert (
        main(["recalibrate", str(model), "--data", str(data), "-o", str(out), "--batch-size", "16", "--mode", mode])
        == 0
    )
    text = capsys.readouterr().out
    assert f"recalibrated 3 BatchNormalization ({mode}) on 50 samples in 4 batches" in text and f"wrote {out}" in text
    assert (digest(model), digest(data)) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d.npz", "m.onnx", "out.onnx"]  # no temporary left
    x = np.load(data)["x"]
    expected, _ = bnfuse.recalibrate(onnx.load(model), [x[i : i + 16] for i in range(0, 50, 16)], mode=mode)
    written = stats(out)
    for tensor in expected.graph.initializer:
        assert numpy_helper.to_array(tensor).tobytes() == written[tensor.name].tobytes(), tensor.name


def test_fold_writes_a_model_without_bn_that_computes_the_recalibrated_one(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model, data = write_model(tmp_path / "m.onnx"), write_data(tmp_path / "d.npz")
    main(["recalibrate", str(model), "--data", str(data), "-o", str(tmp_path / "r.onnx"), "--mode", "exact"])
    args = ["recalibrate", str(model), "--data", str(data), "-o", str(tmp_path / "f.onnx"), "--mode", "exact", "--fold"]
    assert main(args) == 0
    assert "BatchNormalization" in capsys.readouterr().out
    folded = onnx.load(tmp_path / "f.onnx")
    assert not any(n.op_type == "BatchNormalization" for n in folded.graph.node[:-1])  # the last reads a MatMul
    x = np.load(data)["x"]
    run = {
        name: ort.InferenceSession(str(tmp_path / name), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
        for name in ("r.onnx", "f.onnx")
    }
    assert np.allclose(run["r.onnx"], run["f.onnx"], rtol=1e-4, atol=1e-4)


def _mpiexec() -> str:
    beside = Path(sys.executable).with_name("mpiexec")
    found = str(beside) if beside.exists() else shutil.which("mpiexec")
    if found is None:
        pytest.fail("mpiexec not found (pip install mpich gives one next to the interpreter)")
    return found


@pytest.mark.parametrize("mode", ["update-bn", "exact"])
def test_three_ranks_equal_one(tmp_path: Path, mode: str) -> None:
    """Batch 16 over 50 samples on 3 ranks: shares of 6/5/5 and, in the last batch of 2, one rank with none."""
    model, data = write_model(tmp_path / "m.onnx"), write_data(tmp_path / "d.npz")
    env = dict(os.environ, OMP_NUM_THREADS="1", NUMBA_NUM_THREADS="1")
    repo = str(Path(__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (repo, env.get("PYTHONPATH")) if p)
    outputs = {}
    for ranks in (1, 3):
        out = tmp_path / f"out{ranks}.onnx"
        command = [sys.executable, "-m", "bnfuse.cli", "recalibrate", str(model), "--data", str(data), "-o", str(out)]
        command += ["--batch-size", "16", "--mode", mode]
        result = subprocess.run(
            [_mpiexec(), "-n", str(ranks), *command], capture_output=True, text=True, timeout=LIMIT_S, env=env
        )
        assert result.returncode == 0, result.stderr[-3000:]
        assert result.stdout.count("wrote") == 1  # only rank 0 writes
        assert ("on 3 ranks" in result.stdout) == (ranks == 3)
        outputs[ranks] = stats(out)
    for name, value in outputs[1].items():
        scale = max(float(np.abs(value).max()), 1e-30)
        assert np.abs(outputs[3][name].astype(np.float64) - value).max() / scale < 1e-6, name


def test_bad_input_on_ranks_ends_the_job_with_one_line_per_rank(tmp_path: Path) -> None:
    model, data = write_model(tmp_path / "m.onnx"), write_data(tmp_path / "d.npz")
    folded = tmp_path / "folded.onnx"
    assert main(["optimize", str(model), "-o", str(folded)]) == 0
    env = dict(os.environ, OMP_NUM_THREADS="1", NUMBA_NUM_THREADS="1")
    repo = str(Path(__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (repo, env.get("PYTHONPATH")) if p)
    out = tmp_path / "out.onnx"
    command = [sys.executable, "-m", "bnfuse.cli", "recalibrate", str(folded), "--data", str(data), "-o", str(out)]
    result = subprocess.run([_mpiexec(), "-n", "3", *command], capture_output=True, text=True, timeout=LIMIT_S, env=env)
    assert result.returncode != 0 and not out.exists()
    assert "Traceback" not in result.stderr
    assert any(f"rank {r}: error:" in result.stderr and "recalibrate before folding" in result.stderr for r in range(3))


def test_data_file_faults_read_as_train_reads_them(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """One .npz reader (bnfuse.training.data.load_arrays): the same fault, the same line from both commands."""
    model, train_graph = write_model(tmp_path / "m.onnx"), tmp_path / "train.onnx"
    assert main(["train-graph", str(model), "-o", str(train_graph), "--batch-size", "4"]) == 0
    np.savez(tmp_path / "empty.npz")
    np.savez(tmp_path / "none.npz", x=np.zeros((0, 3, 6, 6), np.float32), labels=np.zeros(0, np.int64))
    np.savez(tmp_path / "other.npz", images=np.zeros((4, 3, 6, 6), np.float32), labels=np.zeros(4, np.int64))
    np.savez(tmp_path / "scalar.npz", X=np.float32(0), labels=np.zeros(4, np.int64))
    np.save(tmp_path / "lone.npy", np.zeros((4, 3, 6, 6), np.float32))
    (tmp_path / "junk.npz").write_bytes(b"not a zip")
    expected = {
        "empty.npz": "the data file holds no arrays",
        "none.npz": "the data file holds no samples (empty arrays)",
        "other.npz": "no array for input 'x' (arrays: images, labels; accepted: 'x' or 'X')",
        "scalar.npz": "array 'X' is a scalar, not a batch of samples",
        "lone.npy": "not a readable .npz file (a .npy array, not an .npz archive of named arrays)",
        "junk.npz": "not a readable .npz file (",
        "missing.npz": "not a readable .npz file (",
    }
    capsys.readouterr()
    for name, message in expected.items():
        data, lines = str(tmp_path / name), {}
        for command, source in (("recalibrate", model), ("train", train_graph)):
            assert main([command, str(source), "--data", data, "-o", str(tmp_path / "out.onnx")]) == 2, (command, name)
            err = capsys.readouterr().err
            prefix = f"bnfuse {command}: error: "
            assert err.startswith(prefix) and err.count("\n") == 1 and "Traceback" not in err, err
            lines[command] = err[len(prefix) :]
        assert lines["recalibrate"] == lines["train"], lines
        assert lines["train"].startswith(f"{data}: {message}"), lines
        assert not (tmp_path / "out.onnx").exists()


def _if_model(path: Path) -> Path:
    inner = helper.make_node("BatchNormalization", ["x", "s", "b", "m", "v"], ["t"], name="inner_bn")
    then = helper.make_graph([inner], "then", [], [helper.make_tensor_value_info("t", TensorProto.FLOAT, None)])
    other = helper.make_graph(
        [helper.make_node("Identity", ["x"], ["e"])], "else", [], [helper.make_tensor_value_info("e", 1, None)]
    )
    ones = np.ones(3, np.float32)
    graph = helper.make_graph(
        [helper.make_node("If", ["cond"], ["y"], then_branch=then, else_branch=other, name="branch")],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 3, 6, 6])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        [numpy_helper.from_array(a, n) for n, a in (("s", ones), ("b", 0 * ones), ("m", 0 * ones), ("v", ones))]
        + [numpy_helper.from_array(np.array(True), "cond")],
    )
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)
    return path


def test_bad_input_is_one_line_and_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    model, data = write_model(tmp_path / "m.onnx"), write_data(tmp_path / "d.npz")
    folded = tmp_path / "folded.onnx"
    assert main(["optimize", str(model), "-o", str(folded)]) == 0
    np.savez(tmp_path / "empty.npz")
    np.savez(tmp_path / "none.npz", x=np.zeros((0, 3, 6, 6), np.float32))
    np.savez(tmp_path / "wrong.npz", x=np.zeros((4, 3, 5, 5), np.float32))
    np.savez(tmp_path / "other.npz", images=np.zeros((4, 3, 6, 6), np.float32))
    (tmp_path / "junk.npz").write_bytes(b"not a zip")
    capsys.readouterr()
    out = str(tmp_path / "out.onnx")
    cases = {
        "recalibrate before folding": [str(folded), "--data", str(data)],
        "inside the body of If 'branch'": [str(_if_model(tmp_path / "if.onnx")), "--data", str(data)],
        "the data file holds no arrays": [str(model), "--data", str(tmp_path / "empty.npz")],
        "the data file holds no samples": [str(model), "--data", str(tmp_path / "none.npz")],
        "has shape 4x3x5x5, the model takes ?x3x6x6": [str(model), "--data", str(tmp_path / "wrong.npz")],
        "no array for input 'x' (arrays: images; accepted: 'x' or 'X')": [
            str(model),
            "--data",
            str(tmp_path / "other.npz"),
        ],
        "not a readable .npz file": [str(model), "--data", str(tmp_path / "junk.npz")],
        "--batch-size 0: must be >= 1": [str(model), "--data", str(data), "--batch-size", "0"],
    }
    for message, args in cases.items():
        assert main(["recalibrate", *args, "-o", out]) == 2, message
        err = capsys.readouterr().err
        assert err.startswith("bnfuse recalibrate: error: ") and message in err, (message, err)
        assert err.count("\n") == 1 and "Traceback" not in err
        assert not Path(out).exists()
    before = digest(model)
    assert main(["recalibrate", str(model), "--data", str(data), "-o", str(model)]) == 2
    assert "refusing to overwrite the input model" in capsys.readouterr().err and digest(model) == before
    with pytest.raises(SystemExit) as exited:  # allow_abbrev=False: no prefix of --batch-size
        main(["recalibrate", str(model), "--data", str(data), "-o", out, "--batch", "8"])
    assert exited.value.code == 2


def test_progress_bar_on_a_terminal(tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch) -> None:  # noqa: ANN001
    """On a terminal, one line redrawn per batch of every pass (exact: 3 stages x 4 batches), then cleared."""
    model, data = write_model(tmp_path / "m.onnx"), write_data(tmp_path / "d.npz")
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    args = ["recalibrate", str(model), "--data", str(data), "-o", str(tmp_path / "o.onnx"), "--batch-size", "16"]
    assert main([*args, "--mode", "exact"]) == 0
    err = capsys.readouterr().err
    assert [f"{k}/12 batches" in err for k in range(1, 13)] == [True] * 12
    assert err.startswith("\rrecalibrating [") and err.endswith("\r") and "\n" not in err
