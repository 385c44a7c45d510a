"""Peak memory of `bnfuse optimize` on a large model, with and without --check.

    python bench/bench_memory.py [--quick]

The model: a chain of Gemm (4096 x 4096 float32 weights, 64 MiB each) + BatchNormalization + Relu, 1.5 GiB
in all (--quick: 192 MiB), written as one protobuf file. Each command runs in a fresh subprocess; its peak
resident set size is the child's own ru_maxrss (os.wait4), so the Python interpreter, onnx, NumPy and
onnxruntime are counted as a user would see them. Targets (issue 11): peak RSS at most 1.5x the model's
size without --check and 3x with it.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import Section, Target, machine_description, markdown_table, today  # noqa: E402

WIDTH = 4096
MIB = 2**20


def write_gemm_chain(path: Path, layers: int, width: int = WIDTH) -> int:
    """Write the benchmark model at ``path`` (weights spliced from their buffers); returns its size in bytes."""
    import onnx
    from onnx import TensorProto, helper

    from bnfuse.protowire import PayloadStore, write_model

    store = PayloadStore()
    model = helper.make_model(onnx.GraphProto(name="gemm_chain"), opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    graph = model.graph  # references are bound to these very TensorProtos: add them in place, never copy
    rng = np.random.default_rng(0)
    x = "x"
    for i in range(layers):
        weight = (rng.standard_normal((width, width), dtype=np.float32) / np.float32(np.sqrt(width))).astype(np.float32)
        store.add(graph.initializer, f"w{i}", weight, TensorProto.FLOAT)
        stats = {
            "scale": rng.uniform(0.5, 1.5, width),
            "bias": rng.normal(0, 0.1, width),
            "mean": rng.normal(0, 0.1, width),
            "var": rng.uniform(0.5, 1.5, width),
        }
        for key, values in stats.items():
            store.add(graph.initializer, f"bn{i}.{key}", values.astype(np.float32), TensorProto.FLOAT)
        graph.node.extend(
            [
                helper.make_node("Gemm", [x, f"w{i}"], [f"g{i}"], name=f"gemm{i}", transB=1),
                helper.make_node(
                    "BatchNormalization", [f"g{i}", *(f"bn{i}.{k}" for k in stats)], [f"b{i}"], name=f"bn{i}"
                ),
                helper.make_node("Relu", [f"b{i}"], [f"r{i}"], name=f"relu{i}"),
            ]
        )
        x = f"r{i}"
    graph.input.append(helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", width]))
    graph.output.append(helper.make_tensor_value_info(x, TensorProto.FLOAT, ["n", width]))
    return write_model(model, store, path)


def peak_rss(argv: list[str]) -> tuple[int, float, int]:
    """(peak RSS in bytes, wall seconds, exit code) of ``argv`` run as a child process."""
    start = time.perf_counter()
    child = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=_env())
    _, status, usage = os.wait4(child.pid, 0)
    elapsed = time.perf_counter() - start
    child.returncode = os.waitstatus_to_exitcode(status)
    if child.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} exited {child.returncode}: {child.stderr.read().decode()[-500:]}")
    return usage.ru_maxrss * 1024, elapsed, child.returncode  # Linux reports kilobytes


def _env() -> dict[str, str]:
    root = Path(__file__).resolve().parents[1]
    return {**os.environ, "PYTHONPATH": f"{root}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}


def run(quick: bool = False) -> Section:
    layers = 3 if quick else 24
    with tempfile.TemporaryDirectory(prefix="bnfuse-bench-memory-") as scratch:
        model = Path(scratch) / "gemm_chain.onnx"
        # Written by a child: ru_maxrss counts what a child inherits at fork, so this process stays small.
        subprocess.run([sys.executable, __file__, "--write", str(model), str(layers)], check=True, env=_env())
        size = model.stat().st_size
        base = [sys.executable, "-m", "bnfuse.cli", "optimize", str(model), "-o", str(Path(scratch) / "out.onnx")]
        commands = {
            "bnfuse optimize": base,
            "bnfuse optimize --check": [*base, "--check"],
            "python -c 'import bnfuse.cli, onnxruntime' (floor)": [
                sys.executable,
                "-c",
                "import bnfuse.cli, bnfuse.passes.optimize_file, bnfuse.passes.check.compare, onnxruntime",
            ],
        }
        results = {name: peak_rss(argv) for name, argv in commands.items()}
    rows = [
        [name, f"{rss / MIB:,.0f}", f"{rss / size:.2f}x", f"{seconds:.1f}"]
        for name, (rss, seconds, _) in results.items()
    ]
    markdown = (
        f"Gemm + BatchNormalization + Relu chain, {layers} layers of {WIDTH} x {WIDTH} float32: "
        f"one {size / MIB:,.0f} MiB protobuf file. {machine_description()}, {today()}. Peak RSS is the "
        "child's ru_maxrss; one run each (memory, unlike time, does not need a median).\n\n"
        + markdown_table(["command", "peak RSS MiB", "peak RSS / model size", "wall s"], rows)
    )
    plain, checked = results["bnfuse optimize"][0], results["bnfuse optimize --check"][0]
    return Section(
        title="Inference pass: peak memory of `bnfuse optimize`",
        command="python bench/bench_memory.py" + (" --quick" if quick else ""),
        markdown=markdown,
        series={"model_bytes": size, "peak_rss_bytes": {name: r[0] for name, r in results.items()}},
        targets=[
            Target(f"optimize {size / MIB:,.0f} MiB model: peak RSS / model size", plain / size, 1.5),
            Target(f"optimize --check {size / MIB:,.0f} MiB model: peak RSS / model size", checked / size, 3.0),
        ],
    )


if __name__ == "__main__":
    if sys.argv[1:2] == ["--write"]:
        write_gemm_chain(Path(sys.argv[2]), int(sys.argv[3]))
    else:
        from bench.common import main

        main(run, __doc__.splitlines()[0])
