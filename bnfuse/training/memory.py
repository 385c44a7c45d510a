"""What a training step holds, and the settings that keep it lean (the one place TrainingSession and the CLI get them).

A step's memory beyond the state (parameters, running statistics, optimizer state, each held twice: the
double-buffered bindings) is onnxruntime's arena, holding the forward tensors the backward reads and the
gradients in flight, and the Conv weight gradients' oneDNN workspaces (bnfuse.runtime.conv_grad: one per pool
thread, shared by every weight gradient, the size of one batch chunk's blocked copies of X and dY).

``memory="lean"`` (the default of ``TrainingSession`` and ``bnfuse train``) changes three things, all measured in
bench/RESULTS.md ("Training step memory"):

* ``enable_mem_pattern = False``: with the pattern, onnxruntime's second run allocates one block for every
  planned tensor while the arena still holds the first run's chunks (alone: 2,346 -> 1,209 MiB of step growth for
  the width-32 ResNet at batch 128, 64x64; all three settings: 829 MiB).
* ``execution_order = PRIORITY_BASED``: the graph's own order, where each Conv's weight gradient runs right after
  its input gradient. onnxruntime's default order (a depth-first walk back from the outputs) ran every input
  gradient first and every weight gradient last, so each dY stayed alive to the end of the backward.
* the Conv weight gradients read plain X (``nchwc_weight_grads=False``): reading the forward Conv's NCHWc copy of
  X kept that copy alive from the forward to the backward, a second copy of every 3x3 Conv's input.

``memory="speed"``: onnxruntime's defaults and the NCHWc copies for the weight gradients (the settings before
issue 22).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from bnfuse.errors import BnfuseError

LEAN = "lean"
SPEED = "speed"
MODES = (LEAN, SPEED)
DEFAULT = LEAN


def check_mode(memory: str) -> str:
    if memory not in MODES:
        raise BnfuseError(f"memory must be one of {', '.join(MODES)}; got {memory!r}")
    return memory


def apply(options: Any, memory: str = DEFAULT) -> Any:
    """Set ``memory`` 's onnxruntime settings on ``options`` (an onnxruntime.SessionOptions); returns them.
    ``speed`` leaves them as they are."""
    import onnxruntime

    if check_mode(memory) == LEAN:
        options.enable_mem_pattern = False
        options.execution_order = onnxruntime.ExecutionOrder.PRIORITY_BASED
    return options


def nchwc_weight_grads(memory: str = DEFAULT) -> bool:
    """Whether the Conv weight gradients read the forward Conv's NCHWc copy of X under ``memory``."""
    return check_mode(memory) == SPEED


def lean_session_options(providers: Iterable[Any] | None = None, **attributes: Any) -> Any:
    """``bnfuse.runtime.session_options(providers, **attributes)`` with the lean settings applied."""
    from bnfuse.runtime import session_options

    return apply(session_options(providers, **attributes), LEAN)
