"""BN kernel speed: bnfuse's C CPU kernels beside onnxruntime's native BatchNormalization and PyTorch CPU.

One tensor N=32 C=64 56x56 float32 (quick: N=8), all contenders in one process:

* forward inference: bnfuse cpu, ORT BatchNormalization (opset 15, training_mode=0), torch F.batch_norm eval,
  plain NumPy float32
* forward training: bnfuse cpu, ORT BatchNormalization (training_mode=1, outputs Y and running stats),
  torch F.batch_norm(training=True) under no_grad, plain NumPy float32
* backward: bnfuse cpu, torch autograd (torch.autograd.grad of F.batch_norm's output), plain NumPy float32
* channels-last (NHWC): bnfuse cpu (axis=-1) against torch channels_last tensors

Each op's contenders run round-robin (interleaved medians), one op after the other. Rows "floor" time a
NumPy copy (one read, one write) or add (two reads, one write) of the same tensor: the memory traffic any
implementation needs at least. bnfuse writes into preallocated outputs (as the ORT custom op does); ORT and
torch allocate theirs.
A sweep of tensor sizes gives time and effective bandwidth (bytes read + written) of the cpu kernels.

    python -m bench.bench_kernels [--quick]
"""

from __future__ import annotations

import statistics
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import onnxruntime
from onnx import TensorProto, helper

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import (  # noqa: E402
    Section,
    Target,
    interleaved_medians,
    machine_description,
    markdown_table,
    median_seconds,
    today,
)
from bench.common import main as bench_main
from bnfuse.io import ort_compatible  # noqa: E402
from bnfuse.runtime import cpu  # noqa: E402
from bnfuse.runtime.kernel_types import GradOutputs, TrainingOutputs  # noqa: E402
from bnfuse.runtime.semantics import BatchNormConfig  # noqa: E402

SHAPE = (32, 64, 56, 56)
QUICK_SHAPE = (8, 64, 56, 56)
SWEEP = [(1, 64, 8, 8), (2, 64, 14, 14), (4, 64, 28, 28), (8, 64, 56, 56), (16, 64, 56, 56), (32, 64, 56, 56)]
EPS, MOMENTUM = 1e-5, 0.9
NO_GPU = "not measured (no GPU lent to this task)"
OPS = ("inference", "training fwd", "backward", "NHWC training fwd", "NHWC backward")
TARGET_PEERS = {
    "inference": "inference | onnxruntime",
    "training fwd": "training fwd | onnxruntime",
    "backward": "backward | torch cpu autograd",
    "NHWC training fwd": "NHWC training fwd | torch cpu",
    "NHWC backward": "NHWC backward | torch cpu autograd",
}
Fn = Callable[[], object]


def _inputs(shape: tuple[int, ...], seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    c = shape[1]
    return {
        "X": rng.normal(0.5, 2.0, size=shape).astype(np.float32),
        "dY": rng.normal(size=shape).astype(np.float32),
        "scale": rng.uniform(0.5, 2.0, c).astype(np.float32),
        "B": rng.normal(size=c).astype(np.float32),
        "mean": rng.normal(size=c).astype(np.float32),
        "var": rng.uniform(0.5, 2.0, c).astype(np.float32),
    }


def _ort_session(shape: tuple[int, ...], training: bool) -> onnxruntime.InferenceSession:
    c = shape[1]
    outputs = ["Y", "running_mean", "running_var"] if training else ["Y"]
    node = helper.make_node(
        "BatchNormalization",
        ["X", "scale", "B", "mean", "var"],
        outputs,
        epsilon=EPS,
        momentum=MOMENTUM,
        training_mode=int(training),
    )
    inputs = [helper.make_tensor_value_info("X", TensorProto.FLOAT, shape)] + [
        helper.make_tensor_value_info(n, TensorProto.FLOAT, (c,)) for n in ("scale", "B", "mean", "var")
    ]
    graph = helper.make_graph(
        [node], "bn", inputs, [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in outputs]
    )
    model = ort_compatible(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 15)]))
    return onnxruntime.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])


def _numpy_forward_training(x: np.ndarray, scale: np.ndarray, bias: np.ndarray) -> np.ndarray:
    """Plain vectorized NumPy float32 (the baseline the C kernels replace)."""
    mean = x.mean(axis=(0, 2, 3), keepdims=True)
    var = x.var(axis=(0, 2, 3), keepdims=True)
    return (x - mean) / np.sqrt(var + EPS) * scale[:, None, None] + bias[:, None, None]


