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

import os
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from bnfuse.attributes import float_attribute
from bnfuse.errors import BnfuseError
from bnfuse.io import check_model, load_model, ort_compatible
from bnfuse.passes.training import autodiff, bn, dynamic_batch, groups, prepare, running_stats, simplify, untie
from bnfuse.passes.training import dropout as dropout_ops
from bnfuse.passes.training import notes as training_notes
from bnfuse.passes.training import shapes as shape_ops
from bnfuse.passes.training.losses import LOSS_OUTPUT, build_loss
from bnfuse.passes.training.optimizers import ADAM_STEP, SGD, Adam, StepBuilder, parse_optimizer
from bnfuse.passes.training.spec import TrainingSpec, read_spec, set_spec, write_spec
from bnfuse.runtime.semantics import BatchNormConfig, MomentumConvention

LR_INPUT = "lr"
NEW_SUFFIX = ".new"


@dataclass
class TrainingReport:
    """What the training pass built."""

    loss: str
    optimizer: str
    batch_norms: int
    frozen_batch_norms: int
    parameters: int
    parameter_elements: int
    running_stats: int
    optimizer_state: int
    forward_nodes: int
    training_nodes: int
    portable: bool
    momentum: str
    running_var: str = "biased (batch variance)"
    weight_decay: str = "0"
    training_mode_reset: int = 0  # BN nodes exported in training mode, made inference nodes
    notes: list[str] = field(default_factory=list)  # what is frozen or left out, and why
    seconds: float = 0.0
    op_counts: dict[str, int] = field(default_factory=dict)
    batch: str = ""  # "dynamic (any size)" or "static N" (and why)

    def format_text(self) -> str:
        ops = ", ".join(f"{k} {v}" for k, v in sorted(self.op_counts.items(), key=lambda kv: -kv[1])[:8])
        return "\n".join(
            [
                f"training graph: {self.training_nodes} nodes (inference model: {self.forward_nodes})"
                + (" [portable: standard ONNX ops only]" if self.portable else " [bnfuse custom ops]"),
                f"  batch norms: {self.batch_norms} in training mode, {self.frozen_batch_norms} frozen"
                + (f", {self.training_mode_reset} exported in training mode (reset)" * bool(self.training_mode_reset)),
                *([f"  batch: {self.batch}"] if self.batch else []),
                f"  running statistics: momentum {self.momentum}; running variance {self.running_var}",
                f"  trainable: {self.parameters} tensors, {self.parameter_elements} values; "
                f"loss {self.loss}; optimizer {self.optimizer} ({self.optimizer_state} state tensors)",
                f"  weight decay: {self.weight_decay}",
                *(f"  note: {note}" for note in self.notes),
                f"  most used ops: {ops}",
                f"  built in {self.seconds:.2f} s",
            ]
        )


