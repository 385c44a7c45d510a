"""Graphs for re-estimating BatchNormalization statistics (``bnfuse.recalibrate``), and writing them back.

``find_batch_norms(model)`` lists the top-level inference BatchNormalization nodes with their *stage*: how
many BatchNormalization nodes lie on the longest path upstream of the node's input. A node of stage d sees
statistics of stage < d only.

* ``update_bn_graph`` (mode update-bn): every BN becomes bnfuse's training-mode op
  (BatchNormalizationTraining, or SyncBatchNormalizationTraining across ranks) with momentum 1 in PyTorch's
  convention and the unbiased running variance, fed zero / one running statistics: its running-statistic
  outputs are then the batch mean and the unbiased batch variance, and its Y (normalized with the batch
  statistics) feeds the BNs downstream, as every BN of a PyTorch module in ``train()`` mode does.
* ``exact_graph`` (mode exact): the model with every BN's mean and variance as graph inputs (fed per run) and
  every BN input X as a graph output: a run fetching the inputs of stage d, with the statistics of stages < d
  fed, reads exactly what the recalibrated model computes in inference before those BNs.
* ``apply_statistics`` writes new statistics into a copy of the model; nothing else changes.

Only what leads to the fetched tensors is kept in either graph.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from bnfuse.errors import BnfuseError
from bnfuse.passes.training.prepare import producers_of, resolve_initializer
from bnfuse.runtime.ops import DOMAIN, TRAINING
from bnfuse.runtime.sync_ops import SYNC_TRAINING

STAT_PREFIX = "recalibrate"
TOKEN = f"{STAT_PREFIX}/token"
CONTROL_FLOW = ("If", "Loop", "Scan")


@dataclass(frozen=True)
class BatchNormSite:
    """One top-level BatchNormalization: its key (name, or first output), position in the graph's node list,
    input names, epsilon and stage."""

    key: str
    position: int
    x: str
    scale: str
    bias: str
    mean: str
    var: str
    epsilon: float
    stage: int


def _is_bn(node: onnx.NodeProto) -> bool:
    return node.op_type == "BatchNormalization" and node.domain in ("", "ai.onnx")


def _subgraph_bn(node: onnx.NodeProto) -> str | None:
    """The key of a BatchNormalization inside ``node``'s subgraphs (If / Loop / Scan bodies), or None."""
    for attribute in node.attribute:
        graphs = [attribute.g] if attribute.type == onnx.AttributeProto.GRAPH else list(attribute.graphs)
        for graph in graphs:
            for inner in graph.node:
                if _is_bn(inner):
                    return inner.name or inner.output[0]
                found = _subgraph_bn(inner)
                if found is not None:
                    return found
    return None


def _attribute(node: onnx.NodeProto, name: str, default: object) -> object:
    for attribute in node.attribute:
        if attribute.name == name:
            return helper.get_attribute_value(attribute)
    return default


def find_batch_norms(model: onnx.ModelProto) -> list[BatchNormSite]:
    """Every top-level inference BatchNormalization in graph order, with its stage; BnfuseError (one line) for a
    model recalibration cannot serve: no BN left, a BN inside a control-flow body or a function, a BN in
    training mode or per-activation (spatial=0), or data other than float32."""
    graph = model.graph
    for node in graph.node:
        inner = _subgraph_bn(node)
        if inner is not None:
            raise BnfuseError(
                f"BatchNormalization {inner!r} is inside the body of {node.op_type} {node.name or node.output[0]!r}: "
                "recalibration runs top-level BatchNormalization only"
            )
    for function in model.functions:
        if any(_is_bn(n) for n in function.node):
            raise BnfuseError(f"BatchNormalization inside the function {function.name!r}: inline it first")
    stage_of: dict[str, int] = {}  # tensor -> number of BNs on the longest path to it
    sites: list[BatchNormSite] = []
    for position, node in enumerate(graph.node):  # ONNX keeps nodes in topological order
        stage = max((stage_of.get(name, 0) for name in node.input if name), default=0)
        if _is_bn(node):
            key = node.name or node.output[0]
            if len(node.input) < 5:
                raise BnfuseError(f"BatchNormalization {key!r} has fewer than 5 inputs")
            if _attribute(node, "training_mode", 0):
                raise BnfuseError(
                    f"BatchNormalization {key!r} is in training mode (training_mode=1): export the model in eval() "
                    "mode, or run `bnfuse optimize` first, which resets it"
                )
            if not _attribute(node, "spatial", 1):
                raise BnfuseError(f"BatchNormalization {key!r} is per-activation (spatial=0): not supported")
            x, scale, bias, mean, var = node.input[:5]
            epsilon = float(_attribute(node, "epsilon", 1e-5))  # type: ignore[arg-type]
            sites.append(BatchNormSite(key, position, x, scale, bias, mean, var, epsilon, stage))
            stage += 1
        for name in node.output:
            if name:
                stage_of[name] = stage
    if not sites:
        raise BnfuseError(
            "the model has no BatchNormalization left (folded already?): recalibrate before folding "
            "(bnfuse recalibrate ... --fold does both)"
        )
    _require_float32(model, sites)
    return sites


