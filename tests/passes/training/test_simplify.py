"""simplify.drop_copying_expands: onnx-ad's gradient-accumulating Expands that copy a tensor onto its own shape are
dropped, true broadcasts and anything of unknown shape are kept, and training gives the same numbers."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from bnfuse.io import ort_compatible
from bnfuse.passes.training import SGD, build_training_graph, simplify
from bnfuse.training import TrainingSession
from tests.loaders import torch_nets


def _expand_model(x_shape: list[int | str], target: list[int], as_output: bool = False) -> onnx.ModelProto:
    nodes = [helper.make_node("Expand", ["x", "shape"], ["e"]), helper.make_node("Relu", ["e"], ["y"])]
    outputs = [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)]
    if as_output:
        outputs.append(helper.make_tensor_value_info("e", TensorProto.FLOAT, None))
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, x_shape)],
        outputs,
        [numpy_helper.from_array(np.array(target, np.int64), "shape")],
    )
    return ort_compatible(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]))


@pytest.mark.parametrize(
    ("x_shape", "target", "as_output", "dropped"),
    [
        ([2, 3], [2, 3], False, 1),  # a copy onto its own shape
        ([1, 3], [2, 3], False, 0),  # a real broadcast
        (["n", 3], [2, 3], False, 0),  # unknown at build time: kept
        ([2, 3], [2, 3], True, 0),  # its output is a graph output: kept
    ],
)
def test_only_copies_onto_the_same_static_shape_are_dropped(x_shape, target, as_output, dropped) -> None:
    model = _expand_model(x_shape, target, as_output)
    assert simplify.drop_copying_expands(model) == dropped
    remaining = [n for n in model.graph.node if n.op_type == "Expand"]
    assert len(remaining) == 1 - dropped
    relu = next(n for n in model.graph.node if n.op_type == "Relu")
    assert relu.input[0] == ("x" if dropped else "e")


def _view_round_trip(keep_name: bool) -> tuple[onnx.ModelProto, list[str]]:
    """x -> Unsqueeze -> Reshape back to x's shape -> Relu: the Reshape undoes a view."""
    nodes = [
        helper.make_node("Unsqueeze", ["x", "axes"], ["u"]),
        helper.make_node("Reshape", ["u", "shape"], ["r"]),
        helper.make_node("Relu", ["r"], ["y"]),
    ]
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        [
            numpy_helper.from_array(np.array([0], np.int64), "axes"),
            numpy_helper.from_array(np.array([2, 3], np.int64), "shape"),
        ],
    )
    model = ort_compatible(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]))
    return model, ["r"] if keep_name else []


def test_a_reshape_undoing_views_becomes_an_alias_and_the_views_go() -> None:
    model, keep = _view_round_trip(keep_name=False)
    assert simplify.drop_copying_expands(model, keep=keep) == 1
    assert [(n.op_type, list(n.input)) for n in model.graph.node] == [("Relu", ["x"])]


def test_kept_names_stay_produced() -> None:
    model, keep = _view_round_trip(keep_name=True)
    assert simplify.drop_copying_expands(model, keep=keep) == 0
    assert [n.op_type for n in model.graph.node] == ["Unsqueeze", "Reshape", "Relu"]


def _exported(kind: str) -> tuple[onnx.ModelProto, tuple[int, ...]]:
    torch = pytest.importorskip("torch")
    nets = torch_nets()
    net, shape = nets.make(kind, seed=2)
    return nets.export(net, torch.randn(*shape)), shape


