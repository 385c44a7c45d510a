"""Streaming ONNX file I/O: large weights stay in a memory map on the way in and go from their buffers
straight to the file on the way out, without ever being copied into protobuf messages.

``onnx.load`` copies every weight into the ModelProto, and ``SerializeToString`` copies it out again:
for a 100 MB ResNet-50 that is most of the cost of a fold. Here the file is mapped read-only and scanned
at the protobuf wire level; every large ``raw_data`` initializer of the main graph becomes a *payload
reference*: a TensorProto with its name, type and dims and ``data_location = EXTERNAL`` pointing at
``bnfuse-payload:<k>``, entry ``k`` of a PayloadStore that holds a NumPy view of the mapped bytes. The
small remainder (nodes, attributes, small tensors) parses with onnx as usual. On the way out a pass adds
its new large arrays to the same store; ``write_model`` serializes the small ModelProto and splices
every referenced payload back in as ``raw_data``, writing the buffers directly.

Payload references are an in-process device only: a model holding them is never handed to a user.
"""

from __future__ import annotations

import mmap
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx

PREFIX = "bnfuse-payload:"
# Initializers at least this large travel as payloads; smaller ones (shapes, axes, BN parameters of
# small layers) stay inline, where shape inference and the checker can see them.
MIN_PAYLOAD_BYTES = 4096
_PROTOBUF_LIMIT = 2**31 - 1

# Field numbers (onnx.proto): ModelProto.graph, GraphProto.initializer, TensorProto fields.
_MODEL_GRAPH = 7
_GRAPH_INITIALIZER = 5
_TENSOR_DIMS, _TENSOR_DATA_TYPE, _TENSOR_RAW_DATA = 1, 2, 9
_TENSOR_EXTERNAL_DATA, _TENSOR_DATA_LOCATION = 13, 14
_VARINT, _FIXED64, _LEN, _FIXED32 = 0, 1, 2, 5


class WireFormatError(ValueError):
    """The bytes are not a protobuf this module can scan (the caller falls back to onnx.load)."""


@dataclass
class PayloadStore:
    """Arrays referenced by payload TensorProtos: views of a mapped file, or arrays a pass made."""

    arrays: list[np.ndarray] = field(default_factory=list)

    def add(self, name: str, array: np.ndarray, data_type: int) -> onnx.TensorProto:
        """A payload TensorProto for ``array`` (kept C-contiguous, not copied when it already is)."""
        self.arrays.append(np.ascontiguousarray(array))
        return _reference(name, data_type, array.shape, len(self.arrays) - 1)

    def array(self, tensor: onnx.TensorProto) -> np.ndarray | None:
        """The array behind a payload TensorProto, or None when ``tensor`` is not a payload reference."""
        index = payload_index(tensor)
        return None if index is None else self.arrays[index]


def payload_index(tensor: onnx.TensorProto) -> int | None:
    if tensor.data_location != onnx.TensorProto.EXTERNAL:
        return None
    for entry in tensor.external_data:
        if entry.key == "location" and entry.value.startswith(PREFIX):
            return int(entry.value[len(PREFIX) :])
    return None


def _reference(name: str, data_type: int, dims: tuple[int, ...], index: int) -> onnx.TensorProto:
    tensor = onnx.TensorProto(name=name, data_type=data_type, dims=dims)
    tensor.MergeFrom(_marker(index))
    return tensor


def _marker(index: int) -> onnx.TensorProto:
    """The fields that make a TensorProto a reference to payload ``index``."""
    marker = onnx.TensorProto(data_location=onnx.TensorProto.EXTERNAL)
    marker.external_data.add(key="location", value=f"{PREFIX}{index}")
    return marker


# --- reading -------------------------------------------------------------------------------------


def map_model(path: str | os.PathLike[str]) -> tuple[onnx.ModelProto, PayloadStore]:
    """The model at ``path`` with its large main-graph initializers as payload references into a read-only map.

    Raises WireFormatError when the file is not a plain single-protobuf model this scanner understands
    (the caller then uses onnx.load and gets onnx's own error for a broken file).
    """
    with open(path, "rb") as file:
        size = os.fstat(file.fileno()).st_size
        if size == 0:
            raise WireFormatError("empty file")
        mapped = mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ)
    store = PayloadStore()  # its views keep the map alive; it is unmapped when the last one goes
    data = memoryview(mapped)
    pieces: list[bytes | memoryview] = []
    graphs = 0
    for number, wire, start, value_start, end in _fields(data, 0, size):
        if number == _MODEL_GRAPH and wire == _LEN:
            graphs += 1
            graph = _map_graph(data, value_start, end, store)
            pieces += [_tag(_MODEL_GRAPH, _LEN), _varint(len(graph)), graph]
        else:
            pieces.append(data[start:end])
    if graphs != 1:
        raise WireFormatError(f"{graphs} graph fields")
    skeleton = b"".join(pieces)
    model = onnx.ModelProto()
    try:
        model.ParseFromString(skeleton)
    except Exception as exc:  # protobuf's DecodeError
        raise WireFormatError(str(exc)) from exc
    return model, store


