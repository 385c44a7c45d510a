"""Run by test_native.py in a fresh interpreter that never imports bnfuse: steps a bnfuse training graph by hand
with plain onnxruntime and the library at argv[1], from the graph file alone (metadata bnfuse.training: inputs by
role, state input -> output pairs, initial state as initializers), and saves the losses and the final state."""

from __future__ import annotations

import json
import sys

import numpy as np
import onnx
import onnxruntime as ort
from onnx import numpy_helper


def main() -> None:
    library, graph, batches, out = sys.argv[1:5]
    model = onnx.load(graph)
    spec = json.loads(next(p.value for p in model.metadata_props if p.key == "bnfuse.training"))
    state = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer if t.name in spec["state"]}
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    options.register_custom_ops_library(library)
    session = ort.InferenceSession(graph, options, providers=["CPUExecutionProvider"])
    data = np.load(batches)
    names = list(spec["state"])
    fetch = [spec["loss"], *(spec["state"][n] for n in names)]
    losses = []
    for step in range(int(data["steps"])):
        feeds = {spec["data"][0]: data[f"x{step}"], spec["targets"][0]: data[f"y{step}"], spec["lr"]: data["lr"]}
        loss, *updated = session.run(fetch, {**feeds, **state})
        losses.append(float(loss))
        state = dict(zip(names, updated, strict=True))  # each output feeds its input back next step
    np.savez(out, losses=np.array(losses), **{f"state_{i}": state[n] for i, n in enumerate(names)})
    print("bnfuse imported:", any(m == "bnfuse" or m.startswith("bnfuse.") for m in sys.modules))


if __name__ == "__main__":
    main()
