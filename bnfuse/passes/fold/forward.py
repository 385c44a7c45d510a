"""Forward folds: a BN folded into the Conv, ConvTranspose, Gemm or MatMul that reads its output, through
shape-only ops (Identity, inference Dropout, Flatten, a (batch, features) Reshape)."""

from __future__ import annotations

import numpy as np
import onnx_graphsurgeon as gs

from bnfuse.attributes import float_attribute
from bnfuse.passes.fold import fold_math
from bnfuse.passes.fold.bounds import conv_border_effect, deconv_border_effect, require_magnitudes
from bnfuse.passes.fold.context import (
    FLOAT_DTYPES,
    NotFoldable,
    Plan,
    describe,
    has_input,
    is_default_domain,
)
from bnfuse.passes.fold.fold_math import ChannelAffine, NotRepresentableError
from bnfuse.passes.fold.surgery import GraphSurgery


def forward_plan(surgery: GraphSurgery, bn: gs.Node, affine: ChannelAffine) -> Plan:
    """Fold into the linear consumer of the BN output, through shape-only ops (see the module docstring)."""
    x, tensor = bn.inputs[0], bn.outputs[0]
    first: gs.Node | None = None
    passthrough: list[gs.Node] = []
    flattened = False
    while True:
        node = _only_reader(surgery, tensor)
        first = first or node
        passthrough.append(node)
        if node.op in ("Identity", "Dropout"):
            surgery.require_inference_dropout(node)
        elif node.op == "Flatten":
            rank = surgery.ctx.types.rank(tensor)
            axis = int(node.attrs.get("axis", 1))
            if rank is None or (axis + rank if axis < 0 else axis) != 1:
                raise NotFoldable(f"{describe(node)} does not flatten to (batch, features)")
            flattened = True
        elif node.op == "Reshape":
            _require_batch_features_reshape(surgery, node, x)
            flattened = True
        else:
            passthrough.pop()
            break
        tensor = node.outputs[0]
    consumer = node
    spread = surgery.input_spread(bn)
    if consumer.op in ("Conv", "ConvTranspose") and not flattened:
        weight, bias = _forward_conv_values(surgery, consumer, affine, spread)
        output_node = consumer
    elif consumer.op in ("Gemm", "MatMul"):
        weight, bias, output_node = _forward_matrix_values(surgery, consumer, tensor, affine, flattened, spread)
    else:
        raise NotFoldable(f"consumer {describe(consumer)} ({consumer.op}) cannot absorb a per-channel map")

    def apply() -> None:
        # The BN's output vanishes; the first tensor holding the same values in both models is the
        # consumer's result (a MatMul's bias Add writes it where there is one).
        result = output_node.outputs[0] if output_node is not None else consumer.outputs[0]
        surgery.ctx.superseded[bn.outputs[0].name] = result.name
        surgery.retire(bn, [])
        first.inputs[0] = x
        # They now carry the values before the BN: renamed (at commit, after every lookup by name) so
        # that no name means one thing in the original and another in the optimized model.
        surgery.renamed.extend((node.outputs[0], "_before_bn") for node in passthrough)
        surgery.set_constant(consumer, 1, weight)
        if bias is None:
            return
        if consumer.op == "MatMul":
            if output_node is None:
                surgery.append_bias_add(consumer, bias)
            else:
                index = 0 if surgery.ctx.resolver.value(output_node.inputs[0]) is not None else 1
                surgery.set_constant(output_node, index, bias)
            return
        if consumer.op == "Gemm":
            consumer.attrs["beta"] = 1.0
        surgery.set_constant(consumer, 2, bias)

    had_bias = output_node is not None and (consumer.op == "MatMul" or has_input(consumer, 2))
    added = 0 if bias is None or had_bias else int(np.size(bias))
    return Plan("forward", describe(consumer), added, apply)


