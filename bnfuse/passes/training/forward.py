"""The inference graph's nodes in training mode: BatchNormalization as bnfuse.BatchNormalizationTraining (batch
statistics, running-statistics updates as outputs) and Dropout dropping, for the training pass (assemble.py)."""

from __future__ import annotations

from collections.abc import Sequence

import onnx
from onnx import TensorProto, helper

from bnfuse.attributes import float_attribute
from bnfuse.errors import BnfuseError
from bnfuse.passes.training import bn, prepare, running_stats
from bnfuse.passes.training import dropout as dropout_ops
from bnfuse.runtime.semantics import BatchNormConfig

NEW_SUFFIX = ".new"  # a state tensor's updated value: the output "<name>.new"


def reject_subgraph_bn(graph: onnx.GraphProto) -> None:
    for node in graph.node:
        for attr in node.attribute:
            if attr.type == onnx.AttributeProto.GRAPH and any(n.op_type == "BatchNormalization" for n in attr.g.node):
                raise BnfuseError(
                    f"BatchNormalization inside {node.op_type} {node.name!r} is not supported for training"
                )


def training_forward(
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


def training_dropout(
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
