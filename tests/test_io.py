"""bnfuse.io: clear errors on bad files, atomic saves, ORT-loadable IR version."""

import os
import stat
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from bnfuse.errors import ModelError
from bnfuse.io import MAX_IR_VERSION, load_model, read_model, save_model


def _relu_model() -> onnx.ModelProto:
    weight = numpy_helper.from_array(np.arange(6, dtype=np.float32).reshape(2, 3), "w")
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["y"])],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 2])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 3])],
        [weight],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_save_caps_ir_version_and_round_trips(tmp_path: Path) -> None:
    model = _relu_model()
    assert model.ir_version > MAX_IR_VERSION  # onnx 1.23 writes a version ORT 1.31 refuses
    out = save_model(model, tmp_path / "m.onnx")
    loaded = load_model(out)
    assert loaded.ir_version == MAX_IR_VERSION
    session = ort.InferenceSession(str(out), providers=["CPUExecutionProvider"])
    (y,) = session.run(None, {"x": np.array([[1.0, 2.0]], dtype=np.float32)})
    np.testing.assert_array_equal(y, [[6.0, 9.0, 12.0]])
    assert [p.name for p in tmp_path.iterdir()] == ["m.onnx"]  # no temporary left behind


def test_failed_save_leaves_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    target = tmp_path / "m.onnx"
    target.write_bytes(b"previous")

    def write_half_then_fail(model: onnx.ModelProto, path: str, **_: object) -> None:
        Path(path).write_bytes(model.SerializeToString()[:10])
        raise OSError("disk full")

    monkeypatch.setattr(onnx, "save_model", write_half_then_fail)
    with pytest.raises(OSError, match="disk full"):
        save_model(_relu_model(), target)
    assert target.read_bytes() == b"previous"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.onnx"]


@pytest.mark.parametrize(
    ("content", "message"),
    [(None, "no such file"), (b"\x08\x07garbage\xff\xff\xff", "not a readable ONNX model"), (b"", "not an ONNX model")],
)
def test_bad_files_raise_one_line(tmp_path: Path, content: bytes | None, message: str) -> None:
    path = tmp_path / "bad.onnx"
    if content is not None:
        path.write_bytes(content)
    with pytest.raises(ModelError, match=message) as info:
        load_model(path)
    assert "\n" not in str(info.value)


def test_truncated_model_is_reported(tmp_path: Path) -> None:
    path = tmp_path / "t.onnx"
    path.write_bytes(_relu_model().SerializeToString()[:-7])
    with pytest.raises(ModelError, match=f"^{path}: not a readable ONNX model \\(.+\\)$") as info:
        load_model(path)
    assert "\n" not in str(info.value)


def test_checker_message_keeps_the_node_name_on_one_line(tmp_path: Path) -> None:
    """onnx.checker puts the node name on a later line of its message; the one-line error keeps it."""
    model = _relu_model()
    model.graph.node[0].name = "the_matmul"
    model.graph.node[0].attribute.append(helper.make_attribute("bogus", 1))
    path = tmp_path / "m.onnx"
    onnx.save_model(model, str(path))
    with pytest.raises(ModelError, match="invalid ONNX model") as info:
        load_model(path)
    message = str(info.value)
    assert "\n" not in message and "Unrecognized attribute: bogus" in message and "Name: the_matmul" in message
    assert len(message) <= len(f"{path}: invalid ONNX model ()") + 300


def test_external_data_is_reported_and_kept_on_save(tmp_path: Path) -> None:
    weight = np.linspace(-1, 1, 2 * 600, dtype=np.float32).reshape(2, 600)
    model = _relu_model()
    model.graph.initializer[0].CopyFrom(numpy_helper.from_array(weight, "w"))
    model.graph.output[0].CopyFrom(helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 600]))
    inline = save_model(model, tmp_path / "inline.onnx")
    assert read_model(inline)[1] is False
    source = tmp_path / "in.onnx"
    onnx.save_model(model, str(source), save_as_external_data=True, location="in.bin", size_threshold=0)
    loaded, external = read_model(source)
    assert external is True
    np.testing.assert_array_equal(numpy_helper.to_array(loaded.graph.initializer[0]), weight)
    out = save_model(loaded, tmp_path / "sub" / "out.onnx", external_data=True)
    assert sorted(p.name for p in out.parent.iterdir()) == ["out.onnx", "out.onnx.data"]
    assert (out.parent / "out.onnx.data").stat().st_size == weight.nbytes
    assert read_model(out)[1] is True
    session = ort.InferenceSession(str(out), providers=["CPUExecutionProvider"])
    (y,) = session.run(None, {"x": np.array([[1.0, 2.0]], dtype=np.float32)})
    np.testing.assert_allclose(y[0], weight[0] + 2 * weight[1], rtol=1e-6)


def test_missing_external_data_file_is_a_model_error(tmp_path: Path) -> None:
    source = tmp_path / "in.onnx"
    onnx.save_model(_relu_model(), str(source), save_as_external_data=True, location="in.bin", size_threshold=0)
    (tmp_path / "in.bin").unlink()
    with pytest.raises(ModelError, match=f"^{source}: cannot read its external data"):
        load_model(source)


def test_model_and_extra_files_are_one_transaction(tmp_path: Path) -> None:
    """When the last file cannot be put in place, the model, its data and new directories go too."""
    (tmp_path / "taken").mkdir()
    with pytest.raises(IsADirectoryError) as info:
        save_model(
            _relu_model(),
            tmp_path / "new" / "m.onnx",
            external_data=True,
            extra_files={tmp_path / "other" / "r.json": b"{}", tmp_path / "taken": b"{}"},
        )
    assert info.value.filename == str(tmp_path / "taken")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["taken"]
    save_model(_relu_model(), tmp_path / "m.onnx", extra_files={tmp_path / "r.json": b"{}"})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.onnx", "r.json", "taken"]
    assert (tmp_path / "r.json").read_bytes() == b"{}"


def test_saved_file_gets_umask_permissions_not_mkstemp_0600(tmp_path: Path) -> None:
    previous = os.umask(0o022)
    try:
        path = save_model(_relu_model(), tmp_path / "m.onnx")
    finally:
        os.umask(previous)
    assert stat.S_IMODE(path.stat().st_mode) == 0o644


def test_model_over_the_protobuf_limit_is_saved_with_external_data(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from bnfuse import io

    weight = np.linspace(-1, 1, 2 * 600, dtype=np.float32).reshape(2, 600)
    model = _relu_model()
    model.graph.initializer[0].CopyFrom(numpy_helper.from_array(weight, "w"))
    model.graph.output[0].CopyFrom(helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 600]))
    monkeypatch.setattr(io, "_METADATA_MARGIN", 0)
    monkeypatch.setattr(io, "_PROTOBUF_LIMIT", weight.nbytes + 1)
    assert not io.exceeds_protobuf_limit(model)
    monkeypatch.setattr(io, "_PROTOBUF_LIMIT", weight.nbytes)
    assert io.exceeds_protobuf_limit(model)
    out = save_model(model, tmp_path / "big.onnx")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["big.onnx", "big.onnx.data"]
    assert (tmp_path / "big.onnx.data").stat().st_size == weight.nbytes
    assert len(model.graph.initializer[0].raw_data) == weight.nbytes  # the caller's model is untouched
    session = ort.InferenceSession(str(out), providers=["CPUExecutionProvider"])
    (y,) = session.run(None, {"x": np.array([[1.0, 2.0]], dtype=np.float32)})
    np.testing.assert_allclose(y[0], weight[0] + 2 * weight[1], rtol=1e-6)