def _only_reader(surgery: GraphSurgery, tensor: gs.Tensor) -> gs.Node:
    """The one node reading ``tensor`` (as its first input), which the forward fold may rewrite."""
    if id(tensor) in surgery.outputs or id(tensor) in surgery.ctx.graph_outputs:
        raise NotFoldable(f"'{tensor.name}' is a graph output")
    if len(tensor.outputs) != 1:
        raise NotFoldable(f"'{tensor.name}' has {len(tensor.outputs)} consumers")
    node = tensor.outputs[0]
    if id(node) not in surgery.own_nodes or not is_default_domain(node):
        raise NotFoldable(f"consumer {describe(node)} ({node.op}) cannot absorb a per-channel map")
    if node.inputs[0] is not tensor or any(t is tensor for t in node.inputs[1:]):
        raise NotFoldable(f"'{tensor.name}' is not only the data input of {describe(node)}")
    return node


def _require_batch_features_reshape(surgery: GraphSurgery, node: gs.Node, x: gs.Tensor) -> None:
    """A Reshape that only merges every axis after the batch: (N, C, d1, ...) -> (N, C * d1 * ...)."""
    target = surgery.ctx.resolver.value(node.inputs[1]) if len(node.inputs) > 1 else None
    allowzero = int(node.attrs.get("allowzero", 0))
    if target is None or target.size != 2:
        raise NotFoldable(f"{describe(node)} does not reshape to (batch, features)")
    first, second = (int(d) for d in target.reshape(-1))
    if first == 0 and second == -1 and not allowzero:
        return
    shape = surgery.ctx.types.shape(x)
    if shape is None or any(not isinstance(d, int) for d in shape[1:]):
        raise NotFoldable(f"{describe(node)}: the per-sample shape of '{x.name}' is not static")
    keeps_batch = (first == 0 and not allowzero) or first == -1 or first == shape[0]
    if not keeps_batch or second not in (-1, int(np.prod(shape[1:]))) or (first == -1 and second == -1):
        raise NotFoldable(f"{describe(node)} does not reshape to (batch, features)")


def _forward_conv_values(
    surgery: GraphSurgery, conv: gs.Node, affine: ChannelAffine, spread: fold_math.InputSpread
) -> tuple[np.ndarray, np.ndarray | None]:
    weight = surgery.float_constant(conv, 1, "weight")
    bias = surgery.float_constant(conv, 2, "bias") if has_input(conv, 2) else None
    group = int(conv.attrs.get("group", 1))
    if affine.shift.any():  # a pure scaling is exact whatever the padding; a shift only without padding
        reason = conv_border_effect(conv, weight) if conv.op == "Conv" else deconv_border_effect(conv, weight)
        if reason:
            raise NotFoldable(f"{describe(conv)} {reason}")
    dtype = np.dtype(weight.dtype)
    exact_w = surgery.exact(conv.inputs[1], weight, dtype)
    exact_b = None if bias is None else surgery.exact(conv.inputs[2], bias, dtype)
    try:
        if conv.op == "Conv":
            new_w, new_b = fold_math.forward_conv(exact_w, exact_b, affine, group)
        else:
            new_w, new_b = fold_math.forward_conv_transpose(exact_w, exact_b, affine, group)
        new_w, new_b = surgery.rounded(new_w, dtype), surgery.rounded(new_b, dtype)
        weight_abs = fold_math.conv_weight_abs(weight, group, transposed=conv.op == "ConvTranspose")
        require_magnitudes(fold_math.forward_magnitudes(weight_abs, affine, spread, new_b), new_w.dtype)
        return new_w, new_b
    except NotRepresentableError as exc:
        raise NotFoldable(str(exc)) from exc
    except ValueError as exc:
        raise NotFoldable(f"cannot fold into {describe(conv)}: {exc}") from exc


