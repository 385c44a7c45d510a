"""bnfuse's custom ops inside onnxruntime: per-call overhead and zero-copy cost, side by side in one run.

Contenders (CPU execution provider, medians of interleaved rounds):

* the CPU kernel called directly (bnfuse.runtime.cpu.forward_inference into a preallocated output);
* the same kernel as bnfuse's BatchNormalizationInference custom op, through ``session.run`` and through
  io binding (inputs and output bound to OrtValues: nothing is copied anywhere);
* the op with a kernel that does nothing (the mechanism alone: ORT's call, the C ABI, the NumPy views);
* ORT's built-in BatchNormalization (ORT's own per-call cost, for scale);
* an onnxruntime-extensions Python op (``onnx_op`` + ``get_library_path``) calling the same kernel.

Run: ``python -m bench.bench_ortops`` (``--quick`` for a smoke run).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import onnxruntime as ort
from onnx import TensorProto, helper

from bench.common import Section, Target, interleaved_medians, machine_description, markdown_table, today
from bench.common import main as bench_main
from bnfuse.io import ort_compatible
from bnfuse.runtime import cpu, ops, session_options
from bnfuse.runtime.semantics import BatchNormConfig

CPU = ["CPUExecutionProvider"]
NAMES = ops.INPUT_NAMES[ops.INFERENCE]
CONFIG = BatchNormConfig()


class _NoopKernels:
    """A kernel that writes nothing: what remains of a call is the mechanism."""

    @staticmethod
    def forward_inference(x: Any, scale: Any, bias: Any, mean: Any, var: Any, config: Any, *, out: Any) -> Any:
        return out


@contextlib.contextmanager
def _kernels(module: Any) -> Iterator[None]:
    """Sessions created inside bind their kernels to ``module`` (kernels are bound at creation)."""
    original = ops.kernel_module
    ops.kernel_module = lambda provider: module
    try:
        yield
    finally:
        ops.kernel_module = original


def _quiet_options() -> ort.SessionOptions:
    """Options for the sessions that are not bnfuse's: no spinning pool threads, like session_options().

    Spinning threads of one session take the cores from every other contender in the process.
    """
    options = ort.SessionOptions()
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    options.add_session_config_entry("session.inter_op.allow_spinning", "0")
    return options


def _builtin_model() -> bytes:
    node = helper.make_node("BatchNormalization", list(NAMES), ["Y"], epsilon=CONFIG.epsilon)
    inputs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in NAMES]
    graph = helper.make_graph([node], "bn", inputs, [helper.make_tensor_value_info("Y", TensorProto.FLOAT, None)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    return ort_compatible(model).SerializeToString()


_extensions_sessions: list[ort.InferenceSession] = []


def _extensions_session() -> ort.InferenceSession | None:
    """The same kernel as an onnxruntime-extensions Python op (None when the package is missing).

    Made once per process: onnxruntime-extensions refuses to register a Python op twice.
    """
    if _extensions_sessions:
        return _extensions_sessions[0]
    try:
        from onnxruntime_extensions import PyCustomOpDef, get_library_path, onnx_op
    except ImportError:
        return None

    @onnx_op(op_type="BnfusePyInference", inputs=[PyCustomOpDef.dt_float] * 5, outputs=[PyCustomOpDef.dt_float])
    def _inference(x, scale, bias, mean, var):  # noqa: ANN001 - onnxruntime-extensions calls it with arrays
        return cpu.forward_inference(x, scale, bias, mean, var, CONFIG)

    node = helper.make_node("BnfusePyInference", list(NAMES), ["Y"], domain="ai.onnx.contrib")
    inputs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in NAMES]
    graph = helper.make_graph([node], "py", inputs, [helper.make_tensor_value_info("Y", TensorProto.FLOAT, None)])
    opsets = [helper.make_opsetid("", 17), helper.make_opsetid("ai.onnx.contrib", 1)]
    options = _quiet_options()
    options.register_custom_ops_library(get_library_path())
    model = ort_compatible(helper.make_model(graph, opset_imports=opsets)).SerializeToString()
    _extensions_sessions.append(ort.InferenceSession(model, options, providers=CPU))
    return _extensions_sessions[0]


def _feeds(shape: tuple[int, ...]) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    x = rng.standard_normal(shape, dtype=np.float32)
    params = [(rng.random(shape[1], dtype=np.float32) + 0.5) for _ in range(4)]
    return dict(zip(NAMES, (x, *params), strict=True))


def _bound(session: ort.InferenceSession, feeds: dict[str, np.ndarray], out: np.ndarray) -> Callable[[], object]:
    """run_with_iobinding with inputs and output bound to OrtValues over NumPy buffers (no copies)."""
    binding = session.io_binding()
    values = [ort.OrtValue.ortvalue_from_numpy(a) for a in feeds.values()]
    for name, value in zip(feeds, values, strict=True):
        binding.bind_ortvalue_input(name, value)
    output = ort.OrtValue.ortvalue_from_numpy(out)
    binding.bind_ortvalue_output("Y", output)

    def call() -> None:
        session.run_with_iobinding(binding)

    call.keep = (binding, values, output)  # type: ignore[attr-defined]
    return call


def _contenders(shape: tuple[int, ...], calls: int) -> tuple[dict[str, Callable[[], object]], np.ndarray]:
    feeds = _feeds(shape)
    x, scale, bias, mean, var = feeds.values()
    direct_out = np.empty_like(x)
    bound_out = np.empty_like(x)
    model = ops.single_op_model(ops.INFERENCE).SerializeToString()
    options = session_options()
    bnfuse = ort.InferenceSession(model, options, providers=CPU)
    with _kernels(_NoopKernels):
        noop = ort.InferenceSession(model, session_options(), providers=CPU)
    builtin = ort.InferenceSession(_builtin_model(), _quiet_options(), providers=CPU)
    extensions = _extensions_session()
    bound = _bound(bnfuse, feeds, bound_out)
    noop_bound = _bound(noop, feeds, np.empty_like(x))

    def repeat(fn: Callable[[], object]) -> Callable[[], object]:
        def many() -> None:
            for _ in range(calls):
                fn()

        return many

    fns = {
        "kernel called directly": repeat(
            lambda: cpu.forward_inference(x, scale, bias, mean, var, CONFIG, out=direct_out)
        ),
        "bnfuse op, io binding": repeat(bound),
        "bnfuse op, run()": repeat(lambda: bnfuse.run(None, feeds)),
        "bnfuse op, no-op kernel, io binding (mechanism)": repeat(noop_bound),
        "bnfuse op, no-op kernel, run()": repeat(lambda: noop.run(None, feeds)),
        "ORT built-in BatchNormalization": repeat(lambda: builtin.run(None, feeds)),
    }
    if extensions is not None:
        fns["onnxruntime-extensions Python op"] = repeat(lambda: extensions.run(None, feeds))
    # Same answer everywhere before timing anything.
    cpu.forward_inference(x, scale, bias, mean, var, CONFIG, out=direct_out)
    bound()
    np.testing.assert_allclose(bound_out, direct_out, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(bnfuse.run(None, feeds)[0], direct_out, rtol=1e-5, atol=1e-5)
    return fns, direct_out


def _measure(shape: tuple[int, ...], calls: int, repeat: int, warmup: int) -> dict[str, float]:
    fns, _ = _contenders(shape, calls)
    medians = interleaved_medians(fns, repeat=repeat, warmup=warmup)
    return {name: seconds / calls for name, seconds in medians.items()}


def run(quick: bool = False) -> Section:
    tiny_shape = (2, 3, 4)
    big_shape = (8, 64, 32, 32) if quick else (32, 64, 56, 56)  # 2 MB quick, 25.7 MB full
    # Tiny: the median of single calls (a multi-threaded kernel launch has a long tail on small inputs; the
    # median shows the typical call). Big: one call per sample. Each with the kernel on all cores and on one:
    # on a shared machine a multi-threaded kernel waits for cores, which says nothing about the op's cost.
    tiny, big, threads = {}, {}, {}
    for label, count in (("all", None), ("1", 1)):
        with cpu.kernel_threads(count) as threads[label]:
            tiny[label] = _measure(tiny_shape, calls=1, repeat=200 if quick else 3000, warmup=50 if quick else 300)
            big[label] = _measure(big_shape, calls=1, repeat=3 if quick else 15, warmup=1)

    big_mb = np.prod(big_shape) * 4 / 1e6
    # The targets: < 50 µs per call on a tiny tensor, <= 1.2x the direct kernel on a ~25 MB one.
    size_note = " (quick run: not the 25 MB of the target)" if quick else ""
    header = ["contender"]
    for label in threads:
        header += [
            f"tiny, {threads[label]} kernel thread(s): µs/call",
            "µs over direct",
            f"{big_mb:.1f} MB, {threads[label]} kernel thread(s): ms/call",
            "vs direct",
        ]
    rows = []
    for name in tiny["all"]:
        row = [name]
        for label in threads:
            t, b = tiny[label], big[label]
            direct_t, direct_b = t["kernel called directly"], b["kernel called directly"]
            row += [
                f"{t[name] * 1e6:.1f}",
                f"{(t[name] - direct_t) * 1e6:+.1f}",
                f"{b[name] * 1e3:.2f}",
                f"{b[name] / direct_b:.2f}x",
            ]
        rows.append(row)

    def verdict(value: float, target: float) -> str:
        return "target met" if value <= target else "**target missed**"

    def summary(label: str) -> str:
        t, b = tiny[label], big[label]
        overhead = (t["bnfuse op, run()"] - t["kernel called directly"]) * 1e6
        bound = b["bnfuse op, io binding"] / b["kernel called directly"]
        plain = b["bnfuse op, run()"] / b["kernel called directly"]
        mechanism = b["bnfuse op, no-op kernel, io binding (mechanism)"] * 1e3
        return (
            f"{threads[label]} kernel thread(s): per-call overhead over the direct kernel (tiny, run()) "
            f"{overhead:.1f} µs (target < 50 µs: {verdict(overhead, 50.0)}); {big_mb:.1f} MB{size_note} vs the "
            f"direct kernel (target <= 1.2x): io binding {bound:.2f}x ({verdict(bound, 1.2)}), plain run() "
            f"{plain:.2f}x ({verdict(plain, 1.2)}; run() copies nothing in, but ORT allocates the output); "
            f"the mechanism alone (no-op kernel, io binding) {mechanism:.2f} ms."
        )

    markdown = "\n\n".join(
        [
            f"{machine_description()}; onnxruntime {ort.__version__}; {today()}. CPU execution provider, float32, "
            "BatchNormalizationInference; medians of interleaved rounds of single calls. Sessions without spinning "
            "pool threads (bnfuse.runtime.session_options() default; the same set on the other sessions).",
            markdown_table(header, rows),
            "\n".join(f"- {summary(label)}" for label in threads),
            "GPU (CUDA EP): not measured (no GPU lent to this task).",
        ]
    )
    return Section(
        title="onnxruntime custom ops: per-call overhead and zero-copy",
        command="python -m bench.bench_ortops" + (" --quick" if quick else ""),
        markdown=markdown,
        targets=[
            target
            for label in threads
            for target in (
                Target(
                    f"custom op per-call overhead, tiny tensor, {threads[label]} thread(s)",
                    (tiny[label]["bnfuse op, run()"] - tiny[label]["kernel called directly"]) * 1e6,
                    50.0,
                    "µs",
                ),
                Target(
                    f"custom op {big_mb:.0f} MB{size_note}, io binding / direct kernel, {threads[label]} thread(s)",
                    big[label]["bnfuse op, io binding"] / big[label]["kernel called directly"],
                    1.2,
                ),
                Target(
                    f"custom op {big_mb:.0f} MB{size_note}, run() / direct kernel, {threads[label]} thread(s)",
                    big[label]["bnfuse op, run()"] / big[label]["kernel called directly"],
                    1.2,
                ),
            )
        ],
        series={
            "tiny_seconds": tiny,
            "big_seconds": big,
            "kernel_threads": threads,
            "tiny_shape": tiny_shape,
            "big_shape": big_shape,
        },
    )


if __name__ == "__main__":
    bench_main(run, __doc__.splitlines()[0])
