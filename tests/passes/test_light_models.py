"""onnx's shipped light models (onnx/backend/test/data/light): BN counts and outputs.

These models build every weight with ConstantOfShape (all 0.02), so their final outputs are flat and do
not depend on the input (Softmax over 1000 equal logits is 0.001 everywhere). Each model is therefore
checked twice: as shipped (BN count no worse than onnxruntime's own optimizer; outputs compared at every
BatchNormalization output, exposed as extra graph outputs, where they do vary with the input) and with
realistic random weights in place of every constant (final outputs within 1e-4 relative). Both sides
run in onnxruntime with its graph optimizations disabled.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import helper, numpy_helper

from bnfuse.passes.optimize import count_nodes, default_model_path, optimize

LIGHT = default_model_path().parent
# Folds whose compared tensor the shipped model makes bit-identical on every input (the constant weights
# wash the input out by that depth): --check proves those on random data fed to a copy of their chain.
WASHED_OUT = {"light_resnet50": 0, "light_shufflenet": 0, "light_inception_v2": 22, "light_densenet121": 42}
# (model, BN in the shipped model, most BN allowed to remain: what onnxruntime's optimizer leaves)
CASES = [
    ("light_resnet50", 53, 0),
    ("light_shufflenet", 49, 0),
    ("light_inception_v2", 69, 6),
    ("light_densenet121", 121, 62),
]


def batchnorms(model: onnx.ModelProto) -> int:
    return count_nodes(model.graph, "BatchNormalization")


def ort_optimized_batchnorms(path: Path, tmp_path: Path) -> int:
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED
    options.optimized_model_filepath = str(tmp_path / "ort.onnx")
    options.log_severity_level = 3
    ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    return batchnorms(onnx.load(str(tmp_path / "ort.onnx")))


def run_unoptimized(model: onnx.ModelProto, x: np.ndarray) -> list[np.ndarray]:
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    options.log_severity_level = 3
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    return session.run(None, {session.get_inputs()[0].name: x})


def with_random_weights(model: onnx.ModelProto, seed: int = 0) -> onnx.ModelProto:
    """Every ConstantOfShape weight and float initializer replaced by realistic random values (IR 3 kept)."""
    rng = np.random.default_rng(seed)
    model = onnx.ModelProto.FromString(model.SerializeToString())
    graph = model.graph
    inits = {t.name: t for t in graph.initializer}
    variances = {n.input[4] for n in graph.node if n.op_type == "BatchNormalization"}
    kept_nodes = []
    for node in graph.node:
        if node.op_type == "ConstantOfShape" and node.input[0] in inits:
            shape = numpy_helper.to_array(inits[node.input[0]]).tolist()
            new = numpy_helper.from_array(np.zeros(shape, np.float32), node.output[0])
            graph.initializer.append(new)
            graph.input.append(helper.make_tensor_value_info(new.name, new.data_type, shape))
        else:
            kept_nodes.append(node)
    del graph.node[:]
    graph.node.extend(kept_nodes)
    for tensor in graph.initializer:
        if tensor.data_type != onnx.TensorProto.FLOAT:
            continue
        shape = list(tensor.dims)
        if tensor.name in variances:
            values = rng.uniform(0.5, 2.0, shape)
        elif len(shape) >= 2:
            fan_in = int(np.prod(shape[1:]))
            values = rng.normal(0, np.sqrt(2.0 / fan_in), shape)
        else:
            values = (
                rng.uniform(0.5, 1.5, shape)
                if "scale" in tensor.name or "_s_" in tensor.name
                else rng.normal(0, 0.1, shape)
            )
        tensor.CopyFrom(numpy_helper.from_array(values.astype(np.float32), tensor.name))
    onnx.checker.check_model(model)
    return model


def with_batchnorm_probes(model: onnx.ModelProto) -> tuple[onnx.ModelProto, list[str]]:
    """A copy with every BatchNormalization output also a graph output (typed by shape inference).

    A BN output stays a graph output after folding (the producer takes over its name), so the probes do
    not change what folds; unlike the final outputs, they vary with the input.
    """
    probed = onnx.ModelProto.FromString(model.SerializeToString())
    names = [n.output[0] for n in probed.graph.node if n.op_type == "BatchNormalization"]
    typed = {v.name: v for v in onnx.shape_inference.infer_shapes(probed).graph.value_info}
    probed.graph.output.extend(typed[name] for name in names)
    return probed, names


@pytest.mark.parametrize(("name", "before", "allowed"), CASES)
def test_light_model_as_shipped(name: str, before: int, allowed: int, tmp_path: Path) -> None:
    path = LIGHT / f"{name}.onnx"
    original = onnx.load(str(path))
    optimized, report = optimize(path)
    assert report.batchnorms_before == before == batchnorms(original)
    left = batchnorms(optimized)
    assert left == report.batchnorms_after <= allowed
    assert left <= ort_optimized_batchnorms(path, tmp_path)
    assert report.count("folded") + report.count("skipped") == before
    onnx.checker.check_model(optimized, full_check=True)

    probed, probes = with_batchnorm_probes(original)
    probed_optimized, probed_report = optimize(probed)
    assert probed_report.count("folded") == report.count("folded")
    x = np.random.default_rng(0).standard_normal((1, 3, 224, 224)).astype(np.float32)
    want_all, got_all = run_unoptimized(probed, x), run_unoptimized(probed_optimized, x)
    assert len(want_all) == len(got_all) == 1 + len(probes) == 1 + before
    for want, got in zip(want_all[1:], got_all[1:], strict=True):
        assert np.ptp(want) > 0  # input-dependent values: a wrong fold would show
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())


@pytest.mark.parametrize(("name", "before", "allowed"), CASES)
def test_light_model_with_random_weights_keeps_outputs(name: str, before: int, allowed: int) -> None:
    original = with_random_weights(onnx.load(str(LIGHT / f"{name}.onnx")))
    optimized, report = optimize(original, standalone="scale-shift")
    assert batchnorms(optimized) == 0 and report.count("folded") >= before - allowed
    x = np.random.default_rng(1).standard_normal((1, 3, 224, 224)).astype(np.float32)
    for want, got in zip(run_unoptimized(original, x), run_unoptimized(optimized, x), strict=True):
        assert np.ptp(want) > 0  # random weights make the outputs informative
        relative = np.abs(got - want).max() / np.abs(want).max()
        assert relative <= 1e-4


@pytest.mark.parametrize(("name", "before", "allowed"), CASES)
def test_light_model_check_proves_every_fold_on_input_dependent_values(name: str, before: int, allowed: int) -> None:
    """The shipped outputs are uniform on any input; --check must still compare something real per fold."""
    _, report = optimize(LIGHT / f"{name}.onnx", check=True)
    check = report.check
    assert check is not None and check.passed and check.engine == "onnxruntime"
    assert [o.outcome for o in check.outputs] == ["constant"]  # a uniform softmax / constant logits
    assert len(check.folds) == report.count("folded") >= before - allowed
    assert {f.outcome for f in check.folds} == {"ok"}
    assert sum(f.error is not None and f.error.constant for f in check.folds) == WASHED_OUT[name]
    for fold in check.folds:
        assert fold.error is not None and fold.isolated is not None and fold.entry
        # The fold alone, on random data at its producer's input: input-dependent by construction, and
        # folding changes float32 rounding, so a zero error would mean nothing was computed.
        assert not fold.isolated.constant and 0 < fold.isolated.max_rel <= fold.isolated.tolerance == 1e-4
        # In context, where the model has not washed the input out.
        if not fold.error.constant:
            assert 0 < fold.error.max_rel <= fold.error.tolerance == 1e-3
