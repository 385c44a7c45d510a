"""A U-Net (Ronneberger et al.) with ConvTranspose upsampling followed by BatchNormalization.

Encoder: (Conv3x3 -> BN -> ReLU) x 2 then MaxPool, four times; decoder: ConvTranspose(2, stride 2) ->
BN -> ReLU, concatenation with the skip, (Conv3x3 -> BN -> ReLU) x 2; a 1x1 Conv head (per-pixel classes).
"""

from __future__ import annotations

import onnx

from bnfuse.models.builder import GraphBuilder, scaled
from bnfuse.models.common import Options

FEATURES = (64, 128, 256, 512)
CLASSES = 2


def unet(
    *,
    batch: int | None = None,
    size: int = 128,
    width: float = 1.0,
    seed: int = 0,
    opset: int = 17,
    dtype: str = "float32",
) -> onnx.ModelProto:
    """U-Net segmenter [batch, 3, size, size] -> [batch, 2, size, size] (size a multiple of 16)."""
    options = Options(batch, size, width, seed, opset, dtype).check("unet", min_size=16, multiple=16)
    g = options.builder("unet")
    features = [scaled(f, width) for f in FEATURES]
    x, channels, skips = "input", 3, []
    for f in features:
        x = _double_conv(g, x, channels, f)
        skips.append((x, f))
        x, channels = g.max_pool(x, 2, 2), f
    bottom = features[-1] * 2
    x, channels = _double_conv(g, x, channels, bottom), bottom
    for skip, f in reversed(skips):
        up = g.relu(g.batchnorm(g.conv_transpose(x, channels, f, 2, stride=2, bias=False), f))
        x, channels = _double_conv(g, g.concat([skip, up]), 2 * f, f), f
    logits = g.conv(x, channels, CLASSES, 1, pad=0, bias=True)
    return g.model(
        [options.batch_dim, 3, size, size],
        logits,
        [options.batch_dim, CLASSES, size, size],
        doc="U-Net with ConvTranspose + BN upsampling (bnfuse.models), random weights",
        metadata=options.metadata("unet"),
    )


def _double_conv(g: GraphBuilder, x: str, c_in: int, c_out: int) -> str:
    x = g.relu(g.batchnorm(g.conv(x, c_in, c_out, 3), c_out))
    return g.relu(g.batchnorm(g.conv(x, c_out, c_out, 3), c_out))
