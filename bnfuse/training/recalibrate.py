"""Re-estimate the running statistics of every BatchNormalization of an ONNX model on new data (no labels).

``recalibrate(model, batches, mode=...) -> (model, RecalibrationReport)``: the same model with a new mean and
variance for every top-level BatchNormalization and nothing else changed, ready for ``bnfuse.optimize``.

Modes:

* ``"update-bn"`` is ``torch.optim.swa_utils.update_bn``: every BN in training mode (normalizing with the
  batch's statistics, so the BNs downstream see batch-normalized inputs), and each BN's statistics the plain
  average over the batches of the batch mean and of the *unbiased* batch variance (M / (M - 1) times the
  biased one, M the values per channel in the batch): PyTorch's cumulative moving average (``momentum=None``)
  from reset statistics. Every batch weighs the same whatever its size, as in PyTorch; the per-batch
  statistics come from bnfuse's training-mode kernel (float64 inside, float32 out), averaged in float64.
* ``"exact"``: the population statistics the model sees at inference. BNs are recalibrated stage by stage
  (a BN's stage: the BNs on the longest path upstream of it); for each stage one pass over the data runs the
  model in inference with every upstream BN already recalibrated, and each BN's input is reduced in float64
  (two-pass within a batch, Chan's merge across batches and ranks: the SyncBN merge of
  ``bnfuse.runtime.sync_ops``), so a channel mean of 1000 loses nothing. It stores the *biased* variance M2 / N
  over all N values: the variance of the data the BN normalizes, so the recalibrated BN maps the calibration
  data to exactly mean ``bias`` and standard deviation ``|scale| * sqrt(var / (var + eps))``. Its cost is one
  pass per stage.

With ``comm`` (an mpi4py communicator or a bnfuse one, e.g. under ``mpiexec``), every rank passes the same
global batches and works on its contiguous share of each (``distributed.shard``); update-bn runs the
synchronized BN op (statistics over the whole global batch), exact merges every rank's moments: the result
is the single-process one, on every rank.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import onnx
from onnx import helper

from bnfuse.errors import BnfuseError
from bnfuse.passes.training import recalibration as graphs
from bnfuse.runtime import collectives
from bnfuse.runtime.semantics import BatchNormConfig
from bnfuse.runtime.sync_ops import local_moments, merge_moments

MODES = ("update-bn", "exact")
CPU = "CPUExecutionProvider"
Progress = Callable[[int, int], None]


@dataclass
class BatchNormChange:
    """How one BN's statistics moved: largest |new - old| mean shift in old standard deviations, and the
    range of new / old variance."""

    key: str
    channels: int
    mean_shift: float
    var_ratio_min: float
    var_ratio_max: float


@dataclass
class RecalibrationReport:
    mode: str
    batch_norms: int
    stages: int
    batches: int
    samples: int
    ranks: int
    passes: int
    seconds: float = 0.0
    new_initializers: list[str] = field(default_factory=list)
    changes: list[BatchNormChange] = field(default_factory=list)

    def format_text(self, verbose: bool = False) -> str:
        ranks = f" on {self.ranks} ranks" if self.ranks > 1 else ""
        lines = [
            f"recalibrated {self.batch_norms} BatchNormalization ({self.mode}) on {self.samples} samples in "
            f"{self.batches} batches{ranks}: {self.passes} pass(es) over the data, {self.seconds:.2f} s",
        ]
        if self.changes:
            shift = max(c.mean_shift for c in self.changes)
            low = min(c.var_ratio_min for c in self.changes)
            high = max(c.var_ratio_max for c in self.changes)
            lines.append(f"  largest mean shift {shift:.3g} old std; new / old variance in [{low:.3g}, {high:.3g}]")
        if self.new_initializers:
            lines.append(f"  {len(self.new_initializers)} shared statistic(s) given their own initializer")
        if verbose:
            lines += [
                f"  {c.key}: {c.channels} channels, mean shift {c.mean_shift:.3g} std, "
                f"variance x[{c.var_ratio_min:.3g}, {c.var_ratio_max:.3g}]"
                for c in self.changes
            ]
        return "\n".join(lines)


def recalibrate(
    model: onnx.ModelProto | str | os.PathLike[str],
    batches: Iterable[Mapping[str, np.ndarray] | np.ndarray],
    *,
    mode: str = "update-bn",
    providers: Sequence[Any] | None = None,
    comm: Any = None,
    progress: Progress | None = None,
    threads: int | None = None,
) -> tuple[onnx.ModelProto, RecalibrationReport]:
    """New running statistics for every BatchNormalization of ``model`` from ``batches``.

    batches: input dicts (data input name -> array with the batch first) or arrays (a model with one data
        input), in the order they are used; read once and kept (exact mode passes over them once per stage).
        Float arrays are cast to the input's type.
    mode: "update-bn" (torch.optim.swa_utils.update_bn) or "exact" (population statistics); see the module.
    providers: onnxruntime execution providers (default CPU; CUDAExecutionProvider first runs there).
    comm: communicator for data-parallel recalibration (each rank its share of every batch).
    progress: called with (done, total) after every batch of every pass.
    threads: onnxruntime's intra-op threads (bnfuse's CPU kernels run on that pool too); default: onnxruntime's.
    The input model is never modified.
    """
    from bnfuse.io import load_model

    if mode not in MODES:
        raise BnfuseError(f"mode must be one of {', '.join(MODES)}, got {mode!r}")
    source = model if isinstance(model, onnx.ModelProto) else load_model(model)
    started = time.perf_counter()
    sites = graphs.find_batch_norms(source)
    original = graphs.statistics_of(source, sites)  # also: refuses statistics computed in the graph, before any work
    wrapped = _communicator(comm)
    inputs = data_inputs(source)
    prepared = [_feeds(batch, inputs, index) for index, batch in enumerate(batches)]
    if not prepared:
        raise BnfuseError("no data: the batches are empty")
    providers = list(providers) if providers is not None else [CPU]
    _require_providers(providers)
    options = {} if threads is None else {"intra_op_num_threads": int(threads)}
    shards = [_shard(feeds, wrapped) for feeds in prepared]
    if mode == "update-bn":
        statistics = _update_bn(source, sites, shards, (providers, options), wrapped, progress)
        passes = 1
    else:
        statistics, passes = _exact(source, sites, shards, (providers, options), wrapped, progress)
    result, created = graphs.apply_statistics(source, sites, statistics)
    report = RecalibrationReport(
        mode=mode,
        batch_norms=len(sites),
        stages=len(graphs.stages(sites)),
        batches=len(prepared),
        samples=sum(_count(feeds) for feeds in prepared),
        ranks=wrapped.size,
        passes=passes,
        new_initializers=created,
        changes=_changes(sites, original, statistics),
    )
    report.seconds = time.perf_counter() - started
    return result, report


# -- data ------------------------------------------------------------------------------------------------


def data_inputs(model: onnx.ModelProto) -> dict[str, tuple[np.dtype, list[int | None]]]:
    """Data input name -> (NumPy type, dims with None for symbolic ones)."""
    initializers = {t.name for t in model.graph.initializer}
    result = {}
    for value in model.graph.input:
        if value.name in initializers:
            continue
        kind = value.type.tensor_type
        dims = [d.dim_value if d.HasField("dim_value") else None for d in kind.shape.dim]
        result[value.name] = (np.dtype(helper.tensor_dtype_to_np_dtype(kind.elem_type)), dims)
    return result


def _feeds(batch: Any, inputs: Mapping[str, tuple[np.dtype, list[int | None]]], index: int) -> dict[str, np.ndarray]:
    """One batch as checked onnxruntime feeds; BnfuseError naming the batch and input when it does not fit."""
    if not isinstance(batch, Mapping):
        if len(inputs) != 1:
            raise BnfuseError(
                f"batch {index}: the model has {len(inputs)} data inputs ({', '.join(inputs)}): give dicts"
            )
        batch = {next(iter(inputs)): batch}
    missing = [name for name in inputs if name not in batch]
    extra = [name for name in batch if name not in inputs]
    if missing or extra:
        raise BnfuseError(
            f"batch {index}: the data does not match the model's inputs ({', '.join(inputs)}): "
            + "; ".join(p for p in (f"missing {missing}" * bool(missing), f"not inputs {extra}" * bool(extra)) if p)
        )
    feeds = {}
    counts = set()
    for name, (dtype, dims) in inputs.items():
        array = np.asarray(batch[name])
        if array.dtype.kind not in "biuf" or (dtype.kind == "f") != (array.dtype.kind == "f"):
            raise BnfuseError(f"batch {index}: input {name!r} is {array.dtype}, the model takes {dtype}")
        shape = list(array.shape)
        if len(shape) != len(dims) or any(
            d is not None and d > 0 and d != s for d, s in zip(dims, shape, strict=False)
        ):
            wanted = "x".join("?" if d is None or d <= 0 else str(d) for d in dims)
            raise BnfuseError(
                f"batch {index}: input {name!r} has shape {'x'.join(map(str, shape))}, the model takes {wanted}"
            )
        if array.ndim == 0 or array.shape[0] == 0:
            raise BnfuseError(f"batch {index}: input {name!r} holds no samples")
        if array.dtype.kind == "f" and not np.isfinite(array).all():
            raise BnfuseError(f"batch {index}: input {name!r} has NaN or infinite values")
        counts.add(array.shape[0])
        feeds[name] = np.ascontiguousarray(array, dtype=dtype)
    if len(counts) != 1:
        raise BnfuseError(f"batch {index}: the inputs have different sample counts {sorted(counts)}")
    return feeds


def _count(feeds: Mapping[str, np.ndarray]) -> int:
    return int(next(iter(feeds.values())).shape[0])


def _shard(feeds: dict[str, np.ndarray], comm: collectives.Communicator) -> dict[str, np.ndarray]:
    """This rank's contiguous share of a global batch."""
    if comm.size == 1:
        return feeds
    from bnfuse.training.distributed import shard

    part = shard(_count(feeds), comm.rank, comm.size)
    return {name: value[part] for name, value in feeds.items()}


