"""`bnfuse doctor`: what this machine gives bnfuse, and whether bnfuse's ops are right on it.

Versions (bnfuse, numpy, onnx, onnxruntime and its providers, CuPy, CUDA driver / runtime, device), the
installed onnxruntime distributions (exactly one must be), whether the custom-op library loads, then on every
provider bnfuse has kernels for: each op and type pair in a real onnxruntime session against the float64
reference on a few shapes; on CUDA, that the kernels get ORT's device buffers (zero-copy) and run on ORT's
stream; and a bandwidth figure (BN forward and backward vs a copy of the same bytes on that device).
A report is ``ok`` only when no check failed; an absent GPU is reported, not failed.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import platform
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

import bnfuse

PASS, FAIL, SKIP = "pass", "fail", "skip"
ONNXRUNTIME_DISTRIBUTIONS = ("onnxruntime", "onnxruntime-gpu", "onnxruntime-directml", "onnxruntime-openvino")
SHAPES = {  # x shape and op attributes: channels-first (vectorized and odd), channels-last, rank 2
    "(4,3,8,8)": ((4, 3, 8, 8), {}),
    "(3,5,7,3)": ((3, 5, 7, 3), {}),
    "(5,6,40) axis=-1": ((5, 6, 40), {"axis": -1}),
    "(64,7)": ((64, 7), {}),
}
BANDWIDTH_SHAPE = (16, 32, 64, 64)  # float32, 8 MiB per data tensor


@dataclass
class Check:
    name: str
    status: str  # pass, fail or skip
    detail: str


@dataclass
class Bandwidth:
    provider: str
    what: str
    bytes: int
    median_s: float
    gb_per_s: float
    vs_copy: float  # this figure / the device copy's (1.0 = as fast as copying the same bytes)


@dataclass
class DoctorReport:
    versions: dict[str, str] = field(default_factory=dict)
    checks: list[Check] = field(default_factory=list)
    bandwidth: list[Bandwidth] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not any(c.status == FAIL for c in self.checks)

    def add(self, name: str, status: str, detail: str) -> Check:
        check = Check(name, status, detail)
        self.checks.append(check)
        return check

    def to_json(self) -> dict[str, Any]:
        return {
            "ok": self.ok,
            "versions": self.versions,
            "checks": [asdict(c) for c in self.checks],
            "bandwidth": [asdict(b) for b in self.bandwidth],
        }

    def format_text(self) -> str:
        lines = ["versions:"]
        lines += [f"  {k:<22} {v}" for k, v in self.versions.items()]
        lines.append("checks:")
        lines += [f"  {c.status.upper():<5} {c.name:<44} {c.detail}" for c in self.checks]
        if self.bandwidth:
            lines.append(f"bandwidth (float32 {'x'.join(map(str, BANDWIDTH_SHAPE))}, median):")
            lines += [
                f"  {b.provider:<22} {b.what:<28} {b.gb_per_s:7.2f} GB/s  {b.vs_copy:5.2f}x the device copy"
                for b in self.bandwidth
            ]
        failed = sum(c.status == FAIL for c in self.checks)
        lines.append("all checks passed" if self.ok else f"{failed} check(s) FAILED")
        return "\n".join(lines)


def _version(distribution: str) -> str | None:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def _attempt(report: DoctorReport, name: str, body: Callable[[], tuple[str, str]]) -> bool:
    """Run one check; an exception is that check's failure, with its one-line cause."""
    try:
        status, detail = body()
    except Exception as exc:  # noqa: BLE001 - the doctor reports every failure instead of stopping
        status, detail = FAIL, f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    report.add(name, status, detail)
    return status != FAIL


# -- versions and installation ---------------------------------------------------------------------------------


def _collect_versions(report: DoctorReport) -> None:
    v = report.versions
    v["bnfuse"] = bnfuse.__version__
    v["python"] = platform.python_version()
    v["platform"] = platform.platform()
    for name in ("numpy", "onnx", "onnxruntime", "onnxruntime-gpu", "cupy"):
        v[name] = _version(name) or "not installed"
    cupy_wheels = [d.metadata["Name"] for d in importlib.metadata.distributions()
                   if (d.metadata["Name"] or "").lower().startswith("cupy-cuda")]  # fmt: skip
    if cupy_wheels:
        v["cupy"] = f"{cupy_wheels[0]} {_version(cupy_wheels[0])}"


