"""The grammar of bench/fuzz_training.py: random PyTorch CNNs from the layers real networks are made of.

A ``Recipe`` is the global choices (exporter, dynamic or static batch, graph variant, input size) and a list of
steps, each ``(op, seed)``: dropping a step keeps every other step's draws (the minimizer relies on it). ``build``
turns a recipe into an ``nn.Module`` (eval mode, float32, non-trivial BN parameters and statistics); ``export``
writes its inference ONNX model with either exporter. A step that does not fit the current shape is skipped.

Steps: conv (kernel 1/3/5, stride, dilation, groups / depthwise, padding zeros / reflect / replicate / circular,
bias), convT (transposed, output_padding, groups), residual (identity or a strided 1x1 downsample), concat (of
branches, or with the input itself), preact (BN -> act -> conv), se (squeeze-excite, sigmoid or hardsigmoid gate),
pool (max / avg, ceil_mode, count_include_pad, padding), widepool (the same at stride 3, kernel 2-4), shuffle
(channel shuffle by view / transpose / reshape),
upsample (nearest / bilinear), act, bn, bn1d (BatchNorm1d on the (N, C, L) view), dropout (train-mode p = 0: an
eval export has none). Every conv-like step is followed by a BN of a drawn flavour and a drawn activation; the
head is global pooling, flatten (``torch.flatten`` or ``x.view(x.size(0), -1)``) and Linear, or Linear ->
BatchNorm1d -> act -> Linear.

BN flavours: affine (PyTorch's default, momentum drawn), noaffine (``affine=False``), cumulative
(``momentum=None``), frozen (a BN kept in eval mode inside the training module: its running statistics normalize,
its weight and bias train; built with ``frozen_bn`` naming its node). ``Recipe.replace`` swaps drawn features for
supported ones after the draw (the fuzzer's attribution of a failure to a known category): "noaffine" and
"cumulative" flavours become "affine", "size0" reshapes become "-1" reshapes, "ceilpad" turns ceil_mode off in a
pool whose last ceil_mode window would start in the end padding.
"""

from __future__ import annotations

import copy
import io
import warnings
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import onnx
import torch
from torch import nn

OPS = ("conv", "conv", "conv", "convT", "residual", "residual", "concat", "preact", "se", "pool", "pool",
       "widepool", "shuffle", "upsample", "act", "bn", "bn1d", "dropout")  # fmt: skip
ACTIVATIONS = ("relu", "relu", "relu6", "gelu", "gelu_tanh", "silu", "hardswish", "tanh", "elu", "leaky_relu", "none")
FLAVOURS = {"affine": 0.88, "noaffine": 0.04, "cumulative": 0.04, "frozen": 0.04}  # per BN
EXPORTERS = ("torchscript", "dynamo")
VARIANTS = ("default", "default", "default", "portable", "relu-unfused", "optimizer-unfused")
CLASSES = 5
MAX_WIDTH = 16


@dataclass
class Recipe:
    """A network: global choices and the steps, each with its own seed (so dropping one keeps the others)."""

    exporter: str
    dynamic: bool  # the export has a dynamic batch dimension (and the graph keeps it)
    variant: str  # a key of bench/float64_check.VARIANTS-like options (``options``)
    batch: int
    channels: int
    side: int
    head: str  # "linear" or "bn1d"
    head_seed: int
    steps: list[tuple[str, int]]
    replace: list[str] = field(default_factory=list)  # features swapped for supported ones (module docstring)
    unbiased_explicit: bool = False  # pass unbiased_running_var=True (PyTorch's estimator, also its default)

    def describe(self) -> str:
        steps = " -> ".join(op for op, _ in self.steps) or "(none)"
        batch = "dynamic" if self.dynamic else "static"
        swapped = f" replace={','.join(self.replace)}" if self.replace else ""
        swapped += " unbiased_running_var=True" if self.unbiased_explicit else ""
        return (
            f"{self.exporter} {batch} batch {self.variant} N={self.batch} C={self.channels} side={self.side}: "
            f"{steps} -> {self.head} head{swapped}"
        )

    def to_json(self) -> dict:
        return {**self.__dict__, "steps": [list(s) for s in self.steps]}

    @classmethod
    def from_json(cls, data: dict) -> Recipe:
        return cls(**{**data, "steps": [(str(op), int(seed)) for op, seed in data["steps"]]})

    def options(self) -> dict[str, Any]:
        """build_training_graph's keywords for this recipe's variant (and batch)."""
        options: dict[str, Any] = {"batch_size": self.batch, "static_batch": not self.dynamic, "dropout": "off"}
        if self.unbiased_explicit:
            options["unbiased_running_var"] = True
        options |= {
            "default": {},
            "portable": {"portable": True},
            "relu-unfused": {"fuse_relu": False},
            "optimizer-unfused": {"fused_optimizer": False},
        }[self.variant]
        return options


