"""pyproject's extras, resolved by pip itself (no GPU needed): an install ends with exactly one onnxruntime
distribution, and on GPU installs CuPy's wheel is built for the CUDA major onnxruntime-gpu is built for.

`pip install --dry-run --ignore-installed --report` resolves each extra against the configured index. The test
skips only when the index cannot be reached (no network), never when the extras conflict or the index answers
that a required distribution does not exist.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
ONNXRUNTIME_DISTRIBUTIONS = {"onnxruntime", "onnxruntime-gpu", "onnxruntime-directml", "onnxruntime-openvino"}
TARGETS = {"base": ".", "cpu": ".[cpu]", "gpu": ".[gpu]", "gpu+test": ".[gpu,test]"}
# Only a network that cannot be reached skips. "No matching distribution found" is an answer from the index:
# an extra that names a package or version that does not exist (the defect this file exists to catch) fails.
UNREACHABLE = re.compile(
    r"NewConnectionError|Network is unreachable|Temporary failure in name resolution|Max retries exceeded",
    re.I,
)


def _canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _resolve(target: str, report: Path) -> tuple[dict[str, dict] | None, str]:
    command = [sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--no-build-isolation",
               "--quiet", "--report", str(report), target]  # fmt: skip
    run = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=900)
    if run.returncode != 0:
        return None, run.stderr
    install = json.loads(report.read_text())["install"]
    return {_canonical(item["metadata"]["name"]): item["metadata"] for item in install}, run.stderr


@pytest.fixture(scope="module")
def resolved(tmp_path_factory) -> dict[str, dict[str, dict]]:
    work = tmp_path_factory.mktemp("pip-reports")
    with ThreadPoolExecutor(2) as pool:
        results = dict(zip(TARGETS, pool.map(lambda t: _resolve(TARGETS[t], work / f"{t}.json"), TARGETS), strict=True))
    out = {}
    for name, (packages, stderr) in results.items():
        if packages is None:
            if UNREACHABLE.search(stderr):
                pytest.skip(f"the package index cannot answer for {TARGETS[name]}: {UNREACHABLE.search(stderr)[0]}")
            pytest.fail(f"pip cannot resolve {TARGETS[name]}:\n{stderr[-3000:]}")
        out[name] = packages
    return out


def _onnxruntimes(packages: dict[str, dict]) -> set[str]:
    return set(packages) & ONNXRUNTIME_DISTRIBUTIONS


def _cuda_major_of_onnxruntime_gpu(metadata: dict) -> int:
    """From onnxruntime-gpu's own [cuda] extra: nvidia-cuda-runtime-cu12~=12.0 or nvidia-cuda-runtime~=13.0."""
    for requirement in metadata.get("requires_dist", []):
        match = re.match(r"nvidia-cuda-runtime(?:-cu(\d+))?\s*~=\s*(\d+)", requirement)
        if match:
            return int(match.group(1) or match.group(2))
    raise AssertionError(f"onnxruntime-gpu {metadata['version']} names no CUDA runtime in its requirements")


def test_every_install_has_exactly_one_onnxruntime(resolved):
    assert _onnxruntimes(resolved["cpu"]) == {"onnxruntime"}
    assert _onnxruntimes(resolved["gpu"]) == {"onnxruntime-gpu"}
    assert _onnxruntimes(resolved["gpu+test"]) == {"onnxruntime-gpu"}
    assert _onnxruntimes(resolved["base"]) == set()  # the base install leaves the choice to the extras


@pytest.mark.parametrize("target", ["gpu", "gpu+test"])
def test_cupy_matches_the_cuda_major_of_onnxruntime_gpu(resolved, target):
    packages = resolved[target]
    cupy = [name for name in packages if re.fullmatch(r"cupy-cuda\d+x", name)]
    assert len(cupy) == 1, cupy
    ort_major = _cuda_major_of_onnxruntime_gpu(packages["onnxruntime-gpu"])
    assert cupy[0] == f"cupy-cuda{ort_major}x", (cupy[0], packages["onnxruntime-gpu"]["version"], ort_major)
    # the CUDA libraries onnxruntime-gpu's [cuda,cudnn] extras bring are that same major
    runtime = [n for n in packages if n.startswith("nvidia-cuda-runtime")]
    assert runtime and all(packages[n]["version"].split(".")[0] == str(ort_major) for n in runtime), runtime


def test_cpu_install_has_no_gpu_packages(resolved):
    assert not [name for name in resolved["cpu"] if name.startswith(("cupy", "nvidia-"))]


def test_extras_declared_as_documented():
    """README's set-up commands install the cpu extra; .ci/run installs the one the README names."""
    tomllib = pytest.importorskip("tomllib")
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert {"cpu", "gpu", "test", "oracle"} <= set(extras)
    assert not any("onnxruntime" in r for r in extras["test"] + extras["oracle"])
    readme = (ROOT / "README.md").read_text()
    assert "pip install -q -e '.[cpu]'" in readme and "'bnfuse[gpu]'" in readme
