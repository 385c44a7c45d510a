"""Time of the BatchNormalization folding pass against onnxsim, onnxoptimizer and onnxruntime's optimizer.

Every contender goes file to file on bnfuse.models' ResNet-50 (real-sized seeded random weights, non-trivial
BN statistics): load, rewrite, save, measured round-robin in one run; the in-memory times are listed too. A
width series gives (model parameter bytes, pass seconds) for a plot of time against model size.

    python bench/bench_optimize.py [--quick]
"""

from __future__ import annotations

import shutil
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import onnx
from onnx import numpy_helper

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import Section, Target, interleaved_medians, machine_description, markdown_table, today  # noqa: E402
from bench.common import main as bench_main
from bnfuse.io import Staging, save_model  # noqa: E402
from bnfuse.models import build, parameter_bytes  # noqa: E402
from bnfuse.passes.optimize import count_nodes, optimize  # noqa: E402
from bnfuse.passes.optimize_file import optimize_file  # noqa: E402

FILE_FLOOR = "floor: copy the file (no rewrite)"
MEMORY_FLOOR = "floor: every weight out of protobuf and back"


def _contenders(source: Path, work: Path) -> dict[str, Callable[[], object]]:
    import onnxoptimizer
    import onnxruntime as ort
    import onnxsim

    def bnfuse_file() -> None:
        optimize_file(source, work / "bnfuse.onnx")

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

    def copy_floor() -> None:
        """What any file-to-file rewrite pays at least: read the model, write as many bytes atomically."""
        staging = Staging()
        shutil.copyfile(source, staging.stage(work / "floor.onnx"))  # sendfile: the kernel copies
        staging.commit()

    return {
        "bnfuse optimize": bnfuse_file,
        "onnxruntime ORT_ENABLE_BASIC": ort_session(ort.GraphOptimizationLevel.ORT_ENABLE_BASIC, "ort_basic.onnx"),
        "onnxruntime ORT_ENABLE_EXTENDED": ort_session(
            ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED, "ort_extended.onnx"
        ),
        "onnxsim": onnxsim_file,
        "onnxoptimizer fuse_bn_into_conv": onnxoptimizer_file,
        FILE_FLOOR: copy_floor,
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

    def protobuf_floor() -> None:
        """What any ModelProto-to-ModelProto rewrite pays at least: every weight out of protobuf and back in."""
        out = onnx.ModelProto()
        for tensor in model.graph.initializer:
            out.graph.initializer.add(name=tensor.name, raw_data=numpy_helper.to_array(tensor).tobytes())

    return {
        "bnfuse optimize": lambda: optimize(model),
        "onnxruntime ORT_ENABLE_BASIC": ort_session(ort.GraphOptimizationLevel.ORT_ENABLE_BASIC),
        "onnxruntime ORT_ENABLE_EXTENDED": ort_session(ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED),
        "onnxsim": lambda: onnxsim.simplify(model),
        "onnxoptimizer fuse_bn_into_conv": lambda: onnxoptimizer.optimize(model, ["fuse_bn_into_conv"]),
        MEMORY_FLOOR: protobuf_floor,
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
        [name, f"{seconds * 1000:.0f}", f"{ours / seconds:.2f}x", "" if left is None else left.get(name, "")]
        for name, seconds in times.items()
    ]


def run(quick: bool = False) -> Section:
    repeat = 3 if quick else 7
    model = build("resnet50")
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

    # Time against size: bnfuse and onnxruntime's session optimizer (from bytes, EXTENDED) side by side.
    peers = {"bnfuse optimize": "bnfuse optimize (in memory)", "onnxruntime ORT_ENABLE_EXTENDED": "onnxruntime"}
    lines: dict[str, list[tuple[int, float]]] = {label: [] for label in peers.values()}
    widths = [0.25, 0.5, 1.0] if quick else [0.25, 0.5, 0.75, 1.0, 1.25, 1.5]
    for width in widths:
        sized = build("resnet50", width=width, seed=1)
        nbytes = parameter_bytes(sized)
        contenders = _in_memory_contenders(sized)
        times = interleaved_medians({name: contenders[name] for name in peers}, repeat=repeat + 2)
        for name, label in peers.items():
            lines[label].append((nbytes, times[name]))
    series_table = markdown_table(
        ["parameter MB", "bnfuse in-memory pass ms", "MB/s", "onnxruntime EXTENDED session ms", "bnfuse / it"],
        [
            [f"{b / 1e6:.1f}", f"{s * 1000:.0f}", f"{b / 1e6 / s:.0f}", f"{o * 1000:.0f}", f"{s / o:.2f}x"]
            for (b, s), (_, o) in zip(*lines.values(), strict=True)
        ],
    )
    ours_mem = memory["bnfuse optimize"]
    markdown = "\n\n".join(
        [
            f"bnfuse.models ResNet-50 (25.6 M parameters), {size / 1e6:.1f} MB float32, "
            f"{count_nodes(model.graph, 'BatchNormalization')} BatchNormalization. "
            f"{machine_description()}, {today()}. "
            f"Medians of {repeat} round-robin runs ({repeat + 2} for the size series).",
            "File to file (load, rewrite, write the optimized model; bnfuse: `optimize_file`, what `bnfuse "
            "optimize` runs, weights read through a memory map and written from their buffers; onnxruntime: "
            "session with optimized_model_filepath):",
            file_table,
            "In memory (ModelProto in, ModelProto out; onnxruntime: session from serialized bytes, no file "
            "written, session initialization included):",
            memory_table,
            f"The floors are no optimizer: the least a rewrite of this kind costs. Floor / onnxruntime "
            f"EXTENDED: file to file {files[FILE_FLOOR] / files['onnxruntime ORT_ENABLE_EXTENDED']:.2f}, in memory "
            f"{memory[MEMORY_FLOOR] / memory['onnxruntime ORT_ENABLE_EXTENDED']:.2f}.",
            f"bnfuse in memory / onnxruntime EXTENDED in memory: "
            f"{ours_mem / memory['onnxruntime ORT_ENABLE_EXTENDED']:.2f}; / onnxsim in memory: "
            f"{ours_mem / memory['onnxsim']:.2f} (target <= 0.25).",
            "Pass time against model size (bnfuse.models ResNet-50, widths scaled):",
            series_table,
        ]
    )
    return Section(
        title="Inference pass: BatchNormalization folding time",
        command="python bench/bench_optimize.py" + (" --quick" if quick else ""),
        markdown=markdown,
        series={"pass_time": lines, "file_to_file_s": files, "in_memory_s": memory},
        targets=[
            Target(f"optimize ResNet-50 {how} / {peer}", times["bnfuse optimize"] / times[key], 0.25)
            for how, times in (("in memory", memory), ("file to file", files))
            for peer, key in (("onnxruntime", "onnxruntime ORT_ENABLE_EXTENDED"), ("onnxsim", "onnxsim"))
        ],
    )


if __name__ == "__main__":
    bench_main(run, __doc__.splitlines()[0])
