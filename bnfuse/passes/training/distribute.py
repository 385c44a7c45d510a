"""The data-parallel pass: training graph -> the same step for one rank of many (synchronized BN, global gradient).

``distribute_training_graph(model) -> (model, DistributeReport)`` rewrites a graph built by
``build_training_graph`` (with bnfuse's custom ops, not ``portable``):

* every BatchNormalizationTraining / BatchNormalizationGrad in batch-statistics mode becomes its synchronized op
  (statistics over every rank's samples; dScale / dBias stay local); the synchronized ops have no fused
  activation, so a fused ReLU is split off again first (a Relu after the forward op; dY masked by
  Greater / Cast / Mul before the grad op, as the unfused graph computes it);
* the loss is normalized by the global sample count (the local count all-reduced in the graph), so a rank's
  gradient is its share of the global mean's gradient and their sum is the exact global gradient, whatever
  each rank's batch;
* the parameter gradients are all-reduced (summed) before the optimizer step, in one bucket (their flattened
  concatenation: one collective, not one per tensor), and so is the reported loss;
* every collective node is chained to the previous one through an int64 token (in one topological order of the
  graph), so no scheduler can issue them in a different order on two ranks.

The chain order is recorded in the model's metadata (``bnfuse.distributed``): the collective schedule every rank
compares at start-up. On one rank the graph computes what the original graph computes.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from bnfuse.errors import BnfuseError
from bnfuse.passes.training.graph_edit import dead_nodes, toposort
from bnfuse.passes.training.spec import read_spec
from bnfuse.runtime.ops import DOMAIN, GRAD, TRAINING
from bnfuse.runtime.sync_ops import ALL_REDUCE, SYNC_GRAD, SYNC_TRAINING

SCHEDULE_KEY = "bnfuse.distributed"
DROPOUT_RANK_STRIDE = 1_000_003  # rank r's Dropout seeds: the graph's + r * this (distinct for < 1M Dropout nodes)
TOKEN_PREFIX = "dist/token"
COLLECTIVES = (SYNC_TRAINING, SYNC_GRAD, ALL_REDUCE)


@dataclass
class DistributeReport:
    """What the data-parallel pass changed."""

    synced_batch_norms: int
    synced_batch_norm_grads: int
    gradients: int  # tensors, summed by one all-reduce of their concatenation
    gradient_values: int
    collectives: int

    def format_text(self) -> str:
        return (
            f"distributed: {self.synced_batch_norms} synchronized BN forward, {self.synced_batch_norm_grads} "
            f"backward; {self.gradients} gradients ({self.gradient_values} values) summed by one all-reduce; "
            f"{self.collectives} collectives chained in one order"
        )


def is_distributed(model: onnx.ModelProto) -> bool:
    return any(p.key == SCHEDULE_KEY for p in model.metadata_props)


def collective_schedule(model: onnx.ModelProto) -> list[str]:
    """The collective nodes' names in the order every rank issues them."""
    for prop in model.metadata_props:
        if prop.key == SCHEDULE_KEY:
            return list(json.loads(prop.value)["schedule"])
    raise BnfuseError("not a distributed training graph (build it with `bnfuse train-graph --distributed`)")


