"""BN bandwidth on a CUDA GPU: bnfuse's CuPy kernels beside a device copy of the same bytes and cuDNN (torch).

One step of bench/gpu_acceptance.py (run there in its own process); alone:

    python bench/gpu_bandwidth.py --json rows.json [--quick] [--rounds 3] [--repeats 10]

For each op (forward training, forward inference, backward), data type (float32, float16, bfloat16), layout
(NCHW; NHWC = channels-last) and shape (ResNet-50's first stage and a large tensor), on the same tensors:

* bnfuse: bnfuse.runtime.cuda with preallocated outputs (as the onnxruntime custom op calls it);
* copy: cudaMemcpyAsync device to device of one data tensor (reads and writes the same bytes as one BN pass);
* cudnn: ``aten::cudnn_batch_norm`` / ``aten::cudnn_batch_norm_backward`` through torch, float32 parameters,
  the same memory (DLPack) and layout (torch sees NHWC data as an NCHW tensor in channels_last format). Where
  cuDNN refuses a case, torch's own kernel (``aten::native_batch_norm``) is timed and the row says so.

All three run on one CUDA stream (CuPy's and torch's current stream set to it) and are timed with CUDA events
around each call: warm-up calls first, then rounds in which the contenders take turns (so clock changes hit
all alike); each figure is the median over every timed call. Bytes counted once each way: forward reads X and
writes Y, backward reads dY and X and writes dX (the least any implementation moves). Every row also gives
the largest difference between bnfuse's and the contender's output (relative to max(1, max |output|)).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

OPS = ("forward_training", "forward_inference", "backward")
DTYPES = ("float32", "float16", "bfloat16")
LAYOUTS = ("NCHW", "NHWC")
SHAPES = {"resnet50 stage 1": (32, 256, 56, 56), "large": (128, 64, 112, 112)}  # NCHW; 103 MB / 411 MB fp32
QUICK_SHAPES = {"resnet50 stage 1 (N=4)": (4, 256, 56, 56), "large (N=8)": (8, 64, 112, 112)}
EPSILON = 1e-5
MOMENTUM = 0.1


@dataclass
class Row:
    op: str
    dtype: str
    layout: str
    shape_name: str
    shape: list[int]  # NCHW
    bytes_moved: int  # the least any implementation reads + writes
    status: str  # "measured", or "not run: <why>"
    bnfuse_ms: float | None = None
    copy_ms: float | None = None
    contender: str | None = None  # "cudnn" or "torch native (cuDNN refused: ...)"
    contender_ms: float | None = None
    bnfuse_gb_per_s: float | None = None
    fraction_of_copy: float | None = None  # bnfuse bandwidth / copy bandwidth (1.0 = as fast as the copy)
    bnfuse_over_contender: float | None = None  # bnfuse time / contender time (< 1: bnfuse faster)
    max_difference: float | None = None  # bnfuse vs contender output, relative to max(1, max |contender|)


def plan(quick: bool) -> list[tuple[str, str, str, str, tuple[int, ...]]]:
    """(op, dtype, layout, shape name, NCHW shape) for every row, in the order they are measured."""
    shapes = QUICK_SHAPES if quick else SHAPES
    return [(op, dt, lay, name, shape) for name, shape in shapes.items() for dt in DTYPES for lay in LAYOUTS
            for op in OPS]  # fmt: skip


def bytes_moved(op: str, shape: tuple[int, ...], itemsize: int) -> int:
    count = 1
    for n in shape:
        count *= n
    return (3 if op == "backward" else 2) * count * itemsize


def summarize(row: Row) -> Row:
    """Derived figures of a measured row."""
    if row.bnfuse_ms is not None:
        row.bnfuse_gb_per_s = row.bytes_moved / (row.bnfuse_ms * 1e-3) / 1e9
        if row.copy_ms is not None:
            copy_bytes = 2 * row.bytes_moved // (3 if row.op == "backward" else 2)
            copy_gbs = copy_bytes / (row.copy_ms * 1e-3) / 1e9
            row.fraction_of_copy = row.bnfuse_gb_per_s / copy_gbs
        if row.contender_ms is not None:
            row.bnfuse_over_contender = row.bnfuse_ms / row.contender_ms
    return row


# -- the torch contender (cuDNN where it takes the case) ------------------------------------------------------


def torch_view(torch: Any, array: Any, layout: str) -> Any:
    """A torch tensor on the same memory, NCHW-shaped (NHWC data: channels_last memory format)."""
    tensor = array if isinstance(array, torch.Tensor) else torch.from_dlpack(array)
    return tensor.permute(0, 3, 1, 2) if layout == "NHWC" else tensor


def torch_contender(torch: Any, op: str, x: Any, dy: Any, params: dict[str, Any]) -> tuple[str, Callable[[], Any]]:
    """(label, call) for ``op`` on NCHW-shaped torch tensors: cuDNN's batch norm, or torch's own kernel where
    cuDNN refuses (tried once here, so a refusal shows before timing). ``call()`` returns the op's data output."""
    aten = torch.ops.aten
    w, b, rm, rv = params["weight"], params["bias"], params["running_mean"], params["running_var"]
    training = op != "forward_inference"

    def cudnn_forward() -> Any:
        return aten.cudnn_batch_norm(x, w, b, rm, rv, training, MOMENTUM, EPSILON)

    def native_forward() -> Any:
        return aten.native_batch_norm(x, w, b, rm, rv, training, MOMENTUM, EPSILON)

    try:
        cudnn_forward()
        forward, label = cudnn_forward, "cudnn"
    except Exception as exc:  # noqa: BLE001 - any refusal (CPU tensor, dtype, layout) falls back, with its reason
        forward, label = native_forward, f"torch native (cuDNN refused: {str(exc).splitlines()[0][:120]})"
    if op != "backward":
        return label, lambda: forward()[0]
    saved = forward()
    if label == "cudnn":
        _, mean, inv_std, reserve = saved
        return label, lambda: aten.cudnn_batch_norm_backward(x, dy, w, rm, rv, mean, inv_std, EPSILON, reserve)[0]
    _, mean, inv_std = saved[:3]
    mask = [True, True, True]
    return label, lambda: aten.native_batch_norm_backward(dy, x, w, rm, rv, mean, inv_std, True, EPSILON, mask)[0]


