"""The whole training job against PyTorch's: wall time and peak resident memory of a fresh process each.

bnfuse side: ``bnfuse train model.onnx --data d.npz -o out.onnx --epochs 1 --batch-size B --threads T``
(imports, building the training graph, the session, every step, writing the trained model). PyTorch side: a fresh
process that imports torch and torchvision, creates the same network, loads the same .npz, runs the same epoch
(SGD, lr 0.01, a shuffled order, the last partial batch too) in training mode and saves the state dict.
The model file is exported beforehand (not timed). Peak RSS is the child's own high-water mark (VmHWM, printed
by the child at exit: ``ru_maxrss`` would not do, Linux carries the forking parent's peak over exec into it).
Both sides run interleaved, ``--rounds`` times; the table gives the median of each.

    python bench/bench_job.py [--models resnet18 ...] [--threads 1 2] [--rounds 3] [--samples 384] [--quick]

``--build [--before TREE]``: the training pass alone, static and dynamic batch, in fresh processes: the build's wall
time and the process's peak RSS, against another checkout's code (``--before``: a tree with the same layout, its
extensions built, e.g. ``git archive <commit> | tar -x -C TREE``) run interleaved.

``--first-step``: time to the first step, each side a fresh process timed from its start (``/proc``) to the end of
its first training step: ``bnfuse train``'s own path (``job.run``: imports, reading the model, building the graph,
the session, loading the data, one step; no graph cache) against PyTorch's (imports, creating the network, loading
the data, one step).

``--loop``: the job's own loop (``loop.fit``: slicing, shuffling, progress) against the same steps called directly.
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
sys.path.insert(1, str(Path(__file__).resolve().parents[1]))  # tests.loaders (--loop)

from common import (  # noqa: E402
    Section,
    Target,
    interleaved_medians,
    machine_description,
    markdown_table,
    today,
)

CLASSES = 10
ROOT = Path(__file__).resolve().parents[1]  # this checkout: the children import its bnfuse
# Every child prints its peak resident set at exit (VmHWM: this process's own, from exec on).
PEAK = """
import atexit, sys
def _peak():
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            sys.stderr.write("\\nbench_job peak KiB " + line.split()[1] + "\\n")
atexit.register(_peak)
"""
CLI = PEAK + "from bnfuse.cli import main; sys.exit(main())"  # the `bnfuse` entry point, this interpreter
IMAGE = (3, 64, 64)

# What both PyTorch scripts start with: the network, the data and the optimizer the job uses.
TORCH_SETUP = """import sys
sys.path.insert(0, {bench!r})
import numpy as np, torch
import archs
torch.set_num_threads({threads})
net = archs.create({model!r}, classes={classes}).train()
data = np.load({data!r})
x, y = torch.from_numpy(data["x"]), torch.from_numpy(data["labels"])
opt = torch.optim.SGD(net.parameters(), lr=0.01)
"""
# The PyTorch job, a script of its own so the process holds nothing but what the job needs.
TORCH_JOB = (
    PEAK
    + """
import time
"""
    + TORCH_SETUP
    + """order = torch.from_numpy(np.random.default_rng(0).permutation(len(y)))
for start in range(0, len(y), {batch}):
    index = order[start:start + {batch}]
    opt.zero_grad(set_to_none=True)
    loss = torch.nn.functional.cross_entropy(net(x[index]), y[index])
    loss.backward()
    opt.step()
