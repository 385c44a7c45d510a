"""Which tensors of a graph are compile-time constants, and their values.

A tensor is constant when it is an initializer that cannot be overridden (not also a graph input, or
any initializer in IR version < 4, where inputs list every initializer), the output of a Constant node,
or the output of a small constant subgraph: ConstantOfShape / Identity / Cast / Unsqueeze / Squeeze /
Reshape / Concat / Transpose whose inputs are constant. onnx's shipped light models build every weight
with ConstantOfShape; tf2onnx builds Keras kernels with Reshape + Transpose.

Values are read straight from the TensorProtos, so untouched initializers are exported unchanged.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import onnx
import onnx_graphsurgeon as gs
from onnx import helper, numpy_helper
from onnx_graphsurgeon.ir.tensor import LazyValues

from bnfuse.protowire import PayloadStore, release_pages

# ConstantOfShape can describe huge tensors in a few bytes: a 1 MB file can ask for tens of GB. What a
# resolver materializes (ConstantOfShape fills, Cast copies) is capped in total; past the budget a tensor is
# simply not treated as constant (its BN is reported as not folded). onnx's light ResNet-50, the largest
# shipped model built this way, needs ~100 MB.
MAX_MATERIALIZED_BYTES = 512 * 2**20


class PayloadValues(LazyValues):
    """Lazy values of a payload reference (bnfuse.protowire): a read-only view of the mapped weights."""

    def __init__(self, tensor: onnx.TensorProto, array: np.ndarray) -> None:
        super().__init__(tensor)
        self._array = array

    def load(self) -> np.ndarray:
        return self._array


def release_mapped(tensor: gs.Constant) -> None:
    """Release the mapped pages of a payload Constant whose values are about to be replaced (see release_pages)."""
    values = getattr(tensor, "_values", None)
    if isinstance(values, PayloadValues):
        release_pages(values.load())


def attach_payloads(graph: gs.Graph, store: PayloadStore) -> None:
    """Give the graph's payload-reference Constants their mapped values (call right after gs.import_onnx)."""
    for tensor in graph.tensors().values():
        values = getattr(tensor, "_values", None)
        if isinstance(tensor, gs.Constant) and isinstance(values, LazyValues):
            array = store.array(values.tensor)
            if array is not None:
                tensor._values = PayloadValues(values.tensor, array)


def constant_array(tensor: gs.Constant) -> np.ndarray:
    """A gs.Constant's values without caching them in the Constant (which would force re-serialization)."""
    values = tensor._values
    if isinstance(values, PayloadValues):
        return values.load()
    if isinstance(values, LazyValues):
        return numpy_helper.to_array(values.tensor)
    return np.asarray(values)


class ConstantResolver:
    """Memoized constant values of gs tensors (None for tensors that are not constant)."""

    def __init__(self, *, overridable: set[str], budget_bytes: int | None = None) -> None:
        self._overridable = overridable
        self._cache: dict[int, tuple[gs.Tensor, np.ndarray | None]] = {}
        self.budget_bytes = MAX_MATERIALIZED_BYTES if budget_bytes is None else budget_bytes
        self.spent_bytes = 0  # materialized so far
        self.over_budget: set[str] = set()  # tensors left non-constant because of the budget

    def _spend(self, nbytes: int, tensor_name: str) -> bool:
        """Whether ``nbytes`` more may be materialized (and count them when so)."""
        if self.spent_bytes + nbytes > self.budget_bytes:
            self.over_budget.add(tensor_name)
            return False
        self.spent_bytes += nbytes
        return True

    def value(self, tensor: gs.Tensor | None) -> np.ndarray | None:
        if tensor is None or not tensor.name:
            return None
        key = id(tensor)
        hit = self._cache.get(key)
        if hit is not None:
            return hit[1]
        result = self._compute(tensor)
        self._cache[key] = (tensor, result)  # holding the tensor keeps its id from being reused
        return result

    def forget(self, tensor: gs.Tensor) -> None:
        """Drop a memoized value after the tensor's values were replaced."""
        self._cache.pop(id(tensor), None)

    def _compute(self, tensor: gs.Tensor) -> np.ndarray | None:
        if isinstance(tensor, gs.Constant):
            if tensor.name in self._overridable:
                return None
            return constant_array(tensor)
        if len(tensor.inputs) != 1:
            return None
        node = tensor.inputs[0]
        rule = _RULES.get(node.op) if node.domain in ("", "ai.onnx", None) else None
        if rule is None or len(node.outputs) != 1:
            return None
        try:
            return rule(self, node)
        except (ValueError, TypeError, KeyError, IndexError):
            return None  # a malformed constant subgraph is simply not a constant

    def _input(self, node: gs.Node, index: int) -> np.ndarray | None:
        if index >= len(node.inputs) or not node.inputs[index].name:
            return None
        return self.value(node.inputs[index])

    def _axes(self, node: gs.Node) -> list[int] | None:
        """Unsqueeze / Squeeze axes: an attribute before opset 13, an input from 13 on."""
        if "axes" in node.attrs:
            return [int(a) for a in node.attrs["axes"]]
        axes = self._input(node, 1)
        return None if axes is None else [int(a) for a in axes.reshape(-1)]