def _check_distributions(report: DoctorReport) -> None:
    installed = [d for d in ONNXRUNTIME_DISTRIBUTIONS if _version(d)]
    if len(installed) == 1:
        report.add("one onnxruntime distribution", PASS, installed[0])
    elif not installed:
        report.add("one onnxruntime distribution", FAIL, "none: pip install 'bnfuse[cpu]' or 'bnfuse[gpu]'")
    else:
        report.add("one onnxruntime distribution", FAIL,
                   f"{' and '.join(installed)} both install the `onnxruntime` package (the CUDA provider can "
                   "vanish): keep one")  # fmt: skip


def _gpu_facts(report: DoctorReport) -> bool:
    """CUDA driver / runtime and device facts through CuPy; False when no usable GPU is here."""
    import onnxruntime

    cuda_ep = "CUDAExecutionProvider" in onnxruntime.get_available_providers()
    if importlib.util.find_spec("cupy") is None:
        detail = "GPU absent: CuPy is not installed"
        if cuda_ep:
            report.add("CUDA: CuPy for bnfuse's kernels", FAIL, "onnxruntime has CUDA but CuPy is missing")
            return False
        report.add("GPU", SKIP, f"{detail}; onnxruntime has no CUDAExecutionProvider")
        return False
    import cupy

    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as exc:  # noqa: BLE001 - no driver / no device: the GPU is absent
        count, why = 0, str(exc).splitlines()[0]
    else:
        why = "no CUDA device"
    if count == 0:
        report.add("GPU", FAIL if cuda_ep else SKIP, f"GPU absent: {why}")
        return False
    runtime = cupy.cuda.runtime
    props = runtime.getDeviceProperties(0)
    name = props["name"].decode() if isinstance(props["name"], bytes) else str(props["name"])
    report.versions["CUDA driver"] = str(runtime.driverGetVersion())
    report.versions["CUDA runtime"] = str(runtime.runtimeGetVersion())
    report.versions["GPU"] = f"{name}, {props['totalGlobalMem'] / 2**30:.1f} GiB, {count} device(s)"
    if not cuda_ep:
        report.add("CUDA: onnxruntime provider", FAIL, "a GPU is here but onnxruntime has no CUDAExecutionProvider "
                   "(install onnxruntime-gpu alone: pip install 'bnfuse[gpu]')")  # fmt: skip
        return False
    report.add("GPU", PASS, report.versions["GPU"])
    return True


# -- the ops in sessions ---------------------------------------------------------------------------------------


def _config_of(op: str, attrs: dict[str, Any]) -> Any:
    from bnfuse.runtime import ops

    class Attributes:
        def float_attr(self, name: str, default: float) -> float:
            return float(attrs.get(name, default))

        def int_attr(self, name: str, default: int) -> int:
            return int(attrs.get(name, default))

        def string_attr(self, name: str, default: str) -> str:
            return str(attrs.get(name, default))

        def node_name(self) -> str:
            return "doctor"

    return ops.parse_config(op, Attributes())


def _feeds(op: str, shape: tuple[int, ...], config: Any, data: np.dtype, param: np.dtype) -> dict[str, np.ndarray]:
    from bnfuse.runtime import ops
    from bnfuse.runtime.semantics import param_shape

    rng = np.random.default_rng(0)
    p = param_shape(config, shape)
    x = (rng.standard_normal(shape) * 2 + 0.5).astype(data)
    scale, var = (rng.random(p) + 0.5).astype(param), (rng.random(p) + 0.5).astype(param)
    bias, mean = rng.standard_normal(p).astype(param), (rng.standard_normal(p) * 0.1).astype(param)
    if op == ops.GRAD:
        inv_std = (1.0 / np.sqrt(var.astype(np.float64) + 1.0)).astype(param)
        arrays = (rng.standard_normal(shape).astype(data), x, scale, mean, inv_std)
    else:
        arrays = (x, scale, bias, mean, var)
    return dict(zip(ops.INPUT_NAMES[op], arrays, strict=True))


