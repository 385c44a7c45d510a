"""The registry of model builders: name -> (builder, description), and build / write / count helpers."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import onnx
from onnx import numpy_helper

from bnfuse.errors import BnfuseError
from bnfuse.models.convnd import audio1d, r3d18
from bnfuse.models.densenet import densenet121
from bnfuse.models.digits import digits_cnn
from bnfuse.models.mlp import mlp_gemm, mlp_matmul
from bnfuse.models.mobilenet import mobilenetv2
from bnfuse.models.resnet import resnet18, resnet50
from bnfuse.models.unet import unet

Builder = Callable[..., onnx.ModelProto]


@dataclass(frozen=True)
class ModelSpec:
    name: str
    builder: Builder
    description: str
    size: int  # default input size (pixels, samples or features)
    unit: str  # what size measures
    small: dict[str, object] = field(default_factory=dict)  # options of a quick, small variant (tests)


_SPECS = (
    ModelSpec(
        "resnet18", resnet18, "ResNet-18, basic blocks, 11.7 M parameters", 224, "pixels", {"size": 64, "width": 0.25}
    ),
    ModelSpec(
        "resnet50",
        resnet50,
        "ResNet-50, bottleneck blocks, 25.6 M parameters (~100 MB)",
        224,
        "pixels",
        {"size": 64, "width": 0.25},
    ),
    ModelSpec(
        "mobilenetv2",
        mobilenetv2,
        "MobileNetV2, depthwise convs, ReLU6 as Clip",
        224,
        "pixels",
        {"size": 64, "width": 0.5},
    ),
    ModelSpec(
        "densenet121",
        densenet121,
        "DenseNet-121, pre-activation BN -> ReLU -> Conv",
        224,
        "pixels",
        {"size": 32, "width": 0.25},
    ),
    ModelSpec("unet", unet, "U-Net, ConvTranspose -> BN upsampling", 128, "pixels", {"size": 32, "width": 0.25}),
    ModelSpec("audio1d", audio1d, "M5-style 1-D CNN on raw audio", 16000, "samples", {"size": 2048, "width": 0.25}),
    ModelSpec(
        "r3d18",
        r3d18,
        "3-D ResNet-18 on 16-frame video clips",
        112,
        "pixels",
        {"size": 16, "width": 0.125, "frames": 4},
    ),
    ModelSpec("mlp_gemm", mlp_gemm, "MLP, Gemm -> BatchNorm1d -> ReLU", 784, "features", {"size": 64, "width": 0.25}),
    ModelSpec(
        "mlp_matmul",
        mlp_matmul,
        "MLP, MatMul + Add -> BatchNorm1d -> ReLU",
        784,
        "features",
        {"size": 64, "width": 0.25},
    ),
    ModelSpec("digits_cnn", digits_cnn, "small CNN for 8x8 digits (the C host example)", 8, "pixels", {"size": 8}),
)
REGISTRY: dict[str, ModelSpec] = {s.name: s for s in _SPECS}


def names() -> list[str]:
    return list(REGISTRY)


def spec(name: str) -> ModelSpec:
    try:
        return REGISTRY[name]
    except KeyError:
        raise BnfuseError(f"unknown model {name!r} (known: {', '.join(REGISTRY)})") from None


def build(name: str, **options: object) -> onnx.ModelProto:
    """Build a registered model; options: batch, size, width, seed, opset, dtype (and builder-specific ones)."""
    builder = spec(name).builder
    try:
        return builder(**options)
    except TypeError as exc:  # an option this builder does not take
        raise BnfuseError(f"{name}: {exc}") from exc


def write(name: str, path: str | os.PathLike[str], **options: object) -> tuple[onnx.ModelProto, Path]:
    """Build a model, run the full onnx checker on it, and save it atomically."""
    from bnfuse.io import save_model
    from bnfuse.passes.optimize import validate

    model = build(name, **options)
    validate(model, what=name, full=True)
    return model, save_model(model, path)


def parameter_count(model: onnx.ModelProto, *, statistics: bool = False) -> int:
    """Trainable elements of the model's initializers: what PyTorch calls the parameter count.

    BN running mean / variance (buffers in PyTorch) count only with ``statistics``; Clip bounds never.
    """
    skip: set[str] = set()
    for node in model.graph.node:
        if node.op_type == "BatchNormalization" and not statistics:
            skip.update(node.input[3:5])
        elif node.op_type == "Clip":
            skip.update(node.input[1:])
    return sum(_elements(t) for t in model.graph.initializer if t.name not in skip)


def parameter_bytes(model: onnx.ModelProto) -> int:
    return sum(len(t.raw_data) or numpy_helper.to_array(t).nbytes for t in model.graph.initializer)


def _elements(tensor: onnx.TensorProto) -> int:
    count = 1
    for dim in tensor.dims:
        count *= dim
    return count
