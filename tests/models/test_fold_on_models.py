"""The fold pass on every bnfuse.models network: outputs kept (onnxruntime), BN left as expected, reasons given."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import numpy_helper

import bnfuse
from bnfuse.models import build, names, spec
from bnfuse.passes.optimize import count_nodes

# BatchNormalization left after folding: none (DenseNet's 62 pre-activation BN move their scale through the ReLU);
# in float16 those stay (a move rounds twice more: see bnfuse.passes.fold.moves).
LEFT = dict.fromkeys(names(), 0)
LEFT_FLOAT16 = LEFT | {"densenet121": 62}


def outputs(model: onnx.ModelProto, x: np.ndarray) -> np.ndarray:
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL  # no fusion of ORT's own
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    return session.run(None, {"input": x})[0].astype(np.float64)


def random_input(model: onnx.ModelProto, batch: int = 3, seed: int = 1) -> np.ndarray:
    dims = model.graph.input[0].type.tensor_type.shape.dim
    shape = [d.dim_value if d.dim_value else batch for d in dims]
    dtype = np.float16 if model.graph.input[0].type.tensor_type.elem_type == onnx.TensorProto.FLOAT16 else np.float32
    return np.random.default_rng(seed).standard_normal(shape).astype(dtype)


def relative_error(want: np.ndarray, got: np.ndarray) -> float:
    return float(np.abs(want - got).max() / np.abs(want).max())


@pytest.mark.parametrize("name", names())
def test_fold_keeps_outputs_and_removes_foldable_batchnorms(name: str) -> None:
    model = build(name, **spec(name).small)
    before = count_nodes(model.graph, "BatchNormalization")
    optimized, report = bnfuse.optimize(model, check=True, full_check=True)
    x = random_input(model)
    assert relative_error(outputs(model, x), outputs(optimized, x)) <= 1e-4
    assert report.check is not None and report.check.passed
    assert count_nodes(optimized.graph, "BatchNormalization") == report.batchnorms_after == LEFT[name]
    assert report.count("folded") == before - LEFT[name]
    assert count_nodes(optimized.graph) < count_nodes(model.graph)
    assert model.SerializeToString() == build(name, **spec(name).small).SerializeToString(), "input modified"


def test_preactivation_moves_off_keeps_those_batchnorms_with_the_reason(tmp_path) -> None:
    """activation_moves=False (`optimize --no-activation-moves`): the pre-activation BN stay, each with a reason."""
    model = build("densenet121", **spec("densenet121").small)
    _, report = bnfuse.optimize(model, activation_moves=False, check=True)
    assert not [r for r in report.batchnorms if r.direction == "moved"] and report.check.passed
    kept = [r for r in report.batchnorms if r.status == "skipped"]
    assert len(kept) == report.batchnorms_after == 62 and all(r.reason for r in kept)
    path, out = tmp_path / "densenet.onnx", tmp_path / "out.onnx"
    onnx.save(model, path)
    command = [sys.executable, "-m", "bnfuse.cli", "optimize", str(path), "-o", str(out), "--no-activation-moves"]
    run = subprocess.run(command, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    assert count_nodes(onnx.load(out).graph, "BatchNormalization") == 62


def test_preactivation_network_moves_every_scale_through_the_relu() -> None:
    model = build("densenet121", **spec("densenet121").small)
    optimized, report = bnfuse.optimize(model, check=True)
    moved = [r for r in report.batchnorms if r.direction == "moved"]
    assert len(moved) == 62 and report.batchnorms_after == 0 and report.check.passed
    assert all(r.into.startswith("scale into conv") and "shift kept as an Add" in r.into for r in moved[:-1])
    assert "scale into fc0 through relu" in moved[-1].into  # the last one: through the global pool and Flatten
    x = random_input(model)
    assert relative_error(outputs(model, x), outputs(optimized, x)) <= 1e-4


def negated_preactivation(model: onnx.ModelProto) -> onnx.ModelProto:
    """The model with every pre-activation BN's scale negated: no scale may move through a ReLU then."""
    _, report = bnfuse.optimize(model)
    moved = {r.node for r in report.batchnorms if r.direction == "moved"}
    scales = {n.input[1] for n in model.graph.node if n.name in moved}
    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    for tensor in copy.graph.initializer:
        if tensor.name in scales:
            tensor.CopyFrom(numpy_helper.from_array(-numpy_helper.to_array(tensor), tensor.name))
    return copy