# The exporter (PyTorch's dynamo exporter by default) folded every BN away: training would silently train
# a BN-less network, so refuse and say how to export with BN kept (docs/exporting.md).
NO_BATCHNORM_MESSAGE = (
    "the model has no BatchNormalization (the exporter folded it): export with BN kept, e.g. "
    "torch.onnx.export(..., dynamo=True, optimize=False) or dynamo=False with "
    "training=torch.onnx.TrainingMode.PRESERVE, do_constant_folding=False (see docs/exporting.md)"
)


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
    """
    start = time.perf_counter()
    source = load_model(model) if not isinstance(model, onnx.ModelProto) else _copy(model)
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
    )
    if batch_size is not None and batch_size < 1:
        raise BnfuseError(f"batch size must be >= 1, got {batch_size}")
    result: onnx.ModelProto | None = None
    reports: list[TrainingReport] = []
    reason = ""
    relaxed = dynamic_batch.without_batch_sizes(source, {i.name for i in prepare.data_inputs(source)})
    if not static_batch:

        def probe(size: int) -> onnx.ModelProto:
            shapes = {name: [size, *list(dims)[1:]] for name, dims in (input_shapes or {}).items()}
            built, built_report = _build(relaxed, batch_size=size, input_shapes=shapes, **options)
            reports.append(built_report)
            return built

        try:
            result = dynamic_batch.dynamic_batch_graph(probe, lambda model: read_spec(model).data[0])
        except dynamic_batch.NotBatchPolymorphic as exc:
            reason = str(exc)
        except BnfuseError as exc:  # the model pins its batch size (a Reshape to [1, -1], ...): static if it builds
            reason = f"at another batch size: {exc}"
    report = reports[0] if result is not None else None
    if result is None or report is None:  # static: any batch size the model allows (the export's own without one)
        result, report = _build(
            source if batch_size is None else relaxed, batch_size=batch_size, input_shapes=input_shapes, **options
        )
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
    report.seconds = time.perf_counter() - start
    return result, report


def _build(
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
    start = time.perf_counter()
    source = _copy(source)
    opt = parse_optimizer(optimizer)
    stats_plan = running_stats.plan(source, momentum, momentum_convention, unbiased_running_var)
    if require_batchnorm and not any(
        n.op_type == "BatchNormalization" and n.domain in ("", "ai.onnx") for n in source.graph.node
    ):
        raise BnfuseError(NO_BATCHNORM_MESSAGE)
    if any(node.op_type in ("If", "Loop", "Scan") for node in source.graph.node):
        _reject_subgraph_bn(source.graph)
    source = prepare.upgrade_opset(source)
    if prepare.drop_initializer_inputs(source.graph):  # IR < 4 lists weights as inputs; IR 4 need not
        source.ir_version = max(source.ir_version, 4)
    training_mode_reset = prepare.reset_training_mode(source.graph)
    untied = untie.untie_parameters(source)  # every weight slot its own tensor (exporters merge equal ones)
    original_names = untied.renamed
    if fix_gamma:
        prepare.set_bn_scales_to_one(source)  # the exported model then computes what training did
    skeleton = _copy(source)  # the inference model as it will be exported (dynamic shapes kept)

    prepare.freeze_shapes(source, batch_size, input_shapes)
    shapes = prepare.infer_static_shapes(source)
    if shape_ops.fold_shape_computations(source, shapes):  # Shape -> ... -> Reshape / Slice / Resize: constants
        shapes = prepare.infer_static_shapes(source)
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
    nodes, bn_outputs, frozen, cumulative = _training_forward(graph, selection, fix_gamma, stats_plan)
    dropouts = _training_dropout(nodes, graph, shapes, dropout, dropout_seed)
    if fuse_relu and not portable:
        bn.fuse_relu(nodes, set(outputs))
    initial = {t.name: t for t in graph.initializer}
    constants = [t for t in graph.initializer if t.name not in state_names]
    if dropouts:
        constants.append(dropout_ops.flag_initializer())
    data = [i for i in prepare.data_inputs(source)]
    forward = helper.make_graph(
        nodes,
        graph.name or "bnfuse_training",
        data + [_info(initial[n]) for n in state_names],
        [helper.make_tensor_value_info(output, out_type, list(out_shape))],
        constants,
    )
    initializer_names = {t.name for t in graph.initializer}
    forward.value_info.extend(
        prepare.value_info(name, dims, elem) for name, (dims, elem) in shapes.items() if name not in initializer_names
    )
    for name, dims in bn_outputs.items():
        forward.value_info.append(prepare.value_info(name, dims))
    fmodel = helper.make_model(forward, opset_imports=_opsets(source))
    fmodel.ir_version = source.ir_version

    # 2. backward of the network from the output's adjoint
    adjoint = autodiff.reverse(fmodel, selection.parameters, output, weight_grad_op=not portable)
    g = adjoint.graph
    seed_input = autodiff.ADJOINT_PREFIX + output
    _drop(g.input, {seed_input})
    grad_outputs = {autodiff.ADJOINT_PREFIX + p: p for p in selection.parameters}
    _drop(g.output, set(grad_outputs) | {output})
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
        g.input.append(_info(state_inits[-1]))
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
    g.node.extend(_toposort(all_nodes, [i.name for i in g.input] + [t.name for t in g.initializer]))
    g.ClearField("value_info")
    result = helper.make_model(g, opset_imports=_opsets(source, custom=not portable))
    result.producer_name = "bnfuse train-graph"
    ort_compatible(result)
    simplify.drop_copying_expands(result, keep=[f"grad/{p}" for p in selection.parameters])
    _remove_unused_initializers(result.graph)

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
    skeleton_graph = _skeleton(skeleton.graph, set(state_names))
    write_spec(result, spec, skeleton_graph)
    check_model(result, what="training graph")

    counts: dict[str, int] = {}
    for node in result.graph.node:
        counts[node.op_type] = counts.get(node.op_type, 0) + 1
    bn_count = sum(1 for n in graph.node if n.op_type == "BatchNormalization")
    momentum_text, variance_text = stats_plan.describe(len(cumulative) // 2, bn_count)
    notes = training_notes.frozen_notes(source, selection, trainable is not None)
    notes += training_notes.dropout_notes(source, dropouts, dropout_seed)
    notes += untie.note(untied)
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


def _copy(model: onnx.ModelProto) -> onnx.ModelProto:
    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    return copy


def _reject_subgraph_bn(graph: onnx.GraphProto) -> None:
    for node in graph.node:
        for attr in node.attribute:
            if attr.type == onnx.AttributeProto.GRAPH and any(n.op_type == "BatchNormalization" for n in attr.g.node):
                raise BnfuseError(
                    f"BatchNormalization inside {node.op_type} {node.name!r} is not supported for training"
                )


def _training_forward(
    graph: onnx.GraphProto, selection: prepare.Selection, fix_gamma: bool, stats: running_stats.RunningStatsPlan
) -> tuple[list[onnx.NodeProto], dict[str, list[int]], int, dict[str, str]]:
    """The graph's nodes with BN in training mode; shapes of the new BN outputs; count of frozen BNs;
    running statistic -> its batch statistic, for the nodes keeping a cumulative average."""
    initial = {t.name: t for t in graph.initializer}
    frozen_keys = set(selection.frozen_bn)
    nodes: list[onnx.NodeProto] = []
    shapes: dict[str, list[int]] = {}
    frozen = 0
    cumulative: dict[str, str] = {}
    for node in graph.node:
        if node.op_type != "BatchNormalization" or node.domain not in ("", "ai.onnx"):
            nodes.append(node)
            continue
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        key = prepare.bn_key(node)
        m, conv, blend = stats.for_node(float_attribute(attrs, "momentum", 0.9))
        config = BatchNormConfig(
            epsilon=float_attribute(attrs, "epsilon", 1e-5),
            momentum=m,
            momentum_convention=conv,
            unbiased_running_var=stats.unbiased,
            fix_gamma=fix_gamma,
            use_global_stats=key in frozen_keys,
        )
        frozen += int(config.use_global_stats)
        x, scale, bias, mean, var = node.input[:5]
        stem = key.replace("/", "_")
        blend = blend and not config.use_global_stats  # a frozen BN's statistics stay, as in PyTorch's eval()
        suffix = ".batch_stat" if blend else NEW_SUFFIX  # blended into the running statistic after the node
        outs = [
            node.output[0],
            f"{mean}{suffix}",
            f"{var}{suffix}",
            f"{stem}.saved_mean",
            f"{stem}.saved_inv_std",
        ]
        if blend:
            cumulative.update({mean: outs[1], var: outs[2]})
        dims = list(initial[mean].dims)
        for name in outs[1:]:
            shapes[name] = dims
        nodes.append(bn.training_node([x, scale, bias, mean, var], outs, config, name=f"{key}.training"))
    return nodes, shapes, frozen, cumulative


def _training_dropout(
    nodes: list[onnx.NodeProto],
    graph: onnx.GraphProto,
    shapes: dict[str, tuple[tuple[int, ...], int]],
    mode: str,
    seed: int,
) -> int:
    """Dropout nodes in training mode (in place in ``nodes``, their masks' shapes added to ``shapes``); the count."""
    if mode not in ("train", "off"):
        raise BnfuseError(f"dropout must be 'train' or 'off', got {mode!r}")
    if mode == "off":
        return 0
    constants = dropout_ops.constants(graph)
    count = 0
    for index, node in enumerate(nodes):
        if node.op_type != "Dropout" or node.domain not in ("", "ai.onnx"):
            continue
        if dropout_ops.ratio_value(node, constants) is None:
            raise BnfuseError(
                f"Dropout {node.name or node.output[0]!r}: its ratio is not a constant; give dropout='off' "
                "(--dropout off) to train without dropout"
            )
        mask = f"{node.output[0]}.mask"
        nodes[index] = dropout_ops.training_dropout(node, seed + count, mask)
        shapes[mask] = (shapes[node.output[0]][0], TensorProto.BOOL)
        count += 1
    return count


def bn_outputs_by_input(nodes: Sequence[onnx.NodeProto]) -> dict[str, str]:
    """Running statistic input -> the BN output holding its update."""
    mapping: dict[str, str] = {}
    for node in nodes:
        if node.domain == bn.DOMAIN and node.op_type == bn.TRAINING:
            mapping[node.input[3]] = node.output[1]
            mapping[node.input[4]] = node.output[2]
    return mapping


def _info(tensor: onnx.TensorProto) -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(tensor.name, tensor.data_type, list(tensor.dims))


def _opsets(model: onnx.ModelProto, custom: bool = True) -> list[onnx.OperatorSetIdProto]:
    opsets = [o for o in model.opset_import if o.domain != bn.DOMAIN]
    if custom:
        opsets.append(helper.make_opsetid(bn.DOMAIN, 1))
    return opsets


def _drop(values, names: set[str]) -> None:  # noqa: ANN001 (a protobuf repeated field)
    keep = [v for v in values if v.name not in names]
    del values[:]
    values.extend(keep)


def _state_type(
    name: str, initial: Mapping[str, onnx.TensorProto], extra: Sequence[onnx.TensorProto]
) -> tuple[tuple[int, ...], int]:
    tensor = initial.get(name) or next(t for t in extra if t.name == name)
    return tuple(tensor.dims), tensor.data_type


def _toposort(nodes: Sequence[onnx.NodeProto], available: Sequence[str]) -> list[onnx.NodeProto]:
    """Nodes in an order where every input is produced before it is read (Kahn's algorithm)."""
    ready = set(available) | {""}
    producer = {out: i for i, node in enumerate(nodes) for out in node.output if out}
    waiting: dict[int, set[str]] = {}
    readers: dict[str, list[int]] = {}
    queue: list[int] = []
    for i, node in enumerate(nodes):
        missing = {name for name in node.input if name not in ready and name in producer}
        waiting[i] = missing
        for name in missing:
            readers.setdefault(name, []).append(i)
        if not missing:
            queue.append(i)
    order: list[onnx.NodeProto] = []
    while queue:
        i = queue.pop(0)
        order.append(nodes[i])
        for out in nodes[i].output:
            for j in readers.pop(out, []):
                waiting[j].discard(out)
                if not waiting[j]:
                    queue.append(j)
    if len(order) != len(nodes):
        raise BnfuseError("internal error: the training graph has a cycle")
    return order


def _remove_unused_initializers(graph: onnx.GraphProto) -> None:
    read = {name for node in graph.node for name in node.input} | {i.name for i in graph.input}
    keep = [t for t in graph.initializer if t.name in read]
    graph.ClearField("initializer")
    graph.initializer.extend(keep)


def _skeleton(graph: onnx.GraphProto, state: set[str]) -> onnx.GraphProto:
    """The inference graph without the values of state tensors (they come from training)."""
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
    return skeleton