def _constant_node(resolver: ConstantResolver, node: gs.Node) -> np.ndarray | None:
    attrs = node.attrs
    if isinstance(attrs.get("value"), gs.Constant):
        return constant_array(attrs["value"])
    scalars = {
        "value_float": np.float32,
        "value_floats": np.float32,
        "value_int": np.int64,
        "value_ints": np.int64,
    }
    for key, dtype in scalars.items():
        if key in attrs:
            return np.asarray(attrs[key], dtype=dtype)
    return None  # sparse_value, value_string(s): not weights


def _constant_of_shape(resolver: ConstantResolver, node: gs.Node) -> np.ndarray | None:
    shape = resolver._input(node, 0)
    if shape is None:
        return None
    dims = [int(d) for d in shape.reshape(-1)]
    if any(d < 0 for d in dims):
        return None
    fill = node.attrs.get("value")
    element = constant_array(fill).reshape(-1) if isinstance(fill, gs.Constant) else np.zeros(1, np.float32)
    count = 1
    for d in dims:
        count *= d  # Python ints: no wrap-around
    if not resolver._spend(count * element.dtype.itemsize, node.outputs[0].name):
        return None
    return np.full(dims, element[0], dtype=element.dtype)


def _identity(resolver: ConstantResolver, node: gs.Node) -> np.ndarray | None:
    return resolver._input(node, 0)


def _cast(resolver: ConstantResolver, node: gs.Node) -> np.ndarray | None:
    value = resolver._input(node, 0)
    if value is None:
        return None
    target = node.attrs["to"]
    dtype = np.dtype(helper.tensor_dtype_to_np_dtype(int(target)) if isinstance(target, int) else target)
    if not resolver._spend(value.size * dtype.itemsize, node.outputs[0].name):
        return None
    return value.astype(dtype)


def _unsqueeze(resolver: ConstantResolver, node: gs.Node) -> np.ndarray | None:
    value, axes = resolver._input(node, 0), resolver._axes(node)
    if value is None or axes is None:
        return None
    rank = value.ndim + len(axes)
    normalized = sorted(a + rank if a < 0 else a for a in axes)
    return np.expand_dims(value, tuple(normalized))


def _squeeze(resolver: ConstantResolver, node: gs.Node) -> np.ndarray | None:
    value = resolver._input(node, 0)
    if value is None:
        return None
    has_axes = "axes" in node.attrs or (len(node.inputs) > 1 and node.inputs[1].name)
    axes = resolver._axes(node) if has_axes else None
    if has_axes and axes is None:
        return None
    if axes is None:
        return np.squeeze(value)
    return np.squeeze(value, axis=tuple(a + value.ndim if a < 0 else a for a in axes))


def _reshape(resolver: ConstantResolver, node: gs.Node) -> np.ndarray | None:
    value, shape = resolver._input(node, 0), resolver._input(node, 1)
    if value is None or shape is None:
        return None
    dims = [int(d) for d in shape.reshape(-1)]
    if not node.attrs.get("allowzero", 0):
        dims = [value.shape[i] if d == 0 else d for i, d in enumerate(dims)]
    return value.reshape(dims)


def _concat(resolver: ConstantResolver, node: gs.Node) -> np.ndarray | None:
    """Concat of constants: the dynamo exporter builds Reshape targets this way."""
    values = [resolver._input(node, i) for i in range(len(node.inputs))]
    if not values or any(v is None for v in values):
        return None
    return np.concatenate(values, axis=int(node.attrs["axis"]))


def _transpose(resolver: ConstantResolver, node: gs.Node) -> np.ndarray | None:
    """Transpose of a constant: tf2onnx (optimizers off) turns every Keras HWIO kernel into OIHW this way."""
    value = resolver._input(node, 0)
    if value is None:
        return None
    perm = node.attrs.get("perm")
    return np.ascontiguousarray(np.transpose(value, None if perm is None else [int(p) for p in perm]))


_RULES: dict[str, Callable[[ConstantResolver, gs.Node], np.ndarray | None]] = {
    "Constant": _constant_node,
    "ConstantOfShape": _constant_of_shape,
    "Identity": _identity,
    "Cast": _cast,
    "Unsqueeze": _unsqueeze,
    "Squeeze": _squeeze,
    "Reshape": _reshape,
    "Concat": _concat,
    "Transpose": _transpose,
}


def overridable_initializers(graph: onnx.GraphProto, ir_version: int) -> set[str]:
    """Initializers that are also graph inputs, which a caller may feed: not constants (IR >= 4)."""
    if ir_version < 4:
        return set()
    initializers = {t.name for t in graph.initializer}
    return {i.name for i in graph.input if i.name in initializers}
