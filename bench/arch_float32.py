"""The float32 accuracy table of bench/train_architectures.py ``--no-timing``: every (exporter, lr) per architecture.

    nice -n 10 python bench/train_architectures.py --no-timing --exporter torchscript,dynamo --lr 0.05,0.001 \\
        [--models a,b] --jsonl rows.jsonl
    python bench/arch_float32.py rows.jsonl [more.jsonl ...]     # the combined markdown table of finished rows

Per architecture the PyTorch references (float64 and float32, two plain SGD steps from the same weights, the state
after each step) are computed once per learning rate and shared by the exporters; per exporter the eval-mode
export with BN kept is built into the default training graph once and trained from the same weights at each
learning rate. A row per (architecture, exporter, lr): bnfuse float32's error after one and two steps against
PyTorch float64, PyTorch float32's own error, their ratio, and the verdict of train_architectures.verdict (on the
one-step state). The dynamo exporter writes opset 18 natively (``optimize=False`` keeps every BatchNormalization);
asked for opset 17 it tries onnx's version converter, which fails on these graphs (ReduceMean's axes input), so it
exports opset 18.
"""

from __future__ import annotations

import argparse
import copy
import io
import json
import sys
import warnings
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench import archs  # noqa: E402

EXPORTERS = ("torchscript", "dynamo")
DYNAMO_OPSET = 18


def export(net: Any, shape: tuple[int, ...], exporter: str) -> Any:
    """The eval-mode export with BN kept: the TorchScript exporter (bench/archs.py) or the dynamo exporter."""
    if exporter == "torchscript":
        return archs.export(net, shape)
    if exporter != "dynamo":
        raise ValueError(f"unknown exporter {exporter!r} (torchscript or dynamo)")
    import onnx
    import torch

    buffer = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        program = torch.onnx.export(
            net.eval(),
            (torch.zeros(shape),),
            dynamo=True,
            optimize=False,
            opset_version=DYNAMO_OPSET,
            input_names=["x"],
            output_names=["y"],
            verbose=False,
        )
    program.save(buffer)
    return onnx.load_from_string(buffer.getvalue())


def torch_states(net: Any, data: list[tuple[np.ndarray, np.ndarray]], lr: float, dtype: Any) -> list[dict]:
    """The state_dict (float64 NumPy, no num_batches_tracked) after each plain SGD step of a copy of ``net``."""
    import torch

    net = copy.deepcopy(net).to(dtype).train()
    opt = torch.optim.SGD(net.parameters(), lr=lr)
    states = []
    for x, labels in data:
        opt.zero_grad()
        torch.nn.functional.cross_entropy(net(torch.from_numpy(x).to(dtype)), torch.from_numpy(labels)).backward()
        opt.step()
        states.append(
            {
                k: v.detach().to(torch.float64).numpy().copy()
                for k, v in net.state_dict().items()
                if not k.endswith("num_batches_tracked")
            }
        )
    return states


def worst(state: dict[str, np.ndarray], reference: dict[str, np.ndarray]) -> float:
    """The largest per-tensor relative error (archs.relative_error) over the reference's tensors ``state`` has."""
    return max(archs.relative_error(state[k], v) for k, v in reference.items() if k in state)


def errors(bnfuse: list[dict], ref64: list[dict], ref32: list[dict]) -> dict:
    """The row's error fields: bnfuse and PyTorch float32 against PyTorch float64 after one and two steps."""
    missing = [k for k in ref64[-1] if k not in bnfuse[-1]]
    return {
        "error1": worst(bnfuse[0], ref64[0]),
        "error1_32": worst(ref32[0], ref64[0]),
        "error": worst(bnfuse[1], ref64[1]),
        "error32": worst(ref32[1], ref64[1]),
        "missing": len(missing),
        "missing_names": missing[:1],
    }


def measure(name: str, size: int, batch: int, exporters: list[str], lrs: list[float]) -> list[dict]:
    """One architecture's rows, one per (exporter, lr)."""
    import torch

    from bench.train_architectures import _first_line, verdict
    from bnfuse.passes.training import build_training_graph
    from bnfuse.training.session import TrainingSession

    shape = (batch, 3, size, size)
    source = "torchvision" if name in archs.TORCHVISION else "timm"
    net = archs.create(name)
    data = archs.batches(shape, 10, 2)
    references = {
        lr: (torch_states(net, data, lr, torch.float64), torch_states(net, data, lr, torch.float32)) for lr in lrs
    }
    rows = []
    for exporter in exporters:
        base = {"name": name, "source": source, "exporter": exporter}
        try:
            model = export(net, shape, exporter)
        except Exception as exc:  # noqa: BLE001 - the table lists what stops a model
            rows += [dict(base, lr=lr, status=f"export fails: {_first_line(exc)}") for lr in lrs]
            continue
        try:
            train_model, _ = build_training_graph(model, batch_size=batch)
        except Exception as exc:  # noqa: BLE001
            rows += [dict(base, lr=lr, status=f"build fails: {_first_line(exc)}") for lr in lrs]
            continue
        for lr in lrs:
            row = dict(base, lr=lr)
            try:
                session = TrainingSession(train_model, lr=lr)
                states = []
                for x, y in data:
                    session.step(x, y)
                    states.append(session.state_dict())
            except Exception as exc:  # noqa: BLE001
                rows.append(dict(row, status=f"step fails: {_first_line(exc)}"))
                continue
            row.update(errors(states, *references[lr]))
            row["status"] = verdict(row, row["missing_names"])
            rows.append(row)
    return rows


def _ratio(ours: float, theirs: float) -> str:
    if theirs <= 0:
        return "-"
    ratio = ours / theirs
    return f"{ratio:.1f}x" if ratio >= 1 else f"{ratio:.2g}x"  # two digits below 1: 0.031x, not 0.0x


def cell(row: dict | None) -> list[str]:
    """The two cells of one (exporter, lr): errors (1 step; 2 steps) and the verdict."""
    if row is None:
        return ["not run", "-"]
    if "error1" not in row:
        return ["-", row.get("status", "")]
    one = f"{row['error1']:.1e} / {row['error1_32']:.1e} = {_ratio(row['error1'], row['error1_32'])}"
    two = f"{row['error']:.1e} / {row['error32']:.1e} = {_ratio(row['error'], row['error32'])}"
    return [f"{one}; {two}", row["status"]]


def markdown(rows: list[dict]) -> str:
    """Architectures down, a column pair per (exporter, lr) across, in the order they first appear."""
    combos = list(dict.fromkeys((r["exporter"], r["lr"]) for r in rows))
    names = list(dict.fromkeys(r["name"] for r in rows))
    found = {(r["name"], r["exporter"], r["lr"]): r for r in rows}
    header = "| model | " + " | ".join(
        f"{e} lr {lr:g}: 1 step; 2 steps (bnfuse / PyTorch f32 vs f64 = ratio) | {e} lr {lr:g}: verdict"
        for e, lr in combos
    )
    lines = [header + " |", "|---|" + "---|---|" * len(combos)]
    for name in names:
        cells = [c for e, lr in combos for c in cell(found.get((name, e, lr)))]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="the combined float32 table of train_architectures --jsonl rows")
    parser.add_argument("jsonl", nargs="+", type=Path)
    args = parser.parse_args(argv)
    rows = [json.loads(line) for path in args.jsonl for line in path.read_text().splitlines() if line.strip()]
    print(markdown(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
