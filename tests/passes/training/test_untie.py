"""Untying shared weights: a graph whose slots share tensors (directly, through Identity, through Reshape) trains
exactly as the same graph with one tensor per slot. A BN's constant scale / bias (an affine-free BN) is evaluated
into one Constant and trains as a constant."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import helper, numpy_helper

from bnfuse.errors import BnfuseError
from bnfuse.passes.training import build_training_graph, read_spec
from bnfuse.passes.training.untie import untie_parameters
from bnfuse.training.session import TrainingSession

RNG = np.random.default_rng(7)
W = RNG.standard_normal((4, 4, 1, 1)).astype(np.float32) * 0.5
FC = RNG.standard_normal((3, 4)).astype(np.float32)


def _model(tied: bool) -> onnx.ModelProto:
    """Conv(w, Identity(z) as bias) -> BN(o, z, z, o) -> Conv(w) -> Conv(Reshape(wflat)) -> Conv(Reshape(wflat))
    -> pool -> Gemm. ``tied``: the exporter's merged form; else one initializer per slot."""
    zeros, ones = np.zeros(4, np.float32), np.ones(4, np.float32)
    tensors: dict[str, np.ndarray] = {}
    nodes = []

    def slot(name: str, value: np.ndarray, shared: str) -> str:
        if tied:
            tensors[shared] = value
            return shared
        tensors[name] = value
        return name

    if tied:
        tensors["z"] = zeros
        nodes.append(helper.make_node("Identity", ["z"], ["c1.bias"]))
        bias = "c1.bias"
    else:
        bias = slot("c1.bias", zeros, "z")
    tensors["shape"] = np.array([4, 4, 1, 1], np.int64)
    nodes += [
        helper.make_node("Conv", ["x", slot("c1.weight", W, "w"), bias], ["h1"]),
        helper.make_node(
            "BatchNormalization",
            [
                "h1",
                slot("bn.weight", ones, "o"),
                slot("bn.bias", zeros, "z"),
                slot("bn.mean", zeros, "z"),
                slot("bn.var", ones, "o"),
            ],
            ["h2"],
        ),  # fmt: skip
        helper.make_node("Conv", ["h2", slot("c2.weight", W, "w")], ["h3"]),
        helper.make_node("Reshape", [slot("c3.flat", W.reshape(-1), "wflat"), "shape"], ["c3.weight"]),
        helper.make_node("Conv", ["h3", "c3.weight"], ["h4"]),
        helper.make_node("Reshape", [slot("c4.flat", W.reshape(-1), "wflat"), "shape"], ["c4.weight"]),
        helper.make_node("Conv", ["h4", "c4.weight"], ["h5"]),
        helper.make_node("GlobalAveragePool", ["h5"], ["p"]),
        helper.make_node("Flatten", ["p"], ["f"]),
        helper.make_node("Gemm", ["f", "fc", "fcb"], ["y"], transB=1),
    ]
    tensors["fc"], tensors["fcb"] = FC, np.zeros(3, np.float32)
    graph = helper.make_graph(
        nodes,
        "tied" if tied else "untied",
        [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [2, 4, 5, 5])],
        [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [2, 3])],
        [numpy_helper.from_array(v, k) for k, v in tensors.items()],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


def test_every_slot_gets_its_own_tensor() -> None:
    model = _model(tied=True)
    untied = untie_parameters(model)
    slots = {}
    for node in model.graph.node:
        if node.op_type in ("Conv", "BatchNormalization", "Gemm"):
            slots[node.output[0]] = list(node.input[1:])
    names = [n for inputs in slots.values() for n in inputs]
    assert len(names) == len(set(names)), "a tensor is still read by two weight slots"
    assert "c1.bias" in {t.name for t in model.graph.initializer}  # the Identity's name, now an initializer
    assert untied.untied and all(new in untied.untied for new in untied.renamed)


