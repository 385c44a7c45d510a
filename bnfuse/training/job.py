"""``bnfuse train`` as a function: model (inference model or training graph) + .npz data -> trained model file.

``run(job)`` builds the training graph when given an inference model, loads and splits the data, runs
``loop.fit`` (under ``mpiexec``: every rank its shard, rank 0 writes), then writes the inference model with the
kept epoch's weights (folded with ``fold``) and, optionally, the state dict.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bnfuse.errors import BnfuseError
from bnfuse.training import data as datasets
from bnfuse.training import graph_cache
from bnfuse.training.checkpoint import save_npz
from bnfuse.training.loop import FitResult, LoopConfig, fit
from bnfuse.training.schedules import Schedule

DEFAULT_BATCH_SIZE = 32


@dataclass
class TrainJob:
    model: Path
    data: Path
    output: Path
    epochs: int = 1
    batch_size: int | None = None  # None: the training graph's, else DEFAULT_BATCH_SIZE
    schedule: dict[str, Any] = field(default_factory=dict)  # Schedule's fields but epochs
    shuffle_seed: int | None = 0
    drop_last: bool = False
    val_data: Path | None = None
    val_split: float | None = None
    keep: str | None = None  # None: best with validation, else last
    checkpoint_dir: Path | None = None
    resume: bool = False
    fold: bool = False
    state_dict: Path | None = None
    graph_options: dict[str, Any] = field(default_factory=dict)  # build_training_graph's, for an inference model
    threads: int | None = None  # onnxruntime intra-op threads (None: every core; under mpiexec each rank's share)
    debug: bool | None = None  # a failing rank's traceback before its one line (None: BNFUSE_DEBUG)
    memory: str = "lean"  # TrainingSession's memory settings: lean (default) or speed (docs/training.md, Memory)
    graph_cache: bool = True  # keep / reuse the built training graph beside the model (graph_cache.py)


def is_training_graph(model: Any) -> bool:
    from bnfuse.passes.training.spec import METADATA_KEY

    return any(prop.key == METADATA_KEY for prop in model.metadata_props)


def training_graph(
    model: Any, job: TrainJob, log: Callable[[str], None], files: Sequence[Path] = (), detached: Any = None
) -> tuple[Any, dict[str, Any] | None]:
    """The training graph of ``model`` and its initial state: itself (state in its initializers: None), or built from
    the inference model with ``job.graph_options``: then ``model`` is consumed (its weights moved out, never copied
    into a second ModelProto) and the state comes as arrays for ``TrainingSession(initial_state=...)``. With
    ``job.graph_cache`` and the model's ``files``, a graph built before for the same model and options is reused
    (graph_cache.py). ``detached``: the store of ``model``'s placeholders when its weights are detached already
    (read from a map of its file, ``read_source``)."""
    if is_training_graph(model):
        if job.graph_options:
            names = ", ".join("--" + k.replace("_", "-") for k in job.graph_options)
            raise BnfuseError(
                f"{job.model} is already a training graph (its loss, optimizer and batch are built in): {names} "
                "apply when `bnfuse train` builds the graph from an inference model (or give them to `bnfuse "
                "train-graph`)"
            )
        return model, None
    from bnfuse.passes.training import SGD, Adam, weights
    from bnfuse.passes.training.build import build_detached

    options = dict(job.graph_options)
    kind = options.pop("optimizer", "sgd")
    decay = options.pop("weight_decay", 0.0)
    momentum, nesterov = options.pop("sgd_momentum", 0.0), bool(options.pop("nesterov", False))
    if kind == "adam":
        if momentum or nesterov:
            raise BnfuseError("--sgd-momentum / --nesterov are SGD's; Adam has its own moments")
        optimizer: Any = Adam(weight_decay=decay)
    else:
        optimizer = SGD(momentum=momentum, weight_decay=decay, nesterov=nesterov)
    if "bn_momentum" in options:
        options["momentum"] = options.pop("bn_momentum")
    batch_size = job.batch_size or DEFAULT_BATCH_SIZE
    entry = None
    if files and graph_cache.enabled(job.graph_cache):
        entry = graph_cache.key(files, {**job.graph_options, "batch_size": batch_size})
        cached = graph_cache.load(job.model, entry)
        if cached is not None:
            log(
                f"training graph from {graph_cache.directory(job.model)} (built before for this model and these "
                "options; --no-graph-cache builds it anew)"
            )
            return cached
    if detached is None:
        detached = weights.detach(model)
    built, report = build_detached(model, detached, optimizer=optimizer, batch_size=batch_size, **options)
    log(report.format_text())
    if entry is not None:
        graph_cache.store(job.model, entry, built, detached)
    return _handed_over(built, detached)


def _handed_over(graph: Any, detached: Any) -> tuple[Any, dict[str, Any]]:
    """``graph`` without its state's values, and those values as arrays (weights.take)."""
    from bnfuse.passes.training import weights
    from bnfuse.passes.training.spec import read_spec

    state = weights.take(graph, detached, read_spec(graph).state)
    weights.attach(graph, detached)  # anything else detached (none in a training graph): its values back
    detached.clear()
    return graph, state


