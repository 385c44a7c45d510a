"""`bnfuse optimize` never loses or falsifies data, and every bad input is one line with exit 2.

Each refusal is checked the same way: exit 2, exactly one line on stderr (no traceback, no warning, no
onnxruntime log), the input's files (model and external data) byte-for-byte unchanged, nothing new left in
the directory.
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from bnfuse.cli import main

ROOT = Path(__file__).resolve().parents[1]
CHANNELS = 64  # 64 x 3 x 3 x 3 float32 = 6912 bytes: above the 4 KiB mapped-payload and checker thresholds


def conv_bn_model(channels: int = CHANNELS) -> onnx.ModelProto:
    rng = np.random.default_rng(0)
    inits = [
        numpy_helper.from_array(rng.normal(0, 1, (channels, 3, 3, 3)).astype(np.float32), "w"),
        numpy_helper.from_array(rng.uniform(0.5, 1.5, channels).astype(np.float32), "s"),
        numpy_helper.from_array(rng.normal(0, 0.1, channels).astype(np.float32), "b"),
        numpy_helper.from_array(rng.normal(0, 0.1, channels).astype(np.float32), "m"),
        numpy_helper.from_array(rng.uniform(0.5, 1.5, channels).astype(np.float32), "v"),
    ]
    graph = helper.make_graph(
        [
            helper.make_node("Conv", ["x", "w"], ["c"], name="conv"),
            helper.make_node("BatchNormalization", ["c", "s", "b", "m", "v"], ["y"], name="bn"),
        ],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 3, "h", "w"])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", channels, "h2", "w2"])],
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model


def write(model: onnx.ModelProto, path: Path) -> Path:
    path.write_bytes(model.SerializeToString())
    return path


def write_external(model: onnx.ModelProto, path: Path, location: str) -> list[Path]:
    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    onnx.save_model(copy, str(path), save_as_external_data=True, location=location, size_threshold=0)
    return [path, path.parent / location]


def digests(paths: list[Path]) -> dict[Path, str]:
    return {p: hashlib.sha256(p.read_bytes()).hexdigest() for p in paths}


def listing(directory: Path) -> list[str]:
    return sorted(str(p.relative_to(directory)) for p in directory.rglob("*"))


def assert_refused(capfd: pytest.CaptureFixture[str], argv: list[str], inputs: list[Path], expected: str) -> str:
    """Run the CLI; assert exit 2, one line containing ``expected``, inputs unchanged, nothing new on disk."""
    directory = inputs[0].parent
    before, files = digests(inputs), listing(directory)
    assert main(argv) == 2
    err = capfd.readouterr().err
    assert err.count("\n") == 1 and err.startswith("bnfuse optimize: error: "), err
    assert expected in err, err
    assert "Traceback" not in err and "Warning" not in err
    assert digests(inputs) == before
    assert listing(directory) == files
    return err


# --- data must never be lost or falsified --------------------------------------------------------


def test_output_over_the_inputs_external_data_is_refused(tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    # A renamed model: m_orig.onnx keeps its weights in m.onnx.data, so `-o m.onnx` would write m.onnx.data.
    inputs = write_external(conv_bn_model(), tmp_path / "m_orig.onnx", "m.onnx.data")
    argv = ["optimize", str(inputs[0]), "-o", str(tmp_path / "m.onnx")]
    assert_refused(capfd, argv, inputs, "refusing to overwrite the input model's external data")
    argv = ["optimize", str(inputs[0]), "-o", str(tmp_path / "m.onnx.data")]
    assert_refused(capfd, argv, inputs, "refusing to overwrite the input model's external data")
    argv = ["optimize", str(inputs[0]), "-o", str(tmp_path / "o.onnx"), "--json", str(tmp_path / "m.onnx.data")]
    assert_refused(capfd, argv, inputs, "refusing to overwrite the input model's external data")


def test_every_spelling_of_the_input_is_refused(tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "sub").mkdir()
    source = write(conv_bn_model(), tmp_path / "m.onnx")
    (tmp_path / "link").symlink_to(tmp_path)  # a directory link: the same file under another name
    for spelling in [tmp_path / "sub" / ".." / "m.onnx", tmp_path / "link" / "m.onnx"]:
        assert_refused(capfd, ["optimize", str(source), "-o", str(spelling)], [source], "refusing to overwrite")


def test_json_over_the_output_or_its_data_file_is_refused(tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    source = write(conv_bn_model(), tmp_path / "m.onnx")
    out = tmp_path / "o.onnx"
    assert_refused(capfd, ["optimize", str(source), "-o", str(out), "--json", str(out)], [source], "named as both")
    argv = ["optimize", str(source), "-o", str(out), "--json", str(tmp_path / "o.onnx.data")]
    assert_refused(capfd, argv, [source], "named as both the JSON report and the output's data file")


@pytest.mark.parametrize("location", ["bnfuse-payload:0", "bnfuse-payload:7", "bnfuse-payload:x"])
def test_a_location_naming_an_internal_reference_is_only_a_file_name(
    tmp_path: Path, capfd: pytest.CaptureFixture[str], location: str
) -> None:
    """The mapped reader's weight references are not strings: a crafted location cannot reach another tensor."""
    model = conv_bn_model()
    scale = model.graph.initializer[1]
    scale.ClearField("raw_data")
    scale.data_location = TensorProto.EXTERNAL
    scale.external_data.add(key="location", value=location)
    source = write(model, tmp_path / "m.onnx")
    argv = ["optimize", str(source), "-o", str(tmp_path / "o.onnx")]
    assert_refused(capfd, argv, [source], f"cannot read its external data ({tmp_path / location}: no such file)")


