"""Training graphs of real torchvision / timm architectures against PyTorch: builds, trains, matches, speed, memory.

    nice -n 10 python bench/train_architectures.py [--models a,b] [--size 64] [--batch 4] [--output table.md]
    nice -n 10 python bench/train_architectures.py --float64 [--variants default,portable] [--models a,b] ...
    nice -n 10 python bench/train_architectures.py --no-timing --exporter torchscript,dynamo --lr 0.05,0.001 ...

Per architecture (random init, eval-mode TorchScript export with BN kept, bench/archs.py): build the default
training graph (batch ``--batch``, ``--size`` squared images), two SGD steps (lr 0.05) from the same weights as
PyTorch float64, and PyTorch float32 as the float32 yardstick. Verdict, on the state after one step (the gradient;
the second step amplifies float32 differences chaotically on these random-init networks): "matches" where bnfuse's
state is within 1e-4 of PyTorch float64 (per tensor, relative to the tensor's scale, floor 1e-3); "float32-chaotic"
where PyTorch's own float32 run is already > 1e-4 from float64 (a ReLU / max boundary flips under float32 rounding)
and bnfuse is within 10x of that; else "MISMATCH". Step time (median of 3 after one warm-up) and peak RSS of a
process that only trains (bnfuse: onnx file in, no torch imported; PyTorch: the module in float32), at 1 and 2
intra-op threads. A failing build is
listed with its error's first line (the op or pattern that stops it).

``--float64``: the float64 table instead (bench/float64_check.py): each model exported in float64, its training graph
in every variant (default, fused ReLU off, standard optimizer, portable) run by onnx's reference evaluator with
bnfuse's ops on NumPy float64, two SGD steps against PyTorch float64; per variant the largest relative error after
one and two steps, PyTorch float64's own spread (its steps from inputs moved by 1e-15 relative), the largest
difference between the variants' states, and the verdict: matches (1e-9), float64-chaotic (PyTorch's spread > 1e-9
and the graph within 10x of it), else MISMATCH.

``--no-timing``: the float32 accuracy table alone (bench/arch_float32.py): per architecture a column pair per
(exporter, lr) -- the TorchScript and dynamo exporters, any learning rates -- with the verdict above.

Not a run_all topic (needs the ``oracle`` extra and ~30 minutes): its table goes under run_all's kept marker.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench import archs  # noqa: E402

LR = 0.05
RTOL = 1e-4
TIMED = 3
CHAOS_FACTOR = 10  # float32-chaotic: bnfuse within this factor of PyTorch float32's own error


def _peak_rss_mb() -> float:
    """This process's peak RSS (VmHWM: per address space, so not inherited across exec as ru_maxrss is)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024.0
    raise RuntimeError("no VmHWM in /proc/self/status (Linux only)")


def _worker_bnfuse(onnx_path: str, data_path: str, batch: int) -> dict:
    import onnx

    from bnfuse.passes.training import build_training_graph
    from bnfuse.runtime import session_options
    from bnfuse.training.session import TrainingSession

    data = np.load(data_path)
    x, y = data["x"], data["y"]
    train_model, _ = build_training_graph(onnx.load(onnx_path), batch_size=batch)
    times = {}
    for threads in (1, 2):
        options = session_options(["CPUExecutionProvider"], intra_op_num_threads=threads)
        session = TrainingSession(train_model, lr=LR, session_options=options)
        session.step(x, y)
        samples = []
        for _ in range(TIMED):
            start = time.perf_counter()
            session.step(x, y)
            samples.append(time.perf_counter() - start)
        times[threads] = statistics.median(samples)
        del session
    return {"times": times, "rss": _peak_rss_mb()}


def _worker_torch(name: str, data_path: str) -> dict:
    import torch

    data = np.load(data_path)
    x, y = torch.from_numpy(data["x"]), torch.from_numpy(data["y"])
    net = archs.create(name).train()
    opt = torch.optim.SGD(net.parameters(), lr=LR)
    times = {}
    for threads in (1, 2):
        torch.set_num_threads(threads)

        def step() -> None:
            opt.zero_grad()
            torch.nn.functional.cross_entropy(net(x), y).backward()
            opt.step()

        step()
        samples = []
        for _ in range(TIMED):
            start = time.perf_counter()
            step()
            samples.append(time.perf_counter() - start)
        times[threads] = statistics.median(samples)
    return {"times": times, "rss": _peak_rss_mb()}


