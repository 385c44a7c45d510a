"""bnfuse's custom ops inside onnxruntime: per-op overhead against onnxruntime's own operators, large-tensor
cost against the direct kernel, and a ResNet-50-shaped training step, side by side in one run.

Every op bnfuse registers (ops.OP_NAMES), CPU execution provider, float32, both ways of registering the
library -- ``bnfuse.runtime.session_options()`` (pool threads not spinning) and
``SessionOptions.register_custom_ops_library(library_path())`` on onnxruntime's default options (spinning
pool threads) -- through ``session.run()`` and through I/O binding (inputs and outputs bound to OrtValues).

* Tiny tensors: each op against onnxruntime's own operators doing the same work, under the same thread
  settings and the same call: BatchNormalization for Inference, BatchNormalization(training_mode=1) for
  Training (one node, and it skips the saved statistics), and for Grad -- onnxruntime has no BN-grad op
  outside its training build -- the standard-op subgraph bnfuse's --portable lowering writes. Also: each
  op through the Python per-call glue (registry.python_cpu_kernels()) instead of the native library's C op.
* 25.7 MB tensors: each op against its CPU kernel called directly into preallocated outputs.
* A training graph of ResNet-50's shape (bottleneck blocks 3-4-6-3, 53 BatchNorms: 106 bnfuse ops a
  step) on tiny tensors, stepped by TrainingSession, with bnfuse's ops and in --portable form.

Run: ``python -m bench.bench_ortops`` (``--quick`` for a smoke run).
"""

from __future__ import annotations

import io
import os
import time
import warnings
from collections.abc import Callable
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
from onnx import helper

from bench.common import Section, Target, interleaved_medians, machine_description, markdown_table, today
from bench.common import main as bench_main
from bnfuse.io import ort_compatible
from bnfuse.passes.training import bn as training_bn
from bnfuse.runtime import cpu, library_path, ops, registry, session_options
from bnfuse.runtime.kernel_types import GradOutputs, TrainingOutputs
from bnfuse.runtime.semantics import BatchNormConfig

CPU = ["CPUExecutionProvider"]
# The direct kernel calls get the values the op's FLOAT attributes hold (float32, as onnxruntime reads them), so the
# bit-for-bit check below compares the same arithmetic.
CONFIG = BatchNormConfig(epsilon=float(np.float32(1e-5)), momentum=float(np.float32(0.9)))
OVERHEAD_LIMIT_US = 20.0
LARGE_LIMIT = 1.2
RESNET_LIMIT = 1.3
REGISTRATIONS = ("session_options()", "library_path(), ORT defaults (spinning)")


def _quiet_options() -> ort.SessionOptions:
    """onnxruntime options with bnfuse's thread settings (no spinning pool threads), for native sessions."""
    options = ort.SessionOptions()
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    options.add_session_config_entry("session.inter_op.allow_spinning", "0")
    return options


def _bnfuse_session(model: bytes, registration: str) -> ort.InferenceSession:
    if registration == REGISTRATIONS[0]:
        return ort.InferenceSession(model, session_options(), providers=CPU)
    options = ort.SessionOptions()
    options.register_custom_ops_library(library_path())
    return ort.InferenceSession(model, options, providers=CPU)


def _native_session(model: bytes, registration: str) -> ort.InferenceSession:
    options = _quiet_options() if registration == REGISTRATIONS[0] else ort.SessionOptions()
    return ort.InferenceSession(model, options, providers=CPU)


