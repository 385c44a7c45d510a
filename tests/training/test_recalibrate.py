"""bnfuse.recalibrate against torch.optim.swa_utils.update_bn (float64) and a float64 NumPy population-statistics
reference, on PyTorch exports (TorchScript exporter, do_constant_folding=False: every BN kept) and onnx-built
graphs; only the statistics change."""

from __future__ import annotations

import copy
import io

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import bnfuse
from bnfuse.errors import BnfuseError

torch = pytest.importorskip("torch")  # the oracle
nn = torch.nn
update_bn = torch.optim.swa_utils.update_bn

BN_TYPES = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)


class Residual(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 6, 3, padding=1), nn.BatchNorm2d(6), nn.ReLU())
        self.branch = nn.Sequential(
            nn.Conv2d(6, 6, 3, padding=1),
            nn.BatchNorm2d(6),
            nn.ReLU(),
            nn.Conv2d(6, 6, 3, padding=1),
            nn.BatchNorm2d(6),
        )
        self.head = nn.Sequential(nn.ReLU(), nn.Conv2d(6, 4, 1), nn.BatchNorm2d(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.stem(x)
        return self.head(y + self.branch(y))


def _nets() -> dict[str, tuple[nn.Module, tuple[int, ...]]]:
    return {
        "bn1d": (
            nn.Sequential(nn.Linear(10, 12), nn.BatchNorm1d(12), nn.ReLU(), nn.Linear(12, 5), nn.BatchNorm1d(5)),
            (10,),
        ),
        "bn1d-sequence": (nn.Sequential(nn.Conv1d(3, 5, 3), nn.BatchNorm1d(5), nn.ReLU()), (3, 9)),
        "bn2d": (
            nn.Sequential(
                nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.Conv2d(8, 4, 3), nn.BatchNorm2d(4)
            ),
            (3, 8, 8),
        ),
        "bn3d": (
            nn.Sequential(nn.Conv3d(2, 4, 3), nn.BatchNorm3d(4), nn.ReLU(), nn.Conv3d(4, 3, 1), nn.BatchNorm3d(3)),
            (2, 5, 5, 5),
        ),
        "residual": (Residual(), (3, 6, 6)),
        "chain": (nn.Sequential(nn.Linear(6, 7), nn.BatchNorm1d(7), nn.BatchNorm1d(7), nn.ReLU()), (6,)),
    }


def _stale(net: nn.Module, seed: int = 0) -> nn.Module:
    """Random (stale) running statistics, distinct per BN so the exporter keeps each under its module's name."""
    generator = torch.Generator().manual_seed(seed)
    for module in net.modules():
        if isinstance(module, BN_TYPES):
            c = module.num_features
            module.running_mean.copy_(torch.rand(c, generator=generator) * 2 - 1)
            module.running_var.copy_(torch.rand(c, generator=generator) + 0.5)
            module.weight.data.copy_(torch.rand(c, generator=generator) + 0.5)
            module.bias.data.copy_(torch.rand(c, generator=generator) - 0.5)
    return net.eval()


def export(net: nn.Module, sample: tuple[int, ...]) -> onnx.ModelProto:
    buffer = io.BytesIO()
    torch.onnx.export(
        net.eval(),
        (torch.randn(2, *sample),),
        buffer,
        dynamo=False,
        do_constant_folding=False,
        input_names=["input"],
        output_names=["output"],
        dynamic_axes={"input": {0: "n"}, "output": {0: "n"}},
    )
    return onnx.load_from_string(buffer.getvalue())


def _data(sample: tuple[int, ...], sizes: list[int], seed: int = 1, mean: float = 0.5) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    total = rng.standard_normal((sum(sizes), *sample)) * 1.7 + mean  # a shifted, scaled domain
    edges = np.cumsum([0, *sizes])
    return [total[a:b].astype(np.float32) for a, b in zip(edges[:-1], edges[1:], strict=True)]


def initializers(model: onnx.ModelProto) -> dict[str, np.ndarray]:
    return {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}


def rel(actual: np.ndarray, expected: np.ndarray) -> float:
    """Largest error relative to the largest magnitude of the expected vector."""
    expected = np.asarray(expected, np.float64)
    return float(np.abs(np.asarray(actual, np.float64) - expected).max() / max(np.abs(expected).max(), 1e-30))


def bn_modules(net: nn.Module) -> dict[str, nn.Module]:
    return {name: m for name, m in net.named_modules() if isinstance(m, BN_TYPES)}


@pytest.mark.parametrize("name", list(_nets()))
def test_update_bn_matches_torch_update_bn_in_float64(name: str) -> None:
    """Batches of unequal size (update_bn weighs each batch the same): every running mean and variance within
    1e-6 of PyTorch's update_bn on the float64 copy of the module."""
    net, sample = _nets()[name]
    net = _stale(net)
    model = export(net, sample)
    batches = _data(sample, [5, 11, 3, 13])
    result, report = bnfuse.recalibrate(model, batches, mode="update-bn")
    reference = copy.deepcopy(net).double()
    update_bn([torch.from_numpy(b.astype(np.float64)) for b in batches], reference)
    values = initializers(result)
    modules = bn_modules(reference)
    assert report.batch_norms == len(modules) and report.batches == 4 and report.samples == 32
    for module_name, module in modules.items():
        assert rel(values[f"{module_name}.running_mean"], module.running_mean.numpy()) < 1e-6, module_name
        assert rel(values[f"{module_name}.running_var"], module.running_var.numpy()) < 1e-6, module_name


def population_reference(net: nn.Module, batches: list[np.ndarray]) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Layer by layer in float64: each BN's input over every sample (the layers run by the float64 module in
    eval() mode, every BN before it already set), its mean and biased variance computed by NumPy."""
    net = net.double().eval()
    data = torch.from_numpy(np.concatenate(batches).astype(np.float64))
    result = {}
    for name, module in bn_modules(net).items():  # module order is a topological order in these nets
        captured = []
        hook = module.register_forward_pre_hook(lambda m, args, into=captured: into.append(args[0].numpy().copy()))
        with torch.no_grad():
            net(data)
        hook.remove()
        x = np.moveaxis(captured[0], 1, -1).reshape(-1, captured[0].shape[1])
        mean = x.mean(axis=0)
        var = ((x - mean) ** 2).mean(axis=0)
        module.running_mean.copy_(torch.from_numpy(mean))
        module.running_var.copy_(torch.from_numpy(var))
        result[name] = (mean, var)
    return result


@pytest.mark.parametrize("name", list(_nets()))
def test_exact_matches_float64_layer_by_layer_population_statistics(name: str) -> None:
    net, sample = _nets()[name]
    net = _stale(net)
    model = export(net, sample)
    batches = _data(sample, [7, 16, 9])
    result, report = bnfuse.recalibrate(model, batches, mode="exact")
    reference = population_reference(copy.deepcopy(net), batches)
    values = initializers(result)
    assert report.passes == report.stages >= 1
    for module_name, (mean, var) in reference.items():
        assert rel(values[f"{module_name}.running_mean"], mean) < 1e-6, module_name
        assert rel(values[f"{module_name}.running_var"], var) < 1e-6, module_name


def mlp_model(mean_shift: float = 0.0) -> tuple[onnx.ModelProto, dict[str, np.ndarray]]:
    """x -> MatMul -> BN -> Relu -> MatMul -> BN -> (+ the first BN's output) -> BN, built with onnx."""
    rng = np.random.default_rng(4)
    weights = {
        "w1": rng.normal(0, 0.5, (6, 5)),
        "w2": rng.normal(0, 0.5, (5, 5)),
    }
    for k in (1, 2, 3):
        weights |= {
            f"s{k}": rng.uniform(0.5, 1.5, 5),
            f"b{k}": rng.normal(0, 0.3, 5),
            f"m{k}": rng.normal(0, 1, 5) + mean_shift,
            f"v{k}": rng.uniform(0.5, 2, 5),
        }
    weights = {k: v.astype(np.float32) for k, v in weights.items()}
    nodes = [
        helper.make_node("MatMul", ["x", "w1"], ["h1"]),
        helper.make_node("BatchNormalization", ["h1", "s1", "b1", "m1", "v1"], ["n1"], name="bn1"),
        helper.make_node("Relu", ["n1"], ["r1"]),
        helper.make_node("MatMul", ["r1", "w2"], ["h2"]),
        helper.make_node("BatchNormalization", ["h2", "s2", "b2", "m2", "v2"], ["n2"], name="bn2"),
        helper.make_node("Add", ["n2", "n1"], ["sum"]),
        helper.make_node("BatchNormalization", ["sum", "s3", "b3", "m3", "v3"], ["y"], name="bn3"),
    ]
    graph = helper.make_graph(
        nodes,
        "mlp",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 6])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 5])],
        [numpy_helper.from_array(v, k) for k, v in weights.items()],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), weights