torch.save(net.state_dict(), {output!r})
"""
)


def measure(command: list[str], env: dict[str, str]) -> tuple[float, float]:
    """(wall seconds, peak RSS MiB) of ``command`` run as a fresh child process."""
    start = time.perf_counter()
    # run outside any checkout: `python -c` puts the working directory first on sys.path, before PYTHONPATH
    done = subprocess.run(
        command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, check=False, cwd=tempfile.gettempdir()
    )
    wall = time.perf_counter() - start
    stderr = done.stderr.decode()
    if done.returncode:
        raise RuntimeError(f"{' '.join(command)} failed ({done.returncode}): {stderr[-2000:]}")
    return wall, _peak_mib(stderr)


def _peak_mib(stderr: str) -> float:
    """The peak the child printed (PEAK), in MiB."""
    lines = [line for line in stderr.splitlines() if line.startswith("bench_job peak KiB ")]
    return int(lines[-1].split()[-1]) / 1024


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
    before: Path | None = None,
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
                env = {**os.environ, "OMP_NUM_THREADS": str(count), "PYTHONPATH": str(ROOT)}
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
                commands = {
                    "bnfuse": ([*bnfuse_cmd, "--no-graph-cache"], env),  # a first run: the graph built
                    "bnfuse, graph cached": (bnfuse_cmd, env),  # a later run: the graph kept by the first
                    "pytorch": (torch_cmd, env),
                }
                if before is not None:  # an older checkout's `bnfuse train` (no cache there)
                    commands["bnfuse before"] = (bnfuse_cmd, {**env, "PYTHONPATH": str(before.resolve())})
                measure(bnfuse_cmd, env)  # fills the cache
                results: dict[str, list[tuple[float, float]]] = {name: [] for name in commands}
                for _ in range(rounds):
                    for name, (command, environment) in commands.items():
                        results[name].append(measure(command, environment))
                wall = {k: statistics.median(w for w, _ in v) for k, v in results.items()}
                rss = {k: statistics.median(r for _, r in v) for k, v in results.items()}
                cells = []
                for name in ("bnfuse", "bnfuse, graph cached", *(["bnfuse before"] if before else [])):
                    wall_ratio, rss_ratio = wall[name] / wall["pytorch"], rss[name] / rss["pytorch"]
                    cells += [f"{wall[name]:.2f} s = {wall_ratio:.2f}x", f"{rss[name]:,.0f} MiB = {rss_ratio:.2f}x"]
                    what = f"{model} job {'(graph cached) ' if 'cached' in name else ''}"
                    if name == "bnfuse before":
                        continue
                    targets.append(Target(f"{what}wall, {count} thread(s)", wall_ratio, 1.0))
                    targets.append(Target(f"{what}peak RSS, {count} thread(s)", rss_ratio, 1.0))
                rows.append([model, count, f"{wall['pytorch']:.2f} s", f"{rss['pytorch']:,.0f} MiB", *cells])
                series[f"{model}/{count}"] = {
                    **{f"wall {k}": v for k, v in wall.items()},
                    **{f"rss {k}": v for k, v in rss.items()},
                }
    header = [
        "model",
        "threads",
        "PyTorch wall",
        "PyTorch peak RSS",
        "bnfuse wall / PyTorch",
        "bnfuse peak RSS / PyTorch",
    ]
    header += ["graph cached: wall / PyTorch", "graph cached: peak RSS / PyTorch"]
    header += ["before: wall / PyTorch", "before: peak RSS / PyTorch"] if before else []
    text = markdown_table(header, rows)
    text += (
        f"\n\n{samples} samples of {'x'.join(map(str, IMAGE))}, batch {batch}, 1 epoch, median of {rounds} "
        f"interleaved fresh processes each; {machine_description()}; {today()}."
    )
    command = "python bench/bench_job.py " + " ".join(
        [f"--models {' '.join(models)}", f"--threads {' '.join(map(str, threads))}", f"--rounds {rounds}"]
    )
    return Section("Whole training job vs PyTorch", command, text, series, targets)


BUILD_JOB = (
    PEAK
    + """
