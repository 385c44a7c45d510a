"""The inference pass: `optimize(model) -> (model, report)` (exported as ``bnfuse.optimize``).

Loads and validates the model, folds BatchNormalization (and trailing per-channel ops) into producers in
every graph and If / Loop / Scan body, optionally turns the rest into Mul + Add, removes what became
unused, and optionally proves the result numerically (bnfuse.passes.check.compare). The input is never modified.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import overload

import numpy as np
import onnx
import onnx_graphsurgeon as gs
from onnx import helper, numpy_helper

from bnfuse.errors import BnfuseError, CheckFailedError, ModelError
from bnfuse.io import check_model, ort_compatible, read_model
from bnfuse.passes.constants import ConstantResolver, attach_payloads, overridable_initializers
from bnfuse.passes.fold.context import FoldContext, describe
from bnfuse.passes.fold.graph import fold_graph
from bnfuse.passes.fold.reparam import merge_branches
from bnfuse.passes.graphsurgeon_io import (
    InferredTensorTypes,
    copy_fields,
    export_model,
    names_in,
    quiet_graphsurgeon,
    without_functions,
)
from bnfuse.passes.report import BatchNormRecord, MergeRecord, Report
from bnfuse.protowire import PayloadStore
from bnfuse.tensorcheck import check_strings, check_tensors

MIN_OPSET = 7
# Initializers above this size are checked by type and shape only (see validate); small ones, which
# shape inference may need the values of (Reshape shapes, axes), stay.
_SMALL_TENSOR_BYTES = 4096
STANDALONE_CHOICES = ("keep", "scale-shift")
ProgressCallback = Callable[[int, int], None]


@overload
def optimize(
    model_or_path: gs.Graph,
    *,
    standalone: str = ...,
    activation_moves: bool = ...,
    check: bool = ...,
    input_shapes: Mapping[str, Sequence[int]] | None = ...,
    seed: int = ...,
    tolerance: float | None = ...,
    full_check: bool = ...,
    progress: ProgressCallback | None = ...,
) -> tuple[gs.Graph, Report]: ...


@overload
def optimize(
    model_or_path: onnx.ModelProto | str | os.PathLike[str],
    *,
    standalone: str = ...,
    activation_moves: bool = ...,
    check: bool = ...,
    input_shapes: Mapping[str, Sequence[int]] | None = ...,
    seed: int = ...,
    tolerance: float | None = ...,
    full_check: bool = ...,
    progress: ProgressCallback | None = ...,
) -> tuple[onnx.ModelProto, Report]: ...


def optimize(
    model_or_path: onnx.ModelProto | gs.Graph | str | os.PathLike[str],
    *,
    standalone: str = "keep",
    activation_moves: bool = True,
    check: bool = False,
    input_shapes: Mapping[str, Sequence[int]] | None = None,
    seed: int = 0,
    tolerance: float | None = None,
    full_check: bool = False,
    progress: ProgressCallback | None = None,
) -> tuple[onnx.ModelProto | gs.Graph, Report]:
    """Fold inference BatchNormalization into its producers.

    model_or_path: an onnx.ModelProto, a path, or an onnx_graphsurgeon Graph (the result is then a new
        gs.Graph too; the given graph is exported, not modified).
    standalone: "keep" leaves BatchNormalization that cannot fold; "scale-shift" rewrites it to Mul + Add.
    activation_moves: move a pre-activation BN's positive scale through Relu-like activations into the layers after
        them (exact; fewer BN, but at onnxruntime's default level the Add it leaves can be slower than the BN +
        Relu it fuses: docs/exporting.md); False keeps those BN.
    check: run original and optimized on seeded random inputs (onnxruntime, else onnx's reference
        evaluator); raises CheckFailedError (with the report as ``.report``) when an output differs
        beyond tolerance.
    input_shapes: sizes of dynamic input dimensions for the check, by input name.
    tolerance: force a direct comparison with this relative tolerance for every output.
    full_check: run onnx.checker with full shape inference on the result (ModelError on failure).
    progress: called as progress(done, total) per BatchNormalization visited.
    """
    options = {
        "standalone": standalone,
        "activation_moves": activation_moves,
        "check": check,
        "input_shapes": input_shapes,
        "seed": seed,
        "tolerance": tolerance,
        "full_check": full_check,
        "progress": progress,
    }
    if isinstance(model_or_path, gs.Graph):
        label = model_or_path.name or "<graph>"
        try:
            with quiet_graphsurgeon():
                exported = gs.export_onnx(model_or_path, do_type_check=False)
        except Exception as exc:  # gs raises plain exceptions for graphs it cannot export
            raise ModelError(f"{label}: cannot export the onnx-graphsurgeon graph ({_one_line(exc)})") from exc
        optimized, report = optimize_model(ort_compatible(exported), label, False, **options)
        with quiet_graphsurgeon():
            return gs.import_onnx(optimized), report
    if isinstance(model_or_path, onnx.ModelProto):
        check_strings(model_or_path, what=model_or_path.graph.name or "<model>")
        check_tensors(model_or_path, what=model_or_path.graph.name or "<model>")
        return optimize_model(model_or_path, model_or_path.graph.name or "<model>", False, **options)
    if isinstance(model_or_path, (str, os.PathLike)):
        original, external = read_model(model_or_path, check=False)
        return optimize_model(original, str(model_or_path), external, **options)
    raise BnfuseError(
        f"optimize() takes an onnx.ModelProto, an onnx_graphsurgeon Graph or a path, not {type(model_or_path).__name__}"
    )


def optimize_model(
    original: onnx.ModelProto,
    label: str,
    external_data: bool,
    *,
    standalone: str,
    check: bool,
    activation_moves: bool = True,
    input_shapes: Mapping[str, Sequence[int]] | None,
    seed: int,
    tolerance: float | None,
    full_check: bool,
    progress: ProgressCallback | None,
    payloads: PayloadStore | None = None,
) -> tuple[onnx.ModelProto, Report]:
    """The pass on a model already read: what ``optimize`` and ``optimize_file`` share (``optimize``'s options).

    label: the model's name in the report and in errors. external_data: whether the input kept its weights in
    external files (reported). payloads: the memory-mapped weights of a model read by ``optimize_file`` (their
    TensorProtos hold no data; the folds read them from here).
    """
    if standalone not in STANDALONE_CHOICES:
        raise BnfuseError(f"standalone must be one of {', '.join(STANDALONE_CHOICES)}, got {standalone!r}")
    start = time.perf_counter()
    opset = supported_opset(original, label)
    # Full check (shape inference) on the input first, so a type / shape error is blamed on the input,
    # not on the optimized model where it would otherwise surface.
    validate(original, what=label, full=True)
    _validate_function_batchnorms(original, label, payloads)

    original, reset = reset_training_batchnorms(original)
    report = Report(model=label, standalone=standalone, external_data=external_data)
    report.external_data_reason = "input" if external_data else ""
    report.nodes_before = count_nodes(original.graph)
    report.batchnorms_before = count_nodes(original.graph, "BatchNormalization") + _function_batchnorms(original)

    optimized = _fold_model(original, opset, standalone, report, progress, payloads, reset, activation_moves)

    report.nodes_after = count_nodes(optimized.graph)
    report.batchnorms_after = count_nodes(optimized.graph, "BatchNormalization") + _function_batchnorms(optimized)
    if full_check:
        validate(optimized, what="optimized model", full=True)
    report.elapsed_s = time.perf_counter() - start

    if check:
        prove(original, optimized, report, input_shapes=input_shapes, seed=seed, tolerance=tolerance)
    return optimized, report


def prove(
    original: onnx.ModelProto | str | os.PathLike[str],
    optimized: onnx.ModelProto | str | os.PathLike[str],
    report: Report,
    *,
    input_shapes: Mapping[str, Sequence[int]] | None,
    seed: int,
    tolerance: float | None,
) -> None:
    """Compare both models on seeded random inputs, per output and per rewritten BN in ``report``.

    A model given as a path is run from its file, its weights never loaded into Python.

    Records the result in ``report``; raises CheckFailedError naming the most upstream failing fold (errors
    propagate downstream, so that one is the culprit), else the worst failing output.
    """
    from bnfuse.passes.check.compare import compare_models

    report.check = compare_models(
        original,
        optimized,
        input_shapes=input_shapes,
        seed=seed,
        tolerance=tolerance,
        folds=[*report.batchnorms, *report.merges],
        written=report.written_weights,
    )
    if report.check.passed:
        return
    fold = report.check.first_failed_fold()
    if fold is not None and fold.error is not None:
        failed = sum(1 for f in report.check.folds if f.outcome == "failed")
        into = f" into '{fold.into}'" if fold.into else " to Mul+Add"
        others = f" ({failed - 1} later fold(s) fail too)" if failed > 1 else ""
        result, where = fold.error, f"'{fold.tensor}'"
        if result.passed and fold.isolated is not None:  # only the fold alone shows it
            result, where = fold.isolated, f"'{fold.tensor}' on random data at '{fold.entry}'"
        what = f"BatchNormalization '{fold.node}'{into}"
        merged = any(
            r.direction == "merged" and (r.graph, r.node) == (fold.graph, fold.node) for r in report.batchnorms
        )
        what += " (one branch of a merge)" if merged and fold.status == "folded" else ""
        if fold.status == "merged":
            what = f"the branches of '{fold.node}' into '{fold.into}'"
        action = {"folded": "fold", "merged": "merge"}.get(fold.status, "conversion")
        message = (
            f"{action} of {what} fails: {where} differs from the {result.reference} by max rel "
            f"{result.max_rel:.3e} > tolerance {result.tolerance:.1e}{others}"
        )
    else:
        worst = max((o for o in report.check.outputs if not o.passed), key=lambda o: o.max_rel - o.tolerance)
        message = (
            f"optimized output '{worst.name}' differs from the {worst.reference}: max rel {worst.max_rel:.3e} "
            f"> tolerance {worst.tolerance:.1e}"
        )
    error = CheckFailedError(message)
    error.report = report  # type: ignore[attr-defined]
    raise error


def reset_training_batchnorms(model: onnx.ModelProto) -> tuple[onnx.ModelProto, set[str]]:
    """The model with every training-mode BatchNormalization set to inference, and those BNs' output names.

    Training mode is ``training_mode=1`` (opset 14+) or requested running-statistics outputs (older
    opsets). Inference is what `optimize` is for, so such a BN is reset: its extra outputs are dropped
    when nothing reads them; one whose statistics are read (a graph output, another node) stays as it is.
    The input model is not modified: a copy is made only when something is reset.
    """
    found = [
        (graph, node)
        for graph in _all_graphs(model.graph)
        for node in graph.node
        if node.op_type == "BatchNormalization" and node.domain in ("", "ai.onnx") and _in_training_mode(node)
    ]
    if not found:
        return model, set()
    read = {name for graph in _all_graphs(model.graph) for node in graph.node for name in node.input}
    read |= {o.name for graph in _all_graphs(model.graph) for o in graph.output}
    resettable = {n.output[0] for _, n in found if not any(name and name in read for name in n.output[1:])}
    if not resettable:
        return model, set()
    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    for graph in _all_graphs(copy.graph):
        for node in graph.node:
            if node.op_type == "BatchNormalization" and node.output and node.output[0] in resettable:
                kept = [a for a in node.attribute if a.name != "training_mode"]
                del node.attribute[:]
                node.attribute.extend(kept)
                del node.output[1:]
    return copy, resettable


def _in_training_mode(node: onnx.NodeProto) -> bool:
    training = any(a.name == "training_mode" and a.i == 1 for a in node.attribute)
    return training or any(name for name in node.output[1:])


def _all_graphs(graph: onnx.GraphProto) -> Iterator[onnx.GraphProto]:
    yield graph
    for node in graph.node:
        for attr in node.attribute:
            if attr.type == onnx.AttributeProto.GRAPH:
                yield from _all_graphs(attr.g)
            elif attr.type == onnx.AttributeProto.GRAPHS:
                for sub in attr.graphs:
                    yield from _all_graphs(sub)


def supported_opset(model: onnx.ModelProto, label: str) -> int:
    """The model's default-domain opset, or ModelError when bnfuse (and this onnx) cannot handle it."""
    newest = onnx.defs.onnx_opset_version()
    versions = [o.version for o in model.opset_import if o.domain in ("", "ai.onnx")]
    if not versions:
        return newest  # no standard operators at all: nothing to fold, nothing version-dependent
    version = max(versions)
    if not MIN_OPSET <= version <= newest:
        raise ModelError(f"{label}: unsupported opset {version} (supported: {MIN_OPSET} to {newest})")
    return version


def validate(model: onnx.ModelProto, *, what: str, full: bool = False) -> None:
    """onnx.checker on the model's structure (ModelError on failure), without serializing its weights.

    The checker takes a serialized model; for a ResNet-50 that costs more than the whole fold. Large
    top-level initializers are therefore presented to it as typed graph inputs of the same name, shape
    and dtype: node schemas, topological order, names and (full) shape inference are checked all the same.
    """
    skeleton = onnx.ModelProto()
    copy_fields(model, skeleton, skip=("graph",))
    source, graph = model.graph, skeleton.graph
    copy_fields(source, graph, skip=("initializer", "input"))
    graph.input.extend(source.input)
    listed = {i.name for i in source.input}
    for tensor in source.initializer:
        if tensor.data_location != onnx.TensorProto.EXTERNAL and len(tensor.raw_data) <= _SMALL_TENSOR_BYTES:
            graph.initializer.append(tensor)
        elif tensor.name not in listed:
            graph.input.append(helper.make_tensor_value_info(tensor.name, tensor.data_type, list(tensor.dims)))
    check_model(skeleton, what=what, full=full)


def count_nodes(graph: onnx.GraphProto, op_type: str | None = None) -> int:
    """Nodes of ``graph`` and of every subgraph inside it (all of them, or those of one op type)."""
    return sum(1 for node in _all_nodes(graph) if op_type is None or node.op_type == op_type)


def _all_nodes(graph: onnx.GraphProto) -> Iterator[onnx.NodeProto]:
    for node in graph.node:
        yield node
        for attr in node.attribute:
            if attr.type == onnx.AttributeProto.GRAPH:
                yield from _all_nodes(attr.g)
            elif attr.type == onnx.AttributeProto.GRAPHS:
                for sub in attr.graphs:
                    yield from _all_nodes(sub)


def _validate_function_batchnorms(model: onnx.ModelProto, label: str, payloads: PayloadStore | None) -> None:
    """Model-local functions are not rewritten, but their BN statistics must be valid all the same.

    A variance is checked where it is known: a Constant node in the function body, or (for a function
    input) the initializer or Constant every call site passes.
    """
    if not any(n.op_type == "BatchNormalization" for f in model.functions for n in f.node):
        return  # the common case: no function holds a BN, so no initializer needs decoding
    constants = _graph_constants(model.graph, overridable_initializers(model.graph, model.ir_version), payloads)
    for function in model.functions:
        local = {
            out: numpy_helper.to_array(attr.t)
            for node in function.node
            if node.op_type == "Constant" and node.domain in ("", "ai.onnx")
            for attr in node.attribute
            if attr.name == "value" and attr.type == onnx.AttributeProto.TENSOR
            for out in node.output[:1]
        }
        calls = [n for n in _all_nodes(model.graph) if n.op_type == function.name and n.domain == function.domain]
        for node in function.node:
            if node.op_type != "BatchNormalization" or node.domain not in ("", "ai.onnx") or len(node.input) < 5:
                continue
            name = node.input[4]
            values = [local[name]] if name in local else []
            if name in function.input:
                index = list(function.input).index(name)
                values += [
                    constants[c.input[index]] for c in calls if index < len(c.input) and c.input[index] in constants
                ]
            for value in values:
                variance = np.asarray(value, dtype=np.float64)
                if np.isnan(variance).any() or (variance < 0).any():
                    where = f"function {function.domain}:{function.name}"
                    bn = node.name or f"BatchNormalization->{node.output[0]}"
                    raise ModelError(
                        f"{label}: BatchNormalization '{bn}' in {where}: variance has negative or NaN entries"
                    )


def _graph_constants(
    graph: onnx.GraphProto, overridable: set[str], payloads: PayloadStore | None
) -> dict[str, np.ndarray]:
    """Initializers (not overridable) and Constant-node values of one graph, by name."""

    def value(tensor: onnx.TensorProto) -> np.ndarray:
        mapped = payloads.array(tensor) if payloads is not None else None
        return numpy_helper.to_array(tensor) if mapped is None else mapped

    constants = {t.name: value(t) for t in graph.initializer if t.name not in overridable}
    for node in graph.node:
        if node.op_type == "Constant" and node.domain in ("", "ai.onnx"):
            for attr in node.attribute:
                if attr.name == "value" and attr.type == onnx.AttributeProto.TENSOR:
                    constants[node.output[0]] = numpy_helper.to_array(attr.t)
    return constants


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split())[:300] or type(exc).__name__