def _numpy_backward(dy: np.ndarray, x: np.ndarray, scale: np.ndarray, mean: np.ndarray, inv_std: np.ndarray):
    m = x.size // x.shape[1]
    x_hat = (x - mean[:, None, None]) * inv_std[:, None, None]
    dbias = dy.sum(axis=(0, 2, 3))
    dscale = (dy * x_hat).sum(axis=(0, 2, 3))
    k = (scale * inv_std)[:, None, None]
    return k * (dy - dbias[:, None, None] / m - x_hat * dscale[:, None, None] / m), dscale, dbias


def _cpu_contenders(shape: tuple[int, ...]) -> dict[str, Fn]:
    d = _inputs(shape)
    x, dy, scale, bias, mean, var = d["X"], d["dY"], d["scale"], d["B"], d["mean"], d["var"]
    params = (scale, bias, mean, var)
    nchw, nhwc = BatchNormConfig(epsilon=EPS, momentum=MOMENTUM), BatchNormConfig(epsilon=EPS, axis=-1)
    x_last, dy_last = np.ascontiguousarray(x.transpose(0, 2, 3, 1)), np.ascontiguousarray(dy.transpose(0, 2, 3, 1))
    train_out = TrainingOutputs(np.empty_like(x), *(np.empty_like(scale) for _ in range(5)))
    train_last = TrainingOutputs(np.empty_like(x_last), *(np.empty_like(scale) for _ in range(5)))
    y_out = np.empty_like(x)
    grad_out = GradOutputs(np.empty_like(x), np.empty_like(scale), np.empty_like(scale))
    grad_last = GradOutputs(np.empty_like(x_last), np.empty_like(scale), np.empty_like(scale))
    saved = cpu.forward_training(x, *params, nchw)
    saved_last = cpu.forward_training(x_last, *params, nhwc)
    ort_inf, ort_train = _ort_session(shape, False), _ort_session(shape, True)
    feed = {k: v for k, v in d.items() if k != "dY"}
    fns: dict[str, Fn] = {
        "inference | bnfuse cpu": lambda: cpu.forward_inference(x, *params, nchw, out=y_out),
        "inference | onnxruntime": lambda: ort_inf.run(None, feed),
        "inference | numpy f32": lambda: (
            (x - mean[:, None, None]) / np.sqrt(var[:, None, None] + EPS) * scale[:, None, None] + bias[:, None, None]
        ),
        "training fwd | bnfuse cpu": lambda: cpu.forward_training(x, *params, nchw, out=train_out),
        "training fwd | onnxruntime": lambda: ort_train.run(None, feed),
        "training fwd | numpy f32": lambda: _numpy_forward_training(x, scale, bias),
        "backward | bnfuse cpu": lambda: cpu.backward(
            dy, x, scale, saved.saved_mean, saved.saved_inv_std, nchw, out=grad_out
        ),
        "backward | numpy f32": lambda: _numpy_backward(dy, x, scale, saved.saved_mean, saved.saved_inv_std),
        "NHWC training fwd | bnfuse cpu": lambda: cpu.forward_training(x_last, *params, nhwc, out=train_last),
        "NHWC backward | bnfuse cpu": lambda: cpu.backward(
            dy_last, x_last, scale, saved_last.saved_mean, saved_last.saved_inv_std, nhwc, out=grad_last
        ),
    }
    # Memory-traffic floors: what any implementation must at least move (1 read + 1 write; 2 reads + 1 write).
    floor_out = np.empty_like(x)
    for op in ("inference", "training fwd", "NHWC training fwd"):
        fns[f"{op} | floor: copy x (numpy)"] = lambda: np.copyto(floor_out, x)
    for op in ("backward", "NHWC backward"):
        fns[f"{op} | floor: x + dy (numpy)"] = lambda: np.add(x, dy, out=floor_out)
    fns.update(_torch_contenders(d))
    return fns


