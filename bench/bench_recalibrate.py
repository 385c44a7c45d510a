"""BN recalibration after a domain shift: accuracy and time, bnfuse.recalibrate against PyTorch's update_bn.

A small CNN (3 Conv -> BatchNorm2d -> ReLU blocks, global average pooling, Linear) is trained with PyTorch on
scikit-learn's bundled digits (8x8 grey images, 10 classes; train / test split 60 / 40, stratified, seed 0),
then exported (TorchScript exporter, do_constant_folding=False: every BN kept). The shifted domain is the same
images with lower contrast, higher brightness and a left-to-right offset ramp: x' = 0.5 x + 0.3 + 0.25 col / 7
(pixel values first scaled to [0, 1]). Calibration data: the shifted *training* images, without labels, in
batches of 64 in file order; accuracy is measured on the shifted *test* images.

Accuracy rows: the trained model on the clean and the shifted test split, then the shifted split after
``bnfuse recalibrate`` (update-bn and exact) and after ``torch.optim.swa_utils.update_bn`` on the same batches
(float32 module). Timing: one full recalibration of the calibration set per call (bnfuse: graph build, session
creation and the passes over the data, from the in-memory model; PyTorch: update_bn on the module), contenders
interleaved, median of the repeats, reported per 1,000 samples, at 1 and 2 threads (onnxruntime's intra-op pool,
where bnfuse's kernels also run, and PyTorch's); on a loaded 2-core machine PyTorch at 2 threads suffers most.

    python bench/bench_recalibrate.py [--quick]
"""

from __future__ import annotations

import copy
import io
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.bench_step_vs_torch import LoadMeter  # noqa: E402
from bench.common import Section, Target, interleaved_medians, machine_description, markdown_table, today  # noqa: E402
from bench.common import main as bench_main  # noqa: E402

BATCH = 64
SEED = 0
THREADS = (1, 2)


def shift(images: np.ndarray) -> np.ndarray:
    """Lower contrast, brighter, with an offset ramp across the columns (N, 1, 8, 8 in [0, 1])."""
    ramp = 0.25 * np.arange(8, dtype=np.float32) / 7
    return (0.5 * images + 0.3 + ramp).astype(np.float32)


def digits() -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    data = load_digits()
    images = (data.images / 16.0).astype(np.float32)[:, None]
    return train_test_split(images, data.target, test_size=0.4, stratify=data.target, random_state=SEED)


def network() -> object:
    from torch import nn

    def block(cin: int, cout: int) -> list[nn.Module]:
        return [nn.Conv2d(cin, cout, 3, padding=1), nn.BatchNorm2d(cout), nn.ReLU()]

    return nn.Sequential(
        *block(1, 16), *block(16, 32), nn.MaxPool2d(2), *block(32, 32), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
        nn.Linear(32, 10),
    )  # fmt: skip