def _require_float32(model: onnx.ModelProto, sites: Sequence[BatchNormSite]) -> None:
    """bnfuse's training-mode ops run float32 data with float32 statistics here."""
    types = {t.name: t.data_type for t in model.graph.initializer}
    types.update({v.name: v.type.tensor_type.elem_type for v in model.graph.input})
    for site in sites:
        kind = types.get(site.scale) or types.get(site.mean)
        if kind is not None and kind != TensorProto.FLOAT:
            name = TensorProto.DataType.Name(kind).lower()
            raise BnfuseError(f"BatchNormalization {site.key!r} has {name} parameters: recalibration needs float32")


def stages(sites: Sequence[BatchNormSite]) -> list[list[BatchNormSite]]:
    """The sites grouped by stage, in stage order (each stage's BNs are recalibrated in one pass)."""
    grouped: dict[int, list[BatchNormSite]] = {}
    for site in sites:
        grouped.setdefault(site.stage, []).append(site)
    return [grouped[stage] for stage in sorted(grouped)]


def stat_names(index: int) -> tuple[str, str]:
    """Graph outputs of site ``index`` in the update-bn graph: (batch mean, unbiased batch variance)."""
    return f"{STAT_PREFIX}/{index}/mean", f"{STAT_PREFIX}/{index}/var"


def feed_names(index: int) -> tuple[str, str]:
    """Graph inputs of site ``index`` in the exact graph: (mean, variance) its BN normalizes with."""
    return f"{STAT_PREFIX}/{index}/mean_in", f"{STAT_PREFIX}/{index}/var_in"


def _copy(model: onnx.ModelProto) -> onnx.ModelProto:
    result = onnx.ModelProto()
    result.CopyFrom(model)
    return result


def _value(name: str) -> onnx.ValueInfoProto:
    kind = TensorProto.INT64 if name.startswith(TOKEN) else TensorProto.FLOAT
    return helper.make_tensor_value_info(name, kind, None)


def _keep_needed(graph: onnx.GraphProto, outputs: Sequence[str]) -> None:
    """Set the graph outputs to ``outputs`` and drop every node and initializer they do not need (in place)."""
    needed = set(outputs)
    kept: list[onnx.NodeProto] = []
    for node in reversed(graph.node):
        if any(name in needed for name in node.output if name):
            kept.append(node)
            needed.update(name for name in node.input if name)
            for attribute in node.attribute:  # names a control-flow body reads from the outer graph
                for body in [attribute.g] if attribute.type == onnx.AttributeProto.GRAPH else attribute.graphs:
                    needed.update(name for inner in body.node for name in inner.input if name)
    graph.ClearField("node")
    graph.node.extend(reversed(kept))
    initializers = {t.name for t in graph.initializer}
    keep = [t for t in graph.initializer if t.name in needed]
    graph.ClearField("initializer")
    graph.initializer.extend(keep)
    inputs = [v for v in graph.input if v.name in needed or v.name not in initializers]  # data inputs stay fed
    del graph.input[:]
    graph.input.extend(inputs)
    del graph.output[:]
    graph.output.extend(_value(name) for name in outputs)


def update_bn_graph(model: onnx.ModelProto, sites: Sequence[BatchNormSite], *, synchronized: bool) -> onnx.ModelProto:
    """The model with every BN in training mode, its batch mean and unbiased batch variance as graph outputs
    ``stat_names(i)`` (float32). ``synchronized``: the ops take their statistics over every rank's samples."""
    result = _copy(model)
    graph = result.graph
    by_position = {site.position: index for index, site in enumerate(sites)}
    nodes: list[onnx.NodeProto] = []
    outputs: list[str] = []
    for position, node in enumerate(graph.node):
        if position not in by_position:
            nodes.append(node)
            continue
        index = by_position[position]
        site = sites[index]
        mean, var = stat_names(index)
        stem = f"{STAT_PREFIX}/{index}"
        # running statistics 0 and 1 (PyTorch's reset_running_stats), shaped like the scale
        nodes.append(helper.make_node("Shape", [site.scale], [f"{stem}/shape"]))
        for value, name in ((0.0, "zeros"), (1.0, "ones")):
            tensor = numpy_helper.from_array(np.array([value], np.float32), "")
            nodes.append(helper.make_node("ConstantOfShape", [f"{stem}/shape"], [f"{stem}/{name}"], value=tensor))
        inputs = [site.x, site.scale, site.bias, f"{stem}/zeros", f"{stem}/ones"]
        outs = [node.output[0], mean, var, f"{stem}/saved_mean", f"{stem}/saved_inv_std"]  # not fetched
        attributes = {
            "epsilon": site.epsilon,
            "momentum": 1.0,  # running = batch statistic
            "momentum_convention": "pytorch",
            "unbiased_running_var": 1,
        }
        if synchronized:
            inputs.append(f"{TOKEN}{index}")
            outs.append(f"{TOKEN}{index + 1}")
        op = SYNC_TRAINING if synchronized else TRAINING
        nodes.append(helper.make_node(op, inputs, outs, name=f"{stem}/{site.key}", domain=DOMAIN, **attributes))
        outputs += [mean, var]
    graph.ClearField("node")
    graph.node.extend(nodes)
    if synchronized:  # the collectives chained in graph order: every rank issues them in one order
        graph.initializer.append(numpy_helper.from_array(np.array([0], np.int64), f"{TOKEN}0"))
        outputs.append(f"{TOKEN}{len(sites)}")
    _keep_needed(graph, outputs)
    if not any(o.domain == DOMAIN for o in result.opset_import):
        result.opset_import.append(helper.make_opsetid(DOMAIN, 1))
    return result


