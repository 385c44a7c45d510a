"""The GPU path on real hardware in one prepared command: tests, doctor, bandwidth and NCCL, one JSON.

Made for a short, bare, offline GPU loan (docs/gpu.md has the recipe): installs nothing from the network,
stays under its time budget (default 450 s), and degrades instead of crashing: a step that cannot run on this
machine says "not run" and why, in one line.

    python bench/gpu_acceptance.py [--out DIR] [--wheels DIR] [--budget S] [--quick] [--skip STEP ...]
    python bench/gpu_acceptance.py --dry-run        # the plan and what this machine lacks; runs nothing

Steps, in order (each long one in its own process, with a timeout):

* environment: Python, packages, GPU (CuPy, nvidia-smi), onnxruntime's providers.
* wheels: onnx-graphsurgeon and onnx-ad (bnfuse's dependencies, absent on the GPU image) from ``--wheels``
  (pip --no-index --no-deps --target), then ``import`` of bnfuse's passes as the proof.
* entry_library: bnfuse's onnxruntime entry library for this interpreter, compiled with the C compiler and
  setup.py's flags when missing (a checkout built for another Python has another file name).
* cuda_tests: tests/runtime/test_cuda.py (every CUDA kernel test on the real GPU), the nvcc compile checks,
  and the CuPy tests of the sync ops and the ORT CUDA provider (the latter skip without onnxruntime-gpu).
* bandwidth: bench/gpu_bandwidth.py (BN forward training / inference / backward vs a device copy and cuDNN).
* nccl: bench/gpu_nccl.py, one rank per GPU (mpiexec for more than one GPU).
* doctor: ``bnfuse doctor --json``; without onnxruntime-gpu its "onnxruntime provider" failure is expected and
  reported as the ORT CUDA-provider path not run.
* ort_cuda_provider: whether onnxruntime's CUDA execution provider path (bnfuse's ops inside ORT sessions on
  the GPU) ran: only where onnxruntime-gpu is installed (doctor's CUDA checks cover it).

Writes DIR/gpu_acceptance.json (schema SCHEMA below) and DIR/gpu_acceptance.txt (the summary, also printed
last), plus doctor.json (doctor's own report) and logs.txt (every child process's output). DIR: ``--out``, else
$OUT (the device tool's folder), else bench/gpu_results/. Exit 0 when no step failed ("not run" is no failure), 1 when
one did, 2 for bad arguments.
"""

from __future__ import annotations

import argparse
import ast
import datetime as dt
import importlib.machinery
import importlib.metadata
import importlib.util
import json
import os
import platform
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import time
import xml.etree.ElementTree as ElementTree
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
SCHEMA = "bnfuse-gpu-acceptance/1"
PASS, FAIL, NOT_RUN = "pass", "fail", "not run"
# the measurements before doctor: on a GPU machine without onnxruntime-gpu it mostly repeats the CPU checks
STEPS = ("environment", "wheels", "entry_library", "cuda_tests", "bandwidth", "nccl", "doctor", "ort_cuda_provider")
# module -> distribution: bnfuse's dependencies the GPU image lacks; they travel as wheels (docs/gpu.md)
CARRIED = {"onnx_graphsurgeon": "onnx-graphsurgeon", "onnx_ad": "onnx-ad"}
GPU_TESTS = (
    "tests/runtime/test_cuda.py",
    "tests/runtime/test_cuda_sources.py",
    "tests/runtime/test_sync_ops.py::test_gpu_math_matches_host_math",
    "tests/runtime/test_runtime_api.py::test_cuda_execution_provider_matches_reference",
)
STEP_LIMITS_S = {"cuda_tests": 200, "bandwidth": 180, "nccl": 90, "doctor": 120, "probe": 60}
DEFAULT_BUDGET_S = 450  # the ceiling is 8 minutes on an H100; this leaves room for start and transfers
RESERVE_S = 10  # kept back from the budget for writing the results
PACKAGES = ("numpy", "cupy-cuda13x", "cupy-cuda12x", "cupy", "torch", "onnx", "onnxruntime", "onnxruntime-gpu",
            "numba", "mpi4py", "pytest", "hypothesis", "ml_dtypes", "onnx-graphsurgeon", "onnx-ad")  # fmt: skip
