"""A real training job: scikit-learn's digits, `bnfuse train` beside the same PyTorch loop.

Two networks with BatchNorm, exported from PyTorch (a small CNN on the 8x8 images, an MLP on the 64 pixels),
train 10 epochs, batch 32, SGD momentum 0.9, lr 0.05, on 80% of the digits (1,437 samples: the last batch of
each epoch holds 29), shuffled with the same permutation in both (bnfuse's seeded order, handed to PyTorch's
DataLoader through a sampler, drop_last=False). Reported: test accuracy on the other 20% (eval mode /
the exported model), the training loop's time (the epochs, summed; bnfuse's whole command — loading, building
the graph, writing — beside it) and the largest per-epoch loss difference (absolute). Both at 1 thread; the
PyTorch loop runs in a process of its own: measured here, PyTorch steps in a process that has just run a bnfuse
training job are ~30x slower (1.2 -> 33 ms for this MLP's step; importing bnfuse alone does not do it).
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.common import Section, machine_description, markdown_table, today  # noqa: E402

EPOCHS, BATCH, LR, MOMENTUM = 10, 32, 0.05, 0.9
COMMAND = "python bench/bench_digits.py"


def _networks():  # noqa: ANN202
    import torch
    from torch import nn

    class CNN(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.features = nn.Sequential(
                nn.Conv2d(1, 16, 3, padding=1, bias=False),
                nn.BatchNorm2d(16),
                nn.ReLU(),
                nn.Conv2d(16, 32, 3, padding=1, bias=False),
                nn.BatchNorm2d(32),
                nn.ReLU(),
                nn.MaxPool2d(2),
                nn.Conv2d(32, 64, 3, padding=1, bias=False),
                nn.BatchNorm2d(64),
                nn.ReLU(),
                nn.AdaptiveAvgPool2d(1),
                nn.Flatten(),
            )
            self.fc = nn.Linear(64, 10)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.fc(self.features(x))

    def mlp() -> nn.Module:
        return nn.Sequential(
            nn.Linear(64, 256), nn.BatchNorm1d(256), nn.ReLU(), nn.Linear(256, 128), nn.BatchNorm1d(128), nn.ReLU(),
            nn.Linear(128, 10),
        )  # fmt: skip

    return {"CNN (3 conv + BN)": (CNN, (1, 8, 8)), "MLP 64-256-128-10 (BN1d)": (mlp, (64,))}


def _digits() -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    x, y = load_digits(return_X_y=True)
    return train_test_split((x / 16).astype(np.float32), y, test_size=0.2, random_state=0, stratify=y)


def _torch_job(net, x: np.ndarray, y: np.ndarray) -> tuple[list[float], float]:  # noqa: ANN001
    import torch

    from bnfuse.training.data import epoch_order

    class Order(torch.utils.data.Sampler):
        def __init__(self) -> None:
            self.epoch = 0

        def __iter__(self):  # noqa: ANN204
            self.epoch += 1
            return iter(epoch_order(len(x), self.epoch, 0).tolist())

        def __len__(self) -> int:
            return len(x)

    data = torch.utils.data.TensorDataset(torch.from_numpy(x), torch.from_numpy(y))
    loader = torch.utils.data.DataLoader(data, batch_size=BATCH, sampler=Order(), drop_last=False)
    opt = torch.optim.SGD(net.parameters(), lr=LR, momentum=MOMENTUM)
    losses = []
    start = time.perf_counter()
    for _ in range(EPOCHS):
        net.train()
        total = 0.0
        for xb, yb in loader:
            opt.zero_grad()
            loss = torch.nn.functional.cross_entropy(net(xb), yb)
            loss.backward()
            opt.step()
            total += float(loss.detach()) * len(yb)
        losses.append(total / len(x))
    return losses, time.perf_counter() - start


def _bnfuse_job(model: Path, data: Path, output: Path) -> tuple[list[float], float, float]:
    from bnfuse.training.job import TrainJob, run

    job = TrainJob(
        model=model,
        data=data,
        output=output,
        epochs=EPOCHS,
        batch_size=BATCH,
        schedule={"kind": "constant", "base": LR},
        graph_options={"sgd_momentum": MOMENTUM},
        threads=1,
    )
    start = time.perf_counter()
    result = run(job, log=lambda line: None)
    whole = time.perf_counter() - start
    assert result is not None
    return [e.loss for e in result.history], sum(e.seconds for e in result.history), whole


def _torch_worker(name: str, tmp: str) -> None:
    """The PyTorch side in a fresh process (see the module docstring: bnfuse's job slows torch in its process)."""
    import json

    import torch

    torch.set_num_threads(1)
    make, shape = _networks()[name]
    net = make()
    net.load_state_dict(torch.load(Path(tmp) / "initial.pt"))
    arrays = np.load(Path(tmp) / "split.npz")
    losses, seconds = _torch_job(net, arrays["x_train"], arrays["y_train"])
    net.eval()
    with torch.no_grad():
        logits = net(torch.from_numpy(arrays["x_test"])).numpy()
    accuracy = float(np.mean(logits.argmax(1) == arrays["y_test"]))
    print(json.dumps({"losses": losses, "seconds": seconds, "accuracy": accuracy}))


def _torch_in_subprocess(name: str, tmp: str) -> dict:
    import json
    import subprocess

    result = subprocess.run(
        [sys.executable, __file__, "--torch-worker", name, tmp], capture_output=True, text=True, check=True
    )
    return json.loads(result.stdout.strip().splitlines()[-1])


def run(quick: bool = False) -> Section:
    import onnxruntime
    import torch

    x_train, x_test, y_train, y_test = _digits()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # both at 1 thread: on a shared, loaded machine 2 OpenMP threads wait on each other
    repeats = 1 if quick else 3
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, (make, shape) in _networks().items():
            xs_train = x_train.reshape(-1, *shape)
            xs_test = x_test.reshape(-1, *shape)
            data = Path(tmp) / "digits.npz"
            np.savez(data, X=xs_train, y=y_train)
            times: dict[str, list[float]] = {"bnfuse": [], "whole": [], "torch": []}
            accuracy: dict[str, float] = {}
            gap = 0.0
            np.savez(Path(tmp) / "split.npz", x_train=xs_train, y_train=y_train, x_test=xs_test, y_test=y_test)
            for _ in range(repeats):  # interleaved: machine noise hits both alike
                torch.manual_seed(0)
                net = make()
                torch.save(net.state_dict(), Path(tmp) / "initial.pt")
                model = Path(tmp) / "net.onnx"
                torch.onnx.export(
                    net.eval(), torch.zeros(2, *shape), str(model), dynamo=False,
                    training=torch.onnx.TrainingMode.PRESERVE, do_constant_folding=False,
                    input_names=["x"], dynamic_axes={"x": {0: "batch"}},
                )  # fmt: skip
                theirs = _torch_in_subprocess(name, tmp)
                ours, loop_s, whole_s = _bnfuse_job(model, data, Path(tmp) / "trained.onnx")
                times["bnfuse"].append(loop_s)
                times["whole"].append(whole_s)
                times["torch"].append(theirs["seconds"])
                gap = max(gap, max(abs(a - b) for a, b in zip(ours, theirs["losses"], strict=True)))
                trained = str(Path(tmp) / "trained.onnx")
                session = onnxruntime.InferenceSession(trained, providers=["CPUExecutionProvider"])
                logits = session.run(None, {session.get_inputs()[0].name: xs_test})[0]
                accuracy["bnfuse"] = float(np.mean(logits.argmax(1) == y_test))
                accuracy["torch"] = theirs["accuracy"]
            medians = {key: statistics.median(values) for key, values in times.items()}
            rows.append(
                [
                    name,
                    f"{100 * accuracy['bnfuse']:.2f}%",
                    f"{100 * accuracy['torch']:.2f}%",
                    f"{medians['bnfuse']:.2f} s ({medians['whole']:.2f} s)",
                    f"{medians['torch']:.2f} s",
                    f"{medians['bnfuse'] / medians['torch']:.2f}x",
                    f"{gap:.1e}",
                ]
            )
    torch.set_num_threads(threads)
    header = [
        "network",
        "bnfuse test accuracy",
        "PyTorch test accuracy",
        "bnfuse 10 epochs (whole command)",
        "PyTorch 10 epochs",
        "bnfuse / PyTorch",
        "max per-epoch loss difference",
    ]
    markdown = (
        f"{machine_description()}, {today()}; {repeats} interleaved runs, medians; {len(x_train)} training and "
        f"{len(x_test)} test digits; 10 epochs, batch {BATCH}, SGD momentum {MOMENTUM}, lr {LR}; 1 thread each "
        "(torch.set_num_threads(1), the session's intra_op_num_threads=1).\n\n" + markdown_table(header, rows)
    )
    return Section("digits: a training job beside PyTorch", COMMAND + (" --quick" if quick else ""), markdown)


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--torch-worker":
        _torch_worker(sys.argv[2], sys.argv[3])
    else:
        from bench.common import main

        main(run, __doc__.splitlines()[0])
