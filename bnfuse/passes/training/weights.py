"""The weights kept out of the training pass's way while it builds: placeholders in the graph, bytes aside.

Building a training graph copies, serializes (onnx's shape inference, version converter and checker take the
model as bytes) and compares the model many times over, at three probe batch sizes for a dynamic batch. None of
that reads a weight's values, only its name, type and shape. ``detach`` moves every large float initializer's
bytes out of the model into a ``Detached`` store and leaves a data-less placeholder (``data_location =
EXTERNAL``, a location naming this store); ``attach`` puts the bytes back into a finished graph's initializers
(copies of a placeholder, such as untied weights, get the same bytes), and ``take`` hands them to a caller that
wants the arrays themselves (a TrainingSession binds them without another copy).

A placeholder is marked with a random token of its store, so no tensor of an input model can stand for another's
bytes; a model that already has external tensors is left as it is (nothing detached). Tensors read by
BatchNormalization nodes stay inline (``fix_gamma`` rewrites a BN's scale from its values), and so do small ones
(shape arithmetic, constants a pass may fold).
"""

from __future__ import annotations

import math
import secrets
from collections import Counter
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np
import onnx
from onnx import helper

from bnfuse import protowire

MIN_DETACH_BYTES = 4096
_FLOATS = (onnx.TensorProto.FLOAT, onnx.TensorProto.DOUBLE, onnx.TensorProto.FLOAT16)
_SCHEME = "bnfuse-detached"


class Detached:
    """The bytes of detached initializers, by placeholder location."""

    def __init__(self) -> None:
        self.token = secrets.token_hex(8)
        self._bytes: dict[str, bytes | np.ndarray] = {}  # bytes, or uint8 views of a mapped file (detach_payloads)

    def __len__(self) -> int:
        return len(self._bytes)

    def location(self, tensor: onnx.TensorProto) -> str | None:
        """The store key ``tensor`` is a placeholder for, None when it is not one of this store's."""
        if tensor.data_location != onnx.TensorProto.EXTERNAL or len(tensor.external_data) != 1:
            return None
        entry = tensor.external_data[0]
        return entry.value if entry.key == "location" and entry.value in self._bytes else None

    def raw(self, tensor: onnx.TensorProto) -> bytes | np.ndarray | None:
        key = self.location(tensor)
        return None if key is None else self._bytes[key]

    def add(self, tensor: onnx.TensorProto, raw: bytes | np.ndarray | None = None) -> None:
        """Make ``tensor`` a placeholder of these bytes: ``raw``, or its own raw_data (then cleared)."""
        key = f"{_SCHEME}:{self.token}:{len(self._bytes)}"
        self._bytes[key] = tensor.raw_data if raw is None else raw
        tensor.ClearField("raw_data")
        tensor.data_location = onnx.TensorProto.EXTERNAL
        entry = tensor.external_data.add()
        entry.key, entry.value = "location", key

    def release(self, key: str) -> None:
        """Forget the bytes behind ``key`` (no placeholder left needs them)."""
        del self._bytes[key]

    def clear(self) -> None:
        self._bytes.clear()


def detach(model: onnx.ModelProto) -> Detached:
    """Move the large float initializers' bytes of ``model``'s main graph into the returned store (in place)."""
    store = Detached()
    detachable = _detachable(model.graph)
    for tensor in model.graph.initializer:
        if detachable(tensor):
            store.add(tensor)
    return store


def detach_payloads(model: onnx.ModelProto, payloads: Any) -> Detached:
    """``detach`` of a model read by ``bnfuse.io.read_mapped``, whose large initializers are payload references into a
    read-only map of its file (``payloads``, a protowire.PayloadStore): the tensors ``detach`` would move become this
    store's placeholders of the mapped bytes themselves (no copy until ``attach`` or ``take``); the other payloads (a
    BN's parameters, integer tensors) get their bytes inline. ``payloads`` is cleared."""
    store = Detached()
    bn_reads = {name for node in model.graph.node if node.op_type == "BatchNormalization" for name in node.input}
    for tensor in model.graph.initializer:
        view = payloads.array(tensor)
        if view is None:
            continue
        tensor.ClearField("data_location")
        if tensor.data_type in _FLOATS and tensor.name not in bn_reads:
            store.add(tensor, view.reshape(-1).view(np.uint8))
        else:
            tensor.raw_data = view.tobytes()
    payloads.clear()
    return store


def detached_copy(model: onnx.ModelProto) -> tuple[onnx.ModelProto, Detached]:
    """A copy of ``model`` with the initializers ``detach`` would move as placeholders, and their store; the
    weights are copied once (into the store), never into a second ModelProto."""
    store = Detached()
    copy = copy_without_initializers(model)
    graph = model.graph
    detachable = _detachable(graph)
    for tensor in graph.initializer:
        target = copy.graph.initializer.add()
        if not detachable(tensor):
            target.CopyFrom(tensor)
            continue
        for field, value in tensor.ListFields():
            if field.name != "raw_data":
                _copy_field(target, field, value)
        store.add(target, tensor.raw_data)
    return copy, store


