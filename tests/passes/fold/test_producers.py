"""The producer of a per-channel map (fold/producers.py): which node absorbs it, and its folded weight and bias,
checked against the map applied in float64 to the producer's output."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_graphsurgeon as gs
import pytest
from onnx import TensorProto, helper, numpy_helper

from bnfuse.passes.constants import ConstantResolver
from bnfuse.passes.fold.context import FoldContext, NotFoldable
from bnfuse.passes.fold.fold_math import ChannelAffine
from bnfuse.passes.fold.producers import find_producer, fold_values
from bnfuse.passes.fold.surgery import GraphSurgery
from bnfuse.passes.graphsurgeon_io import InferredTensorTypes, names_in, quiet_graphsurgeon

RNG = np.random.default_rng(7)
WEIGHT = RNG.standard_normal((5, 3)).astype(np.float32)
BIAS = RNG.standard_normal(3).astype(np.float32)
AFFINE = ChannelAffine(RNG.uniform(0.5, 2.0, 3), RNG.standard_normal(3))


def surgery_on(
    nodes: list[onnx.NodeProto], outputs: list[str], weight: np.ndarray = WEIGHT
) -> tuple[GraphSurgery, gs.Graph]:
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 5])],
        [helper.make_tensor_value_info(name, TensorProto.FLOAT, None) for name in outputs],
        [numpy_helper.from_array(weight, "w"), numpy_helper.from_array(BIAS, "b")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    with quiet_graphsurgeon():
        imported = gs.import_onnx(model)
    ctx = FoldContext(
        resolver=ConstantResolver(overridable=set()),
        used_names=names_in(imported),
        types=InferredTensorTypes(model),
        opset=17,
    )
    return GraphSurgery(imported, ctx, "main"), imported


def tensor(graph: gs.Graph, name: str) -> gs.Tensor:
    return graph.tensors()[name]


def test_matmul_bias_add_is_one_producer_whose_fold_equals_the_map_applied_after_it() -> None:
    surgery, graph = surgery_on(
        [
            helper.make_node("MatMul", ["x", "w"], ["p"], name="mm"),
            helper.make_node("Add", ["p", "b"], ["y"]),
            helper.make_node("Relu", ["y"], ["r"]),  # where the map would be
        ],
        ["r"],
    )
    producer = find_producer(surgery, tensor(graph, "y"))
    assert (producer.kind, producer.node.name, producer.channels) == ("MatMul", "mm", 3)
    assert producer.bias_node is not None and producer.bias_node.op == "Add"
    weight, bias = fold_values(surgery, producer, AFFINE)
    assert weight.dtype == np.float32 and bias is not None and bias.dtype == np.float32
    x = RNG.standard_normal((4, 5))
    want = (x @ WEIGHT.astype(np.float64) + BIAS) * AFFINE.scale + AFFINE.shift
    np.testing.assert_allclose(x @ weight.astype(np.float64) + bias, want, rtol=1e-5, atol=1e-5)


def test_gemm_with_trans_b_and_beta_folds_its_columns() -> None:
    gemm = helper.make_node("Gemm", ["x", "w", "b"], ["y"], name="gemm", transB=1, beta=0.5)
    surgery, graph = surgery_on([gemm, helper.make_node("Relu", ["y"], ["r"])], ["r"], np.ascontiguousarray(WEIGHT.T))
    producer = find_producer(surgery, tensor(graph, "y"))
    assert (producer.kind, producer.rank) == ("Gemm", 2)
    weight, bias = fold_values(surgery, producer, AFFINE)
    x = RNG.standard_normal((4, 5))
    want = (x @ WEIGHT.astype(np.float64) + 0.5 * BIAS) * AFFINE.scale + AFFINE.shift
    got = x @ weight.T.astype(np.float64) + bias  # the folded C takes beta in (the fold writes beta = 1)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_a_producer_output_read_twice_or_returned_is_refused_with_the_reason() -> None:
    nodes = [helper.make_node("MatMul", ["x", "w"], ["p"], name="mm"), helper.make_node("Relu", ["p"], ["r"])]
    surgery, graph = surgery_on([*nodes, helper.make_node("Neg", ["p"], ["n"])], ["r", "n"])
    with pytest.raises(NotFoldable, match="'p' has 2 consumers"):
        find_producer(surgery, tensor(graph, "p"))
    surgery, graph = surgery_on(nodes, ["r", "p"])
    with pytest.raises(NotFoldable, match="'p' is a graph output"):
        find_producer(surgery, tensor(graph, "p"))
    with pytest.raises(NotFoldable, match="graph input"):
        find_producer(surgery, tensor(graph, "x"))


def test_a_map_of_another_width_is_refused() -> None:
    matmul = helper.make_node("MatMul", ["x", "w"], ["y"], name="mm")
    surgery, graph = surgery_on([matmul, helper.make_node("Relu", ["y"], ["r"])], ["r"])
    producer = find_producer(surgery, tensor(graph, "y"))
    narrow = ChannelAffine(np.ones(2), np.zeros(2))
    with pytest.raises(NotFoldable, match="2 per-channel values but mm has 3 output channels"):
        fold_values(surgery, producer, narrow)
