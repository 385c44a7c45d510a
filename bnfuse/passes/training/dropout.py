"""Dropout in training mode: the forward as ONNX Dropout(training_mode=True) with a fixed seed, the backward
dX = dY * mask / (1 - ratio) from the forward's mask output.

onnxruntime's Dropout kernel seeds its generator once per session from the ``seed`` attribute and draws a new
mask every run, so a session's masks differ from step to step and repeat from session to session (the same
graph, the same order of steps). They are not PyTorch's masks: PyTorch parity holds for dropout-free graphs
only.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import helper, numpy_helper

TRAINING_FLAG = "dropout/training_mode"


def training_dropout(node: onnx.NodeProto, seed: int, mask: str) -> onnx.NodeProto:
    """The Dropout node in training mode (opset >= 12 form: ratio and training_mode inputs), mask as output 1."""
    ratio = node.input[1] if len(node.input) > 1 else ""
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute if a.name != "seed"}
    return helper.make_node(
        "Dropout", [node.input[0], ratio, TRAINING_FLAG], [node.output[0], mask], name=node.name, seed=seed, **attrs
    )


def flag_initializer() -> onnx.TensorProto:
    return numpy_helper.from_array(np.array(True), TRAINING_FLAG)


def is_training(node: onnx.NodeProto) -> bool:
    return node.op_type == "Dropout" and len(node.input) > 2 and node.input[2] == TRAINING_FLAG


def constants(graph: onnx.GraphProto) -> dict[str, np.ndarray]:
    """Initializers and Constant-node values by name (PyTorch's exporter writes the ratio as a Constant)."""
    values = {  # a weight's placeholder while the training pass builds (weights.py) is no ratio
        t.name: numpy_helper.to_array(t) for t in graph.initializer if t.data_location != onnx.TensorProto.EXTERNAL
    }
    for node in graph.node:
        if node.op_type == "Constant" and node.attribute and node.attribute[0].name == "value":
            values[node.output[0]] = numpy_helper.to_array(node.attribute[0].t)
    return values


def ratio_value(node: onnx.NodeProto, values: dict[str, np.ndarray]) -> float | None:
    """The node's drop ratio (0.5 when absent), None when it is not a constant."""
    if len(node.input) < 2 or not node.input[1]:
        return 0.5
    value = values.get(node.input[1])
    return None if value is None else float(np.asarray(value).reshape(-1)[0])