def draw_recipe(seed: int, index: int) -> Recipe:
    rng = np.random.default_rng([seed, index])
    exporter = str(rng.choice(EXPORTERS))
    steps = [str(rng.choice(OPS)) for _ in range(int(rng.integers(1, 7)))]
    if not any(s in ("conv", "convT", "residual", "concat", "preact", "bn", "bn1d") for s in steps):
        steps.insert(0, "conv")
    seeds = rng.integers(0, 2**31, len(steps) + 1)
    recipe = Recipe(
        exporter=exporter,
        dynamic=bool(rng.random() < 0.5),
        variant=str(rng.choice(VARIANTS)),
        batch=int(rng.choice([2, 3, 4, 4, 6, 8])),
        channels=int(rng.choice([1, 2, 3, 3, 4])),
        side=int(rng.integers(4, 13)),
        head="bn1d" if rng.random() < 0.3 else "linear",
        head_seed=int(seeds[-1]),
        steps=[(s, int(k)) for s, k in zip(steps, seeds[:-1], strict=False)],
    )
    recipe.unbiased_explicit = bool(rng.random() < 0.2)  # drawn last: the draws before it are those of earlier runs
    return recipe


# --- modules -----------------------------------------------------------------------------------------------


class FrozenBatchNorm2d(nn.BatchNorm2d):
    """A BN that stays in eval mode when its network trains (running statistics normalize; weight, bias train)."""

    def train(self, mode: bool = True) -> FrozenBatchNorm2d:
        return super().train(False)


class FrozenBatchNorm1d(nn.BatchNorm1d):
    def train(self, mode: bool = True) -> FrozenBatchNorm1d:
        return super().train(False)


def activation(name: str, rng: np.random.Generator) -> nn.Module:
    if name == "leaky_relu":
        return nn.LeakyReLU(float(rng.choice([0.01, 0.1, 0.2])))
    if name == "elu":
        return nn.ELU(float(rng.choice([1.0, 0.5])))
    return {
        "relu": nn.ReLU, "relu6": nn.ReLU6, "gelu": nn.GELU, "gelu_tanh": lambda: nn.GELU("tanh"), "silu": nn.SiLU,
        "hardswish": nn.Hardswish, "tanh": nn.Tanh, "none": nn.Identity,
    }[name]()  # fmt: skip


def batch_norm(channels: int, rng: np.random.Generator, replace: list[str], one_d: bool = False) -> nn.Module:
    """A BN of a drawn flavour with non-trivial parameters and statistics (random, so no two are deduplicated)."""
    flavour = str(rng.choice(list(FLAVOURS), p=list(FLAVOURS.values())))
    if flavour in replace:
        flavour = "affine"
    momentum = float(rng.choice([0.1, 0.1, 0.01, 0.3]))
    eps = float(rng.choice([1e-5, 1e-5, 1e-3]))
    kinds = (nn.BatchNorm1d, FrozenBatchNorm1d) if one_d else (nn.BatchNorm2d, FrozenBatchNorm2d)
    kind = kinds[1] if flavour == "frozen" else kinds[0]
    module = kind(
        channels, eps=eps, momentum=None if flavour == "cumulative" else momentum, affine=flavour != "noaffine"
    )
    weight, bias = rng.uniform(0.5, 1.5, channels), rng.normal(0, 0.2, channels)  # drawn alike for every flavour
    with torch.no_grad():
        if module.affine:
            module.weight.copy_(torch.from_numpy(weight))
            module.bias.copy_(torch.from_numpy(bias))
        module.running_mean.copy_(torch.from_numpy(rng.normal(0, 0.1, channels)))
        module.running_var.copy_(torch.from_numpy(rng.uniform(0.5, 1.5, channels)))
    module.fuzz_flavour = flavour  # type: ignore[assignment]
    return module


