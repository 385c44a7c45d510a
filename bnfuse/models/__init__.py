"""Realistic test networks written directly as ONNX, with seeded random weights and non-trivial BN statistics.

    from bnfuse.models import build, names
    model = build("resnet50", width=0.5, size=128, dtype="float16")

Every builder takes batch (None: dynamic), size, width, seed, opset (default 17) and dtype (float32 /
float16); the result passes onnx's full checker and runs in onnxruntime.
"""

from bnfuse.models.graphs import build_graph, optimize_graph
from bnfuse.models.registry import (
    REGISTRY,
    ModelSpec,
    build,
    names,
    parameter_bytes,
    parameter_count,
    spec,
    write,
)

__all__ = [
    "REGISTRY",
    "ModelSpec",
    "build",
    "build_graph",
    "names",
    "optimize_graph",
    "parameter_bytes",
    "parameter_count",
    "spec",
    "write",
]
