"""Real torchvision / timm architectures for the training pass: import, export, and PyTorch's reference steps.

Used by tests/passes/training/test_architectures.py (a handful in CI) and bench/bench_architectures.py (the
table in RESULTS.md). torch, torchvision and timm come from the ``oracle`` extra.

torchvision from the package index is built against the CUDA torch wheel: its ``_C`` extension (nms, roi_align,
deform_conv2d, ...) does not load beside the CPU torch build, and ``import torchvision`` then fails with
``operator torchvision::nms does not exist`` (two of its fake-tensor registrations assume the ops exist). None of
the classification models use those ops, so ``import_torchvision`` declares the two schemas (no kernels) through
torch.library before the import; torchvision's ops stay unavailable, its models import and run.
"""

from __future__ import annotations

import io
import warnings
from dataclasses import dataclass
from typing import Any

import numpy as np
import onnx

# torchvision.models names, then timm.create_model names
TORCHVISION = (
    "resnet18",
    "resnet50",
    "mobilenet_v2",
    "mobilenet_v3_small",
    "mnasnet0_5",
    "shufflenet_v2_x0_5",
    "efficientnet_b0",
    "regnet_x_400mf",
    "regnet_y_400mf",
    "densenet121",
    "resnext50_32x4d",
)
TIMM = (
    "mobilenetv3_small_050",
    "tinynet_a",
    "mixnet_s",
    "hardcorenas_a",
    "regnety_002",
    "regnetx_002",
    "resnet26d",
    "resnest14d",
    "ghostnet_050",
    "rexnet_100",
    "hrnet_w18_small",
    "dpn68",
    "dla34",
    "lcnet_050",
    "mobilenetv2_050",
    "resnet18d",
    "seresnet18",
    "ese_vovnet19b_dw",
    "selecsls42b",
    "fbnetc_100",
    "spnasnet_100",
    "semnasnet_050",
    "efficientnet_lite0",
    "mobilevit_xxs",
)


HEAVY = ("resnet50", "resnext50_32x4d", "densenet121", "dpn68")  # slowest to train here: run last
ALL = [n for n in TIMM + TORCHVISION if n not in HEAVY] + list(HEAVY)


def import_torchvision() -> Any:
    """torchvision, importable beside the CPU torch build (see the module docstring)."""
    import torch

    if not hasattr(torch.ops.torchvision, "nms"):
        global _LIBRARY
        try:
            _LIBRARY = torch.library.Library("torchvision", "DEF")
            _LIBRARY.define("nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
            _LIBRARY.define("qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
        except RuntimeError:  # torchvision's own library loaded (a matching build): nothing to declare
            pass
    import torchvision

    return torchvision


_LIBRARY: Any = None


def create(name: str, seed: int = 0, classes: int = 10) -> Any:
    """The architecture, random init from ``seed``, in eval mode, float32."""
    import torch

    torchvision = import_torchvision()
    torch.manual_seed(seed)
    if name in TORCHVISION:
        net = getattr(torchvision.models, name)(num_classes=classes)
    else:
        import timm

        try:
            net = timm.create_model(name, pretrained=False, num_classes=classes, drop_rate=0.0, drop_path_rate=0.0)
        except TypeError:  # a model without stochastic depth
            net = timm.create_model(name, pretrained=False, num_classes=classes, drop_rate=0.0)
    for module in net.modules():  # an eval-mode export has no dropout: the reference must train without it too
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
        if type(module).__name__ == "StochasticDepth":  # torchvision's drop path (EfficientNet): random in train mode
            module.p = 0.0
    return net.eval()


def export(net: Any, shape: tuple[int, ...], dtype: Any = None) -> onnx.ModelProto:
    """The TorchScript exporter's inference model with BN kept (docs/exporting.md), input "x", output "y"."""
    import torch

    example = torch.zeros(shape, dtype=dtype or torch.float32)
    buffer = io.BytesIO()
    net.eval()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(
            net,
            (example,),
            buffer,
            dynamo=False,
            opset_version=17,
            training=torch.onnx.TrainingMode.PRESERVE,
            do_constant_folding=False,
            input_names=["x"],
            output_names=["y"],
        )
    return onnx.load_from_string(buffer.getvalue())


def batches(shape: tuple[int, ...], classes: int, steps: int, seed: int = 1) -> list[tuple[np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(seed)
    return [
        (rng.standard_normal(shape).astype(np.float32), rng.integers(0, classes, shape[0]).astype(np.int64))
        for _ in range(steps)
    ]


@dataclass
class TorchRun:
    losses: list[float]
    state: dict[str, np.ndarray]  # state_dict after the steps (no num_batches_tracked)


def torch_steps(net: Any, data: list[tuple[np.ndarray, np.ndarray]], lr: float, dtype: Any = None) -> TorchRun:
    """Plain SGD steps of ``net`` (a copy, in ``dtype``: float64 by default) in training mode."""
    import copy

    import torch

    dtype = dtype or torch.float64
    net = copy.deepcopy(net).to(dtype).train()
    opt = torch.optim.SGD(net.parameters(), lr=lr)
    losses = []
    for x, labels in data:
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(net(torch.from_numpy(x).to(dtype)), torch.from_numpy(labels))
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    state = {
        k: v.detach().to(torch.float64).numpy().copy()
        for k, v in net.state_dict().items()
        if not k.endswith("num_batches_tracked")
    }
    return TorchRun(losses, state)


SCALE_FLOOR = 1e-3  # statistics of zero-mean channels are ~0 in exact arithmetic, float32 rounding in float32


def relative_error(actual: np.ndarray, expected: np.ndarray, floor: float = SCALE_FLOOR) -> float:
    """max |actual - expected| / max |expected| over the tensor (a tensor's scale, not each element's), the scale
    at least ``floor`` (a tensor that is 0 in exact arithmetic is held to an absolute error floor * rtol)."""
    actual, expected = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    return float(np.max(np.abs(actual - expected))) / max(float(np.max(np.abs(expected))), floor)
