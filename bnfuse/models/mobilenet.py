"""MobileNetV2 (torchvision layout): inverted residuals with depthwise 3x3 convs and ReLU6 (Clip).

3,504,872 trainable parameters at width 1. ReLU6 is Clip with min / max inputs from opset 11 and
attributes before it.
"""

from __future__ import annotations

import onnx

from bnfuse.models.builder import GraphBuilder, make_divisible
from bnfuse.models.common import Options

# expansion t, output channels c, repeats n, first stride s
SETTINGS = ((1, 16, 1, 1), (6, 24, 2, 2), (6, 32, 3, 2), (6, 64, 4, 2), (6, 96, 3, 1), (6, 160, 3, 2), (6, 320, 1, 1))
CLASSES = 1000


def mobilenetv2(
    *,
    batch: int | None = None,
    size: int = 224,
    width: float = 1.0,
    seed: int = 0,
    opset: int = 17,
    dtype: str = "float32",
) -> onnx.ModelProto:
    """MobileNetV2: depthwise convs, ReLU6 (Clip), 3.5 M parameters at width 1."""
    options = Options(batch, size, width, seed, opset, dtype).check("mobilenetv2", min_size=32)
    g = options.builder("mobilenetv2")
    channels = make_divisible(32 * width)
    last = make_divisible(1280 * max(1.0, width))
    x = g.relu6(g.batchnorm(g.conv("input", 3, channels, 3, stride=2), channels))
    for t, c, n, s in SETTINGS:
        out = make_divisible(c * width)
        for index in range(n):
            x = _inverted_residual(g, x, channels, out, s if index == 0 else 1, t)
            channels = out
    x = g.relu6(g.batchnorm(g.conv(x, channels, last, 1, pad=0), last))
    logits = g.linear(g.global_pool_flatten(x), last, CLASSES)
    return g.model(
        [options.batch_dim, 3, size, size],
        logits,
        [options.batch_dim, CLASSES],
        doc="MobileNetV2 (bnfuse.models), random weights",
        metadata=options.metadata("mobilenetv2"),
    )


def _inverted_residual(g: GraphBuilder, x: str, c_in: int, c_out: int, stride: int, expand: int) -> str:
    hidden = c_in * expand
    y = x
    if expand != 1:
        y = g.relu6(g.batchnorm(g.conv(y, c_in, hidden, 1, pad=0), hidden))
    y = g.relu6(g.batchnorm(g.conv(y, hidden, hidden, 3, stride=stride, group=hidden), hidden))
    y = g.batchnorm(g.conv(y, hidden, c_out, 1, pad=0), c_out)
    return g.add(x, y) if stride == 1 and c_in == c_out else y
