"""Seeded random inputs for the check: every graph input a caller feeds, dynamic dims made concrete."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import onnx
from onnx import TensorProto, helper

from bnfuse.errors import BnfuseError

BATCH_DIM = 1
SPATIAL_DIM = 32
OTHER_DIM = 8


@dataclass(frozen=True)
class InputSpec:
    """A graph input the check feeds: name, ONNX element type, declared dims (int, symbolic name or None)."""

    name: str
    elem_type: int
    dims: list[int | str | None]


def input_specs(model: onnx.ModelProto) -> list[InputSpec]:
    """The inputs a caller must feed: graph inputs that are not initializers (IR < 4 lists those too)."""
    initializers = {t.name for t in model.graph.initializer}
    specs = []
    for info in model.graph.input:
        if info.name in initializers:
            continue
        if not info.type.HasField("tensor_type"):
            raise BnfuseError(f"check: input '{info.name}' is not a tensor; cannot make random values for it")
        tensor_type = info.type.tensor_type
        dims: list[int | str | None] = []
        for dim in tensor_type.shape.dim:
            if dim.HasField("dim_value"):
                dims.append(int(dim.dim_value))
            else:
                dims.append(dim.dim_param or None)
        specs.append(InputSpec(info.name, tensor_type.elem_type, dims))
    return specs


def random_inputs(
    model: onnx.ModelProto, input_shapes: Mapping[str, Sequence[int]], seed: int | Sequence[int]
) -> dict[str, np.ndarray]:
    """Seeded inputs for every graph input; dynamic dims from ``input_shapes`` or small defaults."""
    specs = input_specs(model)
    unknown = set(input_shapes) - {s.name for s in specs}
    if unknown:
        raise BnfuseError(f"--input-shape names no model input: {', '.join(sorted(unknown))}")
    rng = np.random.default_rng(seed)
    shapes = {spec.name: _concrete_shape(spec.name, spec.dims, input_shapes.get(spec.name)) for spec in specs}
    _require_memory(shapes)
    feeds = {}
    for spec in specs:
        try:
            feeds[spec.name] = _random_tensor(rng, spec.elem_type, shapes[spec.name], spec.name)
        except MemoryError as exc:
            raise BnfuseError(f"check: cannot allocate the random input '{spec.name}' ({exc})") from None
    return feeds


def _require_memory(shapes: Mapping[str, Sequence[int]]) -> None:
    """BnfuseError, saying how much memory they need, when the inputs cannot fit in half the machine's memory.

    Counted at 8 bytes an element: values are drawn as float64 before the cast to the input's type.
    """
    need = sum(8 * int(np.prod(shape, dtype=object)) for shape in shapes.values())
    try:
        physical = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        physical = 2**34
    if need > physical // 2:
        dims = ", ".join(f"{name}={'x'.join(map(str, shape))}" for name, shape in shapes.items())
        raise BnfuseError(
            f"check: the random inputs ({dims}) need {need / 2**30:,.1f} GiB of memory, more than half of this "
            f"machine's {physical / 2**30:,.0f} GiB; give smaller dims with --input-shape"
        )


def _concrete_shape(name: str, declared: Sequence[object], given: Sequence[int] | None) -> list[int]:
    if given is not None:
        given = [int(d) for d in given]
        if len(given) != len(declared) or any(
            isinstance(d, int) and d != g for d, g in zip(declared, given, strict=True)
        ):
            raise BnfuseError(f"--input-shape {name}: {given} does not match the declared shape {list(declared)}")
        return given
    shape = []
    for axis, dim in enumerate(declared):
        if isinstance(dim, int) and dim >= 0:
            shape.append(dim)
        elif axis == 0 or "batch" in str(dim).lower():
            shape.append(BATCH_DIM)
        elif len(declared) >= 3 and axis >= 2:
            shape.append(SPATIAL_DIM)
        else:
            shape.append(OTHER_DIM)
    return shape


_RANDOM_TYPES = {
    TensorProto.FLOAT,
    TensorProto.DOUBLE,
    TensorProto.FLOAT16,
    TensorProto.BFLOAT16,
    TensorProto.INT64,
    TensorProto.INT32,
    TensorProto.INT8,
    TensorProto.UINT8,
    TensorProto.BOOL,
}


def _random_tensor(rng: np.random.Generator, elem_type: int, shape: list[int], name: str) -> np.ndarray:
    if elem_type not in _RANDOM_TYPES:
        type_name = TensorProto.DataType.Name(elem_type) if elem_type in TensorProto.DataType.values() else elem_type
        raise BnfuseError(f"check: cannot make random values for input '{name}' of type {type_name}")
    # onnx's own mapping: bfloat16 is ml_dtypes.bfloat16, which onnx itself depends on.
    dtype = np.dtype(helper.tensor_dtype_to_np_dtype(elem_type))
    if elem_type in (TensorProto.FLOAT, TensorProto.DOUBLE, TensorProto.FLOAT16, TensorProto.BFLOAT16):
        return rng.standard_normal(shape).astype(dtype)
    if elem_type == TensorProto.BOOL:
        return rng.integers(0, 2, shape).astype(bool)
    return rng.integers(0, 8, shape).astype(dtype)