def _map_graph(data: memoryview, begin: int, end: int, store: PayloadStore) -> bytes:
    pieces: list[bytes | memoryview] = []
    for number, wire, start, value_start, value_end in _fields(data, begin, end):
        if number == _GRAPH_INITIALIZER and wire == _LEN:
            tensor = _map_tensor(data, value_start, value_end, store)
            if tensor is not None:
                pieces += [_tag(_GRAPH_INITIALIZER, _LEN), _varint(len(tensor)), tensor]
                continue
        pieces.append(data[start:value_end])
    return b"".join(pieces)


def _map_tensor(data: memoryview, begin: int, end: int, store: PayloadStore) -> bytes | None:
    """A payload reference replacing the tensor at data[begin:end], or None to keep it inline."""
    raw: tuple[int, int] | None = None
    kept: list[memoryview] = []
    dims: list[int] = []
    data_type = 0
    for number, wire, start, value_start, value_end in _fields(data, begin, end):
        if number in (_TENSOR_EXTERNAL_DATA, _TENSOR_DATA_LOCATION):
            return None  # already external: leave it to onnx's external-data handling
        if number == _TENSOR_RAW_DATA and wire == _LEN:
            raw = (value_start, value_end)
            continue
        if number == _TENSOR_DATA_TYPE and wire == _VARINT:
            data_type = _read_varint(data, value_start)[0]
        elif number == _TENSOR_DIMS:
            dims += _read_dims(data, wire, value_start, value_end)
        kept.append(data[start:value_end])
    if raw is None or raw[1] - raw[0] < MIN_PAYLOAD_BYTES:
        return None
    dtype = _PAYLOAD_DTYPES.get(data_type)
    count = int(np.prod(dims, dtype=np.int64))
    if dtype is None or count * dtype.itemsize != raw[1] - raw[0]:
        return None  # an unusual type or a size mismatch: onnx reports it properly
    view = np.frombuffer(data.obj, dtype=dtype, count=count, offset=raw[0]).reshape(dims)
    store.arrays.append(view)
    # Serialized messages concatenate as a merge: the kept fields plus the marker's.
    return b"".join([*kept, _marker(len(store.arrays) - 1).SerializeToString()])


# Types whose raw_data is plain little-endian elements, viewed as numpy_helper reads them.
_PAYLOAD_DTYPES = {
    onnx.TensorProto.FLOAT: np.dtype("<f4"),
    onnx.TensorProto.DOUBLE: np.dtype("<f8"),
    onnx.TensorProto.FLOAT16: np.dtype("<f2"),
    onnx.TensorProto.INT8: np.dtype("i1"),
    onnx.TensorProto.UINT8: np.dtype("u1"),
    onnx.TensorProto.INT16: np.dtype("<i2"),
    onnx.TensorProto.UINT16: np.dtype("<u2"),
    onnx.TensorProto.INT32: np.dtype("<i4"),
    onnx.TensorProto.UINT32: np.dtype("<u4"),
    onnx.TensorProto.INT64: np.dtype("<i8"),
    onnx.TensorProto.UINT64: np.dtype("<u8"),
}


def _read_dims(data: memoryview, wire: int, begin: int, end: int) -> list[int]:
    if wire == _VARINT:
        return [_signed64(_read_varint(data, begin)[0])]
    dims, position = [], begin
    while position < end:  # packed
        value, position = _read_varint(data, position)
        dims.append(_signed64(value))
    return dims


# --- writing -------------------------------------------------------------------------------------


def write_model(model: onnx.ModelProto, store: PayloadStore, path: str | os.PathLike[str]) -> int:
    """Write ``model`` with every payload reference replaced by its raw_data; returns the bytes written."""
    skeleton = memoryview(model.SerializeToString())
    pieces: list[bytes | memoryview] = []
    for number, wire, start, value_start, end in _fields(skeleton, 0, len(skeleton)):
        if number == _MODEL_GRAPH and wire == _LEN:
            graph = _splice_graph(skeleton, value_start, end, store)
            pieces += [_tag(_MODEL_GRAPH, _LEN), _varint(sum(len(p) for p in graph)), *graph]
        else:
            pieces.append(skeleton[start:end])
    total = sum(len(p) for p in pieces)
    if total > _PROTOBUF_LIMIT:
        raise WireFormatError(f"{total} bytes is over the 2 GiB protobuf limit")
    _write_pieces(Path(path), pieces)
    return total