# -- bnfuse ---------------------------------------------------------------------------------------------------


def bnfuse_call(op: str, x: Any, dy: Any, params: dict[str, Any], layout: str) -> Callable[[], Any]:
    """bnfuse.runtime.cuda on CuPy arrays with preallocated outputs; returns the data output."""
    import cupy

    from bnfuse.runtime import cuda
    from bnfuse.runtime.kernel_types import GradOutputs, TrainingOutputs
    from bnfuse.runtime.semantics import BatchNormConfig

    config = BatchNormConfig(axis=-1 if layout == "NHWC" else 1, epsilon=EPSILON, momentum=MOMENTUM,
                             momentum_convention="pytorch")  # fmt: skip
    scale, bias, rm, rv = (params[k] for k in ("scale", "bias", "running_mean", "running_var"))
    channels = scale.size
    out = cupy.empty_like(x)
    if op == "forward_inference":
        return lambda: cuda.forward_inference(x, scale, bias, rm, rv, config, out=out)
    stats = TrainingOutputs(out, *(cupy.empty(channels, cupy.float32) for _ in range(5)))
    if op == "forward_training":
        return lambda: cuda.forward_training(x, scale, bias, rm, rv, config, out=stats).y
    saved = cuda.forward_training(x, scale, bias, rm, rv, config, out=stats)
    grads = GradOutputs(cupy.empty_like(x), cupy.empty(channels, cupy.float32), cupy.empty(channels, cupy.float32))
    return lambda: cuda.backward(dy, x, scale, saved.saved_mean, saved.saved_inv_std, config, out=grads).dx


# -- timing ---------------------------------------------------------------------------------------------------


def timed_medians(calls: dict[str, Callable[[], Any]], rounds: int, repeats: int, warmup: int) -> dict[str, float]:
    """Median milliseconds per call, CUDA events on the current stream, contenders taking turns each round."""
    import cupy

    for call in calls.values():
        for _ in range(warmup):
            call()
    samples: dict[str, list[tuple[Any, Any]]] = {name: [] for name in calls}
    for _ in range(rounds):
        for name, call in calls.items():
            for _ in range(repeats):
                start, end = cupy.cuda.Event(), cupy.cuda.Event()
                start.record()
                call()
                end.record()
                samples[name].append((start, end))
    cupy.cuda.get_current_stream().synchronize()
    return {name: statistics.median(cupy.cuda.get_elapsed_time(s, e) for s, e in pairs)
            for name, pairs in samples.items()}  # fmt: skip


def _max_difference(torch: Any, ours: Any, theirs: Any, layout: str) -> float:
    a = torch_view(torch, ours, layout).float()
    b = theirs.float()
    return float((a - b).abs().max() / max(1.0, float(b.abs().max())))


