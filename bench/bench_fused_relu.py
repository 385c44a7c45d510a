"""Training step with BN -> ReLU fused into the BN ops (the default) against the same graph built with
``fuse_relu=False`` (Relu, then Greater / Cast / Mul in the backward), interleaved blocks in one process.

    PYTHONPATH=. python bench/bench_fused_relu.py [--threads 2] [--rounds 15] [--block 4]

Prints per model: median step time of each graph, the median ratio fused / unfused within a round, and the
load (cores the rest of the machine kept busy meanwhile).
"""

from __future__ import annotations

import argparse

import numpy as np


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--block", type=int, default=4)
    args = parser.parse_args()

    from bench.bench_step_vs_torch import LoadMeter, blocks
    from bench.bench_training import _export, _torch_nets
    from bnfuse.passes.training import SGD, build_training_graph
    from bnfuse.runtime import session_options
    from bnfuse.training.session import TrainingSession

    torch, ResNet, mlp = _torch_nets()
    torch.manual_seed(0)
    cases = [("ResNet (width 16)", ResNet(16), (32, 3, 32, 32)), ("MLP 256-512-512-10", mlp(256, 512), (256, 256))]
    for name, net, shape in cases:
        model = _export(torch, net, shape)
        rng = np.random.default_rng(0)
        x = rng.standard_normal(shape).astype(np.float32)
        labels = rng.integers(0, 10, shape[0]).astype(np.int64)
        fns = {}
        for label, fuse in (("unfused", False), ("fused", True)):
            graph, _ = build_training_graph(model, optimizer=SGD(momentum=0.9), fuse_relu=fuse)
            options = session_options(["CPUExecutionProvider"], intra_op_num_threads=args.threads, log_severity_level=3)
            session = TrainingSession(graph, lr=0.01, session_options=options)
            fns[label] = lambda s=session, x=x, labels=labels: s.step(x, labels)
            nodes = len(graph.graph.node)
            print(f"{name}: {label} graph has {nodes} nodes")
        meter = LoadMeter()
        meter.start()
        result = blocks(fns, rounds=args.rounds, block=args.block, baseline="unfused")
        load = meter.stop()
        fused, unfused = result["fused"], result["unfused"]
        times = f"unfused {unfused['median'] * 1e3:.2f} ms, fused {fused['median'] * 1e3:.2f} ms"
        print(
            f"{name}, {args.threads} threads: {times}, fused / unfused {fused['ratio']:.3f} "
            f"(median of {args.rounds} rounds of {args.block} steps; load {load:.2f} cores)"
        )


if __name__ == "__main__":
    main()