def _reference(op: str, feeds: dict[str, np.ndarray], config: Any) -> list[np.ndarray]:
    from bnfuse.runtime import ops, reference

    args = list(feeds.values())
    if op == ops.INFERENCE:
        return [reference.forward_inference(*args, config)]
    if op == ops.TRAINING:
        return list(reference.forward_training(*args, config))[:5]
    return list(reference.backward(*args, config))


def _session(op: str, provider: str, data: np.dtype, param: np.dtype, attrs: dict[str, Any]) -> Any:
    import onnxruntime

    from bnfuse.runtime import ops, session_options

    model = ops.single_op_model(op, data_dtype=data, param_dtype=param, **attrs)
    return onnxruntime.InferenceSession(model.SerializeToString(), session_options([provider]), providers=[provider])


def _check_op(provider: str, op: str, data: np.dtype, param: np.dtype) -> tuple[str, str]:
    worst = 0.0
    sessions: dict[str, Any] = {}  # one per attribute set: the models leave shapes open
    for shape, attrs in SHAPES.values():
        config = _config_of(op, attrs)
        feeds = _feeds(op, shape, config, data, param)
        key = repr(sorted(attrs.items()))
        if key not in sessions:
            sessions[key] = _session(op, provider, data, param, attrs)
        got = sessions[key].run(None, feeds)
        for g, w in zip(got, _reference(op, feeds, config), strict=True):
            if g.dtype != w.dtype or g.shape != w.shape:
                return FAIL, f"output {g.dtype}{g.shape}, the reference gives {w.dtype}{w.shape}"
            w64 = w.astype(np.float64)
            error = float(np.max(np.abs(g.astype(np.float64) - w64)) / max(1.0, float(np.max(np.abs(w64)))))
            worst = max(worst, error)
    tol = 4e-3 if np.float16 in (data.type, param.type) else 2e-5
    status = PASS if worst <= tol else FAIL
    return status, f"max error {worst:.1e} (tolerance {tol:.0e}) over {len(SHAPES)} shapes"


def _check_cuda_zero_copy_and_stream() -> tuple[str, str]:
    """The CUDA kernel receives ORT's own device buffers (bound OrtValues) and runs on ORT's stream."""
    import onnxruntime

    from bnfuse.runtime import ops

    f32 = np.dtype(np.float32)
    feeds = _feeds(ops.INFERENCE, (8, 16, 32, 32), _config_of(ops.INFERENCE, {}), f32, f32)
    session = _session(ops.INFERENCE, ops.CUDA, f32, f32, {})
    binding = session.io_binding()
    values = {n: onnxruntime.OrtValue.ortvalue_from_numpy(a, "cuda", 0) for n, a in feeds.items()}
    for name, value in values.items():
        binding.bind_ortvalue_input(name, value)
    out = onnxruntime.OrtValue.ortvalue_from_shape_and_type(feeds["X"].shape, np.float32, "cuda", 0)
    binding.bind_ortvalue_output("Y", out)
    with ops.record_addresses() as calls:
        session.run_with_iobinding(binding)
    if len(calls) != 1:
        return FAIL, f"{len(calls)} kernel calls recorded, expected 1"
    call = calls[0]
    if call.inputs != tuple(v.data_ptr() for v in values.values()) or call.outputs != (out.data_ptr(),):
        return FAIL, "the kernel saw other buffers than ORT's bound device buffers (a copy was made)"
    if call.ort_stream == 0 or call.stream != call.ort_stream:
        return FAIL, f"kernel stream {call.stream:#x}, ORT's compute stream {call.ort_stream:#x}"
    want = _reference(ops.INFERENCE, feeds, _config_of(ops.INFERENCE, {}))[0]
    if not np.allclose(out.numpy(), want, rtol=2e-5, atol=2e-5):
        return FAIL, "wrong values through IO binding"
    return PASS, f"inputs, output and stream are ORT's (stream {call.ort_stream:#x})"


# -- bandwidth -------------------------------------------------------------------------------------------------


