"""How far each compared tensor may be from its reference, and the float16 / bfloat16 float32 twins.

Tolerances follow each compared tensor's element type. float32 / float64 tensors are compared with the
original directly: outputs and isolated chains at 1e-4 / 1e-9 relative, tensors in context at
``IN_CONTEXT_FACTOR`` times that, because a tensor inside the network carries the rounding of every fold
upstream, not yet averaged down by the final layers (measured: up to 1.2e-4 at ResNet-50's last BN, whose
output is 1.5e-5 off; every isolated chain of the registry's networks and onnx's light models is within
8e-7). A channel one percent off lands at ~1e-2 in context and alone. A float32 / float64 tensor past its tolerance
still passes within ``CONDITIONING_FACTOR`` times what one rounding of the folded values moves the optimized
model by (``allow_conditioning``: a Div by values near zero after the BN amplifies 1e-7 into 1e-4).

float16 / bfloat16 outputs and tensors in context are not compared directly: onnxruntime computes float16
Conv / Gemm / BN with float32 accumulation and rounds each output once, so the unfolded model is ~3e-4 from its
exact float32 twin, while a fold rounds each new weight and bias once more, and a model can amplify that by
itself (a Div by values near zero after the BN, a float16 ResNet-50's depth). The rule, the same in ``--check``
and in the differential fuzzer (bench/fuzz_folds.py calls ``precision_references`` and ``tensor_error``):
both models are measured against the original widened to float32, and the optimized model passes when its error
stays within ``LOW_PRECISION_FACTOR`` x (the original's own error + what moving the folded values by -1, 0 or +1
ulp of their type moves the optimized model, the largest of ``CONDITIONING_TWINS`` random twins and two moving
the biases alone by an ulp, computed in float32: ``Report.written_weights``, the constants the folds wrote) + a
floor of 2 ulps (``low_precision_limit``). Values
that a twin moves by a tenth of their own magnitude or more (a ``k / x`` with x within a few ulps of zero) are
not determined by the precision at all: they are left out, in both models and the twins (``determined``), and
so are the float32 original's inf / NaN values (a ``k / 0`` after a Relu), which the optimized model must match
(an inf by an inf of either sign: the sign of an exact zero is not kept by a fold; ``output_error``). An
optimized value that overflows where the float32 original is finite fails unless the original, each float16 tensor
held in float16 as its graph defines it (``own_precision``), overflows there too: onnxruntime's CPU computes
float16 graphs in float32 where it lacks float16 kernels, so its own run of the original can hide that overflow.

Why that is what the original keeps: a fold's only new error is rounding a * W and b' once (at most half an ulp
each), and downstream it is amplified exactly as any rounding at the BN's output is, the original's own
included. The twins move those same values by up to a whole ulp, so they show what the model does to that
rounding on the same inputs: a Div after the BN that turns the fold's one rounding into 2.5e-2 turns the
twins' into as much, and on the folded layer's own output the fold stays within the original's rounding. The
twins would also allow a fold that rounds much larger terms than the original does (a layer's bias that its
sum cancels, a BN mean moved through a sum), which does lose what the original keeps: such a fold is refused
before it is made, from the BN's statistics (bnfuse.passes.fold.fold_math: ``backward_rounding``,
``forward_magnitudes``; docs/exporting.md). A wrong fold (a channel 3% off, a missing
epsilon) lands far above the limit: the twins move by ~1e-3 where it moves by 3e-2. An isolated
low-precision chain is one layer deep, with nothing to amplify: it is held to 8 ulps of its type
(``ISOLATED_LOW_PRECISION``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from bnfuse.errors import BnfuseError
from bnfuse.passes.check.engines import Feeds, Model, run_models
from bnfuse.passes.report import OutputError

# Direct relative tolerance by element type. The float16 / bfloat16 entries apply only when the
# float32 reference cannot be built or run (or a tolerance is forced): see the module docstring.
TOLERANCES = {
    TensorProto.FLOAT: 1e-4,
    TensorProto.DOUBLE: 1e-9,
    TensorProto.FLOAT16: 3e-2,
    TensorProto.BFLOAT16: 5e-2,
}
LOW_PRECISION = {TensorProto.FLOAT16: 10, TensorProto.BFLOAT16: 7}  # element type -> stored mantissa bits
LOW_PRECISION_NAMES = {TensorProto.FLOAT16: "float16", TensorProto.BFLOAT16: "bfloat16"}
# A value an ulp's move of the folded values changes by this fraction of itself or more is not determined by the
# model's precision (``determined``): left out of the comparison.
UNDETERMINED = 0.1
# Margin over the precision-explained error (the original's own + the largest of CONDITIONING_TWINS twins with the
# folded values moved by an ulp). A bfloat16 channel 10% off must still fail: bfloat16's own noise is ~1e-2 on a
# small Conv -> BN.
LOW_PRECISION_FACTOR = 2.0
# Output rounding alone: 2 ulps at the largest magnitude (2^-10 float16, 2^-7 bfloat16).
LOW_PRECISION_FLOOR = {TensorProto.FLOAT16: 2.0**-9, TensorProto.BFLOAT16: 2.0**-6}
# An isolated chain (one fold, one layer) in float16 / bfloat16: 8 ulps at the largest magnitude. Measured
# <= 9.3e-4 on the registry's float16 networks; a channel 3% off lands at ~3e-2.
ISOLATED_LOW_PRECISION = {TensorProto.FLOAT16: 2.0**-7, TensorProto.BFLOAT16: 2.0**-4}
_MIN_EXPONENT = {TensorProto.FLOAT16: -24, TensorProto.BFLOAT16: -133}  # smallest subnormal: 2^this
# float32 / float64 tensors in context carry the rounding of every fold upstream (module docstring).
IN_CONTEXT_FACTOR = 10.0
# A float32 / float64 tensor beyond tolerance may still be within what one rounding of the folded values moves
# the optimized model by (see allow_conditioning): that many twins, and the margin over the largest of their errors.
CONDITIONING_TWINS = 3
CONDITIONING_FACTOR = 4.0
_TWIN_DRAW = 3


def tensor_error(
    name: str,
    want: np.ndarray,
    got: np.ndarray,
    references: References | None,
    index: int,
    tolerance: float | None,
    factor: float = 1.0,
) -> OutputError:
    elem_type = elem_type_of(want)
    if references is not None and elem_type in LOW_PRECISION:
        result = _low_precision_error(name, elem_type, want, got, references, index)
        if result is not None:
            return result
    limit = tolerance if tolerance is not None else factor * TOLERANCES.get(elem_type, 1e-4)
    return output_error(name, want, got, limit)


def elem_type_of(value: np.ndarray) -> int:
    try:
        return helper.np_dtype_to_tensor_dtype(value.dtype)
    except (KeyError, ValueError, TypeError):
        return 0


# ----- float32 / float64: what one re-rounding of the rewritten weights moves -----------------------------


def allow_conditioning(
    errors: dict[str, OutputError],
    failing: list[str],
    optimized: Model,
    feeds: Feeds,
    actual: list[np.ndarray],
    compared: list[str],
    written: Collection[str],
    seed: int,
) -> None:
    """Raise the tolerance of ``failing`` float32 / float64 tensors to what one rounding of the folded values
    moves the optimized model by.

    A fold computes each new weight exactly and rounds it once; a model can amplify that rounding by itself
    (a Div by values near zero after the BN turns 1e-7 into 1e-4). ``CONDITIONING_TWINS`` copies of the
    optimized model, each ``written`` constant moved by -1, 0 or +1 ulp at random, are run on the same inputs:
    a tensor whose error stays within ``CONDITIONING_FACTOR`` times the largest twin error is within what that
    rounding explains, not a wrong fold (a channel 1% off would need a model amplifying rounding 1e5-fold to
    hide in it). Where the original itself rounds what the fold computes exactly (a Conv output near 1e5 whose
    BN subtracts 1e5), the folded values are small and their rounding explains nothing: that still fails. A
    model whose twins cannot be built or run keeps the flat tolerance.
    """
    indices = [compared.index(n) for n in failing]
    try:
        full = optimized.full()
    except Exception:  # noqa: BLE001 - a model that cannot be loaded whole keeps the flat tolerance
        return
    moved = [0.0] * len(failing)
    for draw in range(CONDITIONING_TWINS):
        twin = rerounded(full, written, np.random.default_rng((seed, _TWIN_DRAW, draw)))
        if twin is None:
            return
        try:
            _, ((values,),) = run_models([(Model(twin), "re-rounded optimized", None, [(feeds, None)])], failing)
        except BnfuseError:
            return
        moved = [
            max(m, relative_error(np.asarray(actual[i]), np.asarray(v)))
            for m, i, v in zip(moved, indices, values, strict=True)
        ]
    for name, noise in zip(failing, moved, strict=True):
        error = errors[name]
        limit = max(error.tolerance, CONDITIONING_FACTOR * noise)
        errors[name] = OutputError(name, error.max_abs, error.max_rel, limit, error.reference, noise, error.constant)


def rerounded(model: onnx.ModelProto, names: Collection[str], rng: np.random.Generator) -> onnx.ModelProto | None:
    """A copy of ``model`` whose float32 / float64 initializers and Constants in ``names`` moved by a random -1,
    0 or +1 ulp each."""
    names = set(names)
    copy = onnx.ModelProto()
    copy.CopyFrom(model)

    def move(t: onnx.TensorProto, name: str) -> None:
        if name not in names or t.data_type not in (TensorProto.FLOAT, TensorProto.DOUBLE):
            return
        values = numpy_helper.to_array(t)
        steps = rng.integers(-1, 2, values.shape)
        towards = np.where(steps > 0, np.inf, -np.inf).astype(values.dtype)
        moved = np.where(steps != 0, np.nextafter(values, towards), values).astype(values.dtype)
        t.CopyFrom(numpy_helper.from_array(moved, t.name))

    try:
        for t in copy.graph.initializer:
            move(t, t.name)
        for node in copy.graph.node:
            if node.op_type == "Constant" and node.output:
                for attr in node.attribute:
                    if attr.type == onnx.AttributeProto.TENSOR:
                        move(attr.t, node.output[0])
    except Exception:  # noqa: BLE001 - external data numpy cannot read here: no twin
        return None
    return copy


# ----- float16 / bfloat16: the float32 reference ------------------------------------------------------


def _not_computed() -> list[np.ndarray] | None:
    return None


@dataclass(frozen=True)
class References:
    exact: list[np.ndarray]  # the original widened to float32
    folded: list[np.ndarray]  # the optimized model widened to float32: its own low-precision values, in float32
    moved: list[list[np.ndarray]]  # per twin: the same with the folds' values moved by an ulp (precision_references)
    engine: str
    # The original in its own precision (own_precision): run once, on the first call, only when an optimized value
    # overflows where ``exact`` does not; None when it cannot be built or run.
    own_precision: Callable[[], list[np.ndarray] | None] = _not_computed


def precision_references(
    original: Model,
    optimized: Model,
    feeds: dict[str, np.ndarray],
    seed: int,
    names: list[str],
    written: Collection[str] | None,
) -> References | None:
    """Tensors ``names`` of the original's float32 twin, of the optimized model's, and of twins of the latter
    whose ``written`` constants (the values the folds computed and rounded; None: every low-precision constant)
    moved by -1, 0 or +1 ulp of their type at random, and two whose biases alone moved by one ulp, away from
    zero and towards it: a bias that the layer's sum cancels rounds on its own, and random twins moving the
    weights with it can hide that (a fold 0.14 off where three random twins moved 0.035 and the biases alone
    0.42); None when not computable."""
    wide_feeds = {name: value.astype(np.float32) if is_float(value) else value for name, value in feeds.items()}
    try:
        exact, folded = widened(original.full()), widened(optimized.full())
    except Exception:  # a tensor numpy cannot convert: fall back to the direct comparison
        return None
    try:
        engine, ((want,),) = run_models([(Model(exact), "float32 reference", None, [(wide_feeds, None)])], names)
        del exact
        _, ((base,),) = run_models([(Model(folded), "float32 reference", None, [(wide_feeds, None)])], names)
        del folded
        twins = []
        variants = [{"rng": np.random.default_rng((seed, draw))} for draw in range(CONDITIONING_TWINS)]
        for variant in [*variants, {"biases": 1}, {"biases": -1}]:
            rounded = widened(optimized.full(), only=written, **variant)
            _, ((moved,),) = run_models([(Model(rounded), "float32 reference", None, [(wide_feeds, None)])], names)
            twins.append(moved)
    except BnfuseError:
        return None
    own = functools.cache(lambda: _run_own_precision(original, wide_feeds, names))
    return References(want, base, twins, engine, own)


def _run_own_precision(original: Model, feeds: Feeds, names: list[str]) -> list[np.ndarray] | None:
    """Tensors ``names`` of ``own_precision(original)`` on ``feeds`` (float32); None when not computable."""
    try:
        rounded = own_precision(original.full(), original.proto)
        if rounded is None:
            return None
        _, ((values,),) = run_models([(Model(rounded), "original in its own precision", None, [(feeds, None)])], names)
    except Exception:  # noqa: BLE001 - no reference in its own precision: the overflow stays a failure
        return None
    return values


def own_precision(model: onnx.ModelProto, skeleton: onnx.ModelProto | None = None) -> onnx.ModelProto | None:
    """The float32 twin of ``model`` with every tensor that is float16 / bfloat16 in ``model`` rounded to that type
    where a node of the main graph makes it (a Cast to it and back): the model as its graph defines it, each
    tensor held in its own precision; None when onnx cannot infer the tensors' types.

    onnxruntime's CPU runs a float16 model in float32 wherever it has no float16 kernel and rounds only at the
    outputs (its inserted ``InsertedPrecisionFreeCast``), so its float16 original can hide a tensor that overflows
    float16 (a BN's output past 65504, finite again after a Relu and a Conv), and which ops run in float16 changes
    with the graph: a fold that leaves that tensor to a Concat, which has a float16 kernel, shows the inf the
    original's own definition has (the check's exposed in-context tensors do the same). Rounded at every tensor,
    the original overflows where its definition does, whatever the engine.
    """
    try:
        inferred = onnx.shape_inference.infer_shapes(skeleton if skeleton is not None else model)
    except Exception:  # noqa: BLE001 - shape inference fails on some graphs (custom domains, over 2 GiB)
        return None
    graph = inferred.graph
    types = {
        info.name: info.type.tensor_type.elem_type
        for info in [*graph.input, *graph.value_info, *graph.output]
        if info.type.HasField("tensor_type")
    }
    wide = widened(model)
    taken = {o for node in wide.graph.node for o in node.output} | {i.name for i in wide.graph.input}
    taken |= {t.name for t in wide.graph.initializer}
    nodes = []
    for node in wide.graph.node:
        rounding = []
        for position, name in enumerate(node.output):
            elem_type = types.get(name)
            if not name or elem_type not in LOW_PRECISION:
                continue
            unrounded, low = _fresh(f"{name}_float32", taken), _fresh(f"{name}_{LOW_PRECISION_NAMES[elem_type]}", taken)
            node.output[position] = unrounded
            rounding.append(helper.make_node("Cast", [unrounded], [low], to=elem_type))
            rounding.append(helper.make_node("Cast", [low], [name], to=TensorProto.FLOAT))
        nodes += [node, *rounding]
    del wide.graph.node[:]
    wide.graph.node.extend(nodes)
    return wide


def _fresh(name: str, taken: set[str]) -> str:
    candidate, suffix = name, 0
    while candidate in taken:
        suffix += 1
        candidate = f"{name}_{suffix}"
    taken.add(candidate)
    return candidate


def low_precision_limit(own: float, moved: float, elem_type: int) -> float:
    """The float16 / bfloat16 rule (module docstring): how far from the float32 original an optimized tensor may
    be, given the original's own error and what one rounding of the folded values moves the optimized model by."""
    return LOW_PRECISION_FACTOR * (own + moved) + LOW_PRECISION_FLOOR[elem_type]