LOG = "logs.txt"  # every child's output; with the JSON, the summary and doctor.json: 4 files (the tool takes 8)
ORT_PROVIDER_CHECK = "CUDA: onnxruntime provider"  # doctor's check that fails without onnxruntime-gpu


@dataclass
class Step:
    name: str
    status: str  # PASS, FAIL or NOT_RUN
    detail: str  # one line
    seconds: float = 0.0
    data: dict[str, Any] = field(default_factory=dict)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("--dry-run", action="store_true", help="print the plan and what this machine lacks; exit 0")
    parser.add_argument("--out", type=Path, help="results folder (default: $OUT, else bench/gpu_results)")
    parser.add_argument("--wheels", type=Path, default=ROOT / ".whl", help="folder of carried wheels (default .whl)")
    parser.add_argument("--site", type=Path, default=Path("/tmp/bnfuse-gpu-site"), help="where wheels install")
    parser.add_argument("--budget", type=float, default=DEFAULT_BUDGET_S, help="seconds for the whole run")
    parser.add_argument("--quick", action="store_true", help="small bandwidth tensors (a smoke run)")
    parser.add_argument("--skip", action="append", default=[], choices=STEPS[1:], metavar="STEP",
                        help=f"leave a step out (repeatable): {', '.join(STEPS[1:])}")  # fmt: skip
    args = parser.parse_args(argv)
    if args.budget <= RESERVE_S:
        parser.error(f"--budget must be more than {RESERVE_S} seconds")
    if args.out is None:
        args.out = Path(os.environ["OUT"]) if os.environ.get("OUT") else ROOT / "bench" / "gpu_results"
    return args


# -- helpers ------------------------------------------------------------------------------------------------


class Budget:
    def __init__(self, seconds: float) -> None:
        self.deadline = time.monotonic() + seconds

    def limit(self, cap: float) -> float:
        """Seconds a step may take: its cap, or what the budget has left."""
        return max(0.0, min(cap, self.deadline - time.monotonic() - RESERVE_S))


def _one_line(text: str, limit: int = 300) -> str:
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    return (lines[-1] if lines else "")[:limit]


def _env(site: Path) -> dict[str, str]:
    """The environment of every child: bnfuse from this checkout, then the installed wheels."""
    path = [str(ROOT), str(site), *filter(None, [os.environ.get("PYTHONPATH")])]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(path), "PYTHONUNBUFFERED": "1"}


def _text(data: str | bytes | None) -> str:
    return data.decode(errors="replace") if isinstance(data, bytes) else data or ""


def _run(
    command: list[str], timeout: float, site: Path, log: Path | None = None, stdout_only: bool = False
) -> tuple[int | None, str]:
    """(exit code or None on timeout, stdout + stderr, or stdout alone); both are appended to ``log``."""
    if timeout < 5:
        return None, "time budget spent"
    try:
        done = subprocess.run(command, cwd=ROOT, env=_env(site), capture_output=True, text=True, timeout=timeout)
        code, stdout, stderr = done.returncode, done.stdout, done.stderr
    except subprocess.TimeoutExpired as exc:
        code, stdout, stderr = None, _text(exc.stdout), _text(exc.stderr) + "\n(timed out)"
    if log is not None:
        with log.open("a") as file:
            file.write(f"==== {' '.join(command)} (exit {code})\n{stdout}{stderr}\n")
    return code, stdout if stdout_only else stdout + stderr


def _version(distribution: str) -> str | None:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


# -- environment -----------------------------------------------------------------------------------------------

