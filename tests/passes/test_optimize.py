"""bnfuse.optimize: the API contract (input untouched, validation, report, check failure)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import bnfuse
from bnfuse.errors import BnfuseError, CheckFailedError, ModelError
from bnfuse.passes.optimize import default_model_path, optimize


def conv_bn_relu(opset: int = 17) -> onnx.ModelProto:
    rng = np.random.default_rng(0)
    inits = [
        numpy_helper.from_array(rng.normal(0, 1, (8, 3, 3, 3)).astype(np.float32), "w"),
        numpy_helper.from_array(rng.uniform(0.5, 2, 8).astype(np.float32), "s"),
        numpy_helper.from_array(rng.normal(0, 1, 8).astype(np.float32), "b"),
        numpy_helper.from_array(rng.normal(0, 1, 8).astype(np.float32), "m"),
        numpy_helper.from_array(rng.uniform(0.1, 2, 8).astype(np.float32), "v"),
    ]
    nodes = [
        helper.make_node("Conv", ["x", "w"], ["c"], name="conv"),
        helper.make_node("BatchNormalization", ["c", "s", "b", "m", "v"], ["n"], name="bn"),
        helper.make_node("Relu", ["n"], ["y"], name="relu"),
    ]
    graph = helper.make_graph(
        nodes,
        "conv_bn_relu",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 3, 8, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 8, 6, 6])],
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 8
    return model


def test_exported_as_bnfuse_optimize_and_reports_counts() -> None:
    model = conv_bn_relu()
    optimized, report = bnfuse.optimize(model, check=True)
    assert report.batchnorms_before == 1 and report.batchnorms_after == 0
    assert report.nodes_before == 3 and report.nodes_after == 2
    assert report.elapsed_s > 0
    assert report.check is not None and report.check.passed
    assert report.check.input_shapes == {"x": [1, 3, 8, 8]}
    assert "folded     bn into conv" in report.format_text(verbose=True)


def test_input_model_is_not_modified() -> None:
    model = conv_bn_relu()
    before = model.SerializeToString()
    optimize(model, standalone="scale-shift")
    assert model.SerializeToString() == before


def test_path_input_and_json_report(tmp_path: Path) -> None:
    path = tmp_path / "m.onnx"
    onnx.save_model(conv_bn_relu(), str(path))
    _, report = optimize(path)
    out = report.write_json(tmp_path / "r.json")
    import json

    data = json.loads(out.read_text())
    assert data["summary"] == {
        "folded": 1, "converted": 0, "skipped": 0, "folded_forward": 0, "folded_in_merges": 0, "merges": 0,
        "folded_moved": 0,
    }  # fmt: skip
    assert data["batchnorms"][0] == {
        "node": "bn",
        "graph": "main",
        "status": "folded",
        "into": "conv",
        "reason": None,
        "output": "n",
        "replacement": "n",
        "direction": "backward",
        "reset_from_training": False,
    }
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.onnx", "r.json"]


def test_check_beyond_tolerance_raises_with_the_report() -> None:
    with pytest.raises(CheckFailedError, match="differs from the original") as info:
        optimize(conv_bn_relu(), check=True, tolerance=1e-30)  # folding changes float32 rounding
    report = info.value.report
    assert report.check is not None and not report.check.passed


@pytest.mark.parametrize("opset", [6, onnx.defs.onnx_opset_version() + 1])
def test_unsupported_opset_is_a_model_error(opset: int) -> None:
    model = conv_bn_relu()
    model.opset_import[0].version = opset
    with pytest.raises(ModelError, match=f"unsupported opset {opset}"):
        optimize(model)


def test_invalid_graph_is_a_model_error() -> None:
    model = conv_bn_relu()
    model.graph.node[1].input[0] = "undefined_tensor"
    with pytest.raises(ModelError, match="invalid ONNX model"):
        optimize(model)


def test_unknown_standalone_mode_is_refused() -> None:
    with pytest.raises(BnfuseError, match="standalone"):
        optimize(conv_bn_relu(), standalone="fuse-everything")


def test_default_model_is_onnx_shipped_light_resnet50() -> None:
    path = default_model_path()
    assert path.name == "light_resnet50.onnx" and path.exists()
    ops = {n.op_type for n in onnx.load(str(path)).graph.node}
    assert "ConstantOfShape" in ops  # weights are built, not stored: the resolver must see through it


def test_progress_is_reported_per_batchnorm() -> None:
    calls: list[tuple[int, int]] = []
    optimize(conv_bn_relu(), progress=lambda done, total: calls.append((done, total)))
    assert calls == [(1, 1)]


def test_graphsurgeon_graph_in_graphsurgeon_graph_out() -> None:
    import onnx_graphsurgeon as gs
    import onnxruntime as ort

    model = conv_bn_relu()
    graph = gs.import_onnx(model)
    nodes_before = [n.op for n in graph.nodes]
    folded, report = bnfuse.optimize(graph, check=True)
    assert isinstance(folded, gs.Graph) and folded is not graph
    assert [n.op for n in folded.nodes] == ["Conv", "Relu"] and [n.op for n in graph.nodes] == nodes_before
    assert report.count("folded") == 1 and report.check is not None and report.check.passed
    assert report.model == "conv_bn_relu"
    x = np.random.default_rng(0).standard_normal((2, 3, 8, 8)).astype(np.float32)
    want = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})
    exported = gs.export_onnx(folded)
    exported.ir_version = 8
    got = ort.InferenceSession(exported.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})
    np.testing.assert_allclose(got[0], want[0], rtol=1e-5, atol=1e-5 * np.abs(want[0]).max())


@pytest.mark.parametrize("value", [42, b"\x08\x07", None, [1, 2]])
def test_other_input_types_are_a_bnfuse_error(value: object) -> None:
    with pytest.raises(
        BnfuseError,
        match=f"takes an onnx.ModelProto, an onnx_graphsurgeon Graph or a path, not {type(value).__name__}$",
    ):
        bnfuse.optimize(value)  # type: ignore[call-overload]
