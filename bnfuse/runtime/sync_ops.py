"""bnfuse's collective custom ops (domain ``bnfuse``): synchronized batch normalization and a summing all-reduce.

They run on the process's communicator (:mod:`bnfuse.runtime.collectives`; a world of one unless installed).
Every op takes an int64 ``token`` [1] as its last input and returns ``token + 1`` as its last output: a
distributed training graph chains its collective nodes through the tokens, so every rank issues them in one
order whatever the scheduler does.

* ``SyncBatchNormalizationTraining`` (X, scale, B, input_mean, input_var, token) -> (Y, running_mean,
  running_var, saved_mean, saved_inv_std, token_out). Each rank takes its local (count, mean, M2) per channel
  in float64, all-gathers them (2C+1 values, the count as its int64 bits) and merges them in rank order with
  Chan's formula, then normalizes with the global statistics and updates the running ones (identical on every
  rank: the same merge of the same numbers).
* ``SyncBatchNormalizationGrad`` (dY, X, scale, saved_mean, saved_inv_std, token) -> (dX, dScale, dBias,
  token_out). All-reduces (count, sum dY, sum dY * x_hat) in float64 before dX; dScale and dBias stay local
  (sums of the rank's own samples), so the gradient all-reduce adds them once.
* ``AllReduceSum`` (X, token) -> (Y, token_out): Y = sum of X over the ranks (float32, float64, int64).

Ranks with zero samples take part with count 0; a batch empty on every rank is an error.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from bnfuse.runtime import collectives
from bnfuse.runtime.kernel_types import unbiased_factor
from bnfuse.runtime.ops import ATTRIBUTES, CPU, CUDA, GRAD, TRAINING, AttributeSource, Context, parse_config
from bnfuse.runtime.semantics import BatchNormConfig, BatchNormError, Mode, param_shape, reduction_axes

SYNC_TRAINING = "SyncBatchNormalizationTraining"
SYNC_GRAD = "SyncBatchNormalizationGrad"
ALL_REDUCE = "AllReduceSum"
SYNC_OP_NAMES = (SYNC_TRAINING, SYNC_GRAD, ALL_REDUCE)

INPUT_NAMES = {
    SYNC_TRAINING: ("X", "scale", "B", "input_mean", "input_var", "token"),
    SYNC_GRAD: ("dY", "X", "scale", "saved_mean", "saved_inv_std", "token"),
    ALL_REDUCE: ("X", "token"),
}
OUTPUT_NAMES = {
    SYNC_TRAINING: ("Y", "running_mean", "running_var", "saved_mean", "saved_inv_std", "token_out"),
    SYNC_GRAD: ("dX", "dScale", "dBias", "token_out"),
    ALL_REDUCE: ("Y", "token_out"),
}
F32, F64, I64 = np.dtype(np.float32), np.dtype(np.float64), np.dtype(np.int64)
ALL_REDUCE_DTYPES = (F32, F64, I64)


# -- the math (NumPy or CuPy arrays; float64 inside) -----------------------------------------------------


def _xp(array: Any) -> Any:
    if isinstance(array, np.ndarray):
        return np
    import cupy

    return cupy


def _broadcast_shape(config: BatchNormConfig, x_shape: tuple[int, ...]) -> tuple[int, ...]:
    if config.mode is Mode.PER_ACTIVATION:
        return (1, *x_shape[1:])
    axes = set(reduction_axes(config, len(x_shape)))
    return tuple(1 if a in axes else n for a, n in enumerate(x_shape))


def _sum_of_products(a: Any, b: Any, axes: tuple[int, ...]) -> Any:
    """sum(a * b) over ``axes`` in float64, without a temporary of the product (einsum)."""
    letters = "abcdefgh"[: a.ndim]
    keep = "".join(letter for index, letter in enumerate(letters) if index not in axes)
    return _xp(a).einsum(f"{letters},{letters}->{keep}", a, b)


def _centered_moments(x: Any, config: BatchNormConfig) -> tuple[int, Any, Any, Any]:
    """(count, mean, M2, x - mean) of this rank, float64; the centered copy is the only full-size temporary."""
    xp = _xp(x)
    axes = reduction_axes(config, x.ndim)
    count = math.prod(x.shape[a] for a in axes)
    size = math.prod(param_shape(config, x.shape))
    if count == 0:
        return 0, xp.zeros(size), xp.zeros(size), xp.zeros(x.shape)
    mean = x.mean(axis=axes, dtype=np.float64, keepdims=True)  # float64 accumulation, no float64 copy of x
    centered = xp.subtract(x, mean, dtype=np.float64)
    return count, mean.reshape(-1), _sum_of_products(centered, centered, axes).reshape(-1), centered


def local_moments(x: Any, config: BatchNormConfig) -> tuple[int, Any, Any]:
    """This rank's (count, mean, M2) per channel, float64, flattened to the parameters' element count."""
    return _centered_moments(x, config)[:3]


def merge_moments(gathered: Any) -> tuple[int, Any, Any]:
    """Chan's pairwise merge of every rank's (count, mean, M2) in rank order: (count, mean, M2).

    ``gathered`` is (ranks, 1 + 2P) float64, column 0 the int64 bits of each count.
    """
    xp = _xp(gathered)
    size = (gathered.shape[1] - 1) // 2
    counts = [int(c) for c in np.ascontiguousarray(_host(gathered[:, 0])).view(np.int64)]
    total, mean, m2 = 0, xp.zeros(size), xp.zeros(size)
    for rank, count in enumerate(counts):
        if count == 0:
            continue
        merged = total + count
        delta = gathered[rank, 1 : 1 + size] - mean
        mean = mean + delta * (count / merged)
        m2 = m2 + gathered[rank, 1 + size :] + xp.square(delta) * (total * count / merged)
        total = merged
    return total, mean, m2


def _host(array: Any) -> np.ndarray:
    return array if isinstance(array, np.ndarray) else array.get()


def sync_forward(
    x: Any,
    scale: Any,
    bias: Any,
    running_mean: Any,
    running_var: Any,
    config: BatchNormConfig,
    comm: collectives.Communicator,
    stream: int = 0,
) -> tuple[Any, Any, Any, Any, Any]:
    """(y, new running mean, new running var, mean, inv_std) with statistics over every rank's batch (float64)."""
    xp = _xp(x)
    count, local_mean, m2, centered = _centered_moments(x, config)
    packed = xp.empty(1 + 2 * local_mean.size, np.float64)
    packed[:1] = xp.asarray(np.array([count], np.int64).view(np.float64))
    packed[1 : 1 + local_mean.size] = local_mean
    packed[1 + local_mean.size :] = m2
    total, mean, m2 = merge_moments(comm.allgather(packed, stream))
    if total == 0:
        raise BatchNormError(f"{SYNC_TRAINING}: the batch is empty on every rank")
    var = m2 / total
    inv_std = 1.0 / xp.sqrt(var + config.epsilon)
    shape = _broadcast_shape(config, x.shape)
    g = xp.ones(mean.shape) if config.fix_gamma else scale.astype(np.float64).reshape(-1)
    mul = g * inv_std
    # y = (x - mean) * mul + bias, in place from x - local: (x - local) * mul + ((local - mean) * mul + bias)
    y = centered
    y *= mul.reshape(shape)
    y += ((local_mean - mean) * mul + bias.astype(np.float64).reshape(-1)).reshape(shape)
    w = config.batch_weight
    sample_var = var * unbiased_factor(total) if config.unbiased_running_var else var
    new_mean = running_mean.astype(np.float64).reshape(-1) * (1.0 - w) + mean * w
    new_var = running_var.astype(np.float64).reshape(-1) * (1.0 - w) + sample_var * w
    return y, new_mean, new_var, mean, inv_std


