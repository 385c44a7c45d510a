"""Is a float32 mismatch only activation-boundary flips? Replay the float32 training graph with the float64 masks.

    nice -n 10 python bench/mask_replay.py rexnet_100 [--size 64] [--batch 4] [--portable] [--lr 0.001]

A ReLU / ReLU6 input within float32 rounding of 0 or 6 can take the other side in a float32 run; on a small map one
flipped element moves a BN's gradient by 10-30%, so a correct graph can be far from PyTorch float64 (and from
PyTorch float32, which flips other elements or none). This script builds the float32 training graph with unfused
activations (every mask is then a Cast of a boolean comparison), runs one SGD step in onnxruntime (NCHWc off and
on: the TrainingSession rewrite) twice: as built, and with every mask fed from the float64 graph's run
(bench/float64_check.py), and counts the mask elements the float32 run set otherwise. If the error against
PyTorch float64 drops to float32 rounding with the float64 masks, the flips were the whole difference.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import onnx
from onnx import helper, numpy_helper

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import archs, float64_check  # noqa: E402

BOOLEAN = {"Greater", "Less", "And", "Or", "Not", "GreaterOrEqual", "LessOrEqual", "Equal"}
LR = 0.05


def mask_nodes(model: onnx.ModelProto) -> list[onnx.NodeProto]:
    """The Cast nodes that turn a boolean comparison into a float mask (the ReLU / Clip / ... gradient rules')."""
    producer = {o: n for n in model.graph.node for o in n.output}
    return [
        n
        for n in model.graph.node
        if n.op_type == "Cast" and n.input and getattr(producer.get(n.input[0]), "op_type", "") in BOOLEAN
    ]


def with_mask_inputs(model: onnx.ModelProto, masks: dict[str, np.ndarray]) -> onnx.ModelProto:
    """A copy whose mask Casts named in ``masks`` are graph inputs instead."""
    result = onnx.ModelProto()
    result.CopyFrom(model)
    nodes = [n for n in result.graph.node if not (n.op_type == "Cast" and n.output[0] in masks)]
    result.graph.ClearField("node")
    result.graph.node.extend(nodes)
    for name, value in masks.items():
        result.graph.input.append(helper.make_tensor_value_info(name, onnx.TensorProto.FLOAT, list(value.shape)))
    return result


def one_step(
    model: onnx.ModelProto,
    x: np.ndarray,
    y: np.ndarray,
    extra: dict,
    nchwc: bool,
    watch: list[str],
    lr: float = LR,
) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """The state after one step in onnxruntime (plain InferenceSession: the masks are extra inputs), and the values
    of the ``watch`` tensors (made graph outputs)."""
    import onnxruntime

    from bnfuse.passes.training.spec import read_spec
    from bnfuse.runtime import session_options
    from bnfuse.training.session import nchwc_block, nchwc_convs

    spec = read_spec(model)
    graph = onnx.ModelProto()
    graph.CopyFrom(model)
    graph.graph.output.extend(helper.make_tensor_value_info(n, onnx.TensorProto.FLOAT, None) for n in watch)
    if nchwc:
        nchwc_convs(graph, nchwc_block())
    session = onnxruntime.InferenceSession(
        graph.SerializeToString(), session_options(["CPUExecutionProvider"]), providers=["CPUExecutionProvider"]
    )
    initial = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    feeds = {spec.data[0]: x, spec.targets[0]: y, spec.lr: np.array(lr, np.float32)}
    feeds |= {name: initial[name] for name in spec.state} | extra
    names = list(spec.state.values()) + watch
    values = dict(zip(names, session.run(names, feeds), strict=True))
    return {spec.original_names.get(k, k): values[v] for k, v in spec.state.items()}, {n: values[n] for n in watch}


def replay(name: str, size: int, batch: int, portable: bool = False, lr: float = LR) -> list[dict]:
    import torch

    from bnfuse.passes.training import build_training_graph

    shape = (batch, 3, size, size)
    net = archs.create(name)
    model32 = archs.export(net, shape)
    _, model64 = float64_check.export64(name, shape)
    x, y = archs.batches(shape, 10, 1)[0]
    options = {"batch_size": batch, "static_batch": True, "fuse_relu": False, "portable": portable}
    graph32, _ = build_training_graph(model32, **options)
    graph64, _ = build_training_graph(model64, **options)
    trainer = float64_check.ReferenceTrainer(graph64)
    trainer.step([x.astype(np.float64)], [y], lr, keep=True)
    masks = {
        n.output[0]: trainer.intermediates[n.output[0]].astype(np.float32)
        for n in mask_nodes(graph32)
        if n.output[0] in trainer.intermediates
    }
    reference = float64_check.torch_runs(net, [(x.astype(np.float64), y)], lr)[0].state
    ref32 = archs.torch_steps(net, [(x, y)], lr, torch.float32).state
    torch32 = float64_check.worst(ref32, reference)[0]
    rows = []
    for nchwc in (False, True):
        for replayed in (False, True):
            graph = with_mask_inputs(graph32, masks) if replayed else graph32
            state, seen = one_step(graph, x, y, masks if replayed else {}, nchwc, [] if replayed else list(masks), lr)
            flips = sum(int(np.sum(seen[n] != masks[n])) for n in seen)  # mask elements float32 set otherwise
            error, tensor = float64_check.worst(state, reference)
            rows.append(
                {"model": name + " (portable)" * portable, "nchwc": nchwc, "float64 masks": replayed,
                 "masks": len(masks), "error": error, "tensor": tensor, "torch32": torch32, "flips": flips}
            )  # fmt: skip
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("models", nargs="+")
    parser.add_argument("--size", type=int, default=64)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--portable", action="store_true", help="the portable graph (standard ONNX BN ops)")
    parser.add_argument("--lr", type=float, default=LR, help="the SGD step's learning rate (default 0.05)")
    args = parser.parse_args(argv)
    print(
        "| model | NCHWc | masks | flipped mask elements | 1-step error vs PyTorch f64 (tensor) | PyTorch f32's |\n"
        "|---|---|---|---|---|---|"
    )
    for name in args.models:
        for row in replay(name, args.size, args.batch, args.portable, args.lr):
            masks = f"from float64 ({row['masks']} tensors)" if row["float64 masks"] else "float32 (as built)"
            print(
                f"| {row['model']} | {'on' if row['nchwc'] else 'off'} | {masks} | "
                f"{row['flips'] if not row['float64 masks'] else '-'} | {row['error']:.1e} "
                f"({row['tensor']}) | {row['torch32']:.1e} |",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
