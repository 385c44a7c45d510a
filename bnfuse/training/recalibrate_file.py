"""``bnfuse recalibrate``: model file + .npz data -> recalibrated (and optionally folded) model file.

Under an MPI launcher (``mpiexec -n N``) every rank reads the data, takes its share of every batch and
merges the statistics with the others; only rank 0 writes. The input files are never modified: the output
is written to a temporary file in its directory and renamed into place (``bnfuse.io.save_model``).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from bnfuse.errors import BnfuseError
from bnfuse.training.data import load_arrays
from bnfuse.training.recalibrate import RecalibrationReport, data_inputs, mpi_launched, recalibrate

DEFAULT_BATCH_SIZE = 32


@dataclass
class RecalibrateFileResult:
    report: RecalibrationReport
    fold_text: str | None  # the optimize report with --fold
    written: bool  # False on ranks other than 0
    external_data: bool


def npz_batches(path: str | os.PathLike[str], inputs: list[str], batch_size: int) -> list[dict[str, np.ndarray]]:
    """The .npz arrays named like the model's data inputs (bnfuse.training.data's layout, read by its
    ``load_arrays``: a single input may be 'x' or 'X'; other arrays, such as labels, are ignored) cut into batches
    of ``batch_size`` in file order (the last may be smaller)."""
    if batch_size < 1:
        raise BnfuseError(f"--batch-size {batch_size}: must be >= 1")
    chosen, _ = load_arrays(path, inputs)
    count = len(next(iter(chosen.values())))
    return [{n: v[start : start + batch_size] for n, v in chosen.items()} for start in range(0, count, batch_size)]


def recalibrate_file(
    source: str | os.PathLike[str],
    output: str | os.PathLike[str],
    data: str | os.PathLike[str],
    *,
    mode: str = "update-bn",
    batch_size: int = DEFAULT_BATCH_SIZE,
    fold: bool = False,
    providers: list[Any] | None = None,
    progress: Callable[[int, int], None] | None = None,
    comm: Any = None,
) -> RecalibrateFileResult:
    """Recalibrate ``source`` on ``data`` and write ``output`` (rank 0 only under MPI)."""
    from bnfuse.io import check_destinations, read_model_files, save_model

    model, files = read_model_files(source, check=False)
    target = Path(output)
    check_destinations(
        {"output model": target},
        files,
        possible={"output's data file": target.with_name(f"{target.name}.data")},
        other_inputs={"calibration data": Path(data)},
    )
    batches = npz_batches(data, list(data_inputs(model)), batch_size)
    if comm is not None or mpi_launched():
        from bnfuse.training import distributed

        comm = distributed.communicator(comm)  # wrapped once: recalibrate uses it as is
    lead = comm is None or comm.rank == 0
    result, report = recalibrate(
        model, batches, mode=mode, providers=providers, comm=comm, progress=progress if lead else None
    )
    fold_text = None
    if fold:
        from bnfuse.passes.optimize import optimize

        result, folded = optimize(result)
        fold_text = folded.format_text()
    external = len(files) > 1
    if lead:
        try:
            save_model(result, target, external_data=external)
        except OSError as exc:
            raise BnfuseError(f"cannot write {exc.filename or target}: {exc.strerror or exc}") from exc
    return RecalibrateFileResult(report, fold_text, lead, external)
