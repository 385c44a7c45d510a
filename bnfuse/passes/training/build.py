"""The training pass: inference ONNX model -> training graph onnxruntime runs (with bnfuse's custom ops).

``build_training_graph(model) -> (ModelProto, TrainingReport)``. The result computes, in one run: the
forward with every BatchNormalization in training mode (bnfuse.BatchNormalizationTraining), the loss,
the backward (BN through bnfuse.BatchNormalizationGrad, everything else through onnx-ad's rules in
standard ONNX operators) and the optimizer step. Parameters, running statistics and optimizer state are
inputs (with their initial values as initializers) and their updated values are outputs; the interface
is recorded in the model's metadata (see spec.py). ``portable=True`` writes the BN ops in standard ONNX
operators instead, for runtimes without the bnfuse library.
"""

from __future__ import annotations

import functools
import inspect
import os
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import onnx

from bnfuse.errors import BnfuseError
from bnfuse.io import check_model, load_model, read_mapped, require_regular_file
from bnfuse.passes.training import dynamic_batch, groups, prepare, weights
from bnfuse.passes.training import nchwc as nchwc_layout
from bnfuse.passes.training.assemble import Prepared, build_prepared, prepare_source
from bnfuse.passes.training.optimizers import SGD, Adam
from bnfuse.passes.training.report import TrainingReport
from bnfuse.passes.training.spec import read_spec, set_spec
from bnfuse.runtime.semantics import MomentumConvention
from bnfuse.tensorcheck import check_strings, check_tensors

__all__ = ["TrainingReport", "build_training_graph"]


def build_training_graph(
    model: onnx.ModelProto | str | os.PathLike[str],
    *,
    static_batch: bool = False,
    loss: str = "cross-entropy",
    optimizer: str | SGD | Adam = "sgd",
    trainable: Sequence[str] | None = None,
    frozen_bn: bool | Sequence[str] = False,
    fix_gamma: bool = False,
    momentum: float | None = None,
    momentum_convention: str | MomentumConvention | None = None,
    unbiased_running_var: bool | None = None,
    param_groups: Sequence[groups.GroupRule] = (),
    batch_size: int | None = None,
    input_shapes: Mapping[str, Sequence[int]] | None = None,
    output: str | None = None,
    portable: bool = False,
    dropout: str = "train",
    dropout_seed: int = 0,
    require_batchnorm: bool = True,
    fuse_relu: bool = True,
    fused_optimizer: bool = True,
    nchwc: bool = False,
) -> tuple[onnx.ModelProto, TrainingReport]:
    """Build the training graph of an inference model.

    loss: "cross-entropy" (int64 ``labels`` [N]), "mse" (float ``labels`` shaped like the output) or "seed"
        (input ``grad.<output>``: the gradient of the loss with respect to the output).
    optimizer: "sgd", "adam", or an SGD / Adam instance (PyTorch semantics; the learning rate is the
        scalar input ``lr``).
    trainable: initializer names or fnmatch patterns to train (default: every float32 (float64) weight of Conv,
        ConvTranspose, Gemm, MatMul, BatchNormalization scale/bias, PRelu, Layer/InstanceNormalization, and the
        bias of an Add after a linear op, also through shape-only ops; see prepare.select).
    frozen_bn: True, or BN node names / outputs, to normalize with the running statistics while training
        (MXNet's use_global_stats; PyTorch's BN in eval mode): statistics stay, gradients use them.
    fix_gamma: BN scale treated as 1 and not trained (MXNet).
    momentum / momentum_convention: running-statistics momentum, "onnx" (= mxnet: running*m + batch*(1-m)),
        "pytorch" (= mindspore, cudnn: running*(1-m) + batch*m) or "cumulative" (PyTorch's momentum=None:
        the cumulative moving average, no momentum). Default: each node's own momentum attribute (ONNX
        convention; in a PyTorch export, attribute 1.0 = momentum=None, cumulative); "pytorch" / "cudnn"
        need ``momentum``. See bnfuse.passes.training.running_stats.
    unbiased_running_var: update the running variance with the unbiased batch variance. None: unbiased under
        "pytorch", "cudnn", "cumulative" and for PyTorch exports (as PyTorch), biased otherwise.
    param_groups: per-pattern weight decay / learning-rate multipliers (groups.GroupRule), last match wins.
    batch_size / input_shapes: sizes for dynamic input dimensions. The batch dimension (the first of every data
        input) stays dynamic: a step takes any batch size, with the loss and BN statistics over that batch
        (dynamic_batch.py); ``batch_size`` is then recorded as the graph's default batch size (``spec.batch_size``).
    static_batch: fix the batch dimension at ``batch_size`` instead (the only size a step then takes). A graph that
        cannot keep a dynamic batch (a shape the model pins to one size) is built static at ``batch_size`` and the
        report says why.
    output: the model output the loss is computed on (default: the first).
    portable: standard ONNX ops only (no bnfuse custom ops).
    dropout: "train" (the model's Dropout nodes drop during training, node i seeded ``dropout_seed + i``;
        see dropout.py) or "off" (they stay the identity).
    require_batchnorm: refuse a model without BatchNormalization (an exporter folded it away: training it
        would silently train a different network); False builds the plain training graph all the same.
    fuse_relu: a Relu that alone reads a BN's output becomes the BN ops' activation "relu" (one forward and one
        grad node instead of BN, Relu and Relu's three backward nodes; CPU and CUDA kernels). Never in portable
        graphs; the distributed rewrite splits it off again (the synchronized ops have no activation).
    fused_optimizer: one bnfuse.SGDStep / AdamStep node updates every parameter (same bits as the standard nodes,
        one pass over memory). Never in portable graphs; a CPU kernel: TrainingSession on the CUDA provider turns it
        back into standard nodes (optimizers.expand_fused_steps).
    nchwc: write the rewrite of the 2-D convolutions to onnxruntime's blocked layout that TrainingSession makes on
        the CPU (nchwc.py) into the graph, for this CPU's block (recorded in the metadata): a plain onnxruntime host
        with bnfuse's library then runs TrainingSession's step; the file runs only on CPUs with the same block.
        Never in portable graphs.
    """
    start = time.perf_counter()
    if isinstance(model, onnx.ModelProto):
        source, detached = weights.detached_copy(model)
    else:
        source, detached = _read_detached(model)
    options = dict(
        loss=loss,
        optimizer=optimizer,
        trainable=trainable,
        frozen_bn=frozen_bn,
        fix_gamma=fix_gamma,
        momentum=momentum,
        momentum_convention=momentum_convention,
        unbiased_running_var=unbiased_running_var,
        param_groups=param_groups,
        output=output,
        portable=portable,
        dropout=dropout,
        dropout_seed=dropout_seed,
        require_batchnorm=require_batchnorm,
        fuse_relu=fuse_relu,
        fused_optimizer=fused_optimizer,
        nchwc=nchwc,
    )
    result, report = build_detached(
        source, detached, static_batch=static_batch, batch_size=batch_size, input_shapes=input_shapes, **options
    )
    weights.attach(result, detached)
    detached.clear()
    report.seconds = time.perf_counter() - start
    return result, report


