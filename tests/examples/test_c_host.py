"""examples/c_host: a C program trains a bnfuse training graph through onnxruntime's C API, without Python.

Built here with `make` against the onnxruntime wheel's libonnxruntime.so (as a user would), run on scikit-learn's
digits, and compared step by step with `TrainingSession` on the same graph, data and order at 1 thread.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from bnfuse.models import write
from bnfuse.passes.training import SGD, build_training_graph
from bnfuse.runtime import conv_grad, library_path
from bnfuse.runtime.ortabi import api as ortabi_api
from bnfuse.training.session import TrainingSession

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "c_host"
EPOCHS, BATCH, LR = 2, 32, 0.05


def test_table_positions_are_onnxruntime_s():
    """Every index ort_table.h declares is that entry's position in the OrtApi table ortabi keeps."""
    header = (EXAMPLE / "ort_table.h").read_text()
    table = header.split("/* positions in the OrtApi table */")[1].split("};")[0]
    declared = dict(re.findall(r"ORT_(\w+) = (\d+),", table))
    positions = {name: index for index, name in enumerate(ortabi_api._API_ENTRIES)}
    assert len(declared) >= 30
    for name, index in declared.items():
        assert positions[name] == int(index), name


@pytest.fixture(scope="module")
def program(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """train_c built by the example's Makefile, in a copy of the example folder."""
    if shutil.which("cc") is None:
        pytest.fail("no C compiler (cc): the C host example is built in CI")
    folder = tmp_path_factory.mktemp("c_host")
    for source in EXAMPLE.iterdir():
        if source.suffix in (".c", ".h") or source.name == "Makefile":
            shutil.copy(source, folder / source.name)
    build = subprocess.run(
        ["make", f"PYTHON={sys.executable}", "CFLAGS=-O2 -std=c11 -Wall -Wextra -Werror"],
        cwd=folder,
        capture_output=True,
        text=True,
    )
    assert build.returncode == 0, build.stdout + build.stderr
    return folder / "train_c"


@pytest.fixture(scope="module")
def digits(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, np.ndarray, np.ndarray]:
    from sklearn.datasets import load_digits

    data = load_digits()
    x = (data.images / 16).astype(np.float32)[:, None]
    labels = data.target.astype(np.int64)
    path = tmp_path_factory.mktemp("data") / "digits.npz"
    np.savez(path, x=x, labels=labels)
    return path, x, labels


def _train_graph(folder: Path, **options: object) -> Path:
    model_path = folder / "cnn.onnx"
    write("digits_cnn", model_path)
    graph, _ = build_training_graph(str(model_path), optimizer=SGD(momentum=0.9), batch_size=BATCH, **options)
    path = folder / "train.onnx"
    path.write_bytes(graph.SerializeToString())
    return path


def _session_losses(graph: Path, x: np.ndarray, labels: np.ndarray, **options: object) -> np.ndarray:
    session_options = ort.SessionOptions()
    session_options.intra_op_num_threads = 1
    session = TrainingSession(str(graph), lr=LR, session_options=session_options, **options)
    losses = [
        session.step(x[start : start + BATCH], labels[start : start + BATCH])
        for _ in range(EPOCHS)
        for start in range(0, len(x), BATCH)
    ]
    return np.array(losses, np.float32)


def _c_losses(program: Path, graph: Path, data: Path, *extra: str) -> tuple[np.ndarray, list[float]]:
    command = [str(program), str(graph), str(data), "--epochs", str(EPOCHS), "--batch-size", str(BATCH)]
    run = subprocess.run(
        [*command, "--lr", str(LR), "--threads", "1", "--steps", *extra], capture_output=True, text=True
    )
    assert run.returncode == 0, run.stderr
    steps = [np.float32(line.split()[3]) for line in run.stdout.splitlines() if line.startswith("step ")]
    accuracy = [float(line.split()[5]) for line in run.stdout.splitlines() if line.startswith("epoch ")]
    return np.array(steps, np.float32), accuracy


def test_portable_graph_trains_like_training_session(program, digits, tmp_path):
    data, x, labels = digits
    graph = _train_graph(tmp_path, portable=True)
    c_losses, accuracy = _c_losses(program, graph, data)
    steps = EPOCHS * -(-len(x) // BATCH)
    assert len(c_losses) == steps and len(accuracy) == EPOCHS
    # the same graph, data, order and thread count: the same bits (NCHWc off: the graph as written)
    np.testing.assert_array_equal(c_losses, _session_losses(graph, x, labels, nchwc=False))
    # TrainingSession's default runs the 2-D convolutions as NCHWc kernels: float32 rounding apart
    np.testing.assert_allclose(c_losses, _session_losses(graph, x, labels), rtol=2e-5, atol=1e-6)
    assert c_losses[-1] < c_losses[0] / 4 and accuracy[-1] > 0.9  # it learns


def test_custom_op_graph_trains_like_training_session(program, digits, tmp_path, monkeypatch):
    """The default graph (bnfuse's BN, conv-gradient and SGD ops) through the native library file alone."""
    data, x, labels = digits
    graph = _train_graph(tmp_path)
    domains = {node.domain for node in onnx.load(graph).graph.node}
    assert "bnfuse" in domains
    if conv_grad.available():  # the library finds oneDNN itself; named here since an editable install is elsewhere
        monkeypatch.setenv("BNFUSE_ONEDNN_LIBRARY", str(conv_grad.library_path()))
    c_losses, accuracy = _c_losses(program, graph, data, "--library", library_path())
    np.testing.assert_array_equal(c_losses, _session_losses(graph, x, labels, nchwc=False))
    np.testing.assert_allclose(c_losses, _session_losses(graph, x, labels), rtol=2e-5, atol=1e-6)
    assert accuracy[-1] > 0.9


def test_bad_data_file_is_one_line(program, tmp_path, digits):
    graph = _train_graph(tmp_path, portable=True)
    np.savez_compressed(tmp_path / "compressed.npz", x=np.zeros((4, 1, 8, 8), np.float32), labels=np.zeros(4))
    run = subprocess.run([str(program), str(graph), str(tmp_path / "compressed.npz")], capture_output=True, text=True)
    assert run.returncode == 2
    assert run.stderr.strip().count("\n") == 0 and "numpy.savez" in run.stderr
