"""A node's attributes, read through onnxruntime's OrtKernelInfo when it creates the node's kernel."""

from __future__ import annotations

import ctypes
from collections.abc import Callable, Sequence
from typing import Any

from bnfuse.runtime.ortabi.api import OrtApi, OrtError

# onnxruntime's message for an attribute the node does not have (OpNodeProtoHelper::GetAttr). Any other failure
# (a type mismatch reads "Attribute name and type don't match") is an error in the model, never a default.
# The list look-ups (GetAttrs) say it as "No attribute with this name is defined."
_ABSENT_ATTRIBUTE = ("No attribute with name", "No attribute with this name is defined")


class KernelInfo:
    """Attributes of one node, read once when onnxruntime creates its kernel.

    A missing attribute gives the default; one of another type raises (naming op, node, attribute and both
    types). Unknown attribute names cannot be caught here: no OrtApi version lets a kernel list a node's
    attributes (OrtKernelInfo offers only look-up by name).
    """

    def __init__(self, api: OrtApi, info: int, op: str = "") -> None:
        self._api = api
        self._info = info
        self._op = op

    def _present(self, status: int | None, name: str, expected: str) -> bool:
        """True when the look-up succeeded, False when the node has no attribute ``name``; raises otherwise."""
        if not status:
            return True
        message = self._api.status_message(status)
        self._api.ReleaseStatus(status)
        if message.startswith(_ABSENT_ATTRIBUTE):
            return False
        raise OrtError(
            f"{self._op}: attribute {name} must be {expected}, got {self._kind(name)} "
            f"(node {self.node_name()!r}; onnxruntime: {message})"
        )

    def _kind(self, name: str) -> str:
        """What attribute ``name`` holds, found by asking for each scalar type in turn (for error messages)."""
        api, info, key = self._api, self._info, name.encode()
        probes: tuple[tuple[str, Callable[[], int | None]], ...] = (
            ("an int", lambda: api.KernelInfoGetAttribute_int64(info, key, ctypes.byref(ctypes.c_int64()))),
            ("a float", lambda: api.KernelInfoGetAttribute_float(info, key, ctypes.byref(ctypes.c_float()))),
            ("a string", lambda: api.KernelInfoGetAttribute_string(info, key, None, ctypes.byref(ctypes.c_size_t()))),
        )
        for kind, probe in probes:
            status = probe()
            if not status:
                return kind
            api.ReleaseStatus(status)
        return "another type (a list, tensor or graph)"

    def float_attr(self, name: str, default: float) -> float:
        value = ctypes.c_float()
        status = self._api.KernelInfoGetAttribute_float(self._info, name.encode(), ctypes.byref(value))
        return float(value.value) if self._present(status, name, "a float") else default

    def int_attr(self, name: str, default: int) -> int:
        value = ctypes.c_int64()
        status = self._api.KernelInfoGetAttribute_int64(self._info, name.encode(), ctypes.byref(value))
        return int(value.value) if self._present(status, name, "an int") else default

    def string_attr(self, name: str, default: str) -> str:
        size = ctypes.c_size_t(0)
        status = self._api.KernelInfoGetAttribute_string(self._info, name.encode(), None, ctypes.byref(size))
        if not self._present(status, name, "a string"):
            return default
        buffer = ctypes.create_string_buffer(size.value)
        self._api.check(self._api.KernelInfoGetAttribute_string(self._info, name.encode(), buffer, ctypes.byref(size)))
        return buffer.value.decode("utf-8", "replace")

    def floats_attr(self, name: str, default: Sequence[float]) -> tuple[float, ...]:
        array = self._array_attr(name, self._api.KernelInfoGetAttributeArray_float, ctypes.c_float, "a list of floats")
        return tuple(default) if array is None else tuple(float(v) for v in array)

    def ints_attr(self, name: str, default: Sequence[int]) -> tuple[int, ...]:
        array = self._array_attr(name, self._api.KernelInfoGetAttributeArray_int64, ctypes.c_int64, "a list of ints")
        return tuple(default) if array is None else tuple(int(v) for v in array)

    def _array_attr(self, name: str, getter: Callable[..., int | None], ctype: Any, kind: str) -> list[Any] | None:
        """A list attribute's values through ``getter`` (KernelInfoGetAttributeArray_*), None where it is absent."""
        size = ctypes.c_size_t(0)
        if not self._present(getter(self._info, name.encode(), None, ctypes.byref(size)), name, kind):
            return None
        values = (ctype * max(1, size.value))()
        self._api.check(getter(self._info, name.encode(), values, ctypes.byref(size)))
        return list(values[: size.value])

    def input_count(self) -> int:
        """How many inputs the node has (optional ones included)."""
        count = ctypes.c_size_t(0)
        self._api.check(self._api.KernelInfo_GetInputCount(self._info, ctypes.byref(count)))
        return count.value

    def node_name(self) -> str:
        size = ctypes.c_size_t(0)
        if not self._succeeded(self._api.KernelInfo_GetNodeName(self._info, None, ctypes.byref(size))):
            return ""
        if size.value <= 1:
            return ""
        buffer = ctypes.create_string_buffer(size.value)
        if not self._succeeded(self._api.KernelInfo_GetNodeName(self._info, buffer, ctypes.byref(size))):
            return ""
        return buffer.value.decode("utf-8", "replace")

    def _succeeded(self, status: int | None) -> bool:
        if status:  # the node name only labels messages: a failure leaves it empty
            self._api.ReleaseStatus(status)
            return False
        return True