def _forward_matrix_values(
    surgery: GraphSurgery,
    node: gs.Node,
    data: gs.Tensor,
    affine: ChannelAffine,
    flattened: bool,
    spread: fold_math.InputSpread,
) -> tuple[np.ndarray, np.ndarray | None, gs.Node | None]:
    """New weight and bias of a Gemm / MatMul reading the mapped features, and the node holding the bias
    (the Gemm itself, a MatMul's private bias Add, or None when a MatMul needs a new one)."""
    weight = surgery.float_constant(node, 1, "weight" if node.op == "MatMul" else "B")
    if weight.ndim != 2:
        raise NotFoldable(f"{describe(node)} weight is {weight.ndim}-D, not 2-D")
    if node.op == "Gemm" and int(node.attrs.get("transA", 0)):
        raise NotFoldable(f"{describe(node)} transposes its input (transA=1)")
    if node.op == "MatMul" and surgery.ctx.types.rank(data) != 2:
        raise NotFoldable(f"{describe(node)} input is not known to be 2-D (features on axis 1)")
    trans_b = node.op == "Gemm" and bool(node.attrs.get("transB", 0))
    features = int(weight.shape[1] if trans_b else weight.shape[0])
    if features % affine.channels or (not flattened and features != affine.channels):
        raise NotFoldable(f"{features} input features of {describe(node)} for {affine.channels} channels")
    per_feature = fold_math.repeat_channels(affine, features // affine.channels)
    holder: gs.Node | None = node
    dtype = np.dtype(weight.dtype)
    exact_w = surgery.exact(node.inputs[1], weight, dtype)
    try:
        if node.op == "Gemm":
            c = surgery.float_constant(node, 2, "C") if has_input(node, 2) else None
            c = None if c is None else surgery.exact(node.inputs[2], c, dtype)
            alpha, beta = float_attribute(node.attrs, "alpha", 1.0), float_attribute(node.attrs, "beta", 1.0)
            new_w, new_b = fold_math.forward_gemm(exact_w, c, per_feature, trans_b=trans_b, alpha=alpha, beta=beta)
        else:
            alpha = 1.0
            holder, bias = _matmul_bias(surgery, node)
            if bias is not None and holder is not None:
                constant = holder.inputs[0] if holder.inputs[1] is node.outputs[0] else holder.inputs[1]
                bias = surgery.exact(constant, bias, dtype)
            new_w, new_b = fold_math.forward_matmul(exact_w, bias, per_feature)
        new_w, new_b = surgery.rounded(new_w, dtype), surgery.rounded(new_b, dtype)
        weight_abs = abs(alpha) * np.abs(np.asarray(weight, dtype=np.float64))
        weight_abs = weight_abs.T if trans_b else weight_abs
        inner = features // affine.channels
        magnitudes = fold_math.forward_magnitudes(weight_abs, per_feature, spread.repeated(inner), new_b)
        require_magnitudes(magnitudes, new_w.dtype)
    except NotRepresentableError as exc:
        raise NotFoldable(str(exc)) from exc
    except ValueError as exc:
        raise NotFoldable(f"cannot fold into {describe(node)}: {exc}") from exc
    return new_w, new_b, holder


def _matmul_bias(surgery: GraphSurgery, matmul: gs.Node) -> tuple[gs.Node | None, np.ndarray | None]:
    """A MatMul's private bias Add and its values, or (None, None)."""
    out = matmul.outputs[0]
    if len(out.outputs) != 1 or id(out) in surgery.outputs or id(out) in surgery.ctx.graph_outputs:
        return None, None
    add = out.outputs[0]
    if add.op != "Add" or not is_default_domain(add) or id(add) not in surgery.own_nodes or len(add.inputs) != 2:
        return None, None
    other = add.inputs[1] if add.inputs[0] is out else add.inputs[0]
    bias = surgery.ctx.resolver.value(other)
    if other is out or bias is None or bias.ndim > 2 or np.dtype(bias.dtype) not in FLOAT_DTYPES:
        return None, None
    if bias.ndim == 2 and bias.shape[0] != 1:
        return None, None  # a per-row bias is not a bias of the features
    return add, bias
