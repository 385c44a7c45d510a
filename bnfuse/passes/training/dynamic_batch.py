"""A training graph with a dynamic batch dimension, from builds at static batch sizes.

Every rule of the training pass (bnfuse's fast Conv / BN rules, onnx-ad's) writes the static shapes it sees
into constants: Reshape targets such as ``[N, C, H, W]`` or ``[C, N*H*W]``, a ``1/N`` or ``1/(N*H*W)`` scale,
a ``ones[1, N]`` row. Rather than teach every rule symbolic shapes, the pass builds the graph at three probe
batch sizes and compares them: nodes, attributes and constant names must be identical, and each constant that
differs must be one of

* int64, every entry ``base + coeff * N`` (shapes, counts),
* a float scalar ``sign * float32(c / (k * N))`` for integers ``c`` in (1, 2) and ``k >= 1`` (means over the
  batch), or ``float32(M / (M - 1))`` with ``M = k * N`` (the running variance's unbiasing factor); both checked
  bit for bit at every probe (float64 in a graph built from a float64 model),
* a tensor of one repeated value whose shape is ``base + coeff * N`` per axis (rows of ones).

Those constants become small nodes computing the same value from the actual batch size (``Shape`` of the first
data input), so a step on any batch size computes what a graph built for that size computes, bit for bit.
Anything else (a shape the model itself pins to one batch size, a decision a rule takes differently at
another size) keeps the batch static, and the reason is returned.

One build usually says it all (so a dynamic build costs what a static one does): at the prime probe size P, a
batch-dependent constant is an int64 tensor with entries ``coeff * P``, a float scalar ``c / (k * P)`` or
``k P / (k P - 1)`` (k recovered only where k - 1 and k + 1 give other values), or a uniform tensor with dimensions
``coeff * P`` -- the formulas above with ``base`` 0, each read off the one value. Where one value cannot tell (a
non-uniform tensor with a batch-sized dimension, a float32 factor several k round to) the two other probes run
and the comparison above decides. What one build cannot see, the three probes did not see either at the sizes
that matter: it assumes, as they do, that the graph's structure does not depend on the batch size, and it reads an
entry that is a multiple of P as batch-dependent (a model's own constant 2018 would be ``2 * N``), so a model
whose own dimensions or integer constants come near a multiple takes the three probes (``own_sizes_collide``:
build.py asks it first), as does an entry within 8 of a multiple (``N + 1``: base and coeff both non-zero).
The result is the three-probe graph, byte for byte, on the test networks
(tests/passes/training/test_dynamic_batch.py) and on resnet18, resnet50 and efficientnet_b0
(bench/RESULTS.md, session 33).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

PROBES = (1009, 1013, 1019)  # primes no other dimension of a real network is likely to equal
ONE_PROBE = True  # build.py: one build where its constants tell (False: always the three, for comparison)
BATCH_DIM = "batch"
PREFIX = "batch/"
_N = PREFIX + "n"  # int64 [1]: the batch size
_N_DOUBLE = PREFIX + "n.f64"  # float64 [1]


class NotBatchPolymorphic(Exception):
    """The probe builds differ in a way no batch-size formula explains."""


class _Ambiguous(Exception):
    """One build's value fits a batch-size formula for more than one k."""


def dynamic_batch_graph(
    build: Callable[[int], onnx.ModelProto], data_input: Callable[[onnx.ModelProto], str], *, one_probe: bool = True
) -> onnx.ModelProto:
    """The graph ``build(batch_size)`` makes, with a dynamic batch dimension read from the input
    ``data_input(model)``; NotBatchPolymorphic when the builds at the probe sizes cannot be one graph. One build at
    the first probe size where its constants say how they follow the batch (``one_probe``), all three otherwise."""
    first = build(PROBES[0])
    if one_probe:
        formulas = _formulas_of_one_build(first)
        if formulas is not None:
            return _dynamic_graph(first, [first], formulas, data_input, relax=_one_probe_sizes)
    models = [first, *(build(size) for size in PROBES[1:])]
    for other in models[1:]:
        _same_structure(first, other)
    inits = [{t.name: t for t in model.graph.initializer} for model in models]
    formulas = {}
    for name, tensor in inits[0].items():
        serialized = tensor.SerializeToString()
        if all(init[name].SerializeToString() == serialized for init in inits[1:]):
            continue  # the same tensor (a weight's placeholder while the pass builds, see weights.py)
        values = [numpy_helper.to_array(init[name]) for init in inits]
        if all(v.shape == values[0].shape and np.array_equal(v, values[0]) for v in values[1:]):
            continue
        formulas[name] = _fit(name, values)
    return _dynamic_graph(first, models, formulas, data_input, relax=_probe_sizes)


