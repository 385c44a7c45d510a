"""Preparing an inference model for training: opset, per-BN parameters, static shapes, trainable set.

Everything here works on a copy; the caller's model is never modified.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper, shape_inference, version_converter

from bnfuse.errors import BnfuseError, ModelError
from bnfuse.passes.training import pool_sizes
from bnfuse.passes.training.graph_edit import dead_nodes

MIN_OPSET = 18  # ReduceMean / ReduceSum with axes as an input, as the loss and the portable BN use
# (op type, input positions) whose initializers are trainable by default.
WEIGHT_POSITIONS: dict[str, tuple[int, ...]] = {
    "Conv": (1, 2),
    "ConvTranspose": (1, 2),
    "Gemm": (0, 1, 2),
    "MatMul": (0, 1),
    "BatchNormalization": (1, 2),
    "PRelu": (1,),
    "LayerNormalization": (1, 2),
    "InstanceNormalization": (1, 2),
}


def default_opset(model: onnx.ModelProto) -> int:
    return max([o.version for o in model.opset_import if o.domain in ("", "ai.onnx")] or [0])


def upgrade_opset(model: onnx.ModelProto) -> onnx.ModelProto:
    """The model at opset >= 18 (onnx's version converter) so every emitted op has one spelling."""
    opset = default_opset(model)
    if opset >= MIN_OPSET:
        return model
    if opset < 9:
        raise ModelError(f"opset {opset} is too old for training graphs (need >= 9)")
    try:
        return version_converter.convert_version(model, MIN_OPSET)
    except Exception as exc:
        raise ModelError(f"cannot convert the model from opset {opset} to {MIN_OPSET}: {exc}") from exc


def drop_initializer_inputs(graph: onnx.GraphProto) -> int:
    """Remove graph inputs that are also initializers (in place): IR < 4 models (older zoos) list every weight as
    an input too. Training treats them as the weights they are; returns how many were dropped."""
    initializers = {t.name for t in graph.initializer}
    keep = [i for i in graph.input if i.name not in initializers]
    dropped = len(graph.input) - len(keep)
    if dropped:
        del graph.input[:]
        graph.input.extend(keep)
    return dropped


def producers_of(graph: onnx.GraphProto) -> dict[str, onnx.NodeProto]:
    return {out: node for node in graph.node for out in node.output if out}


# Ops that only move or relabel a tensor's values: a weight reached through them is still that initializer
# (tf2onnx feeds depthwise kernels to Conv through Reshape -> Transpose), and it trains through them.
SHAPE_ONLY = ("Identity", "Reshape", "Transpose", "Squeeze", "Unsqueeze", "Flatten")
TRAINABLE_TYPES = (TensorProto.FLOAT, TensorProto.DOUBLE)  # a float64 model trains in float64 (oracle checks)


def resolve_initializer(
    name: str,
    producers: Mapping[str, onnx.NodeProto],
    initializers: Mapping[str, onnx.TensorProto],
    through: Sequence[str] = ("Identity",),
) -> str | None:
    """The initializer a tensor is (through ``through`` ops: Identity by default), or None."""
    seen = 0
    while name not in initializers:
        node = producers.get(name)
        if node is None or node.op_type not in through or node.domain not in ("", "ai.onnx") or seen > 64:
            return None
        name, seen = node.input[0], seen + 1
    return name


def reset_training_mode(graph: onnx.GraphProto) -> int:
    """Turn BatchNormalization(training_mode=1) nodes into inference ones (in place); returns how many.

    A model exported with ``net.train()`` / ``TrainingMode.TRAINING`` keeps batch statistics in its BN nodes:
    trained or exported back, it must normalize with the running statistics as PyTorch's ``eval()`` does. Its
    running-statistic outputs (inference BN has none) become copies of the inputs where anything reads them.
    Dropout nodes lose their training_mode input likewise (not counted).
    """
    read = {name for node in graph.node for name in node.input} | {o.name for o in graph.output}
    count = 0
    nodes: list[onnx.NodeProto] = []
    for node in graph.node:
        nodes.append(node)
        if node.op_type == "Dropout" and len(node.input) > 2:  # its training_mode input: inference drops nothing
            del node.input[2:]
            continue
        if node.op_type != "BatchNormalization" or node.domain not in ("", "ai.onnx"):
            continue
        mode = next((a for a in node.attribute if a.name == "training_mode"), None)
        if mode is None or mode.i == 0:
            continue
        count += 1
        node.attribute.remove(mode)
        extra = list(node.output[1:])
        del node.output[1:]
        for statistic, name in zip(node.input[3:5], extra, strict=False):
            if name and name in read:  # inference: the running statistics pass through unchanged
                nodes.append(helper.make_node("Identity", [statistic], [name], name=f"{name}.inference"))
    if len(nodes) != len(graph.node):
        graph.ClearField("node")
        graph.node.extend(nodes)
    return count


def eval_mode_batch_norms(graph: onnx.GraphProto) -> list[str]:
    """Keys of the inference-mode BN nodes of a graph that also has training-mode ones: PyTorch's TorchScript exporter
    with ``TrainingMode.PRESERVE`` writes a module in ``train()`` with training_mode=1 on its BN, and a BN the user
    put in ``eval()`` inside it (a frozen BN: running statistics, no update) without. Empty for a graph exported all
    in one mode (nothing says which BN PyTorch would freeze: ``frozen_bn`` names them)."""
    bns = [n for n in graph.node if n.op_type == "BatchNormalization" and n.domain in ("", "ai.onnx")]

    def training(node: onnx.NodeProto) -> bool:
        return any(a.name == "training_mode" and a.i for a in node.attribute)

    if not any(training(n) for n in bns):
        return []
    return [bn_key(n) for n in bns if not training(n)]


def with_frozen(frozen_bn: bool | Sequence[str], more: Sequence[str]) -> bool | list[str]:
    """``frozen_bn`` with the BN keys ``more`` frozen too."""
    if frozen_bn is True or not more:
        return frozen_bn
    given = [] if frozen_bn is False else list(frozen_bn)
    return given + [key for key in more if key not in given]


def remove_dead(graph: onnx.GraphProto) -> None:
    """Drop nodes and initializers nothing reads any more (Identity chains left by untying)."""
    outputs = {o.name for o in graph.output}
    dead, _ = dead_nodes(graph.node, outputs)
    for i in sorted(dead, reverse=True):
        del graph.node[i]
    read = {name for node in graph.node for name in node.input} | outputs
    keep = [t for t in graph.initializer if t.name in read]
    graph.ClearField("initializer")
    graph.initializer.extend(keep)


def data_inputs(model: onnx.ModelProto) -> list[onnx.ValueInfoProto]:
    initializers = {t.name for t in model.graph.initializer}
    return [i for i in model.graph.input if i.name not in initializers]


def freeze_shapes(
    model: onnx.ModelProto, batch_size: int | None, input_shapes: Mapping[str, Sequence[int]] | None
) -> None:
    """Make every data input's shape static (in place): training graphs need static shapes."""
    shapes = dict(input_shapes or {})
    names = {i.name for i in data_inputs(model)}
    unknown = set(shapes) - names
    if unknown:
        raise BnfuseError(f"--input-shape names no data input: {', '.join(sorted(unknown))}")
    for value in data_inputs(model):
        dims = value.type.tensor_type.shape.dim
        if value.name in shapes:
            wanted = list(shapes[value.name])
            if len(wanted) != len(dims):
                raise BnfuseError(f"input {value.name!r} has rank {len(dims)}, shape {wanted} given")
            for dim, size in zip(dims, wanted, strict=True):
                dim.Clear()
                dim.dim_value = int(size)
            continue
        for axis, dim in enumerate(dims):
            if dim.HasField("dim_value") and dim.dim_value > 0:
                if axis == 0 and batch_size is not None and dim.dim_value != batch_size:
                    dim.dim_value = int(batch_size)
                continue
            if axis == 0 and batch_size is not None:
                dim.Clear()
                dim.dim_value = int(batch_size)
                continue
            raise BnfuseError(
                f"input {value.name!r} has a dynamic dimension {axis}; give --batch-size or --input-shape "
                f"{value.name}:DIMS (training graphs need static shapes)"
            )


CUT_SUFFIX = ".bnfuse_inferred"  # a pool's output renamed while its runtime size is fed in its place


def _ceil_pool_corrections(
    graph: onnx.GraphProto, known: Mapping[str, tuple[tuple[int, ...], int]]
) -> dict[str, tuple[tuple[int, ...], int]]:
    """Pool outputs whose inferred shape differs from the runtime's: output -> (runtime shape, element type)."""
    wrong = {}
    for node in graph.node:
        if node.op_type not in pool_sizes.POOLS or node.input[0] not in known:
            continue
        shape = pool_sizes.pool_shape(node, known[node.input[0]][0])
        output = node.output[0]
        inferred, elem = known.get(output, ((), known[node.input[0]][1]))
        if shape is not None and tuple(inferred) != shape:
            wrong[output] = (shape, elem or known[node.input[0]][1])
    return wrong


def _cut_at(model: onnx.ModelProto, fixed: Mapping[str, tuple[tuple[int, ...], int]]) -> onnx.ModelProto:
    """A copy of ``model`` for inference only, each pool output in ``fixed`` a graph input of its runtime shape (the
    node writes a renamed copy): what reads it is inferred from the right size, declared shapes after it dropped."""
    cut = onnx.ModelProto()
    cut.CopyFrom(model)
    graph = cut.graph
    for node in graph.node:
        if node.op_type in pool_sizes.POOLS and node.output[0] in fixed:
            node.output[0] += CUT_SUFFIX
    pool_sizes.drop_declared_after(graph, list(fixed))
    graph.input.extend(value_info(name, dims, elem) for name, (dims, elem) in fixed.items())
    return cut


def _infer(model: onnx.ModelProto, strict: bool = True) -> dict[str, tuple[tuple[int, ...], int]]:
    try:
        inferred = shape_inference.infer_shapes(model, strict_mode=strict, data_prop=True)
    except Exception as exc:
        raise ModelError(f"shape inference failed: {str(exc).splitlines()[0][:300]}") from exc
    known: dict[str, tuple[tuple[int, ...], int]] = {}
    for tensor in inferred.graph.initializer:
        known[tensor.name] = (tuple(tensor.dims), tensor.data_type)
    for value in list(inferred.graph.input) + list(inferred.graph.value_info) + list(inferred.graph.output):
        kind = value.type.tensor_type
        if not kind.HasField("shape"):
            continue
        dims = tuple(d.dim_value if d.HasField("dim_value") else -1 for d in kind.shape.dim)
        known.setdefault(value.name, (dims, kind.elem_type))
    return {name: shape for name, shape in known.items() if not name.endswith(CUT_SUFFIX)}


def infer_static_shapes(model: onnx.ModelProto) -> dict[str, tuple[tuple[int, ...], int]]:
    """name -> (shape, element type) for every tensor, with static shapes after freeze_shapes.

    ONNX shape inference keeps a ceil_mode pooling window that would start in the end padding
    (``AvgPool2d(2, 2, padding=1, ceil_mode=True)`` on 5x5: 4x4), onnxruntime's kernels and PyTorch drop it (3x3):
    such a pool's output is given the runtime's size and inference runs again from there (rounds: a pool after
    another is checked at its corrected input size). The rounds are lenient (a Reshape to the size PyTorch traced,
    after such a pool, fails ONNX's inference of the model as it is); the last one is strict."""
    if not pool_sizes.has_ceil_mode_pool(model.graph):
        return _infer(model)  # ONNX's inference as it is
    fixed: dict[str, tuple[tuple[int, ...], int]] = {}
    for _ in range(len(model.graph.node) + 1):
        known = _infer(_cut_at(model, fixed) if fixed else model, strict=False)
        wrong = _ceil_pool_corrections(model.graph, known)
        if not wrong:
            break
        fixed.update(wrong)
    return _infer(_cut_at(model, fixed) if fixed else model)


LINEAR = ("Conv", "ConvTranspose", "Gemm", "MatMul")


def weight_inputs(
    graph: onnx.GraphProto, producers: Mapping[str, onnx.NodeProto]
) -> Iterator[tuple[onnx.NodeProto, int]]:
    """(node, input position) of every weight input: WEIGHT_POSITIONS, and the bias of an Add right after a
    linear op (MatMul + Add is how exporters write Linear / Dense on inputs of rank > 2)."""
    for node in graph.node:
        if node.domain not in ("", "ai.onnx"):
            continue
        for position in WEIGHT_POSITIONS.get(node.op_type, ()):
            if position < len(node.input) and node.input[position]:
                yield node, position
        if node.op_type == "Add" and len(node.input) == 2:
            for position, other in ((0, 1), (1, 0)):
                producer = producers.get(node.input[other])
                if producer is not None and producer.op_type in LINEAR and producer.domain in ("", "ai.onnx"):
                    yield node, position


@dataclass
class Selection:
    parameters: list[str]
    running_stats: list[str]
    frozen_bn: list[str]  # BN node names (or first outputs) normalized with running statistics


def bn_key(node: onnx.NodeProto) -> str:
    return node.name or node.output[0]


def select(
    model: onnx.ModelProto,
    trainable: Sequence[str] | None,
    frozen_bn: bool | Sequence[str],
    fix_gamma: bool,
) -> Selection:
    """The parameters to train (default: every float32 initializer reaching a weight input (weight_inputs),
    through SHAPE_ONLY ops), the running statistics, and the BN nodes to freeze."""
    graph = model.graph
    initializers = {t.name: t for t in graph.initializer}
    inputs = {i.name for i in graph.input}
    bns = [n for n in graph.node if n.op_type == "BatchNormalization" and n.domain in ("", "ai.onnx")]
    running = [name for node in bns for name in node.input[3:5]]
    bn_scales = {node.input[1] for node in bns}
    producers = producers_of(graph)

    def usable(name: str) -> bool:
        tensor = initializers.get(name)
        return (
            tensor is not None
            and name not in inputs
            and tensor.data_type in TRAINABLE_TYPES
            and name not in running
            and not (fix_gamma and name in bn_scales)
        )

    if trainable is None:
        chosen: list[str] = []
        for node, position in weight_inputs(graph, producers):
            name = resolve_initializer(node.input[position], producers, initializers, SHAPE_ONLY) or ""
            if usable(name) and name not in chosen:
                chosen.append(name)
    else:
        chosen = []
        for pattern in trainable:
            matches = [n for n in initializers if fnmatch.fnmatchcase(n, pattern) and usable(n)]
            if not matches:
                raise BnfuseError(f"--trainable {pattern!r} matches no float32 / float64 parameter initializer")
            chosen += [m for m in matches if m not in chosen]
    if not chosen:
        raise BnfuseError(
            "no trainable parameters: the model has no float32 (or float64) weight initializers "
            "(float16 training is not supported)"
        )

    if isinstance(frozen_bn, bool):
        frozen = [bn_key(n) for n in bns] if frozen_bn else []
    else:
        keys = {bn_key(n): n for n in bns} | {n.output[0]: n for n in bns}
        missing = [k for k in frozen_bn if k not in keys]
        if missing:
            raise BnfuseError(f"--frozen-bn names no BatchNormalization: {', '.join(missing)}")
        frozen = [bn_key(keys[k]) for k in frozen_bn]
    return Selection(chosen, running, frozen)


def initializer_array(model: onnx.ModelProto, name: str) -> np.ndarray:
    for tensor in model.graph.initializer:
        if tensor.name == name:
            return numpy_helper.to_array(tensor)
    raise KeyError(name)


def value_info(name: str, shape: Sequence[int], elem_type: int = TensorProto.FLOAT) -> onnx.ValueInfoProto:
    """A tensor's declaration; a negative (unknown) dimension stays unknown, never -1 (read as a size, -1 turns
    the backward's Expand / Reshape targets into invalid shapes)."""
    return helper.make_tensor_value_info(name, elem_type, [d if d >= 0 else None for d in shape])


def set_bn_scales_to_one(model: onnx.ModelProto) -> None:
    """fix_gamma (MXNet): BN scale is 1 in training, so make it 1 in the model too (in place, after untying)."""
    scales = {n.input[1] for n in model.graph.node if n.op_type == "BatchNormalization" and n.domain in ("", "ai.onnx")}
    for index, tensor in enumerate(model.graph.initializer):
        if tensor.name in scales:
            ones = numpy_helper.from_array(np.ones_like(numpy_helper.to_array(tensor)), tensor.name)
            model.graph.initializer[index].CopyFrom(ones)
