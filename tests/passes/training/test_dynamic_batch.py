"""Training graphs with a dynamic batch dimension: bit for bit the graph built for each batch size, PyTorch's
steps on uneven batches, and a static batch where the model pins it."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from bnfuse.passes.training import SGD, Adam, build_training_graph, dynamic_batch
from bnfuse.passes.training.distribute import distribute_training_graph
from bnfuse.training.session import TrainingSession
from tests.loaders import torch_nets

torch = pytest.importorskip("torch")
nets = torch_nets()


def _batch(shape: tuple[int, ...], size: int, classes: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return rng.standard_normal((size, *shape[1:])).astype(np.float32), rng.integers(0, classes, size)


@pytest.mark.parametrize(
    ("kind", "portable", "optimizer"),
    [
        ("resnet", False, SGD(momentum=0.9, weight_decay=1e-4)),
        ("resnet", True, SGD(momentum=0.9)),
        ("mlp", False, Adam()),
        ("mlp", True, SGD(momentum=0.5)),
        ("conv1d", False, SGD(momentum=0.9)),
    ],
    ids=["resnet-sgd", "resnet-portable", "mlp-adam", "mlp-portable", "conv1d"],
)
def test_any_batch_size_is_the_graph_built_for_it_bit_for_bit(kind: str, portable: bool, optimizer: object) -> None:
    net, shape = nets.make(kind, seed=3)
    model = nets.export(net, torch.randn(*shape))
    dynamic, report = build_training_graph(model, optimizer=optimizer, portable=portable, unbiased_running_var=True)
    assert report.batch == "dynamic (any size)"
    for size in (7, 3, 2, 1):  # 1: a BatchNorm1d sees one value (variance 0, never NaN)
        static, static_report = build_training_graph(
            model, optimizer=optimizer, portable=portable, unbiased_running_var=True, batch_size=size, static_batch=True
        )
        assert static_report.batch == f"static {size}"
        ours, theirs = TrainingSession(dynamic, lr=0.05), TrainingSession(static, lr=0.05)
        # A portable BatchNorm1d built for one sample (one value per channel) takes another lowering (ONNX's BN:
        # no unbiased factor to apply to a variance of 0); the dynamic graph keeps the general one: same values
        # up to rounding there, bit for bit everywhere else.
        exact = not (portable and kind == "mlp" and size == 1)
        for step in range(3):
            x, labels = _batch(shape, size, 4, seed=size * 10 + step)
            got, want = ours.step(x, labels), theirs.step(x, labels)
            assert got == want if exact else got == pytest.approx(want, rel=1e-5)
        expected = theirs.state()
        assert all(np.isfinite(value).all() for value in expected.values())
        for name, value in ours.state().items():
            if exact:
                np.testing.assert_array_equal(value, expected[name], err_msg=f"{name} at batch {size}")
            else:
                np.testing.assert_allclose(value, expected[name], rtol=1e-4, atol=1e-5, err_msg=name)


def test_uneven_batches_match_pytorch() -> None:
    """A PyTorch loop's epoch over 13 samples in batches of 5: 5, 5 and the partial 3."""
    net, shape = nets.make("resnet", seed=5)
    model = nets.export(net, torch.randn(*shape))
    train_model, _ = build_training_graph(model, optimizer=SGD(momentum=0.9), unbiased_running_var=True)
    session = TrainingSession(train_model, lr=0.05)
    data = [_batch(shape, size, 10, seed=i) for i, size in enumerate((5, 5, 3, 5, 1))]
    losses = [session.step(x, labels) for x, labels in data]
    expected = nets.train_torch(net, data, lr=0.05, momentum=0.9)
    np.testing.assert_allclose(losses, expected, rtol=1e-4)
    state = session.state()
    for name, value in nets.state(net).items():
        np.testing.assert_allclose(state[name], value, rtol=1e-4, atol=1e-5, err_msg=name)


def test_session_reports_its_batch_sizes() -> None:
    net, shape = nets.make("mlp", seed=6)
    model = nets.export(net, torch.randn(*shape))
    dynamic = TrainingSession(build_training_graph(model, batch_size=6)[0])
    assert (dynamic.batch_size, dynamic.static_batch_size) == (6, None)
    static = TrainingSession(build_training_graph(model, batch_size=6, static_batch=True)[0])
    assert (static.batch_size, static.static_batch_size) == (6, 6)
    x, labels = _batch(shape, 5, 5, seed=0)
    with pytest.raises(Exception, match=r"has shape \[5, 12\], the graph needs \[6, 12\]"):
        static.step(x, labels)
    assert np.isfinite(dynamic.step(x, labels))


