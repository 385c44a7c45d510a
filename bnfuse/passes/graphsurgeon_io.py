"""Between ONNX protobuf and onnx-graphsurgeon: the import shell, tensor types for the folds, and the export
that keeps the original's metadata, opsets, functions and (with a PayloadStore) large weights as references."""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import onnx
import onnx_graphsurgeon as gs
from google.protobuf.message import Message
from onnx import helper
from onnx_graphsurgeon.exporters.onnx_exporter import OnnxExporter, dtype_to_onnx
from onnx_graphsurgeon.ir.tensor import LazyValues

from bnfuse.protowire import MIN_PAYLOAD_BYTES, PayloadStore, copy_field


def names_in(graph: gs.Graph) -> set[str]:
    names: set[str] = set()
    for g in [graph, *graph.subgraphs(recursive=True)]:
        names.update(g.tensors().keys())
        names.update(n.name for n in g.nodes if n.name)
    return names


def without_functions(model: onnx.ModelProto) -> onnx.ModelProto:
    """The model without its local functions, for gs import: functions are copied to the output untouched."""
    if not model.functions:
        return model
    shell = onnx.ModelProto()
    copy_fields(model, shell, skip=("graph", "functions"))
    shell.graph.CopyFrom(model.graph)
    return shell


class InferredTensorTypes:
    """Rank and dtype of tensors: from the graph's own type info, else from one lazy shape-inference run."""

    def __init__(self, model: onnx.ModelProto) -> None:
        self._model = model
        self._inferred: dict[str, tuple[int | None, int, tuple | None]] | None = None

    def rank(self, tensor: gs.Tensor) -> int | None:
        if isinstance(tensor, gs.Constant) or tensor.shape is not None:
            return len(tensor.shape)
        return self._lookup(tensor.name)[0]

    def shape(self, tensor: gs.Tensor) -> tuple[int | str | None, ...] | None:
        """Dimensions (ints where static), or None when even the rank is unknown."""
        if isinstance(tensor, gs.Constant):
            return tuple(tensor.shape)
        if tensor.shape is not None and all(isinstance(d, int) for d in tensor.shape):
            return tuple(tensor.shape)
        inferred = self._lookup(tensor.name)[2]
        if inferred is not None:
            return inferred
        return tuple(tensor.shape) if tensor.shape is not None else None

    def dtype(self, tensor: gs.Tensor) -> np.dtype | None:
        if tensor.dtype is not None:
            return as_numpy_dtype(tensor.dtype)
        elem_type = self._lookup(tensor.name)[1]
        return as_numpy_dtype(elem_type) if elem_type else None

    def _lookup(self, name: str) -> tuple[int | None, int, tuple | None]:
        if self._inferred is None:
            self._inferred = self._infer()
        return self._inferred.get(name, (None, 0, None))

    def _infer(self) -> dict[str, tuple[int | None, int, tuple | None]]:
        try:
            inferred = onnx.shape_inference.infer_shapes(self._model)
        except Exception:  # shape inference is best effort; an unknown rank just blocks a rewrite
            return {}
        types: dict[str, tuple[int | None, int, tuple | None]] = {}

        def collect(graph: onnx.GraphProto) -> None:
            for info in [*graph.input, *graph.output, *graph.value_info]:
                if info.type.HasField("tensor_type"):
                    tensor_type = info.type.tensor_type
                    dims = None
                    if tensor_type.HasField("shape"):
                        dims = tuple(d.dim_value if d.HasField("dim_value") else None for d in tensor_type.shape.dim)
                    types[info.name] = (None if dims is None else len(dims), tensor_type.elem_type, dims)
            for node in graph.node:
                for attr in node.attribute:
                    for sub in [attr.g] if attr.type == onnx.AttributeProto.GRAPH else list(attr.graphs):
                        collect(sub)

        collect(inferred.graph)
        return types


def as_numpy_dtype(dtype: object) -> np.dtype:
    if isinstance(dtype, int):
        return np.dtype(helper.tensor_dtype_to_np_dtype(dtype))
    return np.dtype(dtype)


