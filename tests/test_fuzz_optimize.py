"""Fuzzing `bnfuse optimize` (bench/fuzz_optimize.py): mutated small models, each run in its own subprocess.

Seeded, so a failure reproduces: the case number names the mutation (``make_case(index, SEED, ...)``).
No case may give a traceback, hang, print more than one line, change its input or leave a file behind, and
every model written must compute what its input computes in onnxruntime. The long run (10,000+ cases) and its
counts are in bench/RESULTS.md.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from tests.loaders import bench_module

ROOT = Path(__file__).resolve().parents[1]
SEED = 2026
CASES = 240
TIMEOUT_S = 60


fuzz = bench_module("fuzz_optimize", "bnfuse_fuzz_optimize")


def _run(argv: list[str]) -> tuple[int | None, str]:
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    try:
        done = subprocess.run(
            [sys.executable, "-m", "bnfuse.cli", *argv], capture_output=True, text=True, timeout=TIMEOUT_S, env=env
        )
    except subprocess.TimeoutExpired:
        return None, ""
    return done.returncode, done.stderr


def test_mutated_models_give_one_line_or_an_equal_model(tmp_path: Path) -> None:
    seeds = fuzz.seed_models()
    cases = [fuzz.make_case(index, SEED, tmp_path, seeds) for index in range(CASES)]
    before = [fuzz.digests(case.files) for case in cases]
    with ThreadPoolExecutor(max_workers=2) as pool:
        results = list(pool.map(lambda case: _run(case.argv), cases))
    counts: Counter[str] = Counter()
    defects = []
    for index, (case, (code, stderr), digests) in enumerate(zip(cases, results, before, strict=True)):
        outcome, detail = fuzz.judge(case, code, stderr, digests)
        counts[outcome] += 1
        if outcome not in fuzz.OK_OUTCOMES:
            defects.append(
                f"case {index} ({case.label}, {' '.join(case.argv[:1] + case.argv[4:])}): {outcome}: {detail}"
            )
    assert not defects, "\n".join(defects)
    # The mix must exercise both sides: refusals and models written and compared in onnxruntime.
    assert counts["exit 2"] >= CASES // 4 and counts["exit 0, equal"] >= CASES // 10, dict(counts)
