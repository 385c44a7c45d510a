"""The custom-op library's lifetime in someone else's process: sessions that outlive module teardown end cleanly.

Every test starts a fresh interpreter (guest_cases.py builds and checks the sessions): a crash at exit only shows
in the process's exit status. Each teardown pattern holds a session of every kind (guest_cases.KINDS: inference,
training and grad ops, a TrainingSession, an optimizer op, a distributed session on one rank); the runpy pattern,
where the segmentation fault was reported, also holds each kind alone.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("mpi4py", reason="the distributed session needs mpi4py (pip install -e '.[test]')")

REPO = Path(__file__).resolve().parents[2]
CASES = Path(__file__).resolve().parent
KINDS = ("inference", "training", "grad", "training_session", "optimizer", "distributed")
LIMIT_S = 300

# pattern -> (the file's text, the command's arguments after the interpreter; {file} is the file's path)
PATTERNS: dict[str, tuple[str, tuple[str, ...]]] = {
    # a notebook, test runner or task runner keeps the namespace of the script it ran
    "runpy": (
        "def make():\n    return guest_cases.build(KINDS)\n\nheld = make()\nguest_cases.use(held)\n",
        ("-c", "import runpy, sys; g = runpy.run_path(sys.argv[1])", "{file}"),
    ),
    "plain": ("held = guest_cases.build(KINDS)\nguest_cases.use(held)\n", ("{file}",)),
    # only a reference cycle holds the sessions, and the collector is off: they die in the final collection
    "cycle": (
        "import gc\ngc.disable()\nbox = [guest_cases.build(KINDS)]\nbox.append(box)\n"
        "guest_cases.use(box[0])\ndel box\n",
        ("{file}",),
    ),
    "lru_cache": (
        "import functools\n\n@functools.lru_cache(maxsize=None)\ndef held():\n    return guest_cases.build(KINDS)\n\n"
        "guest_cases.use(held())\n",
        ("{file}",),
    ),
    # sessions used at exit, and more made there that only the module's globals hold
    "atexit": (
        "import atexit\nheld = guest_cases.build(KINDS)\n\ndef at_exit():\n    guest_cases.use(held)\n"
        "    globals()['late'] = guest_cases.build(KINDS)\n\natexit.register(at_exit)\n",
        ("{file}",),
    ),
    "pytest": (
        "HELD = guest_cases.build(KINDS)\n\ndef test_use():\n    guest_cases.use(HELD)\n",
        ("-m", "pytest", "-q", "-s", "-p", "no:cacheprovider", "{file}"),
    ),
}


def run_pattern(tmp_path: Path, pattern: str, kinds: tuple[str, ...]) -> subprocess.CompletedProcess[str]:
    text, arguments = PATTERNS[pattern]
    prelude = f"import sys\nsys.path.insert(0, {str(CASES)!r})\nimport guest_cases\nKINDS = {kinds!r}\n"
    file = tmp_path / ("test_held.py" if pattern == "pytest" else "held.py")
    file.write_text(prelude + text)
    command = [sys.executable, "-X", "faulthandler", *(a.format(file=file) for a in arguments)]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run(command, capture_output=True, text=True, timeout=LIMIT_S, env=env, cwd=tmp_path)


def assert_clean_exit(result: subprocess.CompletedProcess[str], kinds: tuple[str, ...], uses: int = 1) -> None:
    report = f"exit {result.returncode}\nstdout:\n{result.stdout[-3000:]}\nstderr:\n{result.stderr[-3000:]}"
    assert result.returncode == 0, report
    assert "Fatal Python error" not in result.stderr and "Exception ignored" not in result.stderr, report
    for kind in kinds:
        assert result.stdout.count(f"built {kind}\n") >= 1, report
        assert result.stdout.count(f"used {kind}\n") == uses, report


@pytest.mark.parametrize("pattern", list(PATTERNS))
def test_sessions_of_every_kind_end_cleanly(tmp_path: Path, pattern: str) -> None:
    result = run_pattern(tmp_path, pattern, KINDS)
    assert_clean_exit(result, KINDS)
    if pattern == "atexit":  # the sessions made at exit were built and checked too
        assert all(result.stdout.count(f"built {kind}\n") == 2 for kind in KINDS), result.stdout
    if pattern == "pytest":
        assert "1 passed" in result.stdout, result.stdout


@pytest.mark.parametrize("kind", KINDS)
def test_each_kind_alone_in_a_runpy_namespace(tmp_path: Path, kind: str) -> None:
    """The reported case: a session made in a function of a script run by runpy.run_path, its namespace kept."""
    assert_clean_exit(run_pattern(tmp_path, "runpy", (kind,)), (kind,))


def _run_python(code: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run(
        [sys.executable, "-X", "faulthandler", "-c", textwrap.dedent(code)],
        capture_output=True, text=True, timeout=LIMIT_S, env=env,
    )  # fmt: skip


def test_no_call_into_python_once_the_interpreter_finalizes() -> None:
    """While the interpreter reports finalizing (here a stand-in flag), the library answers onnxruntime without
    Python: a Python op's run and kernel creation (options registered earlier) fail with an onnxruntime error saying
    why, a registration gets the native ops only (which run), destroying a session leaves its kernels' Python state
    alone; with the real flag back everything works again."""
    result = _run_python(
        f"""
        import ctypes, gc, sys
        import numpy as np, onnxruntime as ort
        sys.path.insert(0, {str(CASES)!r})
        import guest_cases
        from bnfuse.runtime import ops, ortabi, registry, session_options

        registry._requested.python_cpu = True  # the Python glue's lifetime (the native ops need no Python at all)
        session, check = guest_cases._op_session(ops.TRAINING, False, (4, 3, 5))
        check()
        early = session_options()  # registered while Python runs; a session made from it later
        grad_model = ops.single_op_model(ops.GRAD).SerializeToString()
        library = ortabi._entry.library
        callbacks = ortabi._registry.callbacks
        set_python = library.bnfuse_set_python
        finalizing = ctypes.CFUNCTYPE(ctypes.c_int)(lambda: 1)
        live, refused = ortabi.live_kernel_count(), ortabi.refused_call_count()
        assert live >= 1 and refused == 0, (live, refused)
        set_python(ctypes.cast(finalizing, ctypes.c_void_p).value, callbacks["CreateKernelV2"],
                   callbacks["KernelDestroy"], ortabi.OP_INFO_OFFSET)
        assert library.bnfuse_python_usable() == 0
        feeds = guest_cases._feeds(ops.TRAINING, (4, 3, 5))
        for attempt in (lambda: session.run(None, feeds),  # compute
                        lambda: ort.InferenceSession(grad_model, early, providers=["CPUExecutionProvider"])):  # kernel
            try:
                attempt()
                raise SystemExit("ran while the interpreter was finalizing")
            except Exception as exc:  # onnxruntime's Fail / RuntimeException, whichever the call raises
                assert "the Python interpreter is shutting down" in str(exc), exc
        # a registration now gets the native ops only (no Python asked), and they run
        native = ort.InferenceSession(grad_model, session_options(), providers=["CPUExecutionProvider"])
        native.run(None, guest_cases._feeds(ops.GRAD, (4, 3, 5)))
        del session, check, attempt, native  # the check and the lambda hold the session too
        gc.collect()
        assert ortabi.live_kernel_count() == live, "a kernel's Python state was touched"
        assert ortabi.refused_call_count() >= 4, ortabi.refused_call_count()
        set_python(ortabi._finalizing_function(), callbacks["CreateKernelV2"], callbacks["KernelDestroy"],
                   ortabi.OP_INFO_OFFSET)
        assert library.bnfuse_python_usable() == 1
        session, check = guest_cases._op_session(ops.GRAD, False, (6, 4))
        check()
        del session, check
        gc.collect()
        assert ortabi.live_kernel_count() == live, ortabi.live_kernel_count()
        print("refused while finalizing, fine after")
        """
    )
    assert result.returncode == 0 and "refused while finalizing, fine after" in result.stdout, result.stderr[-3000:]


def test_a_run_during_the_final_collection_is_refused_cleanly() -> None:
    """The real flag: an object whose ``__del__`` runs its session dies in the final garbage collection (a cycle, the
    collector off); the run fails with the onnxruntime error, the process exits 0."""
    result = _run_python(
        f"""
        import gc, os, sys
        import onnxruntime
        sys.path.insert(0, {str(CASES)!r})
        import guest_cases
        from bnfuse.runtime import ops, registry

        registry._requested.python_cpu = True  # the Python glue (the native ops would simply run)

        class RunsAtFinalization:
            def __init__(self):
                self.session, check = guest_cases._op_session(ops.TRAINING, False, (4, 3, 5))
                check()
                self.feeds = guest_cases._feeds(ops.TRAINING, (4, 3, 5))
                self.outputs = [output.name for output in self.session.get_outputs()]
                self.options = onnxruntime.RunOptions()
                self.write, self.finalizing = os.write, sys.is_finalizing  # module globals are gone by then

            def __del__(self):
                try:  # the binding itself: onnxruntime's Python wrapper may be torn down already
                    self.session._sess.run(self.outputs, self.feeds, self.options)
                    self.write(1, b"ran\\n")
                except Exception as exc:
                    self.write(1, f"finalizing={{self.finalizing()}} refused: {{exc}}\\n".encode())

        gc.disable()
        box = [RunsAtFinalization()]
        box.append(box)
        del box
        print("built", flush=True)
        """
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "finalizing=True refused: " in result.stdout, result.stdout
    assert "the Python interpreter is shutting down" in result.stdout, result.stdout