import time
from bnfuse.passes.training import build_training_graph
start = time.perf_counter()
build_training_graph({model!r}, batch_size=32, static_batch={static})
print(time.perf_counter() - start)
"""
)


def run_build(models: tuple[str, ...], rounds: int, before: Path | None) -> str:
    """Markdown table: build wall and peak RSS of the training pass, static and dynamic, this tree (and ``before``)."""
    trees = {"after": Path(__file__).resolve().parents[1], **({"before": before.resolve()} if before else {})}
    rows: list[list[object]] = []
    with tempfile.TemporaryDirectory() as tmp:
        for model in models:
            path, _ = prepare(model, Path(tmp), 1)
            for static in (True, False):
                samples: dict[str, list[tuple[float, float]]] = {tree: [] for tree in trees}
                for _ in range(rounds):
                    for tree, root in trees.items():
                        env = {**os.environ, "PYTHONPATH": str(root)}
                        script = BUILD_JOB.format(model=str(path), static=static)
                        samples[tree].append(_timed_build([sys.executable, "-c", script], env))
                cells = []
                for tree in trees:
                    wall = statistics.median(w for w, _ in samples[tree])
                    rss = statistics.median(r for _, r in samples[tree])
                    cells.append(f"{wall:.2f} s, {rss:,.0f} MiB")
                rows.append([model, "static" if static else "dynamic", *cells])
    return markdown_table(["model", "batch", *[f"{t}: build wall, process peak RSS" for t in trees]], rows)


def _timed_build(command: list[str], env: dict[str, str]) -> tuple[float, float]:
    """(the build's own seconds as the child prints them, the child's peak RSS MiB)."""
    done = subprocess.run(command, env=env, capture_output=True, check=False, cwd=tempfile.gettempdir())
    if done.returncode:
        raise RuntimeError(f"build failed: {done.stderr.decode()[-2000:]}")
    return float(done.stdout.decode().strip().splitlines()[-1]), _peak_mib(done.stderr.decode())


# Seconds since this process started (its start time in /proc, clock ticks since boot), printed at the first step.
SINCE_START = """
import os
def _since_start():
    ticks = int(open("/proc/self/stat").read().rsplit(")", 1)[1].split()[19])
    return float(open("/proc/uptime").read().split()[0]) - ticks / os.sysconf("SC_CLK_TCK")
"""
FIRST_STEP_BNFUSE = (
    SINCE_START
    + """
import sys
from pathlib import Path
from bnfuse.training.job import TrainJob, run
def first(*progress):
    print(_since_start(), flush=True)
    os._exit(0)
job = TrainJob(model=Path({model!r}), data=Path({data!r}), output=Path({output!r}), batch_size={batch},
               threads={threads}, graph_cache=False)
run(job, log=lambda line: None, on_step=first)
"""
)
FIRST_STEP_TORCH = (
    SINCE_START
    + """
"""
    + TORCH_SETUP
    + """index = torch.from_numpy(np.random.default_rng(0).permutation(len(y)))[:{batch}]
