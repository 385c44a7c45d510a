"""Whether a model's tensors and names are what their fields claim: data sizes that match dims and type,
one data field per tensor, dims that are not negative and whose product fits int64, names that are UTF-8.

onnx.checker covers much of this, but bnfuse shows it only the small initializers (passes.optimize.validate
keeps the large ones out of the serialized copy), and protobuf hands back non-UTF-8 names as bytes.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import onnx
from onnx import external_data_helper, helper

from bnfuse.errors import ModelError

_T = onnx.TensorProto
# Bytes per element of raw_data for the byte-aligned types; the sub-byte types pack (see tensor_nbytes).
_ITEM_BYTES = {
    t: np.dtype(helper.tensor_dtype_to_np_dtype(t)).itemsize
    for t in onnx.TensorProto.DataType.values()
    if t not in (_T.UNDEFINED, _T.STRING, _T.UINT4, _T.INT4, _T.FLOAT4E2M1, _T.UINT2, _T.INT2) and t < _T.FLOAT6E2M3
}
_PACKED_BITS = {_T.UINT4: 4, _T.INT4: 4, _T.FLOAT4E2M1: 4, _T.UINT2: 2, _T.INT2: 2}
# Values per element in each typed field, for the types whose layout there is one value per element
# (complex: two); the packed and 6-bit types are left to onnx.
_TYPED_FIELDS = {
    "float_data": {_T.FLOAT: 1, _T.COMPLEX64: 2},
    "double_data": {_T.DOUBLE: 1, _T.COMPLEX128: 2},
    "int64_data": {_T.INT64: 1},
    "uint64_data": {_T.UINT32: 1, _T.UINT64: 1},
    "string_data": {_T.STRING: 1},
    "int32_data": {
        t: 1
        for t in (_T.INT32, _T.INT16, _T.UINT16, _T.INT8, _T.UINT8, _T.BOOL, _T.FLOAT16, _T.BFLOAT16)
        + (_T.FLOAT8E4M3FN, _T.FLOAT8E4M3FNUZ, _T.FLOAT8E5M2, _T.FLOAT8E5M2FNUZ, _T.FLOAT8E8M0)
    },
}
_INT64_MAX = 2**63 - 1


def element_count(tensor: onnx.TensorProto, what: str) -> int:
    """The product of the dims, or ModelError for a negative dim or a product past int64."""
    count = 1
    for dim in tensor.dims:
        if dim < 0:
            raise ModelError(f"{what}: negative dimension {dim} in dims {list(tensor.dims)[:8]}")
        count *= dim
    if count > _INT64_MAX:
        raise ModelError(f"{what}: dims {list(tensor.dims)[:8]} hold more than 2^63 elements")
    return count


def tensor_nbytes(tensor: onnx.TensorProto, what: str) -> int | None:
    """Bytes of the tensor's raw_data as its dims and type require; None for types without a raw layout."""
    count = element_count(tensor, what)
    if tensor.data_type in _ITEM_BYTES:
        return count * _ITEM_BYTES[tensor.data_type]
    bits = _PACKED_BITS.get(tensor.data_type)
    return None if bits is None else (count * bits + 7) // 8


def check_tensors(model: onnx.ModelProto, *, what: str) -> None:
    """ModelError when a tensor's data disagrees with its dims and type, for tensors of any size.

    Tensors still marked external (payload references of bnfuse.protowire, consistent by construction) are
    skipped.
    """
    for tensor in external_data_helper._get_all_tensors(model):
        if tensor.data_location == _T.EXTERNAL:
            continue
        label = f"{what}: tensor '{printable_name(tensor.name)}'"
        count = element_count(tensor, label)
        raw = ["raw_data"] if tensor.HasField("raw_data") else []  # not ListFields: it would copy the bytes
        present = raw + [name for name in _TYPED_FIELDS if len(getattr(tensor, name))]
        if len(present) > 1:
            raise ModelError(f"{label}: holds its values twice ({' and '.join(present)}); keep one")
        if not present:
            continue  # an empty tensor, or no data at all: onnx.checker names the second
        field = present[0]
        if field == "raw_data":
            need = tensor_nbytes(tensor, label)
            have = len(tensor.raw_data)
            if need is not None and have != need:
                raise ModelError(f"{label}: raw_data holds {have} bytes but its dims and type need {need}")
            continue
        per_element = _TYPED_FIELDS[field].get(tensor.data_type)
        have = len(getattr(tensor, field))
        if per_element is not None and have != count * per_element:
            raise ModelError(f"{label}: {field} holds {have} values but its dims need {count * per_element}")


def check_strings(model: onnx.ModelProto, *, what: str) -> None:
    """ModelError when a name or other text field is not UTF-8 (protobuf parses it and hands back bytes)."""
    bad = _invalid_string(model)
    if bad is not None:
        raise ModelError(f"{what}: {bad} is not valid UTF-8 text")


def _invalid_string(message: Any) -> str | None:
    """The first string field of ``message`` (or a sub-message) that holds bytes that are not UTF-8, as text."""
    if isinstance(message, onnx.TensorProto):  # not ListFields: it would copy raw_data
        fields = [(message.DESCRIPTOR.fields_by_name[n], getattr(message, n)) for n in _TENSOR_TEXT_FIELDS]
    else:
        fields = message.ListFields()
    for descriptor, value in fields:
        values = value if descriptor.is_repeated else [value]
        if descriptor.type == descriptor.TYPE_STRING:
            for text in values:
                if not isinstance(text, str):
                    return f"{type(message).__name__}.{descriptor.name} {bytes(text)[:40]!r}"
        elif descriptor.type == descriptor.TYPE_MESSAGE:
            for item in values:
                bad = _invalid_string(item)
                if bad is not None:
                    return bad
    return None


_TENSOR_TEXT_FIELDS = ("name", "doc_string", "external_data", "metadata_props")


def type_name(data_type: int) -> str:
    try:
        return onnx.TensorProto.DataType.Name(data_type)
    except ValueError:
        return f"type {data_type}"


def printable_name(name: str) -> str:
    return name if len(name) <= 80 else name[:77] + "..."
