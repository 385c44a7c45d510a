"""BN left by bnfuse, onnxruntime, onnxsim and onnxoptimizer on the networks whose BN peers leave (issue 35).

    python bench/bn_left_peers.py [MODEL ...]   (levit_128s resnetv2_50 densenet121 dpn68 qdq qdq_int_bias qdq_weights)

timm / torchvision models: random init (seed 0), BN statistics and affine parameters drawn at random (so no fold
is trivially exact), eval mode, batch 1, 224 x 224, the TorchScript exporter at opset 17 with its defaults (it
fuses a Conv directly followed by BN itself). ``qdq``: a Conv -> BN -> Relu -> Conv net quantized by
onnxruntime.quantization.quantize_static (QDQ, per-channel int8 weights, int8 activations, no pre-processing, so
BN stays); ``qdq_int_bias``: the same model with the Conv's output and the BN's parameters left unquantized (the
activation QuantizeLinear / DequantizeLinear pair before the BN removed): a per-channel int8 weight and an int32
bias feeding a BN; ``qdq_weights``: that one with the Conv's bias in float too.

Per model: BatchNormalization nodes in, and left by bnfuse (``optimize(check=True)``; per-channel Add / Mul it
leaves in brackets), onnxruntime (the model its EXTENDED level writes), onnxsim (``simplify``) and onnxoptimizer
(its fuse-and-elimination passes); bnfuse's output against PyTorch's (max abs / max |PyTorch|); bnfuse's reasons
for what stays. ``--latency``: also bnfuse's model against the original in onnxruntime, 1 thread, sessions
interleaved with the order alternating, at the EXTENDED and ALL levels (median of the per-round ratios).
"""

from __future__ import annotations

import io
import sys
import tempfile
import time
import warnings
from collections import Counter
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
from onnx import helper, numpy_helper

sys.path.insert(0, str(Path(__file__).resolve().parent))
import archs  # noqa: E402

import bnfuse  # noqa: E402
from bnfuse.passes.optimize import count_nodes  # noqa: E402

MODELS = ("levit_128s", "resnetv2_50", "densenet121", "dpn68", "qdq", "qdq_int_bias", "qdq_weights")


def torch_model(name: str) -> tuple[onnx.ModelProto, np.ndarray, np.ndarray]:
    """The exported model, an input and PyTorch's output for it."""
    import torch

    torchvision = archs.import_torchvision()
    torch.manual_seed(0)
    if name in archs.TORCHVISION:
        net = getattr(torchvision.models, name)()
    else:
        import timm

        net = timm.create_model(name, pretrained=False)
    net.eval()
    with torch.no_grad():
        for module in net.modules():
            if isinstance(module, torch.nn.modules.batchnorm._BatchNorm):
                module.running_mean.uniform_(-0.5, 0.5)
                module.running_var.uniform_(0.5, 2.0)
                if module.weight is not None:
                    module.weight.uniform_(0.5, 1.5)
                    module.bias.uniform_(-0.3, 0.3)
    x = torch.randn(1, 3, 224, 224)
    buffer = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(net, (x,), buffer, opset_version=17, dynamo=False, input_names=["x"], output_names=["y"])
        with torch.no_grad():
            y = net(x).numpy()
    return onnx.load_from_string(buffer.getvalue()), x.numpy(), y