def _torch_contenders(d: dict[str, np.ndarray]) -> dict[str, Fn]:
    try:
        import torch
    except ImportError:
        return {}
    fns: dict[str, Fn] = {}
    for tag, fmt in (("", torch.contiguous_format), ("NHWC ", torch.channels_last)):
        x = torch.tensor(d["X"]).contiguous(memory_format=fmt).requires_grad_(True)
        dy = torch.tensor(d["dY"]).contiguous(memory_format=fmt)
        w, b = torch.tensor(d["scale"], requires_grad=True), torch.tensor(d["B"], requires_grad=True)
        rm, rv = torch.tensor(d["mean"]), torch.tensor(d["var"])
        y = torch.nn.functional.batch_norm(x, rm.clone(), rv.clone(), w, b, training=True, momentum=0.1, eps=EPS)

        def forward(x=x, w=w, b=b, rm=rm, rv=rv) -> object:
            with torch.no_grad():
                return torch.nn.functional.batch_norm(x, rm, rv, w, b, training=True, momentum=0.1, eps=EPS)

        def backward(y=y, x=x, w=w, b=b, dy=dy) -> object:
            return torch.autograd.grad(y, (x, w, b), dy, retain_graph=True)

        def inference(x=x, w=w, b=b, rm=rm, rv=rv) -> object:
            with torch.no_grad():
                return torch.nn.functional.batch_norm(x, rm, rv, w, b, training=False, eps=EPS)

        fns[f"{tag}training fwd | torch cpu"] = forward
        fns[f"{tag}backward | torch cpu autograd"] = backward
        if not tag:
            fns["inference | torch cpu"] = inference
    return fns


def _gpu_rows() -> list[list[object]]:
    try:
        import cupy

        if cupy.cuda.runtime.getDeviceCount() == 0:
            raise RuntimeError
    except Exception:  # noqa: BLE001 - no CuPy, driver or device: nothing to measure
        return [[op, "bnfuse cuda", NO_GPU, "", "", "", ""] for op in ("inference", "training fwd", "backward")]
    return _gpu_measured(cupy)


def _gpu_measured(cupy: object) -> list[list[object]]:
    from bnfuse.runtime import cuda

    d = {k: cupy.asarray(v) for k, v in _inputs(SHAPE).items()}
    config = BatchNormConfig(epsilon=EPS)
    params = (d["scale"], d["B"], d["mean"], d["var"])
    saved = cuda.forward_training(d["X"], *params, config)
    fns = {
        "inference": lambda: cuda.forward_inference(d["X"], *params, config),
        "training fwd": lambda: cuda.forward_training(d["X"], *params, config),
        "backward": lambda: cuda.backward(d["dY"], d["X"], d["scale"], saved.saved_mean, saved.saved_inv_std, config),
    }
    rows = []
    for op, fn in fns.items():
        fn()
        samples = []
        for _ in range(20):
            start, stop = cupy.cuda.Event(), cupy.cuda.Event()
            start.record()
            fn()
            stop.record()
            stop.synchronize()
            samples.append(cupy.cuda.get_elapsed_time(start, stop) / 1000)
        rows.append([op, "bnfuse cuda", f"{statistics.median(samples) * 1000:.3f}", "", "", "", ""])
    return rows


def _sweep(repeat: int, quick: bool) -> list[dict[str, object]]:
    series = []
    config = BatchNormConfig(epsilon=EPS)
    for shape in SWEEP[:4] if quick else SWEEP:
        d = _inputs(shape, seed=1)
        x, params = d["X"], (d["scale"], d["B"], d["mean"], d["var"])
        y = np.empty_like(x)
        out = TrainingOutputs(np.empty_like(x), *(np.empty_like(d["scale"]) for _ in range(5)))
        times = interleaved_medians(
            {
                "inference": lambda x=x, p=params, y=y: cpu.forward_inference(x, *p, config, out=y),
                "training": lambda x=x, p=params, o=out: cpu.forward_training(x, *p, config, out=o),
            },
            repeat=repeat,
            warmup=2,
        )
        moved = 2 * x.nbytes  # read x, write y: the least any implementation moves
        series.append(
            {
                "shape": list(shape),
                "tensor_bytes": x.nbytes,
                "forward_inference_s": times["inference"],
                "forward_training_s": times["training"],
                "inference_GBps": moved / times["inference"] / 1e9,
                "training_GBps": moved / times["training"] / 1e9,
            }
        )
    return series


