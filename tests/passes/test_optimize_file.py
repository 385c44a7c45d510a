"""optimize_file: the streamed file-to-file pass writes exactly what optimize + save_model writes."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest

import bnfuse.passes.optimize_file as optimize_file_module
from bnfuse.errors import CheckFailedError, ModelError
from bnfuse.io import save_model
from bnfuse.models import build
from bnfuse.passes.optimize import optimize
from bnfuse.passes.optimize_file import optimize_file


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture
def streamed_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fail if optimize_file falls back to the materializing path."""

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("optimize_file fell back to reading the whole model")

    monkeypatch.setattr(optimize_file_module, "read_model_files", refuse)


@pytest.mark.parametrize(
    ("name", "options"),
    [
        ("resnet18", {"width": 0.5}),  # conv weights above the scale kernel's 1 MiB threshold
        ("mobilenetv2", {"width": 0.5, "dtype": "float16"}),
        ("unet", {"width": 0.25}),  # ConvTranspose
        ("audio1d", {"width": 0.5}),
        ("mlp_gemm", {}),
        ("mlp_matmul", {}),
    ],
)
def test_streamed_output_is_byte_identical_to_optimize_and_save(tmp_path: Path, name: str, options: dict) -> None:
    source = save_model(build(name, **options), tmp_path / "in.onnx")
    before = _digest(source)
    reference, expected = optimize(source)
    save_model(reference, tmp_path / "reference.onnx")

    report = optimize_file(source, tmp_path / "out.onnx", full_check=True)

    assert _digest(tmp_path / "out.onnx") == _digest(tmp_path / "reference.onnx")
    assert _digest(source) == before  # the input is never modified
    assert report.batchnorms_after == 0 and report.batchnorms_before == expected.batchnorms_before > 0
    assert report.batchnorms == expected.batchnorms


def test_streamed_path_is_taken_and_the_written_model_runs(tmp_path: Path, streamed_only: None) -> None:
    original = build("resnet18", width=0.25, size=32)
    source = save_model(original, tmp_path / "in.onnx")
    optimize_file(source, tmp_path / "out.onnx", json_path=tmp_path / "r.json")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.onnx", "out.onnx", "r.json"]
    assert json.loads((tmp_path / "r.json").read_text())["batchnorms_after"] == 0
    x = np.random.default_rng(0).standard_normal((1, 3, 32, 32)).astype(np.float32)
    want = ort.InferenceSession(str(source), providers=["CPUExecutionProvider"]).run(None, {"input": x})[0]
    got = ort.InferenceSession(str(tmp_path / "out.onnx"), providers=["CPUExecutionProvider"]).run(None, {"input": x})
    np.testing.assert_allclose(got[0], want, rtol=1e-4, atol=1e-4 * np.abs(want).max())


def test_check_proves_the_written_file(tmp_path: Path, streamed_only: None) -> None:
    source = save_model(build("mlp_gemm"), tmp_path / "in.onnx")
    report = optimize_file(source, tmp_path / "out.onnx", check=True)
    assert report.check is not None and report.check.passed and report.check.outputs


def test_failed_check_leaves_nothing_behind(tmp_path: Path, streamed_only: None) -> None:
    source = save_model(build("mlp_gemm"), tmp_path / "in.onnx")
    with pytest.raises(CheckFailedError) as info:
        optimize_file(source, tmp_path / "out.onnx", json_path=tmp_path / "r.json", check=True, tolerance=1e-30)
    assert not info.value.report.check.passed
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.onnx"]


def test_external_data_input_keeps_external_data(tmp_path: Path) -> None:
    source = save_model(build("mlp_gemm"), tmp_path / "in.onnx", external_data=True)
    report = optimize_file(source, tmp_path / "out.onnx")
    assert report.external_data
    assert (tmp_path / "out.onnx.data").stat().st_size > 0
    loaded = onnx.load(str(tmp_path / "out.onnx"))
    assert not any(n.op_type == "BatchNormalization" for n in loaded.graph.node)


@pytest.mark.parametrize("content", [b"", b"garbage bytes", b"\x3a\xff\xff\xff\x0f"])
def test_bad_files_get_the_same_errors_as_optimize(tmp_path: Path, content: bytes) -> None:
    path = tmp_path / "bad.onnx"
    path.write_bytes(content)
    with pytest.raises(ModelError) as streamed:
        optimize_file(path, tmp_path / "out.onnx")
    with pytest.raises(ModelError) as direct:
        optimize(path)
    assert str(streamed.value) == str(direct.value)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.onnx"]


def test_negative_variance_is_refused_on_the_streamed_path(tmp_path: Path, streamed_only: None) -> None:
    model = build("resnet18", width=0.5)
    var = next(t for t in model.graph.initializer if t.name.endswith("var") and t.dims[0] >= 256)
    values = onnx.numpy_helper.to_array(var).copy()
    values[3] = -1.0
    var.CopyFrom(onnx.numpy_helper.from_array(values, var.name))
    source = save_model(model, tmp_path / "in.onnx")
    with pytest.raises(ModelError, match="variance"):
        optimize_file(source, tmp_path / "out.onnx")
    assert not (tmp_path / "out.onnx").exists()


def test_exported_as_bnfuse_optimize_file() -> None:
    import bnfuse

    assert bnfuse.optimize_file is optimize_file


def test_an_output_whose_structure_alone_passes_the_protobuf_limit_is_a_model_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import bnfuse.protowire as protowire

    monkeypatch.setattr(protowire, "_PROTOBUF_LIMIT", 1000)  # even without its weights (external data) it is too big
    source = save_model(build("mlp_gemm"), tmp_path / "in.onnx")
    with pytest.raises(ModelError, match="2 GiB protobuf limit"):
        optimize_file(source, tmp_path / "out.onnx", json_path=tmp_path / "r.json")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.onnx"]
