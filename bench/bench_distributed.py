"""Data-parallel training: MPI collective latency and bandwidth, per-step communication of ResNet-50, and the
step time of 2 ranks against 1 on this machine.

* collectives: ``mpiexec -n 2`` on localhost (MPICH from pip), medians of MPI_Allreduce over float32 buffers
  from 64 values to 25.6 M (ResNet-50's gradient), MPI_Allgather of one BN layer's 2C+1 float64 statistics, and
  bnfuse's AllReduceSum custom op inside an onnxruntime session (the op's own cost on top of MPI's);
* volume: counted on ResNet-50's distributed training graph (``distribute_training_graph``), collective node
  by collective node;
* step: a small ResNet's distributed step, global batch fixed: 2 ranks x B samples (each rank's onnxruntime
  threads left to TrainingSession's default: its share of the cores) against 1 process x 2B with every core (the
  distributed graph over MPI_COMM_SELF, and the plain graph: the cost of synchronization itself), alternated
  round by round in one ``mpiexec -n 2`` launch; samples per second, and the share of the 2-rank step spent
  inside collectives (timed around every collective call the ops make, waiting for the other rank included).

Run: ``python -m bench.bench_distributed`` (``--quick`` for a smoke run). Ranks run this module with
``--worker collectives|step``.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.common import Section, machine_description, markdown_table, today  # noqa: E402
from bench.common import main as bench_main  # noqa: E402

SIZES = (64, 1024, 16_384, 262_144, 4_194_304, 25_557_032)


def _mpiexec() -> str:
    beside = Path(sys.executable).with_name("mpiexec")
    return str(beside) if beside.exists() else (shutil.which("mpiexec") or "mpiexec")


def _launch(ranks: int, *args: str) -> dict[str, Any]:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    command = [_mpiexec(), "-n", str(ranks), sys.executable, "-m", "bench.bench_distributed", *args]
    result = subprocess.run(command, capture_output=True, text=True, timeout=900, env=env, cwd=ROOT)
    if result.returncode:
        raise RuntimeError(f"{' '.join(command)} failed: {result.stderr[-2000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def _median_loop(fn: Any, repeat: int) -> tuple[float, float]:
    """(median, 10th percentile) of ``fn()``'s time, ranks lined up by a barrier before each call; the slowest
    rank's figures (a collective is as slow as its last rank)."""
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    samples = []
    for _ in range(repeat):
        comm.Barrier()
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    mine = (float(np.median(samples)), float(np.percentile(samples, 10)))
    every = comm.allgather(mine)
    return max(m for m, _ in every), max(p for _, p in every)


def worker_collectives(quick: bool) -> dict[str, Any]:
    import onnxruntime as ort
    from mpi4py import MPI

    from bnfuse.runtime import collectives, session_options, sync_ops

    comm = MPI.COMM_WORLD
    out: dict[str, Any] = {"allreduce": [], "allgather": [], "op": []}
    for size in SIZES[:4] if quick else SIZES:
        buf = np.ones(size, np.float32)
        repeat = 200 if size <= 262_144 else 7
        seconds = _median_loop(lambda buf=buf: comm.Allreduce(MPI.IN_PLACE, buf, op=MPI.SUM), repeat)
        out["allreduce"].append((size, seconds))
    for channels in (64, 2048):
        send = np.ones(2 * channels + 1)
        recv = np.empty((comm.size, send.size))
        out["allgather"].append((channels, _median_loop(lambda s=send, r=recv: comm.Allgather(s, r), 200)))
    collectives.install(collectives.MpiCommunicator(comm))
    model = sync_ops.sync_op_model(sync_ops.ALL_REDUCE)
    providers = ["CPUExecutionProvider"]
    session = ort.InferenceSession(model.SerializeToString(), session_options(providers), providers=providers)
    token = np.zeros(1, np.int64)
    for size in (64, 262_144):
        x = np.ones(size, np.float32)
        for _ in range(20):
            session.run(None, {"X": x, "token": token})
        seconds = _median_loop(lambda x=x: session.run(None, {"X": x, "token": token}), 200)
        out["op"].append((size, seconds))
    return out


def _step_graph(batch: int, distributed: bool) -> Any:
    from bnfuse.models import registry
    from bnfuse.passes.training import build_training_graph
    from bnfuse.passes.training.distribute import distribute_training_graph

    model = registry.build("resnet18", size=32, width=0.25, seed=0)
    train, _ = build_training_graph(model, loss="cross-entropy", optimizer="sgd", batch_size=batch)
    return distribute_training_graph(train)[0] if distributed else train


class _TimedCommunicator:
    """The communicator the collective ops call, timed: seconds spent in allgather / allreduce_sum (a collective
    returns when every rank has arrived, so waiting for a slower rank counts too)."""

    def __init__(self, inner: Any) -> None:
        self.inner, self.rank, self.size, self.seconds, self.calls = inner, inner.rank, inner.size, 0.0, 0

    def allgather(self, array: Any, stream: int = 0) -> Any:
        start = time.perf_counter()
        try:
            return self.inner.allgather(array, stream)
        finally:
            self.seconds += time.perf_counter() - start
            self.calls += 1

    def allreduce_sum(self, array: Any, stream: int = 0) -> None:
        start = time.perf_counter()
        try:
            self.inner.allreduce_sum(array, stream)
        finally:
            self.seconds += time.perf_counter() - start
            self.calls += 1

    def broadcast(self, array: np.ndarray) -> None:
        self.inner.broadcast(array)

    def abort(self, code: int = 1) -> None:
        self.inner.abort(code)