PROBE = """
import json
facts = {"cupy": None, "devices": 0, "gpu": None, "nccl": False, "torch_cuda": False, "providers": []}
try:
    import cupy
    facts["cupy"] = getattr(cupy, "__version__", "unknown")
    facts["devices"] = cupy.cuda.runtime.getDeviceCount()
    if facts["devices"]:
        p = cupy.cuda.runtime.getDeviceProperties(0)
        name = p["name"].decode() if isinstance(p["name"], bytes) else str(p["name"])
        facts["gpu"] = f"{name}, {p['totalGlobalMem'] / 2**30:.1f} GiB, sm_{p['major']}{p['minor']}"
        facts["cuda_runtime"] = cupy.cuda.runtime.runtimeGetVersion()
        facts["cuda_driver"] = cupy.cuda.runtime.driverGetVersion()
except Exception as exc:
    facts["cupy_error"] = f"{type(exc).__name__}: {exc}".splitlines()[0]
try:
    from cupy.cuda import nccl
    facts["nccl"] = bool(getattr(nccl, "available", True))
except Exception as exc:
    facts["nccl_error"] = f"{type(exc).__name__}: {exc}".splitlines()[0]
try:
    import torch
    facts["torch_cuda"] = torch.cuda.is_available()
except Exception as exc:
    facts["torch_error"] = f"{type(exc).__name__}: {exc}".splitlines()[0]
try:
    import onnxruntime
    facts["providers"] = onnxruntime.get_available_providers()
except Exception as exc:
    facts["onnxruntime_error"] = f"{type(exc).__name__}: {exc}".splitlines()[0]
print(json.dumps(facts))
"""


def probe_environment(site: Path, timeout: float = STEP_LIMITS_S["probe"]) -> dict[str, Any]:
    """Versions and GPU facts; CUDA is touched in a child process only (a broken driver cannot hang this one)."""
    env: dict[str, Any] = {
        "python": platform.python_version(),
        "executable": sys.executable,
        "platform": platform.platform(),
        "packages": {name: _version(name) for name in PACKAGES if _version(name)},
        "nvcc": shutil.which("nvcc"),
        "mpiexec": shutil.which("mpiexec"),
        "cc": shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc"),
    }
    code, output = _run([sys.executable, "-c", PROBE], timeout, site, stdout_only=True)
    try:
        env.update(json.loads(output.strip().splitlines()[-1]))
    except (ValueError, IndexError):
        env["probe_error"] = _one_line(output) or f"probe exited {code}"
        env.update({"devices": 0, "providers": []})
    if shutil.which("nvidia-smi"):
        query = ["nvidia-smi", "--query-gpu=name,driver_version,memory.total,clocks.max.sm", "--format=csv,noheader"]
        code, output = _run(query, 30, site)
        env["nvidia_smi"] = output.strip().splitlines() if code == 0 else _one_line(output)
    return env


def gpu_missing(env: dict[str, Any]) -> str | None:
    """Why the GPU steps cannot run here, or None."""
    if "probe_error" in env:
        return f"the GPU probe failed ({env['probe_error']})"
    if env.get("cupy") is None:
        return f"no CuPy ({env.get('cupy_error', 'not installed')})"
    if not env.get("devices"):
        return f"no CUDA GPU ({env.get('cupy_error', 'CuPy sees 0 devices')})"
    return None


# -- steps ---------------------------------------------------------------------------------------------------


def _importable(module: str, site: Path) -> bool:
    code = f"import importlib.util, sys; sys.exit(importlib.util.find_spec({module!r}) is None)"
    return subprocess.run([sys.executable, "-c", code], env=_env(site), capture_output=True).returncode == 0


def find_wheel(wheel_dir: Path, distribution: str) -> Path | None:
    """The one wheel of ``distribution`` in the folder (wheel file names spell it with underscores)."""
    stem = distribution.replace("-", "_").lower()
    found = (
        sorted(p for p in wheel_dir.glob("*.whl") if p.name.lower().split("-")[0] == stem) if wheel_dir.is_dir() else []
    )
    return found[-1] if found else None


