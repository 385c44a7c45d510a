"""BN left by bnfuse, onnxruntime (EXTENDED) and onnxsim on Keras applications converted by tf2onnx.

Needs the extra `keras` (and onnxsim, from `bench`): see bench/keras_apps.py. Not a bench_<topic>.py module,
so bench/run_all.py (and CI) never imports tensorflow.

    python bench/bn_left.py [--cache DIR] [APP ...]

Per model: BatchNormalization nodes in / left, and Mul / Add nodes with a per-channel constant, as
"BN / Mul / Add" (Keras 3's BN arrives as x * scale + shift; TensorFlow's grappler folds the scale into a plain
Conv2D kernel but leaves the shift, and tf2onnx with its optimizers off leaves a Conv's bias as an Add).
bnfuse runs with check=True (every rewrite proven in onnxruntime); its BN folded, Mul / Add absorbed and
forward-folded counts are from its report (forward folds exist from issue 12 on; "n/a" on code without them).
onnxruntime's count is of the model its EXTENDED level writes; onnxsim's of
``onnxsim.simplify``. The dynamo exporter column of the PyTorch table has no counterpart here.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
from onnx import numpy_helper

sys.path.insert(0, str(Path(__file__).resolve().parent))
import keras_apps  # noqa: E402

import bnfuse  # noqa: E402
from bnfuse.errors import CheckFailedError  # noqa: E402
from bnfuse.passes.optimize import count_nodes  # noqa: E402
from bnfuse.passes.report import Report  # noqa: E402


def per_channel(model: onnx.ModelProto, op_type: str) -> int:
    """``op_type`` nodes with a constant operand of more than one element: a per-channel scale or shift (a Keras 3
    BN, or a bias tf2onnx did not fuse), not x * sigmoid(x) nor a residual Add."""
    sizes = {t.name: int(np.prod(t.dims)) for t in model.graph.initializer}
    for node in model.graph.node:
        if node.op_type == "Constant" and node.attribute and node.attribute[0].name == "value":
            sizes[node.output[0]] = numpy_helper.to_array(node.attribute[0].t).size
    return sum(1 for n in model.graph.node if n.op_type == op_type and any(sizes.get(i, 0) > 1 for i in n.input))


def left(model: onnx.ModelProto) -> tuple[int, int, int]:
    """(BatchNormalization, per-channel Mul, per-channel Add) nodes in ``model``."""
    return count_nodes(model.graph, "BatchNormalization"), per_channel(model, "Mul"), per_channel(model, "Add")


def onnxruntime_extended(model: onnx.ModelProto) -> onnx.ModelProto:
    with tempfile.TemporaryDirectory() as tmp:
        options = ort.SessionOptions()
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED
        options.optimized_model_filepath = str(Path(tmp) / "ort.onnx")
        options.log_severity_level = 3
        ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
        return onnx.load(str(Path(tmp) / "ort.onnx"))


def onnxsim_left(model: onnx.ModelProto) -> str:
    try:
        import onnxsim
    except ImportError:
        return "n/a (onnxsim not installed)"
    simplified, ok = onnxsim.simplify(model)
    return fmt(left(simplified)) + ("" if ok else " (check failed)")


def fmt(counts: tuple[int, int, int]) -> str:
    return " / ".join(map(str, counts))


def reasons(report: Report) -> Counter[str]:
    """Why each BatchNormalization bnfuse left stays (the report's reason), counted."""
    return Counter(r.reason or "(no reason given)" for r in report.batchnorms if r.status == "skipped")


def row(app: str, version: str, optimizers: bool, cache: Path | None) -> tuple[list[str], Report]:
    model = keras_apps.onnx_model(app, version, optimizers, cache=cache)
    start = time.perf_counter()
    try:
        optimized, report = bnfuse.optimize(model, check=True)
    except CheckFailedError as failed:  # marked in the table ("check FAILED"), not a traceback ending the run
        report = failed.report
        optimized, _ = bnfuse.optimize(model)
    elapsed = time.perf_counter() - start
    passed = report.check is not None and report.check.passed
    forward = getattr(report, "forward_folds", None)
    return [
        f"{version} {app} ({'opt' if optimizers else 'noopt'})",
        fmt(left(model)),
        fmt(left(optimized)) + ("" if passed else " (check FAILED)"),
        fmt(left(onnxruntime_extended(model))),
        onnxsim_left(model),
        str(report.count("folded")),
        " / ".join(str(sum(1 for a in report.absorbed if a.op == op)) for op in ("Mul", "Add")),
        "n/a" if forward is None else str(forward),
        f"{elapsed:.1f}",
    ], report


def revision() -> str:
    root = Path(bnfuse.__file__).resolve().parents[1]
    try:
        sha = subprocess.run(["git", "-C", str(root), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
        branch = subprocess.run(["git", "-C", str(root), "branch", "--show-current"], capture_output=True, text=True)
        if sha.returncode != 0:
            return str(root)
        return f"{branch.stdout.strip() or 'detached'} @ {sha.stdout.strip()} ({root})"
    except OSError:
        return str(root)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("apps", nargs="*", default=list(keras_apps.APPS))
    parser.add_argument("--cache", type=Path, help="folder for the converted models (reused when present)")
    parser.add_argument("--versions", nargs="*", default=list(keras_apps.KERAS_VERSIONS))
    parser.add_argument("--reasons", action="store_true", help="after the table, why each BN bnfuse left stays")
    args = parser.parse_args(argv)
    header = [
        "model (tf2onnx optimizers)",
        "in (BN / per-channel Mul / Add)",
        "bnfuse left",
        "onnxruntime EXTENDED left",
        "onnxsim left",
        "bnfuse BN folded",
        "bnfuse Mul / Add absorbed",
        "forward folds",
        "bnfuse s (with check)",
    ]
    print(f"bnfuse code: {revision()}")
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    left_reasons: dict[str, Counter[str]] = {}
    for app in args.apps:
        for version in args.versions:
            for optimizers in (True, False):
                cells, report = row(app, version, optimizers, args.cache)
                print("| " + " | ".join(cells) + " |", flush=True)
                if reasons(report):
                    left_reasons[cells[0]] = reasons(report)
    if args.reasons:
        print("\nBN left by bnfuse, by the report's reason:")
        for model, counted in left_reasons.items():
            for reason, count in counted.most_common():
                print(f"- {model}: {count} x {reason}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
