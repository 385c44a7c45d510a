"""Convolutional networks beyond 2-D: a 1-D audio network on raw waveforms and a 3-D video ResNet.

audio1d follows M5 (Dai et al., "Very deep convolutional neural networks for raw waveforms"): a wide
strided first conv over the samples, then 3-tap convs, each Conv -> BN -> ReLU -> MaxPool(4).
r3d18 is torchvision's 3-D ResNet-18 (video classification, Kinetics-400 head).
"""

from __future__ import annotations

import onnx

from bnfuse.models.builder import GraphBuilder, scaled
from bnfuse.models.common import Options

AUDIO_CHANNELS = (128, 128, 256, 512)
AUDIO_CLASSES = 35  # Speech Commands
VIDEO_PLANES = (64, 128, 256, 512)
VIDEO_CLASSES = 400  # Kinetics-400


def audio1d(
    *,
    batch: int | None = None,
    size: int = 16000,
    width: float = 1.0,
    seed: int = 0,
    opset: int = 17,
    dtype: str = "float32",
) -> onnx.ModelProto:
    """M5-style 1-D CNN on raw audio [batch, 1, size samples] (size >= 1024)."""
    options = Options(batch, size, width, seed, opset, dtype).check("audio1d", min_size=1024)
    g = options.builder("audio1d", spatial_dims=1)
    x, channels = "input", 1
    for index, out in enumerate(AUDIO_CHANNELS):
        out = scaled(out, width)
        if index == 0:
            x = g.conv(x, channels, out, 80, stride=4, pad=38)
        else:
            x = g.conv(x, channels, out, 3)
        x = g.max_pool(g.relu(g.batchnorm(x, out)), 4, 4)
        channels = out
    logits = g.linear(g.global_pool_flatten(x), channels, AUDIO_CLASSES)
    return g.model(
        [options.batch_dim, 1, size],
        logits,
        [options.batch_dim, AUDIO_CLASSES],
        doc="M5-style 1-D audio CNN (bnfuse.models), random weights",
        metadata=options.metadata("audio1d"),
    )


def r3d18(
    *,
    batch: int | None = None,
    size: int = 112,
    width: float = 1.0,
    seed: int = 0,
    opset: int = 17,
    dtype: str = "float32",
    frames: int = 16,
) -> onnx.ModelProto:
    """3-D ResNet-18 on video clips [batch, 3, frames, size, size]."""
    options = Options(batch, size, width, seed, opset, dtype).check("r3d18", min_size=16)
    frames = max(1, int(frames))
    g = options.builder("r3d18", spatial_dims=3)
    stem = scaled(64, width)
    x = g.relu(g.batchnorm(g.conv("input", 3, stem, (3, 7, 7), stride=(1, 2, 2), pad=(1, 3, 3)), stem))
    channels = stem
    for stage, planes in enumerate(VIDEO_PLANES):
        planes = scaled(planes, width)
        for index in range(2):
            x = _basic3d(g, x, channels, planes, 2 if stage > 0 and index == 0 else 1)
            channels = planes
    logits = g.linear(g.global_pool_flatten(x), channels, VIDEO_CLASSES)
    return g.model(
        [options.batch_dim, 3, frames, size, size],
        logits,
        [options.batch_dim, VIDEO_CLASSES],
        doc="3-D ResNet-18 video CNN (bnfuse.models), random weights",
        metadata=options.metadata("r3d18", frames=frames),
    )


def _basic3d(g: GraphBuilder, x: str, c_in: int, planes: int, stride: int) -> str:
    y = g.relu(g.batchnorm(g.conv(x, c_in, planes, 3, stride=stride), planes))
    y = g.batchnorm(g.conv(y, planes, planes, 3), planes)
    shortcut = x
    if stride != 1 or c_in != planes:
        shortcut = g.batchnorm(g.conv(x, c_in, planes, 1, stride=stride, pad=0), planes)
    return g.relu(g.add(y, shortcut))