def worker_step(quick: bool, batch: int) -> dict[str, Any]:
    """Under ``mpiexec -n 2``: rounds of (both ranks: one distributed step of ``batch`` each) and (rank 0 alone,
    rank 1 idle: one step of the distributed graph on 2 x ``batch`` over MPI_COMM_SELF, one of the plain graph),
    so every contender sees the same machine noise. onnxruntime's threads: rank 0 alone uses every core; the 2
    ranks take TrainingSession's default under mpiexec (each its share of the machine's cores)."""
    from mpi4py import MPI

    from bnfuse.runtime import collectives, session_options
    from bnfuse.training import TrainingSession

    comm = MPI.COMM_WORLD
    cores = os.cpu_count() or 1

    def session(graph: Any, threads: int | None, over: Any) -> Any:
        options = session_options(["CPUExecutionProvider"])
        return TrainingSession(graph, lr=0.01, comm=over, session_options=options, intra_op_threads=threads)

    alone: dict[str, Any] = {}
    if comm.rank == 0:
        alone["plain"] = session(_step_graph(2 * batch, False), cores, None)
        alone["one"] = session(_step_graph(2 * batch, True), cores, MPI.COMM_SELF)
    two = session(_step_graph(batch, True), None, comm)  # the default thread share
    timed = _TimedCommunicator(two.comm)
    rng = np.random.default_rng(comm.rank)
    data = {
        n: (rng.standard_normal((n, 3, 32, 32)).astype(np.float32), rng.integers(0, 10, n)) for n in (batch, 2 * batch)
    }

    def run(contender: Any, n: int) -> float:
        if contender.comm is not None:
            collectives.install(timed if contender is two else contender.comm)
        start = time.perf_counter()
        contender.step(*data[n])
        return time.perf_counter() - start

    def idle_until_rank0_is_done() -> None:  # a polite wait: MPI's blocking barrier would spin on a core
        request = comm.Ibarrier()
        while not request.Test():
            time.sleep(0.002)

    times: dict[str, list[float]] = {"plain": [], "one": [], "two": []}
    shares: list[float] = []  # per round: the larger of the two ranks' shares of their step in collectives
    rounds = 3 if quick else 15
    alone_times: dict[str, float] = {}
    for index in range(rounds + 2):  # the first two rounds warm up
        comm.Barrier()
        timed.seconds = 0.0
        mine = run(two, batch)
        step = max(comm.allgather(mine))
        share = max(comm.allgather(timed.seconds / mine))
        if comm.rank == 0:  # order reversed every other round: neither runs always first
            order = list(alone.items())[:: 1 if index % 2 else -1]
            alone_times = {name: run(contender, 2 * batch) for name, contender in order}
        idle_until_rank0_is_done()
        if index >= 2:
            times["two"].append(step)
            shares.append(share)
            for name, seconds in alone_times.items():
                times[name].append(seconds)
    result = {name: float(np.median(values)) if values else 0.0 for name, values in times.items()}
    return result | {
        "rounds": rounds,
        "collective_share": float(np.median(shares)),
        "collective_calls": timed.calls // (rounds + 2),
        "threads_note": two.threads_note,
        "threads": two._session.get_session_options().intra_op_num_threads,
        "cores": cores,
    }


def communication_volume() -> dict[str, Any]:
    """Elements and bytes each rank sends per step, by kind, counted on ResNet-50's distributed graph."""
    from bnfuse.models import registry
    from bnfuse.passes.training import build_training_graph
    from bnfuse.passes.training.distribute import distribute_training_graph
    from bnfuse.runtime.sync_ops import ALL_REDUCE, SYNC_GRAD, SYNC_TRAINING

    model = registry.build("resnet50", size=32, seed=0)
    train, _ = build_training_graph(model, loss="cross-entropy", batch_size=1)
    dist, report = distribute_training_graph(train)
    sizes = {t.name: int(np.prod(t.dims)) for t in dist.graph.initializer}
    forward, backward = "BN forward (all-gather, float64)", "BN backward (all-reduce, float64)"
    kinds = {forward: [0, 0], backward: [0, 0], "gradients (all-reduce, float32)": [0, 0]}
    kinds["loss and count (all-reduce)"] = [0, 0]
    for node in dist.graph.node:
        if node.op_type in (SYNC_TRAINING, SYNC_GRAD):
            channels = sizes[node.input[1 if node.op_type == SYNC_TRAINING else 2]]
            key = forward if node.op_type == SYNC_TRAINING else backward
            kinds[key][0] += 1
            kinds[key][1] += 2 * channels + 1
        elif node.op_type == ALL_REDUCE:
            bucket = node.output[0] == "dist/grads"  # every gradient, concatenated
            key = "gradients (all-reduce, float32)" if bucket else "loss and count (all-reduce)"
            kinds[key][0] += 1
            kinds[key][1] += report.gradient_values if bucket else 1
    return kinds


