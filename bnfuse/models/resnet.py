"""ResNet-18 and ResNet-50 (torchvision's v1.5 layout: stride on the 3x3 conv of a bottleneck).

At width 1 the trainable parameters (conv weights, BN scale and bias, fc) are exactly the published
counts: 11,689,512 and 25,557,032.
"""

from __future__ import annotations

import onnx

from bnfuse.models.builder import GraphBuilder, scaled
from bnfuse.models.common import Options

STAGES = {"resnet18": ("basic", (2, 2, 2, 2)), "resnet50": ("bottleneck", (3, 4, 6, 3))}
PLANES = (64, 128, 256, 512)
CLASSES = 1000


def resnet18(
    *,
    batch: int | None = None,
    size: int = 224,
    width: float = 1.0,
    seed: int = 0,
    opset: int = 17,
    dtype: str = "float32",
) -> onnx.ModelProto:
    """ResNet-18: basic blocks [2, 2, 2, 2], 11.7 M parameters at width 1."""
    return _resnet("resnet18", Options(batch, size, width, seed, opset, dtype))


def resnet50(
    *,
    batch: int | None = None,
    size: int = 224,
    width: float = 1.0,
    seed: int = 0,
    opset: int = 17,
    dtype: str = "float32",
) -> onnx.ModelProto:
    """ResNet-50: bottleneck blocks [3, 4, 6, 3], 25.6 M parameters (~100 MB float32) at width 1."""
    return _resnet("resnet50", Options(batch, size, width, seed, opset, dtype))


def _resnet(name: str, options: Options) -> onnx.ModelProto:
    options.check(name, min_size=32)
    kind, blocks = STAGES[name]
    expansion = 4 if kind == "bottleneck" else 1
    g = options.builder(name)
    stem = scaled(64, options.width)
    x = g.relu(g.batchnorm(g.conv("input", 3, stem, 7, stride=2), stem))
    x = g.max_pool(x, 3, 2, pad=1)
    channels = stem
    for stage, (planes, count) in enumerate(zip(PLANES, blocks, strict=True)):
        planes = scaled(planes, options.width)
        for index in range(count):
            stride = 2 if stage > 0 and index == 0 else 1
            block = _bottleneck if kind == "bottleneck" else _basic
            x = block(g, x, channels, planes, stride)
            channels = planes * expansion
    logits = g.linear(g.global_pool_flatten(x), channels, CLASSES)
    return g.model(
        [options.batch_dim, 3, options.size, options.size],
        logits,
        [options.batch_dim, CLASSES],
        doc=f"{name} (bnfuse.models), random weights",
        metadata=options.metadata(name),
    )


def _shortcut(g: GraphBuilder, x: str, c_in: int, c_out: int, stride: int) -> str:
    if stride == 1 and c_in == c_out:
        return x
    return g.batchnorm(g.conv(x, c_in, c_out, 1, stride=stride, pad=0), c_out)


def _basic(g: GraphBuilder, x: str, c_in: int, planes: int, stride: int) -> str:
    y = g.relu(g.batchnorm(g.conv(x, c_in, planes, 3, stride=stride), planes))
    y = g.batchnorm(g.conv(y, planes, planes, 3), planes)
    return g.relu(g.add(y, _shortcut(g, x, c_in, planes, stride)))


def _bottleneck(g: GraphBuilder, x: str, c_in: int, planes: int, stride: int) -> str:
    out = planes * 4
    y = g.relu(g.batchnorm(g.conv(x, c_in, planes, 1, pad=0), planes))
    y = g.relu(g.batchnorm(g.conv(y, planes, planes, 3, stride=stride), planes))
    y = g.batchnorm(g.conv(y, planes, out, 1, pad=0), out)
    return g.relu(g.add(y, _shortcut(g, x, c_in, out, stride)))
