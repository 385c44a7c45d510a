"""Training step time: bnfuse's training graph in onnxruntime (CPU) against PyTorch (CPU), same network and batch.

Each network is built in PyTorch with BatchNorm, exported in eval mode, turned into a training graph
(SGD with momentum, cross-entropy) twice -- with bnfuse's custom BN ops and --portable (standard ONNX ops
only) -- and stepped by TrainingSession; PyTorch runs the same step (zero_grad, forward, backward, SGD step).
The three are timed round-robin in one run (interleaved medians) with the same thread count. Also listed:
the graph built with onnx-ad's own Conv / Gemm / MatMul / pooling rules (fast_rules off), to show what the
rules bnfuse plugs into onnx-ad buy.

    python bench/bench_training.py [--quick]
"""

from __future__ import annotations

import io
import os
import sys
import warnings
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import Section, Target, interleaved_medians, machine_description, markdown_table, today  # noqa: E402
from bench.common import main as bench_main


def _torch_nets():  # noqa: ANN202 - torch is a benchmark peer, imported lazily
    # PyTorch runs with its own defaults (libgomp spins briefly after each parallel region), whatever imported
    # it first: forcing OMP_WAIT_POLICY=PASSIVE made its step ~1.5x slower here, and only when this module
    # loaded torch (run_all's kernels benchmark loads it earlier).
    import torch
    from torch import nn

    class Block(nn.Module):
        def __init__(self, cin: int, cout: int, stride: int) -> None:
            super().__init__()
            self.c1, self.b1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False), nn.BatchNorm2d(cout)
            self.c2, self.b2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False), nn.BatchNorm2d(cout)
            self.down = None
            if stride != 1 or cin != cout:
                self.down = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

        def forward(self, x):  # noqa: ANN001, ANN202
            y = self.b2(self.c2(torch.relu(self.b1(self.c1(x)))))
            return torch.relu(y + (x if self.down is None else self.down(x)))

    class ResNet(nn.Module):
        def __init__(self, width: int) -> None:
            super().__init__()
            self.stem = nn.Sequential(nn.Conv2d(3, width, 3, 1, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU())
            self.layers = nn.Sequential(
                Block(width, width, 1), Block(width, 2 * width, 2), Block(2 * width, 4 * width, 2)
            )
            self.fc = nn.Linear(4 * width, 10)

        def forward(self, x):  # noqa: ANN001, ANN202
            x = self.layers(self.stem(x))
            return self.fc(torch.flatten(nn.functional.adaptive_avg_pool2d(x, 1), 1))

    def mlp(features: int, hidden: int) -> nn.Module:
        return nn.Sequential(
            nn.Linear(features, hidden),
            nn.BatchNorm1d(hidden),
            nn.ReLU(),
            nn.Linear(hidden, hidden),
            nn.BatchNorm1d(hidden),
            nn.ReLU(),
            nn.Linear(hidden, 10),
        )

    return torch, ResNet, mlp


def _export(torch, net, shape):  # noqa: ANN001, ANN202
    import onnx

    net.eval()
    buffer = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(
            net,
            torch.randn(*shape),
            buffer,
            dynamo=False,
            opset_version=17,
            training=torch.onnx.TrainingMode.PRESERVE,
            do_constant_folding=False,
            input_names=["x"],
            output_names=["y"],
        )
    return onnx.load_from_string(buffer.getvalue())


def _case(name: str, net, shape: tuple[int, ...], threads: int, repeat: int) -> dict:  # noqa: ANN001
    import onnxruntime

    from bnfuse.passes.training import SGD, autodiff, build_training_graph
    from bnfuse.training.session import TrainingSession

    torch = sys.modules["torch"]
    model = _export(torch, net, shape)
    rng = np.random.default_rng(0)
    x = rng.standard_normal(shape).astype(np.float32)
    labels = rng.integers(0, 10, shape[0]).astype(np.int64)

    def options() -> onnxruntime.SessionOptions:
        opts = onnxruntime.SessionOptions()
        opts.intra_op_num_threads = threads
        opts.log_severity_level = 3
        opts.add_session_config_entry("session.intra_op.allow_spinning", "0")
        return opts

    sessions = {}
    graphs = {}
    for label, kwargs in (("bnfuse custom ops", {}), ("bnfuse --portable", {"portable": True})):
        train_model, report = build_training_graph(model, optimizer=SGD(momentum=0.9), **kwargs)
        graphs[label] = report.training_nodes
        custom = None
        if not kwargs:
            from bnfuse.runtime import session_options

            custom = session_options(["CPUExecutionProvider"], intra_op_num_threads=threads, log_severity_level=3)
        sessions[label] = TrainingSession(train_model, lr=0.01, session_options=custom or options())
    # the same portable graph with onnx-ad's own Conv / Gemm / MatMul / GlobalAveragePool rules
    original = autodiff.reverse
    try:
        autodiff.reverse = lambda *a, **k: original(*a, **k, fast=False)  # type: ignore[assignment]
        slow_model, slow_report = build_training_graph(model, optimizer=SGD(momentum=0.9), portable=True)
    finally:
        autodiff.reverse = original
    graphs["portable, onnx-ad's own rules"] = slow_report.training_nodes
    sessions["portable, onnx-ad's own rules"] = TrainingSession(slow_model, lr=0.01, session_options=options())

    net.train()
    opt = torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9)
    tx, ty = torch.from_numpy(x), torch.from_numpy(labels)

    def torch_step() -> None:
        opt.zero_grad()
        torch.nn.functional.cross_entropy(net(tx), ty).backward()
        opt.step()

    fns = {label: (lambda s=s: s.step(x, labels)) for label, s in sessions.items()}
    fns["PyTorch"] = torch_step
    times = interleaved_medians(fns, repeat=repeat, warmup=2)
    return {"name": name, "shape": shape, "times": times, "nodes": graphs}


