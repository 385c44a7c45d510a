"""bnfuse.protowire: weights as views of a read-only map on the way in, spliced from their buffers on the way out."""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from bnfuse.io import read_mapped, save_model
from bnfuse.models import build
from bnfuse.protowire import (
    MIN_PAYLOAD_BYTES,
    PayloadStore,
    WireFormatError,
    map_model,
    write_model,
)


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.mark.parametrize(
    ("name", "options"),
    [("resnet18", {"width": 0.25}), ("mobilenetv2", {"width": 0.5, "dtype": "float16"}), ("mlp_gemm", {})],
)
def test_map_then_write_reproduces_the_file_byte_for_byte(tmp_path: Path, name: str, options: dict) -> None:
    source = save_model(build(name, **options), tmp_path / "in.onnx")
    model, store = map_model(source)
    assert len(store), "large initializers are payloads"
    write_model(model, store, tmp_path / "out.onnx")
    assert _digest(tmp_path / "out.onnx") == _digest(source)


def test_payloads_are_read_only_views_of_the_file_with_the_loaded_values(tmp_path: Path) -> None:
    original = build("resnet18", width=0.25)
    source = save_model(original, tmp_path / "in.onnx")
    model, store = map_model(source)
    loaded = {t.name: numpy_helper.to_array(t) for t in original.graph.initializer}
    mapped = 0
    for tensor in model.graph.initializer:
        array = store.array(tensor)
        if array is None:  # small tensors stay inline, with their data
            assert len(tensor.raw_data) < MIN_PAYLOAD_BYTES
            continue
        mapped += 1
        assert not tensor.raw_data and tensor.data_location == TensorProto.EXTERNAL
        assert not array.flags.writeable and not array.flags.owndata  # a view, not a copy
        assert array.dtype == loaded[tensor.name].dtype
        np.testing.assert_array_equal(array, loaded[tensor.name])
    assert mapped == len(store) > 10
    assert model.ByteSize() < source.stat().st_size / 50  # the skeleton holds no weights


def test_new_arrays_are_spliced_in_as_raw_data(tmp_path: Path) -> None:
    weight = np.arange(4096, dtype=np.float32).reshape(64, 64)
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["y"])],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 64])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 64])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=10)
    store = PayloadStore()
    reference = store.add(model.graph.initializer, "w", weight * 2, TensorProto.FLOAT)
    assert store.array(model.graph.initializer[0]) is store.array(reference)
    assert not reference.external_data and not reference.raw_data  # the binding is not in the tensor
    write_model(model, store, tmp_path / "m.onnx")
    written = onnx.load(str(tmp_path / "m.onnx"))
    (tensor,) = written.graph.initializer
    assert tensor.data_location == TensorProto.DEFAULT and not tensor.external_data
    np.testing.assert_array_equal(numpy_helper.to_array(tensor), weight * 2)
    onnx.checker.check_model(written, full_check=True)


def test_negative_and_large_dims_survive_the_wire_scan(tmp_path: Path) -> None:
    # dims are int64 varints: check two's complement and multi-byte values through map + write
    values = np.ones((2, 70000), dtype=np.float32)
    tensor = numpy_helper.from_array(values, "big")
    odd = helper.make_tensor("odd", TensorProto.INT64, [1], [-5])
    graph = helper.make_graph(
        [helper.make_node("Identity", ["big"], ["y"])],
        "g",
        [],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 70000])],
        [tensor, odd],
    )
    source = tmp_path / "m.onnx"
    source.write_bytes(helper.make_model(graph, ir_version=10).SerializeToString())
    model, store = map_model(source)
    assert store.array(model.graph.initializer[0]).shape == (2, 70000)
    assert numpy_helper.to_array(model.graph.initializer[1]).tolist() == [-5]
    write_model(model, store, tmp_path / "out.onnx")
    assert _digest(tmp_path / "out.onnx") == _digest(source)


@pytest.mark.parametrize(
    "content",
    [b"", b"not an onnx model at all", b"\x3a\xff\xff\xff\x0f", b"\x08\x07\x3a\x02\x0a"],
    ids=["empty", "text", "graph-length-past-end", "truncated-graph"],
)
def test_unscannable_bytes_are_a_wire_format_error(tmp_path: Path, content: bytes) -> None:
    path = tmp_path / "bad.onnx"
    path.write_bytes(content)
    with pytest.raises(WireFormatError):
        map_model(path)
    assert read_mapped(path) is None  # the caller falls back to onnx.load, which names the problem


def test_external_data_models_are_left_to_onnx(tmp_path: Path) -> None:
    source = save_model(build("mlp_gemm"), tmp_path / "ext.onnx", external_data=True)
    assert read_mapped(source) is None
    assert read_mapped(tmp_path / "missing.onnx") is None
