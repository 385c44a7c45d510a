"""Float64 oracle for bnfuse's training graphs: run a graph built from a float64 model with onnx's reference
evaluator and compare its steps with PyTorch float64 at 1e-9.

onnxruntime's CPU provider has no float64 Conv / pooling kernels, so a float64 training graph cannot run in a
TrainingSession. This module runs it with ``onnx.reference.ReferenceEvaluator`` (a second engine, used only as
an oracle here), with:

* bnfuse's custom ops as ``OpRun`` classes: BatchNormalizationTraining / Grad / Inference on bnfuse's NumPy float64
  reference kernels (bnfuse/runtime/reference.py), ConvWeightGrad / ConvInputGrad on their NumPy float64
  gradients, SGDStep / AdamStep as the float64 update those ops compute (bnfuse/runtime/optimizer_ops.py);
* Conv and ConvTranspose in NumPy float64 (one einsum per kernel offset): the evaluator's own are too slow for
  real networks; HardSwish with 1/6 in float64 (onnx's is its function body, with a float32 alpha); AveragePool in NumPy
  (onnx's reference averages a wrong window where a ceil_mode window overhangs the input); MaxPool in NumPy
  (onnx's reference gives wrong Indices at stride 1, where windows overlap, which the MaxPool gradient rule
  gathers by; and with ceil_mode keeps a last window starting in the end padding, which onnxruntime and PyTorch
  drop); Erf and Gelu to float64 precision (onnx's are off by 3e-8 and 8e-8).

The graph is what ``build_training_graph`` makes of the float64 export (``model.double()``): the same rules and
variants as float32, every value in float64. ONNX float attributes are float32, so the PyTorch reference is given
the values the graph holds (``graph_hyperparameters``: BN epsilon and momentum rounded through float32);
``lr`` is a float64 input. Used by bench/train_architectures.py ``--float64`` and
tests/passes/training/test_float64_check.py; docs/training.md ("Float64 verification") describes it.
"""

from __future__ import annotations

import contextlib
import copy
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import onnx
from onnx import helper, numpy_helper
from onnx.reference import ReferenceEvaluator
from onnx.reference.op_run import OpRun

from bnfuse.passes.training.spec import read_spec
from bnfuse.runtime import ops, reference

RTOL = 1e-9
LR = 0.05
PERTURBATION = 1e-15  # relative change of the inputs for PyTorch float64's own spread (check_variants)
CHAOS_FACTOR = 10  # float64-chaotic: PyTorch's spread > RTOL and the graph within this factor of it

# -- bnfuse's custom ops ------------------------------------------------------------------------------------


class _NodeAttributes:
    """ops.AttributeSource over an onnx NodeProto."""

    def __init__(self, node: onnx.NodeProto) -> None:
        self._values = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        self._name = node.name

    def float_attr(self, name: str, default: float) -> float:
        return float(self._values.get(name, default))

    def int_attr(self, name: str, default: int) -> int:
        return int(self._values.get(name, default))

    def string_attr(self, name: str, default: str) -> str:
        value = self._values.get(name, default)
        return value.decode() if isinstance(value, bytes) else str(value)

    def node_name(self) -> str:
        return self._name

    def get(self, name: str, default: Any = None) -> Any:
        return self._values.get(name, default)


class _BnfuseOp(OpRun):
    op_domain = "bnfuse"

    def _attrs(self) -> _NodeAttributes:
        return _NodeAttributes(self.onnx_node)

    def _config(self) -> Any:
        return ops.parse_config(type(self).__name__, self._attrs())


class BatchNormalizationTraining(_BnfuseOp):
    def _run(self, x, scale, bias, mean, var, **_):  # noqa: ANN001, ANN202
        out = reference.forward_training(x, scale, bias, mean, var, self._config())
        return tuple(out)[: len(self.onnx_node.output)]


class BatchNormalizationInference(_BnfuseOp):
    def _run(self, x, scale, bias, mean, var, **_):  # noqa: ANN001, ANN202
        return (reference.forward_inference(x, scale, bias, mean, var, self._config()),)


class BatchNormalizationGrad(_BnfuseOp):
    def _run(self, dy, x, scale, saved_mean, saved_inv_std, y=None, **_):  # noqa: ANN001, ANN202
        return tuple(reference.backward(dy, x, scale, saved_mean, saved_inv_std, self._config(), y))


