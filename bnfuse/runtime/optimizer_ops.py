"""bnfuse.SGDStep and bnfuse.AdamStep: a training graph's whole optimizer update as one node (CPU, float32).

The standard-ONNX update (bnfuse/passes/training/optimizers.py) takes 3-12 elementwise nodes per parameter, each
a pass over memory and a kernel launch; a ResNet's step runs ~250 of them. These ops take every parameter at
once: one variadic float32 input list, one variadic output list, the per-parameter hyperparameters as attributes.

    SGDStep(lr, p_1, g_1[, buf_1], ..., p_n, g_n[, buf_n]) -> (p_1'[, buf_1'], ..., p_n'[, buf_n'])
        attributes: momentum, nesterov, weight_decays[n], lr_scales[n]  (momentum 0: no buffers)
    AdamStep(step_size, root, p_1, g_1, m_1, v_1, ...) -> (p_1', m_1', v_1', ...)
        step_size = lr / (1 - beta1^t), root = sqrt(1 - beta2^t); attributes beta1, beta2, epsilon,
        weight_decays[n], lr_scales[n]

Both compute in float32 in the order of the standard nodes, one rounding per node, and so give their bits. The
entry library (ortentry.c, run_optimizer) runs them in C; the Python path below (NumPy, the same operations) serves
what the C path leaves: its errors, and calls while ops.record_addresses() records.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from bnfuse.attributes import onnx_float
from bnfuse.runtime import ops
from bnfuse.runtime.semantics import BatchNormError

DOMAIN = ops.DOMAIN
SGD_STEP = "SGDStep"
ADAM_STEP = "AdamStep"
OP_NAMES = (SGD_STEP, ADAM_STEP)
_CODES = {SGD_STEP: 3, ADAM_STEP: 4}  # ortentry.c's BNFUSE_SGD / BNFUSE_ADAM


@dataclass(frozen=True)
class StepConfig:
    """One node's attributes. head: SGD (momentum, nesterov, 0), Adam (beta1, beta2, epsilon), as float32
    values (ONNX float attributes are float32)."""

    op: str
    head: tuple[float, float, float]
    weight_decays: tuple[float, ...]
    lr_scales: tuple[float, ...]

    @property
    def parameters(self) -> int:
        return len(self.weight_decays)

    @property
    def lead(self) -> int:
        """Scalar inputs before the parameters: SGD lr; Adam step_size and root."""
        return 2 if self.op == ADAM_STEP else 1

    @property
    def states(self) -> int:
        if self.op == ADAM_STEP:
            return 2
        return 1 if self.head[0] != 0.0 else 0


def parse_config(op: str, attributes: Any) -> StepConfig:
    """The node's attributes (ortabi.KernelInfo); a bad value raises BatchNormError naming it."""
    decays = tuple(attributes.floats_attr("weight_decays", ()))
    scales = tuple(attributes.floats_attr("lr_scales", ()))
    if not decays or len(decays) != len(scales):
        raise BatchNormError(f"{op}: weight_decays and lr_scales need one value per parameter, got {len(decays)} and "
                             f"{len(scales)}")  # fmt: skip
    if any(d < 0 for d in decays):
        raise BatchNormError(f"{op}: weight_decays must be >= 0")
    if op == SGD_STEP:
        momentum, nesterov = attributes.float_attr("momentum", 0.0), attributes.int_attr("nesterov", 0)
        if momentum < 0 or nesterov not in (0, 1) or (nesterov and momentum == 0):
            raise BatchNormError(f"{op}: momentum must be >= 0 and nesterov 0 or 1 (1 needs momentum > 0)")
        head = (momentum, float(nesterov), 0.0)
    else:
        head = tuple(attributes.float_attr(name, default) for name, default in _ADAM_DEFAULTS)  # type: ignore[assignment]
        if not (0 <= head[0] < 1 and 0 <= head[1] < 1) or head[2] <= 0:
            raise BatchNormError(f"{op}: needs 0 <= beta1, beta2 < 1 and epsilon > 0, got {head}")
    return StepConfig(op, head, decays, scales)  # type: ignore[arg-type]


# FLOAT attributes are float32: the defaults are what a node writing them would hold.
_ADAM_DEFAULTS = (("beta1", onnx_float(0.9)), ("beta2", onnx_float(0.999)), ("epsilon", onnx_float(1e-8)))


def step_plan(config: StepConfig) -> ops.FastPath:
    """The node's plan for the entry library: no C function (ortentry.c runs the steps itself), the op code, then
    the head and each parameter's (weight decay, lr multiplier)."""
    per_parameter = tuple(v for pair in zip(config.weight_decays, config.lr_scales, strict=True) for v in pair)
    return ops.FastPath(entry=0, op=_CODES[config.op], hyper=(*config.head, *per_parameter),
                        parameters=config.parameters)  # fmt: skip


