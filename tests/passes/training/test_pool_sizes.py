"""pool_sizes.py: pooling sizes as onnxruntime and PyTorch compute them, and ceil_mode pools rewritten to attributes
ONNX shape inference agrees with, computing the same values (checked in onnxruntime, every small case)."""

from __future__ import annotations

import itertools

import numpy as np
import onnx
import onnxruntime
import pytest
from onnx import helper, shape_inference

from bnfuse.passes.training import pool_sizes

torch = pytest.importorskip("torch")
F = torch.nn.functional


def _cases() -> list[tuple[int, int, int, int, int]]:
    """(size, kernel, stride, pad, dilation) PyTorch accepts (pad at most half the window)."""
    return [
        (size, kernel, stride, pad, dilation)
        for size, kernel, stride, pad, dilation in itertools.product(
            range(1, 12), (1, 2, 3, 4), (1, 2, 3, 4), (0, 1, 2), (1, 2)
        )
        if pad <= kernel // 2 and size + 2 * pad >= dilation * (kernel - 1) + 1
    ]


def test_pool_output_size_is_pytorchs() -> None:
    """Every case, both modes, against max_pool1d's output size; ONNX's rule differs only where a window is dropped."""
    dropped = 0
    for (size, kernel, stride, pad, dilation), ceil in itertools.product(_cases(), (False, True)):
        want = F.max_pool1d(torch.zeros(1, 1, size), kernel, stride, pad, dilation, ceil_mode=ceil).shape[2]
        assert pool_sizes.pool_output_size(size, kernel, stride, pad, pad, dilation, ceil) == want
        onnx_size = pool_sizes.onnx_output_size(size, kernel, stride, pad, pad, dilation, ceil)
        assert onnx_size in (want, want + 1) and (onnx_size == want or ceil)
        dropped += onnx_size != want
    assert dropped > 20, dropped


def _pool_model(op: str, shape: list[int], **attributes: object) -> onnx.ModelProto:
    node = helper.make_node(op, ["x"], ["y"], **attributes)
    graph = helper.make_graph(
        [node],
        "pool",
        [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, shape)],
        [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, None)],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 19)])  # AveragePool dilations


def _run(model: onnx.ModelProto, x: np.ndarray) -> np.ndarray:
    session = onnxruntime.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, {"x": x})[0]


def _inferred(model: onnx.ModelProto) -> tuple[int, ...]:
    output = shape_inference.infer_shapes(model, strict_mode=True).graph.output[0]
    return tuple(d.dim_value for d in output.type.tensor_type.shape.dim)


POOLINGS = {  # op, extra attributes
    "max": ("MaxPool", {}),
    "avg-exclude": ("AveragePool", {"count_include_pad": 0}),
    "avg-include": ("AveragePool", {"count_include_pad": 1}),
    "lp": ("LpPool", {"p": 2}),
}


@pytest.mark.parametrize("pooling", sorted(POOLINGS))
def test_rewritten_pools_compute_the_same_values_at_the_size_onnx_infers(pooling: str) -> None:
    """Every small case whose last ceil_mode window starts in the end padding (2-D: that axis, and a plain one):
    the rewritten node's output in onnxruntime equals the original's, and ONNX shape inference gives its shape."""
    op, extra = POOLINGS[pooling]
    rng = np.random.default_rng(0)
    rewritten = floor_mode = 0
    for size, kernel, stride, pad, dilation in _cases():
        if op == "LpPool" and dilation > 1:
            continue  # onnxruntime's LpPool has no dilations
        if pool_sizes.onnx_output_size(size, kernel, stride, pad, pad, dilation, True) == pool_sizes.pool_output_size(
            size, kernel, stride, pad, pad, dilation, True
        ):
            continue
        shape = [2, 3, size, 5]
        attributes = {
            "kernel_shape": [kernel, 2],
            "strides": [stride, 1],
            "pads": [pad, 0, pad, 1],
            "ceil_mode": 1,
            **({"dilations": [dilation, 1]} if dilation > 1 else {}),
            **extra,
        }
        model = _pool_model(op, shape, **attributes)
        found = pool_sizes.runtime_pool_attributes(model.graph.node[0], shape)
        assert found is not None, (size, kernel, stride, pad, dilation)
        pads, ceil = found
        assert pads[:2] == [pad, 0] and pads[2] <= pad and pads[3] <= 1, pads
        before = onnx.ModelProto()
        before.CopyFrom(model)
        assert pool_sizes.match_pool_sizes(model, {"x": (tuple(shape), onnx.TensorProto.FLOAT)}) == 1
        x = rng.standard_normal(shape).astype(np.float32)
        want, got = _run(before, x), _run(model, x)
        assert got.shape == want.shape == _inferred(model), (got.shape, want.shape, _inferred(model))
        np.testing.assert_array_equal(got, want, err_msg=str((size, kernel, stride, pad, dilation)))
        rewritten += 1
        floor_mode += not ceil
    assert rewritten >= 10 and floor_mode >= 1, (rewritten, floor_mode)


def test_pools_onnx_sizes_right_are_left_alone() -> None:
    """Floor mode, and ceil_mode whose windows all start inside: no rewrite, the attributes as they were."""
    for attributes in (
        {"kernel_shape": [2, 2], "strides": [2, 2], "pads": [1, 1, 1, 1]},
        {"kernel_shape": [3, 3], "strides": [2, 2], "ceil_mode": 1},
    ):
        model = _pool_model("AveragePool", [1, 2, 8, 8], **attributes)
        before = model.SerializeToString()
        assert pool_sizes.match_pool_sizes(model, {"x": ((1, 2, 8, 8), onnx.TensorProto.FLOAT)}) == 0
        assert model.SerializeToString() == before


def test_declared_shapes_after_a_rewritten_pool_are_dropped() -> None:
    """An exporter's value_info after the pool holds ONNX's wrong size: dropped with the rewrite, others kept."""
    model = _pool_model("MaxPool", [1, 1, 5, 5], kernel_shape=[2, 2], strides=[2, 2], pads=[1, 1, 1, 1], ceil_mode=1)
    relu = helper.make_node("Relu", ["y"], ["z"])
    model.graph.node.append(relu)
    model.graph.output[0].name = "z"
    model.graph.value_info.extend(
        [
            helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [1, 1, 4, 4]),
            helper.make_tensor_value_info("z", onnx.TensorProto.FLOAT, [1, 1, 4, 4]),
            helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [1, 1, 5, 5]),
        ]
    )
    assert pool_sizes.match_pool_sizes(model, {"x": ((1, 1, 5, 5), onnx.TensorProto.FLOAT)}) == 1
    assert [v.name for v in model.graph.value_info] == ["x"]
    assert _inferred(model) == (1, 1, 3, 3)
