"""bnfuse's training step of two source trees side by side: this tree against another checkout (e.g. main's, to see
what a kernel change does to a whole step), interleaved block by block.

The bench ResNet (width 16, 32x3x32x32) and MLP (256-512-512-10, 256x256) of bench_step_vs_torch.py are exported
once to ONNX here; then for each network and thread count one worker process per tree (PYTHONPATH = the tree) builds
the training graph (SGD momentum 0.9) and a TrainingSession at that many intra-op threads, and runs blocks of steps
on request: each round runs one block on each worker in a seeded random order, one untimed step before each block.
The table gives each tree's median step time over rounds and the median of the per-round ratios (this / other).

    python bench/compare_trees_step.py --other /work/main [--rounds 15] [--block 4] [--threads 1,2]
    python bench/compare_trees_step.py --other /work/main --models resnet18,resnet50  # bench/archs.py's, 4x3x64x64
    python bench/compare_trees_step.py --other /work/main --models tinynet_a --arch-graph  # bench_arch_step's graph
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parents[1]
CASES = {"ResNet (width 16)": ("resnet", 16, (32, 3, 32, 32)), "MLP 256-512-512-10": ("mlp", 0, (256, 256))}

_WORKER = """
import sys, time
import numpy as np
import onnx
from bnfuse.passes.training import SGD, build_training_graph
from bnfuse.runtime import session_options
from bnfuse.training import TrainingSession

path, threads, shape = sys.argv[1], int(sys.argv[2]), tuple(int(v) for v in sys.argv[3].split("x"))
if sys.argv[4] == "arch":  # bench_arch_step.py's graph: its batch, the default optimizer (SGD), lr 0.05
    graph, _ = build_training_graph(onnx.load(path), batch_size=shape[0])
    lr = 0.05
else:
    graph, _ = build_training_graph(onnx.load(path), optimizer=SGD(momentum=0.9))
    lr = 0.01
options = session_options(["CPUExecutionProvider"], intra_op_num_threads=threads, log_severity_level=3)
session = TrainingSession(graph, lr=lr, session_options=options)
rng = np.random.default_rng(0)
x = rng.standard_normal(shape).astype(np.float32)
labels = rng.integers(0, 10, shape[0]).astype(np.int64)
session.step(x, labels)
print("ready", flush=True)
for line in sys.stdin:
    count = int(line)
    session.step(x, labels)  # untimed
    start = time.perf_counter()
    for _ in range(count):
        session.step(x, labels)
    print((time.perf_counter() - start) / count, flush=True)
"""


class Worker:
    def __init__(self, tree: str, model: str, threads: int, shape: tuple[int, ...], graph: str = "momentum") -> None:
        env = {**os.environ, "PYTHONPATH": tree, "OMP_NUM_THREADS": str(threads)}
        command = [sys.executable, "-c", _WORKER, model, str(threads), "x".join(map(str, shape)), graph]
        self.process = subprocess.Popen(
            command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env, cwd=tree
        )
        if self.process.stdout.readline().strip() != "ready":  # type: ignore[union-attr]
            raise RuntimeError(f"the worker of {tree} did not start")

    def block(self, count: int) -> float:
        self.process.stdin.write(f"{count}\n")  # type: ignore[union-attr]
        self.process.stdin.flush()  # type: ignore[union-attr]
        return float(self.process.stdout.readline())  # type: ignore[union-attr]

    def close(self) -> None:
        self.process.stdin.close()  # type: ignore[union-attr]
        self.process.wait(timeout=60)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--other", required=True, help="the other source tree (its PYTHONPATH)")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--block", type=int, default=4)
    parser.add_argument("--threads", default="1,2")
    parser.add_argument("--models", default="", help="bench/archs.py architectures instead of the two networks")
    parser.add_argument(
        "--arch-graph",
        action="store_true",
        help="the graph bench_arch_step.py times (static batch, plain SGD, lr 0.05) instead of SGD momentum 0.9",
    )
    args = parser.parse_args()
    sys.path.insert(0, str(HERE))
    import onnx

    from bench.bench_step_memory import _network
    from bench.bench_training import _export, _torch_nets

    torch, _, _ = _torch_nets()
    trees = {"this": str(HERE), "other": str(Path(args.other).resolve())}
    print(f"this: {trees['this']}, other: {trees['other']}; {args.rounds} rounds of {args.block}-step blocks")
    print("| network | threads | this ms | other ms | this / other |")
    print("|---|---|---:|---:|---:|")
    order = random.Random(0)
    with tempfile.TemporaryDirectory(prefix="bnfuse-bench-step-vs-tree-") as scratch:
        cases = {name: ("arch", 0, (4, 3, 64, 64)) for name in args.models.split(",") if name} or CASES
        for name, (kind, width, shape) in cases.items():
            torch.manual_seed(0)
            model = str(Path(scratch) / f"{name if kind == 'arch' else kind}.onnx")
            if kind == "arch":
                from bench import archs

                onnx.save(archs.export(archs.create(name), shape), model)
            else:
                onnx.save(_export(torch, _network(torch, kind, width), shape), model)
            for threads in (int(t) for t in args.threads.split(",")):
                graph = "arch" if args.arch_graph else "momentum"
                workers = {tree: Worker(path, model, threads, shape, graph) for tree, path in trees.items()}
                times: dict[str, list[float]] = {"this": [], "other": []}
                ratios = []
                for _ in range(args.rounds):
                    names = list(workers)
                    order.shuffle(names)
                    got = {tree: workers[tree].block(args.block) for tree in names}
                    for tree, seconds in got.items():
                        times[tree].append(seconds)
                    ratios.append(got["this"] / got["other"])
                for worker in workers.values():
                    worker.close()
                mine, theirs = (statistics.median(times[t]) * 1e3 for t in ("this", "other"))
                ratio = statistics.median(ratios)
                print(f"| {name} {'x'.join(map(str, shape))} | {threads} | {mine:.2f} | {theirs:.2f} | {ratio:.3f} |")


if __name__ == "__main__":
    main()
