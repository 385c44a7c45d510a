"""PyTorch twins of the training tests' networks (torch is the oracle; imported only where installed).

Loaded by path from the tests (pytest runs with --import-mode=importlib), after importorskip("torch").
"""

from __future__ import annotations

import io
import warnings

import numpy as np
import onnx
import torch
from torch import nn


class Block(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.c1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.b1 = nn.BatchNorm2d(cout)
        self.c2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.b2 = nn.BatchNorm2d(cout)
        self.down = None
        if stride != 1 or cin != cout:
            self.down = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.relu(self.b1(self.c1(x)))
        y = self.b2(self.c2(y))
        return torch.relu(y + (x if self.down is None else self.down(x)))


class ResNet(nn.Module):
    """conv-BN-ReLU stem, an identity block, a strided block with a downsample, global pool, linear head."""

    def __init__(self, width: int = 8, classes: int = 10) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, width, 3, 1, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU())
        self.layer1 = Block(width, width, 1)
        self.layer2 = Block(width, 2 * width, 2)
        self.fc = nn.Linear(2 * width, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.layer2(self.layer1(self.stem(x)))
        return self.fc(torch.flatten(nn.functional.adaptive_avg_pool2d(x, 1), 1))


class MLP(nn.Module):
    def __init__(self, features: int = 12, hidden: int = 16, classes: int = 5) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(features, hidden),
            nn.BatchNorm1d(hidden),
            nn.ReLU(),
            nn.Linear(hidden, hidden),
            nn.BatchNorm1d(hidden),
            nn.ReLU(),
            nn.Linear(hidden, classes),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def randomize_bn(net: nn.Module, seed: int, momentum: float | None = 0.1) -> nn.Module:
    """Non-trivial BN parameters and statistics (also keeps the exporter from deduplicating them)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for module in net.modules():
            if isinstance(module, nn.modules.batchnorm._BatchNorm):
                n = module.num_features
                module.weight.copy_(0.5 + torch.rand(n, generator=gen))
                module.bias.copy_(0.2 * torch.randn(n, generator=gen))
                module.running_mean.copy_(0.1 * torch.randn(n, generator=gen))
                module.running_var.copy_(0.5 + torch.rand(n, generator=gen))
                module.momentum = momentum
    return net


def export(net: nn.Module, example: torch.Tensor, training: bool = False) -> onnx.ModelProto:
    """The eval-mode ONNX model with BatchNormalization kept as nodes (not folded into Conv); ``training``:
    exported from ``net.train()`` with TrainingMode.TRAINING (BN nodes with training_mode=1; the trace updates
    the net's running statistics, and the file holds the updated ones)."""
    net.train(training)
    buffer = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(
            net,
            example,
            buffer,
            dynamo=False,
            opset_version=17,
            training=torch.onnx.TrainingMode.TRAINING if training else torch.onnx.TrainingMode.PRESERVE,
            do_constant_folding=False,
            input_names=["x"],
            output_names=["y"],
        )
    return onnx.load_from_string(buffer.getvalue())


def make(kind: str, seed: int = 0, momentum: float | None = 0.1) -> tuple[nn.Module, tuple[int, ...]]:
    torch.manual_seed(seed)
    if kind == "resnet":
        return randomize_bn(ResNet(), seed, momentum), (4, 3, 8, 8)
    if kind == "convzoo":
        return randomize_bn(ConvZoo(), seed, momentum), (4, 3, 11, 11)
    if kind == "conv1d":
        return randomize_bn(Conv1dNet(), seed, momentum), (4, 3, 13)
    if kind == "conv3d":
        return randomize_bn(Conv3dNet(), seed, momentum), (2, 2, 3, 7, 7)
    return randomize_bn(MLP(), seed, momentum), (8, 12)


def batches(shape: tuple[int, ...], classes: int, steps: int, seed: int = 1) -> list[tuple[np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(seed)
    return [
        (rng.standard_normal(shape).astype(np.float32), rng.integers(0, classes, shape[0]).astype(np.int64))
        for _ in range(steps)
    ]


def train_torch(
    net: nn.Module,
    data: list[tuple[np.ndarray, np.ndarray]],
    *,
    lr: float,
    momentum: float = 0.0,
    weight_decay: float = 0.0,
    frozen_bn: bool = False,
    adam: bool = False,
    nesterov: bool = False,
    bn_momentum: float | None = None,
    fix_gamma: bool = False,
    groups: list[tuple[set[str], dict]] | None = None,
) -> list[float]:
    """``bn_momentum`` (PyTorch convention) replaces the BN momentum the net was exported with;
    ``fix_gamma``: BN weight 1 and not trained (MXNet's fix_gamma), set after export; ``groups``: SGD
    parameter groups (SGD or Adam) as (parameter names, options such as lr / weight_decay), covering every
    parameter."""
    net.train()
    for module in net.modules():
        if isinstance(module, nn.modules.batchnorm._BatchNorm):
            if bn_momentum is not None:
                module.momentum = bn_momentum
            if fix_gamma:
                with torch.no_grad():
                    module.weight.fill_(1.0)
                module.weight.requires_grad_(False)
    if frozen_bn:
        for module in net.modules():
            if isinstance(module, nn.modules.batchnorm._BatchNorm):
                module.eval()
    params = list(net.parameters())
    if groups is not None:
        named = dict(net.named_parameters())
        assert set(named) == set().union(*(names for names, _ in groups)), "groups must cover every parameter"
        params = [{"params": [named[n] for n in sorted(names)], **options} for names, options in groups]
    if adam:
        opt = torch.optim.Adam(params, lr=lr, weight_decay=weight_decay)
    else:
        opt = torch.optim.SGD(params, lr=lr, momentum=momentum, weight_decay=weight_decay, nesterov=nesterov)
    losses = []
    for x, labels in data:
        opt.zero_grad()
        loss = nn.functional.cross_entropy(net(torch.from_numpy(x)), torch.from_numpy(labels))
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    return losses


def bn_weights(net: nn.Module) -> set[str]:
    """State-dict names of the BN weights (scales)."""
    return {f"{name}.weight" for name, m in net.named_modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)}


def state(net: nn.Module) -> dict[str, np.ndarray]:
    """Parameters and running statistics by their ONNX initializer names."""
    return {k: v.detach().numpy().copy() for k, v in net.state_dict().items() if not k.endswith("num_batches_tracked")}


class ConvZoo(nn.Module):
    """Conv variants the fast Conv rule must get right: bias, ReLU6 (Clip), depthwise, grouped + dilated,
    MaxPool, ConvTranspose, an unpadded strided 5x5 on an odd-sized map."""

    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 8, 3, padding=1, bias=True),
            nn.BatchNorm2d(8),
            nn.ReLU6(),
            nn.Conv2d(8, 8, 3, stride=2, padding=1, groups=8, bias=False),
            nn.BatchNorm2d(8),
            nn.ReLU(),
            nn.Conv2d(8, 16, 3, padding=2, dilation=2, groups=2, bias=False),
            nn.BatchNorm2d(16),
            nn.MaxPool2d(2, ceil_mode=True),
            nn.ConvTranspose2d(16, 8, 2, stride=2),
            nn.BatchNorm2d(8),
            nn.ReLU(),
            nn.Conv2d(8, 12, 5, stride=2, bias=False),
            nn.BatchNorm2d(12),
            nn.ReLU(),
        )
        self.fc = nn.Linear(12, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.flatten(nn.functional.adaptive_avg_pool2d(self.features(x), 1), 1))


class Conv1dNet(nn.Module):
    """1-D: strided, grouped + dilated, ConvTranspose1d with output_padding."""

    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv1d(3, 8, 5, stride=2, padding=2),
            nn.BatchNorm1d(8),
            nn.ReLU(),
            nn.Conv1d(8, 8, 3, groups=4, dilation=2, padding=2, bias=False),
            nn.BatchNorm1d(8),
            nn.ConvTranspose1d(8, 4, 3, stride=2, padding=1, output_padding=1),
            nn.BatchNorm1d(4),
            nn.ReLU(),
        )
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.flatten(nn.functional.adaptive_avg_pool1d(self.features(x), 1), 1))


class Conv3dNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv3d(2, 4, 3, stride=(1, 2, 2), padding=1, bias=False),
            nn.BatchNorm3d(4),
            nn.ReLU(),
            nn.Conv3d(4, 8, (1, 3, 3), groups=2, bias=False),
            nn.BatchNorm3d(8),
            nn.ReLU(),
        )
        self.fc = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.flatten(nn.functional.adaptive_avg_pool3d(self.features(x), 1), 1))
