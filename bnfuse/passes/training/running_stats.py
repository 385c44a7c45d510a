"""How each BatchNormalization updates its running statistics in the training graph: momentum, convention,
variance estimator, and the cumulative moving average (PyTorch's ``momentum=None``, cuDNN's factor 1/(1+n)).

Conventions (``momentum_convention``):

* None (auto): each node's momentum attribute. For a model from PyTorch's exporter (producer "pytorch") the
  PyTorch defaults apply: unbiased running variance, and a node momentum of exactly 1.0 means PyTorch's
  ``momentum=None`` (the exporter writes ``1 - 0`` for it), so that node keeps a cumulative average.
  (``momentum=0`` in PyTorch exports the same 1.0; it never updates, a rare choice: give ``--momentum-convention
  onnx`` to keep such nodes fixed.)
* "onnx" / "mxnet": running*m + batch*(1-m), the node attributes unless ``momentum`` is given.
* "pytorch" / "mindspore" / "cudnn": running*(1-m) + batch*m with the given ``momentum``.
* "cumulative": every node keeps the cumulative average: running += (batch - running) / (n + 1) after n
  updates, counted in the state scalar ``bn.num_batches_tracked`` (PyTorch's counter; start it with
  ``TrainingSession.load_state`` for a network trained before).

Running variance (``unbiased_running_var``), None: unbiased (M / (M - 1) * batch variance) under "pytorch",
"cudnn", "cumulative" and for PyTorch exports, as PyTorch and cuDNN do; biased otherwise (ONNX's reference).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx
from onnx import helper, numpy_helper

from bnfuse.errors import BnfuseError
from bnfuse.runtime.semantics import MomentumConvention

CUMULATIVE = "cumulative"
COUNTER = "bn.num_batches_tracked"
UNBIASED_BY_DEFAULT = ("pytorch", "cudnn", CUMULATIVE)


@dataclass(frozen=True)
class RunningStatsPlan:
    """The resolved settings; ``for_node`` gives one node's (momentum, convention, cumulative)."""

    momentum: float | None
    convention: MomentumConvention
    cumulative_all: bool
    from_pytorch: bool
    unbiased: bool

    def for_node(self, attribute_momentum: float) -> tuple[float, MomentumConvention, bool]:
        if self.cumulative_all or (self.momentum is None and self.from_pytorch and attribute_momentum == 1.0):
            return 1.0, MomentumConvention.PYTORCH, True  # the kernel yields the batch statistic; blended after
        if self.momentum is None:
            return attribute_momentum, MomentumConvention.ONNX, False
        return self.momentum, self.convention, False

    def describe(self, cumulative_nodes: int, nodes: int) -> tuple[str, str]:
        """(momentum text, running-variance text) for the build report."""
        if self.cumulative_all:
            momentum = "cumulative moving average (1/(1+n), PyTorch momentum=None)"
        elif self.momentum is None:
            momentum = "node attributes (onnx convention"
            momentum += ", PyTorch export: PyTorch momentum = 1 - attribute)" if self.from_pytorch else ")"
            if cumulative_nodes:
                momentum += f"; {cumulative_nodes} of {nodes} with momentum 1.0 = PyTorch momentum=None: cumulative"
        else:
            momentum = f"{self.momentum} ({self.convention.value})"
        variance = "unbiased (M/(M-1) * batch variance, as PyTorch)" if self.unbiased else "biased (batch variance)"
        return momentum, variance


def plan(
    model: onnx.ModelProto,
    momentum: float | None,
    momentum_convention: str | MomentumConvention | None,
    unbiased_running_var: bool | None,
) -> RunningStatsPlan:
    from_pytorch = model.producer_name == "pytorch"
    raw = momentum_convention.value if isinstance(momentum_convention, MomentumConvention) else momentum_convention
    raw = raw.lower() if raw is not None else None
    if momentum is not None and not 0.0 <= momentum <= 1.0:
        raise BnfuseError(f"momentum must be in [0, 1], got {momentum}")
    cumulative = raw == CUMULATIVE
    if cumulative and momentum is not None:
        raise BnfuseError("the cumulative moving average takes no momentum (it is 1/(1+n) after n updates)")
    convention = MomentumConvention.ONNX if raw is None or cumulative else MomentumConvention.parse(raw)
    if momentum is None and not cumulative and convention is not MomentumConvention.ONNX:
        # without a momentum the nodes' own attributes are used, and those are ONNX-convention values
        raise BnfuseError(
            f"momentum convention {convention.value!r} given without a momentum: give the momentum too "
            "(--momentum), or leave the convention at 'onnx' to use each node's momentum attribute"
        )
    if unbiased_running_var is None:
        unbiased_running_var = raw in UNBIASED_BY_DEFAULT or (raw is None and from_pytorch)
    return RunningStatsPlan(
        momentum=momentum,
        convention=convention,
        cumulative_all=cumulative,
        from_pytorch=from_pytorch and raw is None,
        unbiased=bool(unbiased_running_var),
    )


def cumulative_update(
    running: str, batch: str, updated: str, counter_new: str, nodes: list, initializers: list, dtype: type = np.float32
) -> None:
    """updated = running * (1 - f) + batch * f with f = 1 / counter_new (the count including this update)."""
    stem = f"{running}.cumulative"
    one = f"{stem}/one"
    initializers.append(numpy_helper.from_array(np.array(1.0, dtype), one))
    nodes += [
        helper.make_node("Reciprocal", [counter_new], [f"{stem}/f"]),
        helper.make_node("Sub", [one, f"{stem}/f"], [f"{stem}/keep"]),
        helper.make_node("Mul", [running, f"{stem}/keep"], [f"{stem}/old"]),
        helper.make_node("Mul", [batch, f"{stem}/f"], [f"{stem}/new"]),
        helper.make_node("Add", [f"{stem}/old", f"{stem}/new"], [updated]),
    ]


def counter_step(counter: str, counter_new: str, nodes: list, initializers: list, dtype: type = np.float32) -> None:
    initializers.append(numpy_helper.from_array(np.array(1.0, dtype), f"{counter}/one"))
    nodes.append(helper.make_node("Add", [counter, f"{counter}/one"], [counter_new]))