def _width(rng: np.random.Generator, c: int) -> int:
    return int(min(MAX_WIDTH, rng.choice([c, c, 2 * c, max(1, c // 2), int(rng.integers(1, MAX_WIDTH + 1))])))


def _conv_out(size: int, k: int, stride: int, pad: int, dilation: int) -> int:
    return (size + 2 * pad - dilation * (k - 1) - 1) // stride + 1


class ConvUnit(nn.Module):
    """conv -> BN -> act (the conv drawn: kernel, stride, dilation, groups, padding mode, bias)."""

    def __init__(self, c: int, h: int, w: int, rng: np.random.Generator, replace: list[str], co: int | None = None,
                 k: int | None = None, stride: int | None = None, same: bool = False) -> None:  # fmt: skip
        super().__init__()
        co = co or _width(rng, c)
        k = k or int(rng.choice([1, 3, 3, 5]))
        dilation = int(rng.choice([1, 1, 2])) if k > 1 else 1
        pad = int(rng.choice([0, dilation * (k // 2), dilation * (k // 2)])) if k > 1 else int(rng.choice([0, 0, 1]))
        if same:  # the size kept (at stride 1): residual and concat branches
            pad = dilation * (k // 2)
        stride = stride or (2 if min(h, w) >= 6 and rng.random() < 0.3 else 1)
        while (
            not same
            and k > 1
            and min(_conv_out(h, k, stride, pad, dilation), _conv_out(w, k, stride, pad, dilation)) < 1
        ):
            k, dilation, pad = k - 2, 1, min(pad, (k - 2) // 2)
        mode = str(rng.choice(["zeros"] * 5 + ["reflect", "replicate", "circular"])) if pad else "zeros"
        if mode == "reflect" and pad >= min(h, w) or mode == "circular" and pad > min(h, w):
            mode = "zeros"
        groups = 1
        if co == c and c > 1 and rng.random() < 0.4:
            groups = c  # depthwise
        elif c % 2 == 0 and co % 2 == 0 and rng.random() < 0.3:
            groups = 2
        self.conv = nn.Conv2d(c, co, k, stride, pad, dilation, groups, bool(rng.random() < 0.4), mode)
        self.bn = batch_norm(co, rng, replace)
        self.act = activation(str(rng.choice(ACTIVATIONS)), rng)
        self.shape = (co, _conv_out(h, k, stride, pad, dilation), _conv_out(w, k, stride, pad, dilation))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.bn(self.conv(x)))


class ConvTransposeUnit(nn.Module):
    def __init__(self, c: int, h: int, w: int, rng: np.random.Generator, replace: list[str]) -> None:
        super().__init__()
        co = _width(rng, c)
        k, stride = int(rng.choice([1, 2, 3])), int(rng.choice([1, 2]))
        pad = int(rng.choice([0, 1])) if k > 1 else 0
        output_padding = int(rng.integers(0, stride)) if stride > 1 else 0
        groups = 2 if c % 2 == 0 and co % 2 == 0 and rng.random() < 0.3 else 1
        self.conv = nn.ConvTranspose2d(c, co, k, stride, pad, output_padding, groups, bool(rng.random() < 0.5))
        self.bn = batch_norm(co, rng, replace)
        self.act = activation(str(rng.choice(ACTIVATIONS)), rng)
        out = [(s - 1) * stride - 2 * pad + k + output_padding for s in (h, w)]
        self.shape = (co, out[0], out[1])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.bn(self.conv(x)))


class Residual(nn.Module):
    """act(x + BN(conv(act(BN(conv(x)))))), with a strided 1x1 conv + BN shortcut where the shape changes."""

    def __init__(self, c: int, h: int, w: int, rng: np.random.Generator, replace: list[str]) -> None:
        super().__init__()
        co = _width(rng, c)
        stride = 2 if min(h, w) >= 6 and rng.random() < 0.3 else 1
        self.first = ConvUnit(c, h, w, rng, replace, co=co, k=3, stride=stride, same=True)
        _, oh, ow = self.first.shape
        self.second = nn.Conv2d(co, co, 3, 1, 1, bias=False)
        self.bn = batch_norm(co, rng, replace)
        self.down = None
        if co != c or stride != 1 or rng.random() < 0.2:
            self.down = nn.Sequential(nn.Conv2d(c, co, 1, stride, bias=False), batch_norm(co, rng, replace))
        self.act = activation(str(rng.choice(ACTIVATIONS)), rng)
        if (oh, ow) != ((h - 1) // stride + 1, (w - 1) // stride + 1):  # the drawn conv changed the size: no add
            raise ValueError("residual branch changes the spatial size")
        self.shape = (co, oh, ow)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shortcut = x if self.down is None else self.down(x)
        return self.act(shortcut + self.bn(self.second(self.first(x))))


class Concat(nn.Module):
    def __init__(self, c: int, h: int, w: int, rng: np.random.Generator, replace: list[str]) -> None:
        super().__init__()
        self.a = ConvUnit(c, h, w, rng, replace, k=1, stride=1, same=True)
        self.b = ConvUnit(c, h, w, rng, replace, k=3 if min(h, w) >= 3 else 1, stride=1, same=True)
        self.keep_input = bool(rng.random() < 0.3)
        co = self.a.shape[0] + self.b.shape[0] + (c if self.keep_input else 0)
        if co > 2 * MAX_WIDTH:
            raise ValueError("too wide")
        self.shape = (co, h, w)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        parts = [self.a(x), self.b(x)] + ([x] if self.keep_input else [])
        return torch.cat(parts, 1)


class PreAct(nn.Module):
    def __init__(self, c: int, h: int, w: int, rng: np.random.Generator, replace: list[str]) -> None:
        super().__init__()
        self.bn = batch_norm(c, rng, replace)
        self.act = activation(str(rng.choice(ACTIVATIONS)), rng)
        co = _width(rng, c)
        self.conv = nn.Conv2d(c, co, 3, 1, 1, bias=bool(rng.random() < 0.5))
        self.shape = (co, h, w)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(self.act(self.bn(x)))


class SqueezeExcite(nn.Module):
    def __init__(self, c: int, h: int, w: int, rng: np.random.Generator, replace: list[str]) -> None:
        super().__init__()
        hidden = max(1, c // int(rng.choice([1, 2, 4])))
        self.reduce = nn.Conv2d(c, hidden, 1)
        self.act = activation(str(rng.choice(["relu", "silu", "hardswish"])), rng)
        self.expand = nn.Conv2d(hidden, c, 1)
        self.gate = nn.Hardsigmoid() if rng.random() < 0.4 else nn.Sigmoid()
        self.shape = (c, h, w)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scale = self.gate(self.expand(self.act(self.reduce(x.mean((2, 3), keepdim=True)))))
        return x * scale


class Pool(nn.Module):
    KERNELS: tuple[int, ...] = (2, 3)
    STRIDES: tuple[int, ...] = (1, 2, 2)

    def __init__(self, c: int, h: int, w: int, rng: np.random.Generator, replace: list[str]) -> None:
        super().__init__()
        k = int(rng.choice(self.KERNELS))
        stride = int(rng.choice(self.STRIDES))
        pad = int(rng.integers(0, k // 2 + 1))
        ceil = bool(rng.random() < 0.4)
        if min(h, w) + 2 * pad < k:
            raise ValueError("map smaller than the window")
        # ceil_mode's last window starting in the end padding: PyTorch drops it, ONNX shape inference keeps it
        self.ceil_in_padding = ceil and any((-(-(s + 2 * pad - k) // stride)) * stride >= s + pad for s in (h, w))
        if self.ceil_in_padding and "ceilpad" in replace:
            ceil, self.ceil_in_padding = False, False
        if rng.random() < 0.5:
            self.pool: nn.Module = nn.MaxPool2d(k, stride, pad, ceil_mode=ceil)
        else:
            self.pool = nn.AvgPool2d(k, stride, pad, ceil_mode=ceil, count_include_pad=bool(rng.random() < 0.5))
        with torch.no_grad():
            shape = self.pool(torch.zeros(1, c, h, w)).shape
        self.shape = (c, int(shape[2]), int(shape[3]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.pool(x)


class WidePool(Pool):
    """A pool striding past its window or level with it (stride 3, kernel 2-4): rows and columns left over at the
    end, where onnx-ad's floor AveragePool gradient was misplaced. Its own step, so "pool" recipes draw as before."""

    KERNELS = (2, 3, 4)
    STRIDES = (3,)


class Shuffle(nn.Module):
    """ShuffleNet's channel shuffle: view (N, g, C/g, H, W), swap, flatten back. "size0" reads the batch from
    x.size(0), "sizes" every dimension from x.size() (torchvision's shufflenet_v2): Shape-computed shapes in the
    export; "-1" leaves the batch to the reshape."""

    def __init__(self, c: int, h: int, w: int, rng: np.random.Generator, replace: list[str]) -> None:
        super().__init__()
        divisors = [g for g in range(2, c + 1) if c % g == 0]
        if not divisors:
            raise ValueError("one channel: nothing to shuffle")
        self.groups = int(rng.choice(divisors))
        style = str(rng.choice(["size0", "-1", "sizes"]))
        self.style = "-1" if "size0" in replace else style
        self.shape = (c, h, w)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        c, h, w = self.shape
        if self.style == "sizes":  # shufflenet_v2's: every dimension read from x.size()
            n, c, h, w = x.size()
            y = x.view(n, self.groups, c // self.groups, h, w).transpose(1, 2).contiguous()
            return y.view(n, -1, h, w)
        if self.style == "size0":
            n = x.size(0)
            y = x.view(n, self.groups, c // self.groups, h, w).transpose(1, 2).contiguous()
            return y.view(n, -1, h, w)
        y = x.reshape(-1, self.groups, c // self.groups, h, w).transpose(1, 2)
        return y.reshape(-1, c, h, w)


class Upsample(nn.Module):
    def __init__(self, c: int, h: int, w: int, rng: np.random.Generator, replace: list[str]) -> None:
        super().__init__()
        if max(h, w) > 8:
            raise ValueError("map already large")
        mode = str(rng.choice(["nearest", "bilinear"]))
        self.up = nn.Upsample(scale_factor=2, mode=mode, align_corners=False if mode == "bilinear" else None)
        self.shape = (c, 2 * h, 2 * w)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.up(x)


class Act(nn.Module):
    def __init__(self, c: int, h: int, w: int, rng: np.random.Generator, replace: list[str]) -> None:
        super().__init__()
        self.act = activation(str(rng.choice(ACTIVATIONS[:-1])), rng)
        self.shape = (c, h, w)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(x)


class LoneBatchNorm(nn.Module):
    def __init__(self, c: int, h: int, w: int, rng: np.random.Generator, replace: list[str]) -> None:
        super().__init__()
        self.bn = batch_norm(c, rng, replace)
        self.shape = (c, h, w)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.bn(x)


class BatchNorm1dOnMap(nn.Module):
    """BatchNorm1d on the (N, C, H*W) view of the map, then back to (N, C, H, W)."""

    def __init__(self, c: int, h: int, w: int, rng: np.random.Generator, replace: list[str]) -> None:
        super().__init__()
        self.bn = batch_norm(c, rng, replace, one_d=True)
        self.shape = (c, h, w)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        c, h, w = self.shape
        return self.bn(x.flatten(2)).reshape(-1, c, h, w)


class Dropout(nn.Module):
    def __init__(self, c: int, h: int, w: int, rng: np.random.Generator, replace: list[str]) -> None:
        super().__init__()
        self.drop = nn.Dropout2d(0.0) if rng.random() < 0.5 else nn.Dropout(0.0)  # off: an eval export has none
        self.shape = (c, h, w)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(x)


STEPS = {
    "conv": ConvUnit, "convT": ConvTransposeUnit, "residual": Residual, "concat": Concat, "preact": PreAct,
    "se": SqueezeExcite, "pool": Pool, "widepool": WidePool, "shuffle": Shuffle, "upsample": Upsample, "act": Act,
    "bn": LoneBatchNorm, "bn1d": BatchNorm1dOnMap, "dropout": Dropout,
}  # fmt: skip


class Head(nn.Module):
    def __init__(self, c: int, kind: str, rng: np.random.Generator, replace: list[str]) -> None:
        super().__init__()
        self.pool = nn.AdaptiveAvgPool2d(1) if rng.random() < 0.8 else nn.AdaptiveMaxPool2d(1)
        self.flatten = "-1" if "size0" in replace else str(rng.choice(["torch", "size0"]))
        layers: list[nn.Module] = []
        if kind == "bn1d":
            hidden = int(rng.integers(2, MAX_WIDTH + 1))
            layers += [nn.Linear(c, hidden, bias=bool(rng.random() < 0.5)), batch_norm(hidden, rng, replace, True)]
            layers.append(activation(str(rng.choice(ACTIVATIONS)), rng))
            c = hidden
        layers.append(nn.Linear(c, CLASSES))
        self.layers = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.pool(x)
        x = torch.flatten(x, 1) if self.flatten == "torch" else x.view(x.size(0), -1)
        return self.layers(x)


class FuzzNet(nn.Module):
    def __init__(self, recipe: Recipe) -> None:
        super().__init__()
        c, h, w = recipe.channels, recipe.side, recipe.side
        blocks = []
        for op, seed in recipe.steps:
            rng = np.random.default_rng(seed)
            torch.manual_seed(seed)
            try:
                block = STEPS[op](c, h, w, rng, recipe.replace)
            except ValueError:  # the step does not fit here: skipped
                continue
            if min(block.shape[1:]) < 1 or block.shape[1] * block.shape[2] > 1024:
                continue
            blocks.append(block)
            c, h, w = block.shape
        self.blocks = nn.Sequential(*blocks)
        torch.manual_seed(recipe.head_seed)
        self.head = Head(c, recipe.head, np.random.default_rng(recipe.head_seed), recipe.replace)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(x))


def build(recipe: Recipe) -> FuzzNet:
    return FuzzNet(recipe).float().eval()


def flavours(net: nn.Module) -> dict[str, str]:
    """BN module name -> its flavour."""
    return {name: m.fuzz_flavour for name, m in net.named_modules() if hasattr(m, "fuzz_flavour")}


def frozen_nodes(net: nn.Module, model: onnx.ModelProto) -> list[str]:
    """The BN nodes of the frozen-flavour modules (found by their running-mean initializer)."""
    running = {f"{name}.running_mean" for name, flavour in flavours(net).items() if flavour == "frozen"}
    return [n.output[0] for n in model.graph.node if n.op_type == "BatchNormalization" and n.input[3] in running]


_UNCACHED_TORCHLIB: dict[str, Any] = {}


def cache_torchlib(enabled: bool = True) -> None:
    """The dynamo exporter rebuilds its ONNX registry on every export, and onnxscript's half of it
    (``get_torchlib_ops``: every torchlib function's source parsed for its signature, ~0.3 CPU-s) is the same list
    each time for the installed onnxscript: computed once per process. ``enabled=False`` restores the original
    (tests/test_fuzz_training.py checks the exports are byte-identical either way)."""
    import functools
    import importlib

    try:  # the module torch's exporter calls (torch.onnx._internal._lazy_import.onnxscript_apis)
        apis = importlib.import_module("onnxscript._framework_apis.torch_2_11")
    except ImportError:  # another torch / onnxscript pairing: left uncached
        _UNCACHED_TORCHLIB["get_torchlib_ops"] = None
        return
    original = _UNCACHED_TORCHLIB.setdefault("get_torchlib_ops", apis.get_torchlib_ops)
    if original is None:
        return
    apis.get_torchlib_ops = functools.cache(original) if enabled else original


def export(net: nn.Module, recipe: Recipe, dtype: torch.dtype = torch.float32) -> onnx.ModelProto:
    """The inference model (eval mode, BN kept) from the recipe's exporter, input "x", output "y"."""
    example = torch.zeros((recipe.batch, recipe.channels, recipe.side, recipe.side), dtype=dtype)
    net = copy.deepcopy(net).to(dtype).eval()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if recipe.exporter == "dynamo":
            if "get_torchlib_ops" not in _UNCACHED_TORCHLIB:
                cache_torchlib()
            import logging

            logging.getLogger("torch.onnx").setLevel(logging.ERROR)
            shapes = ({0: torch.export.Dim("batch", min=2)},) if recipe.dynamic else None
            program = torch.onnx.export(
                net, (example,), dynamo=True, optimize=False, input_names=["x"], output_names=["y"],
                dynamic_shapes=shapes, verbose=False,
            )  # fmt: skip
            return program.model_proto
        buffer = io.BytesIO()
        torch.onnx.export(
            net, (example,), buffer, dynamo=False, opset_version=17, training=torch.onnx.TrainingMode.PRESERVE,
            do_constant_folding=False, input_names=["x"], output_names=["y"],
            dynamic_axes={"x": {0: "batch"}, "y": {0: "batch"}} if recipe.dynamic else None,
        )  # fmt: skip
        return onnx.load_from_string(buffer.getvalue())