def test_tied_graph_trains_as_the_untied_one() -> None:
    data = [(RNG.standard_normal((2, 4, 5, 5)).astype(np.float32), RNG.integers(0, 3, 2)) for _ in range(3)]
    tied_model, report = build_training_graph(_model(tied=True))
    plain_model, _ = build_training_graph(_model(tied=False))
    assert any("untied" in note for note in report.notes)
    tied, plain = TrainingSession(tied_model, lr=0.1), TrainingSession(plain_model, lr=0.1)
    tied_losses = [tied.step(x, y) for x, y in data]
    plain_losses = [plain.step(x, y) for x, y in data]
    np.testing.assert_allclose(tied_losses, plain_losses, rtol=1e-6)
    spec = read_spec(tied_model)
    assert len(spec.parameters) == len(read_spec(plain_model).parameters) == 9
    state = tied.state()
    plain_state = plain.state()
    # every tied-graph parameter equals the untied graph's parameter of its slot, and they moved apart
    assert np.abs(state["c1.bias"] - plain_state["c1.bias"]).max() < 1e-6
    weights = [state[name] for name in spec.parameters if state[name].shape == W.shape]
    flats = [state[name] for name in spec.parameters if state[name].shape == (16,)]
    assert len(weights) == 2 and len(flats) == 2
    expected_w = sorted([plain_state["c1.weight"], plain_state["c2.weight"]], key=lambda a: float(a.sum()))
    expected_f = sorted([plain_state["c3.flat"], plain_state["c4.flat"]], key=lambda a: float(a.sum()))
    for got, want in zip(sorted(weights, key=lambda a: float(a.sum())), expected_w, strict=True):
        np.testing.assert_allclose(got, want, atol=1e-6)
    for got, want in zip(sorted(flats, key=lambda a: float(a.sum())), expected_f, strict=True):
        np.testing.assert_allclose(got, want, atol=1e-6)
    assert np.abs(plain_state["c1.weight"] - plain_state["c2.weight"]).max() > 1e-4


def _constant_bn_model(constant: bool, gated: bool = False) -> onnx.ModelProto:
    """Conv -> BN -> pool -> Gemm. ``constant``: the BN's scale is Identity(Constant 1.5) and its bias dynamo's
    ``Constant 0.25 -> CastLike(h) -> Expand(Shape(h)[1:2])`` (an affine-free BN's form); else initializers of those
    values. ``gated``: x first multiplied by its spatial mean as the dynamo exporter writes a squeeze-excite's
    (ReduceMean with axes Reshape(Constant)): shape inference loses the rank of everything after it."""
    inits = {
        "w": W,
        "mean": np.full(4, 0.1, np.float32),
        "var": np.full(4, 0.8, np.float32),
        "fc": FC,
        "fcb": np.zeros(3, np.float32),
    }
    nodes = [helper.make_node("Conv", ["x", "w"], ["h"])]
    if gated:
        nodes = [
            helper.make_node("Constant", [], ["axes_2d"], value=numpy_helper.from_array(np.array([2, 3], np.int64))),
            helper.make_node("Constant", [], ["flat"], value_ints=[-1]),
            helper.make_node("Reshape", ["axes_2d", "flat"], ["axes"]),
            helper.make_node("ReduceMean", ["x", "axes"], ["gate"], keepdims=1),
            helper.make_node("Mul", ["x", "gate"], ["gated"]),
            helper.make_node("Conv", ["gated", "w"], ["h"]),
        ]
    if constant:
        nodes += [
            helper.make_node("Constant", [], ["ones"], value=numpy_helper.from_array(np.full(4, 1.5, np.float32))),
            helper.make_node("Identity", ["ones"], ["scale"]),
            helper.make_node("Constant", [], ["quarter"], value_floats=[0.25]),
            helper.make_node("CastLike", ["quarter", "h"], ["quarter_like"]),
            helper.make_node("Shape", ["h"], ["channels"], start=1, end=2),
            helper.make_node("Expand", ["quarter_like", "channels"], ["bias"]),
        ]
    else:
        inits["scale"], inits["bias"] = np.full(4, 1.5, np.float32), np.full(4, 0.25, np.float32)
    nodes += [
        helper.make_node("BatchNormalization", ["h", "scale", "bias", "mean", "var"], ["n"]),
        helper.make_node("GlobalAveragePool", ["n"], ["p"]),
        helper.make_node("Flatten", ["p"], ["f"]),
        helper.make_node("Gemm", ["f", "fc", "fcb"], ["y"], transB=1),
    ]
    graph = helper.make_graph(
        nodes,
        "constant_bn",
        [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, ["n", 4, 5, 5])],
        [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, ["n", 3])],
        [numpy_helper.from_array(v, k) for k, v in inits.items()],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


