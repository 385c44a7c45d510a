"""`bnfuse doctor` on this machine (CPU only, no GPU): real onnxruntime sessions against the reference."""

from __future__ import annotations

import json
import sys
import types
from types import SimpleNamespace

import numpy as np
import onnxruntime
import pytest

from bnfuse import doctor
from bnfuse.cli import main
from bnfuse.runtime import cpu, ops, registry


@pytest.fixture(scope="module")
def report() -> doctor.DoctorReport:
    return doctor.run_doctor(repeats=2)


def test_cli_json_passes_and_says_the_gpu_is_absent(capsys):
    assert main(["doctor", "--json", "--repeats", "2"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["ok"] is True
    assert data["versions"]["onnxruntime"] == onnxruntime.__version__
    assert "CPUExecutionProvider" in data["versions"]["onnxruntime providers"]
    (gpu,) = [c for c in data["checks"] if c["name"] == "GPU"]
    assert gpu["status"] == "skip" and gpu["detail"].startswith("GPU absent")
    assert {c["status"] for c in data["checks"]} <= {"pass", "skip"}


def test_every_op_and_type_pair_checked_on_the_cpu(report):
    op_checks = [c for c in report.checks if c.name.startswith("CPU Batch")]
    assert len(op_checks) == len(ops.OP_NAMES) * len(ops.DTYPE_PAIRS)
    assert all(c.status == doctor.PASS and "over 4 shapes" in c.detail for c in op_checks)
    assert any(c.name == "custom-op library loads" and c.status == doctor.PASS for c in report.checks)
    assert not any(c.name.startswith("CUDA") for c in report.checks)  # no GPU here: nothing claimed about CUDA


def test_bandwidth_against_a_copy_of_the_same_bytes(report):
    figures = {b.what: b for b in report.bandwidth}
    assert set(figures) == {"device copy (read + write)", "BN forward (training)", "BN backward"}
    n = int(np.prod(doctor.BANDWIDTH_SHAPE)) * 4
    assert figures["BN forward (training)"].bytes == 2 * n and figures["BN backward"].bytes == 3 * n
    for figure in figures.values():
        assert figure.median_s > 0 and figure.gb_per_s == pytest.approx(figure.bytes / figure.median_s / 1e9)
    copy = figures["device copy (read + write)"]
    assert figures["BN backward"].vs_copy == pytest.approx(figures["BN backward"].gb_per_s / copy.gb_per_s)


def test_text_report(report):
    text = report.format_text()
    assert "GPU absent" in text and text.endswith("all checks passed")


def test_a_wrong_kernel_fails_the_doctor(monkeypatch, capsys):
    original = cpu.forward_inference

    def off_by_a_little(*args, **kwargs):
        out = original(*args, **kwargs)
        out[...] += 1e-2
        return out

    monkeypatch.setattr(cpu, "forward_inference", off_by_a_little)
    with registry.python_cpu_kernels():  # the CPU BN ops through cpu.py (the native ops cannot be patched)
        assert main(["doctor", "--repeats", "1"]) == 1
    text = capsys.readouterr().out
    assert "FAIL  CPU BatchNormalizationInference float32/float32" in text
    assert "PASS  CPU BatchNormalizationTraining float32/float32" in text
    assert text.rstrip().endswith("check(s) FAILED")


def test_two_onnxruntime_distributions_fail(monkeypatch):
    monkeypatch.setattr(doctor, "_version", lambda name: "1.0" if name.startswith("onnxruntime") else None)
    report = doctor.DoctorReport()
    doctor._check_distributions(report)
    (check,) = report.checks
    assert check.status == doctor.FAIL and "onnxruntime and onnxruntime-gpu" in check.detail


def test_cuda_provider_without_cupy_fails(monkeypatch):
    """onnxruntime-gpu installed but no CuPy: bnfuse's CUDA kernels cannot run, which is a failure."""
    monkeypatch.setattr(doctor.importlib.util, "find_spec", lambda name: None)
    monkeypatch.setattr(
        onnxruntime, "get_available_providers", lambda: ["CUDAExecutionProvider", "CPUExecutionProvider"]
    )
    report = doctor.DoctorReport()
    assert doctor._gpu_facts(report) is False
    assert [(c.status, c.detail) for c in report.checks] == [(doctor.FAIL, "onnxruntime has CUDA but CuPy is missing")]


def _fake_cupy(devices: int) -> types.ModuleType:
    """NOT CuPy: only the runtime queries _gpu_facts makes (no GPU exists here)."""
    runtime = SimpleNamespace(
        getDeviceCount=lambda: devices,
        getDeviceProperties=lambda i: {"name": b"Fake GPU", "totalGlobalMem": 80 * 2**30},
        driverGetVersion=lambda: 13000,
        runtimeGetVersion=lambda: 13000,
    )
    module = types.ModuleType("cupy")
    module.cuda = SimpleNamespace(runtime=runtime)  # type: ignore[attr-defined]
    return module


@pytest.mark.parametrize(
    "providers, devices, want",
    [
        (["CUDAExecutionProvider", "CPUExecutionProvider"], 1, (doctor.PASS, "Fake GPU, 80.0 GiB, 1 device(s)")),
        (["CPUExecutionProvider"], 1, (doctor.FAIL, "a GPU is here but onnxruntime has no CUDAExecutionProvider")),
        (["CUDAExecutionProvider", "CPUExecutionProvider"], 0, (doctor.FAIL, "GPU absent: no CUDA device")),
        (["CPUExecutionProvider"], 0, (doctor.SKIP, "GPU absent: no CUDA device")),
    ],
)
def test_gpu_facts_decisions(monkeypatch, providers, devices, want):
    """The GPU branch's decisions with a stand-in runtime (this proves the logic, not a GPU)."""
    monkeypatch.setitem(sys.modules, "cupy", _fake_cupy(devices))
    monkeypatch.setattr(doctor.importlib.util, "find_spec", lambda name: object())
    monkeypatch.setattr(onnxruntime, "get_available_providers", lambda: providers)
    report = doctor.DoctorReport()
    assert doctor._gpu_facts(report) is (want[0] == doctor.PASS)
    (check,) = report.checks
    assert (check.status, check.detail.split(" (install")[0]) == want
    if devices:
        assert report.versions["CUDA driver"] == "13000" and report.versions["GPU"].startswith("Fake GPU")