def _spawn(args: list[str]) -> dict:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    done = subprocess.run(
        [sys.executable, __file__, *args], capture_output=True, text=True, env=env, timeout=900, check=False
    )
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        tail = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise RuntimeError(tail[:200])
    return json.loads(lines[-1])


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return (text[0] if text else type(exc).__name__)[:160].replace("|", "/")


def measure(name: str, size: int, batch: int, workdir: Path) -> dict:
    """One architecture's row."""
    import torch

    from bnfuse.passes.training import build_training_graph
    from bnfuse.training.session import TrainingSession

    shape = (batch, 3, size, size)
    row: dict = {"name": name, "source": "torchvision" if name in archs.TORCHVISION else "timm"}
    net = archs.create(name)
    row["params"] = sum(p.numel() for p in net.parameters())
    model = archs.export(net, shape)
    data = archs.batches(shape, 10, 2)
    try:
        train_model, report = build_training_graph(model, batch_size=batch)
    except Exception as exc:  # noqa: BLE001 - the table lists what stops a model
        row["status"] = f"build fails: {_first_line(exc)}"
        return row
    row["untied"] = sum(int(n.split()[1]) for n in report.notes if n.startswith("untied "))
    try:
        session = TrainingSession(train_model, lr=LR)
        losses = [session.step(*data[0])]
        first = session.state_dict()  # one step: the gradient itself, before chaotic amplification
        losses.append(session.step(*data[1]))
        state = session.state_dict()
    except Exception as exc:  # noqa: BLE001
        row["status"] = f"step fails: {_first_line(exc)}"
        return row
    ref = archs.torch_steps(net, data, LR, torch.float64)
    ref32 = archs.torch_steps(net, data, LR, torch.float32)
    one = archs.torch_steps(net, data[:1], LR, torch.float64)
    one32 = archs.torch_steps(net, data[:1], LR, torch.float32)
    row["error1"] = max(archs.relative_error(first[k], v) for k, v in one.state.items() if k in first)
    row["error1_32"] = max(archs.relative_error(one32.state[k], v) for k, v in one.state.items())
    missing = [k for k in ref.state if k not in state]
    row["missing"] = len(missing)
    row["loss"] = (losses[-1], ref.losses[-1])
    row["error"] = max(archs.relative_error(state[k], v) for k, v in ref.state.items() if k in state)
    row["error32"] = max(archs.relative_error(ref32.state[k], v) for k, v in ref.state.items())
    row["status"] = verdict(row, missing)
    onnx_path, data_path = workdir / f"{name}.onnx", workdir / f"{name}.npz"
    import onnx

    onnx.save(model, onnx_path)
    np.savez(data_path, x=data[0][0], y=data[0][1])
    try:
        row["bnfuse"] = _spawn(["--worker", "bnfuse", str(onnx_path), str(data_path), str(batch)])
        row["torch"] = _spawn(["--worker", "torch", name, str(data_path)])
    except Exception as exc:  # noqa: BLE001
        row["timing"] = f"timing failed: {_first_line(exc)}"
    return row


def verdict(row: dict, missing: list[str]) -> str:
    """On the one-step state (the gradient): matches, float32-chaotic, or MISMATCH (module docstring)."""
    if missing:
        return f"MISMATCH: {len(missing)} state_dict names missing ({missing[0]})"
    if row["error1"] <= RTOL:
        return "matches"
    if row["error1_32"] > RTOL and row["error1"] <= CHAOS_FACTOR * row["error1_32"]:
        return "float32-chaotic"
    return "MISMATCH"