def is_float(value: np.ndarray) -> bool:
    # ml_dtypes' bfloat16 has numpy kind "V", not "f".
    return value.dtype.kind in "fc" or value.dtype == np.dtype(helper.tensor_dtype_to_np_dtype(TensorProto.BFLOAT16))


def widened(
    model: onnx.ModelProto,
    *,
    rng: np.random.Generator | None = None,
    only: Collection[str] | None = None,
    biases: int = 0,
) -> onnx.ModelProto:
    """A copy with every float16 / bfloat16 tensor, type and cast target turned into float32.

    With ``rng``, each low-precision constant value (of those named in ``only``, when given: an initializer's
    name or a Constant node's output) also moves by -1, 0 or +1 of its own ulp at random: at least what the
    one rounding of a folded value can have moved it by (at most half an ulp). With ``biases`` (+1 or -1)
    instead, only the one-dimensional ones (biases) move, all by one ulp away from zero (+1) or towards it (-1).
    """
    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    moved = None if only is None else set(only)

    def tensor(t: onnx.TensorProto, name: str | None = None) -> None:
        if t.data_type not in LOW_PRECISION:
            return
        values = numpy_helper.to_array(t).astype(np.float64)
        if moved is None or (name or t.name) in moved:
            if rng is not None:
                values = values + rng.integers(-1, 2, values.shape) * _ulp(values, t.data_type)
            elif biases and values.ndim <= 1:
                values = values + biases * np.where(values < 0, -1.0, 1.0) * _ulp(values, t.data_type)
        t.CopyFrom(numpy_helper.from_array(values.astype(np.float32), t.name))

    def value_info(info: onnx.ValueInfoProto) -> None:
        if info.type.HasField("tensor_type") and info.type.tensor_type.elem_type in LOW_PRECISION:
            info.type.tensor_type.elem_type = TensorProto.FLOAT

    def graph(g: onnx.GraphProto) -> None:
        for t in g.initializer:
            tensor(t)
        for info in [*g.input, *g.output, *g.value_info]:
            value_info(info)
        nodes(g.node)

    def nodes(items: Sequence[onnx.NodeProto]) -> None:
        for node in items:
            for attr in node.attribute:
                if attr.type == onnx.AttributeProto.TENSOR:
                    tensor(attr.t, node.output[0] if node.op_type == "Constant" and node.output else None)
                elif attr.type == onnx.AttributeProto.GRAPH:
                    graph(attr.g)
                elif attr.type == onnx.AttributeProto.GRAPHS:
                    for sub in attr.graphs:
                        graph(sub)
                elif attr.type == onnx.AttributeProto.INT and attr.name in ("to", "dtype") and attr.i in LOW_PRECISION:
                    attr.i = TensorProto.FLOAT  # Cast, EyeLike, Random*: the element type they produce

    graph(copy.graph)
    for function in copy.functions:
        nodes(function.node)
    return copy


