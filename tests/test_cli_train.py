"""`bnfuse train-graph` and `bnfuse train`: files written, one-line errors (exit 2), trained model folds."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from bnfuse.cli import main
from bnfuse.passes.training import read_spec


def write_conv_bn(path: Path) -> Path:
    rng = np.random.default_rng(0)
    inits = [
        numpy_helper.from_array(rng.normal(0, 0.5, (4, 3, 3, 3)).astype(np.float32), "w"),
        numpy_helper.from_array(np.full(4, 1.5, np.float32), "s"),
        numpy_helper.from_array(np.full(4, 0.1, np.float32), "b"),
        numpy_helper.from_array(np.full(4, 0.2, np.float32), "m"),
        numpy_helper.from_array(np.array([2, 1, 1, 1], np.float32), "v"),
        numpy_helper.from_array(rng.normal(0, 0.5, (4, 3)).astype(np.float32), "fc"),
    ]
    graph = helper.make_graph(
        [
            helper.make_node("Conv", ["x", "w"], ["c"], name="conv", pads=[1, 1, 1, 1]),
            helper.make_node("BatchNormalization", ["c", "s", "b", "m", "v"], ["n"], name="bn"),
            helper.make_node("Relu", ["n"], ["r"]),
            helper.make_node("GlobalAveragePool", ["r"], ["p"]),
            helper.make_node("Flatten", ["p"], ["f"]),
            helper.make_node("MatMul", ["f", "fc"], ["y"]),
        ],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 3, 6, 6])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 3])],
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    onnx.save(model, path)
    return path


@pytest.mark.parametrize("portable", [False, True])
def test_train_graph_then_train_then_fold(tmp_path: Path, capsys: pytest.CaptureFixture[str], portable: bool) -> None:
    source = write_conv_bn(tmp_path / "m.onnx")
    train = tmp_path / "train.onnx"
    argv = ["train-graph", str(source), "-o", str(train), "--batch-size", "4", "--sgd-momentum", "0.9"]
    assert main(argv + (["--portable"] if portable else [])) == 0
    out = capsys.readouterr().out
    assert "training graph:" in out and f"wrote {train}" in out
    spec = read_spec(onnx.load(train))
    assert spec.parameters == ["w", "s", "b", "fc"] and spec.running_stats == ["m", "v"]

    rng = np.random.default_rng(1)
    data = tmp_path / "data.npz"
    np.savez(data, x=rng.standard_normal((10, 3, 6, 6)).astype(np.float32), labels=rng.integers(0, 3, 10))
    trained = tmp_path / "trained.onnx"
    assert (
        main(["train", str(train), "--data", str(data), "-o", str(trained), "--epochs", "2", "--lr", "0.1", "--fold"])
        == 0
    )
    out = capsys.readouterr().out
    assert "epoch 2/2: mean loss" in out and "2 steps" in out
    model = onnx.load(trained)
    assert not any(n.op_type == "BatchNormalization" for n in model.graph.node)
    x = rng.standard_normal((2, 3, 6, 6)).astype(np.float32)  # dynamic batch is back in the exported model
    y = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    assert y.shape == (2, 3) and np.all(np.isfinite(y))


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["train-graph", "{m}", "-o", "{t}"], "dynamic dimension"),
        (
            ["train-graph", "{m}", "-o", "{t}", "--batch-size", "2", "--momentum-convention", "keras"],
            "momentum convention",
        ),
        (["train-graph", "{missing}", "-o", "{t}"], "no such file"),
        (["train-graph", "{m}", "-o", "{m}", "--batch-size", "2"], "refusing to overwrite"),
        (["train", "{m}", "--data", "{missing}", "-o", "{t}"], "not a bnfuse training graph"),
    ],
)
def test_errors_are_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str], message: str) -> None:
    names = {"m": write_conv_bn(tmp_path / "m.onnx"), "t": tmp_path / "t.onnx", "missing": tmp_path / "missing.onnx"}
    assert main([a.format(**names) for a in argv]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1
    assert not (tmp_path / "t.onnx").exists()


def test_train_rejects_bad_data(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    source = write_conv_bn(tmp_path / "m.onnx")
    train = tmp_path / "train.onnx"
    assert main(["train-graph", str(source), "-o", str(train), "--batch-size", "4"]) == 0
    data = tmp_path / "d.npz"
    np.savez(data, images=np.zeros((8, 3, 6, 6), np.float32))
    assert main(["train", str(train), "--data", str(data), "-o", str(tmp_path / "o.onnx")]) == 2
    assert "no array 'x'" in capsys.readouterr().err
