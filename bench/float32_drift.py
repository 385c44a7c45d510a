"""Where does bnfuse's float32 step round worse than PyTorch float32? Gradients and intermediates against float64.

    nice -n 10 python bench/float32_drift.py mnasnet0_5 [--size 64] [--batch 4] [--top 12] [--nchwc]

Per architecture (bench/archs.py): the gradient of every parameter after one forward / backward, in PyTorch float64
(the reference), PyTorch float32 (the yardstick) and bnfuse's float32 training graph (fused ReLU off, static batch)
run in onnxruntime with every activation mask fed from the float64 graph's run (bench/mask_replay.py's approach: no
element is on another side of a kink than in float64, so what is left is rounding alone). The float64 graph runs in
onnx's reference evaluator (bench/float64_check.py), and its gradients are checked against PyTorch float64 first.

Printed: the parameters whose float32 gradient error (relative to the tensor's scale, floor 1e-3) is largest, each
with PyTorch float32's error on the same tensor; then the graph's nodes ranked by how much they grow the error
(error of the output / largest error of a floating input, each against the float64 graph's tensor): the kernel or
rule that rounds worse than its inputs did stands at the top, with its op type.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench import archs, float64_check, mask_replay  # noqa: E402

FLOOR = 1e-12  # relative to the tensor's own scale: gradients are small


def relative(actual: np.ndarray, expected: np.ndarray) -> float:
    return float64_check.relative_error(actual, expected, FLOOR)


def torch_gradients(net, x: np.ndarray, y: np.ndarray, dtype) -> dict[str, np.ndarray]:  # noqa: ANN001
    import torch

    net = float64_check.graph_hyperparameters(net).to(dtype).train()
    with float64_check.one_torch_thread():
        loss = torch.nn.functional.cross_entropy(net(torch.from_numpy(x).to(dtype)), torch.from_numpy(y))
        loss.backward()
    return {k: p.grad.detach().to(torch.float64).numpy() for k, p in net.named_parameters() if p.grad is not None}


def gradient_names(graph) -> dict[str, str]:  # noqa: ANN001
    """parameter input name -> its gradient tensor (the fused SGDStep's (param, grad) pairs)."""
    step = next(n for n in graph.graph.node if n.op_type == "SGDStep")
    pairs = list(step.input)[1:]
    return dict(zip(pairs[0::2], pairs[1::2], strict=True))


def analyse(name: str, size: int, batch: int, top: int, nchwc: bool) -> None:
    import onnx
    import onnxruntime
    import torch
    from onnx import helper, numpy_helper

    from bnfuse.passes.training import build_training_graph, read_spec
    from bnfuse.runtime import session_options
    from bnfuse.training.session import nchwc_block, nchwc_convs

    shape = (batch, 3, size, size)
    net = archs.create(name)
    x, y = archs.batches(shape, 10, 1)[0]
    options = {"batch_size": batch, "static_batch": True, "fuse_relu": False}
    graph32, _ = build_training_graph(archs.export(net, shape), **options)
    _, model64 = float64_check.export64(name, shape)
    graph64, _ = build_training_graph(model64, **options)
    spec = read_spec(graph32)
    trainer = float64_check.ReferenceTrainer(graph64)
    trainer.step([x.astype(np.float64)], [y], 0.0, keep=True)
    values64 = trainer.intermediates
    masks = {
        n.output[0]: values64[n.output[0]].astype(np.float32)
        for n in mask_replay.mask_nodes(graph32)
        if n.output[0] in values64
    }
    graph = mask_replay.with_mask_inputs(graph32, masks)
    state_inits = [t for t in graph.graph.initializer if t.name in spec.state]
    initial = {t.name: numpy_helper.to_array(t) for t in state_inits}
    for t in state_inits:
        graph.graph.initializer.remove(t)
    elem = {
        vi.name: vi.type.tensor_type.elem_type for vi in onnx.shape_inference.infer_shapes(graph32).graph.value_info
    }
    watch = [
        o
        for n in graph.graph.node
        for o in n.output
        if o in values64 and values64[o].dtype == np.float64 and elem.get(o, 1) == onnx.TensorProto.FLOAT
    ]
    known = {o.name for o in graph.graph.output}
    graph.graph.output.extend(
        helper.make_tensor_value_info(o, onnx.TensorProto.FLOAT, None) for o in dict.fromkeys(watch) if o not in known
    )
    if nchwc:
        nchwc_convs(graph, nchwc_block())
    so = session_options(["CPUExecutionProvider"], intra_op_num_threads=1)
    session = onnxruntime.InferenceSession(graph.SerializeToString(), so, providers=["CPUExecutionProvider"])
    feeds = {spec.data[0]: x, spec.targets[0]: y, spec.lr: np.array(0.0, np.float32)} | initial | masks
    names = list(dict.fromkeys(watch))
    values32 = dict(zip(names, session.run(names, feeds), strict=True))

    grads64t = torch_gradients(net, x.astype(np.float64), y, torch.float64)
    grads32t = torch_gradients(net, x, y, torch.float32)
    rows = []
    for param, grad in gradient_names(graph32).items():
        original = spec.original_names.get(param, param)
        if original not in grads64t or grad not in values32:
            continue
        oracle = relative(values64[grad], grads64t[original])
        rows.append((relative(values32[grad], values64[grad]), relative(grads32t[original], grads64t[original]),
                     oracle, original))  # fmt: skip
    rows.sort(reverse=True)
    ratio = [r[0] / max(r[1], 1e-12) for r in rows]
    print(f"## {name} ({size}x{size}, batch {batch}, NCHWc {'on' if nchwc else 'off'}, float64 masks)")
    worst_torch, worst_oracle = max(r[1] for r in rows), max(r[2] for r in rows)
    print(f"worst gradient: bnfuse f32 {rows[0][0]:.1e} ({rows[0][3]}); PyTorch f32 worst {worst_torch:.1e}; "
          f"float64 graph vs PyTorch f64 worst {worst_oracle:.1e}")  # fmt: skip
    print(f"median over {len(rows)} gradients: bnfuse f32 {np.median([r[0] for r in rows]):.1e}, PyTorch f32 "
          f"{np.median([r[1] for r in rows]):.1e}; bnfuse/PyTorch ratio median {np.median(ratio):.2f}, "
          f"max {max(ratio):.1f}")  # fmt: skip
    print("| parameter | bnfuse f32 grad error | PyTorch f32 grad error | float64 graph vs PyTorch f64 |")
    print("|---|---|---|---|")
    for error, torch_error, oracle, original in rows[:top]:
        print(f"| {original} | {error:.1e} | {torch_error:.1e} | {oracle:.1e} |")
    errors = {o: relative(values32[o], values64[o]) for o in names}
    errors |= {k: 0.0 for k in initial} | {spec.data[0]: 0.0}
    growth = []
    for node in graph.graph.node:
        inputs = [errors[i] for i in node.input if i in errors]
        for out in node.output:
            if out in errors and inputs:
                growth.append((errors[out] / max(max(inputs), 1e-8), errors[out], node.op_type, node.name or out))
    growth.sort(reverse=True)
    print("\n| node | op | output error | growth over its inputs' |\n|---|---|---|---|")
    for factor, error, op, node_name in growth[:top]:
        print(f"| {node_name} | {op} | {error:.1e} | {factor:.1f}x |")
    by_op: dict[str, list[float]] = {}
    for factor, _, op, _ in growth:
        by_op.setdefault(op, []).append(factor)
    print("\n| op | nodes | median growth | max growth |\n|---|---|---|---|")
    for op, factors in sorted(by_op.items(), key=lambda kv: -max(kv[1]))[:top]:
        print(f"| {op} | {len(factors)} | {np.median(factors):.1f}x | {max(factors):.1f}x |")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("models", nargs="+")
    parser.add_argument("--size", type=int, default=64)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--top", type=int, default=12)
    parser.add_argument("--nchwc", action="store_true", help="the NCHWc rewrite TrainingSession makes")
    args = parser.parse_args(argv)
    for name in args.models:
        analyse(name, args.size, args.batch, args.top, args.nchwc)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