@pytest.mark.parametrize(("kind", "classes"), [("mlp", 5), ("resnet", 10)])
def test_training_graph_loses_its_copying_expands_and_trains_the_same(
    kind: str, classes: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    model, shape = _exported(kind)
    simplified, _ = build_training_graph(model, optimizer=SGD(momentum=0.9))
    monkeypatch.setattr(simplify, "drop_copying_expands", lambda *_, **__: 0)
    as_built, _ = build_training_graph(model, optimizer=SGD(momentum=0.9))
    expands = [sum(n.op_type == "Expand" for n in m.graph.node) for m in (as_built, simplified)]
    assert expands[0] > expands[1]
    rng = np.random.default_rng(0)
    x = rng.standard_normal(shape).astype(np.float32)
    labels = rng.integers(0, classes, shape[0]).astype(np.int64)
    sessions = [TrainingSession(m, lr=0.05) for m in (as_built, simplified)]
    losses = [[s.step(x, labels) for _ in range(5)] for s in sessions]
    assert losses[0] == losses[1]
    for name, value in sessions[0].state().items():
        np.testing.assert_array_equal(value, sessions[1].state()[name])


def _seed_axis_model() -> onnx.ModelProto:
    """onnx-ad's seed-axis patterns on x [2, 3, 4, 5, 1]: a mean's gradient divided by a Size-computed count (rank 0),
    a Constant-node [1] factor, and sums over the spatial axes with and without keepdims (axes from Constant nodes:
    the shapes after them must be known)."""
    axes = helper.make_node("Constant", [], ["axes"], value=numpy_helper.from_array(np.array([2, 3], np.int64)))
    factor = helper.make_node("Constant", [], ["factor"], value=numpy_helper.from_array(np.array([0.5], np.float32)))
    nodes = [
        axes,
        factor,
        helper.make_node("ReduceMean", ["x", "axes"], ["mean"], keepdims=1),
        helper.make_node("Size", ["x"], ["size"]),
        helper.make_node("Size", ["mean"], ["size_mean"]),
        helper.make_node("Div", ["size", "size_mean"], ["ratio"]),
        helper.make_node("Cast", ["ratio"], ["count"], to=TensorProto.FLOAT),
        helper.make_node("Div", ["x", "count"], ["scaled"]),
        helper.make_node("Mul", ["factor", "scaled"], ["halved"]),
        helper.make_node("ReduceSum", ["halved", "axes"], ["kept"], keepdims=1),
        helper.make_node("ReduceSum", ["halved", "axes"], ["dropped"], keepdims=0),
    ]
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3, 4, 5, 1])],
        [helper.make_tensor_value_info(name, TensorProto.FLOAT, None) for name in ("halved", "kept", "dropped")],
    )
    return ort_compatible(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]))


def test_seed_axis_patterns_take_onnxruntimes_fast_paths_with_the_same_results() -> None:
    """The rank-0 count and the [1] factor are reshaped to rank 5 (onnxruntime's per-element path otherwise), the
    mean and the sums reduce the trailing size-1 axis too (a Reshape restores keepdims=0's shape); the outputs are
    unchanged."""
    import onnxruntime

    model = _seed_axis_model()
    before = onnx.ModelProto()
    before.CopyFrom(model)
    shapes, types = simplify.static_shapes_and_types(model)
    assert shapes["kept"] == (2, 3, 1, 1, 1) and shapes["dropped"] == (2, 3, 1)  # through the Constant axes
    assert simplify.seed_axis_fast_paths(model, shapes, types) == 5  # two operands, three reductions (the mean too)
    ops = {n.output[0]: n for n in model.graph.node}
    assert ops["scaled"].input[1] == "count/rank5" and ops["halved"].input[0] == "factor/rank5"
    constants = {t.name: numpy_helper.to_array(t).tolist() for t in model.graph.initializer}
    assert [constants[ops[name].input[1]] for name in ("mean", "kept", "dropped/reduced")] == [[2, 3, 4]] * 3
    assert ops["dropped"].op_type == "Reshape"
    x = np.random.default_rng(0).standard_normal((2, 3, 4, 5, 1)).astype(np.float32)

    def run(m: onnx.ModelProto) -> list[np.ndarray]:
        return onnxruntime.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]).run(
            None, {"x": x}
        )

    for got, want in zip(run(model), run(before), strict=True):
        assert got.shape == want.shape
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


