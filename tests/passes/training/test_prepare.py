"""prepare.py's static shapes: ceil_mode pooling at the size onnxruntime's kernels and PyTorch give, not ONNX shape
inference's (which keeps a last window starting in the end padding), and everything after such a pool inferred from
that size."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime
import pytest
from onnx import helper, numpy_helper

from bnfuse.passes.training import prepare


def _pool(op: str, name: str, source: str, **attributes: object) -> onnx.NodeProto:
    return helper.make_node(op, [source], [name], name=name, **attributes)


def _chain() -> onnx.ModelProto:
    """AveragePool -> MaxPool -> LpPool, each with a ceil_mode window that would start in the end padding, then a Conv
    and a Reshape to a constant (N, -1): each size feeds the next."""
    nodes = [
        _pool("AveragePool", "avg", "x", kernel_shape=[2, 2], strides=[2, 2], pads=[1, 1, 1, 1], ceil_mode=1),
        _pool("MaxPool", "max", "avg", kernel_shape=[2, 1], strides=[2, 1], pads=[1, 0, 1, 0], ceil_mode=1),
        _pool("LpPool", "lp", "max", kernel_shape=[1, 1], strides=[2, 2], ceil_mode=1),
        helper.make_node("Conv", ["lp", "w"], ["conv"], name="conv", pads=[1, 1, 1, 1]),
        helper.make_node("Reshape", ["conv", "flat"], ["y"], name="reshape"),
    ]
    weights = [
        numpy_helper.from_array(np.ones((4, 3, 3, 3), np.float32), "w"),
        numpy_helper.from_array(np.array([2, -1], np.int64), "flat"),
    ]
    graph = helper.make_graph(
        nodes,
        "pools",
        [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [2, 3, 13, 9])],
        [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, None)],
        weights,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


def test_static_shapes_of_ceil_mode_pools_are_onnxruntimes() -> None:
    model = _chain()
    shapes = prepare.infer_static_shapes(model)
    names = ["avg", "max", "lp", "conv", "y"]
    probe = onnx.ModelProto()
    probe.CopyFrom(model)
    probe.graph.output.extend(helper.make_tensor_value_info(n, onnx.TensorProto.FLOAT, None) for n in names[:-1])
    session = onnxruntime.InferenceSession(probe.SerializeToString(), providers=["CPUExecutionProvider"])
    x = np.random.default_rng(0).standard_normal((2, 3, 13, 9)).astype(np.float32)
    actual = dict(zip(["y", *names[:-1]], session.run(None, {"x": x}), strict=True))
    for name in names:
        assert shapes[name][0] == actual[name].shape, (name, shapes[name], actual[name].shape)
    assert shapes["avg"][0] == (2, 3, 7, 5) and shapes["y"][0] == (2, 4 * 2 * 3)  # ONNX alone: (2, 3, 8, 6) ... (2, 48)
    assert all(not name.endswith(prepare.CUT_SUFFIX) for name in shapes)


def test_shapes_without_a_dropped_window_are_onnxs() -> None:
    """A ceil_mode pool whose windows all start inside (and a floor-mode one): inference runs once, unchanged."""
    nodes = [
        _pool("AveragePool", "avg", "x", kernel_shape=[3, 3], strides=[2, 2], ceil_mode=1),
        _pool("MaxPool", "y", "avg", kernel_shape=[2, 2], strides=[2, 2], pads=[1, 1, 1, 1]),
    ]
    graph = helper.make_graph(
        nodes,
        "pools",
        [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [1, 2, 8, 8])],
        [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, None)],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    shapes = prepare.infer_static_shapes(model)
    assert shapes["avg"][0] == (1, 2, 4, 4) and shapes["y"][0] == (1, 2, 3, 3)


def test_a_reshape_to_the_runtime_size_after_a_ceil_mode_pool_is_inferred() -> None:
    """BatchNorm1d on a pooled map's (N, C, H*W) view, exported with PyTorch's size as a constant: ONNX's inference of
    the model as it is fails at that Reshape (-1 x 3 x 9 of 2 x 3 x 4 x 4); at the runtime's size, not."""
    nodes = [
        _pool("AveragePool", "avg", "x", kernel_shape=[2, 2], strides=[2, 2], pads=[1, 1, 1, 1], ceil_mode=1),
        helper.make_node("Reshape", ["avg", "view"], ["y"], name="view"),
    ]
    graph = helper.make_graph(
        nodes,
        "pools",
        [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [2, 3, 5, 5])],
        [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, None)],
        [numpy_helper.from_array(np.array([-1, 3, 9], np.int64), "view")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    with pytest.raises(onnx.shape_inference.InferenceError):
        onnx.shape_inference.infer_shapes(model, strict_mode=True, data_prop=True)
    shapes = prepare.infer_static_shapes(model)
    assert shapes["avg"][0] == (2, 3, 3, 3) and shapes["y"][0] == (2, 3, 9)
