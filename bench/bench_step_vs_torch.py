"""Training step and convolution weight gradient against PyTorch on a shared machine, at 1 and 2 threads.

Method (holds on a shared 2-core machine where other processes come and go): each contender runs blocks of
steps; one round runs one block of every contender, in a seeded random order, each block after one untimed step;
the per-step time of a block is its mean; the ratio of a round is the contender's block over PyTorch's block of
the same round. Reported: the median per-step time and the median ratio over rounds, and the load the rest of
the machine put on the cores while we ran (busy cores from /proc/stat minus this process's CPU time, in cores).
Thread count t: ORT's intra-op pool and PyTorch at t (in the weight-gradient table, oneDNN too).

Contenders: bnfuse's training graph as built here (custom BN ops; Conv weight gradients as bnfuse.ConvWeightGrad
on oneDNN when the onednn-cpu-gomp wheel is installed, split into t batch chunks on the session's intra-op pool;
BN -> ReLU fused into the BN ops; the optimizer update as one bnfuse.SGDStep node), the same without the ReLU
fusion (fuse_relu=False), without the optimizer fusion (fused_optimizer=False), with memory="speed" (onnxruntime's
memory pattern and default order, the weight gradients reading the forward Conv's NCHWc copy of X: the settings
before issue 22; the default is memory="lean"), the same with each weight gradient on one thread (t > 1), the same
graph with the weight gradients as the graph rule (oneDNN off while building: what a plain install runs), and
PyTorch (zero_grad, forward, cross-entropy, backward, SGD momentum step) in a process of its own (see TorchWorker),
a block at a time. Second table: the weight gradient alone per conv shape of the ResNet, bnfuse's op as a training
step runs it (a one-node session at t intra-op threads, t batch chunks on its pool) against PyTorch's
convolution_backward asked for the weight gradient only. Third table: peak RSS growth of a step
(bench_step_memory.py's measurement, cold: a fresh process per figure, 5 steps) for bnfuse (lean and speed) and
PyTorch, so that a speed change that costs memory shows.

    python bench/bench_step_vs_torch.py [--quick]
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import Section, Target, machine_description, markdown_table, today  # noqa: E402
from bench.common import main as bench_main  # noqa: E402

THREADS = (1, 2)


class LoadMeter:
    """Cores the rest of the machine kept busy between start() and stop(): busy time from /proc/stat minus the CPU
    time of this process and of ``helpers`` (process ids, e.g. the PyTorch worker), over wall time."""

    def __init__(self, helpers: tuple[int, ...] = ()) -> None:
        self._helpers = helpers

    def start(self) -> None:
        self._busy, self._own, self._wall = _busy_seconds(), self._ours(), time.perf_counter()

    def stop(self) -> float:
        wall = time.perf_counter() - self._wall
        other = (_busy_seconds() - self._busy) - (self._ours() - self._own)
        return max(0.0, other / wall) if wall > 0 else 0.0

    def _ours(self) -> float:
        return _own_seconds() + sum(_process_seconds(pid) for pid in self._helpers)


def _busy_seconds() -> float:
    with open("/proc/stat") as stat:
        fields = [int(v) for v in stat.readline().split()[1:]]
    idle = fields[3] + fields[4]  # idle + iowait
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def _process_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as stat:
        fields = stat.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime


def _own_seconds() -> float:
    times = os.times()
    return times.user + times.system


def blocks(
    fns: dict[str, Callable[[], object]],
    *,
    rounds: int,
    block: int,
    baseline: str,
    warmup: int = 2,
    timed_blocks: dict[str, Callable[[int], float]] | None = None,
    lead_in: int = 1,
) -> dict[str, dict[str, float]]:
    """Per contender: median per-step seconds, median ratio to ``baseline`` within a round, the fastest block.
    ``timed_blocks``: contenders that run a block of n steps themselves and return seconds per step. ``lead_in``:
    untimed steps right before every timed block (timed_blocks contenders run their own, see TorchWorker): they take
    the hand-over from the previous contender (PyTorch's OpenMP team still spin-waiting after its block, idle cores
    waking up), so a block times steps run back to back, as a training loop runs them."""
    timed_blocks = timed_blocks or {}
    fns = {**fns, **{name: (lambda fn=fn: fn(1)) for name, fn in timed_blocks.items()}}
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    names = list(fns)
    per_step: dict[str, list[float]] = {name: [] for name in names}
    ratios: dict[str, list[float]] = {name: [] for name in names}
    shuffle = np.random.default_rng(0)  # seeded: the same schedule every run
    for _ in range(rounds):
        # A fresh order each round: whichever contender follows PyTorch's block (its threads still spinning, the
        # caches full of its data) changes at random, where a rotation always put the same one after it.
        order = [names[i] for i in shuffle.permutation(len(names))]
        this_round = {}
        for name in order:
            fn = fns[name]
            if name in timed_blocks:  # times its own block (another process)
                this_round[name] = timed_blocks[name](block)
            else:
                for _ in range(lead_in):
                    fn()
                start = time.perf_counter()
                for _ in range(block):
                    fn()
                this_round[name] = (time.perf_counter() - start) / block
        for name in names:
            per_step[name].append(this_round[name])
            ratios[name].append(this_round[name] / this_round[baseline])
    return {
        name: {
            "median": statistics.median(per_step[name]),
            "ratio": statistics.median(ratios[name]),
            "best": min(per_step[name]),
        }
        for name in names
    }


_TORCH_WORKER = """
import sys, time
sys.path.insert(0, {root!r})
from bench.bench_training import _torch_nets
torch, ResNet, mlp = _torch_nets()
torch.set_num_threads({threads})
torch.manual_seed(0)
net = ResNet({width}) if {kind!r} == "resnet" else mlp(256, 512)
net.train()
opt = torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9)
x, y = torch.randn(*{shape!r}), torch.randint(0, 10, ({shape!r}[0],))
def step():
    opt.zero_grad()
    torch.nn.functional.cross_entropy(net(x), y).backward()
    opt.step()