def test_exact_matches_numpy_on_an_mlp_with_a_residual_add() -> None:
    """The reference entirely in NumPy float64: the stages are bn1, bn2, then bn3 (it reads bn1 and bn2)."""
    model, w = mlp_model()
    batches = _data((6,), [8, 3, 20, 1])
    result, report = bnfuse.recalibrate(model, batches, mode="exact")
    x = np.concatenate(batches).astype(np.float64)
    f = {k: v.astype(np.float64) for k, v in w.items()}

    def bn(h: np.ndarray, k: int, stats: dict) -> np.ndarray:
        mean, var = h.mean(axis=0), h.var(axis=0)
        stats[k] = (mean, var)
        # inference with the float32 statistics the model stores, as onnxruntime then runs it
        m32, v32 = mean.astype(np.float32).astype(np.float64), var.astype(np.float32).astype(np.float64)
        return f[f"s{k}"] * (h - m32) / np.sqrt(v32 + 1e-5) + f[f"b{k}"]

    stats: dict[int, tuple[np.ndarray, np.ndarray]] = {}
    n1 = bn(x @ f["w1"], 1, stats)
    n2 = bn(np.maximum(n1, 0) @ f["w2"], 2, stats)
    bn(n2 + n1, 3, stats)
    values = initializers(result)
    assert report.stages == 3 and report.passes == 3
    for k, (mean, var) in stats.items():
        assert rel(values[f"m{k}"], mean) < 1e-6 and rel(values[f"v{k}"], var) < 1e-6, k


