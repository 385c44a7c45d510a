"""Is a float32 mismatch only activation-boundary flips? Replay the float32 training graph with the float64 masks.

    nice -n 10 python bench/mask_replay.py rexnet_100 [--size 64] [--batch 4] [--portable] [--lr 0.001]

A ReLU / ReLU6 input within float32 rounding of 0 or 6 can take the other side in a float32 run; on a small map one
flipped element moves a BN's gradient by 10-30%, so a correct graph can be far from PyTorch float64 (and from
PyTorch float32, which flips other elements or none). This script builds the float32 training graph with unfused
activations (every mask is then a Cast of a boolean comparison, the ReLU / Clip rules', or a Where's boolean
condition, the LeakyRelu / Elu / HardSwish rules'), runs one SGD step in onnxruntime (NCHWc off and on: the
TrainingSession rewrite) twice: as built, and with every mask fed from the float64 graph's run
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


def mask_values(model: onnx.ModelProto) -> list[str]:
    """The values that pick an element's side of an activation's kink in the gradient rules: the float masks (a Cast
    of a boolean comparison: the ReLU / Clip rules') and the boolean conditions of Where nodes (the LeakyRelu / Elu /
    HardSwish rules')."""
    producer = {o: n for n in model.graph.node for o in n.output}

    def boolean(name: str) -> bool:
        return getattr(producer.get(name), "op_type", "") in BOOLEAN

    names = []
    for n in model.graph.node:
        if n.op_type == "Cast" and n.input and boolean(n.input[0]):
            names.append(n.output[0])
        elif n.op_type == "Where" and n.input and boolean(n.input[0]):
            names.append(n.input[0])
    return list(dict.fromkeys(names))


def matched_masks(graph32: onnx.ModelProto, graph64: onnx.ModelProto) -> dict[str, str]:
    """The float32 graph's masks (mask_values) by the name their value has in the float64 graph. The two graphs come
    from two exports, and the names onnx-ad generates (greater_175 / greater_173) differ between them: a mask is
    matched by what it computes (its comparisons, down to the exporter's named values and constants' values)."""
    by_key = {_mask_key(graph64, name): name for name in mask_values(graph64)}
    matched = {name: by_key.get(_mask_key(graph32, name)) for name in mask_values(graph32)}
    return {name: other for name, other in matched.items() if other is not None}


def _mask_key(model: onnx.ModelProto, name: str) -> tuple:
    producer = {o: n for n in model.graph.node for o in n.output}
    constants = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer if t.name}
    for node in model.graph.node:
        if node.op_type == "Constant" and node.attribute and node.attribute[0].name == "value":
            constants[node.output[0]] = numpy_helper.to_array(node.attribute[0].t)

    def key(value: str) -> tuple:
        if value in constants and constants[value].size <= 16:  # generated constants: by value, at float32
            return ("constant", tuple(np.asarray(constants[value], np.float32).ravel().tolist()))
        node = producer.get(value)
        if node is not None and (node.op_type in BOOLEAN or node.op_type == "Cast"):
            return (node.op_type, *(key(i) for i in node.input))
        return ("value", value)

    return key(name)


def as_mask(value: np.ndarray) -> np.ndarray:
    """A float64 run's mask as the float32 graph takes it: a float mask in float32, a boolean one as it is."""
    return value if value.dtype == np.bool_ else value.astype(np.float32)


def mask_output(name: str, value: np.ndarray) -> onnx.ValueInfoProto:
    """A graph output (or input) declaration for the mask ``name`` of ``value``'s type."""
    elem = onnx.TensorProto.BOOL if value.dtype == np.bool_ else onnx.TensorProto.FLOAT
    return helper.make_tensor_value_info(name, elem, list(value.shape))


def with_mask_inputs(model: onnx.ModelProto, masks: dict[str, np.ndarray]) -> onnx.ModelProto:
    """A copy whose masks named in ``masks`` (mask_values) are graph inputs instead of computed."""
    result = onnx.ModelProto()
    result.CopyFrom(model)
    nodes = [n for n in result.graph.node if not any(o in masks for o in n.output)]
    result.graph.ClearField("node")
    result.graph.node.extend(nodes)
    result.graph.input.extend(mask_output(name, value) for name, value in masks.items())
    return result


def one_step(
    model: onnx.ModelProto,
    x: np.ndarray,
    y: np.ndarray,
    extra: dict,
    nchwc: bool,
    watch: dict[str, np.ndarray],
    lr: float = LR,
) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """The state after one step in onnxruntime (plain InferenceSession: the masks are extra inputs), and the values
    of the ``watch`` tensors (made graph outputs, of the types of the values ``watch`` maps them to)."""
    import onnxruntime

    from bnfuse.passes.training.spec import read_spec
    from bnfuse.runtime import session_options
    from bnfuse.training.session import nchwc_block, nchwc_convs

    spec = read_spec(model)
    graph = onnx.ModelProto()
    graph.CopyFrom(model)
    graph.graph.output.extend(mask_output(n, value) for n, value in watch.items())
    if nchwc:
        nchwc_convs(graph, nchwc_block())
    session = onnxruntime.InferenceSession(
        graph.SerializeToString(), session_options(["CPUExecutionProvider"]), providers=["CPUExecutionProvider"]
    )
    initial = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    feeds = {spec.data[0]: x, spec.targets[0]: y, spec.lr: np.array(lr, np.float32)}
    feeds |= {name: initial[name] for name in spec.state} | extra
    names = list(spec.state.values()) + list(watch)
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
        m: as_mask(trainer.intermediates[m64])
        for m, m64 in matched_masks(graph32, graph64).items()
        if m64 in trainer.intermediates
    }
    reference = float64_check.torch_runs(net, [(x.astype(np.float64), y)], lr)[0].state
    ref32 = archs.torch_steps(net, [(x, y)], lr, torch.float32).state
    torch32 = float64_check.worst(ref32, reference)[0]
    rows = []
    for nchwc in (False, True):
        for replayed in (False, True):
            graph = with_mask_inputs(graph32, masks) if replayed else graph32
            state, seen = one_step(graph, x, y, masks if replayed else {}, nchwc, {} if replayed else masks, lr)
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
