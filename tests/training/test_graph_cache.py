"""`bnfuse train`'s training-graph cache beside the model: a second run with the same model and options starts from
the kept graph (same trained file, bit for bit), other options or model bytes build anew, and it can be turned off."""

from __future__ import annotations

from pathlib import Path

import onnx
import pytest
from onnx import numpy_helper

from bnfuse.cli import main
from bnfuse.training import graph_cache
from tests.loaders import ROOT, load_file

cli_tests = load_file(ROOT / "tests" / "test_cli_train.py", "bnfuse_test_cli_train_for_cache")


def _train(tmp_path: Path, capsys: pytest.CaptureFixture[str], *extra: str, output: str = "out.onnx") -> str:
    argv = ["train", str(tmp_path / "m.onnx"), "--data", str(tmp_path / "d.npz"), "-o", str(tmp_path / output)]
    assert main([*argv, "--batch-size", "4", *extra]) == 0
    return capsys.readouterr().out


@pytest.fixture
def files(tmp_path: Path) -> Path:
    cli_tests.write_conv_bn(tmp_path / "m.onnx")
    cli_tests.write_data(tmp_path / "d.npz")
    return tmp_path


def test_a_second_run_starts_from_the_kept_graph(files: Path, capsys: pytest.CaptureFixture[str]) -> None:
    first = _train(files, capsys, output="first.onnx")
    assert "training graph:" in first and "from" not in first.split("training graph")[1][:6]
    kept = list(graph_cache.directory(files / "m.onnx").glob("*.onnx"))
    assert len(kept) == 1
    second = _train(files, capsys, output="second.onnx")
    assert f"training graph from {graph_cache.directory(files / 'm.onnx')}" in second
    assert (files / "first.onnx").read_bytes() == (files / "second.onnx").read_bytes()


def test_other_options_or_model_bytes_build_anew(files: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _train(files, capsys)
    assert "training graph from" not in _train(files, capsys, "--sgd-momentum", "0.9")
    cli_tests.write_conv_bn(files / "m.onnx")  # the same bytes: still the kept graph
    assert "training graph from" in _train(files, capsys)
    model = files / "m.onnx"
    model.write_bytes(model.read_bytes() + b"")  # unchanged bytes, newer file: still kept
    assert "training graph from" in _train(files, capsys)
    changed = onnx.load(model)  # another model: one weight changed
    fc = next(t for t in changed.graph.initializer if t.name == "fc")
    fc.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(fc) + 1, "fc"))
    onnx.save(changed, model)
    out = _train(files, capsys)
    assert "training graph from" not in out
    assert len(list(graph_cache.directory(model).glob("*.onnx"))) == graph_cache.KEEP  # the oldest dropped


def test_a_broken_entry_is_built_anew(files: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _train(files, capsys)
    (entry,) = graph_cache.directory(files / "m.onnx").glob("*.onnx")
    entry.write_bytes(b"not a model")
    assert "training graph from" not in _train(files, capsys)
    assert "training graph from" in _train(files, capsys)  # rewritten by the run that rebuilt it


def test_it_can_be_turned_off(files: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    _train(files, capsys, "--no-graph-cache")
    assert not graph_cache.directory(files / "m.onnx").exists()
    monkeypatch.setenv(graph_cache.ENVIRONMENT, "0")
    _train(files, capsys)
    assert not graph_cache.directory(files / "m.onnx").exists()