def test_a_crafted_location_that_exists_as_a_file_is_read_as_that_file(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    model = conv_bn_model()
    values = numpy_helper.to_array(model.graph.initializer[1]) * 2
    scale = model.graph.initializer[1]
    scale.ClearField("raw_data")
    scale.data_location = TensorProto.EXTERNAL
    scale.external_data.add(key="location", value="bnfuse-payload:0")
    source = write(model, tmp_path / "m.onnx")
    (tmp_path / "bnfuse-payload:0").write_bytes(values.tobytes())
    out = tmp_path / "o.onnx"
    assert main(["optimize", str(source), "-o", str(out)]) == 0
    capfd.readouterr()
    reference = conv_bn_model()
    reference.graph.initializer[1].CopyFrom(numpy_helper.from_array(values, "s"))
    x = np.random.default_rng(1).normal(0, 1, (1, 3, 8, 8)).astype(np.float32)
    (want,) = ort.InferenceSession(reference.SerializeToString(), providers=["CPUExecutionProvider"]).run(
        None, {"x": x}
    )
    (got,) = ort.InferenceSession(str(out), providers=["CPUExecutionProvider"]).run(None, {"x": x})
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * float(np.abs(want).max()))


@pytest.mark.parametrize(
    ("location", "expected"),
    [
        ("/etc/hostname", "is not a relative path inside the model's directory"),
        ("../outside.data", "is not a relative path inside the model's directory"),
        ("sub/../../outside.data", "is not a relative path inside the model's directory"),
        ("escape.data", "leads out of the model's directory"),  # a link in the directory pointing outside
        ("", "is not a relative path inside the model's directory"),
    ],
)
def test_external_data_must_be_a_file_inside_the_models_directory(
    tmp_path: Path, capfd: pytest.CaptureFixture[str], location: str, expected: str
) -> None:
    (tmp_path / "outside.data").write_bytes(bytes(1 << 16))
    models = tmp_path / "models"
    models.mkdir()
    (models / "escape.data").symlink_to(tmp_path / "outside.data")
    model = conv_bn_model()
    tensor = model.graph.initializer[0]
    tensor.ClearField("raw_data")
    tensor.data_location = TensorProto.EXTERNAL
    tensor.external_data.add(key="location", value=location)
    source = write(model, models / "m.onnx")
    assert_refused(capfd, ["optimize", str(source), "-o", str(models / "o.onnx")], [source], expected)


