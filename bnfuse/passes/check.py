"""Numerical proof of a rewrite: run original and optimized models on the same seeded random inputs.

What is compared, per rewritten BatchNormalization (bnfuse.passes.fold_probes names the tensors):
- in context: the tensor that carries the BN's output in both models (the BN's own output, whose name the
  producer takes over, or the output of the per-channel op folded after it), exposed as an extra graph
  output of the serialized models without copying any weight;
- alone: the chain from the producer's data input to that tensor (Conv -> BN -> trailing ops; the folded
  Conv), copied in both models under fresh names to read seeded random data (weights shared by name).
And every graph output, end to end. A final output alone can prove nothing: onnx's light_resnet50 builds
every weight with ConstantOfShape, so its softmax is exactly uniform on any input. The original therefore
first runs on a second random draw, and a compared tensor whose values are bit-identical on both draws is
flagged ``constant`` (it passes, with a warning: it cannot show a wrong weight); the isolated chain, fed
random data, is flagged only when all its elements are equal.

Engine: onnxruntime (CPU), every graph optimization disabled so the original graph is computed as written
(no BatchNormalization fusion of its own), one session at a time so that at most one model's weights are
held by an engine. Where onnxruntime cannot run both models (its CPU build has no float64 or bfloat16
Conv, for one), both run in onnx's reference evaluator instead; the result names the engine. Errors are
reported per tensor as max absolute difference and max relative difference (normalized by the largest
reference magnitude of that tensor).

Tolerances follow each compared tensor's element type. float32 / float64 tensors are compared with the
original directly: outputs and isolated chains at 1e-4 / 1e-9 relative, tensors in context at
``IN_CONTEXT_FACTOR`` times that, because a tensor inside the network carries the rounding of every fold
upstream, not yet averaged down by the final layers (measured: up to 1.2e-4 at ResNet-50's last BN, whose
output is 1.5e-5 off; every isolated chain of the registry's networks and onnx's light models is within
8e-7). A channel one percent off lands at ~1e-2 in context and alone. A float32 / float64 tensor past its tolerance
still passes within ``CONDITIONING_FACTOR`` times what one rounding of the folded values moves the optimized
model by (``_allow_conditioning``: a Div by values near zero after the BN amplifies 1e-7 into 1e-4).

float16 / bfloat16 outputs and tensors in context are not compared directly: a fold rounds the new weights to
the model's precision once, and a deep float16 network amplifies that rounding by itself (a float16 ResNet-50
moves by ~4e-2 when its weights are merely re-rounded), while onnxruntime computes float16 Conv / BN with
float32 accumulation (the unfolded model is ~3e-4 from its exact float32 twin). So both models are measured
against the original widened to float32, and the optimized model passes when its error stays within
``LOW_PRECISION_FACTOR`` times the error that precision alone explains: the original's own error plus that of
a twin whose rewritten weights (those the folds round again: ``Report.rewritten_weights``) were moved by
random half-ulp amounts (what that re-rounding does; the largest of three such twins), plus a floor of a few
ulps. Only those weights move: a twin moving a BN's mean as well measured a sensitivity no fold has (a mean of
169 moved by half an ulp, times a factor of 467, allowed a tolerance of 0.16), and let a fold that lost the
original's precision pass. On the project's float16 networks the fold's error was 0.3-1.2x that estimate
(measured when one twin moved every constant; the folds rewrite nearly every weight there); a wrong fold (a
channel scaled by a few percent, a missing epsilon) lands far above it. An isolated low-precision chain is one
layer deep, with nothing to amplify: it is held to 8 ulps of its type (``ISOLATED_LOW_PRECISION``).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from bnfuse.attributes import onnx_float
from bnfuse.errors import BnfuseError
from bnfuse.io import MAX_IR_VERSION, exceeds_protobuf_limit, load_model, read_mapped
from bnfuse.passes import fold_probes
from bnfuse.passes.report import BatchNormRecord, CheckResult, OutputError

# Direct relative tolerance by element type. The float16 / bfloat16 entries apply only when the
# float32 reference cannot be built or run (or a tolerance is forced): see the module docstring.
TOLERANCES = {
    TensorProto.FLOAT: 1e-4,
    TensorProto.DOUBLE: 1e-9,
    TensorProto.FLOAT16: 3e-2,
    TensorProto.BFLOAT16: 5e-2,
}
LOW_PRECISION = {TensorProto.FLOAT16: 10, TensorProto.BFLOAT16: 7}  # element type -> stored mantissa bits
# Margin over the precision-explained error (the largest of CONDITIONING_TWINS re-rounded twins; one twin can
# land below the fold's own rounding: a fuzzed float16 Conv -> Mul -> Add gave 2.7e-2 against 1.9e-2). A
# bfloat16 channel 10% off must still fail: bfloat16's own noise is ~1e-2 on a small Conv -> BN.
LOW_PRECISION_FACTOR = 2.0
# Output rounding alone: 2 ulps at the largest magnitude (2^-10 float16, 2^-7 bfloat16).
LOW_PRECISION_FLOOR = {TensorProto.FLOAT16: 2.0**-9, TensorProto.BFLOAT16: 2.0**-6}
# An isolated chain (one fold, one layer) in float16 / bfloat16: 8 ulps at the largest magnitude. Measured
# <= 9.3e-4 on the registry's float16 networks; a channel 3% off lands at ~3e-2.
ISOLATED_LOW_PRECISION = {TensorProto.FLOAT16: 2.0**-7, TensorProto.BFLOAT16: 2.0**-4}
_MIN_EXPONENT = {TensorProto.FLOAT16: -24, TensorProto.BFLOAT16: -133}  # smallest subnormal: 2^this
BATCH_DIM = 1
SPATIAL_DIM = 32
OTHER_DIM = 8
ENGINES = ("onnxruntime", "onnx reference evaluator")
_SECOND_DRAW = 1  # the second random draw is seeded with (seed, _SECOND_DRAW)
_ISOLATED_DRAW = 2  # data fed to isolated fold chains: (seed, _ISOLATED_DRAW)
# float32 / float64 tensors in context carry the rounding of every fold upstream (module docstring).
IN_CONTEXT_FACTOR = 10.0
# A float32 / float64 tensor beyond tolerance may still be within what one rounding of the folded values moves
# the optimized model by (see _allow_conditioning): that many twins, and the margin over the largest of their errors.
CONDITIONING_TWINS = 3
CONDITIONING_FACTOR = 4.0
_TWIN_DRAW = 3


@dataclass(frozen=True)
class InputSpec:
    """A graph input the check feeds: name, ONNX element type, declared dims (int, symbolic name or None)."""

    name: str
    elem_type: int
    dims: list[int | str | None]


Runner = Callable[[dict[str, np.ndarray]], list[np.ndarray]]
Feeds = dict[str, np.ndarray]


ModelSource = onnx.ModelProto | str | os.PathLike[str]


@dataclass
class _Model:
    """A model to run: a ModelProto, or a file whose weights stay on disk (``proto`` is then its skeleton)."""

    proto: onnx.ModelProto
    path: Path | None = None

    def full(self) -> onnx.ModelProto:
        """The whole model in memory: only the reference evaluator and the float16 twins need it."""
        return self.proto if self.path is None else load_model(self.path, check=False)


def _open(source: ModelSource) -> _Model:
    """A ModelProto as is; a one-file model as its path and mapped skeleton (weights never read here); any
    other file (external data, which onnxruntime only reads beside the model, or over 2 GiB) loaded whole."""
    if isinstance(source, onnx.ModelProto):
        return _Model(source)
    mapped = read_mapped(source)
    if mapped is None:
        return _Model(load_model(source, check=False))
    return _Model(mapped[0], Path(source))


def compare_models(
    original: ModelSource,
    optimized: ModelSource,
    *,
    input_shapes: Mapping[str, Sequence[int]] | None = None,
    seed: int = 0,
    tolerance: float | None = None,
    folds: Sequence[BatchNormRecord] = (),
    rewritten: Collection[str] | None = None,
    written: Collection[str] | None = None,
) -> CheckResult:
    """Max abs / rel error of ``optimized`` against ``original`` per output and per rewritten BN in ``folds``.

    ``tolerance`` forces a direct comparison of every tensor against the original with that limit. A model
    given as a path is run from its file (onnxruntime reads it; Python never holds its weights).
    ``rewritten``: the original's tensors the folds gave new values (float16 / bfloat16: the re-rounded twin
    perturbs only these; None: every low-precision constant). ``written``: the optimized model's constants
    holding the values the folds computed (float32 / float64: see _allow_conditioning).
    """
    start = time.perf_counter()
    original_model, optimized_model = _open(original), _open(optimized)
    original, optimized = original_model.proto, optimized_model.proto
    feeds = random_inputs(original, input_shapes or {}, seed)
    shapes = {name: list(value.shape) for name, value in feeds.items()}
    second = random_inputs(original, shapes, (seed, _SECOND_DRAW))
    outputs = [o.name for o in original.graph.output]
    probes = fold_probes.plan(original, optimized, folds)
    compared = list(dict.fromkeys([*outputs, *(p.check.tensor for p in probes if p.check.tensor)]))
    entries = [e for e in dict.fromkeys(p.entry for p in probes if p.entry) if e not in compared]
    count = len(compared)

    def digest_and_type(values: list[np.ndarray]) -> tuple[list[bytes], list]:
        return _fingerprints(values[:count]), [(v.shape, v.dtype) for v in values]

    # Draw B, original only, reduced at once to a digest per compared tensor (constant detection) and the
    # shape / dtype of every producer's data input (what the isolated chains are fed).
    first_engine, (((second_digests, types),),) = _run_models(
        [(original_model, "original", None, [(second, digest_and_type)])], compared + entries
    )
    entry_types = dict(zip(compared + entries, types, strict=True))
    isolation = fold_probes.isolate(original, optimized, probes, entry_types)
    rng = np.random.default_rng((seed, _ISOLATED_DRAW))
    fed = dict(feeds)
    for name, (shape, dtype) in isolation.inputs.items():
        fed[name] = rng.standard_normal(shape).astype(dtype)
    # Draw A, both models, with the isolated chains: one session at a time. Copies the engine of draw B
    # cannot run are dropped rather than sending the whole model to a slower engine.
    first = ENGINES.index(first_engine)
    try:
        engine, ((expected,), (actual,)) = _run_models(
            [
                (original_model, "original", isolation.original, [(fed, None)]),
                (optimized_model, "optimized", isolation.optimized, [(fed, None)]),
            ],
            compared + isolation.outputs,
            first=first,
            single=bool(isolation.outputs),
        )
    except BnfuseError:
        if not isolation.outputs:
            raise
        isolation = fold_probes.Isolation(onnx.GraphProto(), onnx.GraphProto(), {}, [], [])
        engine, ((expected,), (actual,)) = _run_models(
            [
                (original_model, "original", None, [(feeds, None)]),
                (optimized_model, "optimized", None, [(feeds, None)]),
            ],
            compared,
            first=first,
        )
    del fed
    constant = [a == b for a, b in zip(_fingerprints(expected[:count]), second_digests, strict=True)]
    low = any(_elem_type_of(np.asarray(v)) in LOW_PRECISION for v in expected[:count])
    references = (
        _precision_references(original_model, feeds, seed, compared, rewritten) if low and tolerance is None else None
    )
    in_context = set(compared) - set(outputs)
    errors = {}
    for index, name in enumerate(compared):
        want, got = np.asarray(expected[index]), np.asarray(actual[index])
        factor = IN_CONTEXT_FACTOR if name in in_context else 1.0
        error = _tensor_error(name, want, got, references, index, tolerance, factor)
        error.constant = constant[index]
        errors[name] = error
    failing = [
        n for n in compared if not errors[n].passed and errors[n].noise is None and np.isfinite(errors[n].max_rel)
    ]
    if failing and tolerance is None and written:
        _allow_conditioning(errors, failing, optimized_model, feeds, actual[:count], compared, written, seed)
    for probe in probes:
        if probe.check.tensor is not None:
            probe.check.error = errors[probe.check.tensor]
    for offset, (probe, name) in enumerate(zip(isolation.isolated, isolation.outputs, strict=True)):
        want, got = np.asarray(expected[count + offset]), np.asarray(actual[count + offset])
        elem_type = _elem_type_of(want)
        limit = ISOLATED_LOW_PRECISION.get(elem_type) or TOLERANCES.get(elem_type, 1e-4)
        error = _error(name, want, got, tolerance if tolerance is not None else limit)
        error.constant = bool(want.size) and bool(np.all(want == want.reshape(-1)[0]))
        probe.check.entry, probe.check.isolated = probe.entry, error
    del expected, actual
    return CheckResult(
        seed=seed,
        input_shapes=shapes,
        outputs=[errors[name] for name in outputs],
        engine=engine,
        folds=[p.check for p in probes],
        elapsed_s=time.perf_counter() - start,
    )


def _fingerprints(values: Sequence[np.ndarray]) -> list[bytes]:
    """A digest per tensor (shape and bytes): enough to tell whether two draws gave identical values."""
    digests = []
    for value in values:
        array = np.ascontiguousarray(value)
        digest = hashlib.blake2b(repr((array.dtype.str, array.shape)).encode(), digest_size=16)
        digest.update(array.reshape(-1).view(np.uint8))
        digests.append(digest.digest())
    return digests


def _tensor_error(
    name: str,
    want: np.ndarray,
    got: np.ndarray,
    references: _References | None,
    index: int,
    tolerance: float | None,
    factor: float = 1.0,
) -> OutputError:
    elem_type = _elem_type_of(want)
    if references is not None and elem_type in LOW_PRECISION:
        result = _low_precision_error(name, elem_type, want, got, references, index)
        if result is not None:
            return result
    limit = tolerance if tolerance is not None else factor * TOLERANCES.get(elem_type, 1e-4)
    return _error(name, want, got, limit)


def _elem_type_of(value: np.ndarray) -> int:
    try:
        return helper.np_dtype_to_tensor_dtype(value.dtype)
    except (KeyError, ValueError, TypeError):
        return 0


# ----- inputs -----------------------------------------------------------------------------------------


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


# ----- engines ----------------------------------------------------------------------------------------


Job = tuple["_Model", str, "onnx.GraphProto | None", Sequence[tuple[Feeds, "Callable | None"]]]


def _run_models(
    jobs: Sequence[Job], names: list[str], *, first: int = 0, single: bool = False
) -> tuple[str, list[list]]:
    """Tensors ``names`` of every model on each of its feeds, from one engine: onnxruntime if it runs them
    all, else the reference evaluator (``first``: the index of the engine to try first; ``single``: that one
    only).

    A job is (model, what, addition, runs): ``addition`` is merged into the model's graph first (extra
    inputs, nodes, outputs), and ``names`` not yet outputs become outputs. Models run one after another (a
    session is released before the next is built); each result goes through its reducer, if any, before
    the next run.
    """
    with tempfile.TemporaryDirectory(prefix="bnfuse-check-") as scratch:
        makers: list[tuple[str, str, Callable[..., Runner]]] = [
            (ENGINES[0], "onnxruntime", lambda *job: _ort_runner(*job, scratch=Path(scratch))),
            (ENGINES[1], "reference evaluator", _reference_runner),
        ]
        failures: dict[str, list[str]] = {}
        for engine, label, make in makers[first : first + 1] if single else makers[first:]:
            try:
                results = []
                for model, what, addition, runs in jobs:
                    runner = make(model, what, exposure(model.proto, names, addition), names)
                    results.append([reduce(runner(feeds)) if reduce else runner(feeds) for feeds, reduce in runs])
                    del runner  # the session and its copy of the weights go before the next model's
                return engine, results
            except _EngineError as exc:
                failures.setdefault(exc.what, []).append(f"{label}: {exc.reason}")
                failed = exc
        raise BnfuseError(f"check: cannot run the {failed.what} model ({'; '.join(failures[failed.what])})") from failed


def exposure(model: onnx.ModelProto, names: Sequence[str], addition: onnx.GraphProto | None = None) -> onnx.GraphProto:
    """What to merge into ``model``'s graph so that it computes ``addition`` and has ``names`` as outputs.

    The new outputs carry no type: both engines infer it.
    """
    extra = onnx.GraphProto()
    if addition is not None:
        extra.CopyFrom(addition)
    present = {o.name for o in model.graph.output} | {o.name for o in extra.output}
    for name in names:
        if name not in present:
            extra.output.add().name = name
            present.add(name)
    return extra


class _EngineError(Exception):
    def __init__(self, what: str, reason: str) -> None:
        super().__init__(f"{what}: {reason}")
        self.what, self.reason = what, reason


def _ort_runner(
    model: _Model,
    what: str,
    extra: onnx.GraphProto | None = None,
    names: Sequence[str] = (),
    *,
    scratch: Path,
) -> Runner:
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    options.log_severity_level = 4  # errors reach the user as one line, not as onnxruntime's log
    options.enable_cpu_mem_arena = False  # one or two runs per session: an arena would only hold memory longer
    try:
        source = _ort_source(model, what, scratch, extra)
        session = ort.InferenceSession(source, options, providers=["CPUExecutionProvider"])
        del source  # onnxruntime holds its own copy now
    except Exception as exc:  # onnxruntime raises its own Fail / NotImplemented / InvalidGraph types
        raise _EngineError(what, _first_line(exc)) from exc
    wanted = list(names) or None

    def run(feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
        try:
            return [np.asarray(o) for o in session.run(wanted, feeds)]
        except Exception as exc:
            raise _EngineError(what, _first_line(exc)) from exc

    return run


def _ort_source(model: _Model, what: str, scratch: Path, extra: onnx.GraphProto | None = None) -> bytes | str:
    """What onnxruntime loads: ``model`` with ``extra`` merged into its graph, without a copy of its weights
    in Python: a one-file model is copied on disk with the extra fields appended, a ModelProto is serialized
    once.

    Protobuf merges a repeated embedded message field (graph) and appends repeated fields (its inputs,
    nodes, outputs), so serialized ``extra`` fields appended to a model file add to its graph.
    """
    proto = model.proto
    fix_ir = proto.ir_version > MAX_IR_VERSION or proto.ir_version == 0
    # Protobuf keeps the last value of a scalar field: ir_version (field 1, varint) appended lowers it.
    tail = _graph_fields(extra) + (bytes([0x08, MAX_IR_VERSION]) if fix_ir else b"")
    if model.path is not None:
        if not tail:
            return str(model.path)
        path = scratch / f"{what}.onnx"
        shutil.copyfile(model.path, path)
        with path.open("ab") as file:
            file.write(tail)
        return str(path)
    if exceeds_protobuf_limit(proto):
        copy = onnx.ModelProto()
        copy.CopyFrom(proto)
        copy.ir_version = min(copy.ir_version or MAX_IR_VERSION, MAX_IR_VERSION)
        if extra is not None:
            copy.graph.MergeFrom(extra)
        path = scratch / f"{what}.onnx"
        onnx.save_model(copy, str(path), save_as_external_data=True, location=f"{what}.onnx.data")
        return str(path)
    return _serialized_with(proto, extra, fix_ir)


def _graph_fields(extra: onnx.GraphProto | None) -> bytes:
    if extra is None or not extra.ByteSize():
        return b""
    shell = onnx.ModelProto()
    shell.graph.CopyFrom(extra)
    return shell.SerializeToString()


def _serialized_with(proto: onnx.ModelProto, extra: onnx.GraphProto | None, fix_ir: bool) -> bytes:
    """``proto`` serialized with ``extra``'s inputs, nodes and outputs: added in place for the one
    serialization and removed again (appending bytes to the serialized model would copy its weights)."""
    graph = proto.graph
    sizes = len(graph.input), len(graph.node), len(graph.output)
    had_ir, ir_version = proto.HasField("ir_version"), proto.ir_version
    try:
        if extra is not None:
            graph.input.extend(extra.input)
            graph.node.extend(extra.node)
            graph.output.extend(extra.output)
        if fix_ir:
            proto.ir_version = MAX_IR_VERSION
        return proto.SerializeToString()
    finally:
        del graph.input[sizes[0] :], graph.node[sizes[1] :], graph.output[sizes[2] :]
        if had_ir:
            proto.ir_version = ir_version
        else:
            proto.ClearField("ir_version")


def _reference_runner(
    model: _Model, what: str, extra: onnx.GraphProto | None = None, names: Sequence[str] = ()
) -> Runner:
    from onnx.reference import ReferenceEvaluator

    try:
        exposed = model.full()
        if extra is not None and extra.ByteSize():
            exposed = onnx.ModelProto()
            exposed.CopyFrom(model.full())  # the reference evaluator is for small models onnxruntime cannot run
            exposed.graph.MergeFrom(extra)
        evaluator = ReferenceEvaluator(exposed, new_ops=_reference_overrides(exposed))
    except Exception as exc:  # unknown ops / domains: NotImplementedError, ValueError, ...
        raise _EngineError(what, _first_line(exc)) from exc
    wanted = list(names) or None

    def run(feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
        try:
            return [np.asarray(o) for o in evaluator.run(wanted, feeds)]
        except Exception as exc:
            raise _EngineError(what, _first_line(exc)) from exc

    return run


def _reference_overrides(model: onnx.ModelProto) -> list[type]:
    """Ops of onnx's reference evaluator replaced by ONNX's inference semantics, for ``model``'s opset.

    Its BatchNormalization for opsets 9 to 13 mixes the batch's own statistics into the running ones whenever
    ``momentum`` has a value, and the default 0.9 always gives it one: a float64 Conv -> BN at opset 13 (which
    onnxruntime's CPU cannot run, so it goes to the reference evaluator) came out 46% off, and every correct
    fold of it failed the check. onnxruntime, like the ONNX specification, normalizes with the running
    statistics there; epsilon's default is float32(1e-5).
    """
    version = max((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), default=0)
    if not 9 <= version <= 13:
        return []
    from onnx.reference.op_run import OpRun
    from onnx.reference.ops.op_batch_normalization import _batchnorm_test_mode

    class BatchNormalization(OpRun):
        def _run(self, x, scale, bias, mean, var, epsilon=None, momentum=None, training_mode=None):  # noqa: ANN001, ANN202, ARG002
            eps = onnx_float(1e-5 if epsilon is None else epsilon)
            return (_batchnorm_test_mode(x, scale, bias, mean, var, epsilon=eps).astype(x.dtype),)

    return [BatchNormalization]


# ----- float32 / float64: what one re-rounding of the rewritten weights moves -----------------------------


def _allow_conditioning(
    errors: dict[str, OutputError],
    failing: list[str],
    optimized: _Model,
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
        twin = _rerounded(full, written, np.random.default_rng((seed, _TWIN_DRAW, draw)))
        if twin is None:
            return
        try:
            _, ((values,),) = _run_models([(_Model(twin), "re-rounded optimized", None, [(feeds, None)])], failing)
        except BnfuseError:
            return
        moved = [
            max(m, _relative(np.asarray(actual[i]), np.asarray(v)))
            for m, i, v in zip(moved, indices, values, strict=True)
        ]
    for name, noise in zip(failing, moved, strict=True):
        error = errors[name]
        limit = max(error.tolerance, CONDITIONING_FACTOR * noise)
        errors[name] = OutputError(name, error.max_abs, error.max_rel, limit, error.reference, noise, error.constant)


def _rerounded(model: onnx.ModelProto, names: Collection[str], rng: np.random.Generator) -> onnx.ModelProto | None:
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


@dataclass(frozen=True)
class _References:
    exact: list[np.ndarray]  # the original widened to float32
    rounded: list[list[np.ndarray]]  # per twin: the same with its rewritten weights moved by random half-ulp amounts
    engine: str


def _precision_references(
    original: _Model, feeds: dict[str, np.ndarray], seed: int, names: list[str], rewritten: Collection[str] | None
) -> _References | None:
    """Tensors ``names`` of the original's float32 twin and of a twin whose ``rewritten`` tensors (the weights
    the folds round again; None: every low-precision constant) moved by half-ulp amounts; None when not
    computable."""
    wide_feeds = {name: value.astype(np.float32) if _is_float(value) else value for name, value in feeds.items()}
    try:
        exact = widened(original.full())
    except Exception:  # a tensor numpy cannot convert: fall back to the direct comparison
        return None
    try:
        engine, ((want,),) = _run_models([(_Model(exact), "float32 reference", None, [(wide_feeds, None)])], names)
        del exact
        twins = []
        for draw in range(CONDITIONING_TWINS):
            rounded = widened(original.full(), rng=np.random.default_rng((seed, draw)), only=rewritten)
            _, ((moved,),) = _run_models([(_Model(rounded), "float32 reference", None, [(wide_feeds, None)])], names)
            twins.append(moved)
    except BnfuseError:
        return None
    return _References(want, twins, engine)


def _is_float(value: np.ndarray) -> bool:
    # ml_dtypes' bfloat16 has numpy kind "V", not "f".
    return value.dtype.kind in "fc" or value.dtype == np.dtype(helper.tensor_dtype_to_np_dtype(TensorProto.BFLOAT16))


def widened(
    model: onnx.ModelProto, *, rng: np.random.Generator | None = None, only: Collection[str] | None = None
) -> onnx.ModelProto:
    """A copy with every float16 / bfloat16 tensor, type and cast target turned into float32.

    With ``rng``, each low-precision constant value (of those named in ``only``, when given: an initializer's
    name or a Constant node's output) also moves by a uniform random fraction in [-0.5, 0.5] of its own ulp:
    the perturbation a fresh rounding to that precision makes.
    """
    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    moved = None if only is None else set(only)

    def tensor(t: onnx.TensorProto, name: str | None = None) -> None:
        if t.data_type not in LOW_PRECISION:
            return
        values = numpy_helper.to_array(t).astype(np.float64)
        if rng is not None and (moved is None or (name or t.name) in moved):
            values = values + rng.uniform(-0.5, 0.5, values.shape) * _ulp(values, t.data_type)
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
    name: str, elem_type: int, want: np.ndarray, got: np.ndarray, references: _References, index: int
) -> OutputError | None:
    exact = np.asarray(references.exact[index], dtype=np.float64)
    if not np.isfinite(exact).all() or want.shape != exact.shape:
        return None  # the float32 twin says nothing useful here: compare directly
    own = _relative(exact, want)
    moved = max(_relative(exact, np.asarray(twin[index], dtype=np.float64)) for twin in references.rounded)
    if not (np.isfinite(own) and np.isfinite(moved)):
        return None  # the original overflows in its own precision: only a direct comparison is meaningful
    noise = own + moved
    limit = LOW_PRECISION_FACTOR * noise + LOW_PRECISION_FLOOR[elem_type]
    result = _error(name, exact, got, limit)
    return OutputError(result.name, result.max_abs, result.max_rel, limit, reference="float32 original", noise=noise)


def _relative(want: np.ndarray, got: np.ndarray) -> float:
    return _error("", want, got, 0.0).max_rel


# ----- errors -----------------------------------------------------------------------------------------


def _error(name: str, want: np.ndarray, got: np.ndarray, tolerance: float) -> OutputError:
    if want.shape != got.shape:
        return OutputError(name, float("inf"), float("inf"), tolerance)
    if not _is_float(want):
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


def _elem_type(info: onnx.ValueInfoProto) -> int:
    return info.type.tensor_type.elem_type if info.type.HasField("tensor_type") else 0


def _first_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split()) or type(exc).__name__
    return text[:300]
