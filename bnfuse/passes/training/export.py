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
from bnfuse.protowire import MIN_PAYLOAD_BYTES, PayloadStore


def export_inference_model(
    train_model: onnx.ModelProto, state: Mapping[str, np.ndarray] | None = None, *, payloads: PayloadStore | None = None
) -> onnx.ModelProto:
    """The inference model with each parameter and running statistic taken from ``state`` (by name),
    or, where ``state`` lacks it, from the training graph's initial values. With ``payloads``, the large ones from
    ``state`` are payload references bound to the arrays themselves (nothing copied; write the model with
    ``protowire.write_model`` while the arrays stay as they are)."""
    spec = read_spec(train_model)
    graph = read_inference_graph(train_model)
    initial = {t.name: t for t in train_model.graph.initializer}
    state = state or {}
    wanted = set(spec.parameters) | set(spec.running_stats)
    for tensor in graph.initializer:
        if tensor.name in wanted and tensor.name not in state and tensor.name not in initial:
            raise BnfuseError(f"no value for {tensor.name!r} in the training state or graph")
        value = state.get(tensor.name) if tensor.name in wanted else None
        if value is not None and tuple(np.shape(value)) != tuple(tensor.dims):
            needs = tuple(tensor.dims)
            raise BnfuseError(f"state {tensor.name!r} has shape {np.shape(value)}, the model needs {needs}")
    tensors = list(graph.initializer)
    graph.ClearField("initializer")
    reset_training_mode(graph)  # graphs built before the pass reset it: exported models are inference models
    opsets = [o for o in train_model.opset_import if o.domain != DOMAIN]
    model = helper.make_model(graph, opset_imports=opsets)  # copied without its weights: they go in one by one
    for tensor in tensors:  # one new tensor alive at a time beside the model
        if tensor.name not in wanted:
            model.graph.initializer.append(tensor)
        elif tensor.name in state:
            value = np.asarray(state[tensor.name]).astype(helper.tensor_dtype_to_np_dtype(tensor.data_type), copy=False)
            if payloads is not None and value.nbytes >= MIN_PAYLOAD_BYTES and value.dtype.isnative:
                payloads.add(model.graph.initializer, tensor.name, value, tensor.data_type)
            else:
                model.graph.initializer.append(numpy_helper.from_array(value, tensor.name))
        else:
            model.graph.initializer.append(initial[tensor.name])
    model.producer_name = "bnfuse train"
    return ort_compatible(model)
