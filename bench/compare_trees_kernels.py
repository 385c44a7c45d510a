"""The CPU BN kernels of two source trees side by side: this tree against another checkout (e.g. main's, to compare
a kernel rewrite with what it replaces), each in its own process, interleaved round by round.

Each round starts one worker process per tree (PYTHONPATH = the tree), in alternating order; a worker warms every
case up, then times each case (median of ``--calls`` calls) and prints the medians as JSON. The table gives, per
case, the median over rounds of each tree's median and their ratio (this tree / other).

Cases: the direct kernels (cpu.forward_inference / forward_training / backward into preallocated outputs) on
bench_kernels.py's tensor (32x64x56x56, channels-first and NHWC) and on small tensors (the serial path), with the
kernels' default thread count and with one thread; and one op in an onnxruntime session of 2 intra-op threads
(bnfuse.runtime.session_options), large (the loops as tasks on the session's pool) and small (the serial kernels on
the calling thread: the native library's ops, or an older tree's C fast path).

    python bench/compare_trees_kernels.py --other /work/main [--rounds 5] [--calls 20]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parents[1]

# name -> (x shape, axis)
SHAPES = {
    "NCHW 32x64x56x56": ((32, 64, 56, 56), 1),
    "NHWC 32x56x56x64": ((32, 56, 56, 64), -1),
    "NCHW 8x16x16x16 (serial)": ((8, 16, 16, 16), 1),
    "rows 256x64 (serial)": ((256, 64), 1),
}
SESSION_SHAPES = {"NCHW 16x64x32x32 (pool)": (16, 64, 32, 32), "NCHW 8x16x16x16 (serial)": (8, 16, 16, 16)}


def _worker(calls: int) -> None:  # noqa: C901 - one flat list of cases
    import numpy as np
    import onnxruntime as ort

    from bnfuse.runtime import cpu, ops, session_options
    from bnfuse.runtime.kernel_types import GradOutputs, TrainingOutputs
    from bnfuse.runtime.semantics import BatchNormConfig

    rng = np.random.default_rng(0)
    cases = {}
    for name, (shape, axis) in SHAPES.items():
        config = BatchNormConfig(axis=axis)
        channels = shape[axis]
        x = rng.standard_normal(shape).astype(np.float32)
        dy = rng.standard_normal(shape).astype(np.float32)
        ones, zeros = np.ones(channels, np.float32), np.zeros(channels, np.float32)
        y = np.empty_like(x)
        stats = TrainingOutputs(np.empty_like(x), *(np.empty(channels, np.float32) for _ in range(5)))
        grads = GradOutputs(np.empty_like(x), np.empty(channels, np.float32), np.empty(channels, np.float32))
        mean, inv_std = zeros + 0.1, ones * 0.9

        def infer(x=x, config=config, ones=ones, zeros=zeros, y=y) -> None:
            cpu.forward_inference(x, ones, zeros, zeros, ones, config, out=y)

        def train(x=x, config=config, ones=ones, zeros=zeros, stats=stats) -> None:
            cpu.forward_training(x, ones, zeros, zeros, ones, config, out=stats)

        def grad(dy=dy, x=x, config=config, ones=ones, mean=mean, inv_std=inv_std, grads=grads) -> None:
            cpu.backward(dy, x, ones, mean, inv_std, config, out=grads)

        for op, function in (("inference", infer), ("training", train), ("backward", grad)):
            cases[f"direct {op} {name}"] = (function, None)
            cases[f"direct {op} {name}, 1 thread"] = (function, 1)
    options = session_options(["CPUExecutionProvider"])
    options.intra_op_num_threads = 2
    for name, shape in SESSION_SHAPES.items():
        for op in (ops.INFERENCE, ops.TRAINING, ops.GRAD):
            session = ort.InferenceSession(
                ops.single_op_model(op).SerializeToString(), options, providers=["CPUExecutionProvider"]
            )
            channels = shape[1]
            feeds = {}
            for input_name in ops.INPUT_NAMES[op]:
                big = input_name in ("X", "dY")
                feeds[input_name] = (rng.standard_normal(shape) if big else rng.random(channels) + 0.5).astype(
                    np.float32
                )

            def run(session=session, feeds=feeds) -> None:
                session.run(None, feeds)

            cases[f"session {op} {name}"] = (run, None)
    for function, threads in cases.values():  # warm up (compiles, first-touch of outputs)
        with cpu.kernel_threads(threads):
            function()
            function()
    result = {}
    for name, (function, threads) in cases.items():
        times = []
        with cpu.kernel_threads(threads):
            for _ in range(calls):
                start = time.perf_counter()
                function()
                times.append(time.perf_counter() - start)
        result[name] = statistics.median(times)
    print(json.dumps(result))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--other", required=True, help="the other source tree (its PYTHONPATH)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--calls", type=int, default=20)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        _worker(args.calls)
        return
    trees = {"this": str(HERE), "other": str(Path(args.other).resolve())}
    runs: dict[str, list[dict[str, float]]] = {"this": [], "other": []}
    for round_index in range(args.rounds):
        order = ("this", "other") if round_index % 2 == 0 else ("other", "this")
        for tree in order:
            env = {**os.environ, "PYTHONPATH": trees[tree]}
            command = [sys.executable, str(HERE / "bench" / "compare_trees_kernels.py"), "--other", trees["other"]]
            command += ["--worker", "--calls", str(args.calls)]
            done = subprocess.run(command, env=env, capture_output=True, text=True, check=True, cwd=trees[tree])
            runs[tree].append(json.loads(done.stdout.strip().splitlines()[-1]))
    print(f"this: {trees['this']}, other: {trees['other']}; {args.rounds} rounds x {args.calls} calls")
    print("| case | this (ms) | other (ms) | this / other |")
    print("|---|---:|---:|---:|")
    for case in runs["this"][0]:
        mine = statistics.median(r[case] for r in runs["this"]) * 1e3
        theirs = statistics.median(r[case] for r in runs["other"]) * 1e3
        print(f"| {case} | {mine:.3f} | {theirs:.3f} | {mine / theirs:.2f} |")


if __name__ == "__main__":
    main()
