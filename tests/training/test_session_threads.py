"""TrainingSession (and the ops in plain sessions) inside a PyTorch process: no other library's thread setting moves.

Each graph kind runs in a fresh interpreter (tests/runtime/guest_cases.py): a library's threading layer starts once
per process (numba's, when bnfuse's kernels were numba code, set PyTorch's OpenMP thread count on its first start),
so only a fresh process shows it. The process imports torch and sets one thread, then reads -- itself and through
threadpoolctl, never through bnfuse -- torch's intra-op threads, every loaded OpenMP runtime's thread count, dynamic
adjustment and nesting levels, the BLAS thread counts and whether numba got imported, before and after two steps;
then again with torch set to another value by the caller.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("threadpoolctl")

REPO = Path(__file__).resolve().parents[2]
CASES = REPO / "tests" / "runtime" / "guest_cases.py"
GRAPHS = ("mlp_fused", "mlp_unfused", "cnn_fused", "cnn_unfused", "mlp_distributed", "ops")


@pytest.mark.parametrize("graph", GRAPHS)
def test_thread_settings_unchanged_around_steps(graph: str) -> None:
    if graph == "mlp_distributed":
        pytest.importorskip("mpi4py")
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    result = subprocess.run(
        [sys.executable, "-X", "faulthandler", str(CASES), "threads", graph],
        capture_output=True, text=True, timeout=300, env=env,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    for before, after in (("before", "after"), ("before_again", "after_again")):
        expected, got = report[before], report[after]
        assert "torch" in expected and any("omp" in key for key in expected), expected
        for key, value in expected.items():  # a runtime first loaded during the steps has no earlier setting
            assert got[key] == value, f"{graph}: {key} was {value} before the steps, {got[key]} after"
    assert report["before"]["torch"] == 1 and report["before_again"]["torch"] == 2
    assert not report["after_again"]["numba imported"]  # bnfuse's CPU kernels are C