def train(x: np.ndarray, y: np.ndarray, epochs: int) -> object:
    import torch

    torch.manual_seed(SEED)
    net = network()
    optimizer = torch.optim.Adam(net.parameters(), lr=3e-3)
    order = np.random.default_rng(SEED)
    inputs, labels = torch.from_numpy(x), torch.from_numpy(y).long()
    net.train()
    for _ in range(epochs):
        for index in np.array_split(order.permutation(len(x)), max(1, len(x) // BATCH)):
            optimizer.zero_grad()
            loss = torch.nn.functional.cross_entropy(net(inputs[index]), labels[index])
            loss.backward()
            optimizer.step()
    return net.eval()


def export(net: object) -> object:
    import onnx
    import torch

    buffer = io.BytesIO()
    torch.onnx.export(
        net,
        (torch.zeros(2, 1, 8, 8),),
        buffer,
        dynamo=False,
        do_constant_folding=False,
        input_names=["input"],
        output_names=["logits"],
        dynamic_axes={"input": {0: "n"}, "logits": {0: "n"}},
    )
    return onnx.load_from_string(buffer.getvalue())


def onnx_accuracy(model: object, x: np.ndarray, y: np.ndarray) -> float:
    import onnxruntime as ort

    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return float((session.run(None, {"input": x})[0].argmax(axis=1) == y).mean())


def torch_accuracy(net: object, x: np.ndarray, y: np.ndarray) -> float:
    import torch

    with torch.no_grad():
        return float((net.eval()(torch.from_numpy(x)).argmax(dim=1).numpy() == y).mean())


def run(quick: bool = False) -> Section:
    import torch
    from onnx import numpy_helper
    from torch.optim.swa_utils import update_bn

    import bnfuse

    x_train, x_test, y_train, y_test = digits()
    net = train(x_train, y_train, epochs=3 if quick else 15)
    model = export(net)
    calibration = shift(x_train)
    batches = [calibration[i : i + BATCH] for i in range(0, len(calibration), BATCH)]
    shifted_test = shift(x_test)

    recalibrated = {mode: bnfuse.recalibrate(model, batches, mode=mode)[0] for mode in ("update-bn", "exact")}
    torch_net = copy.deepcopy(net)
    update_bn([torch.from_numpy(b) for b in batches], torch_net)
    rows = [
        ["trained, clean test split", f"{onnx_accuracy(model, x_test, y_test):.4f}"],
        ["trained, shifted test split", f"{onnx_accuracy(model, shifted_test, y_test):.4f}"],
        *[
            [f"shifted + `bnfuse recalibrate --mode {m}`", f"{onnx_accuracy(model_, shifted_test, y_test):.4f}"]
            for m, model_ in recalibrated.items()
        ],
        ["shifted + PyTorch `update_bn` (float32 module)", f"{torch_accuracy(torch_net, shifted_test, y_test):.4f}"],
    ]  # fmt: skip

    # bnfuse update-bn against PyTorch's update_bn (float32 module): largest relative difference per statistic
    values = {t.name: numpy_helper.to_array(t) for t in recalibrated["update-bn"].graph.initializer}
    worst = 0.0
    for name, buffer in torch_net.state_dict().items():
        if name.endswith(("running_mean", "running_var")):
            reference = buffer.numpy().astype(np.float64)
            worst = max(worst, float(np.abs(values[name] - reference).max() / np.abs(reference).max()))

    repeat = 3 if quick else 11
    timing, ratios = [], {}
    for threads in THREADS:
        torch.set_num_threads(threads)

        def torch_update() -> None:
            update_bn([torch.from_numpy(b) for b in batches], copy.deepcopy(net))

        contenders = {
            "bnfuse update-bn": lambda t=threads: bnfuse.recalibrate(model, batches, mode="update-bn", threads=t),
            "bnfuse exact": lambda t=threads: bnfuse.recalibrate(model, batches, mode="exact", threads=t),
            "PyTorch update_bn": torch_update,
        }
        meter = LoadMeter()
        meter.start()
        medians = interleaved_medians(contenders, repeat=repeat, warmup=1)
        load = meter.stop()
        per_thousand = {name: seconds * 1000 / len(calibration) for name, seconds in medians.items()}
        reference = per_thousand["PyTorch update_bn"]
        for name, seconds in medians.items():
            ratio = per_thousand[name] / reference
            ratios[(name, threads)] = ratio
            timing.append(
                [
                    name,
                    threads,
                    f"{seconds * 1e3:.1f}",
                    f"{per_thousand[name] * 1e3:.1f}",
                    f"{ratio:.2f}x",
                    f"{load:.2f}",
                ]
            )
    _, report = bnfuse.recalibrate(model, batches, mode="exact")
    from onnxruntime import __version__ as ort_version

    description = (
        f"{machine_description()}, {today()}; torch {torch.__version__}, onnxruntime {ort_version}. "
        f"Digits: {len(x_train)} training / {len(x_test)} test images; calibration: "
        f"{len(calibration)} shifted training images without labels, {len(batches)} batches of <= {BATCH}; the "
        f"network has {report.batch_norms} BatchNormalization in {report.stages} stages (exact mode: "
        f"{report.passes} passes). Timing: median of {repeat} interleaved calls each, bnfuse at "
        "onnxruntime intra-op threads = PyTorch threads; 'other load' is the cores the rest of the machine kept "
        "busy meanwhile."
    )
    markdown = "\n\n".join(
        [
            description,
            markdown_table(["model", "accuracy"], rows),
            f"bnfuse update-bn vs PyTorch update_bn on the same batches: largest relative difference of a running "
            f"statistic {worst:.1e} (float32 PyTorch).",
            markdown_table(
                [
                    "contender",
                    "threads",
                    "ms per call",
                    "ms per 1,000 samples",
                    "time / PyTorch update_bn",
                    "other load",
                ],
                timing,
            ),
        ]
    )
    targets = [
        # 1 thread only: PyTorch's 2-thread time on a loaded 2-core machine is its OpenMP threads waiting for each other
        Target(
            "recalibrate update-bn, digits CNN, 1 thread: bnfuse / PyTorch update_bn",
            ratios[("bnfuse update-bn", 1)],
            1.5,
        )
    ]
    return Section(
        "BN recalibration after a domain shift: digits CNN, bnfuse vs PyTorch update_bn (CPU)",
        "python bench/bench_recalibrate.py" + (" --quick" if quick else ""),
        markdown,
        targets=targets,
    )


if __name__ == "__main__":
    bench_main(run, __doc__.splitlines()[0])
