"""Loading the files tests use that are not importable modules: bench scripts, examples, the training tests' PyTorch
twins (tests/passes/training/torch_nets.py) and test files whose helpers another test file shares.

``from tests.loaders import bench_module, load_file, torch_nets``: pytest's importlib mode (pyproject.toml) puts no
test directory on sys.path, but resolves the ``tests`` namespace from the repository root. Each call executes the
file afresh, as a module of its own.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "bench"
TORCH_NETS = ROOT / "tests" / "passes" / "training" / "torch_nets.py"


def load_file(path: Path, name: str) -> ModuleType:
    """The Python file ``path`` executed as module ``name``, registered in sys.modules (a dataclass, a pickle or
    another script's ``import name`` looks its module up there)."""
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None, path
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module


def bench_module(script: str, name: str | None = None) -> ModuleType:
    """bench/<script>.py as a module (named ``bnfuse_bench_<script>`` unless ``name`` is given)."""
    return load_file(BENCH / f"{script}.py", name or f"bnfuse_bench_{script}")


def torch_nets() -> ModuleType:
    """The PyTorch twins of the training tests' networks; imports torch, so call it after importorskip("torch")."""
    return load_file(TORCH_NETS, "bnfuse_test_torch_nets")
