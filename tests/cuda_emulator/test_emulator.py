"""The CUDA emulator's rules, one small kernel each (semantics_cases.py, run in a subprocess)."""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
REQUIRE_EMULATOR = os.environ.get("BNFUSE_REQUIRE_CUDA_EMULATOR", "") not in ("", "0")


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE), *filter(None, [os.environ.get("PYTHONPATH")])])}


@pytest.fixture(scope="module")
def results() -> dict:
    code = "import cuda_emu, sys; sys.stdout.write(cuda_emu.available() or '')"
    probe = subprocess.run([sys.executable, "-c", code], env=_env(), capture_output=True, text=True)
    problem = probe.stdout if probe.returncode == 0 else probe.stderr[-500:]
    if problem:
        if REQUIRE_EMULATOR:
            pytest.fail(f"BNFUSE_REQUIRE_CUDA_EMULATOR is set but the CUDA emulator cannot run: {problem}")
        pytest.skip(f"CUDA emulator unavailable: {problem}")
    run = subprocess.run([sys.executable, str(HERE / "semantics_cases.py")], env=_env(), capture_output=True,
                         text=True, timeout=600)  # fmt: skip
    assert run.returncode == 0, run.stderr[-4000:]
    return json.loads(run.stdout)


def _shfl_model(kind: str, arg: int, width: int) -> list[float]:
    """PTX shfl.sync: the source lane per lane; a source past the lane's segment of `width` lanes (before it,
    for up) reads the lane's own value; xor may read an earlier segment (CUDA guide, __shfl_xor_sync)."""
    values = [10.0 * lane for lane in range(32)]
    out = []
    for lane in range(32):
        start = lane - lane % width
        src = {"down": lane + arg, "up": lane - arg, "xor": lane ^ arg, "idx": start + arg % width}[kind]
        valid = src >= start if kind == "up" else src < start + width
        out.append(values[src] if valid else values[lane])
    return out


@pytest.mark.parametrize("kind", ["down", "up", "xor", "idx"])
@pytest.mark.parametrize("arg, width", [(1, 32), (3, 8), (5, 32), (17, 16)])
def test_shuffles_follow_ptx(results, kind, arg, width):
    got = results[f"shfl_{kind}_{arg}_{width}"]
    assert got["error"] is None, got["error"]
    assert got["out"] == _shfl_model(kind, arg, width)


ERRORS = {
    "shfl_divergent": r"divergent shuffles",
    "shfl_after_exit": r"names lane 5, which has exited|exited while lanes of its warp wait",
    "shfl_outside_mask": r"lane 8 reads lane 16, which is not in the mask 0x0000ffff",
    "shfl_short_block": r"names lane 16, which does not exist \(the block has 48 threads",
    "barrier_divergent": r"divergent barriers",
    "barrier_after_exit": r"after 1 thread\(s\) of the block exited",
    "cross_block_race": r"race: cross_block_race .* reverse",
    "out_of_bounds": r"kernel out_of_bounds, block \(0,0,0\) thread \(\d+,0,0\): memory fault \(SIGSEGV\) at address",
    "stack_overflow": r"kernel stack_overflow, block \(0,0,0\) thread \(0,0,0\): memory fault .*stack guard page",
    "over_launch_bounds": r"128 threads, over __launch_bounds__\(64\)",
    "grid_y_limit": r"exceeds CUDA's limits",
    "scalar_size": r"argument 1 \(i64 n\): needs a numpy int64 scalar, got int32",
    "python_float": r"argument 2 \(double d\): needs a numpy float64 scalar, got float",
    "pointer_dtype": r"argument 0 \(float\* out\): array of float64, the kernel reads float",
    "host_array": r"argument 0 \(float\* out\): expected a device array, got ndarray",
}


@pytest.mark.parametrize("case", sorted(ERRORS))
def test_errors_instead_of_silent_results(results, case):
    error = results[case]["error"]
    assert error is not None, f"{case} ran without an error"
    assert re.search(ERRORS[case], error), error


def test_correct_kernels_run(results):
    assert results["shfl_partial_mask"]["out"][:8] == [float(i + 8) for i in range(8)]
    assert results["shfl_partial_mask"]["out"][8:16] == [float(i) for i in range(8, 16)]  # past the segment: own
    assert results["barrier_ok"]["out"] == [float(63 - i) for i in range(64)]
    assert results["bounded_ok"]["out"][:64] == [3.5] * 64


def test_memory_is_poisoned(results):
    """empty() and each block's __shared__ memory start as NaN: a read of what was never written shows."""
    assert results["empty_is_nan"]["out"] == [True]
    shared = results["shared_uninitialized"]["out"]
    assert shared[0] == 1.0 and all(math.isnan(v) for v in shared[1:])
