"""In-graph optimizer steps with PyTorch's semantics, written in standard ONNX operators or fused.

Each step maps (parameter, gradient, state...) to (new parameter, new state...). Optimizer state
starts at zero, which reproduces PyTorch's first step exactly: SGD's ``buf = g`` on the first step is
``momentum * 0 + g``; Adam counts its steps in a state scalar.

Fused (StepBuilder(fused=True)): one bnfuse.SGDStep / AdamStep node updates every parameter with the same float32
operations in the same order (bnfuse/runtime/optimizer_ops.py), so it gives the standard nodes' bits;
expand_fused_steps turns it back into them (for the CUDA provider, which has no kernel for it).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx
from onnx import helper, numpy_helper

from bnfuse.attributes import float_attribute, onnx_float
from bnfuse.errors import BnfuseError
from bnfuse.passes.training.groups import Hyper
from bnfuse.runtime import optimizer_ops


@dataclass(frozen=True)
class SGD:
    """torch.optim.SGD: d = g + wd*p; buf = m*buf + d; p -= lr * (d + m*buf if nesterov else buf)."""

    momentum: float = 0.0
    weight_decay: float = 0.0
    nesterov: bool = False

    def __post_init__(self) -> None:
        if self.momentum < 0 or self.weight_decay < 0:
            raise BnfuseError("SGD momentum and weight decay must be >= 0")
        if self.nesterov and self.momentum == 0:
            raise BnfuseError("Nesterov momentum needs momentum > 0")

    def state_names(self, param: str) -> list[str]:
        return [f"{param}.momentum_buffer"] if self.momentum else []


@dataclass(frozen=True)
class Adam:
    """torch.optim.Adam (L2 weight decay added to the gradient, no amsgrad)."""

    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8
    weight_decay: float = 0.0

    def __post_init__(self) -> None:
        if not (0 <= self.beta1 < 1 and 0 <= self.beta2 < 1) or self.eps <= 0 or self.weight_decay < 0:
            raise BnfuseError("Adam needs 0 <= betas < 1, eps > 0 and weight decay >= 0")

    def state_names(self, param: str) -> list[str]:
        return [f"{param}.exp_avg", f"{param}.exp_avg_sq"]


Optimizer = SGD | Adam
ADAM_STEP = "adam.step"


def parse_optimizer(value: str | SGD | Adam) -> SGD | Adam:
    if isinstance(value, SGD | Adam):
        return value
    key = str(value).lower()
    if key == "sgd":
        return SGD()
    if key == "adam":
        return Adam()
    raise BnfuseError(f"unknown optimizer {value!r} (expected sgd or adam)")


class StepBuilder:
    """Emits the update nodes of every parameter into ``nodes`` / ``initializers``: per parameter in standard
    ONNX, or with ``fused`` one bnfuse node for them all, emitted by finish()."""

    def __init__(
        self, optimizer: SGD | Adam, lr: str, *, fused: bool = False, prefix: str = "opt/", dtype: type = np.float32
    ) -> None:
        self.optimizer = optimizer
        self.dtype = dtype  # of the parameters, lr and constants (float64 for a float64 model)
        self.lr = lr
        self.fused = fused
        self.prefix = prefix
        self.nodes: list = []
        self.initializers: list = []
        self._constants: dict[float, str] = {}
        self._count = 0
        self.step_input: str | None = None  # Adam's step counter (state), when any
        self._scaled: dict[tuple[str, float], str] = {}
        self._pending: list[tuple[list[str], list[str], Hyper]] = []  # fused: (inputs, outputs, hyper) per param

    def _name(self, stem: str) -> str:
        self._count += 1
        return f"{self.prefix}{stem}_{self._count}"

    def _op(self, op_type: str, inputs: list[str], output: str | None = None) -> str:
        output = output or self._name(op_type.lower())
        self.nodes.append(helper.make_node(op_type, inputs, [output]))
        return output

    def const(self, value: float) -> str:
        if value not in self._constants:
            name = f"{self.prefix}const_{len(self._constants)}"
            self.initializers.append(numpy_helper.from_array(np.array(value, self.dtype), name))
            self._constants[value] = name
        return self._constants[value]

    def step(
        self, param: str, grad: str, state: list[str], new_param: str, new_state: list[str], hyper: Hyper | None = None
    ) -> None:
        """``hyper``: this parameter's weight decay and learning-rate multiplier (its parameter group); default:
        the optimizer's weight decay, multiplier 1."""
        hyper = hyper or Hyper(self.optimizer.weight_decay)
        if self.fused:
            self._pending.append(([param, grad, *state], [new_param, *new_state], hyper))
            return
        if isinstance(self.optimizer, SGD):
            self._sgd(param, grad, state, new_param, new_state, hyper)
        else:
            self._adam(param, grad, state, new_param, new_state, hyper)

    def finish(self) -> None:
        """Fused: emit the one node that updates every parameter stepped so far."""
        if not self._pending:
            return
        opt = self.optimizer
        if isinstance(opt, SGD):
            op, lead = optimizer_ops.SGD_STEP, [self.lr]
            attributes: dict = {"momentum": opt.momentum, "nesterov": int(opt.nesterov)}
        else:
            op, lead = optimizer_ops.ADAM_STEP, list(self._adam_factors)
            attributes = {"beta1": opt.beta1, "beta2": opt.beta2, "epsilon": opt.eps}
        inputs = lead + [name for given, _, _ in self._pending for name in given]
        outputs = [name for _, made, _ in self._pending for name in made]
        attributes["weight_decays"] = [float(h.weight_decay) for _, _, h in self._pending]
        attributes["lr_scales"] = [float(h.lr_scale) for _, _, h in self._pending]
        self.nodes.append(
            helper.make_node(op, inputs, outputs, name=f"{self.prefix}{op}", domain=optimizer_ops.DOMAIN, **attributes)
        )
        self._pending = []

    def _scaled_lr(self, base: str, scale: float) -> str:
        """``base`` times a group's learning-rate multiplier (one node per distinct multiplier)."""
        if scale == 1.0:
            return base
        key = (base, scale)
        if key not in self._scaled:
            self._scaled[key] = self._op("Mul", [base, self.const(scale)])
        return self._scaled[key]

    def _decayed(self, param: str, grad: str, weight_decay: float) -> str:
        if not weight_decay:
            return grad
        return self._op("Add", [grad, self._op("Mul", [param, self.const(weight_decay)])])

    def _sgd(self, param: str, grad: str, state: list[str], new_param: str, new_state: list[str], hyper: Hyper) -> None:
        opt = self.optimizer
        d = self._decayed(param, grad, hyper.weight_decay)
        if opt.momentum:
            buf = self._op("Add", [self._op("Mul", [state[0], self.const(opt.momentum)]), d], new_state[0])
            d = self._op("Add", [d, self._op("Mul", [buf, self.const(opt.momentum)])]) if opt.nesterov else buf
        self._op("Sub", [param, self._op("Mul", [d, self._scaled_lr(self.lr, hyper.lr_scale)])], new_param)

    def adam_step(self, step: str, new_step: str) -> tuple[str, str]:
        """Increment the step counter once; returns (lr / (1 - b1^t), sqrt(1 - b2^t))."""
        opt = self.optimizer
        t = self._op("Add", [step, self.const(1.0)], new_step)
        bc1 = self._op("Sub", [self.const(1.0), self._op("Pow", [self.const(onnx_float(opt.beta1)), t])])
        bc2 = self._op("Sub", [self.const(1.0), self._op("Pow", [self.const(onnx_float(opt.beta2)), t])])
        self._adam_factors = (self._op("Div", [self.lr, bc1]), self._op("Sqrt", [bc2]))
        return self._adam_factors

    def _adam(
        self, param: str, grad: str, state: list[str], new_param: str, new_state: list[str], hyper: Hyper
    ) -> None:
        opt = self.optimizer
        step_size, bc2_sqrt = self._adam_factors
        step_size = self._scaled_lr(step_size, hyper.lr_scale)
        g = self._decayed(param, grad, hyper.weight_decay)
        m = self._op(
            "Add",
            [
                self._op("Mul", [state[0], self.const(onnx_float(opt.beta1))]),
                self._op("Mul", [g, self.const(1.0 - onnx_float(opt.beta1))]),
            ],
            new_state[0],
        )
        g2 = self._op("Mul", [g, g])
        v = self._op(
            "Add",
            [
                self._op("Mul", [state[1], self.const(onnx_float(opt.beta2))]),
                self._op("Mul", [g2, self.const(1.0 - onnx_float(opt.beta2))]),
            ],
            new_state[1],
        )
        denom = self._op("Add", [self._op("Div", [self._op("Sqrt", [v]), bc2_sqrt]), self.const(opt.eps)])
        self._op("Sub", [param, self._op("Mul", [self._op("Div", [m, denom]), step_size])], new_param)


