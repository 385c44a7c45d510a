"""The wheel a user installs: `python -m build` from the tracked sources, repaired with auditwheel, installed into a
fresh virtual environment with no compiler reachable, and run there: the custom-op library computes a BN op in a
plain onnxruntime session.

The wheel's extensions (the custom-op library, the CPU kernels, the oneDNN glue) are built here once; installing
never compiles, so a machine without a C compiler installs it (the install below runs with CC / CXX pointing at
`false` and nothing but the new environment's tools and the system's on PATH).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# A single BatchNormalizationInference node of the domain bnfuse against NumPy, run in the wheel's environment.
CHECK = """
import sys, numpy as np, onnx, onnxruntime as ort
from onnx import helper, TensorProto
import bnfuse
assert bnfuse.__file__.startswith(sys.argv[1]), bnfuse.__file__
from bnfuse.runtime import session_options
node = helper.make_node("BatchNormalizationInference", ["x", "s", "b", "m", "v"], ["y"], domain="bnfuse", epsilon=1e-5)
f = lambda name, shape: helper.make_tensor_value_info(name, TensorProto.FLOAT, shape)
graph = helper.make_graph([node], "bn", [f("x", [2, 3, 4, 4])] + [f(n, [3]) for n in "sbmv"], [f("y", [2, 3, 4, 4])])
model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("bnfuse", 1)])
model.ir_version = 8
session = ort.InferenceSession(model.SerializeToString(), session_options(), providers=["CPUExecutionProvider"])
rng = np.random.default_rng(0)
x = rng.standard_normal((2, 3, 4, 4)).astype(np.float32)
s, b, m = (rng.standard_normal(3).astype(np.float32) for _ in range(3))
v = rng.uniform(0.5, 2, 3).astype(np.float32)
(y,) = session.run(None, {"x": x, "s": s, "b": b, "m": m, "v": v})
c = lambda a: a.astype(np.float64)[None, :, None, None]
expected = (x - c(m)) / np.sqrt(c(v) + 1e-5) * c(s) + c(b)
assert np.abs(y - expected).max() < 1e-5, np.abs(y - expected).max()
print("ok", bnfuse.runtime.library_path())
"""


def _tracked_copy(destination: Path) -> Path:
    """The repository's tracked files (what a clone holds), without build outputs of this checkout."""
    listed = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    for name in filter(None, listed.decode().split("\0")):
        source = ROOT / name
        if source.is_file():
            (destination / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, destination / name)
    return destination


@pytest.fixture(scope="module")
def repaired_wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("not a git checkout: the wheel is built from the tracked files")
    work = tmp_path_factory.mktemp("wheel")
    source = _tracked_copy(work / "source")
    build = subprocess.run(
        [sys.executable, "-m", "build", "--wheel", "--no-isolation", "--outdir", str(work / "dist"), str(source)],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert build.returncode == 0, build.stdout[-3000:] + build.stderr[-3000:]
    (wheel,) = (work / "dist").glob("bnfuse-*.whl")
    repair = subprocess.run(
        [sys.executable, "-m", "auditwheel", "repair", str(wheel), "--wheel-dir", str(work / "repaired")],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert repair.returncode == 0, repair.stdout[-3000:] + repair.stderr[-3000:]
    (repaired,) = (work / "repaired").glob("bnfuse-*manylinux*.whl")
    return repaired


def test_wheel_carries_the_compiled_library_and_no_sources_to_compile(repaired_wheel):
    names = zipfile.ZipFile(repaired_wheel).namelist()
    libraries = [n for n in names if n.startswith("bnfuse/runtime/") and n.endswith(".so")]
    assert any("_ortentry" in n for n in libraries), libraries
    assert any("_cpukernels" in n for n in libraries), libraries
    assert "manylinux" in repaired_wheel.name


def test_wheel_installs_without_a_compiler_and_runs(repaired_wheel, tmp_path):
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    python = venv / "bin" / "python"
    environment = {
        **os.environ,
        "CC": "false",
        "CXX": "false",
        "PATH": f"{venv / 'bin'}:/usr/bin:/bin",
        "PIP_DISABLE_PIP_VERSION_CHECK": "1",
    }
    environment.pop("PYTHONPATH", None)
    install = subprocess.run(
        [str(python), "-m", "pip", "install", "--quiet", "--only-binary=:all:", f"{repaired_wheel}[cpu]"],
        capture_output=True,
        text=True,
        env={**environment, "PIP_NO_BUILD_ISOLATION": "0"},
        timeout=1800,
    )
    if install.returncode != 0 and "No matching distribution" in install.stderr and "bnfuse" not in install.stderr:
        pytest.fail(f"a dependency has no wheel for this platform: {install.stderr[-2000:]}")
    assert install.returncode == 0, install.stderr[-3000:]
    command = [str(python), "-c", CHECK, str(venv)]
    run = subprocess.run(command, capture_output=True, text=True, env=environment, cwd=tmp_path, timeout=600)
    assert run.returncode == 0, run.stdout + run.stderr
    assert run.stdout.startswith("ok ") and str(venv) in run.stdout
