"""DenseNet-121 (torchvision layout): pre-activation BN -> ReLU -> Conv layers, most of whose BN cannot fold.

Each dense layer is BN -> ReLU -> Conv1x1 -> BN -> ReLU -> Conv3x3 on the concatenation of every earlier
feature map; transitions are BN -> ReLU -> Conv1x1 -> AvgPool. A pre-activation BN reads a Concat (or a
tensor that also feeds a Concat), not a Conv, so no producer can absorb it: of the 121 BN only the stem's
and the one after each layer's 1x1 conv fold. 7,978,856 trainable parameters at width 1.
"""

from __future__ import annotations

import onnx

from bnfuse.models.builder import GraphBuilder, scaled
from bnfuse.models.common import Options

BLOCKS = (6, 12, 24, 16)
GROWTH = 32
BN_SIZE = 4
CLASSES = 1000


def densenet121(
    *,
    batch: int | None = None,
    size: int = 224,
    width: float = 1.0,
    seed: int = 0,
    opset: int = 17,
    dtype: str = "float32",
) -> onnx.ModelProto:
    """DenseNet-121: growth 32, blocks [6, 12, 24, 16], pre-activation BN (121 BN, 62 unfoldable)."""
    options = Options(batch, size, width, seed, opset, dtype).check("densenet121", min_size=32)
    g = options.builder("densenet121")
    growth = scaled(GROWTH, width)
    channels = 2 * growth
    x = g.relu(g.batchnorm(g.conv("input", 3, channels, 7, stride=2), channels))
    x = g.max_pool(x, 3, 2, pad=1)
    for index, layers in enumerate(BLOCKS):
        features = [x]
        for _ in range(layers):
            joined = features[0] if len(features) == 1 else g.concat(features)
            features.append(_dense_layer(g, joined, channels + growth * (len(features) - 1), growth))
        x = g.concat(features)
        channels += layers * growth
        if index < len(BLOCKS) - 1:
            x = g.conv(g.relu(g.batchnorm(x, channels)), channels, channels // 2, 1, pad=0)
            x, channels = g.avg_pool(x, 2, 2), channels // 2
    logits = g.linear(g.global_pool_flatten(g.relu(g.batchnorm(x, channels))), channels, CLASSES)
    return g.model(
        [options.batch_dim, 3, size, size],
        logits,
        [options.batch_dim, CLASSES],
        doc="DenseNet-121, pre-activation BN (bnfuse.models), random weights",
        metadata=options.metadata("densenet121"),
    )


def _dense_layer(g: GraphBuilder, x: str, c_in: int, growth: int) -> str:
    hidden = BN_SIZE * growth
    y = g.conv(g.relu(g.batchnorm(x, c_in)), c_in, hidden, 1, pad=0)
    return g.conv(g.relu(g.batchnorm(y, hidden)), hidden, growth, 3)