def test_seed_axis_fast_paths_leave_other_shapes_alone() -> None:
    """A scalar against a tensor whose last axis is not 1, or a sum ending at the last axis: nothing changes."""
    nodes = [
        helper.make_node("Div", ["x", "two"], ["half"]),
        helper.make_node("ReduceSum", ["half", "axes"], ["total"], keepdims=1),
    ]
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3, 4])],
        [helper.make_tensor_value_info("total", TensorProto.FLOAT, None)],
        [
            numpy_helper.from_array(np.array(2.0, np.float32), "two"),
            numpy_helper.from_array(np.array([1, 2], np.int64), "axes"),
        ],
    )
    model = ort_compatible(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]))
    assert simplify.seed_axis_fast_paths(model, *simplify.static_shapes_and_types(model)) == 0


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("keepdims", [1, 0])
def test_column_sums_become_one_gemm_with_the_same_results(dtype: type, keepdims: int) -> None:
    """A ReduceSum over the leading axes and the seed axis ([16, 16, 64, 1] over (0, 1, 3): a bias's gradient over
    tokens) becomes Reshape -> Gemm(ones) -> Reshape, in the summed tensor's own float type (one the graph widens to
    the other type too: a float32 gradient summed in float64); sums over a middle axis, or too narrow to gain, stay
    ReduceSum."""
    import onnxruntime

    elem = helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
    cases = {  # output: (input shape, axes, rewritten)
        "bias": ([16, 16, 64, 1], [0, 1, 3], True),
        "layer": ([16, 8, 2, 6, 1], [0, -1], True),  # keeps (1, 2, 3) [8, 2, 6]: rows 16, 96 columns
        "middle": ([16, 16, 64, 1], [0, 2], False),  # the kept axes 1 and 3: not one run
        "narrow": ([64, 16, 1], [0, 2], False),  # 16 columns: no gain
    }
    nodes, inputs, inits = [], [], []
    for out, (shape, axes, _) in cases.items():
        inputs.append(helper.make_tensor_value_info(f"x_{out}", elem, shape))
        inits.append(numpy_helper.from_array(np.array(axes, np.int64), f"axes_{out}"))
        nodes.append(helper.make_node("ReduceSum", [f"x_{out}", f"axes_{out}"], [out], keepdims=keepdims))
    other = TensorProto.DOUBLE if elem == TensorProto.FLOAT else TensorProto.FLOAT
    # a squeeze-excite conv's bias gradient ([N, C, 1, 1] and the seed axis) summed in the other type
    cases["widened"] = ([16, 64, 1, 1, 1], [0, 2, 3, 4], True)
    inputs.append(helper.make_tensor_value_info("x_widened", elem, cases["widened"][0]))
    inits.append(numpy_helper.from_array(np.array([0, 2, 3, 4], np.int64), "axes_widened"))
    nodes.append(helper.make_node("Cast", ["x_widened"], ["x_widened/cast"], to=other))
    nodes.append(helper.make_node("ReduceSum", ["x_widened/cast", "axes_widened"], ["widened"], keepdims=keepdims))
    outputs = [helper.make_tensor_value_info(name, other if name == "widened" else elem, None) for name in cases]
    graph = helper.make_graph(nodes, "g", inputs, outputs, inits)
    model = ort_compatible(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]))
    before = onnx.ModelProto()
    before.CopyFrom(model)
    simplify.seed_axis_fast_paths(model, *simplify.static_shapes_and_types(model))
    producers = {n.output[0]: n for n in model.graph.node}
    for out, (_, _, rewritten) in cases.items():
        source = producers.get(producers[out].input[0]) if producers[out].op_type == "Reshape" else None
        assert (source is not None and source.op_type == "Gemm") == rewritten, out
    assert sum(n.op_type == "Gemm" for n in model.graph.node) == 3
    rng = np.random.default_rng(1)
    feeds = {f"x_{out}": rng.standard_normal(shape).astype(dtype) for out, (shape, _, _) in cases.items()}

    def run(m: onnx.ModelProto) -> list[np.ndarray]:
        return onnxruntime.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)

    for out, got, want in zip(cases, run(model), run(before), strict=True):
        assert got.shape == want.shape and got.dtype == want.dtype, out
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5, err_msg=out)