def read_source(path: Path) -> tuple[Any, list[Path], Any]:
    """The model at ``path``, the files it was read from, and the store of its detached weights (None: inline). An
    inference model bnfuse.io.read_mapped reads keeps its weights in a read-only map of the file (weights.
    detach_payloads: never copied into a ModelProto); a training graph, or a file it does not read, is loaded."""
    from bnfuse.io import read_mapped, read_model_files, require_regular_file
    from bnfuse.tensorcheck import check_strings, check_tensors

    require_regular_file(path)
    mapped = read_mapped(path)
    if mapped is not None and not is_training_graph(mapped[0]):
        from bnfuse.passes.training import weights

        source, payloads = mapped
        check_strings(source, what=str(path))
        check_tensors(source, what=str(path))
        return source, [path.resolve()], weights.detach_payloads(source, payloads)
    source, files = read_model_files(path, check=False)
    return source, files, None


def run(
    job: TrainJob,
    *,
    log: Callable[[str], None] = print,
    on_step: Callable[[int, int, int, float], None] | None = None,
) -> FitResult | None:
    """Run the job; returns the fit's result (None on ranks other than 0 of a distributed job)."""
    from bnfuse.io import check_destinations
    from bnfuse.passes.training.distribute import is_distributed
    from bnfuse.training.session import TrainingSession

    if job.state_dict is not None and job.state_dict.suffix != ".npz":
        raise BnfuseError(f"--state-dict {job.state_dict}: the state dict is written as .npz")
    if job.batch_size is not None and job.batch_size < 1:
        raise BnfuseError(f"--batch-size {job.batch_size}: must be >= 1")
    if job.threads is not None and job.threads < 1:
        raise BnfuseError(f"--threads must be >= 1, got {job.threads}")
    if job.val_data is not None and job.val_split is not None:
        raise BnfuseError("give --val-data or --val-split, not both")
    source, files, detached = read_source(job.model)
    check_destinations(
        {"output model": job.output, "state dict": job.state_dict},
        files,
        possible={"output's data file": job.output.with_name(f"{job.output.name}.data")},
        other_inputs={"training data": job.data, **({"validation data": job.val_data} if job.val_data else {})},
    )
    schedule = Schedule(epochs=job.epochs, **job.schedule)  # option errors before the graph is built
    model, initial_state = training_graph(source, job, log, files, detached)
    del source, detached  # built from: its weights live on in the session's state alone (a mapped file unmapped)
    comm = None
    if not is_distributed(model):
        from bnfuse.training.distributed import launched_ranks

        if launched_ranks() > 1:  # each process would train alone on every sample and write the same file
            raise BnfuseError(
                f"launched as {launched_ranks()} processes (mpiexec / mpirun), but {job.model} is not a distributed "
                "training graph: build one with `bnfuse train-graph --distributed`, or run one process"
            )
    else:
        from bnfuse.training import distributed

        comm = distributed.communicator()  # under mpiexec: every rank; alone: a world of one
        distributed.abort_on_error(comm, debug=job.debug)
    try:
        session = TrainingSession(
            model,
            lr=schedule.lr(0),
            comm=comm,
            intra_op_threads=job.threads,
            memory=job.memory,
            initial_state=initial_state,
        )
        del initial_state
        if comm is not None and comm.size > 1 and comm.rank == 0:
            log(f"{comm.size} ranks; threads: {session.threads_note}")
        return _fit_and_write(job, model, session, schedule, comm, log, on_step)
    except BnfuseError as exc:
        if comm is None or comm.size == 1:
            raise
        from bnfuse.training import distributed

        distributed.report_and_abort(comm, exc, debug=job.debug)  # one rank's bad input ends every rank
        raise


