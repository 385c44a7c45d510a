"""Streaming ONNX file I/O: large weights stay in a memory map on the way in and go from their buffers
straight to the file on the way out, without ever being copied into protobuf messages.

``onnx.load`` copies every weight into the ModelProto, and ``SerializeToString`` copies it out again:
for a 100 MB ResNet-50 that is most of the cost of a fold. Here the file is mapped read-only and scanned
at the protobuf wire level; every large ``raw_data`` initializer of the main graph becomes a *payload
reference*: a TensorProto with its name, type and dims, ``data_location = EXTERNAL`` and no data, bound
in a PayloadStore to a NumPy view of the mapped bytes. The small remainder (nodes, attributes, small
tensors) parses with onnx as usual. On the way out a pass adds its new large arrays to the same store;
``write_model`` serializes the small ModelProto around the initializers and writes every referenced
payload as ``raw_data`` straight from its buffer.

The binding lives outside the model: the store keys it by the identity of the TensorProto object (it holds
the object, so the identity stays valid), never by a string in the tensor. No input can name another
tensor's bytes, and a model holding references is never handed to a user.
"""

from __future__ import annotations

import mmap
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import onnx

# Initializers at least this large travel as payloads; smaller ones (shapes, axes, BN parameters of
# small layers) stay inline, where shape inference and the checker can see them.
MIN_PAYLOAD_BYTES = 4096
_PROTOBUF_LIMIT = 2**31 - 1

# Field numbers (onnx.proto): ModelProto.graph, GraphProto.initializer, TensorProto fields.
_MODEL_GRAPH = 7
_GRAPH_INITIALIZER = 5
_TENSOR_DIMS, _TENSOR_DATA_TYPE, _TENSOR_NAME, _TENSOR_RAW_DATA = 1, 2, 8, 9
_TENSOR_EXTERNAL_DATA, _TENSOR_DATA_LOCATION = 13, 14
_VARINT, _FIXED64, _LEN, _FIXED32 = 0, 1, 2, 5
# TensorProto fields a payload reference keeps besides dims and type: name, doc_string, metadata_props.
_HEADER_FIELDS = (_TENSOR_NAME, 12, 16)


class WireFormatError(ValueError):
    """The bytes are not a protobuf this module can scan (the caller falls back to onnx.load)."""


class PayloadStore:
    """Arrays behind payload TensorProtos: views of a mapped file, or arrays a pass made.

    Keyed by the identity of the TensorProto object: the store holds the object, so its id is not reused,
    and protobuf (upb) hands back that same object for as long as it is alive.
    """

    def __init__(self) -> None:
        self._bound: dict[int, tuple[onnx.TensorProto, np.ndarray]] = {}

    def __len__(self) -> int:
        return len(self._bound)

    def bind(self, tensor: onnx.TensorProto, array: np.ndarray) -> None:
        """Make ``tensor`` (a data-less EXTERNAL TensorProto inside a model) a reference to ``array``."""
        self._bound[id(tensor)] = (tensor, array)

    def add(self, container: Any, name: str, array: np.ndarray, data_type: int) -> onnx.TensorProto:
        """Append to ``container`` (a repeated TensorProto field) a reference to ``array`` (kept C-contiguous)."""
        tensor = container.add()
        tensor.name = name
        tensor.data_type = data_type
        tensor.dims.extend(array.shape)
        tensor.data_location = onnx.TensorProto.EXTERNAL
        self.bind(tensor, np.ascontiguousarray(array))
        return tensor

    def copy(self, container: Any, reference: onnx.TensorProto, name: str) -> onnx.TensorProto | None:
        """Append a copy of payload reference ``reference`` under ``name``; None when it is not one."""
        array = self.array(reference)
        if array is None:
            return None
        tensor = container.add()
        tensor.CopyFrom(reference)
        tensor.name = name
        self.bind(tensor, array)
        return tensor

    def clear(self) -> None:
        """Drop every binding: new arrays are freed, and the file is unmapped once no view is left."""
        self._bound.clear()

    def array(self, tensor: onnx.TensorProto) -> np.ndarray | None:
        """The array behind a payload reference, or None when ``tensor`` is not one of this store's."""
        entry = self._bound.get(id(tensor))
        return entry[1] if entry is not None and entry[0] is tensor else None