def _dynamic_graph(
    first: onnx.ModelProto,
    models: list[onnx.ModelProto],
    formulas: dict[str, _Formula],
    data_input: Callable[[onnx.ModelProto], str],
    relax: Callable[[list[list[int | None]]], list[tuple[int, int] | None]],
) -> onnx.ModelProto:
    """``first`` with each constant of ``formulas`` computed from the batch size, and its interface's batch
    dimensions symbolic (``relax``: per axis, (base, coeff) of a dimension that follows the batch, from the sizes
    each of ``models`` has there)."""
    nodes: list[onnx.NodeProto] = []
    added: list[onnx.TensorProto] = []
    data_types = {t.name: t.data_type for t in first.graph.initializer if t.name in formulas}
    for name, formula in formulas.items():
        _emit(name, formula, data_types[name], nodes, added)
    result = first  # rewritten in place: a probe build is nobody else's
    graph = result.graph
    if nodes:
        needs_double = any(n.input[0] == _N_DOUBLE or _N_DOUBLE in n.input for n in nodes)
        head = [
            helper.make_node("Shape", [data_input(first)], [PREFIX + "shape"], name=PREFIX + "shape"),
            helper.make_node("Gather", [PREFIX + "shape", PREFIX + "axis0"], [_N], name=PREFIX + "n", axis=0),
        ]
        added.append(numpy_helper.from_array(np.array([0], np.int64), PREFIX + "axis0"))
        if needs_double:
            head.append(helper.make_node("Cast", [_N], [_N_DOUBLE], name=PREFIX + "n.f64", to=TensorProto.DOUBLE))
        for index in reversed([i for i, t in enumerate(graph.initializer) if t.name in formulas]):
            del graph.initializer[index]  # in place: the others (the optimizer state's zeros, ...) are not copied
        graph.initializer.extend(added)
        for index, node in enumerate(head + nodes):  # in front of the body, which stays where it is
            graph.node.insert(index, node)
    all_values = [_all_values(m) for m in models]
    for index, value in enumerate(all_values[0]):  # dims read before each is rewritten (models[0] is result)
        _relax_dims(value, [values[index] for values in all_values], relax)
    return result


def without_batch_sizes(model: onnx.ModelProto, data_inputs: set[str]) -> onnx.ModelProto:
    """A copy of an inference model whose batch dimension is symbolic: the first dimension of the data inputs and
    outputs (an existing name kept), and no intermediate shapes (an export at one batch size records them; shape
    inference redoes them)."""
    result = onnx.ModelProto()
    result.CopyFrom(model)
    result.graph.ClearField("value_info")
    for value in [*[i for i in result.graph.input if i.name in data_inputs], *result.graph.output]:
        kind = value.type.tensor_type
        if kind.HasField("shape") and len(kind.shape.dim) and not kind.shape.dim[0].dim_param:
            kind.shape.dim[0].Clear()
            kind.shape.dim[0].dim_param = BATCH_DIM
    return result


def _all_values(model: onnx.ModelProto) -> list[onnx.ValueInfoProto]:
    return [*model.graph.input, *model.graph.output, *model.graph.value_info]