def sgd_update(config: StepConfig, index: int, lr: np.float32, tensors: Sequence[np.ndarray]) -> None:
    """One parameter's SGD update into its output arrays: tensors = param, grad[, buf], new_param[, new_buf]."""
    momentum, nesterov = np.float32(config.head[0]), config.head[1] != 0.0
    decay, scale = np.float32(config.weight_decays[index]), config.lr_scales[index]
    rate = lr if scale == 1.0 else lr * np.float32(scale)
    param, grad = tensors[0], tensors[1]
    d = grad + param * decay if decay != 0 else grad
    if config.states:
        buffer = tensors[2] * momentum + d
        tensors[4][...] = buffer
        d = d + buffer * momentum if nesterov else buffer
    tensors[3 if config.states else 2][...] = param - d * rate


def adam_update(
    config: StepConfig, index: int, step_size: np.float32, root: np.float32, tensors: Sequence[np.ndarray]
) -> None:
    """One parameter's Adam update: tensors = param, grad, exp_avg, exp_avg_sq, and their three new values."""
    beta1, beta2, eps = (np.float32(v) for v in config.head)
    rest1, rest2 = np.float32(1.0 - config.head[0]), np.float32(1.0 - config.head[1])
    decay, scale = np.float32(config.weight_decays[index]), config.lr_scales[index]
    rate = step_size if scale == 1.0 else step_size * np.float32(scale)
    param, grad = tensors[0], tensors[1]
    d = grad + param * decay if decay != 0 else grad
    m = tensors[2] * beta1 + d * rest1
    v = tensors[3] * beta2 + (d * d) * rest2
    tensors[5][...] = m
    tensors[6][...] = v
    tensors[4][...] = param - (m / (np.sqrt(v) / root + eps)) * rate


class OptimizerStepKernel:
    """One SGDStep / AdamStep node; compute() is the Python path."""

    def __init__(self, node: str, config: StepConfig) -> None:
        self.node = node
        self.config = config
        self.fast_path = step_plan(config)

    def compute(self, context: Any) -> None:
        config = self.config
        per_input, per_output = 2 + config.states, 1 + config.states
        count, expected = context.input_count(), config.lead + per_input * config.parameters
        if count != expected:
            raise BatchNormError(
                f"{config.op} node {self.node!r}: {count} inputs, expected {expected} ({config.lead} scalar(s), then "
                f"{per_input} per parameter for {config.parameters} parameters)"
            )
        inputs = context.input_arrays(count)
        scalars = [np.float32(a.reshape(-1)[0]) if a.size == 1 else None for a in inputs[: config.lead]]
        if any(s is None for s in scalars):
            raise BatchNormError(f"{config.op} node {self.node!r}: the first {config.lead} input(s) must be scalars")
        shapes = []
        for index in range(config.parameters):
            group = inputs[config.lead + index * per_input : config.lead + (index + 1) * per_input]
            if any(a.shape != group[0].shape for a in group):
                raise BatchNormError(
                    f"{config.op} node {self.node!r}: parameter {index}'s gradient and state must have its shape "
                    f"{group[0].shape}, got {[a.shape for a in group]}"
                )
            shapes += [group[0].shape] * per_output
        outputs = context.output_arrays(tuple(shapes), (ops.F32,) * len(shapes))
        for index in range(config.parameters):
            given = inputs[config.lead + index * per_input : config.lead + (index + 1) * per_input]
            tensors = (*given, *outputs[index * per_output : (index + 1) * per_output])
            if config.op == SGD_STEP:
                sgd_update(config, index, scalars[0], tensors)  # type: ignore[arg-type]
            else:
                adam_update(config, index, scalars[0], scalars[1], tensors)  # type: ignore[arg-type]
        if ops._recorders:
            ops._record(config.op, self.node, inputs, outputs, (0, 0))


@dataclass(frozen=True)
class OptimizerStepSpec:
    """A registered kernel (CPU, float32) in the shape ortabi.OpSpec describes: one variadic input and output."""

    name: str
    provider: str = ops.CPU
    input_dtypes: tuple[np.dtype, ...] = (ops.F32,)
    output_dtypes: tuple[np.dtype, ...] = (ops.F32,)
    optional_outputs: frozenset[int] = frozenset()
    variadic: bool = True

    def create_kernel(self, attributes: Any) -> OptimizerStepKernel:
        return OptimizerStepKernel(attributes.node_name(), parse_config(self.name, attributes))


SPECS: tuple[OptimizerStepSpec, ...] = tuple(OptimizerStepSpec(name) for name in OP_NAMES)
