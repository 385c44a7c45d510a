"""Numerical proof of a rewrite: run original and optimized models in onnxruntime on the same random inputs.

The reference session runs with every onnxruntime graph optimization disabled, so it computes the
original graph as written (no BatchNormalization fusion of its own). Errors are reported per output as
max absolute difference and max relative difference (normalized by the largest reference magnitude).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import onnx
import onnxruntime as ort

from bnfuse.errors import BnfuseError
from bnfuse.io import MAX_IR_VERSION
from bnfuse.passes.report import CheckResult, OutputError

# Relative tolerance by output element type: a fold changes rounding, not math. float16 rounding differences
# compound with depth: on a float16 ResNet-50 the folded model differs from the unfolded one by 1.2e-2 while
# the unfolded one is itself 2.1e-2 away from its float32 twin, hence 3e-2.
TOLERANCES = {
    onnx.TensorProto.FLOAT: 1e-4,
    onnx.TensorProto.DOUBLE: 1e-9,
    onnx.TensorProto.FLOAT16: 3e-2,
    onnx.TensorProto.BFLOAT16: 5e-2,
}
BATCH_DIM = 1
SPATIAL_DIM = 32
OTHER_DIM = 8


def compare_models(
    original: onnx.ModelProto,
    optimized: onnx.ModelProto,
    *,
    input_shapes: Mapping[str, Sequence[int]] | None = None,
    seed: int = 0,
    tolerance: float | None = None,
) -> CheckResult:
    """Max abs / rel error per output of ``optimized`` against ``original`` on seeded random inputs."""
    reference = _session(original, "original", optimize=False)
    candidate = _session(optimized, "optimized", optimize=False)
    feeds = random_inputs(reference, input_shapes or {}, seed)
    expected = reference.run(None, feeds)
    actual = candidate.run(None, feeds)
    names = [o.name for o in reference.get_outputs()]
    elem_types = {o.name: o.type.tensor_type.elem_type for o in original.graph.output}
    results = []
    for name, want, got in zip(names, expected, actual, strict=True):
        limit = tolerance if tolerance is not None else TOLERANCES.get(elem_types.get(name, 0), 1e-4)
        results.append(_error(name, np.asarray(want), np.asarray(got), limit))
    shapes = {name: list(value.shape) for name, value in feeds.items()}
    return CheckResult(seed=seed, input_shapes=shapes, outputs=results)


def random_inputs(
    session: ort.InferenceSession, input_shapes: Mapping[str, Sequence[int]], seed: int
) -> dict[str, np.ndarray]:
    """Seeded inputs for every graph input; dynamic dims from ``input_shapes`` or small defaults."""
    unknown = set(input_shapes) - {i.name for i in session.get_inputs()}
    if unknown:
        raise BnfuseError(f"--input-shape names no model input: {', '.join(sorted(unknown))}")
    rng = np.random.default_rng(seed)
    feeds = {}
    for info in session.get_inputs():
        shape = _concrete_shape(info.name, info.shape, input_shapes.get(info.name))
        feeds[info.name] = _random_tensor(rng, info.type, shape, info.name)
    return feeds


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


def _random_tensor(rng: np.random.Generator, ort_type: str, shape: list[int], name: str) -> np.ndarray:
    kinds = {
        "tensor(float)": np.float32,
        "tensor(double)": np.float64,
        "tensor(float16)": np.float16,
        "tensor(int64)": np.int64,
        "tensor(int32)": np.int32,
        "tensor(int8)": np.int8,
        "tensor(uint8)": np.uint8,
        "tensor(bool)": np.bool_,
    }
    dtype = kinds.get(ort_type)
    if dtype is None:
        raise BnfuseError(f"check: cannot make random values for input '{name}' of type {ort_type}")
    if np.issubdtype(dtype, np.floating):
        return rng.standard_normal(shape).astype(dtype)
    if dtype is np.bool_:
        return rng.integers(0, 2, shape).astype(bool)
    return rng.integers(0, 8, shape).astype(dtype)


def _session(model: onnx.ModelProto, what: str, *, optimize: bool) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.graph_optimization_level = (
        ort.GraphOptimizationLevel.ORT_ENABLE_ALL if optimize else ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    )
    options.log_severity_level = 3
    data = model.SerializeToString()
    if model.ir_version > MAX_IR_VERSION or model.ir_version == 0:
        # Protobuf keeps the last value of a repeated scalar field: append ir_version (field 1, varint)
        # instead of copying the whole model to lower it.
        data += bytes([0x08, MAX_IR_VERSION])
    try:
        return ort.InferenceSession(data, options, providers=["CPUExecutionProvider"])
    except Exception as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise BnfuseError(f"check: onnxruntime cannot run the {what} model ({first[:300]})") from exc


def _error(name: str, want: np.ndarray, got: np.ndarray, tolerance: float) -> OutputError:
    if want.shape != got.shape:
        return OutputError(name, float("inf"), float("inf"), tolerance)
    if want.dtype.kind not in "fc":
        diff = float(np.max(np.abs(want.astype(np.float64) - got.astype(np.float64)), initial=0.0))
        return OutputError(name, diff, diff, tolerance)
    want64, got64 = want.astype(np.float64), got.astype(np.float64)
    if not np.array_equal(np.isnan(want64), np.isnan(got64)):
        return OutputError(name, float("inf"), float("inf"), tolerance)
    finite = np.isfinite(want64) & np.isfinite(got64)
    if not np.array_equal(want64[~finite], got64[~finite], equal_nan=True):
        return OutputError(name, float("inf"), float("inf"), tolerance)
    diff = float(np.max(np.abs(want64[finite] - got64[finite]), initial=0.0))
    scale = float(np.max(np.abs(want64[finite]), initial=0.0))
    return OutputError(name, diff, diff / scale if scale > 0 else diff, tolerance)