def test_constant_bn_scale_and_bias_stay_constant_and_the_bn_trains() -> None:
    """The constant form trains as the initializer form with scale and bias left out of the trainable set: batch
    statistics, running statistics updated, the constants' values (1.5, 0.25) and no parameter for them."""
    model = _constant_bn_model(constant=True)
    untied = untie_parameters(model)
    assert untied.constant_bns == ["n"]
    producers = {out: node for node in model.graph.node for out in node.output}
    assert producers["bias"].op_type == producers["scale"].op_type == "Constant"
    assert not any(n.op_type in ("Expand", "CastLike", "Shape") for n in model.graph.node)
    constant_model, report = build_training_graph(_constant_bn_model(constant=True))
    assert any("1 BatchNormalization without affine parameters" in note for note in report.notes), report.notes
    plain_model, _ = build_training_graph(_constant_bn_model(constant=False), trainable=["w", "fc", "fcb"])
    assert read_spec(constant_model).parameters == read_spec(plain_model).parameters == ["w", "fc", "fcb"]
    constant, plain = TrainingSession(constant_model, lr=0.1), TrainingSession(plain_model, lr=0.1)
    for size in (3, 5):
        x, labels = RNG.standard_normal((size, 4, 5, 5)).astype(np.float32), RNG.integers(0, 3, size)
        assert constant.step(x, labels) == plain.step(x, labels)
    for name, value in plain.state().items():
        np.testing.assert_array_equal(constant.state()[name], value, err_msg=name)
    assert np.abs(constant.state()["mean"] - 0.1).max() > 1e-3  # the running statistics moved


def test_constant_bn_scale_after_a_lost_rank_is_one_value_a_channel() -> None:
    """Shape(h)[1:2] of a BN input whose rank shape inference lost (bench/fuzz_training.py, seed 36 index 132: a
    squeeze-excite, then an affine-free BN, dynamo exporter) is the BN's channel count, not an empty slice: the bias
    constant has 4 values and the graph trains as the initializer form."""
    model = _constant_bn_model(constant=True, gated=True)
    assert untie_parameters(model).constant_bns == ["n"]
    producers = {out: node for node in model.graph.node for out in node.output}
    np.testing.assert_array_equal(numpy_helper.to_array(producers["bias"].attribute[0].t), np.full(4, 0.25))
    constant_model, _ = build_training_graph(_constant_bn_model(constant=True, gated=True), batch_size=2)
    plain_model, _ = build_training_graph(
        _constant_bn_model(constant=False, gated=True), trainable=["w", "fc", "fcb"], batch_size=2
    )
    constant, plain = TrainingSession(constant_model, lr=0.1), TrainingSession(plain_model, lr=0.1)
    x, labels = RNG.standard_normal((2, 4, 5, 5)).astype(np.float32), RNG.integers(0, 3, 2)
    assert constant.step(x, labels) == plain.step(x, labels)
    for name, value in plain.state().items():
        np.testing.assert_array_equal(constant.state()[name], value, err_msg=name)


def test_a_running_statistic_computed_in_the_graph_is_one_clear_error() -> None:
    model = _constant_bn_model(constant=False)
    model.graph.initializer.append(numpy_helper.from_array(np.array([0, 2, 3], np.int64), "axes"))
    model.graph.node.insert(1, helper.make_node("ReduceMean", ["h", "axes"], ["batch_mean"], keepdims=0))
    next(n for n in model.graph.node if n.op_type == "BatchNormalization").input[3] = "batch_mean"
    with pytest.raises(BnfuseError, match=r"mean 'batch_mean' is not an initializer; .*track_running_stats=False"):
        build_training_graph(model)