class ConvWeightGrad(_BnfuseOp):
    def _run(self, x, dy, **_):  # noqa: ANN001, ANN202
        a = self._attrs()
        if a.get("x_block", 0):
            raise NotImplementedError("ConvWeightGrad with x_block (an NCHWc session rewrite) is not an oracle input")
        grad = reference.conv_weight_grad(
            x, dy, tuple(a.get("kernel_shape")), tuple(a.get("strides")), tuple(a.get("dilations")),
            tuple(a.get("pads")), int(a.get("group", 1)),
        )  # fmt: skip
        return (grad.astype(x.dtype),)


class ConvInputGrad(_BnfuseOp):
    def _run(self, dy, w, **_):  # noqa: ANN001, ANN202
        a = self._attrs()
        spatial = len(a.get("kernel_shape"))
        grad = reference.conv_input_grad(
            dy, w, tuple(a.get("output_shape")), tuple(a.get("strides") or [1] * spatial),
            tuple(a.get("dilations") or [1] * spatial), tuple(a.get("pads") or [0] * 2 * spatial),
            int(a.get("group", 1)),
        )  # fmt: skip
        return (grad.astype(dy.dtype),)


def _hypers(node: onnx.NodeProto) -> tuple[list[float], list[float], _NodeAttributes]:
    a = _NodeAttributes(node)
    return list(a.get("weight_decays")), list(a.get("lr_scales")), a


class SGDStep(_BnfuseOp):
    """bnfuse.SGDStep in the inputs' precision: d = g + wd * p; buf = m * buf + d; d = d + m * buf (nesterov) or
    buf; p -= lr * scale * d."""

    def _run(self, lr, *tensors, **_):  # noqa: ANN001, ANN202
        decays, scales, a = _hypers(self.onnx_node)
        momentum, nesterov = a.float_attr("momentum", 0.0), bool(a.int_attr("nesterov", 0))
        per = 3 if momentum else 2
        params = []
        for index, (decay, scale) in enumerate(zip(decays, scales, strict=True)):
            param, grad, *buf = tensors[index * per : (index + 1) * per]
            d = grad + param * decay if decay else grad
            if momentum:
                new_buf = buf[0] * momentum + d
                d = d + new_buf * momentum if nesterov else new_buf
                params.append([param - d * (lr * scale), new_buf])
            else:
                params.append([param - d * (lr * scale)])
        return tuple(v for group in params for v in group)


class AdamStep(_BnfuseOp):
    """bnfuse.AdamStep in the inputs' precision: m, v moving averages; p -= step_size * scale * m / (sqrt(v) / root
    + eps) with step_size = lr / (1 - beta1^t), root = sqrt(1 - beta2^t) (computed by the graph)."""

    def _run(self, step_size, root, *tensors, **_):  # noqa: ANN001, ANN202
        decays, scales, a = _hypers(self.onnx_node)
        beta1, beta2, eps = a.float_attr("beta1", 0.9), a.float_attr("beta2", 0.999), a.float_attr("epsilon", 1e-8)
        result = []
        for index, (decay, scale) in enumerate(zip(decays, scales, strict=True)):
            param, grad, m, v = tensors[index * 4 : (index + 1) * 4]
            d = grad + param * decay if decay else grad
            m = m * beta1 + d * (1.0 - beta1)
            v = v * beta2 + d * d * (1.0 - beta2)
            result += [param - m / (np.sqrt(v) / root + eps) * (step_size * scale), m, v]
        return tuple(result)


class HardSwish(OpRun):
    """x * clip(x / 6 + 1/2, 0, 1) with 1/6 in float64: onnx's own evaluates its function body, whose HardSigmoid
    holds alpha as a float32 attribute (1/6 off by 3e-8), while the derivative rule (onnx-ad) and PyTorch use 1/6."""

    def _run(self, x, **_):  # noqa: ANN001, ANN202
        return ((x * np.clip(x / 6.0 + 0.5, 0.0, 1.0)).astype(x.dtype),)


# -- fast float64 Conv / ConvTranspose --------------------------------------------------------------------


def _conv_parts(node: onnx.NodeProto, spatial: int, kernel: Sequence[int]) -> tuple[list, list, list, int]:
    a = _NodeAttributes(node)
    auto_pad = a.string_attr("auto_pad", "NOTSET")
    if auto_pad not in ("NOTSET", "VALID"):
        raise NotImplementedError(f"{node.op_type} auto_pad={auto_pad} (the training pass writes explicit pads)")
    strides = list(a.get("strides") or [1] * spatial)
    dilations = list(a.get("dilations") or [1] * spatial)
    pads = list(a.get("pads") or [0] * (2 * spatial))
    return strides, dilations, pads, int(a.get("group", 1))