def measure(quick: bool, rounds: int, repeats: int, warmup: int, log: Callable[[str], None] = print) -> list[Row]:
    import cupy
    import torch

    rows: list[Row] = []
    stream = cupy.cuda.Stream(non_blocking=False)
    torch_stream = torch.cuda.ExternalStream(stream.ptr)
    with stream, torch.cuda.stream(torch_stream):
        tensors: dict[tuple[str, str, str], tuple[Any, Any]] = {}
        for op, dtype, layout, shape_name, shape in plan(quick):
            itemsize = 4 if dtype == "float32" else 2
            row = Row(op, dtype, layout, shape_name, list(shape), bytes_moved(op, shape, itemsize), "measured")
            try:
                key = (shape_name, dtype, layout)
                if key not in tensors:  # one pair of data tensors per shape / type / layout, shared by the ops
                    tensors.clear()
                    tensors[key] = _data(cupy, torch, shape, dtype, layout)
                x, dy = tensors[key]
                _measure_row(cupy, torch, row, x, dy, layout, rounds, repeats, warmup)
            except Exception as exc:  # noqa: BLE001 - one case failing must not end the others
                row.status = f"not run: {type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"
            rows.append(summarize(row))
            log(format_row(row))
    return rows


def _data(cupy: Any, torch: Any, shape: tuple[int, ...], dtype: str, layout: str) -> tuple[Any, Any]:
    """x and dy as CuPy arrays (NCHW, or NHWC contiguous), random normal data (never zeros)."""
    physical = (shape[0], shape[2], shape[3], shape[1]) if layout == "NHWC" else shape
    generator = torch.Generator(device="cuda").manual_seed(0)
    made = []
    for loc in (0.5, 0.0):
        t = torch.randn(physical, device="cuda", generator=generator).add_(loc).to(getattr(torch, dtype))
        made.append(cupy.from_dlpack(t))  # bfloat16 too, where CuPy has it (else the row says so)
    return made[0], made[1]


def _measure_row(cupy: Any, torch: Any, row: Row, x: Any, dy: Any, layout: str, rounds: int, repeats: int,
                 warmup: int) -> None:  # fmt: skip
    import numpy as np

    channels = row.shape[1]
    rng = np.random.default_rng(1)
    host = {"scale": rng.uniform(0.5, 2.0, channels), "bias": rng.standard_normal(channels),
            "running_mean": rng.standard_normal(channels), "running_var": rng.uniform(0.5, 2.0, channels)}  # fmt: skip
    params = {name: cupy.asarray(value.astype(np.float32)) for name, value in host.items()}
    ours = bnfuse_call(row.op, x, dy, params, layout)
    tp = {"weight": torch.from_dlpack(params["scale"]).clone(), "bias": torch.from_dlpack(params["bias"]).clone(),
          "running_mean": torch.from_dlpack(params["running_mean"]).clone(),
          "running_var": torch.from_dlpack(params["running_var"]).clone()}  # fmt: skip
    tx, tdy = torch_view(torch, x, layout), torch_view(torch, dy, layout)
    row.contender, theirs = torch_contender(torch, row.op, tx, tdy, tp)
    copy_dst = cupy.empty_like(x)

    def copy() -> None:
        copy_dst.data.copy_from_device_async(x.data, x.nbytes)

    times = timed_medians({"bnfuse": ours, "copy": copy, "contender": theirs}, rounds, repeats, warmup)
    row.bnfuse_ms, row.copy_ms, row.contender_ms = times["bnfuse"], times["copy"], times["contender"]
    # forward: both normalize with the batch statistics (training) or the same running ones (inference);
    # backward: each with the saved statistics of its own forward on the same x
    row.max_difference = _max_difference(torch, ours(), theirs(), layout)


def format_row(row: Row) -> str:
    where = f"{row.op:<17} {row.dtype:<8} {row.layout:<4} {row.shape_name:<22}"
    if row.bnfuse_ms is None:
        return f"{where} {row.status}"
    parts = [f"bnfuse {row.bnfuse_ms:.3f} ms {row.bnfuse_gb_per_s:7.1f} GB/s"]
    if row.fraction_of_copy is not None:
        parts.append(f"{row.fraction_of_copy:.2f} of copy")
    if row.bnfuse_over_contender is not None:
        parts.append(f"{row.bnfuse_over_contender:.2f}x {'cuDNN' if row.contender == 'cudnn' else 'torch'}")
    if row.max_difference is not None:
        parts.append(f"diff {row.max_difference:.1e}")
    return f"{where} " + ", ".join(parts)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("--json", type=Path, required=True, help="where to write the rows (JSON list)")
    parser.add_argument("--quick", action="store_true", help="small tensors (a smoke run)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of turns between the contenders")
    parser.add_argument("--repeats", type=int, default=10, help="timed calls per contender per round")
    parser.add_argument("--warmup", type=int, default=3, help="untimed calls per contender first")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    rows = measure(args.quick, max(1, args.rounds), max(1, args.repeats), max(0, args.warmup))
    args.json.write_text(json.dumps([asdict(r) for r in rows], indent=1))
    print(f"{len(rows)} rows in {time.perf_counter() - start:.0f} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
