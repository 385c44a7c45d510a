"""numba_cache.cfunc: a cached cfunc is recompiled when the module it compiles in changes (numba alone would load
the old machine code: its cache checks only the cfunc's own file)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

CALLER = """
import ctypes, sys
sys.path.insert(0, {here!r})
sys.path.insert(0, {root!r})
from numba import types
import dependency
from bnfuse.runtime import numba_cache
{compile}

def answer():
    return dependency.value() + 0

compiled = compile_it(answer, types.int64(), depends_on=dependency)
print(ctypes.CFUNCTYPE(ctypes.c_int64)(compiled.address)())
"""
WITH_GUARD = "compile_it = numba_cache.cfunc"
WITHOUT_GUARD = """
import numba
def compile_it(function, signature, depends_on):
    return numba.cfunc(signature, nopython=True, cache=True)(function)
"""


def _dependency(directory: Path, value: int) -> None:
    (directory / "dependency.py").write_text(
        textwrap.dedent(f"""
        import numba

        @numba.njit(cache=True)
        def value():
            return {value}
        """)
    )


def _answer(directory: Path, script: str) -> int:
    run = subprocess.run([sys.executable, str(directory / script)], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    return int(run.stdout.strip())


def test_an_edited_dependency_is_compiled_in_again(tmp_path: Path) -> None:
    for name, compile_code in (("guarded.py", WITH_GUARD), ("unguarded.py", WITHOUT_GUARD)):
        (tmp_path / name).write_text(CALLER.format(here=str(tmp_path), root=str(ROOT), compile=compile_code))
    _dependency(tmp_path, 1)
    assert _answer(tmp_path, "guarded.py") == 1
    assert _answer(tmp_path, "unguarded.py") == 1
    _dependency(tmp_path, 2)
    assert _answer(tmp_path, "unguarded.py") == 1  # numba's own cache: the stale machine code
    assert _answer(tmp_path, "guarded.py") == 2
    assert _answer(tmp_path, "guarded.py") == 2  # and from the refreshed cache