def _feeds(op: str, shape: tuple[int, ...], seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    channels = shape[1]
    x = rng.standard_normal(shape, dtype=np.float32)
    scale, bias, mean = (rng.standard_normal(channels, dtype=np.float32) for _ in range(3))
    var = rng.random(channels, dtype=np.float32) + 0.5
    if op == ops.GRAD:
        dy = rng.standard_normal(shape, dtype=np.float32)
        inv_std = (1.0 / np.sqrt(var + 1e-5)).astype(np.float32)
        return dict(zip(ops.INPUT_NAMES[op], (dy, x, scale, mean, inv_std), strict=True))
    return dict(zip(ops.INPUT_NAMES[op], (x, scale, bias, mean, var), strict=True))


def _native_models(op: str, shape: tuple[int, ...]) -> dict[str, bytes]:
    """onnxruntime's own operators doing the op's work, by label (the first is the one overhead is taken
    against)."""
    names = list(ops.INPUT_NAMES[op])
    inputs = [helper.make_tensor_value_info(n, onnx.TensorProto.FLOAT, None) for n in names]

    def single(outputs: list[str], **attributes: Any) -> bytes:
        node = helper.make_node("BatchNormalization", names, outputs, epsilon=CONFIG.epsilon, **attributes)
        out_info = [helper.make_tensor_value_info(n, onnx.TensorProto.FLOAT, None) for n in outputs]
        graph = helper.make_graph([node], "native", inputs, out_info)
        return ort_compatible(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])).SerializeToString()

    if op == ops.INFERENCE:
        return {"BatchNormalization": single(["Y"])}
    custom = ops.single_op_model(op, x_shape=shape)
    initializers: list[onnx.TensorProto] = []
    nodes = training_bn.lower_portable(list(custom.graph.node), lambda name: shape, initializers)
    graph = helper.make_graph(nodes, "portable", custom.graph.input, custom.graph.output, initializer=initializers)
    portable = ort_compatible(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]))
    lowered = f"--portable lowering ({len(nodes)} standard nodes)"
    if op == ops.TRAINING:
        native = single(["Y", "running_mean", "running_var"], momentum=0.9, training_mode=1)
        return {"BatchNormalization training_mode=1": native, lowered: portable.SerializeToString()}
    return {lowered: portable.SerializeToString()}


def _bound(session: ort.InferenceSession, feeds: dict[str, np.ndarray]) -> Callable[[], object]:
    """run_with_iobinding, inputs and every output bound to OrtValues over NumPy buffers (nothing copied)."""
    binding = session.io_binding()
    keep: list[Any] = []
    for name, array in feeds.items():
        value = ort.OrtValue.ortvalue_from_numpy(array)
        binding.bind_ortvalue_input(name, value)
        keep.append(value)
    for output, array in zip(session.get_outputs(), session.run(None, feeds), strict=True):
        value = ort.OrtValue.ortvalue_from_numpy(np.empty_like(array))
        binding.bind_ortvalue_output(output.name, value)
        keep.append(value)

    def call() -> None:
        session.run_with_iobinding(binding)

    call.keep = keep  # type: ignore[attr-defined]
    return call


def _repeat(fn: Callable[[], object], calls: int) -> Callable[[], None]:
    def many() -> None:
        for _ in range(calls):
            fn()

    return many


def _glue_training_session(model: onnx.ModelProto) -> Any:
    """A TrainingSession whose BN ops run through the Python glue (cpu.py's kernels) instead of the native ops."""
    from bnfuse.training.session import TrainingSession

    with registry.python_cpu_kernels():
        return TrainingSession(model)


def _direct(op: str, feeds: dict[str, np.ndarray]) -> Callable[[], object]:
    """The CPU kernel called directly, writing into preallocated outputs."""
    args = list(feeds.values())
    x, channels = args[1] if op == ops.GRAD else args[0], args[2].shape
    if op == ops.INFERENCE:
        out = np.empty_like(x)
        return lambda: cpu.forward_inference(*args, CONFIG, out=out)
    if op == ops.TRAINING:
        outs = TrainingOutputs(np.empty_like(x), *(np.empty(channels, np.float32) for _ in range(5)))
        return lambda: cpu.forward_training(*args, CONFIG, out=outs)
    grads = GradOutputs(np.empty_like(x), np.empty(channels, np.float32), np.empty(channels, np.float32))
    return lambda: cpu.backward(*args, CONFIG, out=grads)


def _check(op: str, session: ort.InferenceSession, feeds: dict[str, np.ndarray]) -> None:
    """The op's outputs equal the direct kernel's, bit for bit (same kernels, same order)."""
    args = list(feeds.values())
    kernel = {ops.INFERENCE: cpu.forward_inference, ops.TRAINING: cpu.forward_training, ops.GRAD: cpu.backward}[op]
    want = kernel(*args, CONFIG)
    want = [want] if op == ops.INFERENCE else list(want)
    for got, expected in zip(session.run(None, feeds), want, strict=False):
        np.testing.assert_array_equal(got, expected)


