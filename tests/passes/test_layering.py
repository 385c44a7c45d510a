"""passes/fold and passes/check import one way: each module only those below it in LAYERS, the folds never the
proof and the proof never the folds (optimize.py joins them)."""

from __future__ import annotations

import ast
from pathlib import Path

PASSES = Path(__file__).resolve().parents[2] / "bnfuse" / "passes"
# bottom first; a module may import only modules of earlier entries (or of its own entry, none here)
LAYERS = {
    "fold": [
        "scale_kernel",
        "fold_math",
        "moves_math",
        "reparam_math",
        "scale_shift",
        "context",
        "bounds",
        "surgery",
        "producers",
        "layout",
        "backward",
        "forward",
        "moves",
        "qdq",
        "reparam",
        "graph",
    ],
    "check": ["inputs", "engines", "tolerances", "fold_probes", "compare"],
}


def package_imports(path: Path, package: str) -> set[str]:
    """Modules of ``bnfuse.passes.<package>`` that ``path`` imports (at any depth of the module)."""
    prefix = f"bnfuse.passes.{package}"
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            if node.module == prefix:
                found.update(alias.name for alias in node.names)
            elif node.module.startswith(prefix + "."):
                found.add(node.module.removeprefix(prefix + "."))
        elif isinstance(node, ast.Import):
            found.update(a.name.removeprefix(prefix + ".") for a in node.names if a.name.startswith(prefix + "."))
    return found


def test_every_module_is_in_its_layer_list() -> None:
    for package, order in LAYERS.items():
        modules = {p.stem for p in (PASSES / package).glob("*.py")} - {"__init__"}
        assert modules == set(order), (package, modules ^ set(order))


def test_modules_import_only_those_below_them() -> None:
    for package, order in LAYERS.items():
        for index, module in enumerate(order):
            above = set(order[index:])
            imported = package_imports(PASSES / package / f"{module}.py", package)
            assert not imported & above, f"{package}/{module}.py imports {sorted(imported & above)} (not below it)"


def test_folds_and_proof_do_not_import_each_other() -> None:
    for package, other in (("fold", "check"), ("check", "fold")):
        for path in (PASSES / package).glob("*.py"):
            assert not package_imports(path, other), f"{package}/{path.name} imports passes.{other}"