def step_wheels(wheel_dir: Path, site: Path, carried: dict[str, str] = CARRIED) -> Step:
    """Each carried module importable, installing its wheel from ``wheel_dir`` into ``site`` where missing."""
    notes, missing = [], []
    for module, distribution in carried.items():
        if _importable(module, site):
            notes.append(f"{distribution} present")
            continue
        wheel = find_wheel(wheel_dir, distribution)
        if wheel is None:
            missing.append(f"{distribution} is not installed and no {distribution.replace('-', '_')}-*.whl is in "
                           f"{wheel_dir} (docs/gpu.md: pip download it here, carry the folder)")  # fmt: skip
            continue
        command = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                   "--no-cache-dir", "--upgrade", "--target", str(site), str(wheel)]  # fmt: skip
        code, output = _run(command, 120, site)
        if code != 0 or not _importable(module, site):
            missing.append(f"{wheel.name} did not install: {_one_line(output)}")
        else:
            notes.append(f"{wheel.name} installed")
    if missing:
        return Step("wheels", NOT_RUN, "; ".join(missing))
    code, output = _run([sys.executable, "-c", "import bnfuse.passes.optimize, bnfuse.passes.training.autodiff"],
                        60, site)  # fmt: skip
    if code != 0:
        return Step("wheels", FAIL, f"{'; '.join(notes)}; bnfuse's passes do not import: {_one_line(output)}")
    return Step("wheels", PASS, "; ".join(notes) + "; bnfuse's passes import")


def setup_compile_args() -> list[str]:
    """extra_compile_args of setup.py's _ortentry Extension (read, not copied, so the two cannot drift)."""
    tree = ast.parse((ROOT / "setup.py").read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "Extension":
            if isinstance(node.args[0], ast.Constant) and node.args[0].value == "bnfuse.runtime._ortentry":
                for keyword in node.keywords:
                    if keyword.arg == "extra_compile_args":
                        return list(ast.literal_eval(_resolved(tree, keyword.value)))
    raise ValueError("setup.py has no _ortentry Extension with extra_compile_args")


def _resolved(tree: ast.Module, value: ast.expr) -> ast.expr:
    """``value``, or the literal assigned to it at module level when it is a name (setup.py's FLAGS)."""
    if not isinstance(value, ast.Name):
        return value
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == value.id for t in node.targets):
            return node.value
    raise ValueError(f"setup.py does not assign {value.id}")


def native_sources(here: Path) -> list[Path]:
    """The custom-op library's C sources (runtime/native/*.c but the _cpukernels extension's Python module)."""
    return sorted(p for p in (here / "native").glob("*.c") if p.name != "cpukernels.c")


def step_entry_library(site: Path, here: Path = ROOT / "bnfuse" / "runtime") -> Step:
    """bnfuse's ORT custom-op library in ``here`` for this interpreter, compiled from native/*.c when missing."""
    present = [
        here / f"_ortentry{s}" for s in importlib.machinery.EXTENSION_SUFFIXES if (here / f"_ortentry{s}").is_file()
    ]
    if present:
        return Step("entry_library", PASS, f"present: {present[0].name}")
    compiler = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
    if compiler is None:
        return Step("entry_library", NOT_RUN, "no C compiler: ORT sessions cannot load bnfuse's ops (doctor fails)")
    target = here / f"_ortentry{sysconfig.get_config_var('EXT_SUFFIX') or '.so'}"
    sources = [str(p) for p in native_sources(here)]
    command = [
        compiler,
        "-shared",
        "-fPIC",
        *setup_compile_args(),
        *sources,
        "-lm",
        "-lpthread",
        "-ldl",
        "-o",
        str(target),
    ]
    code, output = _run(command, 120, site)
    if code != 0:
        return Step("entry_library", FAIL, f"{' '.join(command)}: {_one_line(output)}")
    return Step("entry_library", PASS, f"built {target.name} with {Path(compiler).name}")


