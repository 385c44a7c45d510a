"""Data from .npz files (``bnfuse train`` and ``bnfuse recalibrate``): arrays by input name, validation splits,
batches in a seeded order.

Layout of a data file: every data input of the model as an array named like the input (a model with one data
input may call it ``x`` or ``X``, as scikit-learn does), and, for training, the labels as ``labels`` or ``y`` (or
the graph's target name); other arrays are ignored. Every array has the samples along its first axis.
``load_arrays`` is the one reader of that layout: both commands give the same one-line error for the same fault.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np

from bnfuse.errors import BnfuseError

SINGLE_INPUT_NAMES = ("x", "X")
LABEL_NAMES = ("labels", "y")


@dataclass
class Dataset:
    """Samples: data inputs by graph input name and the labels (the graph's target), first axis the sample."""

    inputs: dict[str, np.ndarray]
    labels: np.ndarray

    def __len__(self) -> int:
        return len(self.labels)

    def take(self, index: np.ndarray) -> Dataset:
        return Dataset({name: value[index] for name, value in self.inputs.items()}, self.labels[index])


def accepted_inputs(data: Sequence[str]) -> str:
    """The array names a data file may use for the data inputs ``data``, for error messages."""
    inputs = [repr(name) for name in data]
    if len(data) == 1:
        return " or ".join(inputs + [repr(n) for n in SINGLE_INPUT_NAMES if n != data[0]])
    return ", ".join(inputs)


def accepted_labels(target: str) -> str:
    """The array names a data file may use for the labels of target ``target``, for error messages."""
    return " or ".join(repr(n) for n in dict.fromkeys([target, *LABEL_NAMES]))


def load_arrays(
    path: str | os.PathLike[str], data: Sequence[str], target: str | None = None
) -> tuple[dict[str, np.ndarray], np.ndarray | None]:
    """(data input name -> array, labels) from the .npz file ``path`` (module docstring: the layout); labels None
    when ``target`` is None (recalibration takes no labels). BnfuseError, one line, for a file that is not a
    readable .npz archive, holds no arrays, lacks an input's or the labels' array, holds a scalar where samples
    belong, arrays of different sample counts, or no samples."""
    if not data:
        raise BnfuseError(f"{path}: the model has no data inputs to read from it")
    arrays = _read_npz(path)
    present = ", ".join(sorted(arrays))
    chosen: dict[str, str] = {}  # data input -> the file's array
    for name in data:
        candidates = [name, *(SINGLE_INPUT_NAMES if len(data) == 1 else ())]
        key = next((c for c in candidates if c in arrays), None)
        if key is None:
            raise BnfuseError(
                f"{path}: no array for input {name!r} (arrays: {present}; accepted: {accepted_inputs(data)})"
            )
        chosen[name] = key
    label_key = None
    if target is not None:
        label_key = next((c for c in (target, *LABEL_NAMES) if c in arrays), None)
        if label_key is None:
            raise BnfuseError(f"{path}: no labels array (arrays: {present}; accepted: {accepted_labels(target)})")
    used = [*dict.fromkeys([*chosen.values(), *([label_key] if label_key is not None else [])])]
    for key in used:
        if arrays[key].ndim == 0:
            raise BnfuseError(f"{path}: array {key!r} is a scalar, not a batch of samples")
    counts = {key: len(arrays[key]) for key in used}
    if len(set(counts.values())) != 1:
        listed = ", ".join(f"{key} {count}" for key, count in counts.items())
        raise BnfuseError(f"{path}: arrays have different sample counts ({listed})")
    if not counts[used[0]]:
        raise BnfuseError(f"{path}: the data file holds no samples (empty arrays)")
    return {name: arrays[key] for name, key in chosen.items()}, arrays[label_key] if label_key is not None else None


def load_npz(path: str | os.PathLike[str], data: Sequence[str], target: str) -> Dataset:
    """The samples of an .npz file for a graph with data inputs ``data`` and target ``target``."""
    inputs, labels = load_arrays(path, data, target)
    assert labels is not None  # a target was given
    return Dataset(inputs, labels)


def _read_npz(path: str | os.PathLike[str]) -> dict[str, np.ndarray]:
    try:
        loaded = np.load(path, allow_pickle=False)
        if not isinstance(loaded, np.lib.npyio.NpzFile):  # np.load also reads a lone .npy array
            raise ValueError("a .npy array, not an .npz archive of named arrays")
        with loaded as archive:
            arrays = {name: archive[name] for name in archive.files}
    except (OSError, ValueError, EOFError) as exc:
        raise BnfuseError(f"{path}: not a readable .npz file ({(str(exc).splitlines() or [''])[0][:200]})") from exc
    if not arrays:
        raise BnfuseError(f"{path}: the data file holds no arrays")
    return arrays


def split(dataset: Dataset, fraction: float, seed: int) -> tuple[Dataset, Dataset]:
    """(training, validation): ``fraction`` of the samples, drawn with ``seed``, held out (at least one each)."""
    if not 0 < fraction < 1:
        raise BnfuseError(f"--val-split {fraction}: must be a fraction between 0 and 1")
    count = len(dataset)
    held = int(round(count * fraction))
    if held < 1 or held >= count:
        raise BnfuseError(f"--val-split {fraction} of {count} samples leaves {held} for validation")
    order = np.random.default_rng([seed, 0x5A11]).permutation(count)
    return dataset.take(np.sort(order[held:])), dataset.take(np.sort(order[:held]))


def epoch_order(count: int, epoch: int, seed: int | None) -> np.ndarray:
    """The sample order of epoch ``epoch`` (1-based): a permutation drawn from (seed, epoch), so any epoch's
    order is known without replaying the ones before it (resuming); None: in file order."""
    if seed is None:
        return np.arange(count)
    return np.random.default_rng([seed, epoch]).permutation(count)


def batches(order: np.ndarray, batch_size: int, drop_last: bool) -> Iterator[np.ndarray]:
    """Index batches of ``order``: full batches, then the partial last one unless ``drop_last``."""
    stop = len(order) - len(order) % batch_size if drop_last else len(order)
    for start in range(0, stop, batch_size):
        yield order[start : start + batch_size]


def step_count(count: int, batch_size: int, drop_last: bool) -> int:
    return count // batch_size if drop_last else -(-count // batch_size)


def class_count(train_model: object) -> int | None:
    """The class count of a cross-entropy training graph (its one-hot depth), None for other losses."""
    for tensor in train_model.graph.initializer:  # type: ignore[attr-defined]
        if tensor.name == "loss/depth":
            from onnx import numpy_helper

            return int(numpy_helper.to_array(tensor))
    return None


def check_labels(labels: np.ndarray, loss_kind: str, classes: int | None, where: str = "labels") -> None:
    """BnfuseError unless the labels suit the loss: class indices in [0, classes), or finite targets."""
    values = np.asarray(labels)
    if values.dtype.kind not in "biuf":
        raise BnfuseError(f"{where}: expected numbers, got an array of {values.dtype}")
    if loss_kind == "cross-entropy" and classes is not None:
        integral = values.dtype.kind in "biu" or bool(np.all(np.isfinite(values) & (values == np.round(values))))
        bad = ~((values >= 0) & (values < classes)) if integral else ~np.isfinite(values) | (values != values // 1)
        if bad.any():
            at = tuple(int(i) for i in np.argwhere(bad)[0])
            raise BnfuseError(
                f"{where}: {values[at].item()!r} at {list(at)} is not a class index in [0, {classes}) "
                f"({int(bad.sum())} such labels)"
            )
    elif values.dtype.kind == "f" and not np.isfinite(values).all():
        at = tuple(int(i) for i in np.argwhere(~np.isfinite(values))[0])
        raise BnfuseError(f"{where}: {values[at].item()!r} at {list(at)} is not finite")