def _ulp(values: np.ndarray, elem_type: int) -> np.ndarray:
    """The spacing of ``elem_type`` numbers at each of ``values`` (subnormal spacing near zero)."""
    _, exponent = np.frexp(np.abs(values))  # |v| = m * 2^e with m in [0.5, 1)
    return np.exp2(np.maximum(exponent - 1 - LOW_PRECISION[elem_type], _MIN_EXPONENT[elem_type]))


def _low_precision_error(
    name: str, elem_type: int, want: np.ndarray, got: np.ndarray, references: References, index: int
) -> OutputError | None:
    exact = np.asarray(references.exact[index], dtype=np.float64)
    base = np.asarray(references.folded[index], dtype=np.float64)
    if not (want.shape == got.shape == exact.shape == base.shape):
        return None  # the float32 twin says nothing useful here: compare directly
    finite = np.isfinite(exact)
    if np.isfinite(got[~finite].astype(np.float64)).any():
        return None  # the float32 original's inf / NaN (k / 0 after a Relu) must be matched: compare directly
    overflowing = _overflowing_in_own_precision(finite & ~np.isfinite(got.astype(np.float64)), references, index)
    twins = [np.asarray(twin[index], dtype=np.float64) for twin in references.moved]
    kept = determined(base, twins, exact) & finite & ~overflowing
    exact, want, got, base = exact[kept], want[kept], got[kept], base[kept]
    own = relative_error(exact, want)
    moved = max((relative_error(base, twin[kept]) for twin in twins), default=0.0)
    if not (np.isfinite(own) and np.isfinite(moved)):
        return None  # the original overflows in its own precision: only a direct comparison is meaningful
    noise = own + moved
    limit = low_precision_limit(own, moved, elem_type)
    result = output_error(name, exact, got, limit)
    reference = "float32 original"
    overflows = int(overflowing.sum())
    dropped = int(finite.sum()) - overflows - int(kept.sum())
    if dropped:
        reference += f" ({dropped} of {kept.size} values {LOW_PRECISION_NAMES[elem_type]} cannot determine left out)"
    if overflows:
        reference += (
            f" ({overflows} of {kept.size} values inf / NaN in both: the original overflows "
            f"{LOW_PRECISION_NAMES[elem_type]} there in its own precision)"
        )
    return OutputError(result.name, result.max_abs, result.max_rel, limit, reference=reference, noise=noise)


