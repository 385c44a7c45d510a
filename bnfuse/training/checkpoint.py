"""Checkpoints of a training job: the session's whole state and where the loop stands, written atomically.

A checkpoint directory holds ``last.npz`` (state tensors: parameters, running statistics, optimizer state,
counters; and ``__progress__``, a JSON record of the epoch and step reached, the losses summed so far, the best
validation result and the job's settings), and ``best.npz`` (the state of the best epoch, with ``--keep best``).
Resuming loads the state into the session and continues from the recorded step: the shuffle order and the
learning rate of every epoch are functions of the seed and the epoch, so the rest of the run is the one an
uninterrupted run makes, bit for bit.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from bnfuse.errors import BnfuseError

LAST = "last.npz"
BEST = "best.npz"
PROGRESS_KEY = "__progress__"
FORMAT = 1


@dataclass
class Progress:
    """Where the loop stands: ``epoch`` (1-based) with ``step`` steps of it done (0: not started)."""

    epoch: int = 1
    step: int = 0
    loss_sum: float = 0.0  # float64 sum of this epoch's step losses so far
    best_epoch: int = 0
    best_loss: float | None = None
    settings: dict[str, Any] = field(default_factory=dict)  # what must match to resume
    history: list[dict[str, Any]] = field(default_factory=list)  # one summary per finished epoch
    format: int = FORMAT


def save(directory: Path, name: str, state: Mapping[str, np.ndarray], progress: Progress | None = None) -> Path:
    """Write ``directory/name`` atomically (a temporary file renamed into place)."""
    directory.mkdir(parents=True, exist_ok=True)
    arrays = dict(state)
    if progress is not None:
        arrays[PROGRESS_KEY] = np.frombuffer(json.dumps(asdict(progress)).encode(), np.uint8)
    path = directory / name
    save_npz(arrays, path, what="checkpoint ")
    return path


def save_npz(arrays: Mapping[str, np.ndarray], path: Path, what: str = "") -> None:
    """np.savez to a temporary file renamed into place (nothing partial is left)."""
    temporary = None
    try:
        handle, temporary = tempfile.mkstemp(suffix=".npz.tmp", dir=path.parent)
        with os.fdopen(handle, "wb") as stream:
            np.savez(stream, **arrays)
        os.replace(temporary, path)
    except OSError as exc:
        if temporary is not None:
            Path(temporary).unlink(missing_ok=True)
        raise BnfuseError(f"cannot write {what}{path}: {exc.strerror or exc}") from exc


def load(path: Path) -> tuple[dict[str, np.ndarray], Progress | None]:
    """(state tensors, progress) of a checkpoint file."""
    try:
        with np.load(path) as archive:
            arrays = {name: archive[name] for name in archive.files}
    except (OSError, ValueError, EOFError) as exc:
        raise BnfuseError(f"{path}: not a readable checkpoint ({exc})") from exc
    raw = arrays.pop(PROGRESS_KEY, None)
    if raw is None:
        return arrays, None
    try:
        record = json.loads(raw.tobytes().decode())
        if record.get("format") != FORMAT:
            raise ValueError(f"format {record.get('format')}")
        return arrays, Progress(**record)
    except (ValueError, TypeError) as exc:
        raise BnfuseError(f"{path}: unreadable progress record ({exc})") from exc


def check_settings(saved: Mapping[str, Any], current: Mapping[str, Any], path: Path) -> None:
    """Resuming needs the run that wrote the checkpoint: the same graph, data and loop settings."""
    changed = [key for key in sorted(set(saved) | set(current)) if saved.get(key) != current.get(key)]
    if changed:
        first = changed[0]
        raise BnfuseError(
            f"{path} was written by another run: {first} was {saved.get(first)!r}, now {current.get(first)!r}"
            + (f" (and {len(changed) - 1} more)" if len(changed) > 1 else "")
        )