def run(quick: bool = False) -> Section:
    machine = machine_description()
    coll = _launch(2, "--worker", "collectives", *(["--quick"] if quick else []))
    volume = communication_volume()
    batch = 8 if quick else 16
    steps = _launch(2, "--worker", "step", "--batch", str(batch), *(["--quick"] if quick else []))
    one_plain, one, two = ({"step": steps[n]} for n in ("plain", "one", "two"))

    rows = [
        [f"{n:,}", f"{n * 4 / 1e6:.3g}", f"{s * 1e6:.1f}", f"{p * 1e6:.1f}", f"{n * 4 / p / 1e9:.2f}"]
        for n, (s, p) in coll["allreduce"]
    ]
    header = ["float32 values", "MB", "MPI_Allreduce µs (median)", "µs (10th pct.)", "GB/s (buffer / 10th pct.)"]
    table_ar = markdown_table(header, rows)
    rows = [[c, 2 * c + 1, f"{s * 1e6:.1f}", f"{p * 1e6:.1f}"] for c, (s, p) in coll["allgather"]]
    table_ag = markdown_table(["channels C", "float64 values (2C+1)", "MPI_Allgather µs (median)", "10th pct."], rows)
    rows = [[f"{n:,}", f"{s * 1e6:.1f}", f"{p * 1e6:.1f}"] for n, (s, p) in coll["op"]]
    table_op = markdown_table(["float32 values", "AllReduceSum op in session.run µs (median)", "10th pct."], rows)
    rows = []
    for kind, (count, elements) in volume.items():
        width = 8 if "float64" in kind else 4
        rows.append([kind, count, f"{elements:,}", f"{elements * width / 1e6:.3f}"])
    table_vol = markdown_table(["collective", "nodes", "values per rank", "MB per rank (payload)"], rows)
    cores, threads = steps["cores"], steps["threads"]
    rows = []
    for label, ranks, per_rank, step, threads_each in [
        ("plain graph (no collectives)", 1, 2 * batch, one_plain["step"], cores),
        ("distributed graph", 1, 2 * batch, one["step"], cores),
        ("distributed graph", 2, batch, two["step"], threads),
    ]:
        rate = 2 * batch / step
        ratio = f"{step / one_plain['step']:.2f}"
        rows.append([label, f"{ranks} x {threads_each}", per_rank, f"{step * 1e3:.1f}", f"{rate:.1f}", ratio])
    rows[-1].append(f"{steps['collective_share'] * 100:.0f}% ({steps['collective_calls']} calls)")
    rows[0].append("")
    rows[1].append("")
    header = ["graph", "ranks x threads", "batch per rank", "step ms (median, slowest rank)", "samples/s", "/ plain"]
    header.append("share of the step in collectives (median, larger rank)")
    table_step = markdown_table(header, rows)
    rounds = steps["rounds"]
    markdown = "\n\n".join(
        [
            f"{machine}, {today()}. MPICH {_mpich_version()} from pip, 2 ranks on one machine (shared memory). "
            "Medians; every rank synchronized by a barrier before each timed call, the slowest rank reported. "
            "GPU / NCCL: not measured (no GPU here).",
            "Collective latency and bandwidth (2 ranks):",
            table_ar,
            table_ag,
            table_op,
            "Per-step communication of ResNet-50 (counted on its distributed training graph; payload each rank "
            "contributes; a ring all-reduce moves about 2 (p-1)/p times the payload per rank):",
            table_vol,
            "Step time, ResNet-18 (width 0.25, 32x32 inputs, SGD), global batch fixed: 1 process with every core "
            f"against 2 ranks with TrainingSession's default threads ({steps['threads_note']}); one launch of 2 "
            f"ranks, {rounds} rounds alternating the contenders (rank 1 idle while rank 0 runs alone), medians; "
            "time in collectives includes waiting for the other rank; the machine is shared with other work:",
            table_step,
        ]
    )
    return Section(
        title="Data-parallel training: collectives and step time (MPI, CPU)",
        command="python bench/bench_distributed.py",
        markdown=markdown,
        series={"collectives": coll, "volume": volume, "steps": steps},
    )


def _mpich_version() -> str:
    from mpi4py import MPI

    return MPI.Get_library_version().split("\n")[0].split(":")[-1].strip()


def _worker_main(argv: list[str]) -> None:
    import argparse

    parser = argparse.ArgumentParser()
    parser.add_argument("--worker", choices=("collectives", "step"))
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--batch", type=int, default=16)
    args = parser.parse_args(argv)
    from mpi4py import MPI

    if args.worker == "collectives":
        result = worker_collectives(args.quick)
    else:
        result = worker_step(args.quick, args.batch)
    if MPI.COMM_WORLD.rank == 0:
        print(json.dumps(result))


if __name__ == "__main__":
    if "--worker" in sys.argv:
        _worker_main(sys.argv[1:])
    else:
        bench_main(run, __doc__.splitlines()[0])
