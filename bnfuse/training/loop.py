"""The training job: epochs of shuffled batches (the last partial one too), a learning-rate schedule, validation
on the current weights after every epoch, the best or last epoch kept, checkpoints, resuming and Ctrl-C.

``fit(session, train, config, val=...)`` runs it on a ``TrainingSession`` and leaves the kept state in the
session (export it with ``session.export_inference_model()``); ``bnfuse train`` is a thin shell over it.
"""

from __future__ import annotations

import contextlib
import signal
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from bnfuse.errors import BnfuseError
from bnfuse.training import checkpoint
from bnfuse.training.data import Dataset, batches, epoch_order
from bnfuse.training.schedules import Schedule

KEEP = ("best", "last")
VALIDATION_BATCH = 256


@dataclass
class LoopConfig:
    """How to train: ``epochs`` of ``batch_size`` batches; ``shuffle_seed`` None keeps the file order."""

    epochs: int
    batch_size: int
    schedule: Schedule
    shuffle_seed: int | None = 0
    drop_last: bool = False
    keep: str = "last"  # "best": the epoch with the lowest validation loss
    checkpoint_dir: Path | None = None  # a checkpoint after every epoch
    resume: bool = False  # continue from checkpoint_dir's last checkpoint
    interrupt_dir: Path | None = None  # where Ctrl-C saves a checkpoint (default: checkpoint_dir)
    settings: dict[str, Any] = field(default_factory=dict)  # the rest of the job, checked when resuming

    def __post_init__(self) -> None:
        if self.epochs < 1:
            raise BnfuseError(f"--epochs {self.epochs}: must be >= 1")
        if self.batch_size < 1:
            raise BnfuseError(f"--batch-size {self.batch_size}: must be >= 1")
        if self.keep not in KEEP:
            raise BnfuseError(f"--keep {self.keep!r}: expected best or last")
        if self.resume and self.checkpoint_dir is None:
            raise BnfuseError("--resume needs --checkpoint-dir (the directory the interrupted run wrote)")


@dataclass
class EpochSummary:
    epoch: int
    epochs: int
    lr: float
    loss: float  # mean training loss over the epoch's samples (each step's loss weighted by its batch)
    steps: int
    seconds: float
    val_loss: float | None = None
    val_accuracy: float | None = None

    def format(self) -> str:
        text = f"epoch {self.epoch}/{self.epochs}: loss {self.loss:.6g} ({self.steps} steps, lr {self.lr:.6g})"
        if self.val_loss is not None:
            text += f", val loss {self.val_loss:.6g}"
        if self.val_accuracy is not None:
            text += f", val accuracy {100 * self.val_accuracy:.2f}%"
        return text + f", {self.seconds:.1f} s"


@dataclass
class FitResult:
    history: list[EpochSummary]
    kept_epoch: int  # the epoch whose state the session holds at the end
    resumed_from: tuple[int, int] | None = None  # (epoch, steps done in it) of the checkpoint resumed


class Interrupted(KeyboardInterrupt):
    """Ctrl-C during training; the message says where the checkpoint went."""


