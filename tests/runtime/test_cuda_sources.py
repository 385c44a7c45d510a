"""The CUDA sources compile with nvcc for sm_80 and sm_90 and define every kernel cuda.py launches.

Runs without a GPU (CI has none): a compile check only. The kernels' numerics are tested in test_cuda.py
where a GPU and CuPy exist.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess

import pytest

from bnfuse.runtime import cuda

NVCC = shutil.which("nvcc")
# CI (.ci/run) sets BNFUSE_REQUIRE_NVCC=1: there a missing nvcc fails these tests instead of skipping them.
REQUIRE_NVCC = os.environ.get("BNFUSE_REQUIRE_NVCC", "") not in ("", "0")
needs_nvcc = pytest.mark.skipif(NVCC is None and not REQUIRE_NVCC, reason="nvcc not installed")
ALL_SOURCES = sorted(p.name for p in cuda.SOURCE_DIR.glob("*.cu"))


def _nvcc(source: str, arch: str, kind: str, output, *extra: str) -> subprocess.CompletedProcess:
    if NVCC is None:  # only reached with BNFUSE_REQUIRE_NVCC set
        pytest.fail("BNFUSE_REQUIRE_NVCC is set but nvcc is not on PATH: the CUDA compile check cannot run")
    command = [NVCC, "-std=c++17", f"-arch={arch}", kind, "-o", str(output), f"-I{cuda.SOURCE_DIR}",
               *cuda.KERNEL_DEFINES, *extra]  # fmt: skip
    return subprocess.run([*command, str(cuda.SOURCE_DIR / source)], capture_output=True, text=True, timeout=300)


def test_ci_requires_nvcc():
    """.ci/run exports BNFUSE_REQUIRE_NVCC before the test command, so CI never skips the compile check."""
    lines = (cuda.SOURCE_DIR.parents[2] / ".ci" / "run").read_text().splitlines()
    test_line = next(i for i, line in enumerate(lines) if "pytest" in line and not line.startswith("#"))
    assert "export BNFUSE_REQUIRE_NVCC=1" in lines[:test_line]


def test_every_source_is_listed():
    assert set(cuda.SOURCES) | {"bn_common.cu"} == set(ALL_SOURCES)


@needs_nvcc
@pytest.mark.parametrize("variant", [(), (cuda.NO_BF16,)], ids=["with_bf16", "no_bf16"])
@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
@pytest.mark.parametrize("source", ALL_SOURCES)
def test_compiles_to_cubin_without_warnings(source, arch, variant, tmp_path):
    flags = ("-Xptxas", "-warn-spills,-warn-lmem-usage", *variant)
    result = _nvcc(source, arch, "-cubin", tmp_path / "out.cubin", *flags)
    assert result.returncode == 0, result.stderr
    assert "warning" not in result.stderr.lower(), result.stderr
    assert (tmp_path / "out.cubin").stat().st_size > 0


@needs_nvcc
@pytest.mark.parametrize("source", cuda.SOURCES)
def test_ptx_defines_every_launched_kernel(source, tmp_path):
    result = _nvcc(source, "sm_80", "--ptx", tmp_path / "out.ptx")
    assert result.returncode == 0, result.stderr
    entries = set(re.findall(r"\.entry\s+(\w+)\(", (tmp_path / "out.ptx").read_text()))
    assert set(cuda.kernel_names()[source]) <= entries
    # the float32 / float16 build (what cuda.py compiles unless the data is bfloat16) has all but bf16
    result = _nvcc(source, "sm_80", "--ptx", tmp_path / "lean.ptx", cuda.NO_BF16)
    assert result.returncode == 0, result.stderr
    lean = set(re.findall(r"\.entry\s+(\w+)\(", (tmp_path / "lean.ptx").read_text()))
    assert lean == {name for name in entries if not name.endswith("_bf16")}
    assert {name for name in cuda.kernel_names()[source] if not name.endswith("_bf16")} <= lean


def test_sources_are_nvrtc_friendly_and_atomic_free():
    """CuPy compiles with NVRTC: only CUDA's own headers; determinism: no atomics anywhere."""
    for name in ALL_SOURCES:
        text = (cuda.SOURCE_DIR / name).read_text()
        includes = re.findall(r"#include\s*[<\"]([^>\"]+)[>\"]", text)
        assert set(includes) <= {"cuda_fp16.h", "cuda_bf16.h", "bn_common.cu"}, (name, includes)
        assert not re.search(r"\batomic[A-Z]\w*\s*\(", text), name