def parse_junit(path: Path) -> dict[str, Any]:
    """Counts and the names of failed / skipped tests (with the skip reasons) from a junit XML file."""
    counts = {"passed": 0, "failed": 0, "skipped": 0}
    failed, skipped = [], {}
    for case in ElementTree.parse(path).iter("testcase"):
        name = f"{case.get('classname', '').rsplit('.', 1)[-1]}::{case.get('name')}"
        kinds = {child.tag: child for child in case}
        if "failure" in kinds or "error" in kinds:
            counts["failed"] += 1
            failed.append(name)
        elif "skipped" in kinds:
            counts["skipped"] += 1
            reason = kinds["skipped"].get("message", "")
            skipped[reason] = skipped.get(reason, 0) + 1
        else:
            counts["passed"] += 1
    return {**counts, "failed_tests": failed[:20], "skip_reasons": skipped}


def step_cuda_tests(out: Path, work: Path, site: Path, budget: Budget, missing: str | None) -> Step:
    if missing:
        return Step("cuda_tests", NOT_RUN, missing)
    junit = work / "junit.xml"
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={junit}", *GPU_TESTS]
    code, output = _run(command, budget.limit(STEP_LIMITS_S["cuda_tests"]), site, out / LOG)
    if not junit.is_file():
        why = "timed out" if code is None else f"pytest exited {code}"
        return Step("cuda_tests", FAIL, f"{why} before its report: {_one_line(output)}")
    data = parse_junit(junit)
    summary = f"{data['passed']} passed, {data['failed']} failed, {data['skipped']} skipped"
    if code is None:
        return Step("cuda_tests", FAIL, f"timed out ({summary} so far)", data=data)
    status = PASS if code == 0 and data["passed"] > 0 and not data["failed"] else FAIL
    if data["failed"]:
        summary += f"; failed: {', '.join(data['failed_tests'][:5])}"
    return Step("cuda_tests", status, summary, data=data)


def classify_doctor(report: dict[str, Any], providers: list[str]) -> tuple[str, str]:
    """(status, detail) of a doctor report: its ORT-provider failure is expected where onnxruntime has no CUDA
    provider on a GPU machine (the ORT CUDA path is then not run, and says so in its own step)."""
    checks = report.get("checks", [])
    expected = "CUDAExecutionProvider" not in providers
    failures = [c for c in checks if c["status"] == "fail" and not (expected and c["name"] == ORT_PROVIDER_CHECK)]
    passed = sum(c["status"] == "pass" for c in checks)
    if failures:
        names = "; ".join(f"{c['name']}: {c['detail']}" for c in failures[:3])
        return FAIL, f"{len(failures)} check(s) failed: {names}"
    note = " (no onnxruntime CUDA provider: its checks not run)" if expected else ""
    return PASS, f"{passed} checks passed{note}"


def step_doctor(out: Path, site: Path, budget: Budget, providers: list[str]) -> Step:
    command = [sys.executable, "-m", "bnfuse.cli", "doctor", "--json"]
    code, output = _run(command, budget.limit(STEP_LIMITS_S["doctor"]), site, out / LOG, stdout_only=True)
    start = output.find("{")
    try:
        report = json.loads(output[start : output.rfind("}") + 1]) if start >= 0 else None
    except ValueError:
        report = None
    if report is None:
        return Step("doctor", FAIL, f"no JSON report (exit {code}): {_one_line(output)}")
    (out / "doctor.json").write_text(json.dumps(report, indent=1))
    status, detail = classify_doctor(report, providers)
    return Step("doctor", status, detail, data={"exit_code": code, "versions": report.get("versions", {}),
                                                "bandwidth": report.get("bandwidth", [])})  # fmt: skip


def step_ort_cuda_provider(providers: list[str], doctor: Step | None) -> Step:
    if "CUDAExecutionProvider" not in providers:
        return Step("ort_cuda_provider", NOT_RUN, "onnxruntime has no CUDAExecutionProvider (onnxruntime-gpu is not "
                    "installed, too large to carry): bnfuse's ops inside ORT sessions on the GPU, zero-copy and "
                    "ORT's stream were not checked; `bnfuse doctor` checks them where onnxruntime-gpu is")  # fmt: skip
    if doctor is None or doctor.status == NOT_RUN:
        return Step("ort_cuda_provider", NOT_RUN, "onnxruntime has the CUDA provider but doctor did not run")
    return Step("ort_cuda_provider", doctor.status, f"checked by doctor's CUDA checks: {doctor.detail}")