def sync_backward(
    dy: Any,
    x: Any,
    scale: Any,
    saved_mean: Any,
    saved_inv_std: Any,
    config: BatchNormConfig,
    comm: collectives.Communicator,
    stream: int = 0,
) -> tuple[Any, Any, Any]:
    """(dX through the global statistics, local dScale, local dBias), float64; x_hat is the one full-size
    temporary and becomes dX in place."""
    xp = _xp(x)
    axes = reduction_axes(config, x.ndim)
    shape = _broadcast_shape(config, x.shape)
    inv_std = saved_inv_std.astype(np.float64).reshape(shape)
    g = xp.ones(shape) if config.fix_gamma else scale.astype(np.float64).reshape(shape)
    x_hat = xp.subtract(x, saved_mean.astype(np.float64).reshape(shape), dtype=np.float64)
    x_hat *= inv_std
    dbias = dy.sum(axis=axes, dtype=np.float64).reshape(-1)
    dscale = _sum_of_products(dy, x_hat, axes).reshape(-1) if x.size else xp.zeros_like(dbias)
    size = dbias.size
    packed = xp.empty(1 + 2 * size, np.float64)
    packed[0] = math.prod(x.shape[a] for a in axes)  # float64 sums of counts are exact below 2**53
    packed[1 : 1 + size] = dbias
    packed[1 + size :] = dscale
    comm.allreduce_sum(packed, stream)
    total = float(packed[0])
    if total == 0:
        raise BatchNormError(f"{SYNC_GRAD}: the batch is empty on every rank")
    # dx = g * inv_std * (dy - sum_all(dy) / N - x_hat * sum_all(dy * x_hat) / N)
    x_hat *= (packed[1 + size :] / total).reshape(shape)
    x_hat += (packed[1 : 1 + size] / total).reshape(shape)
    dx = xp.subtract(dy, x_hat, out=x_hat)
    dx *= g * inv_std
    if config.fix_gamma:
        dscale = xp.zeros_like(dscale)
    return dx, dscale, dbias