def _pinned_batch_model() -> onnx.ModelProto:
    """Conv -> BN -> Reshape to the constant [4, -1]: the batch size is part of the model."""
    rng = np.random.default_rng(0)
    inits = [
        numpy_helper.from_array(rng.standard_normal((3, 2, 3, 3)).astype(np.float32), "w"),
        numpy_helper.from_array(np.ones(3, np.float32), "s"),
        numpy_helper.from_array(np.zeros(3, np.float32), "b"),
        numpy_helper.from_array(np.zeros(3, np.float32), "m"),
        numpy_helper.from_array(np.ones(3, np.float32), "v"),
        numpy_helper.from_array(np.array([4, -1], np.int64), "shape"),
        numpy_helper.from_array(rng.standard_normal((75, 2)).astype(np.float32), "fc"),
    ]
    graph = helper.make_graph(
        [
            helper.make_node("Conv", ["x", "w"], ["c"]),
            helper.make_node("BatchNormalization", ["c", "s", "b", "m", "v"], ["n"]),
            helper.make_node("Reshape", ["n", "shape"], ["r"]),
            helper.make_node("MatMul", ["r", "fc"], ["y"]),
        ],
        "pinned",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 2, 7, 7])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4, 2])],
        inits,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


def test_a_model_that_pins_its_batch_size_trains_static_and_says_why() -> None:
    train_model, report = build_training_graph(_pinned_batch_model())
    assert report.batch.startswith("static 4 (dynamic refused: at another batch size: shape inference failed")
    assert "batch: static 4" in report.format_text()
    session = TrainingSession(train_model)
    assert session.static_batch_size == 4
    x, labels = _batch((4, 2, 7, 7), 4, 2, seed=1)
    assert np.isfinite(session.step(x, labels))


def test_distributed_rewrite_keeps_the_dynamic_batch() -> None:
    """The distributed loss normalization replaces the loss's 1/N, computed in a dynamic graph, not constant."""
    net, shape = nets.make("mlp", seed=7)
    model = nets.export(net, torch.randn(*shape))
    train_model, _ = build_training_graph(model, optimizer=SGD(momentum=0.9))
    distributed, _ = distribute_training_graph(train_model)
    producers = [o for node in distributed.graph.node for o in node.output]
    assert producers.count("loss/inv_batch") == 1 and producers.count("loss/neg_inv_batch") == 1
    onnx.checker.check_model(distributed)
    ours, reference = TrainingSession(distributed, lr=0.05), TrainingSession(train_model, lr=0.05)
    for size in (5, 3):  # alone (a world of one rank): the plain graph's step, at any batch size
        x, labels = _batch(shape, size, 5, seed=size)
        assert ours.step(x, labels) == pytest.approx(reference.step(x, labels), rel=1e-6)


@pytest.mark.parametrize(
    ("kind", "options"),
    [
        ("resnet", {}),
        ("resnet", {"portable": True, "unbiased_running_var": True}),
        ("convzoo", {"loss": "mse"}),
        ("conv1d", {"momentum_convention": "cumulative"}),
        ("conv3d", {"optimizer": Adam(), "fix_gamma": True}),
        ("mlp", {"loss": "seed", "unbiased_running_var": True}),
        ("mlp", {"portable": True, "unbiased_running_var": True}),
    ],
    ids=["resnet", "resnet-portable", "convzoo-mse", "conv1d-cumulative", "conv3d-adam", "mlp-seed", "mlp-portable"],
)
def test_one_build_is_the_three_probe_graph_byte_for_byte(
    kind: str, options: dict, monkeypatch: pytest.MonkeyPatch
) -> None:
    net, shape = nets.make(kind, seed=4)
    model = nets.export(net, torch.randn(*shape))
    builds: list[int] = []
    probe = dynamic_batch.PROBES[0]
    original = dynamic_batch._formulas_of_one_build

    def one_build(built: onnx.ModelProto) -> dict | None:
        builds.append(next(i for i in built.graph.input if i.name == "x").type.tensor_type.shape.dim[0].dim_value)
        return original(built)

    monkeypatch.setattr(dynamic_batch, "_formulas_of_one_build", one_build)
    ours, report = build_training_graph(model, **options)
    assert builds == [probe] and report.batch == "dynamic (any size)"
    monkeypatch.setattr(dynamic_batch, "ONE_PROBE", False)
    theirs, _ = build_training_graph(model, **options)
    assert ours.SerializeToString() == theirs.SerializeToString()