def test_channel_mean_of_1000_loses_nothing_in_exact_mode() -> None:
    """BN straight on data of mean 1000 and std 0.01: the stored mean and variance are the float64 population
    statistics rounded once to float32 (within one float32 step), over batches of unequal size."""
    rng = np.random.default_rng(2)
    channels = 3
    data = (1000.0 + rng.standard_normal((101, channels, 4)) * 0.01).astype(np.float32)
    graph = helper.make_graph(
        [helper.make_node("BatchNormalization", ["x", "s", "b", "m", "v"], ["y"], name="bn")],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", channels, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", channels, 4])],
        [
            numpy_helper.from_array(np.ones(channels, np.float32), "s"),
            numpy_helper.from_array(np.zeros(channels, np.float32), "b"),
            numpy_helper.from_array(np.zeros(channels, np.float32), "m"),
            numpy_helper.from_array(np.ones(channels, np.float32), "v"),
        ],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    batches = [data[:13], data[13:50], data[50:51], data[51:]]
    result, _ = bnfuse.recalibrate(model, batches, mode="exact")
    x = np.moveaxis(data.astype(np.float64), 1, -1).reshape(-1, channels)
    mean, var = x.mean(axis=0), x.var(axis=0)
    values = initializers(result)
    for stored, exact in ((values["m"], mean), (values["v"], var)):
        assert np.all(np.abs(stored.astype(np.float64) - exact) <= np.spacing(exact.astype(np.float32))), (
            stored,
            exact,
        )
    # what a float32 one-pass E[x^2] - E[x]^2 would give: nothing like it
    naive = (x.astype(np.float32) ** 2).mean(axis=0) - x.astype(np.float32).mean(axis=0) ** 2
    assert np.abs(naive - var).max() > 100 * var.max()
    # update-bn at mean 1000 too: within 1e-6 of PyTorch's float64 update_bn
    net = nn.BatchNorm1d(channels).double()
    update_bn([torch.from_numpy(b.astype(np.float64)) for b in batches[:2] + batches[3:]], net)
    result, _ = bnfuse.recalibrate(model, batches[:2] + batches[3:], mode="update-bn")
    values = initializers(result)
    assert rel(values["m"], net.running_mean.numpy()) < 1e-6
    assert rel(values["v"], net.running_var.numpy()) < 1e-6