opt.zero_grad(set_to_none=True)
torch.nn.functional.cross_entropy(net(x[index]), y[index]).backward()
opt.step()
print(_since_start(), flush=True)
"""
)


def run_first_step(models: tuple[str, ...], threads: tuple[int, ...], rounds: int, batch: int) -> str:
    """Markdown table: seconds from process start to the end of the first training step, bnfuse train against
    PyTorch, interleaved fresh processes, medians of ``rounds``."""
    bench = str(Path(__file__).resolve().parent)
    rows: list[list[object]] = []
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        for model in models:
            path, data = prepare(model, folder, batch)
            for count in threads:
                env = {**os.environ, "OMP_NUM_THREADS": str(count), "PYTHONPATH": str(ROOT)}
                fields = dict(model=str(path), data=str(data), batch=batch, threads=count)
                scripts = {
                    "bnfuse": FIRST_STEP_BNFUSE.format(output=str(folder / "out.onnx"), **fields),
                    "pytorch": FIRST_STEP_TORCH.format(bench=bench, classes=CLASSES, **{**fields, "model": model}),
                }
                seconds: dict[str, list[float]] = {name: [] for name in scripts}
                for _ in range(rounds):
                    for name, script in scripts.items():
                        done = subprocess.run(
                            [sys.executable, "-c", script],
                            env=env,
                            capture_output=True,
                            check=False,
                            cwd=tempfile.gettempdir(),
                        )
                        if done.returncode:
                            raise RuntimeError(f"{name} first step failed: {done.stderr.decode()[-2000:]}")
                        seconds[name].append(float(done.stdout.decode().split()[-1]))
                ours, theirs = (statistics.median(seconds[name]) for name in ("bnfuse", "pytorch"))
                rows.append([model, count, f"{ours:.2f} s", f"{theirs:.2f} s", f"{ours / theirs:.2f}x"])
    header = [
        "model",
        "threads",
        "bnfuse train: start to first step",
        "PyTorch: start to first step",
        "bnfuse / PyTorch",
    ]
    return markdown_table(header, rows) + (
        f"\n\nbatch {batch}, {'x'.join(map(str, IMAGE))}; median of {rounds} interleaved fresh processes each; "
        f"{machine_description()}; {today()}."
    )


def run_loop(rounds: int) -> str:
    """The job loop's overhead per step over TrainingSession.step, on a small network (short steps show it most)."""
    import torch

    from bnfuse.passes.training import build_training_graph
    from bnfuse.training.data import Dataset
    from bnfuse.training.loop import LoopConfig, fit
    from bnfuse.training.schedules import Schedule
    from bnfuse.training.session import TrainingSession
    from tests.loaders import torch_nets

    nets = torch_nets()
    net, shape = nets.make("resnet", seed=3)
    graph, _ = build_training_graph(nets.export(net, torch.randn(*shape)), batch_size=8)
    rng = np.random.default_rng(0)
    count, batch = 8 * 64, 8
    x = rng.standard_normal((count, *shape[1:])).astype(np.float32)
    labels = rng.integers(0, 10, count)
    session = TrainingSession(graph, lr=0.01, intra_op_threads=1)
    data = Dataset({session.spec.data[0]: x}, labels)

    def direct() -> None:
        order = np.random.default_rng(0).permutation(count)
        for start in range(0, count, batch):
            index = order[start : start + batch]
            session.step(x[index], labels[index])

    def job_loop() -> None:
        config = LoopConfig(epochs=1, batch_size=batch, schedule=Schedule(epochs=1))
        fit(session, data, config, log=lambda line: None, on_step=lambda *progress: None)

    times = interleaved_medians({"direct": direct, "fit": job_loop}, repeat=rounds)
    steps = count // batch
    per_step = (times["fit"] - times["direct"]) / steps * 1e6
    return markdown_table(
        ["steps", "TrainingSession.step loop", "loop.fit (shuffle, slicing, progress)", "fit / direct", "per step"],
        [[steps, f"{times['direct'] * 1e3:.1f} ms", f"{times['fit'] * 1e3:.1f} ms",
          f"{times['fit'] / times['direct']:.3f}x", f"{per_step:+.0f} µs"]],
    )  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["resnet18"])
    parser.add_argument("--threads", nargs="+", type=int, default=[1, 2])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--samples", type=int, default=384)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--quick", action="store_true", help="one round, 64 samples, the first thread count")
    parser.add_argument("--build", action="store_true", help="the training pass alone (see the module docstring)")
    parser.add_argument("--before", type=Path, help="a checkout to compare against (its bnfuse train, or its pass)")
    parser.add_argument("--loop", action="store_true", help="the job loop's overhead over the steps alone")
    parser.add_argument("--first-step", action="store_true", help="time from process start to the first step's end")
    args = parser.parse_args()
    if args.first_step:
        print(run_first_step(tuple(args.models), tuple(args.threads), args.rounds, args.batch_size))
        return
    if args.build:
        print(run_build(tuple(args.models), args.rounds, args.before))
        return
    if args.loop:
        print(run_loop(max(args.rounds, 5)))
        return
    section = run(
        args.quick, tuple(args.models), tuple(args.threads), args.rounds, args.samples, args.batch_size, (), args.before
    )
    print(f"## {section.title}\n\n`{section.command}`\n\n{section.markdown}\n")


if __name__ == "__main__":
    main()
