"""The emulator has teeth: each planted bug, in a copy of bnfuse's .cu sources, makes the emulated run fail.

check_kernels.py runs cuda.py on the emulator (a subprocess: a fault cannot take the suite down) with the
kernel sources from a directory; the pristine sources pass, every mutant must fail the way it should.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from bnfuse.runtime import cuda

HERE = Path(__file__).resolve().parent
REQUIRE_EMULATOR = os.environ.get("BNFUSE_REQUIRE_CUDA_EMULATOR", "") not in ("", "0")

# name: (file, text, replacement, what the emulator must report); the first occurrence is replaced, except for
# __launch_bounds__ (every kernel of the file).
MUTATIONS = {
    "missing_sync_block_reduce": (
        "bn_common.cu",
        "    if (lane == 0) warp_stats[warp] = s;\n    __syncthreads();\n",
        "    if (lane == 0) warp_stats[warp] = s;\n",
        r"race: bn_stats_partial",
    ),
    "missing_sync_columns_tile": (
        "bn_stats.cu",
        "    tile[threadIdx.y][threadIdx.x] = s;\n    __syncthreads();\n",
        "    tile[threadIdx.y][threadIdx.x] = s;\n",
        r"race: bn_stats_partial_cl",
    ),
    "shuffle_in_branch": (
        "bn_common.cu",
        "        v.y += __shfl_down_sync(BN_FULL_MASK, v.y, offset);\n",
        "        if ((threadIdx.x & 31) < offset) v.y += __shfl_down_sync(BN_FULL_MASK, v.y, offset);\n",
        r"divergent shuffles|while lanes .* wait",
    ),
    "early_return_before_barrier": (
        "bn_stats.cu",
        "    BnStat s = bn_stat_empty();\n    if (c < channels) {",
        "    if (c >= channels) return;\n    BnStat s = bn_stat_empty();\n    if (c < channels) {",
        r"__syncthreads .*after \d+ thread\(s\) of the block exited|exited while \d+ thread\(s\) wait",
    ),
    "unclamped_chunk_end": (
        "bn_stats.cu",
        "i64 stop = start + chunk < count ? start + chunk : count;",
        "i64 stop = start + chunk;",
        r"memory fault \(SIGSEGV\)|max error",
    ),
    "channel_walk_off_by_one": (
        "bn_common.cu",
        "if (++offset == inner) {",
        "if (offset++ == inner) {",
        r"max error",
    ),
    "skipped_warp_tree_step": (
        "bn_common.cu",
        "for (int offset = 16; offset > 0; offset >>= 1) s = bn_stat_merge(s, bn_shfl_down(s, offset));",
        "for (int offset = 16; offset > 1; offset >>= 1) s = bn_stat_merge(s, bn_shfl_down(s, offset));",
        r"max error",
    ),
    "launch_bounds_below_block": (
        "bn_forward.cu",
        "__launch_bounds__(BN_BLOCK)",
        "__launch_bounds__(BN_BLOCK / 2)",
        r"over __launch_bounds__\(128\)",
    ),
}


def _emulator_problem() -> str | None:
    code = "import cuda_emu, sys; sys.stdout.write(cuda_emu.available() or '')"
    result = subprocess.run([sys.executable, "-c", code], env=_env(), capture_output=True, text=True)
    if result.returncode != 0:
        return (result.stderr.strip().splitlines() or ["cannot import cuda_emu"])[-1]
    return result.stdout or None


def _env() -> dict[str, str]:
    path = [str(HERE), *filter(None, [os.environ.get("PYTHONPATH")])]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(path)}


@pytest.fixture(scope="module")
def emulator() -> None:
    problem = _emulator_problem()
    if problem:
        if REQUIRE_EMULATOR:
            pytest.fail(f"BNFUSE_REQUIRE_CUDA_EMULATOR is set but the CUDA emulator cannot run: {problem}")
        pytest.skip(f"CUDA emulator unavailable: {problem}")


def _run(source_dir: Path) -> subprocess.CompletedProcess:
    command = [sys.executable, str(HERE / "check_kernels.py"), str(source_dir)]
    return subprocess.run(command, env=_env(), capture_output=True, text=True, timeout=1200)


def test_pristine_sources_pass(emulator):
    result = _run(cuda.SOURCE_DIR)
    assert result.returncode == 0, result.stderr[-4000:]


@pytest.mark.parametrize("name", sorted(MUTATIONS))
def test_planted_bug_is_caught(name, emulator, tmp_path):
    file, text, replacement, expected = MUTATIONS[name]
    copy = tmp_path / "cuda"
    shutil.copytree(cuda.SOURCE_DIR, copy)
    source = (copy / file).read_text()
    assert source.count(text) >= 1, f"the mutation no longer applies: {text!r} not in {file}"
    (copy / file).write_text(source.replace(text, replacement, -1 if "__launch_bounds__" in text else 1))
    result = _run(copy)
    assert result.returncode == 1, f"{name} was not caught:\n{result.stdout[-2000:]}{result.stderr[-2000:]}"
    verdict = result.stderr.strip().splitlines()[-1]
    print(f"{name}: {verdict}")
    assert re.search(expected, verdict), verdict