def step_bandwidth(out: Path, work: Path, site: Path, budget: Budget, missing: str | None, env: dict[str, Any],
                   quick: bool) -> Step:  # fmt: skip
    if missing:
        return Step("bandwidth", NOT_RUN, missing)
    if not env.get("torch_cuda"):
        return Step("bandwidth", NOT_RUN, f"torch has no CUDA here ({env.get('torch_error', 'no cuDNN to compare')})")
    rows_file = work / "bandwidth.json"
    command = [sys.executable, str(ROOT / "bench" / "gpu_bandwidth.py"), "--json", str(rows_file),
               *(["--quick"] if quick else [])]  # fmt: skip
    code, output = _run(command, budget.limit(STEP_LIMITS_S["bandwidth"]), site, out / LOG)
    if not rows_file.is_file():
        return Step("bandwidth", FAIL, f"exit {code}: {_one_line(output)}")
    rows = json.loads(rows_file.read_text())
    measured = sum(r["status"] == "measured" for r in rows)
    status = PASS if measured else FAIL
    return Step("bandwidth", status, f"{measured} of {len(rows)} cases measured", data={"rows": rows})


def step_nccl(out: Path, work: Path, site: Path, budget: Budget, missing: str | None, env: dict[str, Any]) -> Step:
    if missing:
        return Step("nccl", NOT_RUN, missing)
    if not env.get("nccl"):
        why = env.get("nccl_error", "cupy.cuda.nccl reports no NCCL library")
        return Step("nccl", NOT_RUN, f"CuPy has no NCCL ({why}; the nvidia-nccl wheel provides it)")
    result_file = work / "nccl.json"
    script = [sys.executable, str(ROOT / "bench" / "gpu_nccl.py"), "--json", str(result_file)]
    devices = int(env.get("devices") or 0)
    note = ""
    if devices > 1 and env.get("mpiexec"):
        command = [env["mpiexec"], "-n", str(devices), *script]
    else:
        command = script
        if devices > 1:
            note = f"; {devices} GPUs but no mpiexec: more ranks not run"
    code, output = _run(command, budget.limit(STEP_LIMITS_S["nccl"]), site, out / LOG)
    if not result_file.is_file():
        return Step("nccl", FAIL, f"exit {code}: {_one_line(output)}{note}")
    result = json.loads(result_file.read_text())
    bad = [f"{k}: {v}" for k, v in result["checks"].items() if not v.startswith("pass")]
    detail = (
        f"{result['ranks']} rank(s), host side {result['host']}; "
        f"all-reduce 16 MiB {result['allreduce_16MiB_ms_median']:.3f} ms"
    )
    status = PASS if code == 0 and not bad else FAIL
    return Step("nccl", status, detail + ("; " + "; ".join(bad) if bad else "") + note, data=result)


# -- plan, report ------------------------------------------------------------------------------------------------