def _copy_bandwidth_gbs(nbytes: int) -> float:
    """The machine's measured copy bandwidth (read + write) on a tensor of this size: the line a kernel that
    reads x once and writes y once cannot beat."""
    src = np.ones(nbytes // 4, dtype=np.float32)
    dst = np.empty_like(src)
    seconds = median_seconds(lambda: np.copyto(dst, src), repeat=9, warmup=2)
    return 2 * nbytes / seconds / 1e9


def _ratio(times: dict[str, float], ours: str, theirs: str) -> float | None:
    return times[ours] / times[theirs] if ours in times and theirs in times else None


def run(quick: bool = False) -> Section:
    shape = QUICK_SHAPE if quick else SHAPE
    repeat = 5 if quick else 15
    contenders = _cpu_contenders(shape)
    times: dict[str, float] = {}
    alone: dict[str, float] = {}
    for op in OPS:
        group = {k: v for k, v in contenders.items() if k.split(" | ")[0] == op}  # round-robin within one op
        times.update(interleaved_medians(group, repeat=repeat, warmup=2))
    for name, fn in contenders.items():  # the same calls back to back: no other library's threads in between
        alone[name] = median_seconds(fn, repeat=repeat, warmup=2)
    rows = []
    for op in OPS:
        ours = f"{op} | bnfuse cpu"
        for name in sorted((k for k in times if k.split(" | ")[0] == op), key=lambda k: k != ours):
            mixed, single = _ratio(times, ours, name), _ratio(alone, ours, name)
            rows.append(
                [
                    *name.split(" | "),
                    f"{times[name] * 1000:.2f}",
                    f"{mixed:.2f}",
                    f"{alone[name] * 1000:.2f}",
                    f"{single:.2f}",
                    "yes" if TARGET_PEERS[op] == name else "",
                ]
            )
    rows += _gpu_rows()
    header = ["op", "contender", "interleaved ms", "bnfuse / it", "alone ms", "bnfuse / it (alone)", "target peer"]
    table = markdown_table(header, rows)
    targets = []
    for op, limit in (("training fwd", 1.5), ("backward", 0.5)):
        peer = TARGET_PEERS[op]
        if peer in times:
            mixed, single = _ratio(times, f"{op} | bnfuse cpu", peer), _ratio(alone, f"{op} | bnfuse cpu", peer)
            targets.append(
                f"{op} bnfuse / {peer.split(' | ')[1]}: {mixed:.2f} interleaved, {single:.2f} alone (target <= {limit})"
            )
    headline = [
        Target(f"CPU {op} N={shape[0]} C={shape[1]} {how} / {TARGET_PEERS[op].split(' | ')[1]}", ratio, limit)
        for op, limit in (("training fwd", 1.5), ("backward", 0.5))
        for how, measured in (("interleaved", times), ("alone", alone))
        if (ratio := _ratio(measured, f"{op} | bnfuse cpu", TARGET_PEERS[op])) is not None
    ]
    sweep = _sweep(3 if quick else 9, quick)
    sweep_table = markdown_table(
        ["shape", "MB", "inference ms", "training fwd ms", "inference GB/s", "training GB/s"],
        [
            [
                "x".join(map(str, s["shape"])),
                f"{s['tensor_bytes'] / 1e6:.2f}",
                f"{s['forward_inference_s'] * 1000:.3f}",
                f"{s['forward_training_s'] * 1000:.3f}",
                f"{s['inference_GBps']:.1f}",
                f"{s['training_GBps']:.1f}",
            ]
            for s in sweep
        ],
    )
    markdown = "\n\n".join(
        [
            f"x {'x'.join(map(str, shape))} float32 ({np.prod(shape) * 4 / 1e6:.1f} MB), epsilon {EPS}. "
            f"{machine_description()}, onnxruntime {onnxruntime.__version__}, {today()}. "
            f"Medians of {repeat} runs.",
            table,
            "; ".join(targets) + ".",
            "Interleaved: each op's contenders round-robin; alone: each contender's calls back to back. On this "
            "2-core machine onnxruntime's, PyTorch's and the kernels' thread pools disturb one another when "
            "interleaved (a pool still spinning or a worker waiting for its core), so both are listed.",
            "bnfuse cpu kernels against tensor size (GB/s counts one read of x and one write of y):",
            sweep_table,
        ]
    )
    return Section(
        title="BN kernels: CPU speed against onnxruntime and PyTorch",
        command="python -m bench.bench_kernels" + (" --quick" if quick else ""),
        markdown=markdown,
        series={
            # run_all plots these: time against bytes moved, beside the machine's copy bandwidth line
            "kernel_sweep": {
                "bnfuse cpu inference": [(2 * s["tensor_bytes"], s["forward_inference_s"]) for s in sweep],
                "bnfuse cpu training fwd": [(2 * s["tensor_bytes"], s["forward_training_s"]) for s in sweep],
            },
            "bandwidth_gbs": _copy_bandwidth_gbs(max(s["tensor_bytes"] for s in sweep)),
            "sweep_rows": sweep,
            "interleaved_median_s": times,
            "alone_median_s": alone,
        },
        targets=headline,
    )


if __name__ == "__main__":
    bench_main(run, __doc__.splitlines()[0])
