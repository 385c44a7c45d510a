"""The reported teardown crash, reproduced in a loop: a bnfuse session made in a function of a script whose namespace
a driver keeps (``runpy.run_path``, as notebooks, test runners and task runners do) must end with exit 0.

    python bench/guest_teardown.py [--runs 20]

Writes the 15-line script of the report (one BatchNormalizationTraining node, the session made in a function and
returned), runs ``python -X faulthandler -c "import runpy; g = runpy.run_path('script.py')"`` ``--runs`` times in
fresh interpreters, prints a markdown table of the exit statuses and times, and exits 1 unless every run exited 0.
Before the fix every run died with SIGSEGV (exit -11 here, 139 from a shell) in the final garbage collection.
tests/runtime/test_ortabi_lifetime.py runs this pattern (and five others) once per session kind in CI.
"""

from __future__ import annotations

import argparse
import collections
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.common import machine_description, markdown_table, today  # noqa: E402

SCRIPT = """\
import numpy as np
import onnxruntime as ort
import bnfuse.runtime
from bnfuse.runtime import ops


def make_session():
    so = bnfuse.runtime.session_options()
    model = ops.single_op_model(ops.TRAINING).SerializeToString()
    return ort.InferenceSession(model, so, providers=["CPUExecutionProvider"])


session = make_session()
x, p = np.ones((4, 3, 5), np.float32), np.ones(3, np.float32)
print([o.shape for o in session.run(None, dict(zip(ops.INPUT_NAMES[ops.TRAINING], (x, p, p, p, p))))])
"""
EXPECTED = "[(4, 3, 5), (3,), (3,), (3,), (3,)]"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=20)
    args = parser.parse_args(argv)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    statuses: collections.Counter[int] = collections.Counter()
    seconds, wrong_output = [], 0
    with tempfile.TemporaryDirectory() as directory:
        script = Path(directory) / "script.py"
        script.write_text(SCRIPT)
        command = [sys.executable, "-X", "faulthandler", "-c", "import runpy; g = runpy.run_path('script.py')"]
        for _ in range(args.runs):
            start = time.perf_counter()
            result = subprocess.run(command, cwd=directory, env=env, capture_output=True, text=True, timeout=300)
            seconds.append(time.perf_counter() - start)
            statuses[result.returncode] += 1
            wrong_output += EXPECTED not in result.stdout
    rows = [[status, count] for status, count in sorted(statuses.items())]
    print(f"{machine_description()}, {today()}: `python bench/guest_teardown.py --runs {args.runs}`\n")
    print(markdown_table(["exit status", "runs"], rows))
    print(f"\nmedian {statistics.median(seconds):.2f} s per run; runs with a wrong printed result: {wrong_output}")
    return 0 if set(statuses) == {0} and not wrong_output else 1


if __name__ == "__main__":
    raise SystemExit(main())