def test_output_onto_a_device_or_fifo_is_refused(tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    source = write(conv_bn_model(), tmp_path / "m.onnx")
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    assert_refused(capfd, ["optimize", str(source), "-o", str(fifo)], [source], "not a regular file")
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode)
    assert_refused(capfd, ["optimize", str(source), "-o", "/dev/null"], [source], "not a regular file")
    assert stat.S_ISCHR(os.lstat("/dev/null").st_mode)
    argv = ["optimize", str(source), "-o", str(tmp_path / "o.onnx"), "--json", str(fifo)]
    assert_refused(capfd, argv, [source], "not a regular file")


def test_output_onto_a_symlink_is_refused_and_the_link_kept(tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    source = write(conv_bn_model(), tmp_path / "m.onnx")
    target = tmp_path / "target.onnx"
    target.write_bytes(b"keep me")
    link = tmp_path / "link.onnx"
    link.symlink_to(target)
    assert_refused(capfd, ["optimize", str(source), "-o", str(link)], [source], "is a symbolic link")
    assert link.is_symlink() and target.read_bytes() == b"keep me"


# --- every bad input: one line, exit 2 -----------------------------------------------------------


def _edited(edit: str) -> onnx.ModelProto:
    model = conv_bn_model()
    weight = model.graph.initializer[0]
    if edit == "raw-long":
        weight.raw_data += bytes(8)
    elif edit == "raw-short":
        weight.raw_data = weight.raw_data[:-8]
    elif edit == "negative-dim":
        weight.dims[0] = -CHANNELS
    elif edit == "wrapping-dims":
        del weight.dims[:]
        weight.dims.extend([2**62, 4, 1, 2, 3 * 3 * 3 * CHANNELS // 8])  # int64 product wraps to 1728
    elif edit == "raw-and-float":
        weight.float_data.extend([1.0] * (CHANNELS * 27))
    return model


@pytest.mark.parametrize(
    ("edit", "expected"),
    [
        ("raw-long", "raw_data holds 6920 bytes but its dims and type need 6912"),
        ("raw-short", "raw_data holds 6904 bytes but its dims and type need 6912"),
        ("negative-dim", "negative dimension -64"),
        ("wrapping-dims", "hold more than 2^63 elements"),
        ("raw-and-float", "holds its values twice (raw_data and float_data)"),
    ],
)
def test_inconsistent_tensor_data_is_one_line(
    tmp_path: Path, capfd: pytest.CaptureFixture[str], edit: str, expected: str
) -> None:
    source = write(_edited(edit), tmp_path / "m.onnx")
    assert_refused(capfd, ["optimize", str(source), "-o", str(tmp_path / "o.onnx")], [source], expected)


@pytest.mark.parametrize(("length", "offset"), [(6912 + 4, 0), (6912 - 4, 0), (6912, 10**6)])
def test_external_length_and_offset_must_fit_the_tensor(
    tmp_path: Path, capfd: pytest.CaptureFixture[str], length: int, offset: int
) -> None:
    inputs = write_external(conv_bn_model(), tmp_path / "m.onnx", "m.data")
    model = onnx.load(str(inputs[0]), load_external_data=False)
    for entry in model.graph.initializer[0].external_data:
        if entry.key == "length":
            entry.value = str(length)
        if entry.key == "offset":
            entry.value = str(offset)
    write(model, inputs[0])
    expected = "past the end of its file" if offset else f"external data length {length} but its dims and type need"
    assert_refused(capfd, ["optimize", str(inputs[0]), "-o", str(tmp_path / "o.onnx")], inputs, expected)


def test_invalid_utf8_name_is_one_line(tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    source = tmp_path / "m.onnx"
    source.write_bytes(conv_bn_model().SerializeToString().replace(b"conv", b"co\xffv"))
    argv = ["optimize", str(source), "-o", str(tmp_path / "o.onnx")]
    assert_refused(capfd, argv, [source], "NodeProto.name b'co\\xffv' is not valid UTF-8 text")


def test_output_names_up_to_255_bytes_work_and_longer_ones_are_one_line(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    source = write(conv_bn_model(), tmp_path / "m.onnx")
    longest = tmp_path / ("a" * 250 + ".onnx")  # the temporary file's name must not be longer than this
    assert main(["optimize", str(source), "-o", str(longest)]) == 0
    assert longest.exists()
    longest.unlink()
    capfd.readouterr()
    too_long = tmp_path / ("a" * 251 + ".onnx")
    assert_refused(capfd, ["optimize", str(source), "-o", str(too_long)], [source], "File name too long")


def test_negative_seed_is_one_line(tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    source = write(conv_bn_model(), tmp_path / "m.onnx")
    argv = ["optimize", str(source), "-o", str(tmp_path / "o.onnx"), "--check", "--seed", "-1"]
    assert_refused(capfd, argv, [source], "--seed -1: must be a non-negative integer")


def test_unallocatable_input_shape_says_the_memory_needed(tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    source = write(conv_bn_model(), tmp_path / "m.onnx")
    argv = ["optimize", str(source), "-o", str(tmp_path / "o.onnx"), "--check"]
    argv += ["--input-shape", "x:100000x3x100000x100000"]
    err = assert_refused(capfd, argv, [source], "x=100000x3x100000x100000) need 22,351,741.8 GiB of memory")
    assert "--input-shape" in err


def test_signalling_nan_variance_is_one_line_without_a_warning(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    model = conv_bn_model()
    variance = numpy_helper.to_array(model.graph.initializer[4]).copy()
    variance.view(np.uint32)[3] = 0x7F800001  # a signalling NaN: widening it to float64 warns in NumPy
    model.graph.initializer[4].CopyFrom(numpy_helper.from_array(variance, "v"))
    source = write(model, tmp_path / "m.onnx")
    assert_refused(capfd, ["optimize", str(source), "-o", str(tmp_path / "o.onnx")], [source], "NaN")


@pytest.mark.parametrize("kind", ["fifo", "char-device"])
def test_non_regular_input_is_refused_without_reading(tmp_path: Path, kind: str) -> None:
    if kind == "fifo":
        source = tmp_path / "pipe.onnx"
        os.mkfifo(source)  # opening it for reading would block forever
    else:
        source = Path("/dev/zero")  # reading it never ends
    argv = [sys.executable, "-m", "bnfuse.cli", "optimize", str(source), "-o", str(tmp_path / "o.onnx")]
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    done = subprocess.run(argv, capture_output=True, text=True, timeout=60, env=env)
    assert done.returncode == 2
    assert (
        done.stderr
        == f"bnfuse optimize: error: {source}: not a regular file (a device, FIFO or socket); refusing to read it\n"
    )
    assert not (tmp_path / "o.onnx").exists()


# --- real-world paths ----------------------------------------------------------------------------


def test_external_data_input_with_output_in_the_working_directory(
    tmp_path: Path, capfd: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "in").mkdir()
    inputs = write_external(conv_bn_model(), tmp_path / "in" / "m.onnx", "m.onnx.data")
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    before = digests(inputs)
    assert main(["optimize", str(inputs[0]), "-o", "o.onnx", "--check"]) == 0
    assert "tensors in o.onnx.data" in capfd.readouterr().out
    assert sorted(os.listdir(work)) == ["o.onnx", "o.onnx.data"]
    assert digests(inputs) == before
    session = ort.InferenceSession("o.onnx", providers=["CPUExecutionProvider"])
    assert [n.op_type for n in onnx.load("o.onnx").graph.node] == ["Conv"]
    assert session.run(None, {"x": np.zeros((1, 3, 5, 5), np.float32)})[0].shape == (1, CHANNELS, 3, 3)


def test_an_output_past_2_gib_is_written_with_external_data(
    tmp_path: Path, capfd: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import bnfuse.protowire as protowire

    monkeypatch.setattr(protowire, "_PROTOBUF_LIMIT", 4000)  # as if folding had grown the model past 2 GiB
    source = write(conv_bn_model(), tmp_path / "m.onnx")
    out = tmp_path / "o.onnx"
    assert main(["optimize", str(source), "-o", str(out), "--check", "--json", str(tmp_path / "r.json")]) == 0
    assert f"wrote {out} (tensors in o.onnx.data: the model outgrew protobuf's 2 GiB limit)" in capfd.readouterr().out
    assert json.loads((tmp_path / "r.json").read_text())["external_data_reason"] == "2 GiB"
    assert sorted(os.listdir(tmp_path)) == ["m.onnx", "o.onnx", "o.onnx.data", "r.json"]
    weight = onnx.load(str(out), load_external_data=False).graph.initializer[0]
    assert {e.key: e.value for e in weight.external_data}["location"] == "o.onnx.data"
    x = np.random.default_rng(0).normal(0, 1, (1, 3, 6, 6)).astype(np.float32)
    (want,) = ort.InferenceSession(str(source), providers=["CPUExecutionProvider"]).run(None, {"x": x})
    (got,) = ort.InferenceSession(str(out), providers=["CPUExecutionProvider"]).run(None, {"x": x})
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * float(np.abs(want).max()))


def test_constant_expansion_stops_at_the_total_budget(
    tmp_path: Path, capfd: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A few bytes of ConstantOfShape per layer may not add up to unbounded memory: past the budget, BN stays."""
    import bnfuse.passes.constants as constants

    monkeypatch.setattr(constants, "MAX_MATERIALIZED_BYTES", 3 * 64 * 64 * 9 * 4 - 1)  # room for two weights
    nodes, inits, x = [], [numpy_helper.from_array(np.array([64, 64, 3, 3], np.int64), "shape")], "x"
    for i in range(3):
        fill = numpy_helper.from_array(np.array([0.01 * (i + 1)], np.float32), "value")
        nodes.append(helper.make_node("ConstantOfShape", ["shape"], [f"w{i}"], value=fill))
        nodes.append(helper.make_node("Conv", [x, f"w{i}"], [f"c{i}"], name=f"conv{i}", pads=[1, 1, 1, 1]))
        names = [f"bn{i}.{p}" for p in "sbmv"]
        inits += [
            numpy_helper.from_array(np.full(64, v, np.float32), n)
            for n, v in zip(names, (1.5, 0.1, 0.2, 2.0), strict=True)
        ]
        x = f"y{i}"
        nodes.append(helper.make_node("BatchNormalization", [f"c{i}", *names], [x], name=f"bn{i}"))
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 64, 4, 4])],
        [helper.make_tensor_value_info(x, TensorProto.FLOAT, [1, 64, 4, 4])],
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    source = write(model, tmp_path / "m.onnx")
    report = tmp_path / "r.json"
    assert main(["optimize", str(source), "-o", str(tmp_path / "o.onnx"), "--check", "--json", str(report)]) == 0
    records = {r["node"]: r for r in json.loads(report.read_text())["batchnorms"]}
    assert [records[f"bn{i}"]["status"] for i in range(3)] == ["folded", "folded", "skipped"]
    assert "expanding its constant subgraph would pass the 0 MiB budget" in records["bn2"]["reason"]


def test_a_batchnorm_with_non_vector_parameters_is_kept_as_written(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    """onnxruntime refuses BN parameters that are not 1-D; folding them would turn a model that does not run
    into one that runs with a guessed meaning (found by fuzzing: a bias of shape [C, 1])."""
    model = conv_bn_model()
    model.opset_import[0].version = 13  # BatchNormalization-15's shape inference would refuse the input itself
    bias = numpy_helper.to_array(model.graph.initializer[2]).reshape(CHANNELS, 1)
    model.graph.initializer[2].CopyFrom(numpy_helper.from_array(bias, "b"))
    source = write(model, tmp_path / "m.onnx")
    report = tmp_path / "r.json"
    assert main(["optimize", str(source), "-o", str(tmp_path / "o.onnx"), "--json", str(report)]) == 0
    (record,) = json.loads(report.read_text())["batchnorms"]
    assert record["status"] == "skipped"
    shapes = f"[{CHANNELS}], [{CHANNELS}, 1], [{CHANNELS}], [{CHANNELS}]"
    assert record["reason"] == f"scale, bias, mean and variance must be 1-D [C] (shapes {shapes})"
    assert [n.op_type for n in onnx.load(str(tmp_path / "o.onnx")).graph.node] == ["Conv", "BatchNormalization"]
