"""Training step memory: peak RSS growth of bnfuse's step against PyTorch's, each side in its own process.

    python bench/bench_step_memory.py [--quick]

The networks of bench_step_vs_torch.py (ResNet width 16 on 3x32x32, MLP 256-512-512-10) at two batch sizes each,
and the ResNet of issue 22 (width 32, batch 128 at 3x64x64); SGD with momentum 0.9, cross-entropy, 5 steps, 2
threads (ORT's intra-op pool / torch.set_num_threads). Every measurement is a fresh process that exports nothing
and imports what its side needs (torch; onnx and onnxruntime), builds the network (bnfuse: loads the ONNX export
and builds the training graph; PyTorch: makes the input tensors), then resets the peak (Linux:
``/proc/self/clear_refs`` 5) and reads VmRSS just before the ``TrainingSession`` (PyTorch: the module and the
optimizer) is made; after the last step VmHWM minus that VmRSS is the growth of peak RSS, as issue 22 measured it.

Two readings per side: "cold", as above (libraries either side loads on first use count: onnxruntime's session and
bnfuse's extensions, torch.optim and its imports for PyTorch), and "warm", where the process first ran one step of
the same architecture at a tiny size, so that the growth is what the step itself holds. bnfuse runs with
``memory="lean"`` (the default) and, warm, with ``memory="speed"`` (the settings before issue 22; the
oneDNN workspace sharing of issue 22 applies to both).
"""

from __future__ import annotations

import gc
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import Section, Target, machine_description, markdown_table, today  # noqa: E402

MIB = 2**20
THREADS = 2
STEPS = 5


def _status_bytes(key: str) -> int:
    with open("/proc/self/status") as status:
        return int(re.search(rf"^{key}:\s+(\d+) kB", status.read(), re.MULTILINE).group(1)) * 1024  # type: ignore[union-attr]


def _reset_peak() -> None:
    """Make VmHWM start again from the current RSS (Linux 4.0+)."""
    with open("/proc/self/clear_refs", "w") as refs:
        refs.write("5")


def _network(torch, kind: str, width: int):  # noqa: ANN001, ANN202
    from bench.bench_training import _torch_nets

    _, ResNet, mlp = _torch_nets()
    return ResNet(width) if kind == "resnet" else mlp(256, 512)


def _tiny_shape(kind: str) -> tuple[int, ...]:
    return (2, 3, 16, 16) if kind == "resnet" else (4, 256)


def _data(shape: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    return rng.standard_normal(shape).astype(np.float32), rng.integers(0, 10, shape[0]).astype(np.int64)


def worker(
    side: str, kind: str, width: int, shape: tuple[int, ...], warm: bool, memory: str, files: dict, threads: int
) -> dict:
    """One measurement in this (fresh) process; see the module docstring."""
    x, labels = _data(shape)
    if side == "pytorch":
        from bench.bench_training import _torch_nets

        torch, _, _ = _torch_nets()
        torch.set_num_threads(threads)
        torch.manual_seed(0)
        tx, ty = torch.from_numpy(x), torch.from_numpy(labels)

        def make():  # noqa: ANN202
            net = _network(torch, kind, width)
            net.train()
            optimizer = torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9)

            def step(tx=tx, ty=ty) -> None:  # noqa: ANN001
                optimizer.zero_grad()
                torch.nn.functional.cross_entropy(net(tx), ty).backward()
                optimizer.step()

            return step

        if warm:
            tiny_x, tiny_y = (torch.from_numpy(a) for a in _data(_tiny_shape(kind)))
            net = _network(torch, kind, width)
            optimizer = torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9)
            torch.nn.functional.cross_entropy(net(tiny_x), tiny_y).backward()
            optimizer.step()
            del net, optimizer, tiny_x, tiny_y
    else:
        import onnx
        import onnxruntime  # noqa: F401 - imported before the baseline, as PyTorch's side has imported torch

        from bnfuse.passes.training import SGD, build_training_graph
        from bnfuse.runtime import session_options
        from bnfuse.training.session import TrainingSession

        def session(path: str, lr: float = 0.01) -> TrainingSession:
            graph, _ = build_training_graph(onnx.load(path), optimizer=SGD(momentum=0.9))
            options = session_options(["CPUExecutionProvider"], intra_op_num_threads=threads, log_severity_level=3)
            return TrainingSession(graph, lr=lr, session_options=options, memory=memory)

        if warm:
            tiny = session(files["tiny"])
            tiny.step(*_data(_tiny_shape(kind)))
            del tiny
        graph, _ = build_training_graph(onnx.load(files["model"]), optimizer=SGD(momentum=0.9))

        def make():  # noqa: ANN202
            options = session_options(["CPUExecutionProvider"], intra_op_num_threads=threads, log_severity_level=3)
            training = TrainingSession(graph, lr=0.01, session_options=options, memory=memory)
            return lambda: training.step(x, labels)

    gc.collect()
    _reset_peak()
    before = _status_bytes("VmRSS")
    step = make()
    times = []
    for _ in range(STEPS):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return {
        "growth": _status_bytes("VmHWM") - before,
        "before": before,
        "end": _status_bytes("VmRSS") - before,
        "step_s": float(np.median(times[1:])),
    }


