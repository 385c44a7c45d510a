"""Structural re-parameterization on timm's re-parameterizable models: `bnfuse optimize` on the training-form export
against the deploy form (``timm.utils.model.reparameterize_model``), onnxruntime's optimizer and onnxsim.

Per model (smallest variant of each family, random weights from seed 0 and random BN statistics, eval mode, batch 1,
TorchScript exporter, opset 17): Conv and BatchNormalization counts of the raw export, `bnfuse optimize` of it (file
to file, with ``--check``), onnxruntime's optimized model (ORT_ENABLE_EXTENDED, saved; its FusedConv counted as
Conv), onnxsim's and the deploy export; bnfuse's output against PyTorch's (max |diff| / max |PyTorch|); onnxruntime
latency of the bnfuse model over the deploy model's at 1 thread: the median of per-round ratios, the models timed in
turn in each round (interleaved, so machine load hits both alike), beside a second session of the deploy model over
the first (the A/A ratio: what noise alone gives).

    python bench/bench_reparam.py [--models repvgg_a0,mobileone_s0] [--rounds 21] [--json out.json]
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import tempfile
import time
import warnings
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import onnx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import archs  # noqa: E402
from bench.common import Section, machine_description, markdown_table, today  # noqa: E402
from bnfuse.passes.optimize_file import optimize_file  # noqa: E402

# the smallest variant of every timm family whose reparameterize_model() merges parallel branches, and the input
# side it exports at (128 as in issue 35 where the model takes it)
MODELS = {
    "repvgg_a0": 128,
    "mobileone_s0": 128,
    "repghostnet_050": 128,
    "repvit_m0_9": 128,
    "fastvit_t8": 128,
    "fastvit_sa12": 128,  # the smallest with attention stages and RepCPE
    "ghostnetv3_050": 128,
    "lcnetv2_small": 128,
    "shvit_s1": 224,
    "iformer_t": 224,
    "levit_128s": 224,  # issue 35's third model: BatchNorm1d after token MatMuls (timm gives it no deploy form)
}
CONV_OPS = ("Conv", "FusedConv", "NhwcFusedConv")


def randomize_batchnorms(net: Any, seed: int = 0) -> Any:
    """Give every BatchNorm non-trivial statistics and affine parameters (a fresh model's are the identity map, and
    its merges would sum zero biases): seeded, in place; returns ``net``."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for module in net.modules():
            if isinstance(module, torch.nn.modules.batchnorm._BatchNorm) and module.running_mean is not None:
                c = module.running_mean.shape[0]
                module.running_mean.copy_(0.2 * torch.randn(c, generator=generator))
                module.running_var.copy_(0.5 + torch.rand(c, generator=generator))
                if module.weight is not None:
                    module.weight.copy_(0.5 + torch.rand(c, generator=generator))
                    module.bias.copy_(0.2 * torch.randn(c, generator=generator))
    return net


def export(net: Any, side: int, path: Path) -> None:
    import torch

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(net, (torch.zeros(1, 3, side, side),), str(path), dynamo=False, opset_version=17,
                          input_names=["x"], output_names=["y"])  # fmt: skip


def counts(path: Path) -> tuple[int, int]:
    ops = Counter(n.op_type for n in onnx.load(str(path), load_external_data=False).graph.node)
    return sum(ops[o] for o in CONV_OPS), ops["BatchNormalization"]


def conv_layers(path: Path) -> list[tuple]:
    """Every Conv's geometry and weight shape, sorted: two models with the same list run the same Convs."""
    model = onnx.load(str(path), load_external_data=False)
    shapes = {t.name: tuple(t.dims) for t in model.graph.initializer}
    layers = []
    for node in model.graph.node:
        if node.op_type == "Conv":
            attrs = {a.name: tuple(a.ints) if a.ints else a.i for a in node.attribute if a.name != "kernel_shape"}
            defaults = {"group": 1, "strides": (1, 1), "dilations": (1, 1), "pads": (0, 0, 0, 0)}
            layers.append((shapes.get(node.input[1]), tuple(sorted({**defaults, **attrs}.items()))))
    return sorted(layers, key=repr)


def session(path: Path, *, level: str = "all", save: Path | None = None) -> Any:
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    options.inter_op_num_threads = 1
    options.graph_optimization_level = {
        "all": ort.GraphOptimizationLevel.ORT_ENABLE_ALL,
        "extended": ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED,
    }[level]
    if save is not None:
        options.optimized_model_filepath = str(save)
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


def latency_ratio(first: Path, second: Path, x: np.ndarray, rounds: int) -> tuple[float, float, float, float]:
    """(median of per-round time ratios first / second, the same for a second session of ``second`` (an A/A
    ratio: what the machine's noise alone gives), median ms of first, of second). Each round times a block of runs
    of each session (its median run), in an order that alternates from round to round."""
    sessions = [session(first), session(second), session(second)]
    for s in sessions:
        for _ in range(3):
            s.run(None, {"x": x})
    blocks: list[list[float]] = [[], [], []]
    for index in range(rounds):
        order = [0, 1, 2] if index % 2 == 0 else [2, 1, 0]
        for which in order:
            samples = []
            for _ in range(5):
                start = time.perf_counter()
                sessions[which].run(None, {"x": x})
                samples.append(time.perf_counter() - start)
            blocks[which].append(statistics.median(samples))
    ratio = statistics.median(a / b for a, b in zip(blocks[0], blocks[1], strict=True))
    same = statistics.median(c / b for c, b in zip(blocks[2], blocks[1], strict=True))
    return ratio, same, 1e3 * statistics.median(blocks[0]), 1e3 * statistics.median(blocks[1])


