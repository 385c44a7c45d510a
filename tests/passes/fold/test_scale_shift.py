"""--standalone scale-shift: a BatchNormalization that cannot fold becomes Mul + Add, proven in onnxruntime."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from bnfuse.passes.optimize import optimize

ELEM = {np.float32: TensorProto.FLOAT, np.float16: TensorProto.FLOAT16, np.float64: TensorProto.DOUBLE}


def relu_bn_model(rank: int, dtype: type, opset: int) -> tuple[onnx.ModelProto, np.ndarray]:
    """x -> Relu -> BatchNormalization: the BN has no producer to fold into."""
    rng = np.random.default_rng(rank)
    channels = 5
    params = [
        rng.uniform(0.5, 2, channels),
        rng.normal(0, 1, channels),
        rng.normal(0, 1, channels),
        rng.uniform(0.2, 2, channels),
    ]
    names = ["scale", "bias", "mean", "var"]
    inits = [numpy_helper.from_array(p.astype(dtype), n) for p, n in zip(params, names, strict=True)]
    shape = [2, channels, *([3] * (rank - 2))]
    graph = helper.make_graph(
        [
            helper.make_node("Relu", ["x"], ["r"]),
            helper.make_node("BatchNormalization", ["r", *names], ["y"], name="bn", epsilon=1e-4),
        ],
        "g",
        [helper.make_tensor_value_info("x", ELEM[dtype], shape)],
        [helper.make_tensor_value_info("y", ELEM[dtype], shape)],
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 8
    x = np.random.default_rng(0).standard_normal(shape).astype(dtype)
    return model, x


def run(model: onnx.ModelProto, x: np.ndarray) -> np.ndarray:
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, {"x": x})[0]


@pytest.mark.parametrize("rank", [2, 3, 4, 5])
@pytest.mark.parametrize(("dtype", "rtol"), [(np.float32, 1e-6), (np.float16, 2e-3), (np.float64, 1e-13)])
@pytest.mark.parametrize("opset", [7, 15])
def test_unfoldable_batchnorm_becomes_mul_add(rank: int, dtype: type, rtol: float, opset: int) -> None:
    model, x = relu_bn_model(rank, dtype, opset)
    optimized, report = optimize(model, standalone="scale-shift")
    assert [n.op_type for n in optimized.graph.node] == ["Relu", "Mul", "Add"]
    (record,) = report.batchnorms
    assert record.status == "converted" and "Relu" in record.reason
    inits = {t.name: numpy_helper.to_array(t) for t in optimized.graph.initializer}
    mul_constant = inits[optimized.graph.node[1].input[1]]
    assert mul_constant.shape == (5,) + (1,) * (rank - 2) and mul_constant.dtype == dtype
    onnx.checker.check_model(optimized, full_check=True)
    want, got = run(model, x), run(optimized, x)
    np.testing.assert_allclose(got, want, rtol=rtol, atol=rtol * np.abs(want).max())


def test_keep_leaves_the_batchnorm_with_its_reason() -> None:
    model, _ = relu_bn_model(4, np.float32, 15)
    optimized, report = optimize(model)
    assert [n.op_type for n in optimized.graph.node] == ["Relu", "BatchNormalization"]
    assert report.batchnorms[0].status == "skipped"


def test_unknown_rank_is_not_converted() -> None:
    model, _ = relu_bn_model(4, np.float32, 15)
    relu = model.graph.node[0]
    relu.CopyFrom(helper.make_node("Reshape", ["x", "target"], ["r"]))  # rank decided at run time
    model.graph.input.append(helper.make_tensor_value_info("target", TensorProto.INT64, ["k"]))
    optimized, report = optimize(model, standalone="scale-shift")
    assert "BatchNormalization" in [n.op_type for n in optimized.graph.node]
    assert "input rank unknown" in report.batchnorms[0].reason