@pytest.mark.parametrize("mode", ["update-bn", "exact"])
def test_only_the_statistics_change_bit_for_bit(mode: str) -> None:
    net, sample = _nets()["residual"]
    model = export(_stale(net), sample)
    before = model.SerializeToString()
    result, report = bnfuse.recalibrate(model, _data(sample, [8, 8]), mode=mode)
    assert model.SerializeToString() == before  # the caller's model is untouched
    statistics = {n.input[i] for n in model.graph.node if n.op_type == "BatchNormalization" for i in (3, 4)}
    old, new = initializers(model), initializers(result)
    assert report.new_initializers == [] and set(old) == set(new)
    for name in old:
        if name in statistics:
            assert not np.array_equal(old[name], new[name]), name
        else:
            assert old[name].tobytes() == new[name].tobytes() and old[name].dtype == new[name].dtype, name
    assert [n.SerializeToString() for n in model.graph.node] == [n.SerializeToString() for n in result.graph.node]
    for field in ("input", "output", "value_info"):
        assert [v.SerializeToString() for v in getattr(model.graph, field)] == [
            v.SerializeToString() for v in getattr(result.graph, field)
        ]
    assert [(o.domain, o.version) for o in model.opset_import] == [(o.domain, o.version) for o in result.opset_import]


def test_shared_statistics_get_their_own_initializers() -> None:
    """A fresh PyTorch network's BN statistics are all zeros / ones: the exporter shares them behind Identity
    nodes. Each BN gets its own new initializer; the shared ones keep their values."""
    net, sample = _nets()["bn2d"]
    model = export(net.eval(), sample)
    result, report = bnfuse.recalibrate(model, _data(sample, [6, 6]))
    assert len(report.new_initializers) == 4
    old, new = initializers(model), initializers(result)
    assert all(old[name].tobytes() == new[name].tobytes() for name in old)
    import onnxruntime as ort

    ort.InferenceSession(result.SerializeToString(), providers=["CPUExecutionProvider"])


def test_recalibrated_bn_normalizes_its_data() -> None:
    """exact: on the calibration data the BN output has mean bias and variance scale^2 * var / (var + eps)."""
    import onnxruntime as ort

    model, w = mlp_model(mean_shift=3.0)
    batches = _data((6,), [10, 10, 10])
    result, _ = bnfuse.recalibrate(model, batches, mode="exact")
    probe = onnx.ModelProto()
    probe.CopyFrom(result)
    probe.graph.output.append(helper.make_tensor_value_info("n1", TensorProto.FLOAT, None))
    session = ort.InferenceSession(probe.SerializeToString(), providers=["CPUExecutionProvider"])
    n1 = session.run(["n1"], {"x": np.concatenate(batches)})[0].astype(np.float64)
    var = initializers(result)["v1"].astype(np.float64)
    assert np.allclose(n1.mean(axis=0), w["b1"], atol=1e-5)
    assert np.allclose(n1.var(axis=0), w["s1"].astype(np.float64) ** 2 * var / (var + 1e-5), rtol=1e-4)


def _if_model() -> onnx.ModelProto:
    inner_bn = helper.make_node("BatchNormalization", ["x", "s", "b", "m", "v"], ["y_then"], name="inner_bn")
    then = helper.make_graph([inner_bn], "then", [], [helper.make_tensor_value_info("y_then", TensorProto.FLOAT, None)])
    other = helper.make_graph(
        [helper.make_node("Identity", ["x"], ["y_else"])],
        "else",
        [],
        [helper.make_tensor_value_info("y_else", 1, None)],
    )
    ones = np.ones(2, np.float32)
    graph = helper.make_graph(
        [
            helper.make_node("ReduceMax", ["x"], ["mx"], keepdims=0),
            helper.make_node("Greater", ["mx", "zero"], ["cond"]),
            helper.make_node("If", ["cond"], ["y"], then_branch=then, else_branch=other, name="branch"),
        ],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 2])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        [numpy_helper.from_array(a, n) for n, a in (("s", ones), ("b", 0 * ones), ("m", 0 * ones), ("v", ones))]
        + [numpy_helper.from_array(np.array(0, np.float32), "zero")],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_bad_models_and_data_are_one_line_errors() -> None:
    model, _ = mlp_model()
    batches = _data((6,), [4])
    folded, _ = bnfuse.optimize(export(_stale(_nets()["bn2d"][0]), (3, 8, 8)))
    with pytest.raises(BnfuseError, match="recalibrate before folding"):
        bnfuse.recalibrate(folded, _data((3, 8, 8), [4]))
    with pytest.raises(BnfuseError, match="inside the body of If 'branch'"):
        bnfuse.recalibrate(_if_model(), [np.ones((2, 2), np.float32)])
    with pytest.raises(BnfuseError, match="has shape 4x7, the model takes \\?x6"):
        bnfuse.recalibrate(model, [np.ones((4, 7), np.float32)])
    with pytest.raises(BnfuseError, match="missing \\['x'\\]"):
        bnfuse.recalibrate(model, [{"input": batches[0]}])
    with pytest.raises(BnfuseError, match="no data"):
        bnfuse.recalibrate(model, [])
    with pytest.raises(BnfuseError, match="holds no samples"):
        bnfuse.recalibrate(model, [np.ones((0, 6), np.float32)])
    with pytest.raises(BnfuseError, match="NaN or infinite"):
        bnfuse.recalibrate(model, [np.full((3, 6), np.nan, np.float32)])
    with pytest.raises(BnfuseError, match="mode must be one of"):
        bnfuse.recalibrate(model, batches, mode="ema")
    training = onnx.ModelProto()
    training.CopyFrom(model)
    training.graph.node[1].attribute.append(helper.make_attribute("training_mode", 1))
    with pytest.raises(BnfuseError, match="training mode"):
        bnfuse.recalibrate(training, batches)