def run(quick: bool = False) -> Section:
    torch, ResNet, mlp = _torch_nets()
    threads = os.cpu_count() or 1
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    repeat = 5 if quick else 15
    width, batch = (8, 8) if quick else (16, 32)
    cases = [
        _case(f"ResNet (3 blocks, width {width})", ResNet(width), (batch, 3, 32, 32), threads, repeat),
        _case("MLP with BatchNorm1d (256-512-512-10)", mlp(256, 512), (64 if quick else 256, 256), threads, repeat),
    ]
    rows = []
    for case in cases:
        base = case["times"]["PyTorch"]
        for label, seconds in case["times"].items():
            nodes = case["nodes"].get(label, "")
            rows.append(
                [
                    case["name"],
                    "x".join(map(str, case["shape"])),
                    label,
                    f"{seconds * 1e3:.2f}",
                    f"{seconds / base:.2f}",
                    nodes,
                ]
            )
    table = markdown_table(["network", "batch", "contender", "step ms (median)", "/ PyTorch", "graph nodes"], rows)
    markdown = "\n\n".join(
        [
            f"One training step (forward, cross-entropy, backward, SGD momentum 0.9 update), float32, CPU, "
            f"{threads} threads for onnxruntime and PyTorch; PyTorch at its default OMP wait policy, onnxruntime's "
            f"pool threads not spinning (bnfuse's session default). {machine_description()}, {today()}. "
            f"Medians of {repeat} round-robin runs. Target: bnfuse <= 1.5 x PyTorch. "
            "GPU: not measured (no GPU lent to this task).",
            table,
        ]
    )
    return Section(
        title="Training step: onnxruntime training graph vs PyTorch (CPU)",
        command="python bench/bench_training.py" + (" --quick" if quick else ""),
        markdown=markdown,
        series={case["name"]: case["times"] for case in cases},
        targets=[
            Target(
                f"training step {case['name']}, {label} / PyTorch", case["times"][label] / case["times"]["PyTorch"], 1.5
            )
            for case in cases
            for label in ("bnfuse custom ops", "bnfuse --portable")
        ],
    )


if __name__ == "__main__":
    bench_main(run, __doc__.splitlines()[0])
