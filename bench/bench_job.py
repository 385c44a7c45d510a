"""The whole training job against PyTorch's: wall time and peak resident memory of a fresh process each.

bnfuse side: ``bnfuse train model.onnx --data d.npz -o out.onnx --epochs 1 --batch-size B --threads T``
(imports, building the training graph, the session, every step, writing the trained model). PyTorch side: a fresh
process that imports torch and torchvision, creates the same network, loads the same .npz, runs the same epoch
(SGD, lr 0.01, a shuffled order, the last partial batch too) in training mode and saves the state dict.
The model file is exported beforehand (not timed). Peak RSS is the child's ``ru_maxrss`` (os.wait4), so nothing
of this process counts. Both sides run interleaved, ``--rounds`` times; the table gives the median of each.

    python bench/bench_job.py [--models resnet18 ...] [--threads 1 2] [--rounds 3] [--samples 384] [--quick]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import Section, Target, machine_description, markdown_table, today  # noqa: E402

CLASSES = 10
CLI = "import sys; from bnfuse.cli import main; sys.exit(main())"  # the `bnfuse` entry point, this interpreter
IMAGE = (3, 64, 64)

# The PyTorch job, a script of its own so the process holds nothing but what the job needs.
TORCH_JOB = """
import sys, time
sys.path.insert(0, {bench!r})
import numpy as np, torch
import archs
torch.set_num_threads({threads})
net = archs.create({model!r}, classes={classes}).train()
data = np.load({data!r})
x, y = torch.from_numpy(data["x"]), torch.from_numpy(data["labels"])
opt = torch.optim.SGD(net.parameters(), lr=0.01)
order = torch.from_numpy(np.random.default_rng(0).permutation(len(y)))
for start in range(0, len(y), {batch}):
    index = order[start:start + {batch}]
    opt.zero_grad(set_to_none=True)
    loss = torch.nn.functional.cross_entropy(net(x[index]), y[index])
    loss.backward()
    opt.step()
torch.save(net.state_dict(), {output!r})
"""


def measure(command: list[str], env: dict[str, str]) -> tuple[float, float]:
    """(wall seconds, peak RSS MiB) of ``command`` run as a fresh child process."""
    start = time.perf_counter()
    process = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    _, status, usage = os.wait4(process.pid, 0)
    wall = time.perf_counter() - start
    assert process.stderr is not None
    stderr = process.stderr.read().decode()
    process.stderr.close()
    code = os.waitstatus_to_exitcode(status)
    if code:
        raise RuntimeError(f"{' '.join(command)} failed ({code}): {stderr[-2000:]}")
    return wall, usage.ru_maxrss / 1024  # KiB on Linux


def prepare(model: str, folder: Path, samples: int) -> tuple[Path, Path]:
    """The exported model and the data file (random images, labels over CLASSES)."""
    import archs
    import onnx

    path = folder / f"{model}.onnx"
    onnx.save(archs.export(archs.create(model, classes=CLASSES), (1, *IMAGE)), str(path))
    rng = np.random.default_rng(0)
    data = folder / "data.npz"
    if not data.exists():
        x = rng.standard_normal((samples, *IMAGE)).astype(np.float32)
        np.savez(data, x=x, labels=rng.integers(0, CLASSES, samples).astype(np.int64))
    return path, data


def run(
    quick: bool = False,
    models: tuple[str, ...] = ("resnet18",),
    threads: tuple[int, ...] = (1, 2),
    rounds: int = 3,
    samples: int = 384,
    batch: int = 32,
    extra: tuple[str, ...] = (),
) -> Section:
    if quick:
        rounds, samples, threads = 1, 64, threads[:1]
    bench = str(Path(__file__).resolve().parent)
    rows: list[list[object]] = []
    targets: list[Target] = []
    series: dict[str, dict[str, float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        for model in models:
            onnx_path, data = prepare(model, folder, samples)
            for count in threads:
                env = {**os.environ, "OMP_NUM_THREADS": str(count)}
                bnfuse_cmd = [sys.executable, "-c", CLI, "train", str(onnx_path), "--data", str(data), "-o"]
                bnfuse_cmd += [str(folder / "out.onnx"), "--epochs", "1", "--batch-size", str(batch)]
                bnfuse_cmd += ["--threads", str(count), *extra]
                script = TORCH_JOB.format(
                    bench=bench,
                    threads=count,
                    model=model,
                    classes=CLASSES,
                    data=str(data),
                    batch=batch,
                    output=str(folder / "out.pt"),
                )
                torch_cmd = [sys.executable, "-c", script]
                results: dict[str, list[tuple[float, float]]] = {"bnfuse": [], "pytorch": []}
                for _ in range(rounds):
                    results["bnfuse"].append(measure(bnfuse_cmd, env))
                    results["pytorch"].append(measure(torch_cmd, env))
                wall = {k: statistics.median(w for w, _ in v) for k, v in results.items()}
                rss = {k: statistics.median(r for _, r in v) for k, v in results.items()}
                wall_ratio, rss_ratio = wall["bnfuse"] / wall["pytorch"], rss["bnfuse"] / rss["pytorch"]
                rows.append(
                    [
                        model,
                        count,
                        f"{wall['bnfuse']:.2f} / {wall['pytorch']:.2f} s = {wall_ratio:.2f}x",
                        f"{rss['bnfuse']:,.0f} / {rss['pytorch']:,.0f} MiB = {rss_ratio:.2f}x",
                    ]
                )
                series[f"{model}/{count}"] = {**{f"wall_{k}": v for k, v in wall.items()}}
                series[f"{model}/{count}"].update({f"rss_{k}": v for k, v in rss.items()})
                targets.append(Target(f"{model} job wall, {count} thread(s)", wall_ratio, 1.0))
                targets.append(Target(f"{model} job peak RSS, {count} thread(s)", rss_ratio, 1.0))
    header = ["model", "threads", "wall, bnfuse / PyTorch", "peak RSS, bnfuse / PyTorch"]
    text = markdown_table(header, rows)
    text += (
        f"\n\n{samples} samples of {'x'.join(map(str, IMAGE))}, batch {batch}, 1 epoch, median of {rounds} "
        f"interleaved fresh processes each; {machine_description()}; {today()}."
    )
    command = "python bench/bench_job.py " + " ".join(
        [f"--models {' '.join(models)}", f"--threads {' '.join(map(str, threads))}", f"--rounds {rounds}"]
    )
    return Section("Whole training job vs PyTorch", command, text, series, targets)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["resnet18"])
    parser.add_argument("--threads", nargs="+", type=int, default=[1, 2])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--samples", type=int, default=384)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--quick", action="store_true", help="one round, 64 samples, the first thread count")
    args = parser.parse_args()
    section = run(args.quick, tuple(args.models), tuple(args.threads), args.rounds, args.samples, args.batch_size)
    print(f"## {section.title}\n\n`{section.command}`\n\n{section.markdown}\n")


if __name__ == "__main__":
    main()