def _same_structure(a: onnx.ModelProto, b: onnx.ModelProto) -> None:
    if len(a.graph.node) != len(b.graph.node):
        raise NotBatchPolymorphic("the graph's nodes depend on the batch size")
    for x, y in zip(a.graph.node, b.graph.node, strict=True):
        if (x.op_type, x.domain, list(x.input), list(x.output)) != (y.op_type, y.domain, list(y.input), list(y.output)):
            raise NotBatchPolymorphic(f"node {x.name or x.output[0]!r} depends on the batch size")
        if list(x.attribute) != list(y.attribute):
            raise NotBatchPolymorphic(f"attributes of node {x.name or x.output[0]!r} depend on the batch size")
    if [t.name for t in a.graph.initializer] != [t.name for t in b.graph.initializer]:
        raise NotBatchPolymorphic("the graph's constants depend on the batch size")
    if [v.name for v in _all_values(a)] != [v.name for v in _all_values(b)]:
        raise NotBatchPolymorphic("the graph's interface depends on the batch size")


def _linear(series: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray] | None:
    """(base, coeff) with series[i] == base + coeff * PROBES[i] exactly, integers; None if there are none."""
    v = [np.asarray(s, np.int64) for s in series]
    coeff, rest = np.divmod(v[1] - v[0], PROBES[1] - PROBES[0])
    if rest.any():
        return None
    base = v[0] - coeff * PROBES[0]
    if not all(np.array_equal(base + coeff * p, s) for p, s in zip(PROBES, v, strict=True)):
        return None
    return base, coeff


