"""BatchNormalization left by bnfuse, PyTorch's dynamo exporter, onnxruntime (EXTENDED) and onnxsim, model by model.

Models: bnfuse's built-in models (small sizes), onnx's shipped light models that contain BN, and PyTorch
modules exported with `torch.onnx.export(..., dynamo=True, optimize=False)` (every BN kept). The dynamo
column is the BN left by the default export (`optimize=True`), for the PyTorch modules only.

Keras applications converted by tf2onnx (bench/keras_apps.py) are added from the folder named by
BNFUSE_KERAS_ONNX. Run alone: `python bench/bench_fold_coverage.py` prints the table.
"""

from __future__ import annotations

import os
import sys
import tempfile
import warnings
from collections.abc import Callable
from pathlib import Path

import onnx
import onnxruntime as ort

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import Section, machine_description  # noqa: E402

import bnfuse  # noqa: E402
from bnfuse.models import build, names, spec  # noqa: E402
from bnfuse.passes.optimize import count_nodes, default_model_path  # noqa: E402

LIGHT_WITH_BN = ("light_resnet50", "light_densenet121", "light_inception_v2", "light_shufflenet")
NOTES = {
    "densenet121": "pre-activation (BN -> ReLU -> Conv): the scale moved into the Conv, the shift an Add before it",
    "light_densenet121": "BN read twice (a Mul beside the Conv): no fold or move; `--standalone scale-shift` covers it",
    "torch bn-relu-conv": "pre-activation: the scale moved into the Conv (`--no-activation-moves` keeps the BN)",
    "torch arcface-head": "BN2d folds forward into the Linear, BN1d backward into it",
}


def batchnorms(model: onnx.ModelProto) -> int:
    return count_nodes(model.graph, "BatchNormalization")


def onnxruntime_left(model: onnx.ModelProto) -> int:
    with tempfile.TemporaryDirectory() as tmp:
        options = ort.SessionOptions()
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED
        options.optimized_model_filepath = str(Path(tmp) / "ort.onnx")
        ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
        return batchnorms(onnx.load(options.optimized_model_filepath))


def onnxsim_left(model: onnx.ModelProto) -> int | str:
    try:
        import onnxsim
    except ImportError:
        return "n/a (onnxsim not installed)"
    simplified, _ = onnxsim.simplify(model)
    return batchnorms(simplified)


def torch_models() -> dict[str, tuple[onnx.ModelProto, int]]:
    """name -> (export with every BN kept, BN left by the default dynamo export)."""
    try:
        import torch
    except ImportError:
        return {}
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from test_docs_exporting import MODULES, input_for
    from test_docs_exporting import build as build_module

    models = {}
    for name in MODULES:
        module, x = build_module(name), input_for(name)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            kept = torch.onnx.export(module, (x,), dynamo=True, optimize=False, verbose=False).model_proto
            default = torch.onnx.export(module, (x,), dynamo=True, verbose=False).model_proto
        models[f"torch {name}"] = (kept, batchnorms(default))
    return models


def all_models(keras_only: bool = False) -> dict[str, tuple[Callable[[], onnx.ModelProto], int | None]]:
    """keras_only: only the Keras rows (a re-run of those in a venv with tensorflow)."""
    models: dict[str, tuple[Callable[[], onnx.ModelProto], int | None]] = {}
    if not keras_only:
        models.update({name: (lambda name=name: build(name, **spec(name).small), None) for name in names()})
        light = default_model_path().parent
        for name in LIGHT_WITH_BN:
            models[name] = (lambda name=name: onnx.load(str(light / f"{name}.onnx")), None)
        for name, (model, dynamo) in torch_models().items():
            models[name] = (lambda model=model: model, dynamo)
    keras_dir = os.environ.get("BNFUSE_KERAS_ONNX")  # written by bench/keras_apps.py
    for path in sorted(Path(keras_dir).glob("keras*.onnx")) if keras_dir else []:
        models[path.stem] = (lambda path=path: onnx.load(str(path)), None)
    return models


def row(name: str, load: Callable[[], onnx.ModelProto], dynamo: int | None) -> list[str]:
    model = load()
    model.ir_version = min(model.ir_version, 10)
    _, report = bnfuse.optimize(model, check=True)
    assert report.check is not None and report.check.passed
    cells = [
        name,
        str(batchnorms(model)),
        str(report.batchnorms_after),
        str(report.forward_folds),
        "—" if dynamo is None else str(dynamo),
        str(onnxruntime_left(model)),
        str(onnxsim_left(model)),
        NOTES.get(name, ""),
    ]
    return cells


def run(quick: bool = False, keras_only: bool = False) -> Section:
    header = (
        "| model | BN in | bnfuse left | forward folds | dynamo exporter left | onnxruntime EXTENDED left "
        "| onnxsim left | note |"
    )
    lines = [header, "|---|---|---|---|---|---|---|---|"]
    rows = {}
    for name, (load, dynamo) in all_models(keras_only).items():
        if quick and name.startswith("light_") and name != "light_resnet50":
            continue
        cells = row(name, load, dynamo)
        rows[name] = cells
        lines.append("| " + " | ".join(cells) + " |")
    not_worse = all(int(c[2]) <= min(int(x) for x in (c[4], c[5], c[6]) if x.isdigit()) for c in rows.values())
    markdown = "\n".join(
        [
            f"{machine_description()}. bnfuse: `bnfuse.optimize(model, check=True)` (every result proven in "
            "onnxruntime). onnxruntime: session with ORT_ENABLE_EXTENDED and optimized_model_filepath. onnxsim: "
            "`onnxsim.simplify`. PyTorch modules (torch 2.13.0, onnxscript 0.7.2): input exported with "
            "`dynamo=True, optimize=False`; the dynamo column is the default export's BN count.",
            "",
            *lines,
            "",
            f"bnfuse leaves no more BN than every other tool on every model: {'yes' if not_worse else '**no**'}.",
            "Keras rows (keras{2,3}_<app>_opt: tf2onnx optimizers on; _noopt: off) only with BNFUSE_KERAS_ONNX set."
            if not os.environ.get("BNFUSE_KERAS_ONNX")
            else "Keras: tensorflow / tf-keras / tf2onnx from `.[keras]`, converted by bench/keras_apps.py.",
        ]
    )
    return Section(
        "Fold coverage: BatchNormalization left by each tool",
        "python bench/bench_fold_coverage.py",
        markdown,
        series={"rows": rows},
    )


if __name__ == "__main__":
    # --keras-only: the rows of BNFUSE_KERAS_ONNX's models alone
    print(run(quick="--quick" in sys.argv, keras_only="--keras-only" in sys.argv).markdown)