def qdq_model(variant: str) -> tuple[onnx.ModelProto, np.ndarray, None]:
    from onnxruntime.quantization import CalibrationDataReader, QuantFormat, QuantType, quantize_static

    rng = np.random.default_rng(0)
    c, m = 3, 16

    def init(name: str, values: np.ndarray) -> onnx.TensorProto:
        return numpy_helper.from_array(np.asarray(values, np.float32), name)

    inits = [
        init("w", rng.normal(0, 0.3, (m, c, 3, 3))),
        init("b", rng.normal(0, 0.1, m)),
        init("s", rng.uniform(0.5, 2, m)),
        init("bb", rng.normal(0, 0.5, m)),
        init("mean", rng.normal(0, 0.5, m)),
        init("var", rng.uniform(0.5, 2, m)),
        init("w2", rng.normal(0, 0.3, (8, m, 1, 1))),
    ]
    nodes = [
        helper.make_node("Conv", ["x", "w", "b"], ["c"], name="conv", pads=[1, 1, 1, 1]),
        helper.make_node("BatchNormalization", ["c", "s", "bb", "mean", "var"], ["n"], name="bn"),
        helper.make_node("Relu", ["n"], ["r"], name="relu"),
        helper.make_node("Conv", ["r", "w2"], ["y"], name="conv2"),
    ]
    shape = [1, c, 16, 16]
    graph = helper.make_graph(
        nodes,
        "qdq",
        [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, shape)],
        [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, None)],
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 9
    samples = [{"x": rng.normal(size=shape).astype(np.float32)} for _ in range(8)]

    class Reader(CalibrationDataReader):
        def __init__(self) -> None:
            self.data = iter(samples)

        def get_next(self) -> dict | None:
            return next(self.data, None)

    with tempfile.TemporaryDirectory() as tmp:
        onnx.save(model, f"{tmp}/float.onnx")
        quantize_static(
            f"{tmp}/float.onnx",
            f"{tmp}/qdq.onnx",
            Reader(),
            quant_format=QuantFormat.QDQ,
            per_channel=True,
            weight_type=QuantType.QInt8,
            activation_type=QuantType.QInt8,
        )
        quantized = onnx.load(f"{tmp}/qdq.onnx")
    if variant != "qdq":
        quantized = _float_before_bn(quantized)
    if variant == "qdq_weights":
        conv = next(n for n in quantized.graph.node if n.op_type == "Conv")
        _dequantized_input(quantized, conv, 2)
    return quantized, samples[0]["x"], None


def _float_before_bn(model: onnx.ModelProto) -> onnx.ModelProto:
    """The BN reads the Conv's float output and float parameters: the Q / DQ pairs feeding it are bypassed."""
    producers = {o: n for n in model.graph.node for o in n.output}
    bn = next(n for n in model.graph.node if n.op_type == "BatchNormalization")
    for index, name in enumerate(bn.input):
        node = producers.get(name)
        if node is None or node.op_type != "DequantizeLinear":
            continue
        source = producers.get(node.input[0])
        if source is not None and source.op_type == "QuantizeLinear":  # activation: Q -> DQ
            bn.input[index] = source.input[0]
        else:  # a quantized parameter: its float value
            _dequantized_input(model, bn, index)
    while True:  # drop what no longer feeds anything (the bypassed pairs)
        used = {i for n in model.graph.node for i in n.input} | {o.name for o in model.graph.output}
        kept = [n for n in model.graph.node if any(o in used for o in n.output)]
        if len(kept) == len(model.graph.node):
            return model
        del model.graph.node[:]
        model.graph.node.extend(kept)


def _dequantized_input(model: onnx.ModelProto, node: onnx.NodeProto, index: int) -> None:
    """``node``'s input ``index`` (a DequantizeLinear of constants) replaced by its float value."""
    name = node.input[index]
    dequantize = next(n for n in model.graph.node if name in n.output)
    q, s = (numpy_helper.to_array(_initializer(model, n)) for n in dequantize.input[:2])
    z = numpy_helper.to_array(_initializer(model, dequantize.input[2])) if len(dequantize.input) > 2 else 0
    values = ((q.astype(np.int64) - z) * s).astype(np.float32)
    model.graph.initializer.append(numpy_helper.from_array(values, name + "_float"))
    node.input[index] = name + "_float"


def _initializer(model: onnx.ModelProto, name: str) -> onnx.TensorProto:
    return next(t for t in model.graph.initializer if t.name == name)


def per_channel(model: onnx.ModelProto, op_type: str) -> int:
    """``op_type`` nodes with a constant operand of more than one element (a BN's shift left as an Add)."""
    sizes = {t.name: int(np.prod(t.dims)) for t in model.graph.initializer}
    return sum(1 for n in model.graph.node if n.op_type == op_type and any(sizes.get(i, 0) > 1 for i in n.input))


def bn(model: onnx.ModelProto) -> int:
    return count_nodes(model.graph, "BatchNormalization")