def _sized_build(values: Callable[[int], np.ndarray]) -> Callable[[int], onnx.ModelProto]:
    """A graph built for batch size n: y = x + c(n), x [n, 3], with the constant ``values(n)`` (shape [n, 3])."""

    def build(size: int) -> onnx.ModelProto:
        graph = helper.make_graph(
            [helper.make_node("Add", ["x", "c"], ["y"])],
            "sized",
            [helper.make_tensor_value_info("x", TensorProto.FLOAT, [size, 3])],
            [helper.make_tensor_value_info("y", TensorProto.FLOAT, [size, 3])],
            [numpy_helper.from_array(values(size).astype(np.float32), "c")],
        )
        return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])

    return build


def test_a_constant_one_build_cannot_tell_runs_the_three_probes() -> None:
    """Uniform ones [n, 3]: one build says ConstantOfShape; an arange over the batch: it takes the three probes, which
    find no formula either (NotBatchPolymorphic)."""
    sizes: list[int] = []

    def counted(build: Callable[[int], onnx.ModelProto]) -> Callable[[int], onnx.ModelProto]:
        return lambda size: sizes.append(size) or build(size)

    ones = dynamic_batch.dynamic_batch_graph(counted(_sized_build(lambda n: np.ones((n, 3)))), lambda model: "x")
    assert sizes == [dynamic_batch.PROBES[0]]
    assert [n.op_type for n in ones.graph.node] == ["Shape", "Gather", "Mul", "Add", "ConstantOfShape", "Add"]
    assert ones.graph.input[0].type.tensor_type.shape.dim[0].dim_param == "batch"
    x = np.arange(15, dtype=np.float32).reshape(5, 3)
    (y,) = ort.InferenceSession(ones.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})
    np.testing.assert_array_equal(y, x + 1)
    sizes.clear()
    arange = counted(_sized_build(lambda n: np.arange(n * 3).reshape(n, 3)))
    with pytest.raises(dynamic_batch.NotBatchPolymorphic, match="constant 'c' depends on the batch size"):
        dynamic_batch.dynamic_batch_graph(arange, lambda model: "x")
    assert sizes == list(dynamic_batch.PROBES)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_a_scale_is_read_off_one_value_only_where_no_other_k_rounds_to_it(dtype: type) -> None:
    probe = dynamic_batch.PROBES[0]
    for k in (1, 7, 4097):  # odd: -2 / (k P) for an even k is -1 / (k/2 P), the formula found first
        mean = dynamic_batch._scale([np.array(-2.0 / (k * probe), dtype)])
        assert mean == dynamic_batch._Inverse(-2.0, k, ())
        factor = np.array(k * probe / (k * probe - 1), dtype)
        if dtype == np.float32 and k > 7:  # M / (M - 1), M = 4097 P: under a float32 step from k +- 1's factors
            with pytest.raises(dynamic_batch._Ambiguous):
                dynamic_batch._scale([factor])
        else:
            assert dynamic_batch._scale([factor]) == dynamic_batch._Unbiased(k, ())
    assert dynamic_batch._scale([np.array(0.1, dtype)]) is None  # not a mean over a multiple of the probe size
    # 1 / (k P) and 1 / ((k + 1) P) round to the same float32 for k this large: one value cannot tell k
    ambiguous = np.array(1.0 / (10**8 * probe), dtype)
    if dtype == np.float32:
        with pytest.raises(dynamic_batch._Ambiguous):
            dynamic_batch._scale([ambiguous])
    else:
        assert dynamic_batch._scale([ambiguous]) == dynamic_batch._Inverse(1.0, 10**8, ())


def test_a_value_one_build_cannot_tell_runs_the_three_probes() -> None:
    """x * M / (M - 1), M = 4097 n, in float32: one value fits several k, so the graph is the three probes', byte for
    byte (they see one float32 at all three sizes: a constant)."""
    sizes: list[int] = []

    def build(size: int) -> onnx.ModelProto:
        sizes.append(size)
        m = 4097 * size
        graph = helper.make_graph(
            [helper.make_node("Mul", ["x", "f"], ["y"])],
            "unbiased",
            [helper.make_tensor_value_info("x", TensorProto.FLOAT, [size, 3])],
            [helper.make_tensor_value_info("y", TensorProto.FLOAT, [size, 3])],
            [numpy_helper.from_array(np.array(m / (m - 1), np.float32), "f")],
        )
        return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])

    dynamic = dynamic_batch.dynamic_batch_graph(build, lambda model: "x")
    assert sizes == list(dynamic_batch.PROBES)
    probes = dynamic_batch.dynamic_batch_graph(build, lambda model: "x", one_probe=False)
    assert dynamic.SerializeToString() == probes.SerializeToString()