def _multiples(value: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(base, coeff) of int64 entries at the first probe size alone: a non-zero multiple of it follows the batch
    (``coeff * N``), anything else is constant."""
    v = np.asarray(value, np.int64)
    coeff, rest = np.divmod(v, PROBES[0])
    coeff = np.where(rest == 0, coeff, 0)
    return v - coeff * PROBES[0], coeff


def _near_multiples(value: np.ndarray, window: int = 8, *, exact: bool = False) -> bool:
    """Whether an int entry is within ``window`` of a non-zero multiple of the first probe size without being one:
    ``N + 1`` and the like, which one value cannot tell from a constant (the three probes do); ``exact``: or is one
    (a model's own number one build would read as a batch size, own_sizes_collide)."""
    v = np.asarray(value, np.int64).reshape(-1)
    rest = np.abs(v) % PROBES[0] if exact else v % PROBES[0]
    near = (rest <= window) | (rest >= PROBES[0] - window)
    return bool(
        np.any((np.abs(v) >= PROBES[0] - window) & near if exact else (np.abs(v) > window) & (rest != 0) & near)
    )


def _inverse_scale(values: list[np.ndarray], dtype: type = np.float32) -> tuple[float, int] | None:
    """(c, k) with values[i] == dtype(c / (k * PROBES[i])) bit for bit (c signed), else None. One value:
    _Ambiguous where k - 1 or k + 1 rounds to the same value."""
    first = float(np.asarray(values[0]).reshape(-1)[0])  # a [1, 1, 1, 1] scale too
    if first == 0 or not np.isfinite(first):
        return None
    for numerator in (1.0, 2.0):
        c = numerator if first > 0 else -numerator
        k = round(numerator / (abs(first) * PROBES[0]))
        if k >= 1 and all(
            dtype(c / (k * p)).tobytes() == np.asarray(v, dtype).tobytes()
            for p, v in zip(PROBES[: len(values)], values, strict=True)
        ):
            if len(values) == 1 and any(dtype(c / (j * PROBES[0])) == dtype(first) for j in (k - 1, k + 1) if j):
                raise _Ambiguous
            return c, k
    return None


def _unbiased_factor(values: list[np.ndarray], dtype: type = np.float32) -> int | None:
    """k with values[i] == dtype(M / (M - 1)), M = k * PROBES[i], bit for bit (the running variance's
    unbiasing factor over M values a channel), else None; _Ambiguous if one value cannot tell k from k +- 1."""
    first = float(np.asarray(values[0]).reshape(-1)[0])  # a [1, 1, 1, 1] scale too
    if not np.isfinite(first) or first <= 1:
        return None
    k = round(first / (first - 1) / PROBES[0])

    def factor(j: int, p: int) -> bytes:
        return dtype((j * p) / (j * p - 1)).tobytes()

    ok = k >= 1 and all(
        factor(k, p) == np.asarray(v, dtype).tobytes() for p, v in zip(PROBES[: len(values)], values, strict=True)
    )
    if ok and len(values) == 1 and any(factor(j, PROBES[0]) == factor(k, PROBES[0]) for j in (k - 1, k + 1) if j):
        raise _Ambiguous
    return k if ok else None


@dataclass(frozen=True)
class _Linear:
    """int64 entries ``base + coeff * N``."""

    base: np.ndarray
    coeff: np.ndarray


@dataclass(frozen=True)
class _Inverse:
    """A float scalar ``c / (k * N)``."""

    c: float
    k: int
    shape: tuple[int, ...]


@dataclass(frozen=True)
class _Unbiased:
    """A float scalar ``M / (M - 1)``, ``M = k * N``."""

    k: int
    shape: tuple[int, ...]


@dataclass(frozen=True)
class _Fill:
    """One repeated value, shape ``base + coeff * N`` per axis."""

    fill: np.ndarray
    base: np.ndarray
    coeff: np.ndarray


_Formula = _Linear | _Inverse | _Unbiased | _Fill


def _fit(name: str, values: list[np.ndarray]) -> _Formula:
    """The formula of the constant ``name`` whose value at each probe size is ``values``; NotBatchPolymorphic if
    none fits."""
    shapes = [np.array(v.shape, np.int64) for v in values]
    same_shape = all(np.array_equal(s, shapes[0]) for s in shapes)
    if same_shape and values[0].dtype == np.int64:
        fit = _linear(values)
        if fit is not None:
            return _Linear(*fit)
    if same_shape and values[0].dtype in (np.float32, np.float64) and values[0].size == 1:
        formula = _scale(values)
        if formula is not None:
            return formula
    uniform = all(v.size and np.all(v == v.flat[0]) for v in values) and len({v.flat[0] for v in values}) == 1
    fit = _linear(shapes) if uniform and all(len(s) == len(shapes[0]) for s in shapes) else None
    if fit is not None:
        return _Fill(values[0].reshape(-1)[:1].copy(), *fit)
    raise NotBatchPolymorphic(f"constant {name!r} depends on the batch size in a way bnfuse cannot compute")


def _scale(values: list[np.ndarray]) -> _Inverse | _Unbiased | None:
    """A float scalar's formula: a mean's ``c / (k N)`` or the unbiasing factor (in the value's own precision:
    float64 in a graph built from a float64 model)."""
    dtype = values[0].dtype.type
    scale = _inverse_scale(values, dtype)
    if scale is not None:
        return _Inverse(scale[0], scale[1], values[0].shape)
    k = _unbiased_factor(values, dtype)
    return _Unbiased(k, values[0].shape) if k is not None else None


def own_sizes_collide(model: onnx.ModelProto, data_inputs: set[str]) -> str | None:
    """Why one build at the first probe size could misread the model's own numbers as batch sizes (a dimension or
    an integer constant at or near a multiple of it: a Reshape to ``[-1, 2018]`` would read as ``2 * N``), else
    None. Such a model takes the three probes, which compare values at three sizes instead."""
    graph = model.graph
    for value in graph.input:
        dims = [d.dim_value for d in value.type.tensor_type.shape.dim]
        if _near_multiples(dims[1:] if value.name in data_inputs else dims, exact=True):
            return f"input '{value.name}' has a dimension near {PROBES[0]}"
    for tensor in graph.initializer:
        if _near_multiples(list(tensor.dims), exact=True):
            return f"initializer '{tensor.name}' has a dimension near {PROBES[0]}"
        small = tensor.data_location != onnx.TensorProto.EXTERNAL and math.prod(tensor.dims) <= 4096
        if small and tensor.data_type in (onnx.TensorProto.INT64, onnx.TensorProto.INT32):
            if _near_multiples(numpy_helper.to_array(tensor), exact=True):
                return f"initializer '{tensor.name}' holds a value near a multiple of {PROBES[0]}"
    for node in graph.node:
        for attribute in node.attribute:
            if attribute.type == onnx.AttributeProto.INT and _near_multiples([attribute.i], exact=True):
                return f"{node.op_type} '{node.name}' has attribute {attribute.name} near a multiple of {PROBES[0]}"
            if attribute.type == onnx.AttributeProto.INTS and _near_multiples(list(attribute.ints), exact=True):
                return f"{node.op_type} '{node.name}' has attribute {attribute.name} near a multiple of {PROBES[0]}"
            if attribute.type == onnx.AttributeProto.TENSOR and attribute.t.data_type in (
                onnx.TensorProto.INT64,
                onnx.TensorProto.INT32,
            ):
                if _near_multiples(numpy_helper.to_array(attribute.t), exact=True):
                    return f"{node.op_type} '{node.name}' holds a value near a multiple of {PROBES[0]}"
    return None


def _formulas_of_one_build(model: onnx.ModelProto) -> dict[str, _Formula] | None:
    """The batch-dependent constants of the build at the first probe size, read off their values there (module
    docstring); None where one value cannot tell (the three probes decide)."""
    formulas: dict[str, _Formula] = {}
    inputs = {i.name for i in model.graph.input}  # state: the same tensor at every size
    for tensor in model.graph.initializer:
        if tensor.name in inputs or tensor.data_location == onnx.TensorProto.EXTERNAL:
            continue  # a weight's placeholder (weights.py) or an initial state value: never built per size
        if any(d and d % PROBES[0] == 0 for d in tensor.dims):
            value = numpy_helper.to_array(tensor)
            if not value.size or np.any(value != value.flat[0]):
                return None
            formulas[tensor.name] = _Fill(value.reshape(-1)[:1].copy(), *_multiples(np.array(tensor.dims, np.int64)))
        elif tensor.data_type == onnx.TensorProto.INT64:
            value = numpy_helper.to_array(tensor)
            if _near_multiples(value):
                return None
            base, coeff = _multiples(value)
            if coeff.any():
                formulas[tensor.name] = _Linear(base, coeff)
        elif tensor.data_type in (onnx.TensorProto.FLOAT, onnx.TensorProto.DOUBLE) and math.prod(tensor.dims) == 1:
            try:
                formula = _scale([numpy_helper.to_array(tensor)])
            except _Ambiguous:
                return None
            if formula is not None:
                formulas[tensor.name] = formula
    return formulas


def _emit(
    name: str, formula: _Formula, data_type: int, nodes: list[onnx.NodeProto], inits: list[onnx.TensorProto]
) -> None:
    """Nodes computing the constant ``name`` from the batch size (appended)."""
    make = helper.make_node
    if isinstance(formula, _Linear):
        n = _N if formula.base.ndim else _scalar_n(nodes, inits)
        inits.append(numpy_helper.from_array(np.asarray(formula.coeff, np.int64), f"{name}/coeff"))
        inits.append(numpy_helper.from_array(np.asarray(formula.base, np.int64), f"{name}/base"))
        nodes.append(make("Mul", [n, f"{name}/coeff"], [f"{name}/scaled"], name=f"{name}/scaled"))
        nodes.append(make("Add", [f"{name}/scaled", f"{name}/base"], [name], name=name))
    elif isinstance(formula, _Inverse):
        inits.append(numpy_helper.from_array(np.array([float(formula.k)], np.float64), f"{name}/k"))
        inits.append(numpy_helper.from_array(np.array([formula.c], np.float64), f"{name}/c"))
        inits.append(numpy_helper.from_array(np.array(formula.shape, np.int64), f"{name}/shape"))
        nodes += [
            make("Mul", [_N_DOUBLE, f"{name}/k"], [f"{name}/kn"], name=f"{name}/kn"),
            make("Div", [f"{name}/c", f"{name}/kn"], [f"{name}/f64"], name=f"{name}/f64"),
            make("Cast", [f"{name}/f64"], [f"{name}/f32"], name=f"{name}/f32", to=data_type),
            make("Reshape", [f"{name}/f32", f"{name}/shape"], [name], name=name),
        ]
    elif isinstance(formula, _Unbiased):
        inits.append(numpy_helper.from_array(np.array([float(formula.k)], np.float64), f"{name}/k"))
        inits.append(numpy_helper.from_array(np.array([1.0], np.float64), f"{name}/one"))
        inits.append(numpy_helper.from_array(np.array(formula.shape, np.int64), f"{name}/shape"))
        nodes += [
            make("Mul", [_N_DOUBLE, f"{name}/k"], [f"{name}/m"], name=f"{name}/m"),
            make("Sub", [f"{name}/m", f"{name}/one"], [f"{name}/m0"], name=f"{name}/m0"),
            # M = 1: factor 1, not inf (a static graph for one value leaves the variance biased: 0, not NaN)
            make("Max", [f"{name}/m0", f"{name}/one"], [f"{name}/m1"], name=f"{name}/m1"),
            make("Div", [f"{name}/m", f"{name}/m1"], [f"{name}/f64"], name=f"{name}/f64"),
            make("Cast", [f"{name}/f64"], [f"{name}/f32"], name=f"{name}/f32", to=data_type),
            make("Reshape", [f"{name}/f32", f"{name}/shape"], [name], name=name),
        ]
    else:
        fill = numpy_helper.from_array(formula.fill, "")
        fill.data_type = data_type
        inits.append(numpy_helper.from_array(np.asarray(formula.coeff, np.int64), f"{name}/coeff"))
        inits.append(numpy_helper.from_array(np.asarray(formula.base, np.int64), f"{name}/base"))
        nodes += [
            make("Mul", [_N, f"{name}/coeff"], [f"{name}/scaled"], name=f"{name}/scaled"),
            make("Add", [f"{name}/scaled", f"{name}/base"], [f"{name}/dims"], name=f"{name}/dims"),
            make("ConstantOfShape", [f"{name}/dims"], [name], name=name, value=fill),
        ]


def _scalar_n(nodes: list[onnx.NodeProto], inits: list[onnx.TensorProto]) -> str:
    """int64 scalar batch size (made once)."""
    scalar = PREFIX + "n.scalar"
    if not any(scalar in node.output for node in nodes):
        inits.append(numpy_helper.from_array(np.zeros(0, np.int64), PREFIX + "shape0"))
        nodes.append(helper.make_node("Reshape", [_N, PREFIX + "shape0"], [scalar], name=scalar))
    return scalar


def _probe_sizes(sizes: list[int | None]) -> tuple[int, int] | None:
    """(base, coeff) of a dimension whose size at the three probes varies (None: the same everywhere)."""
    if None in sizes or len(set(sizes)) == 1:
        return None
    fit = _linear([np.array(s) for s in sizes])
    return (int(fit[0]), int(fit[1])) if fit is not None else (-1, 0)


def _one_probe_sizes(sizes: list[int | None]) -> tuple[int, int] | None:
    """(0, coeff) of a dimension that is a multiple of the first probe size in its one build."""
    (size,) = sizes
    return (0, size // PROBES[0]) if size and size % PROBES[0] == 0 else None


def _relax_dims(
    value: onnx.ValueInfoProto,
    probes: list[onnx.ValueInfoProto],
    relax: Callable[[list[int | None]], tuple[int, int] | None],
) -> None:
    """Dimensions that follow the batch size become symbolic (``batch``, or ``k*batch`` where they are multiples;
    ``relax`` tells them from their sizes in the builds, (-1, 0) for one that follows it with no formula)."""
    kind = value.type.tensor_type
    if not kind.HasField("shape"):
        return
    dims = [[d.dim_value if d.HasField("dim_value") else None for d in p.type.tensor_type.shape.dim] for p in probes]
    if any(len(d) != len(dims[0]) for d in dims):
        kind.ClearField("shape")
        return
    for axis, dim in enumerate(kind.shape.dim):
        fit = relax([d[axis] for d in dims])
        if fit is None:
            continue
        base, coeff = fit
        dim.Clear()
        if base == 0 and coeff == 1:
            dim.dim_param = BATCH_DIM
        elif base == 0 and coeff:
            dim.dim_param = f"{coeff}*{BATCH_DIM}"
        else:
            dim.dim_param = f"{BATCH_DIM}_{axis}"
