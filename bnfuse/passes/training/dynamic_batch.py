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
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

PROBES = (1009, 1013, 1019)  # primes no other dimension of a real network is likely to equal
BATCH_DIM = "batch"
PREFIX = "batch/"
_N = PREFIX + "n"  # int64 [1]: the batch size
_N_DOUBLE = PREFIX + "n.f64"  # float64 [1]


class NotBatchPolymorphic(Exception):
    """The probe builds differ in a way no batch-size formula explains."""


def dynamic_batch_graph(
    build: Callable[[int], onnx.ModelProto], data_input: Callable[[onnx.ModelProto], str]
) -> onnx.ModelProto:
    """The graph ``build(batch_size)`` makes, with a dynamic batch dimension read from the input
    ``data_input(model)``; NotBatchPolymorphic when the builds at the probe sizes cannot be one graph."""
    models = [build(size) for size in PROBES]
    first = models[0]
    for other in models[1:]:
        _same_structure(first, other)
    inits = [{t.name: t for t in model.graph.initializer} for model in models]
    nodes: list[onnx.NodeProto] = []
    added: list[onnx.TensorProto] = []
    replaced: set[str] = set()
    for name, tensor in inits[0].items():
        serialized = tensor.SerializeToString()
        if all(init[name].SerializeToString() == serialized for init in inits[1:]):
            continue  # the same tensor (a weight's placeholder while the pass builds, see weights.py)
        values = [numpy_helper.to_array(init[name]) for init in inits]
        if all(v.shape == values[0].shape and np.array_equal(v, values[0]) for v in values[1:]):
            continue
        _replacement(name, values, tensor.data_type, nodes, added)
        replaced.add(name)
    result = onnx.ModelProto()
    result.CopyFrom(first)
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
        keep = [t for t in graph.initializer if t.name not in replaced]
        graph.ClearField("initializer")
        graph.initializer.extend(keep + added)
        body = list(graph.node)
        graph.ClearField("node")
        graph.node.extend(head + nodes + body)
    for index, value in enumerate([*graph.input, *graph.output, *graph.value_info]):
        _relax_dims(value, [_all_values(m)[index] for m in models])
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


def _inverse_scale(values: list[np.ndarray], dtype: type = np.float32) -> tuple[float, int] | None:
    """(c, k) with values[i] == dtype(c / (k * PROBES[i])) bit for bit (c signed), else None."""
    first = float(values[0])
    if first == 0 or not np.isfinite(first):
        return None
    for numerator in (1.0, 2.0):
        c = numerator if first > 0 else -numerator
        k = round(numerator / (abs(first) * PROBES[0]))
        if k >= 1 and all(
            dtype(c / (k * p)).tobytes() == np.asarray(v, dtype).tobytes() for p, v in zip(PROBES, values, strict=True)
        ):
            return c, k
    return None


def _unbiased_factor(values: list[np.ndarray], dtype: type = np.float32) -> int | None:
    """k with values[i] == dtype(M / (M - 1)), M = k * PROBES[i], bit for bit (the running variance's
    unbiasing factor over M values a channel), else None."""
    first = float(values[0])
    if not np.isfinite(first) or first <= 1:
        return None
    k = round(first / (first - 1) / PROBES[0])
    ok = k >= 1 and all(
        dtype((k * p) / (k * p - 1)).tobytes() == np.asarray(v, dtype).tobytes()
        for p, v in zip(PROBES, values, strict=True)
    )
    return k if ok else None