def fit(
    session: Any,
    train: Dataset,
    config: LoopConfig,
    *,
    val: Dataset | None = None,
    comm: Any = None,
    on_step: Callable[[int, int, int, float], None] | None = None,
    log: Callable[[str], None] = print,
) -> FitResult:
    """Train ``session`` on ``train``; see the module docstring. ``on_step(epoch, done, total, loss)`` after every
    step (a progress bar). With ``comm`` (a distributed graph), each rank trains on its share of every global batch
    (``distributed.EpochSplit``: every sample once per epoch, or with drop_last full batches of its contiguous
    shard); rank 0 alone validates, prints and writes checkpoints."""
    if config.keep == "best" and val is None:
        raise BnfuseError("--keep best needs validation data (--val-data or --val-split)")
    rank, size = (comm.rank, comm.size) if comm is not None else (0, 1)
    lead = rank == 0
    count = len(train)
    if comm is not None:  # every rank the same steps, each its share of every global batch (said once)
        from bnfuse.training.distributed import EpochSplit

        split = EpochSplit(count, size, config.batch_size, config.drop_last)
        plan, step_samples = split.positions(rank), split.global_sizes()
        if lead and size > 1:
            log(f"data: {split.describe()}")
    else:
        plan = list(batches(np.arange(count), config.batch_size, config.drop_last))
        step_samples = [len(index) for index in plan]
    total_steps = len(plan)
    if total_steps < 1:
        raise BnfuseError(
            f"{count} training samples make no full batch of {config.batch_size} and --drop-last drops the partial one"
        )
    validator = Validator(session, val) if val is not None and lead else None
    progress = checkpoint.Progress(settings=_resume_settings(config, len(train)))
    best_state: dict[str, np.ndarray] | None = None
    resumed_from = None
    if config.resume:
        assert config.checkpoint_dir is not None
        progress, best_state = _resume(session, config, progress.settings)
        resumed_from = (progress.epoch, progress.step)
    history = [EpochSummary(**record) for record in progress.history]
    interrupt_dir = config.interrupt_dir or config.checkpoint_dir
    with _deferred_interrupt() as interrupted:
        for epoch in range(progress.epoch, config.epochs + 1):
            start = time.perf_counter()
            session.lr = config.schedule.lr(epoch - 1)
            order = epoch_order(len(train), epoch, config.shuffle_seed)  # the same on every rank
            for step, where in enumerate(plan, start=1):
                if step <= progress.step:
                    continue  # done before the checkpoint this run resumed from
                index = order[where]
                loss = session.step({n: v[index] for n, v in train.inputs.items()}, train.labels[index])
                if not np.isfinite(loss):
                    raise BnfuseError(
                        f"epoch {epoch}, step {step}: the loss is {loss} (NaN or infinite data, or too large a "
                        "learning rate); stopped, nothing written"
                    )
                # the loss is the step's mean over its samples (on ranks: the global batch's)
                progress.step, progress.loss_sum = step, progress.loss_sum + loss * step_samples[step - 1]
                if on_step is not None:
                    on_step(epoch, step, total_steps, loss)
                if interrupted.is_set() and step < total_steps:
                    _save_interrupted(session, progress, best_state, interrupt_dir, lead, epoch, step)
            seen = sum(step_samples)
            summary = EpochSummary(
                epoch, config.epochs, session.lr, progress.loss_sum / seen, total_steps, time.perf_counter() - start
            )
            if validator is not None:
                summary.val_loss, summary.val_accuracy = validator.evaluate()
                if config.keep == "best" and (progress.best_loss is None or summary.val_loss < progress.best_loss):
                    progress.best_epoch, progress.best_loss = epoch, summary.val_loss
                    best_state = session.state()
                    if config.checkpoint_dir is not None:
                        checkpoint.save(config.checkpoint_dir, checkpoint.BEST, best_state)
            history.append(summary)
            if lead:
                log(summary.format())
            progress.history.append(summary.__dict__.copy())
            progress.epoch, progress.step, progress.loss_sum = epoch + 1, 0, 0.0
            if config.checkpoint_dir is not None and lead:
                checkpoint.save(config.checkpoint_dir, checkpoint.LAST, session.state(), progress)
            if interrupted.is_set() and epoch < config.epochs:
                _save_interrupted(session, progress, best_state, interrupt_dir, lead, epoch + 1, 0)
    kept = config.epochs
    if config.keep == "best" and best_state is not None:
        session.load_state(best_state)
        kept = progress.best_epoch
    return FitResult(history, kept, resumed_from)