def _median_seconds(run: Callable[[], Any], repeats: int, sync: Callable[[], None]) -> float:
    run()
    sync()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _bandwidth(report: DoctorReport, provider: str, repeats: int) -> None:
    """BN forward (training) and backward in an onnxruntime session on ``provider`` vs a copy of the same bytes
    on that device, bytes counted once each way: forward reads X and writes Y, backward reads dY and X and
    writes dX."""
    import onnxruntime

    from bnfuse.runtime import ops

    f32 = np.dtype(np.float32)
    nbytes = int(np.prod(BANDWIDTH_SHAPE)) * 4
    device = "cuda" if provider == ops.CUDA else "cpu"
    if device == "cuda":
        import cupy

        src = cupy.ones(BANDWIDTH_SHAPE, np.float32)
        dst = cupy.empty_like(src)
        copy_s = _median_seconds(lambda: dst.__setitem__(Ellipsis, src), repeats, cupy.cuda.Device().synchronize)
    else:
        src = np.ones(BANDWIDTH_SHAPE, np.float32)
        dst = np.empty_like(src)
        copy_s = _median_seconds(lambda: np.copyto(dst, src), repeats, lambda: None)
    copy_gbs = 2 * nbytes / copy_s / 1e9
    report.bandwidth.append(Bandwidth(provider, "device copy (read + write)", 2 * nbytes, copy_s, copy_gbs, 1.0))
    for op, moved in ((ops.TRAINING, 2 * nbytes), (ops.GRAD, 3 * nbytes)):
        config = _config_of(op, {})
        feeds = _feeds(op, BANDWIDTH_SHAPE, config, f32, f32)
        session = _session(op, provider, f32, f32, {})
        binding = session.io_binding()
        for name, array in feeds.items():
            binding.bind_ortvalue_input(name, onnxruntime.OrtValue.ortvalue_from_numpy(array, device, 0))
        for name in ops.OUTPUT_NAMES[op][: 5 if op == ops.TRAINING else 3]:
            binding.bind_output(name, device)
        seconds = _median_seconds(lambda s=session, b=binding: s.run_with_iobinding(b), repeats,
                                  binding.synchronize_outputs)  # fmt: skip
        gbs = moved / seconds / 1e9
        what = "BN forward (training)" if op == ops.TRAINING else "BN backward"
        report.bandwidth.append(Bandwidth(provider, what, moved, seconds, gbs, gbs / copy_gbs))


# -- entry -----------------------------------------------------------------------------------------------------


def run_doctor(*, repeats: int = 10) -> DoctorReport:
    """Every check on this machine (a few seconds on a CPU)."""
    report = DoctorReport()
    _collect_versions(report)
    _check_distributions(report)
    try:
        import onnxruntime
    except ImportError as exc:
        report.add("onnxruntime import", FAIL, f"{exc}: pip install 'bnfuse[cpu]' or 'bnfuse[gpu]'")
        return report
    report.versions["onnxruntime providers"] = ", ".join(onnxruntime.get_available_providers())
    report.versions["device"] = onnxruntime.get_device()
    try:
        gpu = _gpu_facts(report)
    except Exception as exc:  # noqa: BLE001 - a broken CUDA set-up is a failed check, not a crash
        report.add("GPU", FAIL, f"{type(exc).__name__}: {exc}")
        gpu = False

    from bnfuse.runtime import library_path, ops, registry

    if not _attempt(report, "custom-op library loads", lambda: (PASS, library_path())):
        return report
    providers = registry.available_providers()
    report.versions["bnfuse providers"] = ", ".join(providers)
    for provider in providers:
        for op in ops.OP_NAMES:
            for data, param in ops.DTYPE_PAIRS:
                name = f"{provider.removesuffix('ExecutionProvider')} {op} {data.name}/{param.name}"
                _attempt(report, name, lambda p=provider, o=op, d=data, q=param: _check_op(p, o, d, q))
    if gpu and ops.CUDA in providers:
        _attempt(report, "CUDA zero-copy and ORT's stream", _check_cuda_zero_copy_and_stream)
    for provider in providers:
        _attempt(report, f"{provider.removesuffix('ExecutionProvider')} bandwidth",
                 lambda p=provider: (_bandwidth(report, p, repeats), (PASS, "measured"))[1])  # fmt: skip
    return report
