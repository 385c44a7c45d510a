"""A small CNN for 8 x 8 one-channel images (scikit-learn's digits): the network of the C host example.

Three Conv -> BN -> ReLU layers (16, 32, 64 channels; a 2 x 2 MaxPool after the second), global average pooling
and a linear layer to 10 classes; input [batch, 1, size, size], output [batch, 10]. The same layers as
bench/bench_digits.py's PyTorch CNN.
"""

from __future__ import annotations

import onnx

from bnfuse.models.builder import scaled
from bnfuse.models.common import Options

CHANNELS = (16, 32, 64)
CLASSES = 10


def digits_cnn(
    *,
    batch: int | None = None,
    size: int = 8,
    width: float = 1.0,
    seed: int = 0,
    opset: int = 17,
    dtype: str = "float32",
) -> onnx.ModelProto:
    """Conv-BN-ReLU x 3 with a MaxPool, global pooling, Gemm to 10 classes."""
    options = Options(batch, size, width, seed, opset, dtype).check("digits_cnn", min_size=2, multiple=2)
    g = options.builder("digits_cnn")
    x, channels = "input", 1
    for index, out in enumerate(scaled(c, options.width) for c in CHANNELS):
        x = g.relu(g.batchnorm(g.conv(x, channels, out, 3), out))
        if index == 1:
            x = g.max_pool(x, 2, 2)
        channels = out
    logits = g.linear(g.global_pool_flatten(x), channels, CLASSES)
    return g.model(
        [options.batch_dim, 1, options.size, options.size],
        logits,
        [options.batch_dim, CLASSES],
        doc="digits_cnn (bnfuse.models), random weights",
        metadata=options.metadata("digits_cnn"),
    )
