"""`bnfuse train` as a whole training job: every sample each epoch (shuffled, last batch partial), validation,
a learning-rate schedule, checkpoints and resuming; against a PyTorch loop with a DataLoader."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

from bnfuse.cli import main
from bnfuse.training.data import Dataset, epoch_order, split
from tests.loaders import torch_nets

torch = pytest.importorskip("torch")
nets = torch_nets()

SAMPLES = 108  # a 0.1 validation split leaves 97 (prime) to train on: batches of 10 end with a partial one of 7
EPOCHS, BATCH, LR, WARMUP = 5, 10, 0.05, 1


def _data(path: Path, shape: tuple[int, ...], classes: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(7)
    x = rng.standard_normal((SAMPLES, *shape[1:])).astype(np.float32)
    y = rng.integers(0, classes, SAMPLES)
    np.savez(path, X=x, y=y)  # scikit-learn's names
    return x, y


def _epoch_lines(out: str) -> list[tuple[float, float, float]]:
    pattern = r"epoch \d+/\d+: loss (\S+) \(\d+ steps, lr \S+\), val loss (\S+), val accuracy (\S+)%"
    return [(float(a), float(b), float(c) / 100) for a, b, c in re.findall(pattern, out)]


class _Order(torch.utils.data.Sampler):
    """The permutation bnfuse draws for each epoch, handed to PyTorch's DataLoader."""

    def __init__(self, count: int) -> None:
        self.count, self.epoch = count, 0

    def __iter__(self):  # noqa: ANN204
        self.epoch += 1
        return iter(epoch_order(self.count, self.epoch, 0).tolist())

    def __len__(self) -> int:
        return self.count


def _torch_run(net, train: Dataset, val: Dataset) -> list[tuple[float, float, float]]:  # noqa: ANN001
    """The PyTorch loop: DataLoader (same permutation, drop_last=False), SGD momentum + weight decay, LinearLR
    warm-up then CosineAnnealingLR (SequentialLR), stepped per epoch; eval-mode validation after every epoch."""
    (x,) = train.inputs.values()
    loader = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(torch.from_numpy(x), torch.from_numpy(train.labels)),
        batch_size=BATCH,
        sampler=_Order(len(train)),
        drop_last=False,
    )
    opt = torch.optim.SGD(net.parameters(), lr=LR, momentum=0.9, weight_decay=1e-4)
    warmup = torch.optim.lr_scheduler.LinearLR(opt, start_factor=1 / 3, total_iters=WARMUP)
    cosine = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=EPOCHS - WARMUP)
    scheduler = torch.optim.lr_scheduler.SequentialLR(opt, [warmup, cosine], milestones=[WARMUP])
    (vx,) = val.inputs.values()
    results = []
    for _ in range(EPOCHS):
        net.train()
        total = 0.0
        for xb, yb in loader:
            opt.zero_grad()
            loss = torch.nn.functional.cross_entropy(net(xb), yb)
            loss.backward()
            opt.step()
            total += float(loss.detach()) * len(yb)
        scheduler.step()
        net.eval()
        with torch.no_grad():
            logits = net(torch.from_numpy(vx))
            val_loss = float(torch.nn.functional.cross_entropy(logits, torch.from_numpy(val.labels)))
            accuracy = float((logits.argmax(1).numpy() == val.labels).mean())
        results.append((total / len(train), val_loss, accuracy))
    return results


