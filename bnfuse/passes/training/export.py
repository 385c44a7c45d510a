"""Trained state -> the inference model: the original graph with trained weights and running statistics."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import onnx
from onnx import helper, numpy_helper

from bnfuse.errors import BnfuseError
from bnfuse.io import ort_compatible
from bnfuse.passes.training.bn import DOMAIN
from bnfuse.passes.training.prepare import reset_training_mode
from bnfuse.passes.training.spec import read_inference_graph, read_spec


def export_inference_model(
    train_model: onnx.ModelProto, state: Mapping[str, np.ndarray] | None = None
) -> onnx.ModelProto:
    """The inference model with each parameter and running statistic taken from ``state`` (by name),
    or, where ``state`` lacks it, from the training graph's initial values."""
    spec = read_spec(train_model)
    graph = read_inference_graph(train_model)
    initial = {t.name: t for t in train_model.graph.initializer}
    state = state or {}
    wanted = set(spec.parameters) | set(spec.running_stats)
    tensors = []
    for tensor in graph.initializer:
        if tensor.name not in wanted:
            tensors.append(tensor)
            continue
        if tensor.name in state:
            value = np.asarray(state[tensor.name])
            if tuple(value.shape) != tuple(tensor.dims):
                raise BnfuseError(
                    f"state {tensor.name!r} has shape {value.shape}, the model needs {tuple(tensor.dims)}"
                )
            tensors.append(
                numpy_helper.from_array(value.astype(helper.tensor_dtype_to_np_dtype(tensor.data_type)), tensor.name)
            )
        elif tensor.name in initial:
            tensors.append(initial[tensor.name])
        else:
            raise BnfuseError(f"no value for {tensor.name!r} in the training state or graph")
    graph.ClearField("initializer")
    graph.initializer.extend(tensors)
    reset_training_mode(graph)  # graphs built before the pass reset it: exported models are inference models
    opsets = [o for o in train_model.opset_import if o.domain != DOMAIN]
    model = helper.make_model(graph, opset_imports=opsets)
    model.producer_name = "bnfuse train"
    return ort_compatible(model)
