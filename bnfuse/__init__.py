"""bnfuse: batch normalization on ONNX models, end to end."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

if TYPE_CHECKING:
    from bnfuse.passes.optimize import optimize as optimize
    from bnfuse.passes.optimize_file import optimize_file as optimize_file
    from bnfuse.training.recalibrate import recalibrate as recalibrate


def __getattr__(name: str) -> Any:
    # Lazy so `import bnfuse` stays cheap and the runtime can be used without the passes.
    if name == "optimize":
        from bnfuse.passes.optimize import optimize

        return optimize
    if name == "optimize_file":
        from bnfuse.passes.optimize_file import optimize_file

        return optimize_file
    if name == "recalibrate":
        from bnfuse.training.recalibrate import recalibrate

        return recalibrate
    raise AttributeError(f"module 'bnfuse' has no attribute {name!r}")