def _require_providers(providers: Sequence[Any]) -> None:
    """A provider this onnxruntime lacks is an error here: onnxruntime would fall back to the CPU silently."""
    import onnxruntime

    available = onnxruntime.get_available_providers()
    for provider in providers:
        name = provider[0] if isinstance(provider, tuple | list) else str(provider)
        if name not in available:
            raise BnfuseError(f"this onnxruntime has no {name} (available: {', '.join(available)})")


def _communicator(comm: Any) -> collectives.Communicator:
    if comm is None:
        return collectives.SingleProcess()
    from bnfuse.training.distributed import communicator

    return communicator(comm)


# -- running ---------------------------------------------------------------------------------------------


Runtime = tuple[Sequence[Any], dict[str, Any]]  # (providers, onnxruntime.SessionOptions attributes)


def _session(model: onnx.ModelProto, runtime: Runtime) -> Any:
    import onnxruntime

    from bnfuse.io import ort_compatible
    from bnfuse.runtime import session_options

    providers, options = runtime
    try:
        return onnxruntime.InferenceSession(
            ort_compatible(model).SerializeToString(),
            session_options(providers, log_severity_level=3, **options),  # no warning per overridable statistic
            providers=list(providers),
        )
    except Exception as exc:  # onnxruntime's own exception types: one line for the user
        raise BnfuseError(f"onnxruntime cannot load the model: {_first_line(exc)}") from exc