def _overflowing_in_own_precision(overflowed: np.ndarray, references: References, index: int) -> np.ndarray:
    """Of the values the optimized model gives as inf / NaN where the float32 original is finite
    (``overflowed``), those the original also overflows at in its own precision (``own_precision``): an inf
    matched by an inf, left out of the comparison. The rest stay compared and fail: the optimized model
    overflows where the original, as its graph defines it, does not."""
    if not overflowed.any():
        return overflowed
    own = references.own_precision()
    value = None if own is None else np.asarray(own[index], dtype=np.float64)
    if value is None or value.shape != overflowed.shape:
        return np.zeros_like(overflowed)
    return overflowed & ~np.isfinite(value)


def determined(base: np.ndarray, twins: Sequence[np.ndarray], exact: np.ndarray) -> np.ndarray:
    """Which values of ``base`` (the optimized model in float32) its precision determines: those no twin (the
    folded values moved by an ulp) moves by ``UNDETERMINED`` of their own magnitude, or of the original's
    (``exact``), or more. A wrong fold that sends a large value near zero stays compared: the twins move it
    by far less than the original's value.

    A ``k / x`` whose x lies within a few ulps of zero takes its size, and its sign, from the last bit of the
    folded values: the fold's one rounding flipped such a value from -2843 to +20304 where the twins gave
    44185, -1992 and 2094 (the original, rounded otherwise, happened to land on -2842). Such a value says nothing
    about the fold, and as the largest magnitude it would also set the scale of every other value's error; it
    is left out of both models' comparison and of the twins'.
    """
    with np.errstate(invalid="ignore", over="ignore"):
        spread = np.max([np.abs(twin - base) for twin in twins], axis=0) if twins else np.zeros_like(base)
        return (spread == 0) | (spread < UNDETERMINED * np.maximum(np.abs(base), np.abs(exact)))


