"""Running models for the check: onnxruntime (CPU), else onnx's reference evaluator, one session at a time.

Engine: onnxruntime (CPU), every graph optimization disabled so the original graph is computed as written
(no BatchNormalization fusion of its own), one session at a time so that at most one model's weights are
held by an engine. Where onnxruntime cannot run both models (its CPU build has no float64 or bfloat16
Conv, for one), both run in onnx's reference evaluator instead; the result names the engine. Errors are
reported per tensor as max absolute difference and max relative difference (normalized by the largest
reference magnitude of that tensor).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import onnx

from bnfuse.attributes import onnx_float
from bnfuse.errors import BnfuseError
from bnfuse.io import MAX_IR_VERSION, exceeds_protobuf_limit, load_model, read_mapped

ENGINES = ("onnxruntime", "onnx reference evaluator")

Runner = Callable[[dict[str, np.ndarray]], list[np.ndarray]]
Feeds = dict[str, np.ndarray]


ModelSource = onnx.ModelProto | str | os.PathLike[str]


@dataclass
class Model:
    """A model to run: a ModelProto, or a file whose weights stay on disk (``proto`` is then its skeleton)."""

    proto: onnx.ModelProto
    path: Path | None = None

    def full(self) -> onnx.ModelProto:
        """The whole model in memory: only the reference evaluator and the float16 twins need it."""
        return self.proto if self.path is None else load_model(self.path, check=False)


def open_model(source: ModelSource) -> Model:
    """A ModelProto as is; a one-file model as its path and mapped skeleton (weights never read here); any
    other file (external data, which onnxruntime only reads beside the model, or over 2 GiB) loaded whole."""
    if isinstance(source, onnx.ModelProto):
        return Model(source)
    mapped = read_mapped(source)
    if mapped is None:
        return Model(load_model(source, check=False))
    return Model(mapped[0], Path(source))


Job = tuple["Model", str, "onnx.GraphProto | None", Sequence[tuple[Feeds, "Callable | None"]]]


def run_models(
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
            except EngineError as exc:
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


class EngineError(Exception):
    def __init__(self, what: str, reason: str) -> None:
        super().__init__(f"{what}: {reason}")
        self.what, self.reason = what, reason


def _guarded_runner(engine: Any, what: str, names: Sequence[str]) -> Runner:
    """``engine.run(names, feeds)`` (onnxruntime and the reference evaluator share it) as a Runner whose
    failures are EngineErrors."""
    wanted = list(names) or None

    def run(feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
        try:
            return [np.asarray(o) for o in engine.run(wanted, feeds)]
        except Exception as exc:
            raise EngineError(what, first_line(exc)) from exc

    return run


def _ort_runner(
    model: Model,
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
        source = ort_source(model, what, scratch, extra)
        session = ort.InferenceSession(source, options, providers=["CPUExecutionProvider"])
        del source  # onnxruntime holds its own copy now
    except Exception as exc:  # onnxruntime raises its own Fail / NotImplemented / InvalidGraph types
        raise EngineError(what, first_line(exc)) from exc
    return _guarded_runner(session, what, names)


def ort_source(model: Model, what: str, scratch: Path, extra: onnx.GraphProto | None = None) -> bytes | str:
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
    model: Model, what: str, extra: onnx.GraphProto | None = None, names: Sequence[str] = ()
) -> Runner:
    from onnx.reference import ReferenceEvaluator

    try:
        exposed = model.full()
        if extra is not None and extra.ByteSize():
            exposed = onnx.ModelProto()
            exposed.CopyFrom(model.full())  # the reference evaluator is for small models onnxruntime cannot run
            exposed.graph.MergeFrom(extra)
        evaluator = ReferenceEvaluator(exposed, new_ops=reference_overrides(exposed))
    except Exception as exc:  # unknown ops / domains: NotImplementedError, ValueError, ...
        raise EngineError(what, first_line(exc)) from exc
    return _guarded_runner(evaluator, what, names)


def reference_overrides(model: onnx.ModelProto) -> list[type]:
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


def first_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split()) or type(exc).__name__
    return text[:300]