def _run(session: Any, fetches: list[str], feeds: Mapping[str, np.ndarray], index: int) -> list[np.ndarray]:
    try:
        return session.run(fetches, dict(feeds))
    except Exception as exc:
        raise BnfuseError(f"batch {index}: the model cannot run on it: {_first_line(exc)}") from exc


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return (text[0] if text else type(exc).__name__)[:400]


def _update_bn(
    model: onnx.ModelProto,
    sites: Sequence[graphs.BatchNormSite],
    shards: Sequence[dict[str, np.ndarray]],
    runtime: Runtime,
    comm: collectives.Communicator,
    progress: Progress | None,
) -> list[tuple[np.ndarray, np.ndarray]]:
    """The average over the batches of each BN's batch mean and unbiased batch variance (float64 sums)."""
    synchronized = comm.size > 1
    session = _session(graphs.update_bn_graph(model, sites, synchronized=synchronized), runtime)
    fetches = [name for index in range(len(sites)) for name in graphs.stat_names(index)]
    sums: list[np.ndarray] | None = None
    with collectives.use(comm):
        for index, feeds in enumerate(shards):
            values = [v.astype(np.float64) for v in _run(session, fetches, feeds, index)]
            sums = values if sums is None else [s + v for s, v in zip(sums, values, strict=True)]
            if progress is not None:
                progress(index + 1, len(shards))
    assert sums is not None
    return [(sums[2 * i] / len(shards), sums[2 * i + 1] / len(shards)) for i in range(len(sites))]


