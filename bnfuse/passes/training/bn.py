"""Training-mode batch normalization nodes: bnfuse's custom ops, or the same math in standard ONNX operators.

``training_node`` turns an inference BatchNormalization into bnfuse.BatchNormalizationTraining with
outputs (Y, running_mean, running_var, saved_mean, saved_inv_std); ``grad_node`` is its backward,
bnfuse.BatchNormalizationGrad(dY, X, scale, saved_mean, saved_inv_std) -> (dX, dScale, dBias).
``lower_portable`` rewrites both into standard ONNX nodes for runtimes without the bnfuse library (the
--portable graph): the forward as ONNX BatchNormalization(training_mode=1) where its semantics match, else
ReduceMean / ReduceSum / elementwise nodes; the formulas are the kernels' (bnfuse.runtime.semantics).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from bnfuse.attributes import float_attribute
from bnfuse.runtime.semantics import BatchNormConfig, BatchNormError, Mode, channel_axis, param_shape, reduction_axes

DOUBLE = TensorProto.DOUBLE
DOMAIN = "bnfuse"
TRAINING = "BatchNormalizationTraining"
GRAD = "BatchNormalizationGrad"


def config_attributes(config: BatchNormConfig) -> dict[str, object]:
    return {
        "epsilon": float(config.epsilon),
        "momentum": float(config.momentum),
        "momentum_convention": config.momentum_convention.value,
        "mode": config.mode.value,
        "axis": int(config.axis),
        "unbiased_running_var": int(config.unbiased_running_var),
        "fix_gamma": int(config.fix_gamma),
        "use_global_stats": int(config.use_global_stats),
        **({"activation": config.activation} if config.activation != "none" else {}),
    }


def grad_attributes(config: BatchNormConfig) -> dict[str, object]:
    keep = ("epsilon", "mode", "axis", "use_global_stats", "fix_gamma", "activation")
    return {k: v for k, v in config_attributes(config).items() if k in keep}


def config_of(node: onnx.NodeProto) -> BatchNormConfig:
    """The BatchNormConfig a bnfuse training or grad node was built with."""
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    attrs = {k: v.decode() if isinstance(v, bytes) else v for k, v in attrs.items()}
    return BatchNormConfig(
        epsilon=float_attribute(attrs, "epsilon", 1e-5),
        momentum=float_attribute(attrs, "momentum", 0.9),
        momentum_convention=attrs.get("momentum_convention", "onnx"),
        mode=Mode(attrs.get("mode", "spatial")),
        axis=attrs.get("axis", 1),
        unbiased_running_var=bool(attrs.get("unbiased_running_var", 0)),
        fix_gamma=bool(attrs.get("fix_gamma", 0)),
        use_global_stats=bool(attrs.get("use_global_stats", 0)),
        activation=attrs.get("activation", "none"),
    )


def fuse_relu(nodes: list[onnx.NodeProto], keep: set[str]) -> int:
    """Fold each Relu whose input is a bnfuse BN training node's Y, read by nothing else and not in ``keep`` (graph
    outputs), into that node (activation "relu", Y = the Relu's output); returns how many. Its reverse rule
    then emits one BatchNormalizationGrad masked by Y instead of Relu's Greater, Cast and Mul."""
    readers: dict[str, list[onnx.NodeProto]] = {}
    for node in nodes:
        for name in node.input:
            readers.setdefault(name, []).append(node)
    dropped: set[int] = set()
    for node in nodes:
        if node.domain != DOMAIN or node.op_type != TRAINING or config_of(node).activation != "none":
            continue
        y = node.output[0]
        users = readers.get(y, [])
        if y in keep or len(users) != 1 or users[0].op_type != "Relu" or users[0].domain not in ("", "ai.onnx"):
            continue
        relu = users[0]
        node.output[0] = relu.output[0]
        node.attribute.append(helper.make_attribute("activation", "relu"))
        dropped.add(id(relu))
    nodes[:] = [n for n in nodes if id(n) not in dropped]
    return len(dropped)


def training_node(inputs: Sequence[str], outputs: Sequence[str], config: BatchNormConfig, name: str) -> onnx.NodeProto:
    return helper.make_node(
        TRAINING, list(inputs), list(outputs), name=name, domain=DOMAIN, **config_attributes(config)
    )


def grad_node(inputs: Sequence[str], outputs: Sequence[str], config: BatchNormConfig, name: str) -> onnx.NodeProto:
    return helper.make_node(GRAD, list(inputs), list(outputs), name=name, domain=DOMAIN, **grad_attributes(config))


class _Emitter:
    """Appends standard nodes with unique names under one prefix."""

    def __init__(self, prefix: str, initializers: list[onnx.TensorProto], dtype: type = np.float32) -> None:
        self.prefix = prefix
        self.dtype = dtype  # of the float constants: the model's float type
        self.nodes: list[onnx.NodeProto] = []
        self.initializers = initializers
        self._count = 0

    def op(self, op_type: str, inputs: list[str], output: str | None = None, **attrs: object) -> str:
        self._count += 1
        output = output or f"{self.prefix}/{op_type.lower()}_{self._count}"
        self.nodes.append(helper.make_node(op_type, inputs, [output], **attrs))
        return output

    def const(self, value: object, dtype: type | None = None) -> str:
        self._count += 1
        name = f"{self.prefix}/const_{self._count}"
        self.initializers.append(numpy_helper.from_array(np.asarray(value, dtype or self.dtype), name))
        return name


def lower_portable(
    nodes: Sequence[onnx.NodeProto],
    rank_of: Callable[[str], tuple[int, ...]],
    initializers: list[onnx.TensorProto],
    dtype: type = np.float32,
) -> list[onnx.NodeProto]:
    """Replace every bnfuse training / grad node by standard ONNX nodes (opset >= 18 ReduceMean/ReduceSum).

    The forward is ONNX BatchNormalization with training_mode=1 (opset >= 14; onnxruntime's CPU kernel runs
    it) where that op computes exactly the training node (``onnx_training_bn_fits``): spatial statistics
    over the ONNX channel axis 1, batch statistics (not frozen) and a running update it can express,
    running*m + batch*(1-m) with the biased batch variance, m = 1 - batch weight in either convention.
    Opset 14+ BatchNormalization has no saved-statistics outputs, so the batch mean and inverse std the
    backward reads are recomputed beside it (ReduceMean). Frozen, per-activation, channels-last (rank > 2)
    and unbiased-running-variance nodes keep the Reduce* / elementwise forward. Checked on onnxruntime 1.32
    CPU only: its CUDA kernel has refused training_mode at opset >= 14 (onnxruntime issue #16867), and cuDNN's
    forward-training kernel updates the running variance with the unbiased variance. ``rank_of(name)`` gives
    the static shape of a data tensor (X); ``dtype`` that of its float constants (the model's).
    """
    result: list[onnx.NodeProto] = []
    for node in nodes:
        if node.domain == DOMAIN and node.op_type in (TRAINING, GRAD):
            if config_of(node).activation != "none":  # build_training_graph never fuses in portable graphs
                raise BatchNormError(f"BN node {node.name!r}: no portable lowering of a fused activation")
            shape = rank_of(node.input[0] if node.op_type == TRAINING else node.input[1])
            emit = _Emitter(node.name or node.output[0], initializers, dtype)
            (_lower_training if node.op_type == TRAINING else _lower_grad)(emit, node, config_of(node), shape)
            result.extend(emit.nodes)
        else:
            result.append(node)
    return result


def _layout(emit: _Emitter, config: BatchNormConfig, shape: tuple[int, ...]) -> tuple[str, str, str, int]:
    """(axes, broadcast shape, parameter shape) constants and the reduced element count M."""
    ndim = len(shape)
    axes = reduction_axes(config, ndim)
    pshape = param_shape(config, shape)
    if config.mode is Mode.SPATIAL:
        bshape = [1] * ndim
        bshape[channel_axis(config, ndim)] = shape[channel_axis(config, ndim)]
    else:
        bshape = [1, *shape[1:]]
    count = int(np.prod([shape[a] for a in axes]))
    return emit.const(list(axes), np.int64), emit.const(bshape, np.int64), emit.const(list(pshape), np.int64), count


def onnx_training_bn_fits(config: BatchNormConfig, shape: tuple[int, ...]) -> bool:
    """Whether ONNX BatchNormalization(training_mode=1) computes this training node's Y and running stats."""
    count = int(np.prod([shape[a] for a in reduction_axes(config, len(shape))]))
    return (
        config.mode is Mode.SPATIAL
        and channel_axis(config, len(shape)) == 1  # ONNX BN's channel axis is fixed at 1
        and not config.use_global_stats
        and not (config.unbiased_running_var and count > 1)  # ONNX updates with the biased variance
    )


def _lower_training(emit: _Emitter, node: onnx.NodeProto, config: BatchNormConfig, shape: tuple[int, ...]) -> None:
    x, scale, bias, running_mean, running_var = node.input[:5]
    out = list(node.output) + [""] * (6 - len(node.output))
    y, new_mean, new_var, saved_mean, saved_inv_std, batch_var = out
    axes, bshape, pshape, count = _layout(emit, config, shape)
    eps = emit.const(config.epsilon)
    if onnx_training_bn_fits(config, shape):
        _onnx_training_bn(emit, node, config, axes, pshape, eps)
        return
    if config.use_global_stats:
        mean_b = emit.op("Reshape", [running_mean, bshape])
        inv_b = emit.op("Reciprocal", [emit.op("Sqrt", [emit.op("Add", [running_var, eps])])])
        emit.op("Identity", [running_mean], saved_mean or None)
        emit.op("Identity", [inv_b], saved_inv_std or None)
        inv_b = emit.op("Reshape", [inv_b, bshape])
        xhat = emit.op("Mul", [emit.op("Sub", [x, mean_b]), inv_b])
        if new_mean:
            emit.op("Identity", [running_mean], new_mean)
        if new_var:
            emit.op("Identity", [running_var], new_var)
        if batch_var:
            emit.op("Identity", [running_var], batch_var)
    else:
        mean_b, centered = _centered(emit, x, axes)
        var_b = emit.op("ReduceMean", [emit.op("Mul", [centered, centered]), axes], keepdims=1)
        inv_b = emit.op("Reciprocal", [emit.op("Sqrt", [emit.op("Add", [var_b, eps])])])
        xhat = emit.op("Mul", [centered, inv_b])
        mean = emit.op("Reshape", [mean_b, pshape], saved_mean or None)
        if saved_inv_std:
            emit.op("Reshape", [inv_b, pshape], saved_inv_std)
        var = emit.op("Reshape", [var_b, pshape], batch_var or None)
        if config.unbiased_running_var and count > 1:
            var = emit.op("Mul", [var, _unbiased_factor(emit, x, axes)])
        weight = config.batch_weight
        keep, take = emit.const(1.0 - weight), emit.const(weight)
        if new_mean:
            emit.op("Add", [emit.op("Mul", [running_mean, keep]), emit.op("Mul", [mean, take])], new_mean)
        if new_var:
            emit.op("Add", [emit.op("Mul", [running_var, keep]), emit.op("Mul", [var, take])], new_var)
    if config.fix_gamma:
        emit.op("Add", [xhat, emit.op("Reshape", [bias, bshape])], y)
    else:
        emit.op(
            "Add", [emit.op("Mul", [xhat, emit.op("Reshape", [scale, bshape])]), emit.op("Reshape", [bias, bshape])], y
        )


def _onnx_training_bn(
    emit: _Emitter, node: onnx.NodeProto, config: BatchNormConfig, axes: str, pshape: str, eps: str
) -> None:
    """The forward as ONNX BatchNormalization(training_mode=1), the saved statistics recomputed beside it."""
    x, scale, bias, running_mean, running_var = node.input[:5]
    y, new_mean, new_var, saved_mean, saved_inv_std, batch_var = list(node.output) + [""] * (6 - len(node.output))
    if config.fix_gamma:
        scale = emit.op("Expand", [emit.const(1.0), pshape])
    # training_mode=1 needs all three outputs (ONNX shape inference rejects fewer), even when unread
    stats = [new_mean or f"{emit.prefix}/running_mean", new_var or f"{emit.prefix}/running_var"]
    emit.nodes.append(
        helper.make_node(
            "BatchNormalization",
            [x, scale, bias, running_mean, running_var],
            [y, *stats],
            name=f"{emit.prefix}/batch_normalization",
            epsilon=float(config.epsilon),
            momentum=float(1.0 - config.batch_weight),
            training_mode=1,
        )
    )
    if saved_mean or saved_inv_std or batch_var:
        mean_b, centered = _centered(emit, x, axes)
        if saved_mean:
            emit.op("Reshape", [mean_b, pshape], saved_mean)
        var_b = emit.op("ReduceMean", [emit.op("Mul", [centered, centered]), axes], keepdims=1)
        if batch_var:
            emit.op("Reshape", [var_b, pshape], batch_var)
        if saved_inv_std:
            inv_b = emit.op("Reciprocal", [emit.op("Sqrt", [emit.op("Add", [var_b, eps])])])
            emit.op("Reshape", [inv_b, pshape], saved_inv_std)


def _centered(emit: _Emitter, x: str, axes: str) -> tuple[str, str]:
    """(mean, x - mean) per channel, the mean in two passes: one float32 ReduceMean of a channel far from 0 (a
    stride-2 ConvTranspose's output is mostly its bias) rounds by ~1e-5 relative, which leaves sum(xhat) != 0 and a
    bias gradient that is 0 in exact arithmetic at -0.04 (bench/fuzz_training.py's seed 36, index 70); the mean of
    the first pass's residuals corrects it, as the kernels' float64 sums do."""
    first = emit.op("ReduceMean", [x, axes], keepdims=1)
    mean = emit.op("Add", [first, emit.op("ReduceMean", [emit.op("Sub", [x, first]), axes], keepdims=1)])
    return mean, emit.op("Sub", [x, mean])


def _unbiased_factor(emit: _Emitter, x: str, axes: str) -> str:
    """M / max(M - 1, 1) for the M values each channel reduces over, from X's shape at run time: in float64, then
    rounded to the model's float type, the constant ``count / (count - 1)`` a build for that shape would write, bit
    for bit. Not that constant: for large M its float32 is the same at every probe batch size of a dynamic-batch
    build (dynamic_batch.py; M / (M - 1) - 1 is under one float32 step apart there), which then kept it for every
    batch size (the running variance nearly biased). max(., 1): one value a channel leaves the variance 0."""
    shape = emit.op("Shape", [x])
    count = emit.op("Cast", [emit.op("ReduceProd", [emit.op("Gather", [shape, axes])], keepdims=0)], to=DOUBLE)
    one = emit.const(1.0, np.float64)
    factor = emit.op("Div", [count, emit.op("Max", [emit.op("Sub", [count, one]), one])])
    return emit.op("Cast", [factor], to=helper.np_dtype_to_tensor_dtype(np.dtype(emit.dtype)))


def _wide_sums(emit: _Emitter, dy: str, xhat: str, axes: str) -> tuple[str, str]:
    """(sum dY, sum dY * xhat) per channel, accumulated in float64 as the kernels' sums are, then rounded to the model's
    type. In float32 onnxruntime's ReduceSum of dY rounds by enough that the input gradient's per-channel sum, 0 in
    exact arithmetic, left a convolution bias before the BN 13x PyTorch float32's rounding residue
    (bench/fuzz_training.py seed 37, index 713: a portable graph)."""
    elem = helper.np_dtype_to_tensor_dtype(np.dtype(emit.dtype))
    if elem != DOUBLE:
        dy, xhat = emit.op("Cast", [dy], to=DOUBLE), emit.op("Cast", [xhat], to=DOUBLE)
    sums = [
        emit.op("ReduceSum", [dy, axes], keepdims=1),
        emit.op("ReduceSum", [emit.op("Mul", [dy, xhat]), axes], keepdims=1),
    ]
    if elem != DOUBLE:
        sums = [emit.op("Cast", [s], to=elem) for s in sums]
    return sums[0], sums[1]


def _lower_grad(emit: _Emitter, node: onnx.NodeProto, config: BatchNormConfig, shape: tuple[int, ...]) -> None:
    dy, x, scale, saved_mean, saved_inv_std = node.input[:5]
    dx, dscale, dbias = list(node.output) + [""] * (3 - len(node.output))
    axes, bshape, pshape, count = _layout(emit, config, shape)
    inv_b = emit.op("Reshape", [saved_inv_std, bshape])
    xhat = emit.op("Mul", [emit.op("Sub", [x, emit.op("Reshape", [saved_mean, bshape])]), inv_b])
    dbias_b, dscale_b = _wide_sums(emit, dy, xhat, axes)
    gain = inv_b if config.fix_gamma else emit.op("Mul", [emit.op("Reshape", [scale, bshape]), inv_b])
    if dx:
        if config.use_global_stats:
            emit.op("Mul", [dy, gain], dx)
        else:
            inv_count = emit.const(1.0 / count)
            centered = emit.op(
                "Sub",
                [
                    emit.op("Sub", [dy, emit.op("Mul", [dbias_b, inv_count])]),
                    emit.op("Mul", [xhat, emit.op("Mul", [dscale_b, inv_count])]),
                ],
            )
            emit.op("Mul", [centered, gain], dx)
    if dscale:
        if config.fix_gamma:
            emit.op("Mul", [emit.op("Reshape", [dscale_b, pshape]), emit.const(0.0)], dscale)
        else:
            emit.op("Reshape", [dscale_b, pshape], dscale)
    if dbias:
        emit.op("Reshape", [dbias_b, pshape], dbias)