def test_transpose_moves_compose_to_the_transpose() -> None:
    """Every permutation of random small shapes (size-1 axes, axes that move together): the steps each move one
    axis, and applied in turn give NumPy's transpose."""
    rng = np.random.default_rng(0)
    for _ in range(2000):
        rank = int(rng.integers(1, 7))
        shape = tuple(int(rng.choice([1, 2, 3, 4])) for _ in range(rank))
        perm = [int(p) for p in rng.permutation(rank)]
        x = rng.standard_normal(shape)
        y = x
        for step_shape, step_perm in simplify.transpose_moves(shape, perm):
            assert simplify.moves_one_axis(step_perm), (shape, perm, step_perm)
            y = y.reshape(step_shape).transpose(step_perm)
        np.testing.assert_array_equal(y.reshape(x.transpose(perm).shape), x.transpose(perm))
    # onnxruntime's NCHWc weight reorder, OIHW [O/16, 16, I/16, 16, 3, 3] -> OIHWBiBo: two moves, not three
    assert len(simplify.transpose_moves((8, 16, 8, 16, 3, 3), [0, 2, 4, 5, 3, 1])) == 2


def test_generic_transposes_become_one_axis_moves_with_the_same_results() -> None:
    """onnx-ad's attention adjoint [3, 1, 16, 4, 16, 16] (2, 3, 0, 4, 5, 1) becomes one move between views, a
    3-cycle two moves; an NCHW -> NHWC Transpose, or one axis moved past size-1 ones, stays (one move already)."""
    import onnxruntime

    cases = {  # output: (input shape, perm, Transposes after)
        "attention": ([3, 1, 16, 4, 16, 16], [2, 3, 0, 4, 5, 1], 1),
        "nhwc": ([4, 64, 8, 8], [0, 2, 3, 1], 1),
        "ones": ([16, 4, 80, 1], [3, 0, 1, 2], 1),
        "three": ([2, 3, 4, 5], [3, 1, 0, 2], 2),
    }
    nodes = [helper.make_node("Transpose", [f"x_{o}"], [o], perm=p) for o, (_, p, _) in cases.items()]
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info(f"x_{o}", TensorProto.FLOAT, s) for o, (s, _, _) in cases.items()],
        [helper.make_tensor_value_info(o, TensorProto.FLOAT, None) for o in cases],
    )
    model = ort_compatible(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]))
    before = onnx.ModelProto()
    before.CopyFrom(model)
    assert simplify.fast_transposes(model, simplify.static_shapes(model)) == 2
    producers = {n.output[0]: n for n in model.graph.node}
    for out, (_, _, transposes) in cases.items():
        chain, name = [], out
        while name in producers:
            chain.append(producers[name].op_type)
            name = producers[name].input[0]
        assert chain.count("Transpose") == transposes, (out, chain)
    assert producers["nhwc"].op_type == producers["ones"].op_type == "Transpose"
    assert not simplify.moves_one_axis([1, 0, 3, 2]) and simplify.moves_one_axis([0, 3, 1, 2])
    rng = np.random.default_rng(2)
    feeds = {f"x_{o}": rng.standard_normal(s).astype(np.float32) for o, (s, _, _) in cases.items()}

    def run(m: onnx.ModelProto) -> list[np.ndarray]:
        return onnxruntime.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)

    for out, got, want in zip(cases, run(model), run(before), strict=True):
        np.testing.assert_array_equal(got, want, err_msg=out)
