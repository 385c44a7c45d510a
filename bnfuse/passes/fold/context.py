"""What the folds of one model share: the fold context, the Producer and Plan records, small graph helpers."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import onnx_graphsurgeon as gs
from onnx import TensorProto, helper

from bnfuse.passes.constants import ConstantResolver
from bnfuse.passes.report import AbsorbedOp, BatchNormRecord

# bfloat16 comes from ml_dtypes, through onnx's own mapping.
FLOAT_DTYPES = {np.dtype(t) for t in (np.float16, np.float32, np.float64)} | {
    np.dtype(helper.tensor_dtype_to_np_dtype(TensorProto.BFLOAT16))
}
LOW_PRECISION_DTYPES = {np.dtype(np.float16), np.dtype(helper.tensor_dtype_to_np_dtype(TensorProto.BFLOAT16))}
# float16 / bfloat16 values a fold computed are kept in float64 (up to this many elements per constant), so a
# second fold into the same layer starts from them, not from their rounding: each value is rounded once.
EXACT_ELEMENTS = 1 << 22
AFFINE_OPS = ("Mul", "Add", "Sub", "Div")
BN_PARAMS = ("scale", "bias", "mean", "variance")


class TensorTypes(Protocol):
    """Rank and element type of graph tensors (None when unknown)."""

    def rank(self, tensor: gs.Tensor) -> int | None: ...

    def shape(self, tensor: gs.Tensor) -> tuple[int | str | None, ...] | None: ...

    def dtype(self, tensor: gs.Tensor) -> np.dtype | None: ...


class NotFoldable(Exception):
    """Why a per-channel map cannot be folded here (a message for the report)."""


class NotApplicable(NotFoldable):
    """A planner's pattern is not there (no reason worth reporting)."""


@dataclass
class Producer:
    """A linear node able to absorb a per-channel map on its output channels (axis 1)."""

    kind: str  # Conv, ConvTranspose, Gemm, MatMul
    node: gs.Node
    weight: np.ndarray
    bias: np.ndarray | None
    output: gs.Tensor  # the tensor the per-channel map reads
    rank: int
    bias_node: gs.Node | None = None  # MatMul's bias Add

    @property
    def channels(self) -> int:
        if self.kind == "Conv":
            return int(self.weight.shape[0])
        if self.kind == "ConvTranspose":
            return int(self.weight.shape[1]) * int(self.node.attrs.get("group", 1))
        if self.kind == "Gemm":
            return int(self.weight.shape[0] if self.node.attrs.get("transB", 0) else self.weight.shape[1])
        return int(self.weight.shape[1])


@dataclass
class Plan:
    """One exact way to fold a BN, computed before any edit: ``apply`` does the surgery."""

    # "backward" (into the producer), "forward" (into the consumer) or "moved" (the scale through an activation
    # into its readers, the shift left as an Add: moves)
    direction: str
    into: str
    added_elements: int  # values the fold adds to the model (a new bias)
    apply: Callable[[], None]


@dataclass
class FoldContext:
    """State shared by the folds of one model: constants, fresh names, ranks, what was done."""

    resolver: ConstantResolver
    used_names: set[str]
    types: TensorTypes
    opset: int
    standalone: str = "keep"
    activation_moves: bool = True  # the pre-activation move (moves.py); off: such BN stay, with the reason
    records: list[BatchNormRecord] = field(default_factory=list)
    absorbed: list[AbsorbedOp] = field(default_factory=list)
    progress: Callable[[], None] | None = None
    # ids of the tensors that are an output of any graph of the model (main or subgraph): their values
    # are visible to callers, so a fold must never edit them in place.
    graph_outputs: set[int] = field(default_factory=set)
    # A producer output consumed by a fold disappears; the folded consumer's output carries its values on,
    # mapped here (vanished name -> successor) so every BN record can name the tensor that replaces it.
    superseded: dict[str, str] = field(default_factory=dict)

    def replacement(self, name: str) -> str:
        while name in self.superseded:
            name = self.superseded[name]
        return name

    # names (in the input model) of the weights and biases the folds gave new values: what the check's
    # re-rounded twin perturbs (a fold rounds exactly those once more)
    rewritten: set[str] = field(default_factory=set)
    # the constants holding values a fold computed, as named in the optimized model (the check re-rounds them
    # to measure what one rounding of the new weights moves the optimized model by)
    written: set[str] = field(default_factory=set)
    # id(gs.Constant) -> (that constant, the float64 values a fold computed for it): float16 / bfloat16 only
    # (see EXACT_ELEMENTS); the constant is held so that its id cannot name another one
    exact: dict[int, tuple[gs.Constant, np.ndarray]] = field(default_factory=dict)
    transposes_cancelled: int = 0
    noops_removed: int = 0  # identity Transposes, Identity and inference Dropout nodes bypassed before folding
    # output names of the BNs that were in training mode in the input and were reset to inference
    reset_from_training: set[str] = field(default_factory=set)

    def fresh_name(self, base: str) -> str:
        name, index = base, 1
        while name in self.used_names:
            name, index = f"{base}_{index}", index + 1
        self.used_names.add(name)
        return name


def describe(node: gs.Node) -> str:
    if node.name:
        return node.name
    output = node.outputs[0].name if node.outputs else "?"
    return f"{node.op}->{output}"


def is_default_domain(node: gs.Node) -> bool:
    return node.domain in (None, "", "ai.onnx")


def per_channel_vector(constant: np.ndarray, rank: int, channels: int, *, axis: int = 1) -> np.ndarray | None:
    """``constant`` as a (C,) or (1,) vector when it broadcasts only along ``axis`` of a rank-``rank`` output."""
    if constant.ndim > rank or np.dtype(constant.dtype) not in FLOAT_DTYPES:
        return None
    shape = (1,) * (rank - constant.ndim) + tuple(constant.shape)
    if any(d != 1 for index, d in enumerate(shape) if index != axis):
        return None
    if rank > axis and shape[axis] not in (1, channels):
        return None
    return constant.reshape(-1)


def transpose_perm(transpose: gs.Node, rank: int) -> list[int]:
    perm = transpose.attrs.get("perm")
    return [int(p) for p in perm] if perm is not None else list(range(rank))[::-1]


def added_elements(old_bias: np.ndarray | None, new_bias: np.ndarray | None) -> int:
    """Values a fold adds to the model: a bias where there was none."""
    return 0 if new_bias is None or old_bias is not None else int(np.size(new_bias))


def has_input(node: gs.Node, index: int) -> bool:
    return index < len(node.inputs) and bool(node.inputs[index].name)