class Conv(OpRun):
    def _run(self, x, w, b=None, **_):  # noqa: ANN001, ANN202
        spatial = x.ndim - 2
        kernel = w.shape[2:]
        strides, dilations, pads, group = _conv_parts(self.onnx_node, spatial, kernel)
        n, channels = x.shape[:2]
        out_channels = w.shape[0]
        padded = np.pad(x, [(0, 0), (0, 0)] + [(pads[i], pads[i + spatial]) for i in range(spatial)])
        out = [(padded.shape[2 + i] - ((kernel[i] - 1) * dilations[i] + 1)) // strides[i] + 1 for i in range(spatial)]
        grouped_w = w.reshape(group, out_channels // group, channels // group, *kernel)
        y = np.zeros((n, group, out_channels // group, int(np.prod(out))), dtype=np.result_type(x, w))
        for offset in np.ndindex(*kernel):
            window = tuple(
                slice(k * d, k * d + (o - 1) * s + 1, s)
                for k, d, o, s in zip(offset, dilations, out, strides, strict=True)
            )
            patch = padded[(slice(None), slice(None), *window)].reshape(n, group, channels // group, -1)
            y += np.einsum("ngcp,goc->ngop", patch, grouped_w[(slice(None), slice(None), slice(None), *offset)])
        y = y.reshape(n, out_channels, *out)
        if b is not None:
            y = y + b.reshape(1, -1, *([1] * spatial))
        return (y.astype(x.dtype),)


class ConvTranspose(OpRun):
    """The adjoint of Conv: every input position scatters W's taps into the (strided, dilated) output."""

    def _run(self, x, w, b=None, **_):  # noqa: ANN001, ANN202
        spatial = x.ndim - 2
        kernel = w.shape[2:]
        strides, dilations, pads, group = _conv_parts(self.onnx_node, spatial, kernel)
        a = _NodeAttributes(self.onnx_node)
        output_padding = list(a.get("output_padding") or [0] * spatial)
        n, channels, size = x.shape[0], x.shape[1], x.shape[2:]
        per_group_out = w.shape[1]
        full = [(size[i] - 1) * strides[i] + (kernel[i] - 1) * dilations[i] + 1 + output_padding[i] for i in
                range(spatial)]  # fmt: skip
        y = np.zeros((n, group, per_group_out, *full), dtype=np.result_type(x, w))
        xg = x.reshape(n, group, channels // group, *size)
        wg = w.reshape(group, channels // group, per_group_out, *kernel)
        for offset in np.ndindex(*kernel):
            window = tuple(
                slice(k * d, k * d + (s_in - 1) * s + 1, s)
                for k, d, s_in, s in zip(offset, dilations, size, strides, strict=True)
            )
            tap = wg[(slice(None), slice(None), slice(None), *offset)]
            y[(slice(None), slice(None), slice(None), *window)] += np.einsum("ngc...,gco->ngo...", xg, tap)
        y = y.reshape(n, group * per_group_out, *full)
        if a.get(
            "output_shape"
        ):  # ONNX: pads from the requested size (the start gets the smaller half unless SAME_UPPER)
            wanted = list(a.get("output_shape"))[-spatial:]
            upper = a.string_attr("auto_pad", "NOTSET") == "SAME_UPPER"
            total = [full[i] - wanted[i] for i in range(spatial)]
            pads = [t // 2 if upper else t - t // 2 for t in total] + [t - t // 2 if upper else t // 2 for t in total]
        if min(pads) < 0:  # a negative pad: zeros past the scattered values
            grow = [(0, 0), (0, 0)] + [(max(-pads[i], 0), max(-pads[i + spatial], 0)) for i in range(spatial)]
            y, pads = np.pad(y, grow), [max(v, 0) for v in pads]
        crop = tuple(slice(pads[i], y.shape[2 + i] - pads[i + spatial]) for i in range(spatial))
        y = y[(slice(None), slice(None), *crop)]
        if b is not None:
            y = y + b.reshape(1, -1, *([1] * spatial))
        return (np.ascontiguousarray(y).astype(x.dtype),)


def _pool_geometry(a: _NodeAttributes, size: Sequence[int]) -> tuple[list[int], ...]:
    """A pool node's kernel, strides, dilations, pads and output size as onnxruntime and PyTorch give it: with
    ceil_mode a last window that would start in the end padding is dropped."""
    spatial, out = len(size), []
    kernel = list(a.get("kernel_shape"))
    strides = list(a.get("strides") or [1] * spatial)
    dilations = list(a.get("dilations") or [1] * spatial)
    pads = list(a.get("pads") or [0] * (2 * spatial))
    if a.string_attr("auto_pad", "NOTSET") not in ("NOTSET", "VALID"):
        raise NotImplementedError("pooling with auto_pad")
    ceil = bool(a.int_attr("ceil_mode", 0))
    for i in range(spatial):
        span = size[i] + pads[i] + pads[spatial + i] - dilations[i] * (kernel[i] - 1) - 1
        # onnxruntime's size: truncated, not floored (a window larger than the padded input, as the TorchScript
        # exporter writes for AdaptiveMaxPool2d(1) after a pool ONNX shape inference sized too large, is one window)
        count = (-(-span // strides[i]) if ceil else int(span / strides[i])) + 1
        if ceil and (count - 1) * strides[i] >= size[i] + pads[i]:
            count -= 1
        out.append(count)
    return kernel, strides, dilations, pads, out


def average_pool(x: np.ndarray, node: onnx.NodeProto) -> np.ndarray:
    """ONNX AveragePool as onnxruntime and PyTorch compute it, also where a ceil_mode window overhangs the padded
    input (onnx's reference evaluator averages a wrong window there: 4 x 4, kernel 3, stride 3). Per axis, the
    window of output o takes the taps o * s - pad_begin + j * d (j < k) before size + pad_end; its divisor counts
    them (count_include_pad) or only those inside the input; the divisor of a window is the product of its axes'
    (PyTorch's pool_size). So the pool is a matrix per axis, applied axis by axis."""
    a, spatial = _NodeAttributes(node), x.ndim - 2
    kernel, strides, dilations, pads, out = _pool_geometry(a, x.shape[2:])
    include_pad = bool(a.int_attr("count_include_pad", 0))
    y, divisor = x.astype(np.float64), np.ones(out)
    for i in range(spatial):
        size = x.shape[2 + i]
        window = np.zeros((out[i], size))
        counts = np.zeros(out[i])
        for o in range(out[i]):
            taps = [t for t in range(o * strides[i] - pads[i], size + pads[spatial + i])][:: dilations[i]]
            taps = taps[: kernel[i]]
            inside = [t for t in taps if 0 <= t < size]
            window[o, inside] = 1.0
            counts[o] = len(taps) if include_pad else len(inside)
        y = np.moveaxis(np.tensordot(y, window, axes=([2 + i], [1])), -1, 2 + i)
        divisor = divisor * counts.reshape([-1 if j == i else 1 for j in range(spatial)])
    return (y / divisor).astype(x.dtype)


class AveragePool(OpRun):
    def _run(self, x, **_):  # noqa: ANN001, ANN202
        return (average_pool(x, self.onnx_node),)


def max_pool(x: np.ndarray, node: onnx.NodeProto) -> tuple[np.ndarray, np.ndarray]:
    """ONNX MaxPool (storage_order 0) as onnxruntime and PyTorch compute it: the values, and the Indices output (the
    flat index into x of each window's first maximum in scan order); with ceil_mode a last window that would start
    in the end padding is dropped."""
    a, spatial = _NodeAttributes(node), x.ndim - 2
    if a.int_attr("storage_order", 0):
        raise NotImplementedError("MaxPool with storage_order=1")
    kernel, strides, dilations, pads, out = _pool_geometry(a, x.shape[2:])
    # pad the end further where ceil_mode's last window reaches past the padded input
    ends = [max(pads[spatial + i], (out[i] - 1) * strides[i] + dilations[i] * (kernel[i] - 1) + 1 - pads[i]
                - x.shape[2 + i]) for i in range(spatial)]  # fmt: skip
    widths = [(0, 0), (0, 0)] + [(pads[i], ends[i]) for i in range(spatial)]
    padded = np.pad(x, widths, constant_values=-np.inf)
    positions = np.pad(np.arange(x.size, dtype=np.int64).reshape(x.shape), widths, constant_values=-1)
    best = np.full((*x.shape[:2], *out), -np.inf, x.dtype)
    index = np.full(best.shape, -1, np.int64)
    for offset in np.ndindex(*kernel):
        window = tuple(
            slice(k * d, k * d + (o - 1) * s + 1, s) for k, d, o, s in zip(offset, dilations, out, strides, strict=True)
        )
        values = padded[(slice(None), slice(None), *window)]
        better = values > best
        best = np.where(better, values, best)
        index = np.where(better, positions[(slice(None), slice(None), *window)], index)
    return best, index


class MaxPool(OpRun):
    def _run(self, x, **_):  # noqa: ANN001, ANN202
        y, indices = max_pool(x, self.onnx_node)
        return (y, indices) if len(self.onnx_node.output) > 1 and self.onnx_node.output[1] else (y,)


_erf = np.vectorize(math.erf, otypes=[np.float64])


class Erf(OpRun):
    """erf to float64 precision (onnx's reference is off by ~3e-8 in float64)."""

    def _run(self, x, **_):  # noqa: ANN001, ANN202
        return (_erf(x).astype(x.dtype),)


class Gelu(OpRun):
    """Gelu (opset 20, the dynamo exporter's) to float64 precision (onnx's reference is off by ~8e-8 in float64)."""

    def _run(self, x, **_):  # noqa: ANN001, ANN202
        if _NodeAttributes(self.onnx_node).string_attr("approximate", "none") == "tanh":
            inner = math.sqrt(2.0 / math.pi) * (x + 0.044715 * x**3)
            return ((0.5 * x * (1.0 + np.tanh(inner))).astype(x.dtype),)
        return ((0.5 * x * (1.0 + _erf(x / math.sqrt(2.0)))).astype(x.dtype),)


CUSTOM_OPS = (
    BatchNormalizationTraining, BatchNormalizationInference, BatchNormalizationGrad, ConvWeightGrad, ConvInputGrad,
    SGDStep, AdamStep, Conv, ConvTranspose, HardSwish, MaxPool, AveragePool, Erf, Gelu,
)  # fmt: skip


def evaluator(model: onnx.ModelProto) -> ReferenceEvaluator:
    """The reference evaluator for a bnfuse training graph (custom ops and fast Conv / ConvTranspose)."""
    return ReferenceEvaluator(model, new_ops=list(CUSTOM_OPS))


# -- running a training graph -----------------------------------------------------------------------------


@dataclass
class Run:
    losses: list[float]
    state: dict[str, np.ndarray]  # under the input model's names (TrainingSession.state_dict)


class ReferenceTrainer:
    """Steps of a training graph in the reference evaluator, state fed back as TrainingSession does."""

    def __init__(self, model: onnx.ModelProto) -> None:
        self.spec = read_spec(model)
        self.engine = evaluator(model)
        initial = {t.name: t for t in model.graph.initializer}
        self.state = {name: numpy_helper.to_array(initial[name]).copy() for name in self.spec.state}
        lr_type = next(i for i in model.graph.input if i.name == self.spec.lr).type.tensor_type.elem_type
        self.lr_dtype = helper.tensor_dtype_to_np_dtype(lr_type)
        self.intermediates: dict[str, np.ndarray] = {}

    def step(
        self, data: Sequence[np.ndarray], targets: Sequence[np.ndarray], lr: float, *, keep: bool = False
    ) -> float:
        feeds = dict(zip(self.spec.data, data, strict=True)) | dict(zip(self.spec.targets, targets, strict=True))
        feeds[self.spec.lr] = np.array(lr, self.lr_dtype)
        feeds.update(self.state)
        names = [self.spec.loss, *self.spec.state.values()]
        if keep:  # every intermediate value too (for walking a mismatch back to its first tensor)
            names = list(dict.fromkeys(names + [o for n in self.engine.proto_.graph.node for o in n.output if o]))
        values = dict(zip(names, self.engine.run(names, feeds), strict=True))
        if keep:
            self.intermediates = values
        self.state = {name: values[out] for name, out in self.spec.state.items()}
        return float(values[self.spec.loss])

    def state_dict(self) -> dict[str, np.ndarray]:
        names = self.spec.parameters + self.spec.running_stats
        renamed = self.spec.original_names
        result = {name: self.state[name] for name in names if name not in renamed}
        for name in names:
            if name in renamed:
                result.setdefault(renamed[name], self.state[name])
        return result


def run_graph(model: onnx.ModelProto, data: Sequence[tuple[np.ndarray, np.ndarray]], lr: float = LR) -> Run:
    trainer = ReferenceTrainer(model)
    losses = [trainer.step([x], [y], lr) for x, y in data]
    return Run(losses, trainer.state_dict())


# -- PyTorch's side ---------------------------------------------------------------------------------------


def graph_hyperparameters(net: Any) -> Any:
    """A float64 copy of ``net`` whose BN epsilon / momentum, LeakyReLU slope and ELU alpha are the float32 values the
    ONNX graph holds (ONNX float attributes are float32; PyTorch's momentum m is exported as the attribute 1 - m)."""
    import torch

    net = copy.deepcopy(net).to(torch.float64)
    _float32_hard_gates(net)
    for module in net.modules():
        if isinstance(module, torch.nn.modules.batchnorm._BatchNorm):
            module.eps = float(np.float32(module.eps))
            if module.momentum is not None:
                module.momentum = 1.0 - float(np.float32(1.0 - module.momentum))
        if isinstance(module, torch.nn.LeakyReLU):  # ONNX LeakyRelu's alpha is a float32 attribute
            module.negative_slope = float(np.float32(module.negative_slope))
        if isinstance(module, torch.nn.ELU):
            module.alpha = float(np.float32(module.alpha))
    return net


HARD_SLOPE = float(np.float32(1.0 / 6.0))  # ONNX HardSigmoid's alpha as the graph holds it (float32)


def _float32_hard_gates(net: Any) -> None:
    """Replace Hardsigmoid by its ONNX form with the float32 slope the exporter writes (HardSigmoid's alpha attribute
    = float32(1/6)); forward and derivative then use the value the graph holds. (HardSwish has no attribute: the
    oracle's HardSwish uses 1/6, as PyTorch.)"""
    import torch

    class Gate(torch.nn.Module):
        def forward(self, x: Any) -> Any:
            return torch.clamp(x * HARD_SLOPE + 0.5, 0.0, 1.0)

    for parent in list(net.modules()):
        for child_name, child in list(parent.named_children()):
            if isinstance(child, torch.nn.Hardsigmoid):
                setattr(parent, child_name, Gate())


@contextlib.contextmanager
def one_torch_thread() -> Iterator[None]:
    """PyTorch at one intra-op thread (its float64 convolutions took 2-5x longer with two threads on a loaded
    2-core machine); the caller's setting restored after."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def torch_steps(net: Any, data: Sequence[tuple[np.ndarray, np.ndarray]], lr: float = LR) -> Run:
    """PyTorch float64 SGD steps (train mode) from ``net``'s weights, with the graph's hyperparameters."""
    return torch_runs(net, data, lr)[-1]


def torch_runs(
    net: Any,
    data: Sequence[tuple[np.ndarray, np.ndarray]],
    lr: float = LR,
    optimizer: str = "sgd",
    dtype: Any = None,
) -> list[Run]:
    """The state after each of the steps, in one run (PyTorch's float64 convolutions are slow). ``optimizer``: "sgd"
    or "adam" (PyTorch's defaults, betas as the float32 values the graph holds: bnfuse writes them as ONNX floats).
    ``dtype``: the torch dtype the steps run in (default float64; the states are float64 NumPy either way)."""
    import torch

    dtype = torch.float64 if dtype is None else dtype
    net = graph_hyperparameters(net).to(dtype).train()
    if optimizer == "adam":
        betas = (float(np.float32(0.9)), float(np.float32(0.999)))
        opt = torch.optim.Adam(net.parameters(), lr=lr, betas=betas, eps=1e-8)
    else:
        opt = torch.optim.SGD(net.parameters(), lr=lr)
    losses, runs = [], []
    with one_torch_thread():
        for x, labels in data:
            opt.zero_grad()
            inputs = torch.from_numpy(np.asarray(x)).to(dtype)
            loss = torch.nn.functional.cross_entropy(net(inputs), torch.from_numpy(labels))
            loss.backward()
            opt.step()
            losses.append(float(loss.detach()))
            state = {
                k: v.detach().to(torch.float64).numpy().copy()
                for k, v in net.state_dict().items()
                if not k.endswith("num_batches_tracked")
            }
            runs.append(Run(list(losses), state))
    return runs


def export64(name: str, shape: tuple[int, ...]) -> tuple[Any, onnx.ModelProto]:
    """bench/archs.py's architecture ``name`` (float32, for torch_steps) and its float64 TorchScript export."""
    import torch

    from bench import archs

    with one_torch_thread():
        return archs.create(name), archs.export(archs.create(name).double(), shape, torch.float64)


def float64_batches(
    shape: tuple[int, ...], classes: int, steps: int, seed: int = 1
) -> list[tuple[np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(seed)
    return [(rng.standard_normal(shape), rng.integers(0, classes, shape[0]).astype(np.int64)) for _ in range(steps)]


SCALE_FLOOR = 1e-3


def relative_error(actual: np.ndarray, expected: np.ndarray, floor: float = SCALE_FLOOR) -> float:
    """max |actual - expected| / max(max |expected|, floor) over the tensor (bench/archs.py's measure)."""
    actual, expected = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    return float(np.max(np.abs(actual - expected))) / max(float(np.max(np.abs(expected))), floor)


def worst(actual: dict[str, np.ndarray], expected: dict[str, np.ndarray]) -> tuple[float, str]:
    """(largest relative error, its tensor) over ``expected``'s names; a missing name is an infinite error."""
    errors = [(relative_error(actual[k], v) if k in actual else float("inf"), k) for k, v in expected.items()]
    return max(errors)


# -- the variants -----------------------------------------------------------------------------------------

# build_training_graph keyword sets, each one option away from the default (a dynamic batch dimension, fused ReLU,
# fused optimizer, bnfuse's BN ops): every variant whose graph is standard ONNX + bnfuse ops. NCHWc is a rewrite
# TrainingSession makes inside onnxruntime, so it is not a graph this oracle can run (docs/training.md).
VARIANTS: dict[str, dict[str, Any]] = {
    "default": {},
    "static-batch": {"static_batch": True},
    "relu-unfused": {"fuse_relu": False},
    "optimizer-unfused": {"fused_optimizer": False},
    "portable": {"portable": True},
}


def check_variants(
    build: Callable[..., tuple[onnx.ModelProto, Any]],
    model: onnx.ModelProto,
    net: Any,
    data: Sequence[tuple[np.ndarray, np.ndarray]],
    variants: dict[str, dict[str, Any]] | None = None,
    lr: float = LR,
    optimizer: str = "sgd",
) -> dict[str, dict[str, Any]]:
    """Per variant: the largest relative error against PyTorch float64 after each step (and its tensor), PyTorch
    float64's own spread after each step, the losses, and the graph's state after the last step (for comparing the
    variants with each other)."""
    results: dict[str, dict[str, Any]] = {}
    references = torch_runs(net, data, lr, optimizer)
    # PyTorch float64's own spread: the same steps from inputs moved by ~5 ulp (a network whose BNs reduce over
    # 1-2 values per channel amplifies rounding by up to 1/sqrt(eps) per layer: float64-chaotic)
    moved = torch_runs(net, [(x * (1.0 + PERTURBATION), y) for x, y in data], lr, optimizer)
    spread = [worst(run.state, reference.state)[0] for run, reference in zip(moved, references, strict=True)]
    batch = data[0][0].shape[0]
    for name, options in (variants or VARIANTS).items():
        train_model, _ = build(model, batch_size=batch, optimizer=optimizer, **options)
        trainer = ReferenceTrainer(train_model)
        errors, losses = [], []
        for k, (x, y) in enumerate(data):
            losses.append(trainer.step([x], [y], lr))
            errors.append(worst(trainer.state_dict(), references[k].state))
        results[name] = {
            "errors": errors,
            "spread": spread,
            "losses": losses,
            # per step: the first is the forward of the shared initial state; step k + 1's follows the state after k
            "loss_errors": [abs(a - b) / abs(b) for a, b in zip(losses, references[-1].losses, strict=True)],
            "state": trainer.state_dict(),
        }
    return results


def verdict(errors: Sequence[float], spread: Sequence[float]) -> str:
    """matches (every step within RTOL), float64-chaotic (PyTorch float64's own spread > RTOL at a step where the
    graph is off, and the graph within CHAOS_FACTOR of that spread), else MISMATCH."""
    if all(e <= RTOL for e in errors):
        return "matches"
    if all(e <= RTOL or (s > RTOL and e <= CHAOS_FACTOR * s) for e, s in zip(errors, spread, strict=True)):
        return "float64-chaotic"
    return "MISMATCH"