def export_model(
    original: onnx.ModelProto, graph: gs.Graph, overridable: set[str], payloads: PayloadStore | None
) -> onnx.ModelProto:
    """Write ``graph`` into a new ModelProto with the original's metadata, opsets and functions.

    With ``payloads``, new large arrays are stored there and referenced, not copied into the ModelProto.
    """
    model = onnx.ModelProto()
    copy_fields(original, model, skip=("graph",))
    out = model.graph
    out.name = graph.name or original.graph.name
    if original.graph.doc_string:
        out.doc_string = original.graph.doc_string
    out.node.extend(OnnxExporter.export_node(node) for node in graph.nodes)

    tensors = graph.tensors()
    constants = [t for t in tensors.values() if isinstance(t, gs.Constant)]
    for constant in constants:
        append_tensor(out.initializer, constant, payloads)
    constant_names = {t.name for t in constants}

    # gs drops initializers from the inputs; put back the ones that must stay listed there.
    real_inputs = {t.name: t for t in graph.inputs}
    listed = constant_names if original.ir_version < 4 else constant_names & overridable
    original_inputs = {i.name: i for i in original.graph.input}
    for info in original.graph.input:
        if info.name in real_inputs:
            out.input.append(OnnxExporter.export_value_info_proto(real_inputs[info.name], do_type_check=False))
        elif info.name in listed:
            out.input.append(info)
    for constant in constants:  # IR < 4: new initializers must be inputs too
        if constant.name in listed and constant.name not in original_inputs:
            out.input.append(OnnxExporter.export_value_info_proto(constant, do_type_check=False))

    out.output.extend(OnnxExporter.export_value_info_proto(t, do_type_check=False) for t in graph.outputs)
    boundary = {t.name for t in graph.inputs} | {t.name for t in graph.outputs}
    out.value_info.extend(
        OnnxExporter.export_value_info_proto(t, do_type_check=False)
        for t in tensors.values()
        if isinstance(t, gs.Variable) and t.name not in boundary and (t.dtype is not None or t.shape is not None)
    )
    return model


def append_tensor(container: Any, constant: gs.Constant, payloads: PayloadStore | None) -> None:
    """Add a gs.Constant to a repeated TensorProto field with one copy of its data (none via make_tensor)."""
    values = constant._values
    if payloads is not None and isinstance(values, LazyValues):  # an untouched payload reference stays one
        if payloads.copy(container, values.tensor, constant.name) is not None:
            return
    if isinstance(values, LazyValues):  # untouched: the original TensorProto, copied
        tensor = container.add()
        tensor.CopyFrom(values.tensor)
        tensor.name = constant.name
        return
    array = np.ascontiguousarray(values)
    if payloads is not None and array.nbytes >= MIN_PAYLOAD_BYTES and array.dtype.isnative:
        payloads.add(container, constant.name, array, dtype_to_onnx(array.dtype))
        return
    tensor = container.add()
    tensor.name = constant.name
    tensor.data_type = dtype_to_onnx(array.dtype)
    tensor.dims.extend(array.shape)
    tensor.raw_data = array.tobytes()


def copy_fields(source: Message, target: Message, *, skip: tuple[str, ...]) -> None:
    """Copy every set field of ``source`` into ``target`` (same message type), except those named in ``skip``."""
    for descriptor, value in source.ListFields():
        if descriptor.name not in skip:
            copy_field(target, descriptor, value)


class quiet_graphsurgeon:
    """Silence onnx-graphsurgeon's logger (bfloat16 load warnings, duplicate-name notes) for a block."""

    def __enter__(self) -> None:
        self._logger = gs.logger.G_LOGGER
        self._severity = self._logger.severity
        self._logger.severity = gs.logger.G_LOGGER.ERROR
        logging.getLogger("onnx_graphsurgeon").setLevel(logging.ERROR)

    def __exit__(self, *exc: object) -> None:
        self._logger.severity = self._severity