def plan_lines(args: argparse.Namespace, env: dict[str, Any] | None) -> list[str]:
    """What the run would do, step by step, and (given this machine's facts) what would be "not run"."""
    missing = gpu_missing(env) if env is not None else None
    wheel_state = ", ".join(
        f"{d}: {'wheel ' + w.name if (w := find_wheel(args.wheels, d)) else 'no wheel'}" for d in CARRIED.values()
    )
    what = {
        "environment": "Python, packages, GPU facts (a child process touches CUDA)",
        "wheels": f"{', '.join(CARRIED.values())} from {args.wheels} if missing ({wheel_state})",
        "entry_library": "bnfuse/runtime/_ortentry for this Python, cc with setup.py's flags if missing",
        "cuda_tests": f"pytest {' '.join(GPU_TESTS)} (limit {STEP_LIMITS_S['cuda_tests']} s)",
        "bandwidth": f"bench/gpu_bandwidth.py{' --quick' if args.quick else ''}: {len(_bandwidth_plan(args.quick))} "
        f"cases (limit {STEP_LIMITS_S['bandwidth']} s)",
        "nccl": f"bench/gpu_nccl.py, one rank per GPU (limit {STEP_LIMITS_S['nccl']} s)",
        "doctor": f"python -m bnfuse.cli doctor --json (limit {STEP_LIMITS_S['doctor']} s)",
        "ort_cuda_provider": "runs only where onnxruntime-gpu is installed (doctor's CUDA checks)",
    }
    lines = [f"bnfuse GPU acceptance plan (budget {args.budget:.0f} s, results in {args.out})"]
    lines += [f"  {name:<18} {what[name]}" for name in STEPS]
    if args.skip:
        lines.append(f"skipped by request: {', '.join(args.skip)}")
    if env is not None:
        lines.append(f"here: Python {env['python']}, GPU: {env.get('gpu') or missing}, onnxruntime providers: "
                     f"{', '.join(env.get('providers', [])) or 'none'}")  # fmt: skip
        if missing:
            lines.append(f"here the GPU steps (cuda_tests, bandwidth, nccl) would be not run: {missing}")
    return lines


def _bandwidth_plan(quick: bool) -> list[Any]:
    sys.path.insert(0, str(ROOT / "bench"))
    import gpu_bandwidth

    return gpu_bandwidth.plan(quick)


def report_json(
    steps: list[Step], env: dict[str, Any], args: argparse.Namespace, started: str, seconds: float
) -> dict[str, Any]:
    bandwidth = next((s.data.get("rows", []) for s in steps if s.name == "bandwidth"), [])
    return {
        "schema": SCHEMA,
        "started_utc": started,
        "seconds": round(seconds, 1),
        "command": [Path(sys.executable).name, *sys.argv],
        "ok": not any(s.status == FAIL for s in steps),
        "environment": env,
        "steps": [asdict(s) for s in steps],
        "bandwidth": bandwidth,
        "budget_s": args.budget,
    }


def validate(report: dict[str, Any]) -> list[str]:
    """Problems with a report's shape (empty when it follows SCHEMA): the tests and readers rely on it."""
    problems = []
    for key, kind in (("schema", str), ("started_utc", str), ("seconds", float), ("ok", bool),
                      ("environment", dict), ("steps", list), ("bandwidth", list)):  # fmt: skip
        if not isinstance(report.get(key), kind):
            problems.append(f"{key}: expected {kind.__name__}")
    if report.get("schema") != SCHEMA:
        problems.append(f"schema: expected {SCHEMA}")
    names = [s.get("name") for s in report.get("steps", [])]
    if names != [n for n in STEPS if n in names] or "environment" not in names:
        problems.append(f"steps: {names} not in the order {STEPS}")
    for step in report.get("steps", []):
        if step.get("status") not in (PASS, FAIL, NOT_RUN) or not isinstance(step.get("detail"), str):
            problems.append(f"step {step.get('name')}: bad status or detail")
        elif "\n" in step["detail"] or not step["detail"]:
            problems.append(f"step {step.get('name')}: detail must be one non-empty line")
    if report.get("ok") != (not any(s.get("status") == FAIL for s in report.get("steps", []))):
        problems.append("ok disagrees with the steps")
    return problems