def _read_detached(path: str | os.PathLike[str]) -> tuple[onnx.ModelProto, weights.Detached]:
    """The inference model at ``path``, its weights detached (weights.py), checked as ``load_model`` checks it: the
    weights straight from a read-only map of the file where bnfuse.io.read_mapped reads it (never copied into a
    ModelProto and out again), else loaded and detached; onnx's checker on the placeholders."""
    require_regular_file(Path(path))
    mapped = read_mapped(path)
    if mapped is None:
        source = load_model(path, check=False)
        detached = weights.detach(source)
    else:
        source, payloads = mapped
        check_strings(source, what=str(path))
        check_tensors(source, what=str(path))
        detached = weights.detach_payloads(source, payloads)
    check_model(weights.checkable_source(source, detached), what=str(path))
    return source, detached


def build_detached(
    source: onnx.ModelProto,
    detached: weights.Detached,
    *,
    static_batch: bool = False,
    batch_size: int | None = None,
    input_shapes: Mapping[str, Sequence[int]] | None = None,
    **options: Any,
) -> tuple[onnx.ModelProto, TrainingReport]:
    """``build_training_graph`` of ``source``, an inference model whose large weights are placeholders of
    ``detached`` (weights.detach / detached_copy): the training graph's state tensors are placeholders too
    (weights.attach gives them their values, weights.take hands them over as arrays)."""
    start = time.perf_counter()
    if batch_size is not None and batch_size < 1:
        raise BnfuseError(f"batch size must be >= 1, got {batch_size}")
    unknown = set(options) - set(_option_defaults())
    if unknown:
        raise TypeError(f"build_detached: unknown options {', '.join(sorted(unknown))}")
    options = {**_option_defaults(), **options}
    blocked = options.pop("nchwc")
    prepare_options = {k: options[k] for k in _PREPARE_OPTIONS}
    build_options = {k: v for k, v in options.items() if k not in _PREPARE_OPTIONS or k == "fix_gamma"}
    result: onnx.ModelProto | None = None
    report: TrainingReport | None = None
    reason = ""
    relaxed = dynamic_batch.without_batch_sizes(source, {i.name for i in prepare.data_inputs(source)})
    prepared_relaxed: Prepared | None = None  # the batch-independent half, once for every probe size
    if not static_batch:
        reports: list[TrainingReport] = []

        def probe(size: int) -> onnx.ModelProto:
            assert prepared_relaxed is not None
            shapes = {name: [size, *list(dims)[1:]] for name, dims in (input_shapes or {}).items()}
            built, built_report = build_prepared(
                prepared_relaxed, batch_size=size, input_shapes=shapes, check=not reports, **build_options
            )
            reports.append(built_report)
            _check_batch_followed(built, size)
            return built

        try:
            prepared_relaxed = prepare_source(relaxed, detached=detached, **prepare_options)
            collision = dynamic_batch.own_sizes_collide(relaxed, {i.name for i in prepare.data_inputs(relaxed)})
            result = dynamic_batch.dynamic_batch_graph(
                probe, lambda model: read_spec(model).data[0], one_probe=dynamic_batch.ONE_PROBE and not collision
            )
            report = reports[0]
        except dynamic_batch.NotBatchPolymorphic as exc:
            reason = str(exc)
        except BnfuseError as exc:  # the model pins its batch size (a Reshape to [1, -1], ...): static if it builds
            reason = f"at another batch size: {exc}"
    if result is None or report is None:  # static: any batch size the model allows (the export's own without one)
        prepared = prepared_relaxed if batch_size is not None else None
        if prepared is None:
            prepared = prepare_source(source if batch_size is None else relaxed, detached=detached, **prepare_options)
        result, report = build_prepared(prepared, batch_size=batch_size, input_shapes=input_shapes, **build_options)
    spec = read_spec(result)
    data_shape = next(i for i in result.graph.input if i.name == spec.data[0]).type.tensor_type.shape.dim
    static = data_shape[0].dim_value if data_shape and data_shape[0].HasField("dim_value") else None
    spec.batch_size = static or batch_size
    set_spec(result, spec)
    report.batch = (
        f"static {static}" + (f" (dynamic refused: {reason})" if reason and not static_batch else "")
        if static
        else "dynamic (any size)" + (f", default {batch_size}" if batch_size else "")
    )
    if blocked and not options["portable"]:
        count = nchwc_layout.write_rewrite(result)
        block = nchwc_layout.rewritten_block(result)
        report.notes.append(
            f"NCHWc: {count} convolutions in onnxruntime's blocked layout for block {block} (runs on CPUs with that "
            "block only)"
            if count
            else "NCHWc: nothing rewritten (no onnxruntime NCHWc kernels on this CPU, or no convolution they suit)"
        )
    report.seconds = time.perf_counter() - start
    return result, report


