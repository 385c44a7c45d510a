"""The training graphs ``bnfuse train`` builds, kept in the user's cache so the next run with the same model and
options starts at the first step.

Where: ``<cache>/train-graphs/<model path digest>/<key>.onnx``, ``<cache>`` being ``BNFUSE_CACHE_DIR``, else
``$XDG_CACHE_HOME/bnfuse``, else ``~/.cache/bnfuse``: nothing is written beside the user's model. The key is a
SHA-256 of everything the graph follows from: the model's bytes
(its external-data files too), the graph options and batch size, the training pass's source files, the onnx and
onnx-ad versions and whether oneDNN's gradient ops are available. Anything changed: another key, a new build.
Off: ``bnfuse train --no-graph-cache`` or ``BNFUSE_GRAPH_CACHE=0``; delete the directory to drop what it holds. A
directory that cannot be written is skipped (the build result is used as always). Each entry is a whole training
graph (initial state included, so about the model's size); only the newest ``KEEP`` entries of a model stay.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

ENVIRONMENT = "BNFUSE_GRAPH_CACHE"
CACHE_DIR_ENVIRONMENT = "BNFUSE_CACHE_DIR"
KEEP = 2


def enabled(flag: bool = True) -> bool:
    """Whether to use the cache: ``flag`` (the command line's) and not ``BNFUSE_GRAPH_CACHE=0`` / ``off``."""
    return flag and os.environ.get(ENVIRONMENT, "1").strip().lower() not in ("0", "off", "no", "false")


def cache_root() -> Path:
    """BNFUSE_CACHE_DIR, else $XDG_CACHE_HOME/bnfuse, else ~/.cache/bnfuse."""
    chosen = os.environ.get(CACHE_DIR_ENVIRONMENT, "").strip()
    if chosen:
        return Path(chosen)
    xdg = os.environ.get("XDG_CACHE_HOME", "").strip()
    return (Path(xdg) if xdg else Path.home() / ".cache") / "bnfuse"


def directory(model: Path) -> Path:
    """The cache folder of one model file (by its resolved path: KEEP entries per model)."""
    digest = hashlib.sha256(str(Path(model).resolve()).encode()).hexdigest()[:20]
    return cache_root() / "train-graphs" / digest


def key(files: Sequence[Path], options: Mapping[str, Any]) -> str:
    """The cache key of a training graph built from ``files`` (the model, then its data files) with ``options``."""
    import onnx

    digest = hashlib.sha256()
    for path in files:
        with open(path, "rb") as file:
            digest.update(hashlib.file_digest(file, "sha256").digest())
    digest.update(json.dumps(_plain(options), sort_keys=True).encode())
    digest.update(_code_digest().encode())
    digest.update(f"onnx {onnx.__version__}; onnx-ad {_version('onnx-ad')}; {_gradient_ops()}".encode())
    return digest.hexdigest()[:32]


def load(model: Path, entry: str) -> tuple[Any, dict[str, np.ndarray]] | None:
    """The cached training graph ``entry`` of ``model`` without its state's values, and those as arrays (for
    ``TrainingSession(initial_state=...)``); None when absent, unreadable or not a training graph. The file is mapped,
    not parsed with its weights: each state array is copied once out of the map."""
    from bnfuse import protowire
    from bnfuse.errors import BnfuseError
    from bnfuse.passes.training.spec import read_spec

    path = directory(model) / f"{entry}.onnx"
    if not path.is_file():
        return None
    try:
        graph, payloads = protowire.map_model(path)
        state = set(read_spec(graph).state)
    except (BnfuseError, OSError, ValueError):
        return None
    arrays: dict[str, np.ndarray] = {}
    keep = []
    for tensor in graph.graph.initializer:
        view = payloads.array(tensor)
        if view is not None and tensor.name in state:
            arrays[tensor.name] = np.array(view)
            continue
        if view is not None:  # not state (none in a training graph): its bytes inline
            tensor.ClearField("data_location")
            tensor.raw_data = view.tobytes()
        keep.append(tensor)
    graph.graph.ClearField("initializer")
    graph.graph.initializer.extend(keep)
    payloads.clear()
    os.utime(path)  # the newest entries stay
    return graph, arrays


def store(model: Path, entry: str, graph: Any, detached: Any) -> Path | None:
    """Write ``graph`` (its weights placeholders of ``detached``, weights.py: written from their bytes, never
    copied into the graph) as ``entry``, atomically, and drop the oldest entries beyond KEEP; None when it cannot."""
    from bnfuse import protowire
    from bnfuse.io import Staging

    folder = directory(model)
    payloads = protowire.PayloadStore()
    for tensor in graph.graph.initializer:
        raw = detached.raw(tensor)
        if raw is not None:
            payloads.bind(tensor, np.frombuffer(raw, np.uint8))
    path = folder / f"{entry}.onnx"
    staging = Staging()
    try:
        folder.mkdir(parents=True, exist_ok=True)
        protowire.write_model(graph, payloads, staging.stage(path))
        staging.commit()
        entries = sorted(folder.glob("*.onnx"), key=lambda p: p.stat().st_mtime, reverse=True)
        for old in entries[KEEP:]:
            old.unlink(missing_ok=True)
    except (OSError, protowire.WireFormatError):
        staging.abort()
        return None
    return path


def _plain(value: Any) -> Any:
    """Options as JSON-able values (optimizer objects by their repr)."""
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    if value is None or isinstance(value, bool | int | float | str):
        return value
    return repr(value)


def _code_digest() -> str:
    """SHA-256 of the training pass's sources (and the runtime modules whose availability it reads)."""
    import bnfuse

    root = Path(bnfuse.__file__).resolve().parent
    digest = hashlib.sha256(bnfuse.__version__.encode())
    for path in sorted([*(root / "passes" / "training").glob("*.py"), root / "runtime" / "semantics.py"]):
        digest.update(path.name.encode() + path.read_bytes())
    return digest.hexdigest()


def _version(distribution: str) -> str:
    from importlib import metadata

    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return "none"


def _gradient_ops() -> str:
    from bnfuse.runtime import conv_grad

    return f"oneDNN gradients {conv_grad.available()}"