def onnxruntime_extended(model: onnx.ModelProto) -> onnx.ModelProto:
    with tempfile.TemporaryDirectory() as tmp:
        options = ort.SessionOptions()
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED
        options.optimized_model_filepath = f"{tmp}/ort.onnx"
        options.log_severity_level = 3
        ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
        return onnx.load(f"{tmp}/ort.onnx")


def peer(name: str, model: onnx.ModelProto) -> str:
    try:
        if name == "onnxsim":
            import onnxsim

            simplified, ok = onnxsim.simplify(model)
            return str(bn(simplified)) + ("" if ok else " (check failed)")
        import onnxoptimizer

        return str(bn(onnxoptimizer.optimize(model, onnxoptimizer.get_fuse_and_elimination_passes())))
    except ImportError:
        return "n/a"
    except Exception as exc:  # a peer failing on a model is a result too
        return f"error ({type(exc).__name__})"


def latency_ratio(
    original: onnx.ModelProto, optimized: onnx.ModelProto, x: np.ndarray, level: str, rounds: int
) -> float:
    """bnfuse / original run time, median over rounds that alternate which session runs first."""
    options = ort.SessionOptions()
    options.intra_op_num_threads = options.inter_op_num_threads = 1
    options.graph_optimization_level = getattr(ort.GraphOptimizationLevel, f"ORT_ENABLE_{level}")
    options.log_severity_level = 3
    sessions = [
        ort.InferenceSession(m.SerializeToString(), options, providers=["CPUExecutionProvider"])
        for m in (original, optimized)
    ]
    feeds = {"x": x}
    for session in sessions:
        session.run(None, feeds)
    ratios = []
    for index in range(rounds):
        seconds = [0.0, 0.0]
        for which in (0, 1) if index % 2 else (1, 0):
            start = time.perf_counter()
            sessions[which].run(None, feeds)
            seconds[which] = time.perf_counter() - start
        ratios.append(seconds[1] / seconds[0])
    return float(np.median(ratios))


def row(name: str, latency: bool = False) -> tuple[list[str], Counter[str]]:
    model, x, want = qdq_model(name) if name.startswith("qdq") else torch_model(name)
    optimized, report = bnfuse.optimize(model, check=True)
    error = "n/a"
    if want is not None:
        session = ort.InferenceSession(optimized.SerializeToString(), providers=["CPUExecutionProvider"])
        got = session.run(None, {"x": x})[0]
        error = f"{float(np.abs(got - want).max() / np.abs(want).max()):.1e}"
    moved = sum(1 for r in report.batchnorms if r.direction == "moved")
    reasons = Counter(_short(r.reason) for r in report.batchnorms if r.status == "skipped")
    cells = [
        name,
        str(bn(model)),
        f"{bn(optimized)} (+{per_channel(optimized, 'Add') - per_channel(model, 'Add')} Add)"
        + ("" if report.check.passed else " check FAILED"),
        f"{report.count('folded') - moved} / {moved}",
        str(bn(onnxruntime_extended(model))),
        peer("onnxsim", model),
        peer("onnxoptimizer", model),
        error,
    ]
    if latency:
        cells += [f"{latency_ratio(model, optimized, x, level, 12):.3f}" for level in ("EXTENDED", "ALL")]
    return cells, reasons


def _short(reason: str | None) -> str:
    return (reason or "?")[:400]


def main(argv: list[str] | None = None) -> int:
    args = list(argv if argv is not None else sys.argv[1:])
    latency = "--latency" in args
    names = [a for a in args if a != "--latency"] or list(MODELS)
    header = [
        "model",
        "BN in",
        "bnfuse BN left (+ Adds it added)",
        "bnfuse folded / moved",
        "onnxruntime EXTENDED",
        "onnxsim",
        "onnxoptimizer",
        "bnfuse vs PyTorch (max rel)",
    ] + (["latency bnfuse / original, EXTENDED", "ALL"] if latency else [])
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    notes = []
    for name in names:
        cells, reasons = row(name, latency)
        print("| " + " | ".join(cells) + " |", flush=True)
        notes += [f"- {name}: {count} x {reason}" for reason, count in reasons.items()]
    if notes:
        print("\nbnfuse's reasons for the BN it leaves:")
        print("\n".join(notes))
    return 0


if __name__ == "__main__":
    sys.exit(main())
