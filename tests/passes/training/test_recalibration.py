"""The recalibration graphs: BN stages, the update-bn and exact graphs as onnxruntime runs them, statistics
written back (in place, or a new initializer for a shared one)."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from bnfuse.errors import BnfuseError
from bnfuse.passes.training import recalibration
from bnfuse.runtime import session_options
from bnfuse.runtime.ops import DOMAIN, TRAINING
from bnfuse.runtime.sync_ops import SYNC_TRAINING

C = 3


def chain_model(shared: bool = False) -> onnx.ModelProto:
    """x -> bn_a -> Relu -> bn_b, and bn_c on x as well (stage 0): y = bn_b + bn_c; a trailing Neg after."""
    rng = np.random.default_rng(0)
    arrays = {}
    for k in "abc":
        arrays |= {f"s{k}": rng.uniform(0.5, 1.5, C), f"b{k}": rng.normal(0, 1, C)}
        arrays |= {f"m{k}": rng.normal(0, 1, C), f"v{k}": rng.uniform(0.5, 2, C)}
    stats = {k: (f"m{k}", f"v{k}") for k in "abc"}
    if shared:  # bn_a and bn_c read the same mean through Identity nodes, as exporters write shared tensors
        stats["a"] = ("ma_id", "va")
        stats["c"] = ("mc_id", "vc")
    nodes = []
    if shared:
        nodes += [helper.make_node("Identity", ["ma"], ["ma_id"]), helper.make_node("Identity", ["ma"], ["mc_id"])]
    nodes += [
        helper.make_node("BatchNormalization", ["x", "sa", "ba", *stats["a"]], ["na"], name="bn_a"),
        helper.make_node("Relu", ["na"], ["ra"]),
        helper.make_node("BatchNormalization", ["ra", "sb", "bb", *stats["b"]], ["nb"], name="bn_b"),
        helper.make_node("BatchNormalization", ["x", "sc", "bc", *stats["c"]], ["nc"], name="bn_c"),
        helper.make_node("Add", ["nb", "nc"], ["sum"]),
        helper.make_node("Neg", ["sum"], ["y"]),
    ]
    graph = helper.make_graph(
        nodes,
        "chain",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", C, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", C, 4])],
        [numpy_helper.from_array(v.astype(np.float32), k) for k, v in arrays.items()],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def session(model: onnx.ModelProto) -> ort.InferenceSession:
    return ort.InferenceSession(model.SerializeToString(), session_options(), providers=["CPUExecutionProvider"])


def test_stages_count_the_bns_on_the_longest_path_upstream() -> None:
    sites = recalibration.find_batch_norms(chain_model())
    assert [(s.key, s.stage, s.position) for s in sites] == [("bn_a", 0, 0), ("bn_b", 1, 2), ("bn_c", 0, 3)]
    assert [[s.key for s in stage] for stage in recalibration.stages(sites)] == [["bn_a", "bn_c"], ["bn_b"]]


def test_update_bn_graph_outputs_batch_mean_and_unbiased_variance() -> None:
    model = chain_model()
    sites = recalibration.find_batch_norms(model)
    graph = recalibration.update_bn_graph(model, sites, synchronized=False)
    assert [n.op_type for n in graph.graph.node if n.domain == DOMAIN] == [TRAINING] * 3
    assert "Neg" not in [n.op_type for n in graph.graph.node]  # nothing the statistics do not need
    x = np.random.default_rng(1).normal(2.0, 3.0, (5, C, 4)).astype(np.float32)
    names = [name for index in range(3) for name in recalibration.stat_names(index)]
    values = dict(zip(names, session(graph).run(names, {"x": x}), strict=True))
    flat = np.moveaxis(x.astype(np.float64), 1, -1).reshape(-1, C)
    mean, var = recalibration.stat_names(0)
    assert np.allclose(values[mean], flat.mean(axis=0), rtol=1e-6)
    assert np.allclose(values[var], flat.var(axis=0, ddof=1), rtol=1e-6)
    # bn_b reads bn_a's output normalized with the batch statistics: Relu of a standardized, scaled, shifted x
    scale, bias = (numpy_helper.to_array(t) for t in model.graph.initializer if t.name in ("sa", "ba"))
    normalized = (flat - flat.mean(axis=0)) / np.sqrt(flat.var(axis=0) + 1e-5) * scale + bias
    mean_b, var_b = recalibration.stat_names(1)
    assert np.allclose(values[mean_b], np.maximum(normalized, 0).mean(axis=0), rtol=1e-5)
    assert np.allclose(values[var_b], np.maximum(normalized, 0).var(axis=0, ddof=1), rtol=1e-5)


def test_synchronized_graph_chains_the_collectives_in_graph_order() -> None:
    model = chain_model()
    graph = recalibration.update_bn_graph(model, recalibration.find_batch_norms(model), synchronized=True)
    synced = [n for n in graph.graph.node if n.op_type == SYNC_TRAINING]
    tokens = [(n.input[-1], n.output[-1]) for n in synced]
    assert tokens == [(f"{recalibration.TOKEN}{i}", f"{recalibration.TOKEN}{i + 1}") for i in range(3)]
    x = np.ones((2, C, 4), np.float32)
    assert session(graph).run([f"{recalibration.TOKEN}3"], {"x": x})[0].tolist() == [3]  # a world of one


def test_exact_graph_exposes_bn_inputs_and_takes_statistics_as_overridable_inputs() -> None:
    model = chain_model()
    sites = recalibration.find_batch_norms(model)
    graph = recalibration.exact_graph(model, sites)
    assert [o.name for o in graph.graph.output] == ["x", "ra"]
    run = session(graph)
    x = np.random.default_rng(2).normal(size=(4, C, 4)).astype(np.float32)
    default = run.run(["ra"], {"x": x})[0]
    mean_in, var_in = recalibration.feed_names(0)
    fed = run.run(["ra"], {"x": x, mean_in: np.zeros(C, np.float32), var_in: np.ones(C, np.float32)})[0]
    scale, bias = (numpy_helper.to_array(t) for t in model.graph.initializer if t.name in ("sa", "ba"))
    expected = np.maximum(x / np.sqrt(1 + 1e-5) * scale[:, None] + bias[:, None], 0)
    assert np.allclose(fed, expected, rtol=1e-6, atol=1e-6) and not np.allclose(default, fed)


def test_apply_statistics_overwrites_own_initializers_and_unshares_shared_ones() -> None:
    for shared in (False, True):
        model = chain_model(shared)
        sites = recalibration.find_batch_norms(model)
        new = [(np.full(C, 1.0 + i), np.full(C, 2.0 + i)) for i in range(3)]
        result, created = recalibration.apply_statistics(model, sites, new)
        for site, (mean, var) in zip(recalibration.find_batch_norms(result), new, strict=True):
            got_mean, got_var = recalibration.statistics_of(result, [site])[0]
            assert np.array_equal(got_mean, mean) and np.array_equal(got_var, var)
        before = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
        after = {t.name: numpy_helper.to_array(t) for t in result.graph.initializer}
        if shared:
            assert created == ["ma_id.recalibrated", "mc_id.recalibrated"]
            assert np.array_equal(after["ma"], before["ma"])  # the shared tensor keeps its value
        else:
            assert created == [] and set(after) == set(before)


def test_a_channel_count_that_differs_from_the_model_is_refused() -> None:
    model = chain_model()
    sites = recalibration.find_batch_norms(model)
    with pytest.raises(BnfuseError, match="the data gives 4 channels"):
        recalibration.apply_statistics(model, sites, [(np.zeros(4), np.ones(4))] * 3)