print("ready", flush=True)
for line in sys.stdin:
    count = int(line)
    step()  # untimed lead-in, as blocks() runs before every in-process block
    start = time.perf_counter()
    for _ in range(count):
        step()
    print((time.perf_counter() - start) / count, flush=True)
"""


class TorchWorker:
    """PyTorch's step in its own process, run a block at a time on request: bnfuse's OpenMP runtimes (then numba's,
    oneDNN's) in the benchmark process changed PyTorch's thread count and slow it ~9x (measured: 1 thread set, 2
    reported after bnfuse steps; issue 17/14), so PyTorch is timed where bnfuse never ran."""

    def __init__(self, kind: str, width: int, shape: tuple[int, ...], threads: int) -> None:
        import subprocess

        root = str(Path(__file__).resolve().parents[1])
        script = _TORCH_WORKER.format(root=root, threads=threads, width=width, kind=kind, shape=tuple(shape))
        env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
        self._process = subprocess.Popen(
            [sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env
        )
        if self._process.stdout.readline().strip() != "ready":  # type: ignore[union-attr]
            raise RuntimeError("the PyTorch worker did not start")
        self.pid = self._process.pid

    def block(self, count: int) -> float:
        """Seconds per step over ``count`` steps."""
        self._process.stdin.write(f"{count}\n")  # type: ignore[union-attr]
        self._process.stdin.flush()  # type: ignore[union-attr]
        return float(self._process.stdout.readline())  # type: ignore[union-attr]

    def close(self) -> None:
        self._process.stdin.close()  # type: ignore[union-attr]
        self._process.wait(timeout=60)


def _graphs(model):  # noqa: ANN001, ANN202
    """The training graph as built here, the same with the Relu nodes kept (fuse_relu=False), with the standard-ONNX
    optimizer update, with the graph rule for weight gradients, and with the graph rules for Conv input gradients
    (ConvTranspose / flipped-weight Conv instead of bnfuse.ConvInputGrad)."""
    from bnfuse.passes.training import SGD, build_training_graph, fast_rules
    from bnfuse.runtime import conv_grad

    with_op, _ = build_training_graph(model, optimizer=SGD(momentum=0.9))
    relu_kept, _ = build_training_graph(model, optimizer=SGD(momentum=0.9), fuse_relu=False)
    standard_update, _ = build_training_graph(model, optimizer=SGD(momentum=0.9), fused_optimizer=False)
    real = conv_grad._extension
    conv_grad._extension = lambda: None  # as without the wheel: the pass keeps its graph rule
    try:
        rule, _ = build_training_graph(model, optimizer=SGD(momentum=0.9))
    finally:
        conv_grad._extension = real
    real_input_grad = fast_rules._input_grad_node
    fast_rules._input_grad_node = lambda *args: None
    try:
        dx_rule, _ = build_training_graph(model, optimizer=SGD(momentum=0.9))
    finally:
        fast_rules._input_grad_node = real_input_grad
    return with_op, relu_kept, standard_update, rule, dx_rule


def _step_case(
    torch, name: str, kind: str, width: int, shape: tuple[int, ...], threads: int, rounds: int, block: int
) -> dict:  # noqa: ANN001
    from bench.bench_training import _export
    from bench.bench_training import _torch_nets as _torch_nets_cached
    from bnfuse.runtime import conv_grad, session_options
    from bnfuse.training.session import TrainingSession

    _, ResNet, mlp = _torch_nets_cached()
    net = ResNet(width) if kind == "resnet" else mlp(256, 512)
    model = _export(torch, net, shape)
    rng = np.random.default_rng(0)
    x = rng.standard_normal(shape).astype(np.float32)
    labels = rng.integers(0, 10, shape[0]).astype(np.int64)
    with_op, relu_kept, standard_update, rule, dx_rule = _graphs(model)
    op_nodes = sum(n.op_type == conv_grad.OP for n in with_op.graph.node)
    sessions = {}
    labels_of = {"bnfuse": with_op, "bnfuse, ReLU unfused": relu_kept, "bnfuse, optimizer unfused": standard_update}
    if op_nodes:
        labels_of["bnfuse, dW graph rule"] = rule
    if any(n.op_type == "ConvInputGrad" for n in with_op.graph.node):
        labels_of["bnfuse, dX graph rules"] = dx_rule
    for label, graph in labels_of.items():
        options = session_options(["CPUExecutionProvider"], intra_op_num_threads=threads, log_severity_level=3)
        sessions[label] = TrainingSession(graph, lr=0.01, session_options=options)

    variants: dict[str, dict] = {"bnfuse, memory='speed'": {"memory": "speed"}}  # the settings before issue 22
    if op_nodes and threads > 1:  # as before the pool took the weight gradients: each on one thread
        variants["bnfuse, dW on one thread"] = {"weight_grad_threads": 1}
    for label, flags in variants.items():
        options = session_options(["CPUExecutionProvider"], intra_op_num_threads=threads, log_severity_level=3)
        sessions[label] = TrainingSession(with_op, lr=0.01, session_options=options, **flags)
    fns: dict[str, Callable[[], object]] = {label: (lambda s=s: s.step(x, labels)) for label, s in sessions.items()}
    worker = TorchWorker(kind, width, shape, threads)
    meter = LoadMeter((worker.pid,))
    meter.start()
    try:
        result = blocks(fns, rounds=rounds, block=block, baseline="PyTorch", timed_blocks={"PyTorch": worker.block})
        load = meter.stop()  # while the worker's CPU time can still be read
    finally:
        worker.close()
    return {"name": name, "shape": shape, "threads": threads, "times": result, "load": load}


def _conv_shapes(width: int, batch: int) -> list[tuple[tuple[int, ...], int, int, int, int]]:
    """(X shape, output channels, kernel, stride, pad) of the benchmark ResNet's convolutions (distinct)."""
    w, n = width, batch
    return [
        ((n, 3, 32, 32), w, 3, 1, 1),
        ((n, w, 32, 32), w, 3, 1, 1),
        ((n, w, 32, 32), 2 * w, 3, 2, 1),
        ((n, 2 * w, 16, 16), 2 * w, 3, 1, 1),
        ((n, w, 32, 32), 2 * w, 1, 2, 0),
        ((n, 2 * w, 16, 16), 4 * w, 3, 2, 1),
        ((n, 4 * w, 8, 8), 4 * w, 3, 1, 1),
        ((n, 2 * w, 16, 16), 4 * w, 1, 2, 0),
    ]


def _weight_grad_session(geometry, threads: int):  # noqa: ANN001, ANN202
    """A one-node bnfuse.ConvWeightGrad session at ``threads`` intra-op threads."""
    import onnxruntime
    from onnx import TensorProto, helper

    from bnfuse.io import ort_compatible
    from bnfuse.runtime import conv_grad, session_options

    node = conv_grad.make_node(
        "x", "dy", "dw", kernel_shape=geometry.kernel_shape, strides=geometry.strides,
        dilations=geometry.dilations, pads=geometry.pads, group=geometry.group,
    )  # fmt: skip
    inputs = [
        helper.make_tensor_value_info("x", TensorProto.FLOAT, list(geometry.x_shape)),
        helper.make_tensor_value_info("dy", TensorProto.FLOAT, list(geometry.dy_shape)),
    ]
    graph = helper.make_graph([node], "dw", inputs, [helper.make_tensor_value_info("dw", TensorProto.FLOAT, None)])
    opsets = [helper.make_opsetid("", 17), helper.make_opsetid(conv_grad.DOMAIN, 1)]
    model = ort_compatible(helper.make_model(graph, opset_imports=opsets))
    options = session_options(["CPUExecutionProvider"], intra_op_num_threads=threads, log_severity_level=3)
    return onnxruntime.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


def _weight_grad_case(torch, threads: int, shapes, rounds: int, block: int) -> list[dict]:  # noqa: ANN001
    from bnfuse.runtime import conv_grad

    torch.set_num_threads(threads)
    rng = np.random.default_rng(1)
    cases = []
    for x_shape, out_channels, kernel, stride, pad in shapes:
        size = (x_shape[2] + 2 * pad - kernel) // stride + 1
        x = rng.standard_normal(x_shape).astype(np.float32)
        dy = rng.standard_normal((x_shape[0], out_channels, size, size)).astype(np.float32)
        geometry = conv_grad.Geometry(x.shape, dy.shape, (kernel, kernel), (stride,) * 2, (1, 1), (pad,) * 4, 1)
        tx, tdy, tw = torch.from_numpy(x), torch.from_numpy(dy), torch.zeros(geometry.weight_shape)

        session = _weight_grad_session(geometry, threads)
        binding = session.io_binding()
        binding.bind_cpu_input("x", x)
        binding.bind_cpu_input("dy", dy)
        binding.bind_output("dw")

        def ours(session=session, binding=binding) -> None:  # noqa: ANN001
            with conv_grad.onednn_threads(threads):
                session.run_with_iobinding(binding)

        def theirs(tx=tx, tdy=tdy, tw=tw, stride=stride, pad=pad) -> None:  # noqa: ANN001
            torch.ops.aten.convolution_backward(
                tdy, tx, tw, None, [stride] * 2, [pad] * 2, [1, 1], False, [0, 0], 1, [False, True, False]
            )

        result = blocks(
            {"bnfuse.ConvWeightGrad": ours, "PyTorch": theirs}, rounds=rounds, block=block, baseline="PyTorch"
        )
        cases.append({"shape": (x_shape, out_channels, kernel, stride, pad), "threads": threads, "times": result})
    return cases


def _memory_table(sizes: StepSizes) -> tuple[str, dict]:
    """Peak RSS growth of a step, cold, bnfuse (lean, speed) and PyTorch, at each thread count: a markdown table."""
    import tempfile

    from bench import bench_step_memory as memory

    cases = [
        (f"ResNet (width {sizes.width})", "resnet", sizes.width, sizes.resnet_shape),
        ("MLP 256-512-512-10", "mlp", 0, sizes.mlp_shape),
    ]
    rows, series = [], {}
    with tempfile.TemporaryDirectory(prefix="bnfuse-bench-step-vs-torch-") as scratch:
        plan = memory.export_networks(Path(scratch), cases)
        for threads in THREADS:
            for name, kind, width, shape in cases:
                got = {
                    label: memory.measure(
                        side, kind, width, shape, warm=False, memory=mode, files=plan[name], threads=threads
                    )["growth"]
                    for label, side, mode in (
                        ("bnfuse", "bnfuse", "lean"),
                        ("bnfuse, memory='speed'", "bnfuse", "speed"),
                        ("PyTorch", "pytorch", "lean"),
                    )
                }
                series[f"{name} t{threads}"] = got
                rows.append(
                    [
                        name,
                        "x".join(map(str, shape)),
                        threads,
                        *(f"{got[label] / 2**20:,.0f}" for label in got),
                        f"{got['bnfuse'] / got['PyTorch']:.2f}",
                    ]
                )
    header = ["network", "batch", "threads", "bnfuse MiB", "bnfuse, memory='speed' MiB", "PyTorch MiB", "/ PyTorch"]
    return markdown_table(header, rows), series


@dataclass(frozen=True)
class StepSizes:
    """The benchmark's networks and timing schedule (full or --quick), shared with bench_fusions.py."""

    rounds: int
    block: int
    width: int  # the ResNet's
    batch: int  # the ResNet's
    mlp_batch: int

    @classmethod
    def of(cls, quick: bool) -> StepSizes:
        return cls(3, 2, 8, 8, 64) if quick else cls(15, 4, 16, 32, 256)

    @property
    def resnet_shape(self) -> tuple[int, ...]:
        return (self.batch, 3, 32, 32)

    @property
    def mlp_shape(self) -> tuple[int, ...]:
        return (self.mlp_batch, 256)


def run(quick: bool = False) -> Section:
    from bench.bench_training import _torch_nets
    from bnfuse.runtime import conv_grad

    torch, _, _ = _torch_nets()
    torch.manual_seed(0)
    sizes = StepSizes.of(quick)
    rounds, block, width, batch = sizes.rounds, sizes.block, sizes.width, sizes.batch
    step_cases = []
    for threads in THREADS:
        resnet = (f"ResNet (width {width})", "resnet", width, sizes.resnet_shape)
        mlp_case = ("MLP 256-512-512-10", "mlp", 0, sizes.mlp_shape)
        for label, kind, size, shape in (resnet, mlp_case):
            step_cases.append(_step_case(torch, label, kind, size, shape, threads, rounds, block))
    rows = []
    for case in step_cases:
        for label, t in case["times"].items():
            rows.append(
                [
                    case["name"],
                    "x".join(map(str, case["shape"])),
                    case["threads"],
                    label,
                    f"{t['median'] * 1e3:.2f}",
                    f"{t['best'] * 1e3:.2f}",
                    f"{t['ratio']:.2f}",
                    f"{case['load']:.2f}",
                ]
            )
    header = ["network", "batch", "threads", "contender", "step ms (median)", "best block", "/ PyTorch", "other load"]
    step_table = markdown_table(header, rows)

    grad_rows = []
    grad_cases = []
    if conv_grad.available():
        shapes = _conv_shapes(width, batch)[: 3 if quick else None]
        for threads in THREADS:
            grad_cases += _weight_grad_case(torch, threads, shapes, rounds, 3 if quick else 10)
        for case in grad_cases:
            (x_shape, co, kernel, stride, pad), t = case["shape"], case["times"]
            grad_rows.append(
                [
                    "x".join(map(str, x_shape)),
                    f"{co}, {kernel}x{kernel}, s{stride}, p{pad}",
                    case["threads"],
                    f"{t['bnfuse.ConvWeightGrad']['median'] * 1e3:.3f}",
                    f"{t['PyTorch']['median'] * 1e3:.3f}",
                    f"{t['bnfuse.ConvWeightGrad']['best'] * 1e3:.3f} / {t['PyTorch']['best'] * 1e3:.3f}",
                    f"{t['bnfuse.ConvWeightGrad']['ratio']:.2f}",
                ]
            )
    grad_table = (
        markdown_table(
            ["X", "out, kernel, stride, pad", "threads", "bnfuse ms", "PyTorch ms", "best (bnfuse / PyTorch)", "ratio"],
            grad_rows,
        )
        if grad_rows
        else "oneDNN (onednn-cpu-gomp) is not installed here: no ConvWeightGrad timings."
    )
    memory_table, memory_series = _memory_table(sizes)
    onednn = conv_grad.version()
    markdown = "\n\n".join(
        [
            f"{machine_description()}, {today()}; oneDNN {'.'.join(map(str, onednn)) if onednn else 'absent'}. "
            f"Blocks of {block} steps, {rounds} rounds, contenders in a seeded random order each round, one untimed "
            "step before each block; medians over rounds; "
            "'/ PyTorch' is the median of per-round ratios; 'other load' is the cores the rest of the machine "
            "kept busy meanwhile (2 cores in all: above ~0.5 the absolute times are noisy, the ratios less so).",
            step_table,
            "Conv weight gradient alone (float32), per distinct ResNet conv shape: a one-node bnfuse.ConvWeightGrad "
            "session at t intra-op threads (oneDNN, plain NCHW in and out, reorders included; t batch chunks on the "
            "session's pool, as in a training step) against torch.ops.aten.convolution_backward with output_mask "
            "(False, True, False). Blocks and rounds as above.",
            grad_table,
            "Peak RSS growth of a step, one fresh process per figure (bench_step_memory.py's 'cold' measurement: "
            "VmHWM after 5 steps minus VmRSS just before the session / module and optimizer are made, libraries "
            "loaded on first use included; SGD momentum 0.9).",
            memory_table,
        ]
    )
    targets = [
        Target(
            f"training step {case['name']}, {case['threads']} thread(s), bnfuse / PyTorch",
            case["times"]["bnfuse"]["ratio"],
            1.0,
        )
        for case in step_cases
    ]
    return Section(
        title="Training step and weight gradient vs PyTorch, 1 and 2 threads (shared machine)",
        command="python bench/bench_step_vs_torch.py" + (" --quick" if quick else ""),
        markdown=markdown,
        series={
            **{f"{c['name']} t{c['threads']}": {k: v["median"] for k, v in c["times"].items()} for c in step_cases},
            "peak_rss_growth_bytes": memory_series,
        },
        targets=targets,
    )


if __name__ == "__main__":
    bench_main(run, __doc__.splitlines()[0])
