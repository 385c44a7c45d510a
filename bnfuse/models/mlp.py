"""Multi-layer perceptrons with BatchNorm1d after each hidden dense layer, in two exporter dialects.

mlp_gemm: Gemm (PyTorch Linear) -> BatchNormalization -> ReLU; mlp_matmul: MatMul + Add (TensorFlow /
Keras Dense) -> BatchNormalization -> ReLU. Input [batch, size features], output [batch, 10].
"""

from __future__ import annotations

from collections.abc import Callable

import onnx

from bnfuse.models.builder import GraphBuilder, scaled
from bnfuse.models.common import Options

HIDDEN = (1024, 512, 256)
CLASSES = 10


def mlp_gemm(
    *,
    batch: int | None = None,
    size: int = 784,
    width: float = 1.0,
    seed: int = 0,
    opset: int = 17,
    dtype: str = "float32",
) -> onnx.ModelProto:
    """MLP of Gemm -> BatchNorm1d -> ReLU layers (PyTorch export)."""
    return _mlp("mlp_gemm", Options(batch, size, width, seed, opset, dtype), GraphBuilder.linear)


def mlp_matmul(
    *,
    batch: int | None = None,
    size: int = 784,
    width: float = 1.0,
    seed: int = 0,
    opset: int = 17,
    dtype: str = "float32",
) -> onnx.ModelProto:
    """MLP of MatMul + Add -> BatchNorm1d -> ReLU layers (TensorFlow / Keras export)."""
    return _mlp("mlp_matmul", Options(batch, size, width, seed, opset, dtype), GraphBuilder.matmul_add)


def _mlp(name: str, options: Options, dense: Callable[..., str]) -> onnx.ModelProto:
    options.check(name, min_size=1)
    g = options.builder(name, spatial_dims=0)
    x, features = "input", options.size
    for hidden in HIDDEN:
        hidden = scaled(hidden, options.width)
        x = g.relu(g.batchnorm(dense(g, x, features, hidden, he=True), hidden))
        features = hidden
    logits = dense(g, x, features, CLASSES)
    return g.model(
        [options.batch_dim, options.size],
        logits,
        [options.batch_dim, CLASSES],
        doc=f"{name} (bnfuse.models), random weights",
        metadata=options.metadata(name),
    )