# -- tiny tensors: per-op overhead against onnxruntime's own operators ------------------------------------


def _tiny(quick: bool) -> tuple[list[list[str]], list[Target], dict[str, float]]:
    shape, calls = (2, 3, 4), 10
    fns: dict[str, Callable[[], None]] = {}
    natives: dict[str, list[str]] = {}
    for op in ops.OP_NAMES:
        feeds = _feeds(op, shape)
        model = ops.single_op_model(op).SerializeToString()
        natives[op] = list(_native_models(op, shape))
        for registration in REGISTRATIONS:
            session = _bnfuse_session(model, registration)
            _check(op, session, feeds)
            run = lambda s=session, f=feeds: s.run(None, f)  # noqa: E731
            fns[f"{op}|{registration}|run()"] = _repeat(run, calls)
            fns[f"{op}|{registration}|io binding"] = _repeat(_bound(session, feeds), calls)
            if registration == REGISTRATIONS[0]:  # the same op through the Python glue (cpu.py's kernels)
                with registry.python_cpu_kernels():
                    glue = _bnfuse_session(model, registration)
                _check(op, glue, feeds)
                fns[f"{op}|{registration}|run(), Python glue"] = _repeat(lambda s=glue, f=feeds: s.run(None, f), calls)
            for label, native_model in _native_models(op, shape).items():
                native = _native_session(native_model, registration)
                fns[f"{op}|{registration}|run()|{label}"] = _repeat(lambda s=native, f=feeds: s.run(None, f), calls)
                fns[f"{op}|{registration}|io binding|{label}"] = _repeat(_bound(native, feeds), calls)
    seconds = interleaved_medians(fns, repeat=100 if quick else 600, warmup=20 if quick else 100)
    us = {name: value / calls * 1e6 for name, value in seconds.items()}
    rows, targets = [], []
    for op in ops.OP_NAMES:
        reference, worst = natives[op][0], -1e9
        for registration in REGISTRATIONS:
            for call in ("run()", "io binding"):
                mine, native = us[f"{op}|{registration}|{call}"], us[f"{op}|{registration}|{call}|{reference}"]
                others = "; ".join(f"{label} {us[f'{op}|{registration}|{call}|{label}']:.1f}" for label in natives[op])
                before = us.get(f"{op}|{registration}|{call}, Python glue")
                rows.append(
                    [op, registration, call, f"{mine:.1f}", others, f"{mine - native:+.1f}",
                     "" if before is None else f"{before:.1f} ({before - native:+.1f})"]
                )  # fmt: skip
                worst = max(worst, mine - native)
        what = f"{op} tiny: µs over {reference} (worst of registrations and calls)"
        targets.append(Target(what, worst, OVERHEAD_LIMIT_US, "µs"))
    return rows, targets, us


# -- 25.7 MB tensors: the op against its kernel called directly -------------------------------------------


def _large(quick: bool) -> tuple[list[list[str]], list[Target], dict[str, Any], float]:
    """Each kernel thread setting separately: the kernels' default (all cores) and one thread. On a shared
    2-core machine a multi-threaded call waits for cores now and then, whoever calls it."""
    shape = (8, 64, 32, 32) if quick else (32, 64, 56, 56)
    megabytes = float(np.prod(shape) * 4 / 1e6)
    rows, targets, series = [], [], {"shape": shape}
    worst: dict[str, float] = dict.fromkeys(ops.OP_NAMES, 0.0)
    for threads in (None, 1):
        fns: dict[str, Callable[[], object]] = {}
        with cpu.kernel_threads(threads) as count:
            for op in ops.OP_NAMES:
                feeds = _feeds(op, shape)
                model = ops.single_op_model(op).SerializeToString()
                fns[f"{op}|direct"] = _direct(op, feeds)
                for registration in REGISTRATIONS:
                    session = _bnfuse_session(model, registration)
                    fns[f"{op}|{registration}|run()"] = lambda s=session, f=feeds: s.run(None, f)
                    fns[f"{op}|{registration}|io binding"] = _bound(session, feeds)
            seconds = interleaved_medians(fns, repeat=5 if quick else 51, warmup=2)
        series[f"{count} thread(s)"] = seconds
        for op in ops.OP_NAMES:
            direct = seconds[f"{op}|direct"]
            for registration in REGISTRATIONS:
                for call in ("run()", "io binding"):
                    mine = seconds[f"{op}|{registration}|{call}"]
                    worst[op] = max(worst[op], mine / direct)
                    row = [op, str(count), registration, call, f"{direct * 1e3:.2f}", f"{mine * 1e3:.2f}"]
                    rows.append([*row, f"{mine / direct:.2f}x"])
    for op in ops.OP_NAMES:
        what = f"{op} {megabytes:.0f} MB / direct kernel (worst of registrations, calls, thread counts)"
        targets.append(Target(what, worst[op], LARGE_LIMIT))
    return rows, targets, series, megabytes