def test_preactivation_network_reports_why_each_batchnorm_stays() -> None:
    model = negated_preactivation(build("densenet121", **spec("densenet121").small))
    _, report = bnfuse.optimize(model)
    skipped = [r for r in report.batchnorms if r.status == "skipped"]
    assert len(skipped) == 62
    reasons = [r.reason or "" for r in skipped]
    # Backward: every block input (and so every Concat input) is read by every later Concat of the block,
    # so neither the producer nor a split over the Concat may absorb the BN. Forward: ReLU comes between
    # the BN and the next Conv (pre-activation), and ReLU does not commute with a per-channel affine map; its
    # scale moves through the ReLU only where positive.
    assert all("consumers" in r.split(";")[0] for r in reasons)
    assert all("forward: consumer relu" in r and "(Relu) cannot absorb" in r for r in reasons)
    assert all("pre-activation: through relu" in r and "only a positive scale commutes" in r for r in reasons)
    folded = [r for r in report.batchnorms if r.status == "folded"]
    assert len(folded) == 59 and all(r.into and r.into.startswith("conv") for r in folded)
    assert "skipped    bn1: producer output 'maxpool0' has 7 consumers; forward: consumer relu1 (Relu)" in (
        report.format_text(verbose=True)
    )


def test_preactivation_network_scale_shift_removes_every_batchnorm() -> None:
    model = negated_preactivation(build("densenet121", **spec("densenet121").small))
    optimized, report = bnfuse.optimize(model, standalone="scale-shift", check=True)
    assert report.count("converted") == 62 and report.batchnorms_after == 0
    assert all(r.reason and r.reason.startswith("not folded:") for r in report.batchnorms if r.status == "converted")
    x = random_input(model)
    assert relative_error(outputs(model, x), outputs(optimized, x)) <= 1e-4


@pytest.mark.parametrize("name", names())
def test_check_passes_on_every_float16_model(name: str) -> None:
    """--check judges float16 against the float32 original (see bnfuse.passes.check.compare), on every network."""
    model = build(name, dtype="float16", **spec(name).small)
    optimized, report = bnfuse.optimize(model, check=True)
    assert report.batchnorms_after == LEFT_FLOAT16[name] and report.check is not None and report.check.passed
    (out,) = report.check.outputs
    assert out.reference.startswith("float32 original") and out.noise is not None
    assert 0 < out.max_rel <= out.tolerance == pytest.approx(2 * out.noise + 2.0**-9)
    assert {t.data_type for t in optimized.graph.initializer} == {onnx.TensorProto.FLOAT16}


@pytest.mark.parametrize("name", names())
def test_float16_fold_adds_no_more_error_than_half_precision_itself(name: str) -> None:
    """Deep float16 networks drift from float32 by a few percent in onnxruntime with or without folding.

    That drift is the rounding of the weights to float16; the fold rounds its new weights once more, an
    independent error of the same size, so against the float32 network the folded model's error is about
    sqrt(2) times the unfolded one's (measured: 1.2-1.6, 2.1 on the shallowest MLP where output rounding
    matters): at most 1.6x plus two float16 output ulps.
    """
    half, full = build(name, dtype="float16", **spec(name).small), build(name, **spec(name).small)
    optimized, report = bnfuse.optimize(half)
    assert report.batchnorms_after == LEFT_FLOAT16[name]
    x = random_input(half)
    reference = outputs(full, x.astype(np.float32))
    drift = relative_error(reference, outputs(half, x))
    folded = relative_error(reference, outputs(optimized, x))
    assert 0 < drift < 0.06 and folded <= 1.6 * drift + 2.0**-10


@pytest.mark.parametrize("opset", [9, 11])
def test_fold_at_older_opsets(opset: int) -> None:
    model = build("mobilenetv2", opset=opset, **spec("mobilenetv2").small)
    optimized, report = bnfuse.optimize(model, check=True, full_check=True)
    assert report.batchnorms_after == 0 and optimized.opset_import[0].version == opset
