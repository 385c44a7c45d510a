"""Host overhead of TrainingSession.step on a tiny MLP: this tree's session.py against another version of it.

The graph is so small (mlp_gemm, 64 features, hidden 64-32-16, batch 8, one onnxruntime thread) that a step is
mostly the Python around onnxruntime's run: feeding the batch and labels, checking their shapes, binding them.
``--before FILE`` is another version of bnfuse/training/session.py (``git show REV:bnfuse/training/session.py >
FILE``), loaded beside this tree's as a module of its own (both import the rest of bnfuse from this tree). Both
sessions run the same training graph in one process, interleaved: blocks of ``--block`` steps in ABBA order, each
pair of blocks one ratio, so the machine's load drifts over both alike. Reported: each one's median per-step time
over its blocks and the median ratio after / before over the pairs.

    git show efcdb94:bnfuse/training/session.py > /tmp/session_before.py
    python bench/step_overhead.py --before /tmp/session_before.py [--pairs 400] [--block 10] [--model resnet18]

``--model resnet18``: the registry's ResNet-18 at width 1/8 on 32x32 images, batch 2 (167 graph inputs where the
MLP has 37: the old step built a name -> input table over every graph input twice). The last line also gives what
building that table once costs on the graph.
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _session_module(path: Path, name: str):  # noqa: ANN202
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", type=Path, required=True, help="another version of bnfuse/training/session.py")
    parser.add_argument("--pairs", type=int, default=400)
    parser.add_argument("--block", type=int, default=10)
    parser.add_argument("--model", choices=["mlp", "resnet18"], default="mlp")
    args = parser.parse_args()

    import numpy as np

    from bnfuse.models import registry
    from bnfuse.passes.training import SGD, build_training_graph
    from bnfuse.training import session as after_module

    before_module = _session_module(args.before, "bnfuse_session_before")
    if args.model == "mlp":
        model, shape = registry.build("mlp_gemm", size=64, width=1 / 16), (8, 64)
    else:
        model, shape = registry.build("resnet18", size=32, width=1 / 8), (2, 3, 32, 32)
    train, _ = build_training_graph(model, optimizer=SGD(momentum=0.9), batch_size=shape[0])
    rng = np.random.default_rng(0)
    x = rng.standard_normal(shape).astype(np.float32)
    labels = rng.integers(0, 10, shape[0])
    sessions = {
        "before": before_module.TrainingSession(train, lr=0.01, intra_op_threads=1),
        "after": after_module.TrainingSession(train, lr=0.01, intra_op_threads=1),
    }
    for session in sessions.values():
        for _ in range(50):
            session.step(x, labels)
    losses = {name: session.step(x, labels) for name, session in sessions.items()}
    assert losses["before"] == losses["after"], losses  # the same steps, bit for bit

    def block(name: str) -> float:
        step = sessions[name].step
        start = time.perf_counter()
        for _ in range(args.block):
            step(x, labels)
        return (time.perf_counter() - start) / args.block

    times: dict[str, list[float]] = {"before": [], "after": []}
    ratios = []
    for index in range(args.pairs):
        order = ("before", "after") if index % 2 == 0 else ("after", "before")  # ABBA
        for name in order:
            times[name].append(block(name))
        ratios.append(times["after"][-1] / times["before"][-1])
    before, after = (statistics.median(times[n]) * 1e6 for n in ("before", "after"))
    quartiles = statistics.quantiles(ratios, n=4)
    ort_session = sessions["after"]._session
    calls = []
    for _ in range(200):
        start = time.perf_counter()
        {i.name: i for i in ort_session.get_inputs()}  # what the old step built twice
        calls.append(time.perf_counter() - start)
    print(
        f"{args.model}: per-step median over {args.pairs} blocks of {args.block}: before {before:.1f} us, after "
        f"{after:.1f} us; ratio after/before median {statistics.median(ratios):.3f} (quartiles {quartiles[0]:.3f}-"
        f"{quartiles[2]:.3f}); the input table over all {len(ort_session.get_inputs())} graph inputs "
        f"{statistics.median(calls) * 1e6:.1f} us"
    )


if __name__ == "__main__":
    main()
