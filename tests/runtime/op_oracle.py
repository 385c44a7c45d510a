"""The BN ops' contract as a user sees it: single-op ONNX models of domain ``bnfuse``, run in a real onnxruntime
session with the registered library, against NumPy float64 formulas written here from the attribute values
(docs/ops.md), not through bnfuse's own config parsing or reference kernels.

Shared by tests/runtime/test_op_matrix.py (the full matrix, bad input, a seeded random sample) and
bench/fuzz_ops.py (the long random run). Imports only what a user would: numpy, onnx, onnxruntime and bnfuse's
public ``session_options``; whichever implementation is registered (Python-hosted or native) is what runs.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import onnxruntime as ort
from onnx import TensorProto, helper

from bnfuse.runtime import session_options

DOMAIN = "bnfuse"
INFERENCE = "BatchNormalizationInference"
TRAINING = "BatchNormalizationTraining"
GRAD = "BatchNormalizationGrad"
OPS = (INFERENCE, TRAINING, GRAD)
# (data type T, parameter type U): the registered pairs
TYPE_PAIRS = {"f32": (np.float32, np.float32), "f16": (np.float16, np.float16), "f16-f32": (np.float16, np.float32)}
CPU = ["CPUExecutionProvider"]
ONNX_TYPES = {np.dtype(np.float32): TensorProto.FLOAT, np.dtype(np.float16): TensorProto.FLOAT16,
              np.dtype(np.float64): TensorProto.DOUBLE, np.dtype(np.int64): TensorProto.INT64}  # fmt: skip

INPUTS = {
    INFERENCE: ["X", "scale", "B", "mean", "var"],
    TRAINING: ["X", "scale", "B", "input_mean", "input_var"],
    GRAD: ["dY", "X", "scale", "saved_mean", "saved_inv_std"],
}
OUTPUTS = {
    INFERENCE: ["Y"],
    TRAINING: ["Y", "running_mean", "running_var", "saved_mean", "saved_inv_std", "batch_var"],
    GRAD: ["dX", "dScale", "dBias"],
}
DATA_INPUTS = {"X", "dY", "Y"}
DATA_OUTPUTS = {"Y", "dX"}


def f32(value: float) -> float:
    """ONNX float attributes are float32: the value the op reads."""
    return float(np.float32(value))


# -- models and sessions --------------------------------------------------------------------------------------


def model_bytes(
    op: str,
    attributes: Mapping[str, Any],
    data_type: Any = np.float32,
    param_type: Any = np.float32,
    *,
    inputs: Sequence[str] | None = None,
    outputs: Sequence[str] | None = None,
    input_types: Mapping[str, Any] | None = None,
    raw_attributes: Sequence[Any] = (),
) -> bytes:
    """One ``bnfuse`` node in a model: inputs of unknown shape, typed T (data) or U (parameters).

    ``inputs`` / ``outputs`` default to the op's full lists (Grad gains Y with activation "relu");
    ``input_types`` overrides a type by name; ``raw_attributes`` are AttributeProtos added as they are (wrong types).
    """
    if inputs is None:
        inputs = INPUTS[op] + (["Y"] if op == GRAD and attributes.get("activation") == "relu" else [])
    outputs = OUTPUTS[op] if outputs is None else outputs
    types = {name: data_type if name in DATA_INPUTS | DATA_OUTPUTS else param_type for name in (*inputs, *outputs)}
    types.update(input_types or {})
    node = helper.make_node(op, list(inputs), list(outputs), domain=DOMAIN, name=f"node_{op}", **attributes)
    node.attribute.extend(raw_attributes)
    graph = helper.make_graph(
        [node],
        op,
        [helper.make_tensor_value_info(n, ONNX_TYPES[np.dtype(types[n])], None) for n in inputs],
        [helper.make_tensor_value_info(n, ONNX_TYPES[np.dtype(types[n])], None) for n in outputs],
    )
    opsets = [helper.make_opsetid("", 17), helper.make_opsetid(DOMAIN, 1)]
    model = helper.make_model(graph, opset_imports=opsets)
    model.ir_version = 8  # onnxruntime >= 1.14 reads it
    return model.SerializeToString()


def session(model: bytes, threads: int = 2) -> ort.InferenceSession:
    options = session_options(
        CPU, intra_op_num_threads=threads, log_severity_level=4
    )  # errors are asserted, not logged
    return ort.InferenceSession(model, options, providers=CPU)


# -- layouts and data -----------------------------------------------------------------------------------------


def channel_axis(shape: Sequence[int], axis: int) -> int:
    return axis % len(shape)


def reduction_axes(shape: Sequence[int], attributes: Mapping[str, Any]) -> tuple[int, ...]:
    if attributes.get("mode", "spatial") == "per_activation":
        return (0,)
    channel = channel_axis(shape, attributes.get("axis", 1))
    return tuple(a for a in range(len(shape)) if a != channel)


def param_shape(shape: Sequence[int], attributes: Mapping[str, Any]) -> tuple[int, ...]:
    if attributes.get("mode", "spatial") == "per_activation":
        return tuple(shape[1:])
    return (shape[channel_axis(shape, attributes.get("axis", 1))],)


def broadcast_shape(shape: Sequence[int], attributes: Mapping[str, Any]) -> tuple[int, ...]:
    axes = set(reduction_axes(shape, attributes))
    return tuple(1 if a in axes else n for a, n in enumerate(shape))


@dataclass(frozen=True)
class Case:
    """One op call: the op, its attributes, the type pair, X's shape and a seed for the data."""

    op: str
    attributes: dict[str, Any] = field(hash=False)
    types: str
    shape: tuple[int, ...]
    seed: int = 0

    @property
    def data_type(self) -> Any:
        return TYPE_PAIRS[self.types][0]

    @property
    def param_type(self) -> Any:
        return TYPE_PAIRS[self.types][1]

    def describe(self) -> str:
        attrs = ",".join(f"{k}={v}" for k, v in sorted(self.attributes.items()))
        return f"{self.op} {self.types} {self.shape} seed {self.seed} [{attrs}]"