# -- the ops ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SyncOpSpec:
    """One registered collective kernel: an op on one provider for one element type."""

    name: str
    provider: str
    dtype: np.dtype

    @property
    def input_dtypes(self) -> tuple[np.dtype, ...]:
        return (*(self.dtype,) * (len(INPUT_NAMES[self.name]) - 1), I64)

    @property
    def output_dtypes(self) -> tuple[np.dtype, ...]:
        return (*(self.dtype,) * (len(OUTPUT_NAMES[self.name]) - 1), I64)

    @property
    def optional_outputs(self) -> frozenset[int]:
        return frozenset()

    def create_kernel(self, attributes: AttributeSource) -> CollectiveKernel:
        config = None
        if self.name != ALL_REDUCE:
            config = parse_config(TRAINING if self.name == SYNC_TRAINING else GRAD, attributes)
            if config.use_global_stats:
                raise BatchNormError(f"{self.name}: use_global_stats needs no synchronization (use the plain op)")
            if config.activation != "none":  # distribute_training_graph unfuses the activation before syncing
                raise BatchNormError(f"{self.name}: no fused activation (got {config.activation!r})")
        return CollectiveKernel(self, attributes.node_name(), config)


ATTRIBUTES_OF = {SYNC_TRAINING: ATTRIBUTES[TRAINING], SYNC_GRAD: ATTRIBUTES[GRAD], ALL_REDUCE: {}}


@dataclass
class CollectiveKernel:
    spec: SyncOpSpec
    node: str
    config: BatchNormConfig | None

    def compute(self, context: Context) -> None:
        name = self.spec.name
        inputs = context.input_arrays(len(INPUT_NAMES[name]))
        if context.on_gpu:
            import cupy

            with inputs[0].device, cupy.cuda.ExternalStream(context.gpu_stream()):
                self._run(context, inputs, context.gpu_stream())
        else:
            self._run(context, inputs, 0)

    def _run(self, context: Context, inputs: Sequence[Any], stream: int) -> None:
        name, comm = self.spec.name, collectives.current()
        token = inputs[-1]
        if token.shape != (1,):
            raise BatchNormError(f"{name} {self.node!r}: token must have shape [1], got {list(token.shape)}")
        dtypes = self.spec.output_dtypes
        if name == ALL_REDUCE:
            out, token_out = context.output_arrays((inputs[0].shape, (1,)), dtypes)
            out[...] = inputs[0]
            comm.allreduce_sum(out, stream)
            token_out[...] = token + 1
            return
        assert self.config is not None
        config = self.config
        data = inputs[1] if name == SYNC_GRAD else inputs[0]
        p_shape = param_shape(config, data.shape)
        for index, array in enumerate(inputs[:-1]):
            wanted = data.shape if index < (2 if name == SYNC_GRAD else 1) else p_shape
            if array.shape != wanted:
                label = INPUT_NAMES[name][index]
                raise BatchNormError(f"{name}: {label} has shape {array.shape}, expected {wanted}")
        if name == SYNC_TRAINING:
            results = sync_forward(*inputs[:5], config, comm, stream)
            shapes = (data.shape, p_shape, p_shape, p_shape, p_shape, (1,))
        else:
            results = sync_backward(*inputs[:5], config, comm, stream)
            shapes = (data.shape, p_shape, p_shape, (1,))
        outputs = context.output_arrays(shapes, dtypes)
        for out, value in zip(outputs[:-1], results, strict=True):
            out[...] = value.reshape(out.shape)
        outputs[-1][...] = token + 1


def sync_op_specs(providers: Sequence[str]) -> tuple[SyncOpSpec, ...]:
    """The collective kernels for ``providers`` (float32 BN; float32 / float64 / int64 all-reduce)."""
    specs: list[SyncOpSpec] = []
    for provider in (p for p in (CPU, CUDA) if p in providers):
        specs += [SyncOpSpec(SYNC_TRAINING, provider, F32), SyncOpSpec(SYNC_GRAD, provider, F32)]
        specs += [SyncOpSpec(ALL_REDUCE, provider, dtype) for dtype in ALL_REDUCE_DTYPES]
    return tuple(specs)


def sync_op_model(op: str, *, dtype: Any = np.float32, name: str = "sync", **attributes: Any) -> Any:
    """A one-node ONNX model running a collective op (inputs / outputs named as in INPUT_NAMES / OUTPUT_NAMES),
    every dimension open: ranks feed batches of different sizes."""
    from onnx import helper

    from bnfuse.io import ort_compatible
    from bnfuse.runtime.ops import DOMAIN

    if op not in SYNC_OP_NAMES:
        raise BatchNormError(f"unknown collective op {op!r} (expected one of {', '.join(SYNC_OP_NAMES)})")
    code = helper.np_dtype_to_tensor_dtype(np.dtype(dtype))

    def info(names: Sequence[str]) -> list[Any]:
        last = len(names) - 1
        return [helper.make_tensor_value_info(n, 7 if i == last else code, None) for i, n in enumerate(names)]

    node = helper.make_node(op, list(INPUT_NAMES[op]), list(OUTPUT_NAMES[op]), name=name, domain=DOMAIN, **attributes)
    graph = helper.make_graph([node], op, info(INPUT_NAMES[op]), info(OUTPUT_NAMES[op]))
    opsets = [helper.make_opsetid("", 17), helper.make_opsetid(DOMAIN, 1)]
    return ort_compatible(helper.make_model(graph, opset_imports=opsets, producer_name="bnfuse"))