def _pack(count: int, mean: np.ndarray, m2: np.ndarray) -> np.ndarray:
    """(count, mean, M2) as one float64 row, the count as its int64 bits (sync_ops.merge_moments' layout)."""
    return np.concatenate([np.array([count], np.int64).view(np.float64), mean, m2])


def _exact(
    model: onnx.ModelProto,
    sites: Sequence[graphs.BatchNormSite],
    shards: Sequence[dict[str, np.ndarray]],
    runtime: Runtime,
    comm: collectives.Communicator,
    progress: Progress | None,
) -> tuple[list[tuple[np.ndarray, np.ndarray]], int]:
    """Population statistics stage by stage; returns them and the number of passes over the data."""
    session = _session(graphs.exact_graph(model, sites), runtime)
    position = {site.position: index for index, site in enumerate(sites)}
    statistics: list[tuple[np.ndarray, np.ndarray] | None] = [None] * len(sites)
    feeds_done: dict[str, np.ndarray] = {}
    spatial = BatchNormConfig()  # channel axis 1, reduced over every other axis (ONNX BatchNormalization)
    stages = graphs.stages(sites)
    total = len(stages) * len(shards)
    done = 0
    for stage in stages:
        inputs = list(dict.fromkeys(site.x for site in stage))
        merged: dict[str, np.ndarray] = {}  # per input: the packed (count, mean, M2) so far
        for index, feeds in enumerate(shards):
            if _count(feeds) > 0:  # an empty share (fewer samples than ranks) adds nothing
                for name, x in zip(inputs, _run(session, inputs, {**feeds, **feeds_done}, index), strict=True):
                    row = _pack(*local_moments(x, spatial))
                    merged[name] = row if name not in merged else _pack(*merge_moments(np.stack([merged[name], row])))
            done += 1
            if progress is not None:
                progress(done, total)
        for site in stage:
            local = merged.get(site.x)
            if local is None:  # this rank had no samples: it still takes part in the merge
                local = _pack(0, *(np.zeros_like(s) for s in graphs.statistics_of(model, [site])[0]))
            count, mean, m2 = merge_moments(np.asarray(comm.allgather(local)))
            if count == 0:
                raise BnfuseError(f"BatchNormalization {site.key!r}: no samples reached it")
            index = position[site.position]
            statistics[index] = (mean, m2 / count)
            mean_in, var_in = graphs.feed_names(index)
            feeds_done[mean_in] = mean.astype(np.float32)  # what the written model will hold
            feeds_done[var_in] = (m2 / count).astype(np.float32)
    return [s for s in statistics if s is not None], len(stages)


def _changes(
    sites: Sequence[graphs.BatchNormSite],
    old: Sequence[tuple[np.ndarray, np.ndarray]],
    new: Sequence[tuple[np.ndarray, np.ndarray]],
) -> list[BatchNormChange]:
    result = []
    with np.errstate(divide="ignore", invalid="ignore"):
        for site, (old_mean, old_var), (new_mean, new_var) in zip(sites, old, new, strict=True):
            if old_mean.shape != new_mean.shape:
                raise BnfuseError(
                    f"BatchNormalization {site.key!r}: the model has {old_mean.size} channels, the data gives "
                    f"{new_mean.size}"
                )
            shift = np.abs(new_mean - old_mean) / np.sqrt(np.maximum(old_var, 1e-30))
            ratio = new_var / np.maximum(old_var, 1e-30)
            result.append(
                BatchNormChange(
                    site.key,
                    int(new_mean.size),
                    float(np.max(shift)) if shift.size else 0.0,
                    float(np.min(ratio)) if ratio.size else 1.0,
                    float(np.max(ratio)) if ratio.size else 1.0,
                )
            )
    return result


def mpi_launched() -> bool:
    """Whether this process was started by an MPI launcher with more than one rank (mpiexec, srun)."""
    for key in ("PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "MV2_COMM_WORLD_SIZE", "PMIX_SIZE"):
        value = os.environ.get(key)
        if value is not None and value.isdigit() and int(value) > 1:
            return True
    return False


__all__ = ["MODES", "BatchNormChange", "RecalibrationReport", "data_inputs", "mpi_launched", "recalibrate"]