def copy_without_initializers(model: onnx.ModelProto) -> onnx.ModelProto:
    """A copy of ``model`` but for its main graph's initializers (none: the caller adds what it keeps)."""
    copy = onnx.ModelProto()
    for field, value in model.ListFields():
        if field.name != "graph":
            _copy_field(copy, field, value)
    for field, value in model.graph.ListFields():
        if field.name != "initializer":
            _copy_field(copy.graph, field, value)
    return copy


def _detachable(graph: onnx.GraphProto) -> Callable[[onnx.TensorProto], bool]:
    if any(t.data_location == onnx.TensorProto.EXTERNAL for t in graph.initializer):
        return lambda tensor: False  # external tensors of the input: leave the model alone
    bn_reads = {name for node in graph.node if node.op_type == "BatchNormalization" for name in node.input}
    return lambda tensor: (
        tensor.data_type in _FLOATS
        and tensor.name not in bn_reads
        and tensor.HasField("raw_data")
        # from the dims: len(raw_data) copies the bytes out, ByteSize() walks them
        and math.prod(tensor.dims) * helper.tensor_dtype_to_np_dtype(tensor.data_type).itemsize >= MIN_DETACH_BYTES
    )


def _copy_field(target: Any, field: Any, value: Any) -> None:
    if field.is_repeated:
        getattr(target, field.name).extend(value)
    elif field.message_type is not None:
        getattr(target, field.name).CopyFrom(value)
    else:
        setattr(target, field.name, value)


def is_placeholder(tensor: onnx.TensorProto) -> bool:
    """Whether ``tensor`` holds no values of its own (a placeholder of some store, or any external tensor)."""
    return tensor.data_location == onnx.TensorProto.EXTERNAL


def materialize(tensors: Iterable[onnx.TensorProto], store: Detached) -> None:
    """Give the placeholders among ``tensors`` their bytes back (in place)."""
    for tensor in tensors:
        raw = store.raw(tensor)
        if raw is not None:
            tensor.ClearField("external_data")
            tensor.ClearField("data_location")
            tensor.raw_data = raw if isinstance(raw, bytes) else raw.tobytes()


def attach(model: onnx.ModelProto, store: Detached) -> onnx.ModelProto:
    """Every placeholder of ``store`` in ``model``'s main graph gets its bytes back (in place); returns the model."""
    materialize(model.graph.initializer, store)
    return model


def checkable(model: onnx.ModelProto, store: Detached) -> onnx.ModelProto:
    """A copy of ``model`` onnx's checker takes: without the placeholders of ``store`` that are graph inputs' initial
    values (the checker looks for a file behind an external tensor, and checks raw_data against the dims), the
    other placeholders (none in a training graph) with their bytes."""
    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    graph = copy.graph
    inputs = {value.name for value in graph.input}
    keep = [t for t in graph.initializer if t.name not in inputs or store.location(t) is None]
    materialize(keep, store)
    graph.ClearField("initializer")
    graph.initializer.extend(keep)
    return copy


def checkable_source(model: onnx.ModelProto, store: Detached) -> onnx.ModelProto:
    """A copy of an inference model with placeholders of ``store`` that onnx's checker takes: each placeholder a graph
    input of its type and shape instead of an initializer (the checker looks for a file behind an external tensor;
    the bytes were checked against the dims before they were detached, tensorcheck.check_tensors). No weight's bytes
    are copied."""
    copy = copy_without_initializers(model)
    graph = copy.graph
    inputs = {value.name for value in graph.input}
    for tensor in model.graph.initializer:
        if store.location(tensor) is None:
            graph.initializer.add().CopyFrom(tensor)
        elif tensor.name not in inputs:
            graph.input.append(helper.make_tensor_value_info(tensor.name, tensor.data_type, list(tensor.dims)))
    return copy


def take(model: onnx.ModelProto, store: Detached, names: Iterable[str]) -> dict[str, np.ndarray]:
    """The arrays of the placeholders named ``names`` (writable, the caller's), the placeholders removed from
    ``model``'s initializers and their bytes from ``store`` once no placeholder left in the model needs them (one
    tensor's bytes held twice at a time); names that are not placeholders of ``store`` are left in the model."""
    wanted = set(names)
    graph = model.graph
    users = Counter(store.location(tensor) for tensor in graph.initializer)
    arrays: dict[str, np.ndarray] = {}
    keep = []
    for tensor in graph.initializer:
        key = store.location(tensor) if tensor.name in wanted else None
        if key is None:
            keep.append(tensor)
            continue
        dtype = helper.tensor_dtype_to_np_dtype(tensor.data_type)
        raw = store.raw(tensor)
        arrays[tensor.name] = np.frombuffer(b"" if raw is None else raw, dtype).reshape(tuple(tensor.dims)).copy()
        if isinstance(raw, np.ndarray):
            protowire.release_pages(raw)  # a mapped file's pages: out of the resident set once copied
        users[key] -= 1
        if not users[key]:
            store.release(key)
    if arrays:
        graph.ClearField("initializer")
        graph.initializer.extend(keep)
    return arrays
