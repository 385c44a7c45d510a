"""The training graph at static shapes: forward in training mode, backward, loss, optimizer step and interface.

``build_static(source, batch_size=..., ...) -> (ModelProto, TrainingReport)`` does one build with every input shape
fixed, in two halves: ``prepare_source`` (what does not depend on shapes: opset, training-mode flags, untied
weights, the exported skeleton) and ``build_prepared`` (at one batch size). build.py's ``build_training_graph``
prepares once and builds the prepared source at dynamic_batch.py's probe size (all three where one cannot tell).
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from bnfuse.errors import BnfuseError
from bnfuse.io import check_model, ort_compatible
from bnfuse.passes.training import autodiff, bn, groups, prepare, running_stats, sequences, simplify, untie, weights
from bnfuse.passes.training import dropout as dropout_ops
from bnfuse.passes.training import notes as training_notes
from bnfuse.passes.training import shapes as shape_ops
from bnfuse.passes.training.forward import (
    NEW_SUFFIX,
    bn_outputs_by_input,
    reject_subgraph_bn,
    training_dropout,
    training_forward,
)
from bnfuse.passes.training.graph_edit import (
    copy_model,
    drop_values,
    opsets,
    remove_unused_initializers,
    tensor_info,
    toposort,
)
from bnfuse.passes.training.losses import LOSS_OUTPUT, build_loss
from bnfuse.passes.training.optimizers import ADAM_STEP, SGD, Adam, StepBuilder, parse_optimizer
from bnfuse.passes.training.pool_sizes import match_pool_sizes
from bnfuse.passes.training.report import TrainingReport
from bnfuse.passes.training.spec import TrainingSpec, write_spec
from bnfuse.runtime.semantics import MomentumConvention

LR_INPUT = "lr"


# The exporter (PyTorch's dynamo exporter by default) folded every BN away: training would silently train
# a BN-less network, so refuse and say how to export with BN kept (docs/exporting.md).
NO_BATCHNORM_MESSAGE = (
    "the model has no BatchNormalization (the exporter folded it): export with BN kept, e.g. "
    "torch.onnx.export(..., dynamo=True, optimize=False) or dynamo=False with "
    "training=torch.onnx.TrainingMode.PRESERVE, do_constant_folding=False (see docs/exporting.md)"
)


@dataclass
class Prepared:
    """The batch-independent first half of a build (``prepare_source``), shared by builds at several sizes."""

    source: onnx.ModelProto  # the inference model, upgraded, untied, training-mode flags reset
    skeleton: onnx.ModelProto  # the inference model as it will be exported (dynamic shapes kept)
    stats_plan: running_stats.RunningStatsPlan
    training_mode_reset: int
    untied: untie.Untied
    eval_mode: list[str]  # BN left in eval() inside a train() export (frozen)
    detached: weights.Detached | None = None  # the store of ``source``'s placeholders, if any
    seconds: float = 0.0


def prepare_source(
    source: onnx.ModelProto,
    *,
    fix_gamma: bool,
    momentum: float | None,
    momentum_convention: str | MomentumConvention | None,
    unbiased_running_var: bool | None,
    require_batchnorm: bool,
    detached: weights.Detached | None = None,
) -> Prepared:
    """The steps of a build that do not depend on shapes, on a copy of ``source`` (whose placeholders, if any, are
    ``detached``'s: see weights.py)."""
    start = time.perf_counter()
    source = copy_model(source)
    stats_plan = running_stats.plan(source, momentum, momentum_convention, unbiased_running_var)
    if require_batchnorm and not any(
        n.op_type == "BatchNormalization" and n.domain in ("", "ai.onnx") for n in source.graph.node
    ):
        raise BnfuseError(NO_BATCHNORM_MESSAGE)
    if any(node.op_type in ("If", "Loop", "Scan") for node in source.graph.node):
        reject_subgraph_bn(source.graph)
    source = prepare.upgrade_opset(source)
    if prepare.drop_initializer_inputs(source.graph):  # IR < 4 lists weights as inputs; IR 4 need not
        source.ir_version = max(source.ir_version, 4)
    eval_mode = prepare.eval_mode_batch_norms(source.graph)  # BN in eval() inside a train() export: frozen
    training_mode_reset = prepare.reset_training_mode(source.graph)
    untied = untie.untie_parameters(source)  # every weight slot its own tensor (exporters merge equal ones)
    if fix_gamma:
        prepare.set_bn_scales_to_one(source)  # the exported model then computes what training did
    skeleton = copy_model(source)
    return Prepared(
        source,
        skeleton,
        stats_plan,
        training_mode_reset,
        untied,
        eval_mode,
        detached,
        seconds=time.perf_counter() - start,
    )


def build_static(
    source: onnx.ModelProto,
    *,
    loss: str,
    optimizer: str | SGD | Adam,
    trainable: Sequence[str] | None,
    frozen_bn: bool | Sequence[str],
    fix_gamma: bool,
    momentum: float | None,
    momentum_convention: str | MomentumConvention | None,
    unbiased_running_var: bool | None,
    param_groups: Sequence[groups.GroupRule],
    batch_size: int | None,
    input_shapes: Mapping[str, Sequence[int]] | None,
    output: str | None,
    portable: bool,
    dropout: str,
    dropout_seed: int,
    require_batchnorm: bool,
    fuse_relu: bool,
    fused_optimizer: bool,
) -> tuple[onnx.ModelProto, TrainingReport]:
    """The training graph with every input shape static (``batch_size`` fixes the batch dimension)."""
    prepared = prepare_source(
        source,
        fix_gamma=fix_gamma,
        momentum=momentum,
        momentum_convention=momentum_convention,
        unbiased_running_var=unbiased_running_var,
        require_batchnorm=require_batchnorm,
    )
    return build_prepared(
        prepared,
        loss=loss,
        optimizer=optimizer,
        trainable=trainable,
        frozen_bn=frozen_bn,
        fix_gamma=fix_gamma,
        param_groups=param_groups,
        batch_size=batch_size,
        input_shapes=input_shapes,
        output=output,
        portable=portable,
        dropout=dropout,
        dropout_seed=dropout_seed,
        fuse_relu=fuse_relu,
        fused_optimizer=fused_optimizer,
    )


def build_prepared(
    prepared: Prepared,
    *,
    loss: str,
    optimizer: str | SGD | Adam,
    trainable: Sequence[str] | None,
    frozen_bn: bool | Sequence[str],
    fix_gamma: bool,
    param_groups: Sequence[groups.GroupRule],
    batch_size: int | None,
    input_shapes: Mapping[str, Sequence[int]] | None,
    output: str | None,
    portable: bool,
    dropout: str,
    dropout_seed: int,
    fuse_relu: bool,
    fused_optimizer: bool,
    check: bool = True,
) -> tuple[onnx.ModelProto, TrainingReport]:
    """The training graph of a prepared source at static shapes. ``check=False`` skips onnx's checker (a probe
    build whose graph only feeds the dynamic-batch comparison; the graph kept is checked)."""
    start = time.perf_counter() - prepared.seconds
    source = copy_model(prepared.source)
    opt = parse_optimizer(optimizer)
    stats_plan = prepared.stats_plan
    training_mode_reset = prepared.training_mode_reset
    untied = prepared.untied
    eval_mode = prepared.eval_mode
    frozen_bn = prepare.with_frozen(frozen_bn, eval_mode)
    original_names = untied.renamed
    skeleton = prepared.skeleton

    prepare.freeze_shapes(source, batch_size, input_shapes)
    shapes = prepare.infer_static_shapes(source)
    # ceil_mode pools: ONNX's inference at onnxruntime's size; Shape -> ... -> Reshape / Slice / Resize / Pad:
    # constants; dynamo's SplitToSequence -> SequenceAt: one Split. Each can make sizes static that another needs
    # (a pool after a Pad whose pads a Shape computation gives: a reflect-padded Conv), so again until none changes.
    rewrites = (match_pool_sizes, shape_ops.fold_shape_computations, sequences.split_sequences)
    for _ in range(len(rewrites)):
        changed = False
        for rewrite in rewrites:
            if rewrite(source, shapes):
                shapes, changed = prepare.infer_static_shapes(source), True
        if not changed:
            break
    graph = source.graph
    outputs = [o.name for o in graph.output]
    output = output or outputs[0]
    if output not in outputs:
        raise BnfuseError(f"{output!r} is not a model output (outputs: {', '.join(outputs)})")
    out_shape, out_type = shapes.get(output, ((), 0))
    if not out_shape or any(d < 0 for d in out_shape):
        raise BnfuseError(f"output {output!r} has no static shape after fixing the input shapes")
    selection = prepare.select(source, trainable, frozen_bn, fix_gamma)
    state_names = selection.parameters + selection.running_stats
    hypers = groups.resolve(
        selection.parameters,
        param_groups,
        opt.weight_decay,
        bn_parameters={n for node in graph.node if node.op_type == "BatchNormalization" for n in node.input[1:3]},
        ranks={t.name: len(t.dims) for t in graph.initializer},
    )

    # 1. forward: BN in training mode, parameters and running statistics as inputs
    nodes, bn_outputs, frozen, cumulative = training_forward(graph, selection, fix_gamma, stats_plan)
    dropouts = training_dropout(nodes, graph, shapes, dropout, dropout_seed)
    if fuse_relu and not portable:
        bn.fuse_relu(nodes, set(outputs))
    initial = {t.name: t for t in graph.initializer}
    constants = [t for t in graph.initializer if t.name not in state_names]
    if prepared.detached is not None:  # constants onnx-ad may read (frozen weights): their values back
        weights.materialize(constants, prepared.detached)
    if dropouts:
        constants.append(dropout_ops.flag_initializer())
    data = [i for i in prepare.data_inputs(source)]
    forward = helper.make_graph(
        nodes,
        graph.name or "bnfuse_training",
        data + [tensor_info(initial[n]) for n in state_names],
        [helper.make_tensor_value_info(output, out_type, list(out_shape))],
        constants,
    )
    initializer_names = {t.name for t in graph.initializer}
    forward.value_info.extend(
        prepare.value_info(name, dims, elem) for name, (dims, elem) in shapes.items() if name not in initializer_names
    )
    for name, dims in bn_outputs.items():
        forward.value_info.append(prepare.value_info(name, dims))
    fmodel = helper.make_model(forward, opset_imports=opsets(source))
    fmodel.ir_version = source.ir_version

    # 2. backward of the network from the output's adjoint
    adjoint = autodiff.reverse(fmodel, selection.parameters, output, weight_grad_op=not portable)
    g = adjoint.graph
    seed_input = autodiff.ADJOINT_PREFIX + output
    drop_values(g.input, {seed_input})
    grad_outputs = {autodiff.ADJOINT_PREFIX + p: p for p in selection.parameters}
    drop_values(g.output, set(grad_outputs) | {output})
    extra_nodes: list[onnx.NodeProto] = []
    extra_inits: list[onnx.TensorProto] = []

    # 3. loss and its gradient (the seed)
    lossg = build_loss(loss, output, list(out_shape), out_type)
    extra_nodes += lossg.nodes
    extra_inits += lossg.initializers
    extra_inits.append(numpy_helper.from_array(np.array([-1], np.int64), "adj/seed_axis"))
    extra_nodes.append(helper.make_node("Unsqueeze", [lossg.grad, "adj/seed_axis"], [seed_input]))

    # 4. optimizer step
    # one float type for the parameters, lr, loss and optimizer state: float32, or float64 for a float64 model
    param_types = {initial[p].data_type for p in grad_outputs.values()}
    uniform = len(param_types) == 1  # every parameter of one type: one fused node can update them all
    float_type = next(iter(param_types)) if uniform else TensorProto.FLOAT
    float_dtype = helper.tensor_dtype_to_np_dtype(float_type).type
    steps = StepBuilder(opt, LR_INPUT, fused=fused_optimizer and not portable and uniform, dtype=float_dtype)
    opt_state: list[str] = []
    state_outputs: dict[str, str] = {}
    counters: list[str] = []
    if isinstance(opt, Adam):
        opt_state.append(ADAM_STEP)
        state_outputs[ADAM_STEP] = ADAM_STEP + NEW_SUFFIX
        steps.adam_step(ADAM_STEP, state_outputs[ADAM_STEP])
    for adj, param in grad_outputs.items():
        dims = list(initial[param].dims)
        shape_const = f"grad/{param}.shape"
        extra_inits.append(numpy_helper.from_array(np.array(dims, np.int64), shape_const))
        grad = f"grad/{param}"
        extra_nodes.append(helper.make_node("Reshape", [adj, shape_const], [grad]))
        names = opt.state_names(param)
        opt_state += names
        for name in [param, *names]:
            state_outputs[name] = name + NEW_SUFFIX
        steps.step(param, grad, names, state_outputs[param], [state_outputs[n] for n in names], hypers[param])
    steps.finish()
    extra_nodes += steps.nodes
    extra_inits += steps.initializers
    updated = bn_outputs_by_input(nodes)
    for name in selection.running_stats:
        state_outputs[name] = updated[name]
    if cumulative:  # PyTorch's momentum=None: blend the batch statistic in with 1/(n+1), n counted in the graph
        counter = running_stats.COUNTER
        counters.append(counter)
        state_outputs[counter] = counter + NEW_SUFFIX
        running_stats.counter_step(counter, state_outputs[counter], extra_nodes, extra_inits, float_dtype)
        for name, batch in cumulative.items():
            state_outputs[name] = f"{name}{NEW_SUFFIX}"
            running_stats.cumulative_update(
                name, batch, state_outputs[name], state_outputs[counter], extra_nodes, extra_inits, float_dtype
            )

    # 5. interface: inputs (data, targets, lr, state with initial values), outputs (loss, outputs, state)
    g.input.append(lossg.target)
    g.input.append(helper.make_tensor_value_info(LR_INPUT, float_type, []))
    state_inits = []
    for name in opt_state + counters:
        if name in (ADAM_STEP, running_stats.COUNTER):
            state_inits.append(numpy_helper.from_array(np.array(0.0, float_dtype), name))
        else:
            param = name.rsplit(".", 1)[0]
            dtype = helper.tensor_dtype_to_np_dtype(initial[param].data_type)
            state_inits.append(numpy_helper.from_array(np.zeros(tuple(initial[param].dims), dtype), name))
        g.input.append(tensor_info(state_inits[-1]))
    state_inits += [initial[n] for n in state_names]
    g.initializer.extend(state_inits)
    g.initializer.extend(extra_inits)
    g.output.append(helper.make_tensor_value_info(LOSS_OUTPUT, out_type, []))
    for name in outputs:
        dims, elem = shapes[name]
        g.output.append(prepare.value_info(name, dims, elem))
    for name, new in state_outputs.items():
        dims, elem = _state_type(name, initial, state_inits)
        g.output.append(prepare.value_info(new, dims, elem))

    all_nodes = list(g.node) + extra_nodes
    if portable:
        lowering: list[onnx.TensorProto] = []
        all_nodes = bn.lower_portable(all_nodes, lambda name: shapes[name][0], lowering, float_dtype)
        g.initializer.extend(lowering)
    g.ClearField("node")
    g.node.extend(toposort(all_nodes, [i.name for i in g.input] + [t.name for t in g.initializer]))
    g.ClearField("value_info")
    result = helper.make_model(g, opset_imports=opsets(source, custom=not portable))
    result.producer_name = "bnfuse train-graph"
    ort_compatible(result)
    static, element_types = simplify.static_shapes_and_types(result)
    simplify.drop_copying_expands(result, keep=[f"grad/{p}" for p in selection.parameters], shapes=static)
    simplify.seed_axis_fast_paths(result, static, element_types)
    simplify.fast_transposes(result, static)
    remove_unused_initializers(result.graph)

    spec = TrainingSpec(
        data=[i.name for i in data],
        targets=[lossg.target.name],
        lr=LR_INPUT,
        loss=LOSS_OUTPUT,
        loss_kind=loss,
        parameters=list(selection.parameters),
        running_stats=list(selection.running_stats),
        optimizer_state=opt_state,
        state=state_outputs,
        outputs=outputs,
        counters=counters,
        original_names={k: v for k, v in original_names.items() if k in state_outputs and k != v},
    )
    skeleton_graph = _skeleton(skeleton.graph, set(state_names), prepared.detached)
    write_spec(result, spec, skeleton_graph)
    if check:
        detached = prepared.detached
        check_model(result if detached is None else weights.checkable(result, detached), what="training graph")

    counts: dict[str, int] = {}
    for node in result.graph.node:
        counts[node.op_type] = counts.get(node.op_type, 0) + 1
    bn_count = sum(1 for n in graph.node if n.op_type == "BatchNormalization")
    momentum_text, variance_text = stats_plan.describe(len(cumulative) // 2, bn_count)
    notes = training_notes.frozen_notes(source, selection, trainable is not None)
    notes += training_notes.dropout_notes(source, dropouts, dropout_seed)
    notes += untie.note(untied) + training_notes.eval_mode_note(eval_mode)
    report = TrainingReport(
        loss=loss,
        optimizer=repr(opt),
        batch_norms=bn_count,
        frozen_batch_norms=frozen,
        parameters=len(selection.parameters),
        parameter_elements=int(sum(np.prod(initial[p].dims) for p in selection.parameters)),
        running_stats=len(selection.running_stats),
        optimizer_state=len(opt_state),
        forward_nodes=len(graph.node),
        training_nodes=len(result.graph.node),
        portable=portable,
        momentum=momentum_text,
        running_var=variance_text,
        weight_decay=groups.describe(hypers),
        training_mode_reset=training_mode_reset,
        notes=notes,
        seconds=time.perf_counter() - start,
        op_counts=counts,
    )
    return result, report


def _state_type(
    name: str, initial: Mapping[str, onnx.TensorProto], extra: Sequence[onnx.TensorProto]
) -> tuple[tuple[int, ...], int]:
    tensor = initial.get(name) or next(t for t in extra if t.name == name)
    return tuple(tensor.dims), tensor.data_type


def _skeleton(graph: onnx.GraphProto, state: set[str], detached: weights.Detached | None) -> onnx.GraphProto:
    """The inference graph without the values of state tensors (they come from training); other tensors with their
    values (a detached frozen weight's come back)."""
    skeleton = onnx.GraphProto()
    skeleton.CopyFrom(graph)
    keep = []
    for tensor in graph.initializer:
        if tensor.name in state:
            placeholder = onnx.TensorProto(name=tensor.name, data_type=tensor.data_type, dims=tensor.dims)
            keep.append(placeholder)
        else:
            keep.append(tensor)
    skeleton.ClearField("initializer")
    skeleton.initializer.extend(keep)
    if detached is not None:
        weights.materialize(skeleton.initializer, detached)
    return skeleton
