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


class ForcedActivation:
    """ReLU / ReLU6 modules that record their decisions (which side of each kink) in one run and replay them in
    another: PyTorch float32 with PyTorch float64's activation masks (each module's calls in order)."""

    def __init__(self) -> None:
        self.recorded: dict[str, list] = {}
        self.replaying = False

    def install(self, net):  # noqa: ANN001, ANN201
        import torch

        owner = self

        class Forced(torch.nn.Module):
            def __init__(self, name: str, upper: float | None) -> None:
                super().__init__()
                self.key, self.upper, self.calls = name, upper, 0

            def forward(self, x):  # noqa: ANN001, ANN202
                if not owner.replaying:
                    inside = x > 0 if self.upper is None else (x > 0) & (x < self.upper)
                    above = torch.zeros_like(inside) if self.upper is None else x >= self.upper
                    owner.recorded.setdefault(self.key, []).append((inside.detach().cpu(), above.detach().cpu()))
                else:
                    inside, above = owner.recorded[self.key][self.calls]
                    self.calls += 1
                out = x * inside.to(x.dtype)
                return out if self.upper is None else out + above.to(x.dtype) * self.upper

        for parent_name, parent in list(net.named_modules()):
            for child_name, child in list(parent.named_children()):
                if type(child) in (torch.nn.ReLU, torch.nn.ReLU6):
                    upper = 6.0 if isinstance(child, torch.nn.ReLU6) else None
                    setattr(parent, child_name, Forced(f"{parent_name}.{child_name}", upper))
        return net


def torch_gradients(net, x: np.ndarray, y: np.ndarray, dtype, forced=None) -> dict[str, np.ndarray]:  # noqa: ANN001
    """Parameter gradients of one forward / backward in ``dtype`` (train mode, the graph's hyperparameters); with
    ``forced`` (a ForcedActivation), ReLU / ReLU6 record their masks, or replay them once recorded."""
    import torch

    net = float64_check.graph_hyperparameters(net)
    if forced is not None:
        net = forced.install(net)
    net = net.to(dtype).train()
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
    matched = mask_replay.matched_masks(graph32, graph64)
    masks = {m: mask_replay.as_mask(values64[m64]) for m, m64 in matched.items() if m64 in values64}
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
    # the same graph as it runs (its own masks, NCHWc as chosen): its gradients and the mask elements it flips
    free = onnx.ModelProto()
    free.CopyFrom(graph32)
    for t in [t for t in free.graph.initializer if t.name in spec.state]:
        free.graph.initializer.remove(t)
    grads = list(gradient_names(graph32).values())
    free.graph.output.extend(helper.make_tensor_value_info(o, onnx.TensorProto.FLOAT, None) for o in grads)
    free.graph.output.extend(mask_replay.mask_output(m, v) for m, v in masks.items())
    if nchwc:
        nchwc_convs(free, nchwc_block())
    session = onnxruntime.InferenceSession(free.SerializeToString(), so, providers=["CPUExecutionProvider"])
    free_feeds = {k: v for k, v in feeds.items() if k not in masks}
    free_values = dict(zip(grads + list(masks), session.run(grads + list(masks), free_feeds), strict=True))
    bnfuse_flips = sum(int(np.sum(free_values[m] != v)) for m, v in masks.items())

    forced = ForcedActivation()
    grads64t = torch_gradients(net, x.astype(np.float64), y, torch.float64, forced)
    forced.replaying = True
    grads32t = torch_gradients(net, x, y, torch.float32, forced)  # with PyTorch float64's masks
    watcher = ForcedActivation()  # as PyTorch float32 runs (its own flips), its masks recorded
    grads32_free = torch_gradients(net, x, y, torch.float32, watcher)
    torch_flips = sum(
        int(((a[0] != b[0]) | (a[1] != b[1])).sum())
        for key in forced.recorded
        for a, b in zip(forced.recorded[key], watcher.recorded.get(key, []), strict=False)
    )
    # errors relative to a tensor's scale, at least 1e-4 of the largest gradient (a BN bias followed by another BN has
    # a zero gradient in exact arithmetic: its float32 value is pure rounding, as large in PyTorch as in bnfuse)
    floor = 1e-4 * max(float(np.max(np.abs(g))) for g in grads64t.values())
    rows = []
    for param, grad in gradient_names(graph32).items():
        original = spec.original_names.get(param, param)
        if original not in grads64t or grad not in values32:
            continue
        want = grads64t[original]

        def rel(value: np.ndarray, want: np.ndarray = want) -> float:
            return float64_check.relative_error(value, want, floor)

        rows.append((rel(values32[grad]), rel(grads32t[original]), rel(grads32_free[original]), rel(values64[grad]),
                     original, rel(free_values[grad])))  # fmt: skip
    rows.sort(reverse=True)
    ratio = [r[0] / max(r[1], 1e-12) for r in rows]
    print(f"## {name} ({size}x{size}, batch {batch}, NCHWc {'on' if nchwc else 'off'}, float64 masks)")
    print(
        f"gradients: {len(rows)}; worst error (relative to the tensor's scale, floor 1e-4 of the largest gradient):"
        f" bnfuse f32 {rows[0][0]:.1e} ({rows[0][4]}), PyTorch f32 with f64 masks {max(r[1] for r in rows):.1e}, "
        f"PyTorch f32 as it runs {max(r[2] for r in rows):.1e}, float64 graph {max(r[3] for r in rows):.1e}"
    )
    print(
        f"median: bnfuse f32 {np.median([r[0] for r in rows]):.1e}, PyTorch f32 with f64 masks "
        f"{np.median([r[1] for r in rows]):.1e}, as it runs {np.median([r[2] for r in rows]):.1e}; "
        f"bnfuse / PyTorch (both with f64 masks) per gradient: median {np.median(ratio):.2f}, max {max(ratio):.1f}"
    )
    print("| parameter | bnfuse f32 (f64 masks) | PyTorch f32 (f64 masks) | PyTorch f32 (own) | float64 graph |")
    print("|---|---|---|---|---|")
    for error, forced_error, free_error, oracle, original, _ in rows[:top]:
        print(f"| {original} | {error:.1e} | {forced_error:.1e} | {free_error:.1e} | {oracle:.1e} |")
    print(
        f"as they run (own masks): bnfuse f32 worst {max(r[5] for r in rows):.1e}, median "
        f"{np.median([r[5] for r in rows]):.1e}, {bnfuse_flips} mask elements flipped against float64; PyTorch f32 "
        f"worst {max(r[2] for r in rows):.1e}, median {np.median([r[2] for r in rows]):.1e}, {torch_flips} flipped"
    )
    worst_ratio = sorted(zip(ratio, (r[4] for r in rows), strict=True), reverse=True)[:5]
    print("largest bnfuse / PyTorch ratios: " + ", ".join(f"{n} {q:.1f}x" for q, n in worst_ratio))
    # the two graphs come from two exports: a generated name can stand for different values in each
    names = [o for o in names if values32[o].shape == values64[o].shape]
    errors = {o: relative(values32[o], values64[o]) for o in names}
    errors |= {k: 0.0 for k in initial} | {spec.data[0]: 0.0}
    scales = {o: float(np.max(np.abs(values64[o]))) if values64[o].size else 0.0 for o in names}
    growth = []
    for node in graph.graph.node:
        inputs = [errors[i] for i in node.input if i in errors]
        largest = max((scales.get(i, 0.0) for i in node.input), default=0.0)
        for out in node.output:
            if out in errors and inputs and scales[out] > 1e-4 * largest:  # not a cancellation by design
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