def summary_text(report: dict[str, Any]) -> str:
    env = report["environment"]
    lines = [f"bnfuse GPU acceptance, {report['started_utc']}, {report['seconds']:.0f} s: "
             f"{'OK' if report['ok'] else 'FAILED'}",
             f"machine: {env.get('gpu') or 'no GPU'}; Python {env['python']}; "
             f"CUDA runtime {env.get('cuda_runtime', '-')}, driver {env.get('cuda_driver', '-')}"]  # fmt: skip
    lines += [
        f"  {s['status'].upper():<8} {s['name']:<18} {s['detail']} ({s['seconds']:.0f} s)" for s in report["steps"]
    ]
    rows = [r for r in report["bandwidth"] if r.get("bnfuse_ms") is not None]
    if rows:
        lines.append("bandwidth (bnfuse GB/s; fraction of a device copy; bnfuse time / cuDNN time):")
        for r in rows:
            ratio = f"{r['bnfuse_over_contender']:.2f}x" if r.get("bnfuse_over_contender") else "-"
            peer = "cuDNN" if r.get("contender") == "cudnn" else "torch"
            lines.append(f"  {r['op']:<17} {r['dtype']:<8} {r['layout']:<4} {r['shape_name']:<22} "
                         f"{r['bnfuse_gb_per_s']:7.1f} GB/s  {r.get('fraction_of_copy') or 0:.2f} of copy  "
                         f"{ratio} {peer}")  # fmt: skip
    skipped = [r for r in report["bandwidth"] if r.get("bnfuse_ms") is None]
    if skipped:
        lines.append(f"bandwidth cases not run: {len(skipped)} (first: {skipped[0]['status']})")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> dict[str, Any]:
    started = dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")
    clock = time.monotonic()
    budget = Budget(args.budget)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / LOG).write_text("")
    work = Path(tempfile.mkdtemp(prefix="bnfuse-gpu-"))  # intermediate files: their contents go into the JSON
    env = probe_environment(args.site)
    gpu = (
        env.get("gpu") or gpu_missing(env) or f"{env.get('devices')} device(s), no properties ({env.get('cupy_error')})"
    )
    steps = [Step("environment", PASS, f"Python {env['python']}; GPU: {gpu}",
                  time.monotonic() - clock)]  # fmt: skip
    missing = gpu_missing(env)
    providers = env.get("providers", [])
    by_name: dict[str, Step] = {}
    actions = {
        "wheels": lambda: step_wheels(args.wheels, args.site),
        "entry_library": lambda: step_entry_library(args.site),
        "cuda_tests": lambda: step_cuda_tests(args.out, work, args.site, budget, missing),
        "doctor": lambda: step_doctor(args.out, args.site, budget, providers),
        "ort_cuda_provider": lambda: step_ort_cuda_provider(providers, by_name.get("doctor")),
        "bandwidth": lambda: step_bandwidth(args.out, work, args.site, budget, missing, env, args.quick),
        "nccl": lambda: step_nccl(args.out, work, args.site, budget, missing, env),
    }
    for name in STEPS[1:]:
        begin = time.monotonic()
        if name in args.skip:
            step = Step(name, NOT_RUN, "skipped by request (--skip)")
        else:
            try:
                step = actions[name]()
            except Exception as exc:  # noqa: BLE001 - one broken step must not lose the others' results
                step = Step(name, FAIL, f"{type(exc).__name__}: {_one_line(str(exc))}")
        step.seconds = round(time.monotonic() - begin, 1)
        by_name[name] = step
        steps.append(step)
        print(f"{step.status.upper():<8} {name:<18} {step.detail} ({step.seconds:.0f} s)", flush=True)
    report = report_json(steps, env, args, started, time.monotonic() - clock)
    return report


def write(report: dict[str, Any], out: Path) -> str:
    """Writes the JSON and the summary (each through a temporary file and a rename); returns the summary."""
    text = summary_text(report)
    for name, content in (("gpu_acceptance.json", json.dumps(report, indent=1)), ("gpu_acceptance.txt", text + "\n")):
        tmp = out / f".{name}.tmp"
        tmp.write_text(content)
        tmp.replace(out / name)
    return text


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.dry_run:
        env = probe_environment(args.site)
        print("\n".join(plan_lines(args, env)))
        return 0
    report = run(args)
    problems = validate(report)
    if problems:  # a bug in this script, not in bnfuse: say so, keep the results
        report["schema_problems"] = problems
    print(write(report, args.out))
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