# -- a ResNet-50-shaped training graph on tiny tensors --------------------------------------------------------


def _resnet50_shaped(width: int) -> Any:
    """ResNet-50's structure (bottlenecks 3-4-6-3, expansion 4, 53 BatchNorms) at 1/``64/width`` width."""
    import torch
    from torch import nn

    class Bottleneck(nn.Module):
        def __init__(self, cin: int, mid: int, stride: int) -> None:
            super().__init__()
            self.body = nn.Sequential(
                nn.Conv2d(cin, mid, 1, bias=False), nn.BatchNorm2d(mid), nn.ReLU(),
                nn.Conv2d(mid, mid, 3, stride, 1, bias=False), nn.BatchNorm2d(mid), nn.ReLU(),
                nn.Conv2d(mid, 4 * mid, 1, bias=False), nn.BatchNorm2d(4 * mid),
            )  # fmt: skip
            self.down = None
            if stride != 1 or cin != 4 * mid:
                self.down = nn.Sequential(nn.Conv2d(cin, 4 * mid, 1, stride, bias=False), nn.BatchNorm2d(4 * mid))

        def forward(self, x):  # noqa: ANN001, ANN202
            return torch.relu(self.body(x) + (x if self.down is None else self.down(x)))

    layers, cin = [], width
    for stage, blocks in enumerate((3, 4, 6, 3)):
        mid = width * 2**stage
        for block in range(blocks):
            layers.append(Bottleneck(cin, mid, 2 if block == 0 and stage > 0 else 1))
            cin = 4 * mid
    stem = nn.Sequential(nn.Conv2d(3, width, 3, 1, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU())
    head = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(cin, 10))
    return nn.Sequential(stem, *layers, head)


def _resnet(quick: bool) -> tuple[list[list[str]], list[Target], dict[str, float], int]:
    import torch

    from bnfuse.passes.training import SGD, build_training_graph
    from bnfuse.training.session import TrainingSession

    torch.manual_seed(0)
    shape = (2, 3, 16, 16)
    net = _resnet50_shaped(2).eval()
    buffer = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(net, torch.randn(*shape), buffer, dynamo=False, opset_version=17,
                          training=torch.onnx.TrainingMode.PRESERVE, do_constant_folding=False,
                          input_names=["x"], output_names=["y"])  # fmt: skip
    model = onnx.load_from_string(buffer.getvalue())
    batchnorms = sum(node.op_type == "BatchNormalization" for node in model.graph.node)
    rng = np.random.default_rng(0)
    x = rng.standard_normal(shape).astype(np.float32)
    labels = rng.integers(0, 10, shape[0]).astype(np.int64)
    custom, _ = build_training_graph(model, optimizer=SGD(momentum=0.9))
    portable, _ = build_training_graph(model, optimizer=SGD(momentum=0.9), portable=True)
    sessions = {
        "bnfuse custom ops (TrainingSession default: session_options())": TrainingSession(custom),
        "bnfuse custom ops, Python glue (registry.python_cpu_kernels())": _glue_training_session(custom),
        "bnfuse custom ops, session_options(spinning=True)": TrainingSession(
            custom, session_options=session_options(CPU, spinning=True)
        ),
        "--portable (TrainingSession default: ORT defaults, spinning)": TrainingSession(portable),
        "--portable, no spinning (bnfuse's thread settings)": TrainingSession(
            portable, session_options=_quiet_options()
        ),
    }
    fns: dict[str, Callable[[], object]] = {label: (lambda s=s: s.step(x, labels)) for label, s in sessions.items()}
    seconds = interleaved_medians(fns, repeat=15 if quick else 150, warmup=5)
    labels_ = list(sessions)
    portable_default, portable_quiet = labels_[3], labels_[4]
    rows = [
        [label, f"{seconds[label] * 1e3:.2f}", f"{seconds[label] / seconds[portable_default]:.2f}x"]
        for label in labels_
    ]
    targets = [
        Target("ResNet-50-shaped training step, tiny tensors: custom ops / --portable (each its default options)",
               seconds[labels_[0]] / seconds[portable_default], RESNET_LIMIT),
        Target("ResNet-50-shaped training step, tiny tensors: custom ops / --portable (same thread settings)",
               seconds[labels_[0]] / seconds[portable_quiet], RESNET_LIMIT),
    ]  # fmt: skip
    return rows, targets, seconds, batchnorms