def distribute_training_graph(model: onnx.ModelProto) -> tuple[onnx.ModelProto, DistributeReport]:
    spec = read_spec(model)
    if is_distributed(model):
        raise BnfuseError("the training graph is already distributed")
    result = onnx.ModelProto()
    result.CopyFrom(model)
    graph = result.graph
    if not any(n.domain == DOMAIN for n in graph.node):
        raise BnfuseError("a distributed training graph needs bnfuse's custom ops: build it without --portable")
    nodes: list[onnx.NodeProto] = []
    inits: list[onnx.TensorProto] = []
    synced = {TRAINING: 0, GRAD: 0}
    consumed = {name for node in graph.node for name in node.input} | {o.name for o in graph.output}
    gradients = {f"grad/{p}" for p in spec.parameters}
    source_nodes = []
    for original in graph.node:  # copies: the graph's node list is rebuilt below
        source_nodes.append(onnx.NodeProto())
        source_nodes[-1].CopyFrom(original)
    for node in source_nodes:
        if node.domain == DOMAIN and node.op_type in synced and not _attr(node, "use_global_stats"):
            nodes += _unfuse_activation(node, inits)
            if node.op_type == TRAINING and len(node.output) > 5:
                if node.output[5] and node.output[5] in consumed:
                    raise BnfuseError(f"BN node {node.name!r}: its batch_var output has no synchronized form")
                del node.output[5:]
            synced[node.op_type] += 1
            node.op_type = SYNC_TRAINING if node.op_type == TRAINING else SYNC_GRAD
        for index, name in enumerate(node.output):
            if name in gradients or name == spec.loss:  # all-reduced below: the node now writes the local value
                node.output[index] = f"{name}.local"
                if name == spec.loss:
                    nodes.append(_all_reduce(f"{name}.local", name))
        nodes.append(node)
    local = {o for n in nodes for o in n.output}
    if any(f"{g}.local" not in local for g in gradients):
        raise BnfuseError("training graph has no gradient tensor grad/<parameter> for every parameter")
    sizes = {t.name: list(t.dims) for t in graph.initializer}
    nodes += _gradient_bucket([(f"grad/{p}", sizes[p]) for p in spec.parameters], inits)
    nodes += _global_normalization(graph, nodes, spec.loss_kind, spec.targets[0], inits)

    available = [i.name for i in graph.input] + [t.name for t in graph.initializer] + [t.name for t in inits]
    ordered = toposort(nodes, [*available, f"{TOKEN_PREFIX}0"])
    schedule = []
    for node in ordered:
        if node.domain == DOMAIN and node.op_type in COLLECTIVES:
            if not node.name:
                node.name = f"dist/{node.op_type}/{len(schedule)}"
            node.input.append(f"{TOKEN_PREFIX}{len(schedule)}")
            node.output.append(f"{TOKEN_PREFIX}{len(schedule) + 1}")
            schedule.append(node.name)
    inits.append(numpy_helper.from_array(np.array([0], np.int64), f"{TOKEN_PREFIX}0"))
    graph.ClearField("node")
    graph.node.extend(ordered)
    graph.initializer.extend(inits)
    entry = result.metadata_props.add()
    entry.key, entry.value = SCHEDULE_KEY, json.dumps({"schedule": schedule})
    report = DistributeReport(
        synced_batch_norms=synced[TRAINING],
        synced_batch_norm_grads=synced[GRAD],
        gradients=len(gradients),
        gradient_values=sum(int(np.prod(t.dims)) for t in graph.initializer if f"grad/{t.name}" in gradients),
        collectives=len(schedule),
    )
    return result, report


def seed_dropout_for_rank(model: onnx.ModelProto, rank: int) -> int:
    """Give rank ``rank`` its own Dropout masks: each training-mode Dropout's seed + rank * DROPOUT_RANK_STRIDE
    (rank 0 keeps the graph's seeds, so one rank draws what the plain graph draws). Every rank seeded alike would
    drop the same units of its samples at every step. Changes ``model`` in place; returns the count."""
    from bnfuse.passes.training.dropout import is_training

    count = 0
    for node in model.graph.node:
        if not is_training(node):
            continue
        for attribute in node.attribute:
            if attribute.name == "seed":
                attribute.i += rank * DROPOUT_RANK_STRIDE
                count += 1
    return count


def _unfuse_activation(node: onnx.NodeProto, inits: list[onnx.TensorProto]) -> list[onnx.NodeProto]:
    """Drop ``node``'s activation "relu" (a bnfuse BN training or grad node); returns the standard nodes that now
    compute it: Relu of the BN output (forward, after the node), or dY * Cast(Y > 0) (grad, before it)."""
    fused = [a for a in node.attribute if a.name == "activation"]
    if not fused or helper.get_attribute_value(fused[0]) in (b"none", "none"):
        return []
    node.attribute.remove(fused[0])
    stem = node.name or node.output[0]
    if node.op_type == TRAINING:
        activated = node.output[0]
        node.output[0] = f"{activated}.bn"
        return [helper.make_node("Relu", [node.output[0]], [activated], name=f"{stem}/relu")]
    dy, y = node.input[0], node.input[5]
    del node.input[5:]
    zero = f"{stem}/relu_zero"
    if not any(t.name == zero for t in inits):
        inits.append(numpy_helper.from_array(np.array(0.0, np.float32), zero))  # the training graphs are float32
    node.input[0] = f"{stem}/relu_dY"
    return [
        helper.make_node("Greater", [y, zero], [f"{stem}/relu_positive"], name=f"{stem}/relu_positive"),
        helper.make_node("Cast", [f"{stem}/relu_positive"], [f"{stem}/relu_mask"], to=TensorProto.FLOAT),
        helper.make_node("Mul", [dy, f"{stem}/relu_mask"], [node.input[0]], name=f"{stem}/relu_grad"),
    ]


def _attr(node: onnx.NodeProto, name: str) -> int:
    return next((int(helper.get_attribute_value(a)) for a in node.attribute if a.name == name), 0)


