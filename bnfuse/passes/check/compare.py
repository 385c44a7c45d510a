"""Numerical proof of a rewrite: run original and optimized models on the same seeded random inputs.

What is compared, per rewritten BatchNormalization (bnfuse.passes.check.fold_probes names the tensors):
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

How far each tensor may be off is bnfuse.passes.check.tolerances (its docstring gives the tolerances and the
float16 / bfloat16 logic); bnfuse.passes.check.engines runs the models; bnfuse.passes.check.inputs draws the
inputs.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Collection, Mapping, Sequence

import numpy as np
import onnx

from bnfuse.errors import BnfuseError
from bnfuse.passes.check import fold_probes
from bnfuse.passes.check.engines import ENGINES, ModelSource, open_model, run_models
from bnfuse.passes.check.inputs import InputSpec, input_specs, random_inputs
from bnfuse.passes.check.tolerances import (
    IN_CONTEXT_FACTOR,
    ISOLATED_LOW_PRECISION,
    LOW_PRECISION,
    TOLERANCES,
    allow_conditioning,
    elem_type_of,
    output_error,
    precision_references,
    tensor_error,
    widened,
)
from bnfuse.passes.report import BatchNormRecord, CheckResult, MergeRecord

__all__ = [
    "ENGINES",
    "TOLERANCES",
    "InputSpec",
    "ModelSource",
    "compare_models",
    "input_specs",
    "random_inputs",
    "widened",
]

_SECOND_DRAW = 1  # the second random draw is seeded with (seed, _SECOND_DRAW)
_ISOLATED_DRAW = 2  # data fed to isolated fold chains: (seed, _ISOLATED_DRAW)


def compare_models(
    original: ModelSource,
    optimized: ModelSource,
    *,
    input_shapes: Mapping[str, Sequence[int]] | None = None,
    seed: int = 0,
    tolerance: float | None = None,
    folds: Sequence[BatchNormRecord | MergeRecord] = (),
    written: Collection[str] | None = None,
) -> CheckResult:
    """Max abs / rel error of ``optimized`` against ``original`` per output and per rewritten BN in ``folds``.

    ``folds``: the rewritten BNs and branch merges to prove one by one. ``tolerance`` forces a direct
    comparison of every tensor against the original with that limit. A model
    given as a path is run from its file (onnxruntime reads it; Python never holds its weights).
    ``written``: the optimized model's constants holding the values the folds computed and rounded once: the
    twins move only these (float32 / float64: allow_conditioning; float16 / bfloat16: precision_references;
    None: every low-precision constant, and a flat float32 / float64 tolerance).
    """
    start = time.perf_counter()
    original_model, optimized_model = open_model(original), open_model(optimized)
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
    first_engine, (((second_digests, types),),) = run_models(
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
        engine, ((expected,), (actual,)) = run_models(
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
        engine, ((expected,), (actual,)) = run_models(
            [
                (original_model, "original", None, [(feeds, None)]),
                (optimized_model, "optimized", None, [(feeds, None)]),
            ],
            compared,
            first=first,
        )
    del fed
    constant = [a == b for a, b in zip(_fingerprints(expected[:count]), second_digests, strict=True)]
    low = any(elem_type_of(np.asarray(v)) in LOW_PRECISION for v in expected[:count])
    references = (
        precision_references(original_model, optimized_model, feeds, seed, compared, written)
        if low and tolerance is None
        else None
    )
    in_context = set(compared) - set(outputs)
    errors = {}
    for index, name in enumerate(compared):
        want, got = np.asarray(expected[index]), np.asarray(actual[index])
        factor = IN_CONTEXT_FACTOR if name in in_context else 1.0
        error = tensor_error(name, want, got, references, index, tolerance, factor)
        error.constant = constant[index]
        errors[name] = error
    failing = [
        n for n in compared if not errors[n].passed and errors[n].noise is None and np.isfinite(errors[n].max_rel)
    ]
    if failing and tolerance is None and written:
        allow_conditioning(errors, failing, optimized_model, feeds, actual[:count], compared, written, seed)
    for probe in probes:
        if probe.check.tensor is not None:
            probe.check.error = errors[probe.check.tensor]
    for offset, (probe, name) in enumerate(zip(isolation.isolated, isolation.outputs, strict=True)):
        want, got = np.asarray(expected[count + offset]), np.asarray(actual[count + offset])
        elem_type = elem_type_of(want)
        limit = ISOLATED_LOW_PRECISION.get(elem_type) or TOLERANCES.get(elem_type, 1e-4)
        error = output_error(name, want, got, tolerance if tolerance is not None else limit)
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