def release_pages(array: np.ndarray) -> None:
    """Tell the kernel this process is done with the mapped pages under ``array`` (a view of a mapped file).

    The mapping is read-only and file-backed: the pages leave this process's resident set and come back
    from the file if read again. A fold reads each weight once, so releasing it right after keeps the
    resident set at the new weights instead of new + old. A no-op for arrays that are not mapped views.
    """
    base: object = array
    while isinstance(base, np.ndarray):
        base = base.base
    if isinstance(base, memoryview):  # np.frombuffer keeps the buffer's memoryview
        base = base.obj
    if not isinstance(base, mmap.mmap) or not hasattr(base, "madvise") or array.nbytes == 0:
        return
    start = array.__array_interface__["data"][0] - np.frombuffer(base, np.uint8, count=1).ctypes.data
    first = -(-start // mmap.PAGESIZE) * mmap.PAGESIZE  # only whole pages inside the array
    last = (start + array.nbytes) // mmap.PAGESIZE * mmap.PAGESIZE
    if last > first:
        base.madvise(mmap.MADV_DONTNEED, first, last - first)


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
    data = memoryview(mapped)
    pieces: list[bytes | memoryview] = []
    views: dict[int, np.ndarray] = {}  # initializer position -> mapped array (the views keep the map alive)
    graphs = 0
    for number, wire, start, value_start, end in _fields(data, 0, size):
        if number == _MODEL_GRAPH and wire == _LEN:
            graphs += 1
            views = {}  # protobuf merges repeated graph fields; only one is accepted below
            graph = _map_graph(data, value_start, end, views)
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
    store = PayloadStore()
    initializers = model.graph.initializer
    for position, view in views.items():
        store.bind(initializers[position], view)
    return model, store


def _map_graph(data: memoryview, begin: int, end: int, views: dict[int, np.ndarray]) -> bytes:
    pieces: list[bytes | memoryview] = []
    position = 0
    for number, wire, start, value_start, value_end in _fields(data, begin, end):
        if number == _GRAPH_INITIALIZER and wire == _LEN:
            mapped = _map_tensor(data, value_start, value_end)
            if mapped is not None:
                tensor, views[position] = mapped
                pieces += [_tag(_GRAPH_INITIALIZER, _LEN), _varint(len(tensor)), tensor]
            else:
                pieces.append(data[start:value_end])
            position += 1
            continue
        pieces.append(data[start:value_end])
    return b"".join(pieces)


_EXTERNAL_LOCATION = bytes([_TENSOR_DATA_LOCATION << 3 | _VARINT, onnx.TensorProto.EXTERNAL])


def _map_tensor(data: memoryview, begin: int, end: int) -> tuple[bytes, np.ndarray] | None:
    """The data-less tensor replacing data[begin:end] and the view of its raw_data, or None to keep it inline."""
    raw: tuple[int, int] | None = None
    kept: list[memoryview] = []
    dims: list[int] = []
    data_type = 0
    for number, wire, start, value_start, value_end in _fields(data, begin, end):
        if number in (_TENSOR_EXTERNAL_DATA, _TENSOR_DATA_LOCATION):
            return None  # already external: leave it to the external-data reader
        if number == _TENSOR_RAW_DATA and wire == _LEN:
            if raw is not None:
                return None  # repeated raw_data (protobuf keeps the last): unusual, leave it to onnx
            raw = (value_start, value_end)
            continue
        if number == _TENSOR_DATA_TYPE and wire == _VARINT:
            data_type = _read_varint(data, value_start)[0]
        elif number == _TENSOR_DIMS:
            dims += _read_dims(data, wire, value_start, value_end)
        elif number not in _HEADER_FIELDS:
            return None  # typed data or a segment beside raw_data: left inline for the validator to report
        kept.append(data[start:value_end])
    if raw is None or raw[1] - raw[0] < MIN_PAYLOAD_BYTES:
        return None
    dtype = _PAYLOAD_DTYPES.get(data_type)
    if dtype is None or any(d < 0 for d in dims):
        return None
    count = 1
    for d in dims:
        count *= d  # Python ints: no int64 wrap-around
    if count * dtype.itemsize != raw[1] - raw[0]:
        return None  # a size mismatch: the validator reports it properly
    view = np.frombuffer(data.obj, dtype=dtype, count=count, offset=raw[0]).reshape(dims)
    # Serialized messages concatenate as a merge: the kept fields plus data_location = EXTERNAL.
    return b"".join([*kept, _EXTERNAL_LOCATION]), view


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
    """Write ``model`` with every payload reference replaced by its raw_data; returns the bytes written.

    The bytes are those ``model.SerializeToString()`` gives for the model with the arrays inline: fields in
    field-number order, the payloads spliced where their raw_data belongs.
    """
    graph = _graph_pieces(model.graph, store)
    before, after = _split(model, _MODEL_GRAPH)
    pieces: list[bytes | memoryview] = [before]
    if model.HasField("graph"):
        pieces += [_tag(_MODEL_GRAPH, _LEN), _varint(sum(len(p) for p in graph)), *graph]
    pieces.append(after)
    total = sum(len(p) for p in pieces)
    if total > _PROTOBUF_LIMIT:
        raise WireFormatError(f"{total} bytes is over the 2 GiB protobuf limit")
    _write_pieces(Path(path), pieces)
    return total


def _graph_pieces(graph: onnx.GraphProto, store: PayloadStore) -> list[bytes | memoryview]:
    before, after = _split(graph, _GRAPH_INITIALIZER)
    pieces: list[bytes | memoryview] = [before]
    for tensor in graph.initializer:
        array = store.array(tensor)
        if array is None and tensor.data_location == onnx.TensorProto.EXTERNAL and not tensor.external_data:
            # A copy of a reference, made behind the store's back: its bytes are unknown here. Never write it.
            raise WireFormatError(f"initializer '{tensor.name}' is a payload reference this store does not hold")
        if array is None:
            body: list[bytes | memoryview] = [tensor.SerializeToString()]
        else:
            head, tail = _split(tensor, _TENSOR_RAW_DATA, skip=("data_location", "external_data"))
            payload = memoryview(array).cast("B") if array.nbytes else b""
            body = [head, _tag(_TENSOR_RAW_DATA, _LEN), _varint(len(payload)), payload, tail]
        pieces += [_tag(_GRAPH_INITIALIZER, _LEN), _varint(sum(len(p) for p in body)), *body]
    pieces.append(after)
    return pieces


def _split(message: Any, number: int, *, skip: tuple[str, ...] = ()) -> tuple[bytes, bytes]:
    """``message`` serialized without field ``number`` (and ``skip``): the fields before it, and after it."""
    parts = (type(message)(), type(message)())
    for descriptor, value in message.ListFields():
        if descriptor.number == number or descriptor.name in skip:
            continue
        copy_field(parts[descriptor.number > number], descriptor, value)
    return parts[0].SerializeToString(), parts[1].SerializeToString()


def copy_field(target: Any, descriptor: Any, value: Any) -> None:
    """Set field ``descriptor`` of ``target`` to ``value``, as one item of ``ListFields()`` gives them."""
    if descriptor.is_repeated:
        getattr(target, descriptor.name).extend(value)
    elif descriptor.type == descriptor.TYPE_MESSAGE:
        getattr(target, descriptor.name).CopyFrom(value)
    else:
        setattr(target, descriptor.name, value)


def write_external(
    model: onnx.ModelProto,
    store: PayloadStore | None,
    path: str | os.PathLike[str],
    data_path: str | os.PathLike[str],
    *,
    location: str,
    threshold: int = 1024,
) -> int:
    """Write ``model`` at ``path`` with its large initializers in ``data_path`` (named ``location`` in the model).

    Payload references and raw_data initializers of ``threshold`` bytes or more (in every graph) move to the
    data file, one after the other; ``model`` is changed in place to point at them. Returns the bytes written
    to ``data_path`` (0: nothing was large enough, and the file is left empty).
    """
    offset = 0
    with open(data_path, "wb") as data:
        for tensor in _initializers(model.graph):
            array = store.array(tensor) if store is not None else None
            if array is not None:
                buffer: bytes | memoryview = memoryview(array).cast("B") if array.nbytes else b""
            elif tensor.HasField("raw_data") and tensor.data_location != onnx.TensorProto.EXTERNAL:
                if len(tensor.raw_data) < threshold:
                    continue
                buffer = tensor.raw_data
            else:
                continue
            data.write(buffer)
            tensor.ClearField("raw_data")
            tensor.data_location = onnx.TensorProto.EXTERNAL
            del tensor.external_data[:]
            for key, value in (("location", location), ("offset", str(offset)), ("length", str(len(buffer)))):
                tensor.external_data.add(key=key, value=value)
            offset += len(buffer)
    skeleton = model.SerializeToString()
    if len(skeleton) > _PROTOBUF_LIMIT:
        raise WireFormatError(f"{len(skeleton)} bytes without the weights is over the 2 GiB protobuf limit")
    Path(path).write_bytes(skeleton)
    return offset


def _initializers(graph: onnx.GraphProto) -> Iterator[onnx.TensorProto]:
    yield from graph.initializer
    for node in graph.node:
        for attr in node.attribute:
            for sub in [attr.g] if attr.type == onnx.AttributeProto.GRAPH else attr.graphs:
                yield from _initializers(sub)


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