def markdown(rows: list[dict]) -> str:
    header = (
        "| model | source | params (M) | builds | trains | 1 step: bnfuse / PyTorch f32 vs f64 | "
        "2 steps: bnfuse / PyTorch f32 vs f64 | verdict (1 step) | "
        "step ms 1t (bnfuse / torch = ratio) | step ms 2t (ratio) | peak RSS MB (bnfuse / torch) |\n"
        "|---|---|---|---|---|---|---|---|---|---|---|"
    )
    lines = [header]
    for row in rows:
        status = row.get("status", "")
        builds = "no" if status.startswith("build fails") else "yes"
        trains = "no" if status.startswith(("build fails", "step fails")) else "yes"
        one = f"{row['error1']:.1e} / {row['error1_32']:.1e}" if "error1" in row else "-"
        two = f"{row['error']:.1e} / {row['error32']:.1e}" if "error" in row else "-"
        cells = ["-", "-", "-"]
        if "bnfuse" in row and "torch" in row:
            ours, theirs = row["bnfuse"], row["torch"]
            cells = [
                f"{1e3 * ours['times'][t]:.0f} / {1e3 * theirs['times'][t]:.0f} = "
                f"{ours['times'][t] / theirs['times'][t]:.2f}x"
                for t in ("1", "2")
            ] + [f"{ours['rss']:.0f} / {theirs['rss']:.0f}"]
        elif "timing" in row:
            cells = [row["timing"], "-", "-"]
        params = f"{row.get('params', 0) / 1e6:.1f}"
        lines.append(
            f"| {row['name']} | {row['source']} | {params} | {builds} | {trains} | {one} | {two} | {status} | "
            + " | ".join(cells)
            + " |"
        )
    return "\n".join(lines)


def measure_float64(name: str, size: int, batch: int, variants: list[str]) -> dict:
    """One architecture's float64 row: per variant the errors after 1 and 2 steps, and the variants' agreement."""

    from bench import float64_check
    from bnfuse.passes.training import build_training_graph

    shape = (batch, 3, size, size)
    row: dict = {"name": name, "source": "torchvision" if name in archs.TORCHVISION else "timm"}
    net, model = float64_check.export64(name, shape)
    data = float64_check.float64_batches(shape, 10, 2)
    chosen = {v: float64_check.VARIANTS[v] for v in variants}
    try:
        results = float64_check.check_variants(build_training_graph, model, net, data, chosen)
    except Exception as exc:  # noqa: BLE001 - the table lists what stops a model
        row["status"] = f"fails: {_first_line(exc)}"
        return row
    row["errors"] = {v: [e for e, _ in r["errors"]] for v, r in results.items()}
    row["worst_tensor"] = {v: r["errors"][-1][1] for v, r in results.items()}
    base = results[variants[0]]["state"]
    row["agreement"] = max(float64_check.worst(r["state"], base)[0] for r in results.values())
    row["spread"] = next(iter(results.values()))["spread"]
    verdicts = {float64_check.verdict(errors, row["spread"]) for errors in row["errors"].values()}
    row["status"] = next(v for v in ("MISMATCH", "float64-chaotic", "matches") if v in verdicts)
    return row