# the attributes the inputs depend on (Grad's saved statistics and Y): cases that differ only elsewhere share them
_FEED_ATTRIBUTES = {INFERENCE: ("mode", "axis"), TRAINING: ("mode", "axis"),
                    GRAD: ("mode", "axis", "epsilon", "use_global_stats", "fix_gamma", "activation")}  # fmt: skip


def feeds(case: Case) -> dict[str, np.ndarray]:
    """Seeded inputs in the case's types: X (offset per channel), parameters, running statistics, dY; for Grad
    the saved statistics of X and (with relu) the training op's Y, as the training op would give them. Read-only
    arrays, shared by the cases that differ only in attributes the inputs do not depend on (the large ones take
    a second to draw)."""
    relevant = tuple((k, case.attributes[k]) for k in _FEED_ATTRIBUTES[case.op] if k in case.attributes)
    return dict(_feeds(case.op, case.types, case.shape, case.seed, relevant))


@functools.lru_cache(maxsize=4)
def _feeds(op: str, types: str, shape: tuple[int, ...], seed: int, relevant: tuple) -> dict[str, np.ndarray]:
    arrays = _draw(Case(op, dict(relevant), types, shape, seed))
    for array in arrays.values():
        array.flags.writeable = False
    return arrays


def _draw(case: Case, location: float = 0.5, spread: float = 2.0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(case.seed)
    attrs, shape = case.attributes, case.shape
    pshape = param_shape(shape, attrs)
    bshape = broadcast_shape(shape, attrs)
    t, u = case.data_type, case.param_type
    offsets = rng.normal(location, 1.0, pshape).reshape(bshape)
    x = (rng.standard_normal(shape, np.float32) * spread + offsets).astype(t)
    scale = rng.uniform(0.5, 1.5, pshape).astype(u)
    bias = (0.2 * rng.standard_normal(pshape)).astype(u)
    if case.op == INFERENCE:
        mean = (offsets.reshape(pshape) + 0.3 * rng.standard_normal(pshape)).astype(u)
        var = rng.uniform(0.5, 2.0, pshape).astype(u)
        return {"X": x, "scale": scale, "B": bias, "mean": mean, "var": var}
    if case.op == TRAINING:
        running_mean = (0.3 * rng.standard_normal(pshape)).astype(u)
        running_var = rng.uniform(0.5, 2.0, pshape).astype(u)
        return {"X": x, "scale": scale, "B": bias, "input_mean": running_mean, "input_var": running_var}
    dy = rng.standard_normal(shape, np.float32).astype(t)
    x64 = x.astype(np.float64)
    axes = reduction_axes(shape, attrs)
    eps = f32(attrs.get("epsilon", 1e-5))
    mean = x64.mean(axis=axes, keepdims=True) if x.size else np.zeros(bshape)
    var = x64.var(axis=axes, keepdims=True) if x.size else np.zeros(bshape)
    if attrs.get("use_global_stats", 0):  # a frozen BN's backward gets the running statistics
        mean = mean + 0.3 * rng.standard_normal(bshape)
        var = var * rng.uniform(0.5, 2.0, bshape)
    saved_mean, saved_inv_std = mean.astype(u).reshape(pshape), (1.0 / np.sqrt(var + eps)).astype(u).reshape(pshape)
    out = {"dY": dy, "X": x, "scale": scale, "saved_mean": saved_mean, "saved_inv_std": saved_inv_std}
    if attrs.get("activation") == "relu":
        g = 1.0 if attrs.get("fix_gamma", 0) else scale.astype(np.float64).reshape(bshape)
        xhat = (x64 - saved_mean.astype(np.float64).reshape(bshape)) * saved_inv_std.astype(np.float64).reshape(bshape)
        out["Y"] = np.maximum(g * xhat + bias.astype(np.float64).reshape(bshape), 0).astype(t)
    return out


# -- the float64 formulas (docs/ops.md) -----------------------------------------------------------------------


def expected(case: Case, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The op's outputs in float64 from the inputs as fed (already rounded to T / U) and the attribute values."""
    attrs, shape = case.attributes, case.shape
    v = {name: a.astype(np.float64) for name, a in inputs.items()}
    axes = reduction_axes(shape, attrs)
    bshape, pshape = broadcast_shape(shape, attrs), param_shape(shape, attrs)
    count = math.prod(shape[a] for a in axes)
    eps = f32(attrs.get("epsilon", 1e-5))

    def b(name: str) -> np.ndarray:
        return v[name].reshape(bshape)

    if case.op == INFERENCE:
        return {"Y": b("scale") * (v["X"] - b("mean")) / np.sqrt(b("var") + eps) + b("B")}
    fix_gamma, frozen = bool(attrs.get("fix_gamma", 0)), bool(attrs.get("use_global_stats", 0))
    relu = attrs.get("activation", "none") == "relu"
    g = np.ones(bshape) if fix_gamma else b("scale")
    if case.op == TRAINING:
        x = v["X"]
        momentum = f32(attrs.get("momentum", 0.9))
        convention = attrs.get("momentum_convention", "onnx")
        weight = 1.0 - momentum if convention in ("onnx", "mxnet") else momentum
        if frozen:
            mean, var = b("input_mean"), b("input_var")
            new_mean, new_var, batch_var = v["input_mean"], v["input_var"], v["input_var"]
        elif x.size == 0:  # an empty batch leaves the running statistics, the saved ones are 0
            zero = np.zeros(pshape)
            return {"Y": x, "running_mean": v["input_mean"], "running_var": v["input_var"], "saved_mean": zero,
                    "saved_inv_std": zero, "batch_var": zero}  # fmt: skip
        else:
            mean, var = x.mean(axis=axes, keepdims=True), x.var(axis=axes, keepdims=True)
            unbiased = var * count / (count - 1) if attrs.get("unbiased_running_var", 0) and count > 1 else var
            new_mean = v["input_mean"] * (1 - weight) + mean.reshape(pshape) * weight
            new_var = v["input_var"] * (1 - weight) + unbiased.reshape(pshape) * weight
            batch_var = var.reshape(pshape)
        inv_std = 1.0 / np.sqrt(var + eps)
        y = g * (x - mean) * inv_std + b("B")
        if relu:
            y = np.maximum(y, 0)
        return {"Y": y, "running_mean": new_mean, "running_var": new_var, "saved_mean": mean.reshape(pshape),
                "saved_inv_std": inv_std.reshape(pshape), "batch_var": batch_var}  # fmt: skip
    dy = np.where(v["Y"] <= 0, 0.0, v["dY"]) if relu else v["dY"]
    inv_std = b("saved_inv_std")
    xhat = (v["X"] - b("saved_mean")) * inv_std
    dbias = dy.sum(axis=axes, keepdims=True)
    dscale = (dy * xhat).sum(axis=axes, keepdims=True)
    if frozen:
        dx = dy * g * inv_std
    else:
        dx = g * inv_std * (dy - dbias / max(count, 1) - xhat * dscale / max(count, 1))
    # dX may cancel to far below its terms (a batch of 2: |dX| ~ 1e-6 from terms ~ 1): rounding is relative to them
    terms = float(np.abs(g * inv_std * dy).max()) if dy.size else 0.0
    return {
        "dX": dx,
        "dScale": np.zeros(pshape) if fix_gamma else dscale.reshape(pshape),
        "dBias": dbias.reshape(pshape),
        "dX:scale": np.array(terms),
    }


def tolerance(dtype: Any) -> float:
    """Relative to the output's largest magnitude (or, for dX, its terms' when they cancel), plus the type's
    smallest subnormal: float32 outputs accumulate in float64 and round once (float16 inputs are exact in
    float32); float16 outputs round to 11 bits."""
    return 2e-3 if np.dtype(dtype) == np.float16 else 2e-5


def mismatches(case: Case, got: Sequence[np.ndarray], want: Mapping[str, np.ndarray]) -> list[str]:
    """Outputs that differ from the formulas, one line each (empty: all agree)."""
    problems = []
    names = OUTPUTS[case.op]
    for name, array in zip(names, got, strict=True):
        wanted_type = case.data_type if name in DATA_OUTPUTS else case.param_type
        reference = want[name]
        if array.dtype != np.dtype(wanted_type) or array.shape != reference.shape:
            problems.append(f"{name}: {array.dtype} {array.shape}, expected {np.dtype(wanted_type)} {reference.shape}")
            continue
        if not array.size:
            continue
        tol = tolerance(wanted_type)
        scale = max(float(np.abs(reference).max()), float(want.get(f"{name}:scale", 0.0)), 1e-30)
        error = np.abs(array.astype(np.float64) - reference)
        bad = error > tol * (np.abs(reference) + scale) + float(np.finfo(wanted_type).smallest_subnormal)
        if not np.isfinite(array).all() or bad.any():
            worst = np.unravel_index(int(np.argmax(np.where(np.isfinite(error), error, np.inf))), error.shape)
            problems.append(
                f"{name}: {int(bad.sum())} of {array.size} off, worst at {tuple(int(i) for i in worst)}: "
                f"{array[worst]!r} vs {reference[worst]!r} (tolerance {tol} x (|want| + max |want| = {scale:.3g}))"
            )
    return problems


def run_case(case: Case, threads: int = 2) -> list[str]:
    """Build, run and compare one case; returns its mismatches."""
    inputs = feeds(case)
    sess = session(model_bytes(case.op, case.attributes, case.data_type, case.param_type), threads)
    got = sess.run(None, inputs)
    return mismatches(case, got, expected(case, inputs))


# -- random cases ---------------------------------------------------------------------------------------------


def random_case(rng: np.random.Generator, seed: int, max_elements: int = 20000) -> Case:
    """An op, a type pair, a rank 2-6 shape (small dimensions, sometimes 1) and attributes drawn at random."""
    op = OPS[int(rng.integers(3))]
    types = list(TYPE_PAIRS)[int(rng.integers(3))]
    rank = int(rng.integers(2, 7))
    while True:
        shape = tuple(int(d) for d in rng.choice([1, 1, 2, 3, 4, 5, 7, 8, 16, 33], size=rank))
        if math.prod(shape) <= max_elements:
            break
    attrs: dict[str, Any] = {}
    if rng.random() < 0.3:
        attrs["mode"] = "per_activation"
    elif rng.random() < 0.6:
        attrs["axis"] = int(rng.choice([a for a in range(-rank + 1, rank) if a % rank != 0]))
    if rng.random() < 0.5:
        attrs["epsilon"] = float(rng.choice([1e-5, 1e-3, 0.1, 1.0]))
    if op != INFERENCE:
        for flag in ("fix_gamma", "use_global_stats"):
            if rng.random() < 0.3:
                attrs[flag] = 1
        if rng.random() < 0.3:
            attrs["activation"] = "relu"
    if op == TRAINING:
        if rng.random() < 0.4:
            attrs["unbiased_running_var"] = 1
        if rng.random() < 0.6:
            attrs["momentum_convention"] = str(rng.choice(["onnx", "mxnet", "pytorch", "mindspore", "cudnn"]))
        if rng.random() < 0.6:
            attrs["momentum"] = float(rng.choice([0.0, 0.1, 0.5, 0.9, 1.0]))
    return Case(op, attrs, types, shape, seed)
