"""A small ONNX graph writer for the model builders: layers as methods, seeded random weights.

Weights use the initializations the published networks train from (He-normal for convolutions, PyTorch's
uniform for linear layers). BatchNormalization gets random scale / bias and *calibrated* running
statistics: the float32 graph runs once in onnxruntime with every BN in training mode (momentum 0) on a
seeded standard-normal batch, and the batch means / variances it reports become the running statistics,
as in a trained network. Activations therefore stay O(1) through deep stacks (with random statistics a
ResNet-50's output grows to a standard deviation of ~300), and means != 0, variances != 1, scales != 1
all the same. Everything is written with onnx.helper directly, no framework. The graph is built in
opset-17 form and float32; the target opset (Clip attributes before 11) and dtype are applied at the end.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import onnx
from onnx import TensorProto, helper

from bnfuse.errors import BnfuseError
from bnfuse.io import ort_compatible

MIN_OPSET = 7
DEFAULT_OPSET = 17
DTYPES = {"float32": (np.float32, TensorProto.FLOAT), "float16": (np.float16, TensorProto.FLOAT16)}
INPUT, OUTPUT = "input", "output"
# Calibration: at least this many values per channel at the BN with the smallest feature map.
CALIBRATION_SAMPLES = 128
MAX_CALIBRATION_BATCH = 512
Kernel = int | Sequence[int]


def make_divisible(value: float, divisor: int = 8) -> int:
    """Round a scaled channel count to a multiple of ``divisor`` (MobileNet's rule; never below 90%)."""
    rounded = max(divisor, int(value + divisor / 2) // divisor * divisor)
    if rounded < 0.9 * value:
        rounded += divisor
    return rounded


def scaled(channels: int, width: float) -> int:
    """``channels`` scaled by ``width``: exact at width 1, else a multiple of 8 (at least 8)."""
    return channels if width == 1.0 else make_divisible(channels * width)


class GraphBuilder:
    """Collects nodes and initializers of one graph; every method returns the name of its output tensor."""

    def __init__(self, name: str, *, opset: int, dtype: str, seed: int, spatial_dims: int = 2) -> None:
        newest = onnx.defs.onnx_opset_version()
        if not MIN_OPSET <= opset <= newest:
            raise BnfuseError(f"opset must be between {MIN_OPSET} and {newest}, got {opset}")
        if dtype not in DTYPES:
            raise BnfuseError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
        self.name = name
        self.opset = opset
        self.np_dtype, self.elem_type = DTYPES[dtype]
        self.rng = np.random.default_rng(seed)
        self.spatial_dims = spatial_dims
        self.nodes: list[onnx.NodeProto] = []
        self.arrays: dict[str, np.ndarray] = {}  # initializers, float32 until the model is finished
        self._counts: dict[str, int] = {}
        self._relu6_bounds: tuple[str, str] | None = None

    # ----- names and tensors --------------------------------------------------------------------

    def fresh(self, prefix: str) -> str:
        index = self._counts.get(prefix, 0)
        self._counts[prefix] = index + 1
        return f"{prefix}{index}"

    def constant(self, name: str, values: np.ndarray) -> str:
        self.arrays[name] = np.asarray(values, dtype=np.float32)
        return name

    def he_normal(self, name: str, shape: Sequence[int], fan: int) -> str:
        """He (Kaiming) normal N(0, 2 / fan_in): keeps the activation variance through Conv + ReLU."""
        values = self.rng.standard_normal(tuple(shape), dtype=np.float32)
        values *= np.float32(math.sqrt(2.0 / fan))
        return self.constant(name, values)

    def uniform(self, name: str, shape: Sequence[int], bound: float) -> str:
        values = self.rng.random(tuple(shape), dtype=np.float32)
        values *= np.float32(2 * bound)
        values -= np.float32(bound)
        return self.constant(name, values)

    def node(self, op: str, inputs: Sequence[str], prefix: str, **attrs: object) -> str:
        name = self.fresh(prefix)
        self.nodes.append(helper.make_node(op, list(inputs), [name], name=name, **attrs))
        return name

    def _kernel(self, kernel: Kernel) -> list[int]:
        return [kernel] * self.spatial_dims if isinstance(kernel, int) else list(kernel)

    # ----- layers -------------------------------------------------------------------------------

    def conv(
        self,
        x: str,
        c_in: int,
        c_out: int,
        kernel: Kernel,
        *,
        stride: Kernel = 1,
        pad: Kernel | None = None,
        group: int = 1,
        bias: bool = False,
    ) -> str:
        """Conv with He-normal weights; ``pad`` defaults to kernel // 2 (same size at stride 1)."""
        ks = self._kernel(kernel)
        pads = [k // 2 for k in ks] if pad is None else self._kernel(pad)
        name = self.fresh("conv")
        shape = [c_out, c_in // group, *ks]
        inputs = [x, self.he_normal(f"{name}.weight", shape, fan=c_in // group * math.prod(ks))]
        if bias:
            inputs.append(self.uniform(f"{name}.bias", [c_out], 1 / math.sqrt(c_in // group * math.prod(ks))))
        attrs: dict[str, object] = {"kernel_shape": ks, "strides": self._kernel(stride), "pads": pads + pads}
        if group != 1:
            attrs["group"] = group
        self.nodes.append(helper.make_node("Conv", inputs, [name], name=name, **attrs))
        return name

    def conv_transpose(self, x: str, c_in: int, c_out: int, kernel: Kernel, *, stride: Kernel, bias: bool) -> str:
        """ConvTranspose (upsampling by ``stride`` with kernel == stride, U-Net style), weight [c_in, c_out, k...]."""
        ks, strides = self._kernel(kernel), self._kernel(stride)
        name = self.fresh("deconv")
        # Each output element sees c_in * prod(kernel / stride) products.
        fan = max(1, c_in * math.prod(ks) // math.prod(strides))
        inputs = [x, self.he_normal(f"{name}.weight", [c_in, c_out, *ks], fan=fan)]
        if bias:
            inputs.append(self.uniform(f"{name}.bias", [c_out], 1 / math.sqrt(c_out * math.prod(ks))))
        self.nodes.append(
            helper.make_node("ConvTranspose", inputs, [name], name=name, kernel_shape=ks, strides=strides)
        )
        return name

    def batchnorm(self, x: str, channels: int, *, epsilon: float = 1e-5) -> str:
        """Inference BatchNormalization: random scale and bias; running statistics calibrated in model()."""
        name = self.fresh("bn")
        params = {
            "scale": self.rng.uniform(0.5, 1.5, channels),
            "bias": self.rng.normal(0.0, 0.2, channels),
            "mean": np.zeros(channels),
            "var": np.ones(channels),
        }
        inputs = [x, *(self.constant(f"{name}.{key}", value) for key, value in params.items())]
        self.nodes.append(helper.make_node("BatchNormalization", inputs, [name], name=name, epsilon=epsilon))
        return name

    def relu(self, x: str) -> str:
        return self.node("Relu", [x], "relu")

    def relu6(self, x: str) -> str:
        """ReLU6 as Clip: min / max are inputs from opset 11 (shared scalars), attributes before (see model())."""
        if self._relu6_bounds is None:
            self._relu6_bounds = (self.constant("relu6.min", np.array(0.0)), self.constant("relu6.max", np.array(6.0)))
        return self.node("Clip", [x, *self._relu6_bounds], "relu6")

    def add(self, a: str, b: str) -> str:
        return self.node("Add", [a, b], "add")

    def concat(self, xs: Sequence[str], axis: int = 1) -> str:
        return self.node("Concat", xs, "concat", axis=axis)

    def max_pool(self, x: str, kernel: Kernel, stride: Kernel, pad: Kernel = 0) -> str:
        pads = self._kernel(pad)
        return self.node(
            "MaxPool", [x], "maxpool", kernel_shape=self._kernel(kernel), strides=self._kernel(stride), pads=pads + pads
        )

    def avg_pool(self, x: str, kernel: Kernel, stride: Kernel) -> str:
        return self.node("AveragePool", [x], "avgpool", kernel_shape=self._kernel(kernel), strides=self._kernel(stride))

    def global_pool_flatten(self, x: str) -> str:
        return self.node("Flatten", [self.node("GlobalAveragePool", [x], "gap")], "flatten", axis=1)

    def _dense_weight(self, name: str, shape: list[int], c_in: int, he: bool) -> str:
        """He normal for hidden layers followed by ReLU; PyTorch's U(+-1/sqrt(in)) for classifiers."""
        if he:
            return self.he_normal(name, shape, fan=c_in)
        return self.uniform(name, shape, 1 / math.sqrt(c_in))

    def linear(self, x: str, c_in: int, c_out: int, *, he: bool = False) -> str:
        """PyTorch's Linear as ONNX exports it: Gemm with weight [out, in], transB=1, and a bias."""
        name = self.fresh("fc")
        weight = self._dense_weight(f"{name}.weight", [c_out, c_in], c_in, he)
        bias = self.uniform(f"{name}.bias", [c_out], 1 / math.sqrt(c_in))
        self.nodes.append(helper.make_node("Gemm", [x, weight, bias], [name], name=name, transB=1))
        return name

    def matmul_add(self, x: str, c_in: int, c_out: int, *, he: bool = False) -> str:
        """A dense layer as MatMul by a [in, out] weight, then Add of the bias (TensorFlow / Keras style)."""
        name = self.fresh("dense")
        product = self.node("MatMul", [x, self._dense_weight(f"{name}.kernel", [c_in, c_out], c_in, he)], "matmul")
        return self.node("Add", [product, self.uniform(f"{name}.bias", [c_out], 1 / math.sqrt(c_in))], "biasadd")

    # ----- the model ----------------------------------------------------------------------------

    def model(
        self,
        input_shape: Sequence[int | str],
        y: str,
        output_shape: Sequence[int | str],
        *,
        doc: str,
        metadata: dict[str, object],
    ) -> onnx.ModelProto:
        """The finished model: graph input INPUT, output OUTPUT (``y`` renamed), IR version onnxruntime reads."""
        for node in self.nodes:
            node.output[:] = [OUTPUT if name == y else name for name in node.output]
        self._calibrate(input_shape)
        if self.opset < 11:
            self._clip_attributes()
        graph = helper.make_graph(
            self.nodes,
            self.name,
            [helper.make_tensor_value_info(INPUT, self.elem_type, list(input_shape))],
            [helper.make_tensor_value_info(OUTPUT, self.elem_type, list(output_shape))],
            [self._tensor(name, array, self.np_dtype, self.elem_type) for name, array in self.arrays.items()],
            doc_string=doc,
        )
        model = helper.make_model(
            graph, opset_imports=[helper.make_opsetid("", self.opset)], producer_name="bnfuse.models"
        )
        helper.set_model_props(model, {key: str(value) for key, value in metadata.items()})
        return ort_compatible(model)

    def _calibrate(self, input_shape: Sequence[int | str]) -> None:
        """Set every BN's running mean / variance to the batch statistics of a seeded random batch."""
        import onnxruntime as ort

        batchnorms = [n for n in self.nodes if n.op_type == "BatchNormalization"]
        if not batchnorms:
            return
        nodes, outputs = [], []
        for node in self.nodes:
            if node.op_type == "BatchNormalization":
                stats = [f"{node.name}.calibrated_mean", f"{node.name}.calibrated_var"]
                node = helper.make_node(
                    "BatchNormalization",
                    list(node.input),
                    [node.output[0], *stats],
                    name=node.name,
                    epsilon=next(a.f for a in node.attribute if a.name == "epsilon"),
                    momentum=0.0,
                    training_mode=1,
                )
                outputs += [helper.make_tensor_value_info(s, TensorProto.FLOAT, None) for s in stats]
            nodes.append(node)
        inits = [self._tensor(name, array, np.float32, TensorProto.FLOAT) for name, array in self.arrays.items()]
        opsets = [helper.make_opsetid("", DEFAULT_OPSET)]
        batch = _calibration_batch(nodes, inits, batchnorms, input_shape)
        shape = [batch, *input_shape[1:]]
        graph = helper.make_graph(
            nodes, "calibration", [helper.make_tensor_value_info(INPUT, TensorProto.FLOAT, shape)], outputs, inits
        )
        model = ort_compatible(helper.make_model(graph, opset_imports=opsets))
        options = ort.SessionOptions()
        options.log_severity_level = 3
        session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
        x = self.rng.standard_normal(shape, dtype=np.float32)
        results = session.run(None, {INPUT: x})
        for node, mean, var in zip(batchnorms, results[0::2], results[1::2], strict=True):
            self.arrays[node.input[3]] = mean.astype(np.float32)
            self.arrays[node.input[4]] = var.astype(np.float32)

    def _clip_attributes(self) -> None:
        """Before opset 11 Clip takes min / max as attributes."""
        for index, node in enumerate(self.nodes):
            if node.op_type == "Clip" and len(node.input) == 3:
                low, high = (float(self.arrays[name]) for name in node.input[1:])
                self.nodes[index] = helper.make_node(
                    "Clip", [node.input[0]], list(node.output), name=node.name, min=low, max=high
                )
        for name in self._relu6_bounds or ():
            del self.arrays[name]

    @staticmethod
    def _tensor(name: str, array: np.ndarray, dtype: type, elem_type: int) -> onnx.TensorProto:
        data = np.ascontiguousarray(array, dtype=dtype)
        return TensorProto(name=name, data_type=elem_type, dims=data.shape, raw_data=data.tobytes())


def _calibration_batch(
    nodes: list[onnx.NodeProto],
    inits: list[onnx.TensorProto],
    batchnorms: list[onnx.NodeProto],
    input_shape: Sequence[int | str],
) -> int:
    """Batch size giving every BN at least CALIBRATION_SAMPLES values per channel (at least 2 samples).

    Shape inference runs on a skeleton (initializers as typed inputs), so no weight is copied.
    """
    inputs = [helper.make_tensor_value_info(INPUT, TensorProto.FLOAT, [1, *input_shape[1:]])]
    inputs += [helper.make_tensor_value_info(t.name, t.data_type, list(t.dims)) for t in inits]
    skeleton = helper.make_model(
        helper.make_graph(nodes, "skeleton", inputs, []), opset_imports=[helper.make_opsetid("", DEFAULT_OPSET)]
    )
    inferred = onnx.shape_inference.infer_shapes(skeleton)
    dims = {info.name: [d.dim_value for d in info.type.tensor_type.shape.dim] for info in inferred.graph.value_info}
    fewest = CALIBRATION_SAMPLES
    for node in batchnorms:
        shape = dims.get(node.input[0])
        if shape and all(d > 0 for d in shape):
            fewest = min(fewest, math.prod(shape) // shape[1])
    return int(min(MAX_CALIBRATION_BATCH, max(2, math.ceil(CALIBRATION_SAMPLES / max(1, fewest)))))