def test_an_entry_next_to_a_multiple_of_the_probe_size_runs_the_three_probes() -> None:
    """x [n, 3] with a constant row appended, reshaped to the constant [n + 1, 3]: one value cannot tell n + 1 from
    a constant, so the three probes find base 1 and coeff 1, and the graph takes any batch size."""
    sizes: list[int] = []

    def build(size: int) -> onnx.ModelProto:
        sizes.append(size)
        graph = helper.make_graph(
            [
                helper.make_node("Concat", ["x", "row"], ["rows"], axis=0),
                helper.make_node("Reshape", ["rows", "shape"], ["y"]),
            ],
            "extra_row",
            [helper.make_tensor_value_info("x", TensorProto.FLOAT, [size, 3])],
            [helper.make_tensor_value_info("y", TensorProto.FLOAT, [size + 1, 3])],
            [
                numpy_helper.from_array(np.full((1, 3), 7.0, np.float32), "row"),
                numpy_helper.from_array(np.array([size + 1, 3], np.int64), "shape"),
            ],
        )
        return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])

    dynamic = dynamic_batch.dynamic_batch_graph(build, lambda model: "x")
    assert sizes == list(dynamic_batch.PROBES)
    inits = {t.name: numpy_helper.to_array(t).tolist() for t in dynamic.graph.initializer}
    assert (inits["shape/base"], inits["shape/coeff"]) == ([1, 3], [1, 0])
    x = np.arange(15, dtype=np.float32).reshape(5, 3)
    (y,) = ort.InferenceSession(dynamic.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})
    np.testing.assert_array_equal(y, np.concatenate([x, np.full((1, 3), 7.0, np.float32)]))


class _WideFlatten(torch.nn.Module):
    """Conv -> BN -> ReLU on a 1 x 1009 map, flattened to [-1, 2018] (2 x 1009: the first probe size's multiple)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv, self.bn, self.fc = torch.nn.Conv2d(1, 2, 1), torch.nn.BatchNorm2d(2), torch.nn.Linear(2018, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.relu(self.bn(self.conv(x))).reshape(-1, 2018))


def test_a_model_with_its_own_multiple_of_the_probe_size_runs_the_three_probes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """One build would read the model's 2018 as 2 * N; own_sizes_collide sends it to the three probes, and the
    dynamic graph steps at batch 3 bit for bit as the graph built for 3."""
    torch.manual_seed(0)
    model = nets.export(_WideFlatten().eval(), torch.randn(2, 1, 1, 1009))
    relaxed = dynamic_batch.without_batch_sizes(model, {model.graph.input[0].name})
    assert "1009" in (dynamic_batch.own_sizes_collide(relaxed, {model.graph.input[0].name}) or "")
    sizes: list[int] = []
    original = dynamic_batch._formulas_of_one_build
    monkeypatch.setattr(dynamic_batch, "_formulas_of_one_build", lambda m: sizes.append(1) or original(m))
    dynamic, report = build_training_graph(model)
    assert report.batch == "dynamic (any size)" and sizes == []  # the one-build reading never ran
    static, _ = build_training_graph(model, batch_size=3, static_batch=True)
    ours, theirs = TrainingSession(dynamic, lr=0.05), TrainingSession(static, lr=0.05)
    for step in range(2):
        x, labels = _batch((3, 1, 1, 1009), 3, 3, seed=step)
        assert ours.step(x, labels) == theirs.step(x, labels)
    for name, value in theirs.state().items():
        np.testing.assert_array_equal(ours.state()[name], value, err_msg=name)


def test_a_scale_of_rank_four_is_read_off_one_value() -> None:
    """resnet26d's average-pool gradient holds ``1 / (4 N)`` as a [1, 1, 1, 1] tensor: read as c / (k N), its shape
    kept for the node that computes it."""
    value = np.full((1, 1, 1, 1), np.float32(1 / (4 * dynamic_batch.PROBES[0])), np.float32)
    formula = dynamic_batch._scale([value])
    assert isinstance(formula, dynamic_batch._Inverse)
    assert (formula.c, formula.k, formula.shape) == (1.0, 4, (1, 1, 1, 1))
