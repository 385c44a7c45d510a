"""onnxruntime's blocked-layout (NCHWc) convolutions in a training graph: ``nchwc_convs`` rewrites the 2-D Convs,
``nchwc_block`` probes the CPU's block.

onnxruntime applies its NCHWc layout only to Convs with constant weights; a training graph's weights are inputs, so
without this rewrite its convolutions run as im2col + GEMM. ``TrainingSession`` rewrites the graph it runs (CPU);
``build_training_graph(nchwc=True)`` (``train-graph --nchwc``) writes the same rewrite into the file for this
machine's block, recorded in the metadata (``BLOCK_KEY``), so a host that only has onnxruntime and bnfuse's library
runs the step ``TrainingSession`` runs. The layout is onnxruntime's internal one: a file rewritten for block 16
(AVX-512) does not run on a CPU whose block is 8 (AVX2); the session checks.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import numpy as np
import onnx

NCHWC = "com.microsoft.nchwc"
BLOCK_KEY = "bnfuse.nchwc_block"  # metadata of a graph rewritten by the training pass: the block it was written for
# Fewest output pixels per image for which a Conv runs as NCHWc: its weight is reordered in the graph on every
# step (two Transposes), which the blocked kernel repays only where each weight element is used at enough positions
# (see nchwc_convs).
NCHWC_MIN_PIXELS = 64
_SHAPE_KEEPING_BN_OPS = ("BatchNormalizationTraining", "BatchNormalizationGrad")
CPU = "CPUExecutionProvider"


@functools.cache
def nchwc_block() -> int:
    """onnxruntime's NCHWc channel block on this CPU (16 with AVX-512, 8 with AVX2), 0 where it has none.

    The layout is onnxruntime's internal one, so the probe does not trust it: a small Conv rewritten by
    ``nchwc_convs`` must give the plain Conv's result (blocked and unblocked input paths), else 0 (no rewrite).
    """
    import onnxruntime
    from onnx import TensorProto, helper

    options = onnxruntime.SessionOptions()
    options.log_severity_level = 4

    def run(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> np.ndarray:
        session = onnxruntime.InferenceSession(model.SerializeToString(), options, providers=[CPU])
        return session.run(None, feeds)[0]

    probe = helper.make_graph(
        [helper.make_node("ReorderInput", ["x"], ["y"], domain=NCHWC)],
        "probe",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4, 1, 1])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
    )
    opsets = [helper.make_opsetid("", 17), helper.make_opsetid(NCHWC, 1)]
    try:
        block = int(
            run(helper.make_model(probe, opset_imports=opsets), {"x": np.zeros((1, 4, 1, 1), np.float32)}).shape[1]
        )
        if block <= 4:
            return 0
        rng = np.random.default_rng(0)
        for channels_in, group in ((block, 1), (3, 1), (block, block)):  # OIHWBiBo, OIHWBo, depthwise OIHWBo
            conv = helper.make_graph(
                [helper.make_node("Conv", ["x", "w"], ["y"], pads=[1, 0, 2, 1], strides=[1, 2], group=group)],
                "conv",
                [
                    helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, channels_in, 7, 6]),
                    helper.make_tensor_value_info("w", TensorProto.FLOAT, [block, channels_in // group, 3, 2]),
                ],
                [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
            )
            plain = helper.make_model(conv, opset_imports=opsets[:1])
            feeds = {
                "x": rng.standard_normal((2, channels_in, 7, 6)).astype(np.float32),
                "w": rng.standard_normal((block, channels_in // group, 3, 2)).astype(np.float32),
            }
            blocked = onnx.ModelProto()
            blocked.CopyFrom(plain)
            if nchwc_convs(blocked, block) != 1 or not np.allclose(run(blocked, feeds), run(plain, feeds), 1e-4, 1e-4):
                return 0
    except Exception:  # noqa: BLE001 - a build or CPU without the NCHWc kernels, or a changed layout
        return 0
    return block


def nchwc_convs(
    model: onnx.ModelProto, block: int, *, weight_grads: bool = False, min_pixels: int | None = None
) -> int:
    """Rewrite 2-D, ungrouped or depthwise, non-1x1 Conv nodes as onnxruntime's NCHWc Conv between ReorderInput /
    ReorderOutput, the weight reordered in the graph (OIHWBiBo, or OIHWBo for inputs narrower than a block and for
    depthwise weights, [C, 1, kh, kw]).

    onnxruntime applies this layout itself only to constant weights; a training graph's weights are inputs, so
    its convolutions (forward and stride-1 input gradients) run as im2col + GEMM, ~1.8x slower on ResNet shapes
    (measured: [32, 16, 32, 32] 3x3 1.17 -> 0.64 ms with the reorders). 1x1 kernels stay: the reorders cost
    more than they save, and so do maps of fewer than ``min_pixels`` output pixels per image (default
    NCHWC_MIN_PIXELS): the weight's reorder, then a 6-D Transpose on every step (now two 3-D ones), cost 7 ms for
    a 512x512x3x3 weight whose blocked Conv took 0.7 ms at [4, 512, 2, 2] (torchvision resnet18 at 64x64; its step
    went 127 -> 76 ms at 1 thread, bench/RESULTS.md). Depthwise Convs (group = channels, one input channel per
    group) are rewritten on every map: their weight is small, and onnxruntime's plain grouped Conv loops over the
    groups (im2col + GEMM each): [4, 1152, 2, 2] 5x5 9.1 -> 0.53 ms, [4, 96, 16, 16] 3x3 4.8 -> 1.3 ms (loaded
    machine, with the reorders); their channels are padded to a block multiple where they are not one. Output shapes
    come from onnx's shape inference, seeing bnfuse's BN nodes as Identity; an unknown one keeps the rewrite. The
    other Convs' channels must be multiples of the block (no padded channels).
    ``weight_grads``: point the ConvWeightGrad nodes at the NCHWc copies of X made here (see _blocked_weight_grads).
    Returns the count."""
    from onnx import helper, numpy_helper

    if block <= 1:
        return 0
    graph = model.graph
    inferred = onnx.shape_inference.infer_shapes(_inferable(model))
    shapes = {
        v.name: [d.dim_value if d.HasField("dim_value") else 0 for d in v.type.tensor_type.shape.dim]
        for v in [*inferred.graph.input, *inferred.graph.value_info]
        if v.type.tensor_type.HasField("shape")
    }
    shapes.update({t.name: list(t.dims) for t in graph.initializer})
    nodes: list[onnx.NodeProto] = []
    blocked_copies: dict[str, str] = {}  # a Conv input -> its NCHWc copy (ReorderInput's output)
    count = 0
    for node in graph.node:
        ws = shapes.get(node.input[1]) if node.op_type == "Conv" and node.domain in ("", "ai.onnx") else None
        ys = shapes.get(node.output[0], [])
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        group = attrs.get("group", 1)
        # depthwise (channels a multiple of 4: ReorderInput pads those, and only those, to the block)
        depthwise = ws is not None and len(ws) == 4 and group > 1 and ws[0] == group and ws[1] == 1 and group % 4 == 0
        if (
            ws is None
            or len(ws) != 4
            or not all(ws)
            or (group != 1 and not depthwise)
            or attrs.get("auto_pad", b"NOTSET") not in (b"NOTSET", "NOTSET")
            or ws[2] * ws[3] == 1
            or (ws[0] % block and not depthwise)
            or (ws[1] % block and ws[1] >= block and not depthwise)
            or (not depthwise and _output_pixels(ys) < (NCHWC_MIN_PIXELS if min_pixels is None else min_pixels))
        ):
            nodes.append(node)
            continue
        co, ci, kh, kw = ws
        stem = f"{node.name or node.output[0]}_nchwc"
        # else OIHWBo: NCHW input read directly (e.g. 3-channel images); depthwise: OIHWBo on a blocked input
        blocked_input = ci % block == 0 or depthwise
        # depthwise channels past a block multiple: ReorderInput pads X's with zeros, the weight (and bias) get zero
        # rows here, ReorderOutput drops the padded outputs
        padded = -(-co // block) * block if depthwise else co
        # The reorder as moves of one axis to the end ([n, a, b] -> [n, b, a]), onnxruntime's fast Transpose path:
        # OIHW = [O/B, Bo, I/B, Bi, K] -> [O/B, Bo, I/B, K, Bi] -> [O/B, I/B, K, Bi, Bo] (OIHWBiBo). Its generic
        # 6-D Transpose took 23 ms on a 512x512x3x3 weight at 1 thread, these two 3 ms (quiet machine).
        steps = [[padded // block, block, ci * kh * kw]]  # OIHWBo: [O/B, Bo, I*K] -> [O/B, I*K, Bo]
        if blocked_input and not depthwise:
            steps = [[co * ci // block, block, kh * kw], [co // block, block, ci * kh * kw]]
        constants = {f"{stem}_split{i}": split for i, split in enumerate(steps)}
        constants[f"{stem}_shape"] = [padded, *ws[1:]]
        if padded != co:
            constants[f"{stem}_wpads"] = [0, 0, 0, 0, padded - co, 0, 0, 0]
            constants[f"{stem}_bpads"] = [0, padded - co]
        graph.initializer.extend(numpy_helper.from_array(np.array(v, np.int64), k) for k, v in constants.items())
        w = node.input[1]
        bias = list(node.input[2:3])
        if padded != co:
            nodes.append(helper.make_node("Pad", [w, f"{stem}_wpads"], [f"{stem}_wp"]))
            w = f"{stem}_wp"
            if bias and bias[0]:
                nodes.append(helper.make_node("Pad", [bias[0], f"{stem}_bpads"], [f"{stem}_bp"]))
                bias = [f"{stem}_bp"]
        for i in range(len(steps)):
            nodes.append(helper.make_node("Reshape", [w, f"{stem}_split{i}"], [f"{stem}_w{i}v"]))
            nodes.append(helper.make_node("Transpose", [f"{stem}_w{i}v"], [f"{stem}_w{i}t"], perm=[0, 2, 1]))
            w = f"{stem}_w{i}t"
        nodes.append(helper.make_node("Reshape", [w, f"{stem}_shape"], [f"{stem}_w"]))
        x = node.input[0]
        if blocked_input:
            nodes.append(helper.make_node("ReorderInput", [x], [f"{stem}_x"], domain=NCHWC))
            if padded == co:  # a weight gradient can read this copy (x_block: no padded channels)
                blocked_copies.setdefault(x, f"{stem}_x")
            x = f"{stem}_x"
        inputs = [x, f"{stem}_w", *bias]
        keep = {k: v for k, v in attrs.items() if k in ("dilations", "kernel_shape", "pads", "strides")}
        if depthwise:
            keep["group"] = padded
        nodes.append(helper.make_node("Conv", inputs, [f"{stem}_y"], domain=NCHWC, **keep))
        nodes.append(helper.make_node("ReorderOutput", [f"{stem}_y"], [node.output[0]], domain=NCHWC, channels=co))
        count += 1
    if count:
        if weight_grads:
            _blocked_weight_grads(nodes, blocked_copies, block)
        graph.ClearField("node")
        graph.node.extend(nodes)
        if not any(o.domain == NCHWC for o in model.opset_import):
            model.opset_import.append(helper.make_opsetid(NCHWC, 1))
    return count


def _output_pixels(shape: Sequence[int]) -> float:
    """Output pixels per image of a Conv output shape [N, C, *spatial]; unknown: infinite (the rewrite applies)."""
    if len(shape) < 3 or not all(shape[2:]):
        return float("inf")
    return float(np.prod(shape[2:]))


def _inferable(model: onnx.ModelProto) -> onnx.ModelProto:
    """A copy of ``model`` that onnx's shape inference sees through: bnfuse's BN nodes (first output shaped as
    their first input) become Identity, so the shapes past them (every Conv after a BN) are inferred."""
    from onnx import helper

    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    for index, node in enumerate(copy.graph.node):
        if node.domain == "bnfuse" and node.op_type in _SHAPE_KEEPING_BN_OPS:
            copy.graph.node[index].CopyFrom(helper.make_node("Identity", [node.input[0]], [node.output[0]]))
    return copy


def _blocked_weight_grads(nodes: list[onnx.NodeProto], blocked_copies: dict[str, str], block: int) -> int:
    """Point each 2-D, ungrouped bnfuse.ConvWeightGrad whose X has an NCHWc copy (made for a forward Conv) at that
    copy (attribute x_block): oneDNN reads the blocked layout it computes in, instead of reordering plain X on every
    call. Only where oneDNN runs here (the NumPy fallback needs plain X). Returns how many."""
    from onnx import helper

    from bnfuse.runtime import conv_grad

    if not blocked_copies or not conv_grad.available():
        return 0
    count = 0
    for node in nodes:
        if node.domain != conv_grad.DOMAIN or node.op_type != conv_grad.OP or node.input[0] not in blocked_copies:
            continue
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        if attrs.get("group", 1) != 1 or len(attrs.get("kernel_shape", ())) != 2 or attrs.get("x_block", 0):
            continue
        node.input[0] = blocked_copies[node.input[0]]
        node.attribute.append(helper.make_attribute("x_block", block))
        count += 1
    return count


def rewritten_block(model: onnx.ModelProto) -> int | None:
    """The block a graph's NCHWc rewrite was written for by the training pass (its metadata), None if it has none."""
    for prop in model.metadata_props:
        if prop.key == BLOCK_KEY:
            return int(prop.value)
    return None


def blocked_weight_grads(model: onnx.ModelProto, block: int) -> int:
    """In a graph rewritten already, point the ConvWeightGrad nodes at the NCHWc copies of X its ReorderInput nodes
    make (as ``nchwc_convs(weight_grads=True)``); returns how many."""
    copies: dict[str, str] = {}
    for node in model.graph.node:
        if node.domain == NCHWC and node.op_type == "ReorderInput":
            copies.setdefault(node.input[0], node.output[0])
    nodes = list(model.graph.node)
    count = _blocked_weight_grads(nodes, copies, block)
    if count:
        model.graph.ClearField("node")
        model.graph.node.extend(nodes)
    return count


def write_rewrite(model: onnx.ModelProto) -> int:
    """The training pass's ``nchwc=True``: rewrite ``model``'s convolutions for this CPU's block (in place) and record
    the block in its metadata; returns how many (0, nothing recorded, where onnxruntime has no NCHWc kernels)."""
    block = nchwc_block()
    count = nchwc_convs(model, block) if block else 0
    if count:
        entry = model.metadata_props.add()
        entry.key, entry.value = BLOCK_KEY, str(block)
    return count
