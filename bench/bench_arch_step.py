"""Interleaved step-time A/B on real torchvision / timm architectures: bnfuse's default training graph, the same
graph with its Conv input gradients as the standard-ONNX rules (ConvTranspose / flipped-weight Conv, as before
bnfuse.ConvInputGrad), and PyTorch, in blocks of steps in a seeded random order per round.

    nice -n 10 python bench/bench_arch_step.py [--models resnet18,resnet50] [--threads 1,2] [--rounds 9] [--block 5]

Batch 4, 64x64 images, SGD lr 0.05, as bench/train_architectures.py. PyTorch runs in its own process
(bench_step_vs_torch.TorchWorker's reason: bnfuse's OpenMP runtimes in-process slow it), so it is timed where bnfuse
never ran. Per contender: the median per-step time over rounds, the median of the per-round ratios to PyTorch and
the fastest block; with the load the rest of the machine put on the cores meanwhile (LoadMeter). PyTorch's CPU step
time on this shared machine is bimodal from run to run: compare the best blocks too.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench import archs  # noqa: E402
from bench.bench_step_vs_torch import LoadMeter, blocks  # noqa: E402

LR = 0.05

_TORCH_WORKER = """
import sys, time
sys.path.insert(0, {root!r})
import numpy as np, torch
from bench import archs
torch.set_num_threads({threads})
data = np.load({data!r})
x, y = torch.from_numpy(data["x"]), torch.from_numpy(data["y"])
net = archs.create({name!r}).train()
opt = torch.optim.SGD(net.parameters(), lr={lr})
def step():
    opt.zero_grad()
    torch.nn.functional.cross_entropy(net(x), y).backward()
    opt.step()
step()
print("ready", flush=True)
for line in sys.stdin:
    count = int(line)
    step()  # untimed lead-in, as blocks() runs before every in-process block
    start = time.perf_counter()
    for _ in range(count):
        step()
    print((time.perf_counter() - start) / count, flush=True)
"""


class ArchTorchWorker:
    """PyTorch's step on one architecture in its own process, a block at a time on request."""

    def __init__(self, name: str, data: Path, threads: int) -> None:
        script = _TORCH_WORKER.format(root=str(ROOT), threads=threads, data=str(data), name=name, lr=LR)
        env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
        self._process = subprocess.Popen(
            [sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env
        )
        if self._process.stdout.readline().strip() != "ready":  # type: ignore[union-attr]
            raise RuntimeError("the PyTorch worker did not start")
        self.pid = self._process.pid

    def block(self, count: int) -> float:
        self._process.stdin.write(f"{count}\n")  # type: ignore[union-attr]
        self._process.stdin.flush()  # type: ignore[union-attr]
        return float(self._process.stdout.readline())  # type: ignore[union-attr]

    def close(self) -> None:
        self._process.stdin.close()  # type: ignore[union-attr]
        self._process.wait(timeout=60)


@contextlib.contextmanager
def _graph_rule_input_grads() -> Iterator[None]:
    """Build with the Conv input gradients as the standard-ONNX rules (no bnfuse.ConvInputGrad)."""
    from bnfuse.passes.training import fast_rules

    real = fast_rules._input_grad_node
    fast_rules._input_grad_node = lambda *args: None
    try:
        yield
    finally:
        fast_rules._input_grad_node = real


def run_case(
    name: str, threads_list: list[int], rounds: int, block: int, workdir: Path, graph_rules: bool = True
) -> list[dict]:
    from bnfuse.passes.training import build_training_graph
    from bnfuse.runtime import session_options
    from bnfuse.training.session import TrainingSession

    shape = (4, 3, 64, 64)
    model = archs.export(archs.create(name), shape)
    x, y = archs.batches(shape, 10, 1)[0]
    data = workdir / f"{name}.npz"
    np.savez(data, x=x, y=y)
    graphs = {"bnfuse": build_training_graph(model, batch_size=4)[0]}
    if graph_rules:
        with _graph_rule_input_grads():
            graphs["bnfuse, dX graph rules"] = build_training_graph(model, batch_size=4)[0]
    counts = {label: sum(n.op_type == "ConvInputGrad" for n in g.graph.node) for label, g in graphs.items()}
    cases = []
    for threads in threads_list:  # the graphs are built once; each thread count gets fresh sessions
        sessions = {}
        for label, graph in graphs.items():
            options = session_options(["CPUExecutionProvider"], intra_op_num_threads=threads, log_severity_level=3)
            sessions[label] = TrainingSession(graph, lr=LR, session_options=options)
        fns = {label: (lambda s=s: s.step(x, y)) for label, s in sessions.items()}
        worker = ArchTorchWorker(name, data, threads)
        meter = LoadMeter((worker.pid,))
        meter.start()
        try:
            result = blocks(fns, rounds=rounds, block=block, baseline="PyTorch", timed_blocks={"PyTorch": worker.block})
            load = meter.stop()
        finally:
            worker.close()
        cases.append({"name": name, "threads": threads, "times": result, "load": load, "input_grad_nodes": counts})
        del sessions, fns
    return cases


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="resnet18,resnet50")
    parser.add_argument("--threads", default="1,2")
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--block", type=int, default=5)
    parser.add_argument("--no-graph-rules", action="store_true", help="time only bnfuse's default graph and PyTorch")
    args = parser.parse_args(argv)
    print("| model | threads | contender | median ms | ratio to PyTorch (median of rounds) | best block ms | load |")
    print("|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        threads_list = [int(t) for t in args.threads.split(",")]
        names = args.models.split(",") if args.models != "all" else list(archs.ALL)
        for name in names:
            for case in run_case(name, threads_list, args.rounds, args.block, Path(tmp), not args.no_graph_rules):
                threads = case["threads"]
                for label, times in case["times"].items():
                    print(
                        f"| {name} | {threads} | {label} | {1e3 * times['median']:.1f} | {times['ratio']:.2f}x | "
                        f"{1e3 * times['best']:.1f} | {case['load']:.2f} |",
                        flush=True,
                    )
                print(f"<!-- ConvInputGrad nodes: {case['input_grad_nodes']} -->", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