def test_cli_job_matches_a_pytorch_loop(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    net, shape = nets.make("resnet", seed=21)
    model = tmp_path / "net.onnx"
    onnx.save(nets.export(net, torch.randn(*shape)), model)
    x, y = _data(tmp_path / "data.npz", shape, 10)
    argv = ["train", str(model), "--data", str(tmp_path / "data.npz"), "-o", str(tmp_path / "trained.onnx")]
    argv += ["--epochs", str(EPOCHS), "--batch-size", str(BATCH), "--lr", str(LR), "--sgd-momentum", "0.9"]
    argv += ["--weight-decay", "1e-4", "--val-split", "0.1", "--lr-schedule", "cosine", "--warmup-epochs", "1"]
    argv += ["--keep", "last"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "batch: dynamic (any size), default 32" not in out and "batch: dynamic (any size), default 10" in out
    assert "(10 steps, lr 0.0166667)" in out  # 97 samples: 9 full batches and 7, warm-up lr = 0.05 / 3
    ours = _epoch_lines(out)
    train, val = split(Dataset({"x": x}, y), 0.1, 0)
    assert (len(train), len(val)) == (97, 11)
    expected = _torch_run(net, train, val)
    assert len(ours) == EPOCHS
    for epoch, (got, want) in enumerate(zip(ours, expected, strict=True), start=1):
        np.testing.assert_allclose(got[:2], want[:2], rtol=1e-4, err_msg=f"epoch {epoch}")
        assert got[2] == pytest.approx(want[2], abs=1e-4), f"epoch {epoch}"
    trained = {t.name: numpy_helper.to_array(t) for t in onnx.load(tmp_path / "trained.onnx").graph.initializer}
    for name, value in nets.state(net).items():
        np.testing.assert_allclose(trained[name], value, rtol=1e-4, atol=1e-5, err_msg=name)


def _run(tmp_path: Path, name: str, *extra: str) -> dict[str, np.ndarray]:
    argv = ["train", str(tmp_path / "net.onnx"), "--data", str(tmp_path / "data.npz"), "-o", str(tmp_path / name)]
    argv += ["--batch-size", "10", "--lr", "0.05", "--optimizer", "adam", "--val-split", "0.1"]
    argv += ["--lr-schedule", "step", "--lr-step-size", "2", "--lr-gamma", "0.5", *extra]
    assert main(argv) == 0
    return {t.name: numpy_helper.to_array(t) for t in onnx.load(tmp_path / name).graph.initializer}


def test_resume_after_epoch_3_is_bit_for_bit(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    net, shape = nets.make("mlp", seed=22)
    onnx.save(nets.export(net, torch.randn(*shape)), tmp_path / "net.onnx")
    _data(tmp_path / "data.npz", shape, 5)
    whole = _run(tmp_path, "whole.onnx", "--epochs", "5")
    uninterrupted = capsys.readouterr().out
    checkpoints = tmp_path / "ckpt"
    _run(tmp_path, "part.onnx", "--epochs", "3", "--checkpoint-dir", str(checkpoints))
    first = capsys.readouterr().out
    assert (checkpoints / "last.npz").is_file() and (checkpoints / "best.npz").is_file()
    resumed = _run(tmp_path, "resumed.onnx", "--epochs", "5", "--checkpoint-dir", str(checkpoints), "--resume")
    second = capsys.readouterr().out
    assert set(resumed) == set(whole)
    for name, value in whole.items():
        np.testing.assert_array_equal(resumed[name], value, err_msg=name)
    lines = [line.rsplit(",", 1)[0] for line in uninterrupted.splitlines() if line.startswith("epoch ")]
    got = [line.rsplit(",", 1)[0] for line in (first + second).splitlines() if line.startswith("epoch ")]
    assert got == [line.replace("/5", "/3") if i < 3 else line for i, line in enumerate(lines)]
    # the checkpoint knows the run it belongs to
    argv = ["train", str(tmp_path / "net.onnx"), "--data", str(tmp_path / "data.npz"), "-o", str(tmp_path / "x.onnx")]
    argv += ["--batch-size", "10", "--lr", "0.05", "--optimizer", "adam", "--val-split", "0.1", "--epochs", "6"]
    assert main([*argv, "--checkpoint-dir", str(checkpoints), "--resume"]) == 2
    err = capsys.readouterr().err
    assert "was written by another run: schedule" in err and len(err.strip().splitlines()) == 1


def test_ctrl_c_saves_a_checkpoint_mid_epoch_and_resume_finishes_the_same_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import os
    import signal

    from bnfuse.training import loop

    net, shape = nets.make("mlp", seed=23)
    onnx.save(nets.export(net, torch.randn(*shape)), tmp_path / "net.onnx")
    _data(tmp_path / "data.npz", shape, 5)
    whole = _run(tmp_path, "whole.onnx", "--epochs", "4", "--lr-schedule", "cosine", "--warmup-epochs", "1")
    capsys.readouterr()
    real_fit = loop.fit

    def interrupted_fit(*args, on_step=None, **kwargs):  # noqa: ANN002, ANN003, ANN202
        def step(epoch: int, done: int, total: int, loss: float) -> None:
            if (epoch, done) == (3, 4):
                os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C in the middle of epoch 3

        return real_fit(*args, on_step=step, **kwargs)

    monkeypatch.setattr("bnfuse.training.job.fit", interrupted_fit)
    extra = ["--epochs", "4", "--lr-schedule", "cosine", "--warmup-epochs", "1"]
    assert main(["train", str(tmp_path / "net.onnx"), "--data", str(tmp_path / "data.npz"), "-o",
                 str(tmp_path / "never.onnx"), "--batch-size", "10", "--lr", "0.05", "--optimizer", "adam",
                 "--val-split", "0.1", "--lr-schedule", "step", "--lr-step-size", "2", "--lr-gamma", "0.5",
                 *extra]) == 130  # fmt: skip
    err = capsys.readouterr().err
    default_dir = tmp_path / "never.onnx.checkpoints"
    assert f"interrupted in epoch 3, after step 4: checkpoint in {default_dir}" in err
    assert not (tmp_path / "never.onnx").exists() and (default_dir / "last.npz").is_file()
    monkeypatch.setattr("bnfuse.training.job.fit", real_fit)
    resumed = _run(tmp_path, "resumed.onnx", *extra, "--checkpoint-dir", str(default_dir), "--resume")
    for name, value in whole.items():
        np.testing.assert_array_equal(resumed[name], value, err_msg=name)
