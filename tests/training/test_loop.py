"""The training loop: every sample once per epoch (or --drop-last), the kept epoch, validation values."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest

from bnfuse.errors import BnfuseError
from bnfuse.models import registry
from bnfuse.passes.training import SGD, build_training_graph
from bnfuse.training.data import Dataset
from bnfuse.training.loop import LoopConfig, fit
from bnfuse.training.schedules import Schedule
from bnfuse.training.session import TrainingSession


def _session_and_data(samples: int = 23) -> tuple[TrainingSession, Dataset, Dataset]:
    model = registry.build("mlp_gemm", size=16, width=0.125, seed=3)
    train_model, _ = build_training_graph(model, optimizer=SGD(momentum=0.9))
    rng = np.random.default_rng(4)
    x = rng.standard_normal((samples + 9, 16)).astype(np.float32)
    y = rng.integers(0, 10, samples + 9)
    return (
        TrainingSession(train_model, lr=0.2),
        Dataset({"input": x[:samples]}, y[:samples]),
        Dataset({"input": x[samples:]}, y[samples:]),
    )


@pytest.mark.parametrize(("drop_last", "steps"), [(False, 5), (True, 4)])
def test_every_sample_once_per_epoch(drop_last: bool, steps: int) -> None:
    session, train, _ = _session_and_data()
    train.inputs["input"][:, 0] = np.arange(len(train))  # each sample carries its index
    seen: list[np.ndarray] = []
    real_step = session.step

    def recording_step(inputs, labels):  # noqa: ANN001, ANN202
        seen.append(inputs["input"][:, 0].astype(int))
        return real_step(inputs, labels)

    session.step = recording_step
    config = LoopConfig(epochs=2, batch_size=5, schedule=Schedule(base=0.1, epochs=2), drop_last=drop_last)
    result = fit(session, train, config, log=lambda line: None)
    assert [h.steps for h in result.history] == [steps, steps]
    assert [len(s) for s in seen] == ([5, 5, 5, 5, 3] if not drop_last else [5, 5, 5, 5]) * 2
    epochs = [np.concatenate(seen[:steps]), np.concatenate(seen[steps:])]
    for order in epochs:  # every sample once (all but the 3 of the partial batch with --drop-last), shuffled
        assert len(set(order.tolist())) == len(order) == (23 if not drop_last else 20)
        assert order.tolist() != sorted(order.tolist())
    assert epochs[0].tolist() != epochs[1].tolist()  # a new order each epoch


def test_keep_best_is_the_epoch_with_the_lowest_validation_loss() -> None:
    session, train, val = _session_and_data()
    lines: list[str] = []
    config = LoopConfig(epochs=4, batch_size=5, schedule=Schedule(base=0.2, epochs=4), keep="best")
    result = fit(session, train, config, val=val, log=lines.append)
    losses = [h.val_loss for h in result.history]
    assert result.kept_epoch == int(np.argmin(losses)) + 1
    assert len(lines) == 4 and all("val loss" in line and "val accuracy" in line for line in lines)
    # the session holds the kept epoch: its validation loss is the one reported for that epoch
    model = session.export_inference_model()
    inference = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    logits = inference.run(None, {"input": val.inputs["input"]})[0].astype(np.float64)
    shifted = logits - logits.max(1, keepdims=True)
    log_probs = shifted - np.log(np.exp(shifted).sum(1, keepdims=True))
    assert -log_probs[np.arange(len(val)), val.labels].mean() == pytest.approx(min(losses), rel=1e-9)
    accuracy = float(np.mean(logits.argmax(1) == val.labels))
    assert result.history[result.kept_epoch - 1].val_accuracy == accuracy


def test_keep_best_needs_validation() -> None:
    session, train, _ = _session_and_data()
    with pytest.raises(BnfuseError, match="--keep best needs validation data"):
        fit(session, train, LoopConfig(epochs=1, batch_size=5, schedule=Schedule(), keep="best"))
