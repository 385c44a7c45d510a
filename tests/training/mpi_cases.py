"""What each rank runs under ``mpiexec`` for tests/training/test_distributed.py: ``python mpi_cases.py CASE OUTDIR``.

Each rank writes what it computed to OUTDIR/rank<R>.npz; the test compares it with one process.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

COUNTS = {"uneven": [3, 5, 8, 16], "empty_rank": [3, 0, 8, 16]}
CHANNELS = 4
# (shape of one sample, attributes): NCHW spatial; channels-last 3-D with PyTorch momentum and the unbiased
# running variance (both use the global count)
LAYOUTS = {
    "nchw": ((CHANNELS, 3, 5), {"momentum": 0.9}),
    "nhwc": ((6, CHANNELS), {"axis": -1, "momentum": 0.1, "momentum_convention": "pytorch", "unbiased_running_var": 1}),
}


def batch(seed: int, total: int, sample: tuple[int, ...], mean: float) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((total, *sample)) * 2.0 + mean).astype(np.float32)
    dy = rng.standard_normal((total, *sample)).astype(np.float32)
    return x, dy


def sync_bn(outdir: Path) -> None:
    import onnxruntime as ort

    from bnfuse.runtime import session_options, sync_ops
    from bnfuse.training import distributed

    comm = distributed.communicator()
    distributed.abort_on_error(comm)
    from bnfuse.runtime import collectives

    collectives.install(comm)
    results = {}
    providers = ["CPUExecutionProvider"]
    for layout, (sample, attrs) in LAYOUTS.items():
        forward = sync_ops.sync_op_model(sync_ops.SYNC_TRAINING, **attrs)
        grad_attrs = {k: v for k, v in attrs.items() if k == "axis"}
        backward = sync_ops.sync_op_model(sync_ops.SYNC_GRAD, **grad_attrs)
        fwd = ort.InferenceSession(forward.SerializeToString(), session_options(providers), providers=providers)
        bwd = ort.InferenceSession(backward.SerializeToString(), session_options(providers), providers=providers)
        for slices, counts in COUNTS.items():
            for mean in (0.0, 1000.0):
                key = f"{layout}/{slices}/{mean:g}"
                x, dy = batch(7, sum(counts), sample, mean)
                start = sum(counts[: comm.rank])
                mine = slice(start, start + counts[comm.rank])
                rng = np.random.default_rng(3)
                params = {
                    "scale": rng.uniform(0.5, 1.5, CHANNELS).astype(np.float32),
                    "B": rng.standard_normal(CHANNELS).astype(np.float32),
                    "input_mean": rng.standard_normal(CHANNELS).astype(np.float32),
                    "input_var": rng.uniform(0.5, 2.0, CHANNELS).astype(np.float32),
                }
                token = np.array([0], np.int64)
                y, rm, rv, saved_mean, saved_inv_std, token = fwd.run(None, {"X": x[mine], **params, "token": token})
                feeds = {"dY": dy[mine], "X": x[mine], "scale": params["scale"], "token": token}
                dx, dscale, dbias, token = bwd.run(
                    None, {**feeds, "saved_mean": saved_mean, "saved_inv_std": saved_inv_std}
                )
                for name, value in {
                    "x": x[mine],
                    "dy": dy[mine],
                    "y": y,
                    "running_mean": rm,
                    "running_var": rv,
                    "saved_mean": saved_mean,
                    "saved_inv_std": saved_inv_std,
                    "dx": dx,
                    "dscale": dscale,
                    "dbias": dbias,
                    "token": token,
                    **params,
                }.items():
                    results[f"{key}/{name}"] = value
    np.savez(outdir / f"rank{comm.rank}.npz", **results)


def _user_comm(outdir: Path) -> Any:
    """The communicator a script holds: mpi4py's COMM_WORLD (outdir/comm says "mpi4py") or bnfuse's wrapper."""
    from mpi4py import MPI

    from bnfuse.training import distributed

    chosen = (outdir / "comm").read_text() if (outdir / "comm").exists() else "bnfuse"
    return MPI.COMM_WORLD if chosen == "mpi4py" else distributed.communicator()


def matrix(outdir: Path) -> None:
    """Every graph named in outdir/matrix.json, trained for its steps (the communicator given as mpi4py's
    COMM_WORLD): at step s rank r takes its contiguous share (the plan's counts[s][r] samples, maybe none) of the
    step's global batch in outdir/matrix_data.npz; final state and losses saved."""
    from mpi4py import MPI

    from bnfuse.io import load_model
    from bnfuse.training import TrainingSession, distributed

    comm = MPI.COMM_WORLD
    distributed.abort_on_error(comm)
    plan = json.loads((outdir / "matrix.json").read_text())
    data = np.load(outdir / "matrix_data.npz")
    results: dict[str, np.ndarray] = {}
    for name, (inputs, labels, counts, lr) in plan["cases"].items():
        session = TrainingSession(load_model(outdir / f"{name}.onnx", check=False), lr=lr, comm=comm)
        losses = []
        for step, shares in enumerate(counts):
            start = sum(shares[: comm.rank])
            mine = slice(start, start + shares[comm.rank])
            losses.append(session.step(data[f"{inputs}/{step}"][mine], data[f"{labels}/{step}"][mine]))
        results[f"{name}/losses"] = np.array(losses)
        results[f"{name}/threads"] = np.array(session._session.get_session_options().intra_op_num_threads)
        for key, value in session.state().items():
            results[f"{name}/{key}"] = value
    np.savez(outdir / f"rank{comm.rank}.npz", **results)


def raising_rank(outdir: Path) -> None:
    """Every rank enters a distributed step except rank 1, which raises: the job must end with its error."""
    from bnfuse.io import load_model
    from bnfuse.training import TrainingSession, distributed

    comm = _user_comm(outdir)
    distributed.abort_on_error(comm)
    session = TrainingSession(load_model(outdir / "train.onnx", check=False), comm=comm)
    x, labels = np.load(outdir / "data.npz")["x"], np.load(outdir / "data.npz")["labels"]
    size = session.batch_size
    if comm.rank == 1:
        (outdir / "raised_at").write_text(repr(time.time()))
        raise RuntimeError("rank 1 fails on purpose")
    session.step(x[:size], labels[:size])


def silent_rank(outdir: Path) -> None:
    """Rank 1 stops answering (sleeps): the others' watchdog (2 s) must end the job."""
    from bnfuse.io import load_model
    from bnfuse.training import TrainingSession, distributed

    comm = distributed.communicator()
    session = TrainingSession(load_model(outdir / "train.onnx", check=False), comm=comm, watchdog_s=2.0)
    data = np.load(outdir / "data.npz")
    size = session.batch_size
    if comm.rank == 1:
        (outdir / "raised_at").write_text(repr(time.time()))
        time.sleep(120)
    session.step(data["x"][:size], data["labels"][:size])


def mismatched_graph(outdir: Path) -> None:
    """Rank 1 loads another training graph: every rank must refuse to start."""
    from bnfuse.io import load_model
    from bnfuse.training import TrainingSession, distributed

    comm = _user_comm(outdir)
    distributed.abort_on_error(comm)
    rank = distributed.communicator(comm).rank
    model = load_model(outdir / ("other.onnx" if rank == 1 else "train.onnx"), check=False)
    (outdir / f"starting{rank}").write_text(repr(time.time()))
    TrainingSession(model, comm=comm)
    (outdir / f"started{rank}").write_text("started")


CASES = {f.__name__: f for f in (sync_bn, matrix, raising_rank, silent_rank, mismatched_graph)}

if __name__ == "__main__":
    CASES[sys.argv[1]](Path(sys.argv[2]))
