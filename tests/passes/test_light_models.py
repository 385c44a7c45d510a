"""onnx's shipped light models (onnx/backend/test/data/light): BN counts and outputs.

These models build every weight with ConstantOfShape (all 0.02), so their final outputs are flat and do
not depend on the input (Softmax over 1000 equal logits is 0.001 everywhere). Each model is therefore
checked twice: as shipped (BN count no worse than onnxruntime's own optimizer; outputs compared at every
BatchNormalization output, exposed as extra graph outputs) and with realistic random weights in place of every
constant (final outputs and every BN output within 1e-4 relative). Both sides run in onnxruntime with its graph
optimizations disabled.

A compared tensor proves something only if it depends on the input (a constant tensor with spread, which
``np.ptp > 0`` accepts, is the same wrong value on every input): every comparison runs on two inputs, and a tensor
counts as input-dependent only where the two runs differ. As shipped, deep BN outputs of inception_v2 and
densenet121 are bit-identical on any input (SHIPPED_CONSTANT_PROBES: the constant weights wash the input out);
with random weights every BN output and final output must vary, so each fold is proven on input-dependent values.
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
# BN outputs of the shipped model that are bit-identical on two random inputs (measured; onnxruntime 1.32 CPU).
SHIPPED_CONSTANT_PROBES = {
    "light_resnet50": 0,
    "light_shufflenet": 0,
    "light_inception_v2": 20,
    "light_densenet121": 57,
}
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


def two_inputs(shape: tuple[int, ...], seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return rng.standard_normal(shape).astype(np.float32), rng.standard_normal(shape).astype(np.float32)


def compare_on_two_inputs(
    want_model: onnx.ModelProto,
    got_model: onnx.ModelProto,
    inputs: tuple[np.ndarray, np.ndarray],
    run,
    check,  # noqa: ANN001
) -> list[bool]:
    """``check(got, want)`` on every output of both models for both inputs; per output, whether the wanted values
    differ between the inputs (the only outputs whose comparison proves a rewrite)."""
    wants = [run(want_model, x) for x in inputs]
    for x, want in zip(inputs, wants, strict=True):
        got = run(got_model, x)
        assert len(got) == len(want)
        for got_one, want_one in zip(got, want, strict=True):
            check(got_one, want_one)
    return [not np.array_equal(a, b) for a, b in zip(*wants, strict=True)]


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
    assert len(probed.graph.output) == 1 + len(probes) == 1 + before

    def check(got: np.ndarray, want: np.ndarray) -> None:
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())

    varies = compare_on_two_inputs(probed, probed_optimized, two_inputs((1, 3, 224, 224), 0), run_unoptimized, check)
    assert not varies[0]  # the flat softmax: why the BN outputs are probed
    assert varies[1:].count(False) == SHIPPED_CONSTANT_PROBES[name]  # the rest are input-dependent


def with_logit_probes(model: onnx.ModelProto) -> tuple[onnx.ModelProto, set[str]]:
    """A copy whose Softmax graph outputs also expose their inputs (the logits); returns it and the Softmax outputs.

    Random weights can saturate a Softmax into the same one-hot vector on every input (light_shufflenet's does): its
    output then proves nothing, its logits do."""
    probed = onnx.ModelProto.FromString(model.SerializeToString())
    outputs = {o.name for o in probed.graph.output}
    softmaxes = [n for n in probed.graph.node if n.op_type == "Softmax" and n.output[0] in outputs]
    typed = {v.name: v for v in onnx.shape_inference.infer_shapes(probed).graph.value_info}
    probed.graph.output.extend(typed[n.input[0]] for n in softmaxes)
    return probed, {n.output[0] for n in softmaxes}


@pytest.mark.parametrize(("name", "before", "allowed"), CASES)
def test_light_model_with_random_weights_keeps_outputs(name: str, before: int, allowed: int) -> None:
    """Every final output (a Softmax's logits too) and every BN output, exposed as graph outputs, on two inputs: all
    vary with the input (with random weights nothing is washed out), so every fold is compared on input-dependent
    values. A Softmax output may saturate to the same one-hot vector; its logits may not."""
    original, probes = with_batchnorm_probes(with_random_weights(onnx.load(str(LIGHT / f"{name}.onnx"))))
    original, softmax_outputs = with_logit_probes(original)
    optimized, report = optimize(original, standalone="scale-shift")
    assert batchnorms(optimized) == 0 and report.count("folded") >= before - allowed
    assert len(probes) == before

    def check(got: np.ndarray, want: np.ndarray) -> None:
        assert np.abs(got - want).max() / np.abs(want).max() <= 1e-4

    varies = compare_on_two_inputs(original, optimized, two_inputs((1, 3, 224, 224), 1), run_unoptimized, check)
    names = [o.name for o in original.graph.output]
    assert len(names) == 1 + before + len(softmax_outputs)
    constant = [n for n, v in zip(names, varies, strict=True) if not v and n not in softmax_outputs]
    assert not constant, constant


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