def test_float64_data_is_cast_and_progress_is_reported() -> None:
    model, _ = mlp_model()
    seen: list[tuple[int, int]] = []
    batches = [b.astype(np.float64) for b in _data((6,), [4, 4, 4])]
    _, report = bnfuse.recalibrate(model, batches, mode="exact", progress=lambda d, t: seen.append((d, t)))
    assert seen == [(k, 9) for k in range(1, 10)] and report.passes == 3


def test_a_missing_provider_is_an_error_not_a_silent_cpu_run() -> None:
    import onnxruntime as ort

    model, _ = mlp_model()
    if "CUDAExecutionProvider" in ort.get_available_providers():
        pytest.skip("this onnxruntime has CUDA")
    with pytest.raises(BnfuseError, match="has no CUDAExecutionProvider"):
        bnfuse.recalibrate(model, _data((6,), [4]), providers=["CUDAExecutionProvider", "CPUExecutionProvider"])


@pytest.mark.parametrize("mode", ["update-bn", "exact"])
def test_cuda_provider_matches_cpu(mode: str) -> None:
    """On a GPU: the same statistics from the CUDA execution provider (bnfuse's CUDA kernels) as on the CPU."""
    import onnxruntime as ort

    if "CUDAExecutionProvider" not in ort.get_available_providers():
        pytest.skip("no CUDAExecutionProvider in this onnxruntime")
    net, sample = _nets()["residual"]
    model = export(_stale(net), sample)
    batches = _data(sample, [8, 5, 8])
    cpu, _ = bnfuse.recalibrate(model, batches, mode=mode)
    cuda, _ = bnfuse.recalibrate(model, batches, mode=mode, providers=["CUDAExecutionProvider", "CPUExecutionProvider"])
    expected, actual = initializers(cpu), initializers(cuda)
    for name, value in expected.items():
        assert rel(actual[name], value) < 1e-5, name


def test_update_bn_on_a_dynamo_export(tmp_path) -> None:  # noqa: ANN001
    """The dynamo exporter with optimize=False keeps every BN (docs/exporting.md): same parity with update_bn."""
    pytest.importorskip("onnxscript")
    net, sample = _nets()["residual"]
    net = _stale(net)
    program = torch.onnx.export(
        net, (torch.randn(2, *sample),), dynamo=True, optimize=False, input_names=["input"],
        dynamic_shapes=({0: torch.export.Dim("n")},),
    )  # fmt: skip
    program.save(str(tmp_path / "dynamo.onnx"))
    batches = _data(sample, [5, 11, 3, 13])
    result, report = bnfuse.recalibrate(tmp_path / "dynamo.onnx", batches)
    reference = copy.deepcopy(net).double()
    update_bn([torch.from_numpy(b.astype(np.float64)) for b in batches], reference)
    values = initializers(result)
    assert report.batch_norms == 4
    for module_name, module in bn_modules(reference).items():
        assert rel(values[f"{module_name}.running_mean"], module.running_mean.numpy()) < 1e-6, module_name
        assert rel(values[f"{module_name}.running_var"], module.running_var.numpy()) < 1e-6, module_name


def test_statistics_computed_in_the_graph_are_refused_before_any_run() -> None:
    model, _ = mlp_model()
    constant = helper.make_node("Constant", [], ["m1c"], value=numpy_helper.from_array(np.zeros(5, np.float32)))
    model.graph.node.insert(0, constant)
    model.graph.node[2].input[3] = "m1c"
    with pytest.raises(BnfuseError, match="computed in the graph"):
        bnfuse.recalibrate(model, _data((6,), [4]))
