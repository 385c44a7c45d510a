"""Training-step fusions on the CPU: each against the same graph without it, side by side in one process.

The default training graph (BN -> ReLU fused into the BN ops, the optimizer update as one bnfuse.SGDStep /
AdamStep node) against the same model built with ``fuse_relu=False`` (Relu, then Greater / Cast / Mul in the
backward) and with ``fused_optimizer=False`` (the update as standard ONNX nodes per parameter), for SGD with
momentum, SGD with Nesterov momentum and weight decay, and Adam; ResNet (width 16, batch 32) and the MLP, at 1 and
2 intra-op threads. Method as bench_step_vs_torch.py: blocks of steps, contenders in a seeded random order each
round (one untimed step before each block), medians of per-round ratios, the other cores' load recorded.

    python bench/bench_fusions.py [--quick]
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import Section, Target, machine_description, markdown_table, today  # noqa: E402
from bench.common import main as bench_main  # noqa: E402

THREADS = (1, 2)


def _optimizers():  # noqa: ANN202
    from bnfuse.passes.training import SGD, Adam

    return {
        "SGD momentum 0.9": SGD(momentum=0.9),
        "SGD Nesterov, weight decay": SGD(momentum=0.9, weight_decay=1e-4, nesterov=True),
        "Adam": Adam(),
    }


def _case(torch, name: str, net, shape: tuple[int, ...], threads: int, rounds: int, block: int) -> list[dict]:  # noqa: ANN001
    from bench.bench_step_vs_torch import LoadMeter, blocks
    from bench.bench_training import _export
    from bnfuse.passes.training import build_training_graph
    from bnfuse.runtime import session_options
    from bnfuse.training.session import TrainingSession

    model = _export(torch, net, shape)
    rng = np.random.default_rng(0)
    x = rng.standard_normal(shape).astype(np.float32)
    labels = rng.integers(0, 10, shape[0]).astype(np.int64)
    results = []
    for optimizer_name, optimizer in _optimizers().items():
        variants = {"default (both fused)": {}, "ReLU unfused": {"fuse_relu": False}}
        variants["optimizer unfused"] = {"fused_optimizer": False}
        fns = {}
        for label, flags in variants.items():
            graph, _ = build_training_graph(model, optimizer=optimizer, **flags)
            options = session_options(["CPUExecutionProvider"], intra_op_num_threads=threads, log_severity_level=3)
            session = TrainingSession(graph, lr=0.01, session_options=options)
            fns[label] = lambda s=session: s.step(x, labels)
        meter = LoadMeter()
        meter.start()
        times = blocks(fns, rounds=rounds, block=block, baseline="default (both fused)")
        results.append({"model": name, "optimizer": optimizer_name, "threads": threads, "times": times,
                        "load": meter.stop()})  # fmt: skip
    return results


def run(quick: bool = False) -> Section:
    from bench.bench_step_vs_torch import StepSizes
    from bench.bench_training import _torch_nets

    torch, ResNet, mlp = _torch_nets()
    torch.manual_seed(0)
    sizes = StepSizes.of(quick)
    rounds, block = sizes.rounds, sizes.block
    cases = []
    for threads in THREADS:
        resnet = (f"ResNet (width {sizes.width})", ResNet(sizes.width), sizes.resnet_shape)
        for name, net, shape in (resnet, ("MLP 256-512-512-10", mlp(256, 512), sizes.mlp_shape)):
            cases += _case(torch, name, net, shape, threads, rounds, block)
    rows = []
    for case in cases:
        t = case["times"]
        base = t["default (both fused)"]
        rows.append([
            case["model"], case["optimizer"], case["threads"], f"{base['median'] * 1e3:.2f}",
            f"{t['ReLU unfused']['median'] * 1e3:.2f}", f"{1 / t['ReLU unfused']['ratio']:.3f}",
            f"{t['optimizer unfused']['median'] * 1e3:.2f}", f"{1 / t['optimizer unfused']['ratio']:.3f}",
            f"{case['load']:.2f}",
        ])  # fmt: skip
    header = ["model", "optimizer", "threads", "default ms", "ReLU unfused ms", "fused / unfused (ReLU)",
              "optimizer unfused ms", "fused / unfused (optimizer)", "other load"]  # fmt: skip
    markdown = "\n\n".join(
        [
            f"{machine_description()}, {today()}. Blocks of {block} steps, {rounds} rounds, contenders in a seeded "
            "random order each round, one untimed step before each block; medians over rounds; 'fused / unfused' is "
            "the inverse of the median per-round ratio of the unfused graph to the default one (below 1: the fusion "
            "saves time); 'other load' is the cores the rest of the machine kept busy meanwhile.",
            markdown_table(header, rows),
        ]
    )
    targets = [
        Target(
            f"{c['model']}, {c['optimizer']}, {c['threads']} thread(s): default / optimizer unfused",
            1 / c["times"]["optimizer unfused"]["ratio"],
            1.0,
        )
        for c in cases
    ]
    return Section(
        title="Training-step fusions: fused ReLU and fused optimizer update vs unfused (CPU)",
        command="python bench/bench_fusions.py" + (" --quick" if quick else ""),
        markdown=markdown,
        series={
            f"{c['model']} {c['optimizer']} t{c['threads']}": {k: v["median"] for k, v in c["times"].items()}
            for c in cases
        },  # fmt: skip
        targets=targets,
    )


if __name__ == "__main__":
    bench_main(run, __doc__.splitlines()[0])