def markdown_float64(rows: list[dict], variants: list[str]) -> str:
    header = (
        "| model | source | "
        + " | ".join(f"{v}: 1 / 2 steps" for v in variants)
        + " | PyTorch f64 spread: 1 / 2 steps | variants agree (max) | verdict | s |\n|---|---|"
        + "---|" * (len(variants) + 4)
    )
    lines = [header]
    for row in rows:
        errors = row.get("errors", {})
        cells = [" / ".join(f"{e:.1e}" for e in errors[v]) if v in errors else "-" for v in variants]
        agree = f"{row['agreement']:.1e}" if len(errors) > 1 else "-"  # one variant: nothing to agree with
        spread = " / ".join(f"{e:.1e}" for e in row["spread"]) if "spread" in row else "-"
        lines.append(
            f"| {row['name']} | {row['source']} | " + " | ".join(cells) + f" | {spread} | {agree} | "
            f"{row.get('status', '')} | "
            f"{row.get('seconds', 0):.0f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="", help="comma-separated names (default: all in bench/archs.py)")
    parser.add_argument("--size", type=int, default=64)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--output", type=Path, default=None, help="also write the markdown table here")
    parser.add_argument("--jsonl", type=Path, default=None, help="append each row as JSON here")
    parser.add_argument("--float64", action="store_true", help="the float64 table (bench/float64_check.py)")
    parser.add_argument("--variants", default="", help="--float64: comma-separated variants (default: all)")
    parser.add_argument("--no-timing", action="store_true", help="the float32 accuracy table only (arch_float32.py)")
    parser.add_argument("--exporter", default="torchscript", help="--no-timing: torchscript,dynamo (comma list)")
    parser.add_argument("--lr", default=str(LR), help="--no-timing: SGD learning rates, comma list (default 0.05)")
    parser.add_argument("--worker", nargs="+", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        kind, *rest = args.worker
        if kind == "bnfuse":
            result = _worker_bnfuse(rest[0], rest[1], int(rest[2]))
        else:
            result = _worker_torch(rest[0], rest[1])
        print(json.dumps(result))
        return 0
    names = [n for n in args.models.split(",") if n] or archs.ALL
    if args.float64:
        return _main_float64(names, args)
    if args.no_timing:
        return _main_float32(names, args)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in names:
            start = time.perf_counter()
            try:
                row = measure(name, args.size, args.batch, Path(tmp))
            except Exception as exc:  # noqa: BLE001
                row = {"name": name, "source": "?", "status": f"export fails: {_first_line(exc)}"}
            row["seconds"] = time.perf_counter() - start
            rows.append(row)
            print(json.dumps(row, default=str), flush=True)
            if args.jsonl:
                with args.jsonl.open("a") as handle:
                    handle.write(json.dumps(row, default=str) + "\n")
    table = markdown(rows)
    print(table)
    if args.output:
        args.output.write_text(table + "\n")
    return 0


def _main_float32(names: list[str], args: argparse.Namespace) -> int:
    from bench import arch_float32

    exporters = [e for e in args.exporter.split(",") if e]
    unknown = [e for e in exporters if e not in arch_float32.EXPORTERS]
    try:
        lrs = [float(lr) for lr in args.lr.split(",") if lr]
    except ValueError:
        lrs = []
    if unknown or not exporters or not lrs:
        print("error: --exporter takes torchscript,dynamo and --lr numbers (comma lists)", file=sys.stderr)
        return 2
    rows = []
    for name in names:
        start = time.perf_counter()
        try:
            found = arch_float32.measure(name, args.size, args.batch, exporters, lrs)
        except Exception as exc:  # noqa: BLE001
            found = [
                {"name": name, "source": "?", "exporter": e, "lr": lr, "status": f"fails: {_first_line(exc)}"}
                for e in exporters
                for lr in lrs
            ]
        for row in found:
            row["seconds"] = (time.perf_counter() - start) / len(found)
            print(json.dumps(row, default=str), flush=True)
            if args.jsonl:
                with args.jsonl.open("a") as handle:
                    handle.write(json.dumps(row, default=str) + "\n")
        rows += found
    table = arch_float32.markdown(rows)
    print(table)
    if args.output:
        args.output.write_text(table + "\n")
    return 0


def _main_float64(names: list[str], args: argparse.Namespace) -> int:
    from bench import float64_check

    variants = [v for v in args.variants.split(",") if v] or list(float64_check.VARIANTS)
    rows = []
    for name in names:
        start = time.perf_counter()
        try:
            row = measure_float64(name, args.size, args.batch, variants)
        except Exception as exc:  # noqa: BLE001
            row = {"name": name, "source": "?", "status": f"export fails: {_first_line(exc)}"}
        row["seconds"] = time.perf_counter() - start
        rows.append(row)
        print(json.dumps(row, default=str), flush=True)
        if args.jsonl:
            with args.jsonl.open("a") as handle:
                handle.write(json.dumps(row, default=str) + "\n")
    table = markdown_float64(rows, variants)
    print(table)
    if args.output:
        args.output.write_text(table + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