def measure(
    side: str,
    kind: str,
    width: int,
    shape: tuple[int, ...],
    *,
    warm: bool,
    memory: str,
    files: dict,
    threads: int = THREADS,
) -> dict:
    """``worker`` in a fresh process (the repository on its path): {"growth", "before", "end": bytes, "step_s"}."""
    root = Path(__file__).resolve().parents[1]
    spec = json.dumps(
        {
            "side": side,
            "kind": kind,
            "width": width,
            "shape": shape,
            "warm": warm,
            "memory": memory,
            "files": files,
            "threads": threads,
        }
    )
    env = {
        **os.environ,
        "OMP_NUM_THREADS": str(threads),
        "PYTHONPATH": f"{root}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
    }
    done = subprocess.run(
        [sys.executable, __file__, "--worker", spec], capture_output=True, text=True, env=env, check=False
    )
    if done.returncode != 0:
        raise RuntimeError(f"{side} worker exited {done.returncode}: {done.stderr[-800:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def export_networks(scratch: Path, cases: list[tuple[str, str, int, tuple[int, ...]]]) -> dict[str, dict]:
    """The ONNX exports every bnfuse worker loads (written by a child process, so this one stays small)."""
    plan = {}
    for name, kind, width, shape in cases:
        plan[name] = {
            "model": str(scratch / f"{len(plan)}.onnx"),
            "tiny": str(scratch / f"{len(plan)}_tiny.onnx"),
            "kind": kind,
            "width": width,
            "shape": shape,
        }
    subprocess.run(
        [sys.executable, __file__, "--export", json.dumps(plan)],
        check=True,
        env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])},
    )
    return plan


def _export(plan: dict) -> None:
    import onnx

    from bench.bench_training import _export as torch_export
    from bench.bench_training import _torch_nets

    torch, _, _ = _torch_nets()
    for entry in plan.values():
        torch.manual_seed(0)
        net = _network(torch, entry["kind"], entry["width"])
        onnx.save(torch_export(torch, net, tuple(entry["shape"])), entry["model"])
        onnx.save(torch_export(torch, net, _tiny_shape(entry["kind"])), entry["tiny"])


SETTINGS = {  # the lean settings one at a time on top of memory="speed", then all three (memory="lean")
    "memory='speed'": ({}, {}),
    "+ no memory pattern": ({"enable_mem_pattern": False}, {}),
    "+ graph order": ({"execution_order": "PRIORITY_BASED"}, {}),
    "+ dW on plain X": ({}, {"nchwc_weight_grads": False}),
    "memory='lean'": (None, {}),
}


def speed_cost(files: dict, threads: int, rounds: int, block: int) -> dict[str, dict[str, float]]:
    """Step time of each SETTINGS variant, interleaved blocks (bench_step_vs_torch.blocks), ratio to memory='speed'."""
    import onnx
    import onnxruntime

    from bench.bench_step_vs_torch import blocks
    from bnfuse.passes.training import SGD, build_training_graph
    from bnfuse.runtime import session_options
    from bnfuse.training.session import TrainingSession

    graph, _ = build_training_graph(onnx.load(files["model"]), optimizer=SGD(momentum=0.9))
    x, labels = _data(tuple(files["shape"]))
    steps = {}
    for label, (options_set, flags) in SETTINGS.items():
        options = session_options(["CPUExecutionProvider"], intra_op_num_threads=threads, log_severity_level=3)
        for name, value in (options_set or {}).items():
            setattr(options, name, getattr(onnxruntime.ExecutionOrder, value) if name == "execution_order" else value)
        mode = "lean" if options_set is None else "speed"
        session = TrainingSession(graph, lr=0.01, session_options=options, memory=mode, **flags)
        steps[label] = lambda session=session: session.step(x, labels)
    return blocks(steps, rounds=rounds, block=block, baseline="memory='speed'")


def cases(quick: bool) -> list[tuple[str, str, int, tuple[int, ...]]]:
    if quick:
        return [("ResNet (width 8)", "resnet", 8, (8, 3, 32, 32)), ("MLP 256-512-512-10", "mlp", 0, (64, 256))]
    return [
        ("ResNet (width 16)", "resnet", 16, (32, 3, 32, 32)),
        ("ResNet (width 16)", "resnet", 16, (128, 3, 32, 32)),
        ("MLP 256-512-512-10", "mlp", 0, (256, 256)),
        ("MLP 256-512-512-10", "mlp", 0, (1024, 256)),
        ("ResNet (width 32), issue 22's", "resnet", 32, (128, 3, 64, 64)),
    ]


