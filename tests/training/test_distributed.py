"""Data-parallel training under real ``mpiexec`` on localhost (MPICH from the test extra), each launch time-limited.

Ranks run tests/training/mpi_cases.py (or the CLI) and write what they computed; the comparisons against one
process on the whole batch happen here.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import onnx
import pytest

from bnfuse.io import save_model
from bnfuse.models import registry
from bnfuse.passes.training import SGD, build_training_graph, read_spec
from bnfuse.passes.training.distribute import collective_schedule, distribute_training_graph
from bnfuse.runtime import reference
from bnfuse.runtime.semantics import BatchNormConfig
from bnfuse.runtime.sync_ops import SYNC_GRAD, SYNC_TRAINING
from bnfuse.training import TrainingSession

pytest.importorskip("mpi4py", reason="the distributed tests need mpi4py + an MPI (pip install -e '.[test]')")
CASES = Path(__file__).with_name("mpi_cases.py")
LIMIT_S = 240  # 2 shared cores: several ranks each import onnxruntime and numba


def _mpiexec() -> str:
    beside = Path(sys.executable).with_name("mpiexec")
    found = str(beside) if beside.exists() else shutil.which("mpiexec")
    if found is None:
        pytest.fail("mpiexec not found (pip install mpich gives one next to the interpreter)")
    return found


def _launch(ranks: int, *command: str, timeout: float = LIMIT_S) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", NUMBA_NUM_THREADS="1")
    repo = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (repo, env.get("PYTHONPATH")) if p)
    return subprocess.run(
        [_mpiexec(), "-n", str(ranks), *command], capture_output=True, text=True, timeout=timeout, env=env
    )


def _case(ranks: int, case: str, outdir: Path, timeout: float = LIMIT_S) -> subprocess.CompletedProcess[str]:
    return _launch(ranks, sys.executable, str(CASES), case, str(outdir), timeout=timeout)


def _rel(actual: np.ndarray, expected: np.ndarray) -> float:
    scale = max(float(np.abs(expected).max()), 1e-30) if expected.size else 1.0
    return float(np.abs(actual.astype(np.float64) - expected).max() / scale) if expected.size else 0.0


def test_sync_bn_on_uneven_and_empty_ranks_matches_one_process(tmp_path: Path) -> None:
    """4 ranks with 3/5/8/16 and 3/0/8/16 samples, channel means 0 and 1000, NCHW and channels-last: forward,
    backward and running statistics equal float64 BN on the concatenated batch within 1e-6 (relative)."""
    result = _case(4, "sync_bn", tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    ranks = [dict(np.load(tmp_path / f"rank{r}.npz")) for r in range(4)]
    keys = sorted({k.rsplit("/", 1)[0] for k in ranks[0]})
    assert len(keys) == 8
    for key in keys:
        layout = key.split("/")[0]
        attrs = {"nchw": {"momentum": 0.9}, "nhwc": {"axis": -1, "momentum": 0.1}}[layout]
        config = BatchNormConfig(
            **attrs,
            momentum_convention="pytorch" if layout == "nhwc" else "onnx",
            unbiased_running_var=layout == "nhwc",
        )

        def whole(name: str, key: str = key) -> np.ndarray:
            return np.concatenate([r[f"{key}/{name}"] for r in ranks])

        first = ranks[0]
        params = [first[f"{key}/{n}"] for n in ("scale", "B", "input_mean", "input_var")]
        x, dy = whole("x"), whole("dy")
        expected = reference.forward_training(x.astype(np.float64), *(p.astype(np.float64) for p in params), config)
        assert _rel(whole("y"), expected.y) < 1e-6, key
        for name in ("running_mean", "running_var", "saved_mean", "saved_inv_std"):
            for r in ranks:  # identical on every rank, bit for bit
                np.testing.assert_array_equal(r[f"{key}/{name}"], first[f"{key}/{name}"])
            assert _rel(first[f"{key}/{name}"], getattr(expected, name)) < 1e-6, (key, name)
        # the backward reads the float32 saved statistics the forward wrote (as in a graph): the oracle gets them too
        saved = [first[f"{key}/{n}"].astype(np.float64) for n in ("saved_mean", "saved_inv_std")]
        grads = reference.backward(dy.astype(np.float64), x.astype(np.float64), params[0].astype(np.float64), *saved,
                                   config)  # fmt: skip
        assert _rel(whole("dx"), grads.dx) < 1e-6, key
        # dScale / dBias stay local: their sum over the ranks is the whole batch's
        assert _rel(sum(r[f"{key}/dscale"].astype(np.float64) for r in ranks), grads.dscale) < 1e-6, key
        assert _rel(sum(r[f"{key}/dbias"].astype(np.float64) for r in ranks), grads.dbias) < 1e-6, key
        if "empty_rank" in key:
            assert ranks[1][f"{key}/y"].shape[0] == 0 and not ranks[1][f"{key}/dbias"].any()
        assert all(int(r[f"{key}/token"][0]) == 2 for r in ranks)


def _small_training(tmp_path: Path, per_rank: int, ranks: int, seed: int = 0) -> tuple[onnx.ModelProto, Path]:
    """An MLP with BatchNorm1d, its data (per_rank * ranks samples) in data.npz, and its training graphs."""
    model = registry.build("mlp_gemm", size=16, width=0.125, seed=seed)
    rng = np.random.default_rng(seed)
    total = per_rank * ranks
    np.savez(tmp_path / "data.npz", x=rng.standard_normal((total, 16)).astype(np.float32) + 3.0,
             labels=rng.integers(0, 10, total))  # fmt: skip
    save_model(model, tmp_path / "model.onnx")
    return model, tmp_path / "data.npz"


def _distributed_graph(model: onnx.ModelProto, batch: int, **options: object) -> onnx.ModelProto:
    train, _ = build_training_graph(model, loss="cross-entropy", batch_size=batch, **options)
    return distribute_training_graph(train)[0]


@pytest.mark.parametrize("ranks", [1, 4])
def test_sgd_steps_on_ranks_match_one_process_on_the_whole_batch(tmp_path: Path, ranks: int) -> None:
    """`mpiexec -n N bnfuse train` on a distributed graph (4 samples per rank, 5 SGD steps with momentum) gives
    the parameters and running statistics of one process training on all samples at once within 1e-5."""
    per_rank, steps = 4, 5
    model, data = _small_training(tmp_path, per_rank, ranks)
    optimizer = SGD(momentum=0.9, weight_decay=1e-3)
    dist = _distributed_graph(model, per_rank, optimizer=optimizer)
    save_model(dist, tmp_path / "dist.onnx")
    args = ["train", str(tmp_path / "dist.onnx"), "--data", str(data), "-o", str(tmp_path / "out.onnx")]
    result = _launch(ranks, sys.executable, "-m", "bnfuse.cli", *args, "--epochs", str(steps), "--lr", "0.5")
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.count("epoch 5/5") == 1  # only rank 0 prints
    trained = onnx.load(tmp_path / "out.onnx")

    whole, _ = build_training_graph(model, loss="cross-entropy", batch_size=per_rank * ranks, optimizer=optimizer)
    session = TrainingSession(whole, lr=0.5)
    arrays = np.load(data)
    losses = [session.step(arrays["x"], arrays["labels"]) for _ in range(steps)]
    expected = session.export_inference_model()
    got = {t.name: onnx.numpy_helper.to_array(t) for t in trained.graph.initializer}
    compared = 0
    for tensor in expected.graph.initializer:
        want = onnx.numpy_helper.to_array(tensor)
        if want.dtype == np.float32:
            np.testing.assert_allclose(got[tensor.name], want, rtol=1e-5, atol=1e-5, err_msg=tensor.name)
            compared += 1
    assert compared >= 10 and abs(losses[0] - losses[-1]) > 1e-3  # it trained, and every weight was compared
    mean_loss = float(result.stdout.split("epoch 5/5: loss ")[-1].split()[0])
    assert mean_loss == pytest.approx(float(np.mean(losses[-1:])), rel=1e-4)  # the global loss, not rank 0's


def _write_failure_fixtures(tmp_path: Path) -> None:
    model, _ = _small_training(tmp_path, 4, 4)
    save_model(_distributed_graph(model, 4), tmp_path / "train.onnx")
    save_model(_distributed_graph(model, 4, optimizer="adam"), tmp_path / "other.onnx")


def test_a_raising_rank_ends_the_job_quickly_with_its_error(tmp_path: Path) -> None:
    _write_failure_fixtures(tmp_path)
    result = _case(4, "raising_rank", tmp_path)
    ended = time.time()
    assert result.returncode != 0
    assert "bnfuse: rank 1: error: rank 1 fails on purpose" in result.stderr
    assert ended - float((tmp_path / "raised_at").read_text()) < 10.0


def test_a_silent_rank_is_caught_by_the_watchdog(tmp_path: Path) -> None:
    _write_failure_fixtures(tmp_path)
    result = _case(3, "silent_rank", tmp_path)
    ended = time.time()
    assert result.returncode != 0
    assert "made no progress for 2 s" in result.stderr
    assert ended - float((tmp_path / "raised_at").read_text()) < 10.0


def test_a_mismatched_graph_is_refused_at_start_up(tmp_path: Path) -> None:
    _write_failure_fixtures(tmp_path)
    result = _case(2, "mismatched_graph", tmp_path)
    assert result.returncode != 0
    assert "rank(s) 1 have a different training graph" in result.stderr
    assert not list(tmp_path.glob("started*"))


def test_distributed_graph_on_one_process_equals_the_plain_graph() -> None:
    """Without a communicator the collectives are a world of one: same losses and state as the plain graph."""
    model = registry.build("mlp_gemm", size=16, width=0.125, seed=1)
    plain, _ = build_training_graph(model, loss="mse", batch_size=6, optimizer="adam", fuse_relu=True)
    dist, report = distribute_training_graph(plain)
    assert report.synced_batch_norms == report.synced_batch_norm_grads == 3
    # the plain graph fuses BN -> ReLU (fuse_relu); the synchronized ops have no activation: split off again
    fused = [n for n in plain.graph.node if any(a.name == "activation" for a in n.attribute)]
    assert len(fused) >= 2 and not any(any(a.name == "activation" for a in n.attribute) for n in dist.graph.node)
    unfused, _ = build_training_graph(model, loss="mse", batch_size=6, optimizer="adam", fuse_relu=False)
    dist_unfused, _ = distribute_training_graph(unfused)
    for op_type in ("Relu", "Greater", "Cast", "Mul", SYNC_TRAINING, SYNC_GRAD):
        assert sum(n.op_type == op_type for n in dist.graph.node) == sum(
            n.op_type == op_type for n in dist_unfused.graph.node
        ), op_type
    schedule = collective_schedule(dist)
    assert len(schedule) == report.collectives == 3 + 3 + 1 + 2  # BN forward, backward, gradients, count, loss
    parameters = read_spec(plain).parameters
    assert report.gradients == len(parameters)
    assert report.gradient_values == sum(int(np.prod(t.dims)) for t in plain.graph.initializer if t.name in parameters)
    a, b = TrainingSession(plain, lr=0.01), TrainingSession(dist, lr=0.01)
    rng = np.random.default_rng(0)
    labels_shape = [6, *[i for i in a._session.get_inputs() if i.name == "labels"][0].shape[1:]]
    for _ in range(3):
        x = rng.standard_normal((6, 16)).astype(np.float32)
        y = rng.standard_normal(labels_shape).astype(np.float32)
        assert b.step(x, y) == pytest.approx(a.step(x, y), rel=1e-6)
    for name, value in a.state().items():
        np.testing.assert_allclose(b.state()[name], value, rtol=1e-6, atol=1e-7, err_msg=name)


def test_collectives_are_chained_in_one_order() -> None:
    model = registry.build("mlp_gemm", size=16, width=0.125, seed=1)
    dist = _distributed_graph(model, 4)
    collective = [n for n in dist.graph.node if n.domain == "bnfuse" and n.input[-1].startswith("dist/token")]
    assert [n.name for n in collective] == collective_schedule(dist)
    for index, node in enumerate(collective):  # token i in, token i + 1 out: no two can reorder
        assert node.input[-1] == f"dist/token{index}" and node.output[-1] == f"dist/token{index + 1}"
