"""Losses and the gradient of the loss with respect to the network output, both in standard ONNX operators.

The backward of the network starts from that gradient (the seed), so the loss's own derivative is
written once here, in closed form, rather than differentiated op by op:

* cross-entropy (PyTorch's CrossEntropyLoss, mean over the batch) on logits [N, K] and int64 labels [N]:
  loss = -mean(log_softmax(y)[i, label_i]); dL/dy = (softmax(y) - onehot(label)) / N
* mse (PyTorch's MSELoss, mean over all elements): loss = mean((y - t)^2); dL/dy = 2 (y - t) / numel
* seed: the gradient dL/dy is a graph input; the reported loss is sum(y * seed), the objective whose
  gradient that is.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from bnfuse.errors import BnfuseError

LOSSES = ("cross-entropy", "mse", "seed")
LOSS_OUTPUT = "loss"


@dataclass
class LossGraph:
    """Nodes computing the loss (scalar ``loss``) and the seed ``grad`` from ``output``."""

    target: onnx.ValueInfoProto
    grad: str
    nodes: list[onnx.NodeProto] = field(default_factory=list)
    initializers: list[onnx.TensorProto] = field(default_factory=list)


def build_loss(kind: str, output: str, shape: list[int], elem_type: int) -> LossGraph:
    if kind not in LOSSES:
        raise BnfuseError(f"unknown loss {kind!r} (expected one of {', '.join(LOSSES)})")
    if elem_type not in (TensorProto.FLOAT, TensorProto.DOUBLE):
        raise BnfuseError(
            f"output {output!r} must be float32 (or float64) for training, got {TensorProto.DataType.Name(elem_type)}"
        )
    dtype = helper.tensor_dtype_to_np_dtype(elem_type)  # a float64 model's loss is float64 throughout
    numel = int(np.prod(shape))
    if kind == "cross-entropy":
        return _cross_entropy(output, shape, dtype)
    target = "labels" if kind == "mse" else f"grad.{output}"
    info = helper.make_tensor_value_info(target, elem_type, shape)
    consts = {"scale": 2.0 / numel}
    inits = [numpy_helper.from_array(np.array(v, dtype), f"loss/{k}") for k, v in consts.items()]
    n = helper.make_node
    if kind == "mse":
        nodes = [
            n("Sub", [output, target], ["loss/diff"]),
            n("Mul", ["loss/diff", "loss/diff"], ["loss/sq"]),
            n("ReduceMean", ["loss/sq"], [LOSS_OUTPUT], keepdims=0),
            n("Mul", ["loss/diff", "loss/scale"], ["loss/grad"]),
        ]
        return LossGraph(info, "loss/grad", nodes, inits)
    nodes = [n("Mul", [output, target], ["loss/prod"]), n("ReduceSum", ["loss/prod"], [LOSS_OUTPUT], keepdims=0)]
    return LossGraph(info, target, nodes, [])


def _cross_entropy(output: str, shape: list[int], dtype: np.dtype) -> LossGraph:
    if len(shape) != 2:
        raise BnfuseError(f"cross-entropy needs logits shaped [batch, classes]; output {output!r} has shape {shape}")
    batch, classes = shape
    info = helper.make_tensor_value_info("labels", TensorProto.INT64, [batch])
    inits = [
        numpy_helper.from_array(np.array([1], np.int64), "loss/axis1"),
        numpy_helper.from_array(np.array(classes, np.int64), "loss/depth"),
        numpy_helper.from_array(np.array([0.0, 1.0], dtype), "loss/onehot_values"),
        numpy_helper.from_array(np.array(-1.0 / batch, dtype), "loss/neg_inv_batch"),
        numpy_helper.from_array(np.array(1.0 / batch, dtype), "loss/inv_batch"),
    ]
    n = helper.make_node
    nodes = [
        n("LogSoftmax", [output], ["loss/logp"], axis=1),
        n("Unsqueeze", ["labels", "loss/axis1"], ["loss/labels2d"]),
        n("GatherElements", ["loss/logp", "loss/labels2d"], ["loss/picked"], axis=1),
        n("ReduceSum", ["loss/picked"], ["loss/total"], keepdims=0),
        n("Mul", ["loss/total", "loss/neg_inv_batch"], [LOSS_OUTPUT]),
        n("Exp", ["loss/logp"], ["loss/prob"]),
        n("OneHot", ["labels", "loss/depth", "loss/onehot_values"], ["loss/onehot"], axis=-1),
        n("Sub", ["loss/prob", "loss/onehot"], ["loss/residual"]),
        n("Mul", ["loss/residual", "loss/inv_batch"], ["loss/grad"]),
    ]
    return LossGraph(info, "loss/grad", nodes, inits)