def _check_batch_followed(model: onnx.ModelProto, size: int) -> None:
    """NotBatchPolymorphic where the loss target's first dimension is not the probe's batch size: the model pins the
    batch (a static-batch export's Reshape to [4, -1], which onnx's shape inference accepts at any size)."""
    spec = read_spec(model)
    target = next((i for i in model.graph.input if spec.targets and i.name == spec.targets[0]), None)
    dims = target.type.tensor_type.shape.dim if target is not None else []
    if dims and dims[0].HasField("dim_value") and dims[0].dim_value != size:
        raise dynamic_batch.NotBatchPolymorphic(
            f"the model's output {spec.outputs[0]!r} has batch {dims[0].dim_value} for an input batch of {size} "
            "(a shape the export fixed)"
        )


# build_training_graph's options that prepare_source takes (fix_gamma: build_prepared too)
_PREPARE_OPTIONS = ("fix_gamma", "momentum", "momentum_convention", "unbiased_running_var", "require_batchnorm")


@functools.cache
def _option_defaults() -> dict[str, Any]:
    """build_training_graph's graph options (all but the shapes) and their defaults: build_detached's too."""
    parameters = inspect.signature(build_training_graph).parameters.values()
    shapes = ("static_batch", "batch_size", "input_shapes")
    return {p.name: p.default for p in parameters if p.kind is p.KEYWORD_ONLY and p.name not in shapes}