def _function_batchnorms(model: onnx.ModelProto) -> int:
    return sum(1 for f in model.functions for n in f.node if n.op_type == "BatchNormalization")


def _fold_model(
    original: onnx.ModelProto,
    opset: int,
    standalone: str,
    report: Report,
    progress: ProgressCallback | None,
    payloads: PayloadStore | None,
    reset: set[str],
    activation_moves: bool = True,
) -> onnx.ModelProto:
    overridable = overridable_initializers(original.graph, original.ir_version)
    shell = without_functions(original)
    if payloads is not None and shell is not original:  # references are bound to objects: bind the copies too
        for source, copied in zip(original.graph.initializer, shell.graph.initializer, strict=True):
            array = payloads.array(source)
            if array is not None:
                payloads.bind(copied, array)
    with quiet_graphsurgeon():
        graph = gs.import_onnx(shell)
    if payloads is not None:
        attach_payloads(graph, payloads)
    used_names = names_in(graph)
    total = report.batchnorms_before
    done = 0

    def tick() -> None:
        nonlocal done
        done += 1
        if progress is not None:
            progress(done, total)

    ctx = FoldContext(
        resolver=ConstantResolver(overridable=overridable),
        used_names=used_names,
        types=InferredTensorTypes(original),
        opset=opset,
        standalone=standalone,
        activation_moves=activation_moves,
        progress=tick,
        graph_outputs={id(t) for g in [graph, *graph.subgraphs(recursive=True)] for t in g.outputs},
        reset_from_training=reset,
    )
    merges: list[MergeRecord] = []
    _fold_recursively(graph, ctx, "main", merges)
    for function in original.functions:
        for node in function.node:
            if node.op_type == "BatchNormalization" and node.domain in ("", "ai.onnx"):
                name = node.name or f"BatchNormalization->{node.output[0]}"
                where = f"function {function.domain}:{function.name}"
                ctx.records.append(
                    BatchNormRecord(name, where, "skipped", reason="inside a model-local function (not rewritten)")
                )
                tick()
    for record in [*ctx.records, *merges]:
        if record.status != "skipped" and record.output:
            record.replacement = ctx.replacement(record.output)
    report.merges = merges
    report.batchnorms = ctx.records
    report.absorbed = ctx.absorbed
    report.transposes_cancelled = ctx.transposes_cancelled
    report.noops_removed = ctx.noops_removed
    report.rewritten_weights = sorted(ctx.rewritten)
    report.written_weights = sorted(ctx.written)
    with quiet_graphsurgeon():
        graph.cleanup(remove_unused_graph_inputs=False, recurse_functions=False)
        return export_model(original, graph, overridable, payloads)


def _fold_recursively(graph: gs.Graph, ctx: FoldContext, path: str, merges: list[MergeRecord]) -> None:
    merge_branches(graph, ctx, merges, graph_path=path)  # first: a BN after a branch sum folds into its Conv
    fold_graph(graph, ctx, graph_path=path)
    for node in graph.nodes:
        for key, value in node.attrs.items():
            bodies = value if isinstance(value, list) else [value]
            for index, body in enumerate(bodies):
                if isinstance(body, gs.Graph):
                    suffix = f"[{index}]" if isinstance(value, list) else ""
                    _fold_recursively(body, ctx, f"{path}/{describe(node)}.{key}{suffix}", merges)


def default_model_path() -> Path:
    """onnx's own light ResNet-50 (weights built with ConstantOfShape), shipped inside the onnx package."""
    return Path(onnx.__file__).parent / "backend" / "test" / "data" / "light" / "light_resnet50.onnx"