def relative_error(want: np.ndarray, got: np.ndarray) -> float:
    return output_error("", want, got, 0.0).max_rel


# ----- errors -----------------------------------------------------------------------------------------


def output_error(name: str, want: np.ndarray, got: np.ndarray, tolerance: float) -> OutputError:
    if want.shape != got.shape:
        return OutputError(name, float("inf"), float("inf"), tolerance)
    if not is_float(want):
        diff = float(np.max(np.abs(want.astype(np.float64) - got.astype(np.float64)), initial=0.0))
        return OutputError(name, diff, diff, tolerance)
    want64, got64 = want.astype(np.float64), got.astype(np.float64)
    if not np.array_equal(np.isnan(want64), np.isnan(got64)):
        return OutputError(name, float("inf"), float("inf"), tolerance)
    # An inf must be an inf, of either sign: a division by an exact zero, whose sign a fold need not keep
    # (0 / -c gives -0 where the Conv that absorbed the Div gives +0).
    if not np.array_equal(np.isinf(want64), np.isinf(got64)):
        return OutputError(name, float("inf"), float("inf"), tolerance)
    finite = np.isfinite(want64) & np.isfinite(got64)
    diff = float(np.max(np.abs(want64[finite] - got64[finite]), initial=0.0))
    scale = float(np.max(np.abs(want64[finite]), initial=0.0))
    return OutputError(name, diff, diff / scale if scale > 0 else diff, tolerance)
