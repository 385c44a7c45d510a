"""Time of the BatchNormalization folding pass against onnxsim, onnxoptimizer and onnxruntime's optimizer.

Every contender goes file to file on the same ResNet-50-sized model with real-sized random weights
(load, rewrite, save), measured round-robin in one run; bnfuse's in-memory pass time is listed too. A
width series gives (model parameter bytes, pass seconds) for a plot of time against model size.

    python bench/bench_optimize.py [--quick]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import Section, Target, interleaved_medians, machine_description, markdown_table, today  # noqa: E402
from bnfuse.io import ort_compatible, save_model  # noqa: E402
from bnfuse.passes.optimize import count_nodes, optimize  # noqa: E402

STAGES = [(64, 3), (128, 4), (256, 6), (512, 3)]  # ResNet-50: bottleneck width, blocks per stage


def resnet50_model(width: float = 1.0, seed: int = 0) -> onnx.ModelProto:
    """A ResNet-50-shaped Conv-BN-Relu graph (bnfuse.models' builder when present), float32 random weights."""
    if width == 1.0:
        try:
            from bnfuse.models import build  # written by the models helper; optional here

            return build("resnet50")
        except (ImportError, AttributeError, TypeError, KeyError, ValueError):
            pass
    return _resnet50_like(width, seed)


def _resnet50_like(width: float, seed: int) -> onnx.ModelProto:
    rng = np.random.default_rng(seed)
    nodes: list[onnx.NodeProto] = []
    inits: list[onnx.TensorProto] = []
    counter = iter(range(10**6))

    def conv_bn(x: str, c_in: int, c_out: int, k: int, stride: int, relu: bool) -> str:
        i = next(counter)
        w = rng.standard_normal((c_out, c_in, k, k), dtype=np.float32) * np.float32(np.sqrt(2 / (c_in * k * k)))
        inits.append(numpy_helper.from_array(w, f"conv{i}_w"))
        params = [
            rng.uniform(0.5, 1.5, c_out),
            rng.normal(0, 0.1, c_out),
            rng.normal(0, 0.1, c_out),
            rng.uniform(0.5, 2.0, c_out),
        ]
        names = [f"bn{i}_{p}" for p in ("scale", "bias", "mean", "var")]
        inits.extend(numpy_helper.from_array(p.astype(np.float32), n) for p, n in zip(params, names, strict=True))
        pad = k // 2
        nodes.append(
            helper.make_node(
                "Conv", [x, f"conv{i}_w"], [f"conv{i}"], name=f"conv{i}", strides=[stride] * 2, pads=[pad] * 4
            )
        )
        nodes.append(helper.make_node("BatchNormalization", [f"conv{i}", *names], [f"bn{i}"], name=f"bn{i}"))
        if not relu:
            return f"bn{i}"
        nodes.append(helper.make_node("Relu", [f"bn{i}"], [f"relu{i}"]))
        return f"relu{i}"

    stem = max(8, int(64 * width))
    x = conv_bn("input", 3, stem, 7, 2, True)
    nodes.append(helper.make_node("MaxPool", [x], ["pool"], kernel_shape=[3, 3], strides=[2, 2], pads=[1] * 4))
    x, channels = "pool", stem
    for stage, (base, blocks) in enumerate(STAGES):
        mid = max(8, int(base * width))
        out = mid * 4
        for block in range(blocks):
            stride = 2 if block == 0 and stage > 0 else 1
            y = conv_bn(x, channels, mid, 1, 1, True)
            y = conv_bn(y, mid, mid, 3, stride, True)
            y = conv_bn(y, mid, out, 1, 1, False)
            shortcut = conv_bn(x, channels, out, 1, stride, False) if block == 0 else x
            name = f"res{stage}_{block}"
            nodes.append(helper.make_node("Add", [y, shortcut], [f"{name}_sum"]))
            nodes.append(helper.make_node("Relu", [f"{name}_sum"], [name]))
            x, channels = name, out
    nodes.append(helper.make_node("GlobalAveragePool", [x], ["gap"]))
    nodes.append(helper.make_node("Flatten", ["gap"], ["flat"]))
    fc = rng.standard_normal((channels, 1000), dtype=np.float32) * np.float32(0.01)
    inits += [numpy_helper.from_array(fc, "fc_w"), numpy_helper.from_array(np.zeros(1000, np.float32), "fc_b")]
    nodes.append(helper.make_node("Gemm", ["flat", "fc_w", "fc_b"], ["logits"]))
    graph = helper.make_graph(
        nodes,
        "resnet50_like",
        [helper.make_tensor_value_info("input", TensorProto.FLOAT, [1, 3, 224, 224])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [1, 1000])],
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    return ort_compatible(model)


def parameter_bytes(model: onnx.ModelProto) -> int:
    return sum(len(t.raw_data) or numpy_helper.to_array(t).nbytes for t in model.graph.initializer)


def _contenders(source: Path, work: Path) -> dict[str, Callable[[], object]]:
    import onnxoptimizer
    import onnxruntime as ort
    import onnxsim

    def bnfuse_file() -> None:
        model, _ = optimize(source)
        save_model(model, work / "bnfuse.onnx")

    def ort_session(level: ort.GraphOptimizationLevel, name: str) -> Callable[[], None]:
        def run() -> None:
            options = ort.SessionOptions()
            options.graph_optimization_level = level
            options.optimized_model_filepath = str(work / name)
            options.log_severity_level = 3
            ort.InferenceSession(str(source), options, providers=["CPUExecutionProvider"])

        return run

    def onnxsim_file() -> None:
        model, ok = onnxsim.simplify(onnx.load(str(source)))
        assert ok
        onnx.save_model(model, str(work / "onnxsim.onnx"))

    def onnxoptimizer_file() -> None:
        model = onnxoptimizer.optimize(onnx.load(str(source)), ["fuse_bn_into_conv"])
        onnx.save_model(model, str(work / "onnxoptimizer.onnx"))

    return {
        "bnfuse optimize": bnfuse_file,
        "onnxruntime ORT_ENABLE_BASIC": ort_session(ort.GraphOptimizationLevel.ORT_ENABLE_BASIC, "ort_basic.onnx"),
        "onnxruntime ORT_ENABLE_EXTENDED": ort_session(
            ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED, "ort_extended.onnx"
        ),
        "onnxsim": onnxsim_file,
        "onnxoptimizer fuse_bn_into_conv": onnxoptimizer_file,
    }


def _in_memory_contenders(model: onnx.ModelProto) -> dict[str, Callable[[], object]]:
    """The same rewrites without file I/O; onnxruntime gets the serialized bytes and writes no file."""
    import onnxoptimizer
    import onnxruntime as ort
    import onnxsim

    data = model.SerializeToString()

    def ort_session(level: ort.GraphOptimizationLevel) -> Callable[[], None]:
        def run() -> None:
            options = ort.SessionOptions()
            options.graph_optimization_level = level
            options.log_severity_level = 3
            ort.InferenceSession(data, options, providers=["CPUExecutionProvider"])

        return run

    return {
        "bnfuse optimize": lambda: optimize(model),
        "onnxruntime ORT_ENABLE_BASIC": ort_session(ort.GraphOptimizationLevel.ORT_ENABLE_BASIC),
        "onnxruntime ORT_ENABLE_EXTENDED": ort_session(ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED),
        "onnxsim": lambda: onnxsim.simplify(model),
        "onnxoptimizer fuse_bn_into_conv": lambda: onnxoptimizer.optimize(model, ["fuse_bn_into_conv"]),
    }


def _batchnorms_left(work: Path) -> dict[str, int]:
    files = {
        "bnfuse optimize": "bnfuse.onnx",
        "onnxruntime ORT_ENABLE_BASIC": "ort_basic.onnx",
        "onnxruntime ORT_ENABLE_EXTENDED": "ort_extended.onnx",
        "onnxsim": "onnxsim.onnx",
        "onnxoptimizer fuse_bn_into_conv": "onnxoptimizer.onnx",
    }
    return {name: count_nodes(onnx.load(str(work / f)).graph, "BatchNormalization") for name, f in files.items()}


def _ratio_rows(times: dict[str, float], left: dict[str, int] | None) -> list[list[object]]:
    ours = times["bnfuse optimize"]
    return [
        [name, f"{seconds * 1000:.0f}", f"{ours / seconds:.2f}x", "" if left is None else left[name]]
        for name, seconds in times.items()
    ]


def run(quick: bool = False) -> Section:
    repeat = 3 if quick else 7
    model = resnet50_model(1.0)
    size = parameter_bytes(model)
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        source = save_model(model, work / "resnet50.onnx")
        files = interleaved_medians(_contenders(source, work), repeat=repeat)
        left = _batchnorms_left(work)
    memory = interleaved_medians(_in_memory_contenders(model), repeat=repeat)
    header = ["contender", "median ms", "bnfuse time / its time", "BN left"]
    file_table = markdown_table(header, _ratio_rows(files, left))
    memory_table = markdown_table(header[:3], [row[:3] for row in _ratio_rows(memory, None)])

    series = []
    widths = [0.25, 0.5, 1.0] if quick else [0.25, 0.5, 0.75, 1.0, 1.25, 1.5]
    for width in widths:
        sized = _resnet50_like(width, seed=1)
        nbytes = parameter_bytes(sized)
        seconds = interleaved_medians({"w": lambda m=sized: optimize(m)}, repeat=repeat)["w"]
        series.append((nbytes, seconds))
    series_table = markdown_table(
        ["parameter MB", "bnfuse in-memory pass ms", "MB/s"],
        [[f"{b / 1e6:.1f}", f"{s * 1000:.0f}", f"{b / 1e6 / s:.0f}"] for b, s in series],
    )
    ours_mem = memory["bnfuse optimize"]
    markdown = "\n\n".join(
        [
            f"ResNet-50-shaped Conv-BN model, {size / 1e6:.1f} MB float32 parameters, "
            f"{count_nodes(model.graph, 'BatchNormalization')} BatchNormalization. "
            f"{machine_description()}, {today()}. Medians of {repeat} round-robin runs.",
            "File to file (load, rewrite, write the optimized model; onnxruntime: session with "
            "optimized_model_filepath):",
            file_table,
            "In memory (ModelProto in, ModelProto out; onnxruntime: session from serialized bytes, no file "
            "written, session initialization included):",
            memory_table,
            f"bnfuse in memory / onnxruntime EXTENDED in memory: "
            f"{ours_mem / memory['onnxruntime ORT_ENABLE_EXTENDED']:.2f}; / onnxsim in memory: "
            f"{ours_mem / memory['onnxsim']:.2f} (target <= 0.25).",
            "Pass time against model size (ResNet-50 shape, widths scaled):",
            series_table,
        ]
    )
    return Section(
        title="Inference pass: BatchNormalization folding time",
        command="python bench/bench_optimize.py" + (" --quick" if quick else ""),
        markdown=markdown,
        series={"pass_time": series, "file_to_file_s": files, "in_memory_s": memory},
        targets=[
            Target(f"optimize ResNet-50 {how} / {peer}", times["bnfuse optimize"] / times[key], 0.25)
            for how, times in (("in memory", memory), ("file to file", files))
            for peer, key in (("onnxruntime", "onnxruntime ORT_ENABLE_EXTENDED"), ("onnxsim", "onnxsim"))
        ],
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    start = time.perf_counter()
    section = run(quick=args.quick)
    print(f"## {section.title}\n\n`{section.command}`\n\n{section.markdown}\n")
    print(f"(benchmark took {time.perf_counter() - start:.0f} s)", file=sys.stderr)


if __name__ == "__main__":
    main()
