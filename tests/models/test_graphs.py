"""onnx-graphsurgeon graphs with the fold pass: gs.export_onnx output into bnfuse.optimize, gs.Graph in and out."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_graphsurgeon as gs
import onnxruntime as ort

import bnfuse
from bnfuse.io import ort_compatible
from bnfuse.models import build, build_graph, optimize_graph, spec


def run(model: onnx.ModelProto, x: np.ndarray) -> np.ndarray:
    session = ort.InferenceSession(ort_compatible(model).SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, {"input": x})[0]


def test_optimize_accepts_a_graphsurgeon_export() -> None:
    graph = build_graph("resnet18", **spec("resnet18").small)
    assert isinstance(graph, gs.Graph)
    exported = gs.export_onnx(graph)
    optimized, report = bnfuse.optimize(exported, check=True)
    assert report.batchnorms_before == 20 and report.batchnorms_after == 0 and report.check.passed


def test_optimize_graph_returns_a_graph_and_leaves_the_input_alone() -> None:
    small = spec("unet").small
    graph = build_graph("unet", **small)
    nodes_before = len(graph.nodes)
    folded, report = optimize_graph(graph, check=True)
    assert isinstance(folded, gs.Graph)
    assert len(graph.nodes) == nodes_before
    assert not [n for n in folded.nodes if n.op == "BatchNormalization"]
    assert report.count("folded") == 22
    x = np.random.default_rng(0).standard_normal((2, 3, 32, 32)).astype(np.float32)
    want = run(build("unet", **small), x)
    got = run(gs.export_onnx(folded), x)
    assert np.abs(want - got).max() <= 1e-4 * np.abs(want).max()


def test_graph_built_with_graphsurgeon_folds() -> None:
    """A network written by hand with gs (Conv -> BN -> Relu), not from the registry."""
    rng = np.random.default_rng(0)
    x = gs.Variable("input", dtype=np.float32, shape=["batch", 4, 8, 8])
    conv_out = gs.Variable("conv_out", dtype=np.float32)
    bn_out = gs.Variable("bn_out", dtype=np.float32)
    y = gs.Variable("output", dtype=np.float32, shape=["batch", 6, 8, 8])
    weight = gs.Constant("w", rng.standard_normal((6, 4, 3, 3)).astype(np.float32))
    params = [
        gs.Constant(n, v.astype(np.float32))
        for n, v in [("s", rng.uniform(0.5, 2, 6)), ("b", rng.normal(0, 1, 6)), ("m", rng.normal(0, 1, 6)),
                     ("v", rng.uniform(0.5, 2, 6))]
    ]  # fmt: skip
    nodes = [
        gs.Node("Conv", inputs=[x, weight], outputs=[conv_out], attrs={"pads": [1, 1, 1, 1]}),
        gs.Node("BatchNormalization", inputs=[conv_out, *params], outputs=[bn_out]),
        gs.Node("Relu", inputs=[bn_out], outputs=[y]),
    ]
    graph = gs.Graph(nodes=nodes, inputs=[x], outputs=[y], opset=17)
    folded, report = optimize_graph(graph, check=True)
    assert [n.op for n in folded.nodes] == ["Conv", "Relu"] and report.check.passed
