"""Training on onnxruntime: the session that steps a training graph (and, later, its distribution).

The training graph itself is built by the pass ``bnfuse.passes.training``; the kernels live in
``bnfuse.runtime``. Imports run one way: ``bnfuse.training`` -> ``bnfuse.passes.training`` -> (nothing
runtime-side), and ``bnfuse.training`` -> ``bnfuse.runtime``; the runtime never imports upward.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from bnfuse.training.session import TrainingSession as TrainingSession

__all__ = ["TrainingSession"]


def __getattr__(name: str) -> Any:
    # Lazy: `import bnfuse.training` stays cheap until a session is made.
    if name == "TrainingSession":
        from bnfuse.training.session import TrainingSession

        return TrainingSession
    raise AttributeError(f"module 'bnfuse.training' has no attribute {name!r}")
