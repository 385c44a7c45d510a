"""bench/gpu_acceptance.py and its steps (gpu_bandwidth.py, gpu_nccl.py) without a GPU: argument parsing, the
plan, the JSON schema, the "not run" paths, wheel installs and the entry-library build, the torch contender's
fallback on CPU tensors, and the benchmark's bnfuse calls on the CUDA emulator."""

from __future__ import annotations

import ctypes
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import numpy as np
import pytest

from tests.loaders import bench_module

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "bench"
EMULATOR_DIR = ROOT / "tests" / "cuda_emulator"
REQUIRE_EMULATOR = os.environ.get("BNFUSE_REQUIRE_CUDA_EMULATOR", "") not in ("", "0")
HAS_CUPY = importlib.util.find_spec("cupy") is not None


acceptance = bench_module("gpu_acceptance", "bnfuse_gpu_acceptance_under_test")
bandwidth = bench_module("gpu_bandwidth", "bnfuse_gpu_bandwidth_under_test")
nccl = bench_module("gpu_nccl", "bnfuse_gpu_nccl_under_test")


def _script(*args: str, env: dict[str, str] | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    command = [sys.executable, str(BENCH / "gpu_acceptance.py"), *args]
    return subprocess.run(command, cwd=ROOT, capture_output=True, text=True, env=env, timeout=timeout)


# -- arguments and the plan -----------------------------------------------------------------------------------


def test_dry_run_prints_the_plan_and_exits_0(tmp_path):
    run = _script("--dry-run", "--out", str(tmp_path / "never"))
    assert run.returncode == 0, run.stderr
    for step in acceptance.STEPS[1:]:
        assert f"  {step} " in run.stdout
    assert "bench/gpu_bandwidth.py: 36 cases" in run.stdout
    for test in acceptance.GPU_TESTS:
        assert test in run.stdout
    if not HAS_CUPY:
        assert "here the GPU steps (cuda_tests, bandwidth, nccl) would be not run: no CuPy" in run.stdout
    assert not (tmp_path / "never").exists()  # a dry run writes nothing


def test_arguments(monkeypatch, tmp_path):
    monkeypatch.setenv("OUT", str(tmp_path))
    args = acceptance.parse_args([])
    assert args.out == tmp_path and args.wheels == ROOT / ".whl" and args.budget == acceptance.DEFAULT_BUDGET_S
    monkeypatch.delenv("OUT")
    assert acceptance.parse_args([]).out == ROOT / "bench" / "gpu_results"
    args = acceptance.parse_args(["--skip", "doctor", "--skip", "nccl", "--quick", "--budget", "100"])
    assert args.skip == ["doctor", "nccl"] and args.quick and args.budget == 100


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--skip", "environment"], "invalid choice"),
        (["--skip", "everything"], "invalid choice"),
        (["--budget", "5"], "--budget must be more than"),
        (["--dry"], "unrecognized arguments"),  # no abbreviations
    ],
)
def test_bad_arguments_exit_2_with_one_line(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        acceptance.parse_args(argv)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


# -- a whole run here (no GPU): JSON schema and "not run" lines ------------------------------------------------


@pytest.mark.skipif(HAS_CUPY, reason="CuPy is installed: the GPU steps would run")
def test_run_without_a_gpu_says_not_run_and_writes_valid_json(tmp_path):
    out = tmp_path / "results"
    run = _script("--out", str(out), "--site", str(tmp_path / "site"), "--skip", "doctor")
    assert run.returncode == 0, run.stdout + run.stderr
    report = json.loads((out / "gpu_acceptance.json").read_text())
    assert acceptance.validate(report) == []
    steps = {s["name"]: s for s in report["steps"]}
    assert list(steps) == list(acceptance.STEPS)
    for name in ("cuda_tests", "bandwidth", "nccl"):
        assert steps[name]["status"] == "not run"
        assert steps[name]["detail"].startswith("no CuPy")
    assert steps["doctor"] == {**steps["doctor"], "status": "not run", "detail": "skipped by request (--skip)"}
    assert steps["ort_cuda_provider"]["status"] == "not run"
    assert "onnxruntime-gpu is not installed" in steps["ort_cuda_provider"]["detail"]
    assert steps["wheels"]["status"] == "pass" and steps["entry_library"]["status"] == "pass"
    assert report["ok"] is True and report["bandwidth"] == []
    summary = (out / "gpu_acceptance.txt").read_text()
    assert summary.startswith("bnfuse GPU acceptance") and "NOT RUN  bandwidth" in summary
    assert summary.strip() in run.stdout  # printed last
    assert not list(out.glob(".*.tmp"))


def _report(**changes):
    steps = [{"name": "environment", "status": "pass", "detail": "x", "seconds": 0.0, "data": {}},
             {"name": "cuda_tests", "status": "not run", "detail": "no GPU", "seconds": 0.0, "data": {}}]  # fmt: skip
    report = {"schema": acceptance.SCHEMA, "started_utc": "now", "seconds": 1.0, "ok": True, "environment": {},
              "steps": steps, "bandwidth": []}  # fmt: skip
    report.update(changes)
    return report


def test_validate_finds_what_breaks_the_schema():
    assert acceptance.validate(_report()) == []
    bad_status = _report()
    bad_status["steps"][1]["status"] = "skipped"
    assert any("bad status" in p for p in acceptance.validate(bad_status))
    two_lines = _report()
    two_lines["steps"][1]["detail"] = "a\nb"
    assert any("one non-empty line" in p for p in acceptance.validate(two_lines))
    failed_but_ok = _report()
    failed_but_ok["steps"][1]["status"] = "fail"
    assert "ok disagrees with the steps" in acceptance.validate(failed_but_ok)
    order = _report()
    order["steps"].reverse()
    assert any("not in the order" in p for p in acceptance.validate(order))
    assert any(p.startswith("schema") for p in acceptance.validate(_report(schema="other/1")))
    assert any(p.startswith("bandwidth") for p in acceptance.validate(_report(bandwidth=None)))


# -- steps ------------------------------------------------------------------------------------------------------


def _tiny_wheel(folder: Path, module: str) -> Path:
    """A minimal pure-Python wheel holding ``module`` (VALUE = 42)."""
    distribution = module.replace("_", "-")
    info = f"{module}-1.0.dist-info"
    path = folder / f"{module}-1.0-py3-none-any.whl"
    files = {
        f"{module}/__init__.py": "VALUE = 42\n",
        f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {distribution}\nVersion: 1.0\n",
        f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    with zipfile.ZipFile(path, "w") as wheel:
        for name, text in files.items():
            wheel.writestr(name, text)
        wheel.writestr(f"{info}/RECORD", "".join(f"{n},,\n" for n in files) + f"{info}/RECORD,,\n")
    return path


def test_wheels_install_from_the_folder_or_say_which_is_missing(tmp_path):
    wheels, site = tmp_path / "wheels", tmp_path / "site"
    wheels.mkdir()
    module = "bnfuse_carried_probe"
    step = acceptance.step_wheels(wheels, site, {module: "bnfuse-carried-probe"})
    assert step.status == "not run"
    assert step.detail == (f"bnfuse-carried-probe is not installed and no bnfuse_carried_probe-*.whl is in {wheels} "
                           "(docs/gpu.md: pip download it here, carry the folder)")  # fmt: skip
    _tiny_wheel(wheels, module)
    step = acceptance.step_wheels(wheels, site, {module: "bnfuse-carried-probe"})
    assert step.status == "pass", step.detail
    assert step.detail == f"{module}-1.0-py3-none-any.whl installed; bnfuse's passes import"
    assert (site / module / "__init__.py").read_text() == "VALUE = 42\n"
    step = acceptance.step_wheels(wheels, site, {module: "bnfuse-carried-probe"})  # now importable from the site
    assert step.detail.startswith("bnfuse-carried-probe present")


def test_find_wheel_matches_the_distribution_name_only(tmp_path):
    for name in ("onnx_ad-0.3.0-py3-none-any.whl", "onnx_graphsurgeon-0.6.1-py2.py3-none-any.whl", "onnx-1.0.whl"):
        (tmp_path / name).write_bytes(b"")
    assert acceptance.find_wheel(tmp_path, "onnx-ad").name == "onnx_ad-0.3.0-py3-none-any.whl"
    assert acceptance.find_wheel(tmp_path, "onnx-graphsurgeon").name.startswith("onnx_graphsurgeon-0.6.1")
    assert acceptance.find_wheel(tmp_path, "onnxruntime") is None
    assert acceptance.find_wheel(tmp_path / "absent", "onnx-ad") is None


def test_entry_library_is_built_with_setup_py_flags(tmp_path):
    flags = acceptance.setup_compile_args()
    assert "-ffp-contract=off" in flags and "-fvisibility=hidden" in flags  # what setup.py says, read from it
    shutil.copytree(ROOT / "bnfuse" / "runtime" / "native", tmp_path / "native")
    step = acceptance.step_entry_library(tmp_path / "site", here=tmp_path)
    assert step.status == "pass", step.detail
    built = list(tmp_path.glob("_ortentry*"))
    assert len(built) == 1 and step.detail.startswith(f"built {built[0].name}")
    assert ctypes.CDLL(str(built[0])).RegisterCustomOps  # the symbol onnxruntime looks up
    assert acceptance.step_entry_library(tmp_path / "site", here=tmp_path).detail == f"present: {built[0].name}"


def test_junit_counts_and_skip_reasons(tmp_path):
    junit = tmp_path / "junit.xml"
    junit.write_text(
        '<testsuites><testsuite name="pytest">'
        '<testcase classname="tests.runtime.test_cuda" name="test_a"/>'
        '<testcase classname="tests.runtime.test_cuda" name="test_b"><failure message="boom"/></testcase>'
        '<testcase classname="tests.runtime.test_api" name="test_c"><skipped message="no ORT GPU"/></testcase>'
        '<testcase classname="tests.runtime.test_api" name="test_d"><skipped message="no ORT GPU"/></testcase>'
        "</testsuite></testsuites>"
    )
    data = acceptance.parse_junit(junit)
    assert (data["passed"], data["failed"], data["skipped"]) == (1, 1, 2)
    assert data["failed_tests"] == ["test_cuda::test_b"] and data["skip_reasons"] == {"no ORT GPU": 2}


def _doctor(*failed: str) -> dict:
    checks = [{"name": "custom-op library loads", "status": "pass", "detail": "ok"}]
    checks += [{"name": name, "status": "fail", "detail": "why"} for name in failed]
    return {"ok": not failed, "checks": checks}


def test_doctor_classification():
    cpu_only = ["CPUExecutionProvider"]
    with_cuda = ["CUDAExecutionProvider", "CPUExecutionProvider"]
    status, detail = acceptance.classify_doctor(_doctor(acceptance.ORT_PROVIDER_CHECK), cpu_only)
    assert status == "pass" and detail == "1 checks passed (no onnxruntime CUDA provider: its checks not run)"
    status, detail = acceptance.classify_doctor(_doctor(acceptance.ORT_PROVIDER_CHECK), with_cuda)
    assert status == "fail" and acceptance.ORT_PROVIDER_CHECK in detail
    status, detail = acceptance.classify_doctor(_doctor("CUDA BatchNormalizationTraining float32/float32"), cpu_only)
    assert status == "fail" and detail.startswith("1 check(s) failed: CUDA BatchNormalizationTraining")
    assert acceptance.step_ort_cuda_provider(with_cuda, None).status == "not run"
    doctor = acceptance.Step("doctor", "pass", "12 checks passed")
    assert acceptance.step_ort_cuda_provider(with_cuda, doctor).status == "pass"


def test_gpu_steps_say_why_they_did_not_run(tmp_path):
    """Each GPU step's one line when the machine lacks its part (the facts as probe_environment reports them)."""
    budget = acceptance.Budget(100)
    site = tmp_path / "site"
    no_gpu = {"cupy": "14.2.0", "devices": 0, "cupy_error": "CUDARuntimeError: no CUDA-capable device"}
    why = acceptance.gpu_missing(no_gpu)
    assert why == "no CUDA GPU (CUDARuntimeError: no CUDA-capable device)"
    assert acceptance.gpu_missing({"cupy": None}) == "no CuPy (not installed)"
    assert acceptance.gpu_missing({"probe_error": "probe exited -11"}) == "the GPU probe failed (probe exited -11)"
    assert acceptance.step_cuda_tests(tmp_path, tmp_path, site, budget, why).detail == why
    gpu = {"cupy": "14.2.0", "devices": 1, "gpu": "H100", "torch_cuda": False, "nccl": False,
           "torch_error": "ImportError: no torch"}  # fmt: skip
    assert acceptance.gpu_missing(gpu) is None
    step = acceptance.step_bandwidth(tmp_path, tmp_path, site, budget, None, gpu, quick=True)
    assert (step.status, step.detail) == ("not run", "torch has no CUDA here (ImportError: no torch)")
    step = acceptance.step_nccl(tmp_path, tmp_path, site, budget, None, gpu)
    assert step.detail == "CuPy has no NCCL (cupy.cuda.nccl reports no NCCL library; the nvidia-nccl wheel provides it)"


def test_budget_limits_each_step():
    budget = acceptance.Budget(100)
    assert 85 <= budget.limit(240) <= 90  # what is left, less the reserve
    assert budget.limit(30) == 30
    assert acceptance.Budget(5).limit(240) == 0.0
    code, output = acceptance._run([sys.executable, "-c", "pass"], 2, Path("/nonexistent"))
    assert code is None and output == "time budget spent"
    code, output = acceptance._run([sys.executable, "-c", "import time; time.sleep(30)"], 5, Path("/nonexistent"))
    assert code is None and output.endswith("(timed out)")


# -- gpu_bandwidth: the plan, the figures, the torch contender on CPU tensors -------------------------------------


def test_bandwidth_plan_covers_every_case():
    cases = bandwidth.plan(quick=False)
    assert len(cases) == len(set(cases)) == 3 * 3 * 2 * 2
    assert {c[0] for c in cases} == set(bandwidth.OPS) and {c[1] for c in cases} == set(bandwidth.DTYPES)
    assert {c[2] for c in cases} == {"NCHW", "NHWC"}
    assert bandwidth.SHAPES["resnet50 stage 1"] == (32, 256, 56, 56)
    assert bandwidth.bytes_moved("backward", (2, 3, 4, 5), 2) == 3 * 120 * 2
    assert bandwidth.bytes_moved("forward_training", (2, 3, 4, 5), 4) == 2 * 120 * 4


def test_bandwidth_figures():
    row = bandwidth.Row("backward", "float32", "NCHW", "s", [1], 3_000_000, "measured", bnfuse_ms=1.0, copy_ms=0.5,
                        contender_ms=2.0)  # fmt: skip
    bandwidth.summarize(row)
    assert row.bnfuse_gb_per_s == pytest.approx(3.0)  # 3 MB in 1 ms
    assert row.fraction_of_copy == pytest.approx(3.0 / 4.0)  # the copy moves 2 MB in 0.5 ms: 4 GB/s
    assert row.bnfuse_over_contender == pytest.approx(0.5)
    assert "0.75 of copy" in bandwidth.format_row(row) and "0.50x torch" in bandwidth.format_row(row)
    idle = bandwidth.summarize(bandwidth.Row("backward", "bfloat16", "NHWC", "s", [1], 6, "not run: no bf16"))
    assert idle.bnfuse_gb_per_s is None and bandwidth.format_row(idle).endswith("not run: no bf16")


@pytest.mark.parametrize("layout", ["NCHW", "NHWC"])
@pytest.mark.parametrize("op", bandwidth.OPS)
def test_torch_contender_falls_back_from_cudnn_on_cpu_tensors(op, layout):
    """CPU tensors: cuDNN refuses, torch's own kernel is timed, labelled so; it computes batch norm."""
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(0)
    physical = (4, 5, 6, 3) if layout == "NHWC" else (4, 3, 5, 6)
    x = torch.from_numpy(rng.normal(size=physical).astype(np.float32))
    dy = torch.from_numpy(rng.normal(size=physical).astype(np.float32))
    tx, tdy = bandwidth.torch_view(torch, x, layout), bandwidth.torch_view(torch, dy, layout)
    assert tx.shape == (4, 3, 5, 6)
    params = {"weight": torch.rand(3) + 0.5, "bias": torch.randn(3), "running_mean": torch.randn(3),
              "running_var": torch.rand(3) + 0.5}  # fmt: skip
    want_params = {k: v.clone() for k, v in params.items()}
    label, call = bandwidth.torch_contender(torch, op, tx, tdy, params)
    assert label.startswith("torch native (cuDNN refused: ")
    got = call()
    p = want_params
    if op == "backward":
        xr = tx.clone().requires_grad_(True)
        y = torch.nn.functional.batch_norm(xr, None, None, p["weight"], p["bias"], True, 0.1, bandwidth.EPSILON)
        (want,) = torch.autograd.grad(y, xr, tdy)
    else:
        training = op == "forward_training"
        want = torch.nn.functional.batch_norm(tx, p["running_mean"], p["running_var"], p["weight"], p["bias"],
                                              training, bandwidth.MOMENTUM, bandwidth.EPSILON)  # fmt: skip
    np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=1e-5, atol=1e-5)


# -- the benchmark's bnfuse calls on the CUDA emulator ----------------------------------------------------------

EMULATED_CALLS = """
import json, sys
import numpy as np
import cupy
sys.path.insert(0, sys.argv[1])
import gpu_bandwidth as b
from bnfuse.runtime import reference as ref
from bnfuse.runtime.semantics import BatchNormConfig
errors = {}
for layout, shape in (("NCHW", (3, 4, 5, 6)), ("NHWC", (3, 5, 6, 4))):
    rng = np.random.default_rng(0)
    x, dy = (rng.normal(0.5, 2.0, shape).astype(np.float32) for _ in range(2))
    host = {"scale": rng.uniform(0.5, 2, 4), "bias": rng.normal(size=4), "running_mean": rng.normal(size=4),
            "running_var": rng.uniform(0.5, 2, 4)}
    host = {k: v.astype(np.float32) for k, v in host.items()}
    config = BatchNormConfig(axis=-1 if layout == "NHWC" else 1, epsilon=b.EPSILON)
    t = ref.forward_training(x, host["scale"], host["bias"], host["running_mean"], host["running_var"], config)
    want = {"forward_inference": ref.forward_inference(x, host["scale"], host["bias"], host["running_mean"],
                                                       host["running_var"], config),
            "forward_training": t.y,
            "backward": ref.backward(dy, x, host["scale"], t.saved_mean, t.saved_inv_std, config).dx}
    for op in b.OPS:
        params = {k: cupy.asarray(v) for k, v in host.items()}
        call = b.bnfuse_call(op, cupy.asarray(x), cupy.asarray(dy), params, layout)
        first, second = cupy.asnumpy(call()), cupy.asnumpy(call())
        errors[f"{op} {layout}"] = [float(np.max(np.abs(first - want[op]))), bool(np.array_equal(first, second))]
print(json.dumps(errors))
"""


def test_benchmark_calls_bnfuse_correctly_on_the_emulator():
    """gpu_bandwidth.bnfuse_call (preallocated outputs, layouts, configs) against the float64 reference, run on
    the CUDA emulator's CuPy stand-in: the bnfuse side of the benchmark computes what it claims to time."""
    spec = importlib.util.spec_from_file_location("_emu_probe", EMULATOR_DIR / "cuda_emu" / "__init__.py",
                                                  submodule_search_locations=[])  # fmt: skip
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    problem = module.available()
    if problem:
        if REQUIRE_EMULATOR:
            pytest.fail(f"BNFUSE_REQUIRE_CUDA_EMULATOR is set but the CUDA emulator cannot run: {problem}")
        pytest.skip(f"CUDA emulator unavailable: {problem}")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(EMULATOR_DIR), str(ROOT)])}
    run = subprocess.run([sys.executable, "-c", EMULATED_CALLS, str(BENCH)], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=600)  # fmt: skip
    assert run.returncode == 0, run.stderr[-4000:]
    errors = json.loads(run.stdout.strip().splitlines()[-1])
    assert len(errors) == 6
    for case, (error, repeatable) in errors.items():
        assert error < 1e-4, case
        assert repeatable, case


# -- gpu_nccl: the one-rank host side ----------------------------------------------------------------------------


def test_one_rank_host_side_without_mpi(monkeypatch):
    for name in ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK"):
        monkeypatch.delenv(name, raising=False)
    host, how = nccl.host_communicator()
    assert isinstance(host, nccl.OneRankHost) and how == "one rank, no MPI"
    assert (host.rank, host.size) == (0, 1)
    uid = b"unique id"
    assert host.comm.bcast(uid, root=0) is uid
    gathered = host.allgather(np.arange(3.0))
    assert gathered.shape == (1, 3)