class Validator:
    """Loss and accuracy of the current weights on held-out data, by an inference session on the exported model
    (BN with its running statistics, as the trained model will run)."""

    def __init__(self, session: Any, data: Dataset) -> None:
        self.session, self.data = session, data
        spec = session.spec
        self.kind = spec.loss_kind
        if self.kind == "seed":
            raise BnfuseError("validation needs a loss (cross-entropy or mse); this graph takes gradient seeds")
        self.output = loss_output(session.train_model)

    def evaluate(self) -> tuple[float, float | None]:
        import onnxruntime

        model = self.session.export_inference_model()
        options = onnxruntime.SessionOptions()
        options.log_severity_level = 3
        inference = onnxruntime.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
        fixed = {i.name: i.shape[0] for i in inference.get_inputs() if i.shape and isinstance(i.shape[0], int)}
        chunk = min(fixed.values()) if fixed else VALIDATION_BATCH
        outputs = []
        count = len(self.data)
        for start in range(0, count, chunk):
            index = np.arange(start, min(start + chunk, count))
            feeds = {}
            for name, value in self.data.inputs.items():
                part = np.ascontiguousarray(value[index], np.float32)
                if fixed and len(part) < chunk:  # a static batch: pad (inference treats samples independently)
                    part = np.concatenate([part, np.repeat(part[-1:], chunk - len(part), axis=0)])
                feeds[name] = part
            outputs.append(inference.run([self.output], feeds)[0][: len(index)])
        prediction = np.concatenate(outputs).astype(np.float64)
        labels = self.data.labels
        if self.kind == "cross-entropy":
            shifted = prediction - prediction.max(axis=1, keepdims=True)
            log_probs = shifted - np.log(np.exp(shifted).sum(axis=1, keepdims=True))
            picked = log_probs[np.arange(count), labels.astype(np.int64)]
            accuracy = float(np.mean(prediction.argmax(axis=1) == labels))
            return float(-picked.mean()), accuracy
        return float(np.mean((prediction - labels.reshape(prediction.shape)) ** 2)), None


def loss_output(train_model: Any) -> str:
    """The model output the training graph's loss reads (the first node of its loss)."""
    for node in train_model.graph.node:
        if node.output and node.output[0] in ("loss/logp", "loss/diff", "loss/prod"):
            return node.input[0]
    raise BnfuseError("training graph has no loss nodes (loss/logp, loss/diff or loss/prod)")


def _resume_settings(config: LoopConfig, samples: int) -> dict[str, Any]:
    schedule = config.schedule.__dict__.copy()
    if config.schedule.kind != "cosine":  # only the cosine's curve depends on the run's length
        schedule.pop("epochs")
    return {
        **config.settings,
        "samples": samples,
        "batch size": config.batch_size,
        "shuffle seed": config.shuffle_seed,
        "drop last": config.drop_last,
        "keep": config.keep,
        "schedule": schedule,
    }


def _resume(
    session: Any, config: LoopConfig, settings: dict[str, Any]
) -> tuple[checkpoint.Progress, dict[str, np.ndarray] | None]:
    assert config.checkpoint_dir is not None
    path = config.checkpoint_dir / checkpoint.LAST
    if not path.is_file():
        raise BnfuseError(f"--resume: no checkpoint {path}")
    state, progress = checkpoint.load(path)
    if progress is None:
        raise BnfuseError(f"--resume: {path} has no progress record")
    checkpoint.check_settings(progress.settings, settings, path)
    if progress.epoch > config.epochs:
        raise BnfuseError(f"--resume: {path} finished epoch {progress.epoch - 1} already; --epochs is {config.epochs}")
    session.load_state(state)
    best = None
    if config.keep == "best" and progress.best_epoch:
        best, _ = checkpoint.load(config.checkpoint_dir / checkpoint.BEST)
    return progress, best


def _save_interrupted(
    session: Any,
    progress: checkpoint.Progress,
    best_state: dict[str, np.ndarray] | None,
    directory: Path | None,
    lead: bool,
    epoch: int,
    step: int,
) -> None:
    where = f"in epoch {epoch}, after step {step}" if step else f"before epoch {epoch}"
    if directory is None or not lead:
        raise Interrupted(f"interrupted {where}; no checkpoint written")
    if best_state is not None:
        checkpoint.save(directory, checkpoint.BEST, best_state)
    checkpoint.save(directory, checkpoint.LAST, session.state(), progress)
    raise Interrupted(
        f"interrupted {where}: checkpoint in {directory} (continue with --checkpoint-dir {directory} --resume)"
    )


@contextlib.contextmanager
def _deferred_interrupt() -> Iterator[threading.Event]:
    """Ctrl-C sets the event instead of raising mid-step (the loop checkpoints at the next step boundary); a second
    Ctrl-C raises at once."""
    event = threading.Event()
    if threading.current_thread() is not threading.main_thread():
        yield event
        return

    def handler(signum: int, frame: object) -> None:
        if event.is_set():
            raise KeyboardInterrupt
        event.set()

    previous = signal.signal(signal.SIGINT, handler)
    try:
        yield event
    finally:
        signal.signal(signal.SIGINT, previous)