def expand_fused_steps(model: onnx.ModelProto) -> int:
    """Replace each bnfuse.SGDStep / AdamStep node of ``model`` by the standard-ONNX nodes of the same update (same
    bits); returns how many were replaced."""
    graph = model.graph
    nodes: list[onnx.NodeProto] = []
    replaced = 0
    for node in graph.node:
        if node.domain != optimizer_ops.DOMAIN or node.op_type not in optimizer_ops.OP_NAMES:
            nodes.append(node)
            continue
        attributes = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        decays, scales = list(attributes["weight_decays"]), list(attributes["lr_scales"])
        if node.op_type == optimizer_ops.SGD_STEP:
            momentum, nesterov = float_attribute(attributes, "momentum", 0.0), bool(attributes.get("nesterov", 0))
            optimizer: SGD | Adam = SGD(momentum=momentum, nesterov=nesterov)
            lead, per_input = 1, 3 if momentum else 2
        else:
            optimizer = Adam(
                beta1=float_attribute(attributes, "beta1", 0.9),
                beta2=float_attribute(attributes, "beta2", 0.999),
                eps=float_attribute(attributes, "epsilon", 1e-8),
            )
            lead, per_input = 2, 4
        builder = StepBuilder(optimizer, node.input[0], prefix=f"{node.name or node.op_type}/expanded/")
        if lead == 2:
            builder._adam_factors = (node.input[0], node.input[1])
        per_output = per_input - 1
        for index, (decay, scale) in enumerate(zip(decays, scales, strict=True)):
            given = list(node.input[lead + index * per_input : lead + (index + 1) * per_input])
            made = list(node.output[index * per_output : (index + 1) * per_output])
            builder.step(given[0], given[1], given[2:], made[0], made[1:], Hyper(float(decay), float(scale)))
        nodes += builder.nodes
        graph.initializer.extend(builder.initializers)
        replaced += 1
    if replaced:
        graph.ClearField("node")
        graph.node.extend(nodes)
    return replaced