def run(quick: bool = False) -> Section:
    rows, targets, series = [], [], {}
    with tempfile.TemporaryDirectory(prefix="bnfuse-bench-step-memory-") as scratch:
        named = {
            f"{name} {'x'.join(map(str, shape))}": (name, kind, width, shape)
            for name, kind, width, shape in cases(quick)
        }
        plan = export_networks(Path(scratch), [(key, *rest[1:]) for key, rest in named.items()])
        for key, (name, kind, width, shape) in named.items():
            files = plan[key]
            got = {}
            for label, side, warm, memory in (
                ("bnfuse cold", "bnfuse", False, "lean"),
                ("PyTorch cold", "pytorch", False, "lean"),
                ("bnfuse warm", "bnfuse", True, "lean"),
                ("bnfuse warm, memory='speed'", "bnfuse", True, "speed"),
                ("PyTorch warm", "pytorch", True, "lean"),
            ):
                got[label] = measure(side, kind, width, shape, warm=warm, memory=memory, files=files)
            series[key] = got
            cold = got["bnfuse cold"]["growth"] / got["PyTorch cold"]["growth"]
            warm = got["bnfuse warm"]["growth"] / got["PyTorch warm"]["growth"]
            speed = got["bnfuse warm, memory='speed'"]["growth"] / got["PyTorch warm"]["growth"]
            rows.append(
                [
                    name,
                    "x".join(map(str, shape)),
                    *(f"{got[label]['growth'] / MIB:,.0f}" for label in ("bnfuse cold", "PyTorch cold")),
                    f"{cold:.2f}",
                    *(f"{got[label]['growth'] / MIB:,.0f}" for label in ("bnfuse warm", "PyTorch warm")),
                    f"{warm:.2f}",
                    f"{got['bnfuse warm, memory=' + repr('speed')]['growth'] / MIB:,.0f} ({speed:.2f})",
                ]
            )
            shape_text = "x".join(map(str, shape))
            targets.append(Target(f"step peak RSS growth {name} {shape_text}, cold: bnfuse / PyTorch", cold, 1.0))
            targets.append(Target(f"step peak RSS growth {name} {shape_text}, warm: bnfuse / PyTorch", warm, 1.0))
        speed_rows = []
        for threads in (1, 2):
            for key in list(named)[:1] + [k for k in named if named[k][1] == "mlp"][:1]:
                name, _, _, shape = named[key]
                result = speed_cost(plan[key], threads, 3 if quick else 12, 2 if quick else 4)
                series[f"speed {key} t{threads}"] = result
                speed_rows.append(
                    [name, "x".join(map(str, shape)), threads]
                    + [f"{result[label]['median'] * 1e3:.2f} ({result[label]['ratio']:.3f})" for label in SETTINGS]
                )
    header = [
        "network",
        "batch",
        "bnfuse cold MiB",
        "PyTorch cold MiB",
        "cold ratio",
        "bnfuse warm MiB",
        "PyTorch warm MiB",
        "warm ratio",
        "bnfuse warm, memory='speed' MiB (ratio)",
    ]
    markdown = (
        f"{machine_description()}, {today()}. Growth of peak RSS (VmHWM after the last step minus VmRSS just before "
        f"the session / module and optimizer are made), {STEPS} steps, SGD momentum 0.9, {THREADS} threads, each "
        "figure a fresh process (one run each: memory, unlike time, needs no median). cold: libraries loaded on "
        "first use count; warm: the process first ran one step of the same architecture at a tiny size. bnfuse "
        "runs with memory='lean' (the default) unless the column says 'speed' (onnxruntime's settings before issue "
        "22; the oneDNN workspace sharing applies to both).\n\n"
        + markdown_table(header, rows)
        + "\n\nSpeed cost of the lean settings, one at a time on top of memory='speed' and all three (memory='lean'): "
        "step ms, median over rounds of blocks run in a seeded random order (bench_step_vs_torch.blocks), and in "
        "brackets the median per-round ratio to memory='speed' (below 1: faster).\n\n"
        + markdown_table(["network", "batch", "threads", *SETTINGS], speed_rows)
    )
    return Section(
        title="Training step memory: peak RSS growth vs PyTorch (CPU)",
        command="python bench/bench_step_memory.py" + (" --quick" if quick else ""),
        markdown=markdown,
        series=series,
        targets=targets,
    )


if __name__ == "__main__":
    if sys.argv[1:2] == ["--worker"]:
        spec = json.loads(sys.argv[2])
        result = worker(
            spec["side"],
            spec["kind"],
            spec["width"],
            tuple(spec["shape"]),
            spec["warm"],
            spec["memory"],
            spec["files"],
            spec["threads"],
        )
        print(json.dumps(result))
    elif sys.argv[1:2] == ["--export"]:
        _export(json.loads(sys.argv[2]))
    else:
        from bench.common import main

        main(run, __doc__.splitlines()[0])
