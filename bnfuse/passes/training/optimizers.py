"""In-graph optimizer steps with PyTorch's semantics, written in standard ONNX operators.

Each step maps (parameter, gradient, state...) to (new parameter, new state...). Optimizer state
starts at zero, which reproduces PyTorch's first step exactly: SGD's ``buf = g`` on the first step is
``momentum * 0 + g``; Adam counts its steps in a state scalar.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from onnx import helper, numpy_helper

from bnfuse.errors import BnfuseError
from bnfuse.passes.training.groups import Hyper


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
    """Emits the update nodes of every parameter into ``nodes`` / ``initializers``."""

    def __init__(self, optimizer: SGD | Adam, lr: str) -> None:
        self.optimizer = optimizer
        self.lr = lr
        self.nodes: list = []
        self.initializers: list = []
        self._constants: dict[float, str] = {}
        self._count = 0
        self.step_input: str | None = None  # Adam's step counter (state), when any
        self._scaled: dict[tuple[str, float], str] = {}

    def _name(self, stem: str) -> str:
        self._count += 1
        return f"opt/{stem}_{self._count}"

    def _op(self, op_type: str, inputs: list[str], output: str | None = None) -> str:
        output = output or self._name(op_type.lower())
        self.nodes.append(helper.make_node(op_type, inputs, [output]))
        return output

    def const(self, value: float) -> str:
        if value not in self._constants:
            name = f"opt/const_{len(self._constants)}"
            self.initializers.append(numpy_helper.from_array(np.array(value, np.float32), name))
            self._constants[value] = name
        return self._constants[value]

    def step(
        self, param: str, grad: str, state: list[str], new_param: str, new_state: list[str], hyper: Hyper | None = None
    ) -> None:
        """``hyper``: this parameter's weight decay and learning-rate multiplier (its parameter group); default:
        the optimizer's weight decay, multiplier 1."""
        hyper = hyper or Hyper(self.optimizer.weight_decay)
        if isinstance(self.optimizer, SGD):
            self._sgd(param, grad, state, new_param, new_state, hyper)
        else:
            self._adam(param, grad, state, new_param, new_state, hyper)

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
        bc1 = self._op("Sub", [self.const(1.0), self._op("Pow", [self.const(opt.beta1), t])])
        bc2 = self._op("Sub", [self.const(1.0), self._op("Pow", [self.const(opt.beta2), t])])
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
            [self._op("Mul", [state[0], self.const(opt.beta1)]), self._op("Mul", [g, self.const(1.0 - opt.beta1)])],
            new_state[0],
        )
        g2 = self._op("Mul", [g, g])
        v = self._op(
            "Add",
            [self._op("Mul", [state[1], self.const(opt.beta2)]), self._op("Mul", [g2, self.const(1.0 - opt.beta2)])],
            new_state[1],
        )
        denom = self._op("Add", [self._op("Div", [self._op("Sqrt", [v]), bc2_sqrt]), self.const(opt.eps)])
        self._op("Sub", [param, self._op("Mul", [self._op("Div", [m, denom]), step_size])], new_param)