def _replacement(
    name: str, values: list[np.ndarray], data_type: int, nodes: list[onnx.NodeProto], inits: list[onnx.TensorProto]
) -> None:
    """Nodes computing the constant ``name`` from the batch size (appended); NotBatchPolymorphic if none do."""
    shapes = [np.array(v.shape, np.int64) for v in values]
    same_shape = all(np.array_equal(s, shapes[0]) for s in shapes)
    make = helper.make_node
    if same_shape and values[0].dtype == np.int64:
        fit = _linear(values)
        if fit is not None:
            base, coeff = fit
            n = _N if values[0].ndim else _scalar_n(nodes, inits)
            inits.append(numpy_helper.from_array(coeff, f"{name}/coeff"))
            inits.append(numpy_helper.from_array(base, f"{name}/base"))
            nodes.append(make("Mul", [n, f"{name}/coeff"], [f"{name}/scaled"], name=f"{name}/scaled"))
            nodes.append(make("Add", [f"{name}/scaled", f"{name}/base"], [name], name=name))
            return
    if same_shape and values[0].dtype in (np.float32, np.float64) and values[0].size == 1:
        dtype = values[0].dtype.type  # float64 in a graph built from a float64 model
        scale = _inverse_scale(values, dtype)
        if scale is not None:
            c, k = scale
            inits.append(numpy_helper.from_array(np.array([float(k)], np.float64), f"{name}/k"))
            inits.append(numpy_helper.from_array(np.array([c], np.float64), f"{name}/c"))
            inits.append(numpy_helper.from_array(np.array(values[0].shape, np.int64), f"{name}/shape"))
            nodes += [
                make("Mul", [_N_DOUBLE, f"{name}/k"], [f"{name}/kn"], name=f"{name}/kn"),
                make("Div", [f"{name}/c", f"{name}/kn"], [f"{name}/f64"], name=f"{name}/f64"),
                make("Cast", [f"{name}/f64"], [f"{name}/f32"], name=f"{name}/f32", to=data_type),
                make("Reshape", [f"{name}/f32", f"{name}/shape"], [name], name=name),
            ]
            return
        k = _unbiased_factor(values, dtype)
        if k is not None:
            inits.append(numpy_helper.from_array(np.array([float(k)], np.float64), f"{name}/k"))
            inits.append(numpy_helper.from_array(np.array([1.0], np.float64), f"{name}/one"))
            inits.append(numpy_helper.from_array(np.array(values[0].shape, np.int64), f"{name}/shape"))
            nodes += [
                make("Mul", [_N_DOUBLE, f"{name}/k"], [f"{name}/m"], name=f"{name}/m"),
                make("Sub", [f"{name}/m", f"{name}/one"], [f"{name}/m0"], name=f"{name}/m0"),
                # M = 1: factor 1, not inf (a static graph for one value leaves the variance biased: 0, not NaN)
                make("Max", [f"{name}/m0", f"{name}/one"], [f"{name}/m1"], name=f"{name}/m1"),
                make("Div", [f"{name}/m", f"{name}/m1"], [f"{name}/f64"], name=f"{name}/f64"),
                make("Cast", [f"{name}/f64"], [f"{name}/f32"], name=f"{name}/f32", to=data_type),
                make("Reshape", [f"{name}/f32", f"{name}/shape"], [name], name=name),
            ]
            return
    uniform = all(v.size and np.all(v == v.flat[0]) for v in values) and len({v.flat[0] for v in values}) == 1
    fit = _linear(shapes) if uniform and all(len(s) == len(shapes[0]) for s in shapes) else None
    if fit is not None:
        base, coeff = fit
        fill = numpy_helper.from_array(values[0].reshape(-1)[:1].copy(), "")
        fill.data_type = data_type
        inits.append(numpy_helper.from_array(coeff, f"{name}/coeff"))
        inits.append(numpy_helper.from_array(base, f"{name}/base"))
        nodes += [
            make("Mul", [_N, f"{name}/coeff"], [f"{name}/scaled"], name=f"{name}/scaled"),
            make("Add", [f"{name}/scaled", f"{name}/base"], [f"{name}/dims"], name=f"{name}/dims"),
            make("ConstantOfShape", [f"{name}/dims"], [name], name=name, value=fill),
        ]
        return
    raise NotBatchPolymorphic(f"constant {name!r} depends on the batch size in a way bnfuse cannot compute")


def _scalar_n(nodes: list[onnx.NodeProto], inits: list[onnx.TensorProto]) -> str:
    """int64 scalar batch size (made once)."""
    scalar = PREFIX + "n.scalar"
    if not any(scalar in node.output for node in nodes):
        inits.append(numpy_helper.from_array(np.zeros(0, np.int64), PREFIX + "shape0"))
        nodes.append(helper.make_node("Reshape", [_N, PREFIX + "shape0"], [scalar], name=scalar))
    return scalar


def _relax_dims(value: onnx.ValueInfoProto, probes: list[onnx.ValueInfoProto]) -> None:
    """Dimensions that follow the batch size become symbolic (``batch``, or ``k*batch`` where they are multiples)."""
    kind = value.type.tensor_type
    if not kind.HasField("shape"):
        return
    dims = [[d.dim_value if d.HasField("dim_value") else None for d in p.type.tensor_type.shape.dim] for p in probes]
    if any(len(d) != len(dims[0]) for d in dims):
        kind.ClearField("shape")
        return
    for axis, dim in enumerate(kind.shape.dim):
        sizes = [d[axis] for d in dims]
        if None in sizes or len(set(sizes)) == 1:
            continue
        fit = _linear([np.array(s) for s in sizes])
        dim.Clear()
        if fit is not None and int(fit[0]) == 0 and int(fit[1]) == 1:
            dim.dim_param = BATCH_DIM
        elif fit is not None and int(fit[0]) == 0:
            dim.dim_param = f"{int(fit[1])}*{BATCH_DIM}"
        else:
            dim.dim_param = f"{BATCH_DIM}_{axis}"
