"""The check's engines (engines.py): onnxruntime, onnx's reference evaluator where onnxruntime cannot run a
model, a clear error where neither can, models over the protobuf limit and models given as files."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from bnfuse.errors import BnfuseError
from bnfuse.passes.check.compare import compare_models, random_inputs
from tests.loaders import load_file

_check_tests = load_file(Path(__file__).with_name("test_compare.py"), "bnfuse_test_check_compare")
conv_bn, conv_bn_chain, scaled_channel = _check_tests.conv_bn, _check_tests.conv_bn_chain, _check_tests.scaled_channel


def test_a_model_no_engine_can_run_is_a_clear_error() -> None:
    graph = helper.make_graph(
        [helper.make_node("NoSuchOp", ["x"], ["y"], domain="nowhere")],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("nowhere", 1)])
    with pytest.raises(BnfuseError, match="cannot run the original model") as info:
        compare_models(model, model)
    message = str(info.value)
    assert "\n" not in message and "onnxruntime: " in message and "reference evaluator: " in message
    assert "NoSuchOp" in message


@pytest.mark.parametrize("elem_type", [TensorProto.DOUBLE, TensorProto.BFLOAT16])
def test_models_onnxruntime_cannot_run_are_checked_by_the_reference_evaluator(elem_type: int) -> None:
    from bnfuse.passes.optimize import optimize

    model = conv_bn(elem_type)
    feeds = random_inputs(model, {}, 0)
    assert feeds["x"].dtype == np.dtype(helper.tensor_dtype_to_np_dtype(elem_type))  # bfloat16 included
    assert feeds["x"].shape == (1, 3, 6, 6) and np.ptp(feeds["x"].astype(np.float32)) > 0
    folded, report = optimize(model, check=True)
    assert report.check is not None and report.check.passed
    assert report.check.engine == "onnx reference evaluator"
    assert "check passed (onnx reference evaluator, seed 0" in report.format_text()
    (out,) = report.check.outputs
    assert out.max_rel > 0  # the fold changed rounding: the outputs really were computed and compared
    if elem_type == TensorProto.DOUBLE:
        assert out.reference == "original" and out.tolerance == 1e-9
    else:
        assert out.reference.startswith("float32 original") and out.max_rel <= out.tolerance
    assert not compare_models(model, scaled_channel(folded, "w1", 1.1)).passed
    # The per-fold tensors are exposed in the reference evaluator as well.
    assert [(f.tensor, f.outcome) for f in report.check.folds] == [("n0", "ok"), ("n1", "ok")]
    wrong = compare_models(model, scaled_channel(folded, "w0", 1.1), folds=report.batchnorms)
    assert wrong.engine == "onnx reference evaluator" and wrong.first_failed_fold() is wrong.folds[0]


def test_model_over_the_protobuf_limit_goes_to_onnxruntime_as_a_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Over 2 GiB a model cannot be serialized to bytes: onnxruntime gets a path with external data."""
    from bnfuse import io
    from bnfuse.passes.check import engines

    model = conv_bn(TensorProto.FLOAT, opset=17)
    assert isinstance(engines.ort_source(engines.Model(model), "original", tmp_path), bytes)
    monkeypatch.setattr(io, "_METADATA_MARGIN", 0)
    monkeypatch.setattr(io, "_PROTOBUF_LIMIT", 1024)
    source = engines.ort_source(engines.Model(model), "original", tmp_path)
    assert source == str(tmp_path / "original.onnx")
    assert (tmp_path / "original.onnx.data").stat().st_size > 0
    result = compare_models(model, scaled_channel(model, "w1", 1.0))
    assert result.engine == "onnxruntime" and result.passed and result.outputs[0].max_abs == 0.0


def test_models_given_as_files_are_run_from_their_files(tmp_path: Path) -> None:
    """One-file models go to onnxruntime as files (extra outputs appended to a scratch copy), IR 14 included;
    external data is loaded whole (onnxruntime reads it only beside its model)."""
    from bnfuse.passes.optimize import optimize

    model = conv_bn_chain()
    model.ir_version = 14  # onnx's own, above what onnxruntime reads: lowered in the copy
    folded, report = optimize(model)
    wrong = scaled_channel(folded, "w1", 1.01)
    onnx.save(model, str(tmp_path / "a.onnx"))
    onnx.save(wrong, str(tmp_path / "wrong.onnx"))
    onnx.save(folded, str(tmp_path / "b.onnx"), save_as_external_data=True, location="b.data", size_threshold=0)
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    good = compare_models(tmp_path / "a.onnx", tmp_path / "b.onnx", folds=report.batchnorms)
    assert good.passed and good.engine == "onnxruntime" and [f.outcome for f in good.folds] == ["ok"] * 3
    bad = compare_models(str(tmp_path / "a.onnx"), str(tmp_path / "wrong.onnx"), folds=report.batchnorms)
    assert bad.first_failed_fold() is bad.folds[1] and bad.folds[1].isolated is not None
    assert not bad.folds[1].isolated.passed
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before  # nothing written beside them