def run(quick: bool = False) -> Section:
    load, started = os.getloadavg()[0], time.strftime("%H:%M", time.gmtime())
    tiny_rows, tiny_targets, tiny_us = _tiny(quick)
    large_rows, large_targets, large_seconds, large_mb = _large(quick)
    resnet_rows, resnet_targets, resnet_seconds, batchnorms = _resnet(quick)
    load = max(load, os.getloadavg()[0])
    large_shape = "x".join(map(str, large_seconds["shape"]))
    size_note = " (quick run: not the 26 MB of the target)" if quick else ""
    markdown = "\n\n".join(
        [
            f"{machine_description()}; onnxruntime {ort.__version__}; {today()} {started} UTC; 1-minute load "
            f"average up to {load:.1f} on the 2 cores during the run (other agents). CPU execution provider, "
            "float32, the kernels' default thread count. Medians of interleaved rounds (every contender of a table in "
            "each round).",
            f"**Tiny tensors (2x3x4)**, µs per call (median of rounds of 10 calls). Overhead = bnfuse op minus the "
            f"first native contender, same registration's thread settings and same call. Target: <= "
            f"{OVERHEAD_LIMIT_US:.0f} µs. Last column: the op through the Python glue (registry.python_cpu_kernels(): "
            "cpu.py's kernels called back from the library) instead of the native C op.",
            markdown_table(
                [
                    "op",
                    "registration",
                    "call",
                    "bnfuse µs",
                    "onnxruntime's own ops µs",
                    "overhead µs",
                    "Python glue: µs (overhead)",
                ],
                tiny_rows,
            ),  # fmt: skip
            f"**{large_mb:.1f} MB tensors{size_note}** ({large_shape}), ms per call; target <= {LARGE_LIMIT}x the "
            "kernel called directly into preallocated outputs.",
            markdown_table(
                ["op", "kernel threads", "registration", "call", "direct kernel ms", "bnfuse op ms", "op / direct"],
                large_rows,
            ),
            f"**ResNet-50-shaped training step on tiny tensors** (2x3x16x16 input, widths 2-4-8-16 x4, "
            f"{batchnorms} BatchNorms: {2 * batchnorms} bnfuse ops a step; SGD momentum), TrainingSession.step, "
            f"median of interleaved steps. Target: custom ops <= {RESNET_LIMIT}x --portable.",
            markdown_table(["contender", "step ms", "/ --portable (ORT defaults)"], resnet_rows),
            "GPU (CUDA EP): not measured (no GPU lent to this task).",
        ]
    )
    return Section(
        title="onnxruntime custom ops: per-op overhead, large tensors, ResNet-50-shaped training step",
        command="python -m bench.bench_ortops" + (" --quick" if quick else ""),
        markdown=markdown,
        targets=tiny_targets + large_targets + resnet_targets,
        series={"tiny_us": tiny_us, "large_seconds": large_seconds, "resnet_seconds": resnet_seconds},
    )


if __name__ == "__main__":
    bench_main(run, __doc__.splitlines()[0])