def _fit_and_write(
    job: TrainJob,
    model: Any,
    session: Any,
    schedule: Schedule,
    comm: Any,
    log: Callable[[str], None],
    on_step: Callable[[int, int, int, float], None] | None,
) -> FitResult | None:
    spec = session.spec
    target = spec.targets[0]
    train = datasets.load_npz(job.data, spec.data, target)
    classes = datasets.class_count(model)
    datasets.check_labels(train.labels, spec.loss_kind, classes)
    val = None
    if job.val_data is not None:
        val = datasets.load_npz(job.val_data, spec.data, target)
        datasets.check_labels(val.labels, spec.loss_kind, classes, where=f"{job.val_data}: labels")
    elif job.val_split is not None:
        train, val = datasets.split(train, job.val_split, job.shuffle_seed or 0)
    batch = job.batch_size or session.batch_size or DEFAULT_BATCH_SIZE
    static = session.static_batch_size
    if static is not None and batch != static:
        raise BnfuseError(
            f"--batch-size {batch}: the training graph's batch is fixed at {static} (built with --static-batch or a "
            "model that pins it)"
        )
    ranks = comm.size if comm is not None else 1
    if static is not None and not job.drop_last and len(train) % (ranks * static):
        per = f" ({ranks} ranks x {static})" if ranks > 1 else ""
        raise BnfuseError(
            f"{len(train)} samples leave a partial batch{per} that a graph fixed at batch {static} cannot take: give "
            "--drop-last, or build the graph without --static-batch"
        )
    config = LoopConfig(
        epochs=job.epochs,
        batch_size=batch,
        schedule=schedule,
        shuffle_seed=job.shuffle_seed,
        drop_last=job.drop_last,
        keep=job.keep or ("best" if val is not None else "last"),
        checkpoint_dir=job.checkpoint_dir,
        resume=job.resume,
        interrupt_dir=job.checkpoint_dir or job.output.with_name(f"{job.output.name}.checkpoints"),
        settings={"model": str(job.model), "data": str(job.data), "validation": str(job.val_data or job.val_split)},
    )
    result = fit(session, train, config, val=val, comm=comm, on_step=on_step, log=log)
    if comm is not None and comm.rank != 0:
        return None
    if config.keep == "best":
        log(f"kept epoch {result.kept_epoch} (lowest validation loss)")
    payloads = None
    if not job.fold:  # written straight from the session's buffers (a fold needs the weights in the model)
        from bnfuse.protowire import PayloadStore

        payloads = PayloadStore()
    trained = session.export_inference_model(payloads=payloads)
    if job.state_dict is not None:
        save_npz(session.state_dict(), job.state_dict)
        log(f"wrote {job.state_dict}")
    if job.fold:
        from bnfuse.passes.optimize import optimize

        trained, report = optimize(trained)
        log(report.format_text(hint=False))
    from bnfuse.io import save_model

    try:
        if payloads is None or not _write_streamed(trained, payloads, job.output):
            if payloads is not None:
                trained = session.export_inference_model()
            save_model(trained, job.output)
    except OSError as exc:
        raise BnfuseError(f"cannot write {exc.filename or job.output}: {exc.strerror or exc}") from exc
    log(f"wrote {job.output}")
    return result


def _write_streamed(model: Any, payloads: Any, path: Path) -> bool:
    """Write ``model`` with its payload references' bytes straight from their arrays, atomically; False (nothing
    written) when it is too large for one protobuf file (save_model then writes external data)."""
    from bnfuse import protowire
    from bnfuse.io import Staging, ort_compatible

    ort_compatible(model)
    staging = Staging()
    try:
        protowire.write_model(model, payloads, staging.stage(path))
        staging.commit()
    except protowire.WireFormatError:
        staging.abort()
        return False
    except BaseException:
        staging.abort()
        raise
    return True