def measure(name: str, side: int, work: Path, rounds: int) -> dict[str, Any]:
    import onnxsim
    import torch
    from timm.utils.model import reparameterize_model

    net = randomize_batchnorms(archs.create(name, classes=1000))
    raw, deploy, optimized = work / f"{name}.onnx", work / f"{name}.deploy.onnx", work / f"{name}.bnfuse.onnx"
    export(net, side, raw)
    export(reparameterize_model(copy.deepcopy(net)), side, deploy)
    started = time.perf_counter()
    report = optimize_file(raw, optimized, check=True)
    elapsed = time.perf_counter() - started
    ort_saved = work / f"{name}.ort.onnx"
    session(raw, level="extended", save=ort_saved)
    simplified, _ = onnxsim.simplify(onnx.load(str(raw)))
    onnx.save(simplified, str(work / f"{name}.onnxsim.onnx"))
    x = np.random.default_rng(0).standard_normal((1, 3, side, side)).astype(np.float32)
    with torch.no_grad():
        reference = net(torch.from_numpy(x)).numpy().astype(np.float64)
    got = session(optimized).run(None, {"x": x})[0].astype(np.float64)
    error = float(np.max(np.abs(got - reference)) / max(float(np.max(np.abs(reference))), 1e-12))
    ratio, same, ms_bnfuse, ms_deploy = latency_ratio(optimized, deploy, x, rounds)
    merged = [m for m in report.merges if m.status == "merged"]
    return {
        "model": name,
        "side": side,
        "raw": counts(raw),
        "bnfuse": counts(optimized),
        "onnxruntime": counts(ort_saved),
        "onnxsim": counts(work / f"{name}.onnxsim.onnx"),
        "deploy": counts(deploy),
        "same_convs_as_deploy": conv_layers(optimized) == conv_layers(deploy),
        "merges": len(merged),
        "refused": len(report.merges) - len(merged),
        "refusals": sorted({m.reason or "" for m in report.merges if m.status != "merged"}),
        "check": report.check.passed if report.check is not None else None,
        "rel_error_vs_torch": error,
        "latency_ratio": ratio,
        "deploy_vs_itself": same,
        "ms_bnfuse": ms_bnfuse,
        "ms_deploy": ms_deploy,
        "optimize_s": elapsed,
    }


def table(results: list[dict[str, Any]]) -> str:
    header = ["model (side)", "Conv raw / bnfuse / ORT / onnxsim / deploy", "BN raw / bnfuse / ORT / onnxsim / deploy"]
    header += [
        "same Convs as deploy",
        "merges (refused)",
        "check",
        "max rel vs PyTorch",
        "ORT ms bnfuse / deploy",
        "latency bnfuse / deploy",
    ]
    header += ["deploy / deploy (noise)"]
    rows = []
    for r in results:
        if "error" in r:
            rows.append([f"{r['model']}", r["error"], "", "", "", "", "", "", "", ""])
            continue
        kinds = ("raw", "bnfuse", "onnxruntime", "onnxsim", "deploy")
        rows.append([
            f"{r['model']} ({r['side']})",
            " / ".join(str(r[k][0]) for k in kinds),
            " / ".join(str(r[k][1]) for k in kinds),
            "yes" if r["same_convs_as_deploy"] else "no",
            f"{r['merges']} ({r['refused']})",
            "passed" if r["check"] else "FAILED",
            f"{r['rel_error_vs_torch']:.1e}",
            f"{r['ms_bnfuse']:.2f} / {r['ms_deploy']:.2f}",
            f"{r['latency_ratio']:.3f}x",
            f"{r['deploy_vs_itself']:.3f}x",
        ])  # fmt: skip
    return markdown_table(header, rows)


def measure_all(models: list[str], rounds: int) -> list[dict[str, Any]]:
    """Every model's row (a model that does not build or export gets a row saying why)."""
    archs.import_torchvision()
    results = []
    with tempfile.TemporaryDirectory() as scratch:
        for name in models:
            started = time.perf_counter()
            try:
                result = measure(name, MODELS.get(name, 128), Path(scratch), rounds)
            except Exception as exc:  # a model that does not export or build: its row says why
                result = {"model": name, "error": f"{type(exc).__name__}: {' '.join(str(exc).split())[:160]}"}
            result["seconds"] = round(time.perf_counter() - started, 1)
            results.append(result)
            print(json.dumps(result), file=sys.stderr, flush=True)
    return results


def run(quick: bool = False) -> Section:
    """bench/run_all.py's entry: every family (quick: RepVGG and MobileOne, 5 rounds)."""
    models, rounds = (["repvgg_a0", "mobileone_s0"], 5) if quick else (list(MODELS), 21)
    return Section(
        "Structural re-parameterization against timm's deploy export",
        f"python bench/bench_reparam.py --models {','.join(models)} --rounds {rounds}",
        table(measure_all(models, rounds)),
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(MODELS), help="comma-separated timm names")
    parser.add_argument("--rounds", type=int, default=21, help="interleaved latency rounds per model")
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args()
    results = measure_all(args.models.split(","), args.rounds)
    print(f"{today()}, {machine_description()}\n")
    print(table(results))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