def _splice_graph(skeleton: memoryview, begin: int, end: int, store: PayloadStore) -> list[bytes | memoryview]:
    pieces: list[bytes | memoryview] = []
    for number, wire, start, value_start, value_end in _fields(skeleton, begin, end):
        if number == _GRAPH_INITIALIZER and wire == _LEN:
            tensor = _splice_tensor(skeleton, value_start, value_end, store)
            if tensor is not None:
                pieces += [_tag(_GRAPH_INITIALIZER, _LEN), _varint(sum(len(p) for p in tensor)), *tensor]
                continue
        pieces.append(skeleton[start:value_end])
    return pieces


def _splice_tensor(skeleton: memoryview, begin: int, end: int, store: PayloadStore) -> list[bytes | memoryview] | None:
    kept: list[bytes | memoryview] = []
    index: int | None = None
    for number, _wire, start, value_start, value_end in _fields(skeleton, begin, end):
        if number == _TENSOR_EXTERNAL_DATA:
            key, value = _read_string_entry(skeleton, value_start, value_end)
            if key == "location" and value.startswith(PREFIX):
                index = int(value[len(PREFIX) :])
                continue
        if number == _TENSOR_DATA_LOCATION:
            continue
        kept.append(skeleton[start:value_end])
    if index is None:
        return None
    payload = memoryview(store.arrays[index]).cast("B")
    return [*kept, _tag(_TENSOR_RAW_DATA, _LEN), _varint(len(payload)), payload]


def _write_pieces(path: Path, pieces: list[bytes | memoryview]) -> None:
    """Write the pieces in order with writev: the payload buffers go to the kernel without a copy here.

    (Two threads writing halves with pwrite measured slower: ext4 serializes writers of one file.)
    """
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o666)
    try:
        for first in range(0, len(pieces), _IOV_MAX):
            views = [memoryview(p) for p in pieces[first : first + _IOV_MAX]]
            while views:
                written = os.writev(fd, views)
                while views and written >= len(views[0]):
                    written -= len(views[0])
                    views.pop(0)
                if views and written:
                    views[0] = views[0][written:]
    finally:
        os.close(fd)


_IOV_MAX = 1024  # Linux's UIO_MAXIOV: buffers per writev call


# --- protobuf wire format ------------------------------------------------------------------------


def _fields(data: memoryview, begin: int, end: int) -> Iterator[tuple[int, int, int, int, int]]:
    """(field number, wire type, field start, value start, value end) for each field in data[begin:end]."""
    position = begin
    while position < end:
        start = position
        key, position = _read_varint(data, position)
        number, wire = key >> 3, key & 7
        if number == 0:
            raise WireFormatError(f"field number 0 at byte {start}")
        if wire == _VARINT:
            value_start = position
            position = _read_varint(data, position)[1]
        elif wire == _LEN:
            length, value_start = _read_varint(data, position)
            position = value_start + length
        elif wire == _FIXED64:
            value_start, position = position, position + 8
        elif wire == _FIXED32:
            value_start, position = position, position + 4
        else:
            raise WireFormatError(f"wire type {wire} at byte {start}")
        if position > end:
            raise WireFormatError(f"field {number} runs past its message at byte {start}")
        yield number, wire, start, value_start, position


def _read_varint(data: memoryview, position: int) -> tuple[int, int]:
    result = shift = 0
    while True:
        if position >= len(data) or shift > 63:
            raise WireFormatError("truncated or overlong varint")
        byte = data[position]
        position += 1
        result |= (byte & 0x7F) << shift
        if byte < 0x80:
            return result, position
        shift += 7


def _signed64(value: int) -> int:
    return value - (1 << 64) if value >= 1 << 63 else value


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        if value:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def _tag(number: int, wire: int) -> bytes:
    return _varint(number << 3 | wire)


def _read_string_entry(data: memoryview, begin: int, end: int) -> tuple[str, str]:
    key = value = ""
    for number, wire, _start, value_start, value_end in _fields(data, begin, end):
        if wire == _LEN and number in (1, 2):
            text = bytes(data[value_start:value_end]).decode("utf-8", "replace")
            key, value = (text, value) if number == 1 else (key, text)
    return key, value