def exact_graph(model: onnx.ModelProto, sites: Sequence[BatchNormSite]) -> onnx.ModelProto:
    """The model in inference, each BN's statistics the graph inputs ``feed_names(i)`` and each BN input X a
    graph output (fetch those of one stage). The inputs default to the model's own statistics (initializers
    behind them), so a run feeds only those of the stages before the one it fetches."""
    result = _copy(model)
    graph = result.graph
    original = statistics_of(model, sites)
    for index, site in enumerate(sites):
        node = graph.node[site.position]
        for slot, name, value in zip((3, 4), feed_names(index), original[index], strict=True):
            node.input[slot] = name
            graph.input.append(_value(name))
            graph.initializer.append(numpy_helper.from_array(value.astype(np.float32), name))
    _keep_needed(graph, list(dict.fromkeys(site.x for site in sites)))
    return result


def statistics_of(model: onnx.ModelProto, sites: Sequence[BatchNormSite]) -> list[tuple[np.ndarray, np.ndarray]]:
    """Each BN's (mean, variance) in the model, float64: initializers, directly or through Identity."""
    initializers = {t.name: t for t in model.graph.initializer}
    producers = producers_of(model.graph)
    result = []
    for site in sites:
        pair = []
        for role, name in (("mean", site.mean), ("variance", site.var)):
            source = resolve_initializer(name, producers, initializers)
            if source is None:
                raise BnfuseError(
                    f"BatchNormalization {site.key!r}: its {role} {name!r} is computed in the graph, not an "
                    "initializer: nothing to recalibrate"
                )
            pair.append(numpy_helper.to_array(initializers[source]).astype(np.float64))
        result.append((pair[0], pair[1]))
    return result


def apply_statistics(
    model: onnx.ModelProto, sites: Sequence[BatchNormSite], statistics: Sequence[tuple[np.ndarray, np.ndarray]]
) -> tuple[onnx.ModelProto, list[str]]:
    """A copy of ``model`` with each BN's (mean, variance) from ``statistics`` (float64, in the order of
    ``sites``), stored in the statistic's own type. An initializer read by that BN alone is overwritten; a
    statistic shared with another node, reached through a node (Identity) or that is a graph input or output
    gets a new initializer ``<name>.recalibrated`` for this BN. Returns (model, names of the new initializers)."""
    result = _copy(model)
    graph = result.graph
    readers: dict[str, int] = {}
    for node in graph.node:
        names = [*node.input]
        for attribute in node.attribute:
            for body in [attribute.g] if attribute.type == onnx.AttributeProto.GRAPH else attribute.graphs:
                names += [name for inner in body.node for name in inner.input]
        for name in names:
            readers[name] = readers.get(name, 0) + 1
    exposed = {v.name for v in graph.input} | {v.name for v in graph.output}
    index = {t.name: i for i, t in enumerate(graph.initializer)}
    taken = set(index) | {name for node in graph.node for name in node.output} | exposed
    created: list[str] = []
    for site, values in zip(sites, statistics, strict=True):
        node = graph.node[site.position]
        for slot, value in zip((3, 4), values, strict=True):
            name = node.input[slot]
            if name in index and readers.get(name) == 1 and name not in exposed:
                tensor = graph.initializer[index[name]]
                if tuple(tensor.dims) != value.shape:
                    raise BnfuseError(
                        f"BatchNormalization {site.key!r}: {name!r} has shape {list(tensor.dims)}, the data gives "
                        f"{value.shape[0]} channels"
                    )
                dtype = helper.tensor_dtype_to_np_dtype(tensor.data_type)
                tensor.CopyFrom(numpy_helper.from_array(np.asarray(value).astype(dtype), name))
                continue
            fresh, k = f"{name}.recalibrated", 0
            while fresh in taken:
                k += 1
                fresh = f"{name}.recalibrated.{k}"
            taken.add(fresh)
            graph.initializer.append(numpy_helper.from_array(np.asarray(value).astype(np.float32), fresh))
            node.input[slot] = fresh
            created.append(fresh)
    return result, created