def _gradient_bucket(gradients: list[tuple[str, list[int]]], inits: list[onnx.TensorProto]) -> list[onnx.NodeProto]:
    """One all-reduce for every gradient: flatten, concatenate, sum over the ranks, split, reshape back.

    One collective instead of one per tensor (161 for ResNet-50): each costs a latency, and on a loaded machine
    a descheduled partner; the two copies of the gradients cost less."""
    n = helper.make_node
    inits.append(numpy_helper.from_array(np.array([-1], np.int64), "dist/flat"))
    counts = [int(np.prod(shape)) for _, shape in gradients]
    inits.append(numpy_helper.from_array(np.array(counts, np.int64), "dist/grad_sizes"))
    nodes = [n("Reshape", [f"{g}.local", "dist/flat"], [f"{g}.flat"]) for g, _ in gradients]
    nodes.append(n("Concat", [f"{g}.flat" for g, _ in gradients], ["dist/grads.local"], axis=0))
    nodes.append(_all_reduce("dist/grads.local", "dist/grads"))
    nodes.append(n("Split", ["dist/grads", "dist/grad_sizes"], [f"{g}.sum" for g, _ in gradients], axis=0))
    for gradient, shape in gradients:
        inits.append(numpy_helper.from_array(np.array(shape, np.int64), f"{gradient}.dist_shape"))
        nodes.append(n("Reshape", [f"{gradient}.sum", f"{gradient}.dist_shape"], [gradient]))
    return nodes


def _all_reduce(source: str, target: str) -> onnx.NodeProto:
    return helper.make_node(ALL_REDUCE, [source], [target], name=f"dist/allreduce/{target}", domain=DOMAIN)


def _global_normalization(
    graph: onnx.GraphProto, nodes: list[onnx.NodeProto], loss_kind: str, target: str, inits: list[onnx.TensorProto]
) -> list[onnx.NodeProto]:
    """Nodes replacing the loss's 1 / local-count constants by 1 / global count (the local count all-reduced)."""
    if loss_kind == "seed":  # the gradient is given: nothing is averaged over the batch
        return []
    n = helper.make_node
    added = [
        n("Size", [target], ["dist/count.scalar"]),
        n("Reshape", ["dist/count.scalar", "dist/shape1"], ["dist/count.local"]),
        _all_reduce("dist/count.local", "dist/count"),
        n("Cast", ["dist/count"], ["dist/count.f64"], to=TensorProto.DOUBLE),
        n("Reciprocal", ["dist/count.f64"], ["dist/inv.f64"]),
        n("Cast", ["dist/inv.f64"], ["dist/inv1"], to=TensorProto.FLOAT),
        n("Reshape", ["dist/inv1", "dist/shape0"], ["dist/inv"]),
    ]
    inits += [
        numpy_helper.from_array(np.array([1], np.int64), "dist/shape1"),
        numpy_helper.from_array(np.zeros(0, np.int64), "dist/shape0"),
    ]
    names = {t.name for t in graph.initializer}
    if loss_kind == "cross-entropy":  # loss = -sum(picked) / count, grad = residual / count
        replaced = {"loss/neg_inv_batch", "loss/inv_batch"}
        added += [n("Neg", ["dist/inv"], ["loss/neg_inv_batch"]), n("Identity", ["dist/inv"], ["loss/inv_batch"])]
    elif loss_kind == "mse":  # loss = sum(sq) / numel, grad = diff * 2 / numel
        replaced = {"loss/scale"}
        inits.append(numpy_helper.from_array(np.array(2.0, np.float32), "dist/two"))
        added.append(n("Mul", ["dist/inv", "dist/two"], ["loss/scale"]))
        for node in nodes:
            if node.op_type == "ReduceMean" and node.input[0] == "loss/sq":
                written, node.op_type, node.output[0] = node.output[0], "ReduceSum", "dist/loss.sum"
                added.append(n("Mul", ["dist/loss.sum", "dist/inv"], [written]))
    else:
        raise BnfuseError(f"no distributed form for loss {loss_kind!r}")
    computed = {o for node in nodes for o in node.output if o in replaced}  # a dynamic batch computes them
    if not replaced <= names | computed:
        raise BnfuseError(f"training graph lacks the loss constants {', '.join(sorted(replaced - names - computed))}")
    dropped = [node for node in nodes if set(node.output) & computed]
    nodes[:] = [node for node in nodes if not set(node.output) & computed]
    # what only fed the dropped nodes (a dynamic graph's local-count chain) goes too, with the initializers it read
    dead, orphans = dead_nodes(
        nodes, {o.name for o in graph.output}, readers=added, suspects=[n for node in dropped for n in node.input]
    )
    nodes[:] = [node for i, node in enumerate(nodes) if i not in dead]
    keep = [t for t in graph.initializer if t.name not in replaced | orphans]
    graph.ClearField("initializer")
    graph.initializer.extend(keep)
    return added
