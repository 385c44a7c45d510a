"""bnfuse.models registry and every builder: valid ONNX (full checker), runnable in onnxruntime, published sizes."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import numpy_helper

from bnfuse.errors import BnfuseError
from bnfuse.io import MAX_IR_VERSION
from bnfuse.models import REGISTRY, build, names, parameter_bytes, parameter_count, spec, write

# Published parameter counts (torchvision; BN running statistics are buffers, not parameters).
PUBLISHED = {"resnet18": 11_689_512, "resnet50": 25_557_032, "mobilenetv2": 3_504_872, "densenet121": 7_978_856}
BATCHNORMS = {
    "resnet18": 20, "resnet50": 53, "mobilenetv2": 52, "densenet121": 121, "unet": 22,
    "audio1d": 4, "r3d18": 20, "mlp_gemm": 3, "mlp_matmul": 3, "digits_cnn": 3,
}  # fmt: skip


def run(model: onnx.ModelProto, batch: int = 2, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    info = session.get_inputs()[0]
    shape = [d if isinstance(d, int) else batch for d in info.shape]
    dtype = np.float16 if info.type == "tensor(float16)" else np.float32
    x = np.random.default_rng(seed).standard_normal(shape).astype(dtype)
    return x, session.run(None, {info.name: x})[0]


def batchnorm_params(model: onnx.ModelProto) -> dict[str, np.ndarray]:
    inits = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    params: dict[str, list[np.ndarray]] = {"scale": [], "bias": [], "mean": [], "var": []}
    for node in model.graph.node:
        if node.op_type == "BatchNormalization":
            for key, name in zip(params, node.input[1:], strict=True):
                params[key].append(inits[name].astype(np.float64))
    return {key: np.concatenate(values) for key, values in params.items()}


def test_registry_lists_every_builder_with_a_description() -> None:
    assert names() == list(REGISTRY)
    assert set(names()) == set(BATCHNORMS)
    assert all(REGISTRY[n].description and REGISTRY[n].small for n in names())


@pytest.mark.parametrize("name", names())
def test_small_model_passes_full_checker_and_runs(name: str) -> None:
    model = build(name, **spec(name).small)
    onnx.checker.check_model(model, full_check=True)
    assert model.ir_version <= MAX_IR_VERSION
    assert [o.version for o in model.opset_import if o.domain == ""] == [17]
    assert sum(n.op_type == "BatchNormalization" for n in model.graph.node) == BATCHNORMS[name]
    _, y = run(model)
    assert y.shape[0] == 2 and np.all(np.isfinite(y))
    # Calibrated statistics keep the output O(1) instead of growing with depth.
    assert 0.05 < float(np.std(y)) < 20


@pytest.mark.parametrize("name", names())
def test_batchnorm_statistics_are_not_trivial(name: str) -> None:
    params = batchnorm_params(build(name, **spec(name).small))
    assert np.all(params["var"] > 0)
    assert np.abs(params["mean"]).max() > 0.05, "means != 0"
    assert np.abs(params["var"] - 1).max() > 0.1, "variances != 1"
    assert np.abs(params["scale"] - 1).max() > 0.1, "scales != 1"
    assert np.abs(params["bias"]).max() > 0.05


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_full_size_parameter_count_matches_published(name: str) -> None:
    model = build(name)
    assert parameter_count(model) == PUBLISHED[name]
    dims = {t.name: list(t.dims) for t in model.graph.initializer}
    channels = sum(dims[n.input[3]][0] for n in model.graph.node if n.op_type == "BatchNormalization")
    assert parameter_count(model, statistics=True) - parameter_count(model) == 2 * channels


def test_resnet50_is_about_100_megabytes_and_runs_at_full_size() -> None:
    model = build("resnet50", batch=1)
    assert 100e6 < parameter_bytes(model) < 105e6
    x, y = run(model, batch=1)
    assert x.shape == (1, 3, 224, 224) and y.shape == (1, 1000)
    assert np.all(np.isfinite(y))


def test_mobilenet_uses_depthwise_convs_and_clip() -> None:
    model = build("mobilenetv2", **spec("mobilenetv2").small)
    groups = [
        a.i for n in model.graph.node if n.op_type == "Conv" for a in n.attribute if a.name == "group" and a.i > 1
    ]
    assert len(groups) == 17
    clips = [n for n in model.graph.node if n.op_type == "Clip"]
    assert len(clips) == 35 and all(len(c.input) == 3 for c in clips)


def test_clip_bounds_are_attributes_before_opset_11() -> None:
    model = build("mobilenetv2", opset=10, **spec("mobilenetv2").small)
    onnx.checker.check_model(model, full_check=True)
    clips = [n for n in model.graph.node if n.op_type == "Clip"]
    assert clips and all(len(c.input) == 1 for c in clips)
    assert {(a.name, a.f) for a in clips[0].attribute} == {("min", 0.0), ("max", 6.0)}
    _, y10 = run(model)
    _, y17 = run(build("mobilenetv2", **spec("mobilenetv2").small))
    np.testing.assert_allclose(y10, y17, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("opset", [7, 9, 13, 21])
def test_other_opsets(opset: int) -> None:
    model = build("resnet18", opset=opset, **spec("resnet18").small)
    onnx.checker.check_model(model, full_check=True)
    assert model.opset_import[0].version == opset
    run(model)


@pytest.mark.parametrize("name", ["resnet18", "unet", "mlp_matmul"])
def test_float16_matches_float32(name: str) -> None:
    small = spec(name).small
    half, full = build(name, dtype="float16", **small), build(name, **small)
    onnx.checker.check_model(half, full_check=True)
    assert {t.data_type for t in half.graph.initializer} == {onnx.TensorProto.FLOAT16}
    x16, y16 = run(half)
    _, y32 = run(full)
    assert x16.dtype == np.float16 and y16.dtype == np.float16
    assert np.abs(y16.astype(np.float32) - y32).max() <= 2e-2 * np.abs(y32).max()


def test_dynamic_and_fixed_batch() -> None:
    dynamic = build("resnet18", **spec("resnet18").small)
    dims = dynamic.graph.input[0].type.tensor_type.shape.dim
    assert dims[0].dim_param == "batch" and [d.dim_value for d in dims[1:]] == [3, 64, 64]
    assert run(dynamic, batch=3)[1].shape == (3, 1000)
    fixed = build("resnet18", batch=4, **spec("resnet18").small)
    assert fixed.graph.input[0].type.tensor_type.shape.dim[0].dim_value == 4
    assert run(fixed)[1].shape == (4, 1000)


def test_width_and_size_scale_the_model() -> None:
    small = build("unet", size=32, width=0.25)
    wide = build("unet", size=32, width=0.5)
    assert parameter_count(wide) > 3 * parameter_count(small)
    assert run(build("unet", size=48, width=0.25))[1].shape == (2, 2, 48, 48)
    assert run(build("r3d18", size=16, width=0.125, frames=8))[0].shape == (2, 3, 8, 16, 16)


def test_seed_makes_weights_reproducible() -> None:
    a, b = build("mlp_gemm", seed=3), build("mlp_gemm", seed=3)
    c = build("mlp_gemm", seed=4)
    assert a.SerializeToString() == b.SerializeToString()
    assert a.graph.initializer[0].raw_data != c.graph.initializer[0].raw_data


@pytest.mark.parametrize(
    ("name", "options", "message"),
    [
        ("unet", {"size": 40}, "multiple of 16"),
        ("resnet18", {"size": 8}, "size must be >= 32"),
        ("resnet18", {"batch": 0}, "batch must be >= 1"),
        ("resnet18", {"width": 0}, "width must be in"),
        ("resnet18", {"opset": 5}, "opset must be between"),
        ("resnet18", {"dtype": "int8"}, "dtype must be one of"),
        ("resnet18", {"colour": 1}, "colour"),
        ("vgg16", {}, "unknown model 'vgg16'"),
    ],
)
def test_bad_options_are_one_line_errors(name: str, options: dict[str, object], message: str) -> None:
    with pytest.raises(BnfuseError, match=message) as info:
        build(name, **options)
    assert "\n" not in str(info.value)


def test_write_saves_a_loadable_model(tmp_path) -> None:
    model, path = write("audio1d", tmp_path / "sub" / "audio.onnx", **spec("audio1d").small)
    loaded = onnx.load(str(path))
    assert loaded.SerializeToString() == model.SerializeToString()
    assert [p.name for p in tmp_path.joinpath("sub").iterdir()] == ["audio.onnx"]
    assert {p.key: p.value for p in loaded.metadata_props}["bnfuse.model"] == "audio1d"
