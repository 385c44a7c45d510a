"""The training pass against PyTorch: 20 SGD / Adam steps in onnxruntime vs 20 in torch, same initial weights."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import helper, numpy_helper

from bnfuse.errors import BnfuseError
from bnfuse.passes.training import SGD, Adam, build_training_graph, export_inference_model, read_spec

torch = pytest.importorskip("torch")


def _load_nets():
    spec = importlib.util.spec_from_file_location("bnfuse_test_torch_nets", Path(__file__).with_name("torch_nets.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


nets = _load_nets()
STEPS = 20
RTOL = 1e-4
CLASSES = {"resnet": 10, "mlp": 5}


def session(train_model: onnx.ModelProto) -> ort.InferenceSession:
    custom = any(node.domain == "bnfuse" for node in train_model.graph.node)
    if custom:
        from bnfuse.runtime import session_options

        options = session_options(["CPUExecutionProvider"])
    else:
        options = ort.SessionOptions()
    options.log_severity_level = 3  # state initializers are also inputs, on purpose
    return ort.InferenceSession(train_model.SerializeToString(), options, providers=["CPUExecutionProvider"])


def run_steps(train_model: onnx.ModelProto, data, lr: float) -> tuple[list[float], dict[str, np.ndarray], list[dict]]:
    """Plain onnxruntime: feed state in, take the updated state out, every step."""
    spec = read_spec(train_model)
    values = {t.name: numpy_helper.to_array(t) for t in train_model.graph.initializer}
    state = {name: values[name] for name in spec.state}
    sess = session(train_model)
    names = [o.name for o in sess.get_outputs()]
    losses, outputs = [], []
    for x, target in data:
        feeds = {spec.data[0]: x, spec.targets[0]: target, spec.lr: np.array(lr, np.float32), **state}
        out = dict(zip(names, sess.run(None, feeds), strict=True))
        losses.append(float(out[spec.loss]))
        outputs.append(out)
        state = {name: out[new] for name, new in spec.state.items()}
    return losses, state, outputs


def assert_close_relative(actual, expected, what: str) -> None:
    """Per-tensor relative error: max |actual - expected| over the tensor / max |expected| of that tensor.

    Not elementwise: like torch.testing's atol scaled to the tensor's magnitude, so elements near 0 (a BN
    bias's gradient is 0 in exact arithmetic) are held to the tensor's scale, not to their own.
    """
    actual, expected = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    scale = max(float(np.max(np.abs(expected))), 1e-6)
    error = float(np.max(np.abs(actual - expected))) / scale
    assert error <= RTOL, f"{what}: per-tensor relative error {error:.3g}"


def bn_scales(model: onnx.ModelProto) -> dict[str, np.ndarray]:
    """Scale initializer of every BatchNormalization of an inference model, by name."""
    values = {t.name: t for t in model.graph.initializer}
    names = [n.input[1] for n in model.graph.node if n.op_type == "BatchNormalization"]
    return {name: numpy_helper.to_array(values[name]) for name in names}


def compare_with_torch(
    kind: str, *, portable: bool, torch_kwargs: dict, torch_momentum: float = 0.1, **build_kwargs
) -> tuple[onnx.ModelProto, dict[str, np.ndarray], set[str]]:
    """Train ``kind`` in onnxruntime and in torch from the same weights; returns the training graph, its final
    state and the torch names of BN scales (exported with BN momentum ``torch_momentum``, PyTorch convention)."""
    net, shape = nets.make(kind, momentum=torch_momentum)
    model = nets.export(net, torch.randn(*shape))
    data = nets.batches(shape, CLASSES[kind], STEPS)
    train_model, report = build_training_graph(model, unbiased_running_var=True, portable=portable, **build_kwargs)
    losses, state, _ = run_steps(train_model, data, lr=torch_kwargs["lr"])
    expected_losses = nets.train_torch(net, data, **torch_kwargs)
    for step, (got, want) in enumerate(zip(losses, expected_losses, strict=True)):
        assert abs(got - want) <= RTOL * abs(want), f"step {step}: loss {got} vs torch {want}"
    expected = nets.state(net)
    scales = nets.bn_weights(net)
    untrained = scales if build_kwargs.get("fix_gamma") else set()  # fixed scales are not training state
    assert set(expected) - untrained == set(state) - set(read_spec(train_model).optimizer_state)
    for name in set(expected) - untrained:
        assert_close_relative(state[name], expected[name], name)
    assert report.batch_norms == sum(isinstance(m, torch.nn.modules.batchnorm._BatchNorm) for m in net.modules())
    return train_model, state, scales


@pytest.mark.parametrize("portable", [False, True], ids=["custom-ops", "portable"])
@pytest.mark.parametrize("kind", ["resnet", "mlp"])
def test_sgd_momentum_weight_decay_matches_torch(kind: str, portable: bool) -> None:
    compare_with_torch(
        kind,
        portable=portable,
        optimizer=SGD(momentum=0.9, weight_decay=1e-3),
        torch_kwargs={"lr": 0.05, "momentum": 0.9, "weight_decay": 1e-3},
    )


@pytest.mark.parametrize("portable", [False, True], ids=["custom-ops", "portable"])
@pytest.mark.parametrize("kind", ["resnet", "mlp"])
def test_frozen_bn_matches_torch_eval_mode_bn(kind: str, portable: bool) -> None:
    compare_with_torch(
        kind,
        portable=portable,
        frozen_bn=True,
        optimizer=SGD(momentum=0.5),
        torch_kwargs={"lr": 0.05, "momentum": 0.5, "frozen_bn": True},
    )


@pytest.mark.parametrize("portable", [False, True], ids=["custom-ops", "portable"])
@pytest.mark.parametrize("kind", ["resnet", "mlp"])
def test_pytorch_momentum_convention_matches_torch(kind: str, portable: bool) -> None:
    # exported with torch momentum 0.1 (node attribute 0.9); torch then trains with 0.3, and only the override
    # momentum=0.3 in the PyTorch convention reproduces it (the node attributes would give 0.1)
    compare_with_torch(
        kind,
        portable=portable,
        torch_momentum=0.1,
        momentum=0.3,
        momentum_convention="pytorch",
        optimizer="sgd",
        torch_kwargs={"lr": 0.1, "bn_momentum": 0.3},
    )


@pytest.mark.parametrize("portable", [False, True], ids=["custom-ops", "portable"])
@pytest.mark.parametrize("kind", ["resnet", "mlp"])
def test_fix_gamma_matches_torch_with_frozen_unit_weight(kind: str, portable: bool) -> None:
    # the exported net has random BN weights: the pass must set them to 1 (torch sets them after export)
    train_model, state, scales = compare_with_torch(
        kind,
        portable=portable,
        fix_gamma=True,
        optimizer=SGD(momentum=0.9, weight_decay=1e-3),
        torch_kwargs={"lr": 0.05, "momentum": 0.9, "weight_decay": 1e-3, "fix_gamma": True},
    )
    exported = bn_scales(export_inference_model(train_model, state))
    assert set(exported) == scales
    for name, value in exported.items():
        np.testing.assert_array_equal(value, np.ones_like(value), err_msg=name)
    assert not scales & set(read_spec(train_model).parameters)


def test_onnx_convention_momentum_from_node_attributes_matches_torch() -> None:
    compare_with_torch("mlp", portable=False, torch_momentum=0.25, optimizer="sgd", torch_kwargs={"lr": 0.1})


def test_nesterov_matches_torch() -> None:
    compare_with_torch(
        "mlp",
        portable=True,
        optimizer=SGD(momentum=0.8, nesterov=True),
        torch_kwargs={"lr": 0.05, "momentum": 0.8, "nesterov": True},
    )


@pytest.mark.parametrize("portable", [False, True], ids=["custom-ops", "portable"])
def test_adam_matches_torch(portable: bool) -> None:
    # (resnet only: in the MLP a Linear bias feeds BN, its true gradient is 0 and Adam would amplify rounding noise)
    compare_with_torch(
        "resnet",
        portable=portable,
        optimizer=Adam(weight_decay=1e-4),
        torch_kwargs={"lr": 1e-3, "adam": True, "weight_decay": 1e-4},
    )


@pytest.mark.parametrize("frozen_bn", [False, True])
@pytest.mark.parametrize("fix_gamma", [False, True])
def test_portable_graph_equals_custom_op_graph(fix_gamma: bool, frozen_bn: bool) -> None:
    net, shape = nets.make("resnet", seed=3)
    model = nets.export(net, torch.randn(*shape))
    data = nets.batches(shape, 10, 5, seed=4)
    # biased running variance: where it fits, the portable forward is ONNX's own training-mode BatchNormalization
    options = {"fix_gamma": fix_gamma, "frozen_bn": frozen_bn, "optimizer": SGD(momentum=0.9)}
    options["unbiased_running_var"] = False
    custom, _ = build_training_graph(model, **options)
    portable, _ = build_training_graph(model, portable=True, **options)
    assert {n.domain for n in portable.graph.node} <= {""}
    assert all(o.domain != "bnfuse" for o in portable.opset_import)
    assert {n.op_type for n in custom.graph.node if n.domain == "bnfuse"} == {
        "BatchNormalizationTraining",
        "BatchNormalizationGrad",
    }
    assert not any(n.op_type == "BatchNormalization" for n in custom.graph.node)
    # frozen BN does not fit ONNX's training-mode BatchNormalization: Reduce* / elementwise lowering instead
    assert any(n.op_type == "BatchNormalization" for n in portable.graph.node) == (not frozen_bn)
    losses_c, state_c, outs_c = run_steps(custom, data, lr=0.05)
    losses_p, state_p, outs_p = run_steps(portable, data, lr=0.05)
    np.testing.assert_allclose(losses_p, losses_c, rtol=1e-5)
    for name in state_c:
        assert_close_relative(state_p[name], state_c[name], name)
    if fix_gamma:  # no scale is trained, and every one is 1 in the exported model
        scales = bn_scales(export_inference_model(custom, state_c))
        assert set(scales) == nets.bn_weights(net)
        assert not set(scales) & set(read_spec(custom).parameters)
        assert all(np.array_equal(value, np.ones_like(value)) for value in scales.values())


@pytest.mark.parametrize("unbiased", [False, True], ids=["fits", "unbiased-running-var"])
@pytest.mark.parametrize("kind", ["resnet", "mlp"])
def test_portable_forward_is_onnx_training_bn_where_it_fits(kind: str, unbiased: bool) -> None:
    # PyTorch-convention momentum 0.3 = ONNX momentum 0.7; ONNX BN updates with the biased variance only
    net, shape = nets.make(kind, seed=5)
    model = nets.export(net, torch.randn(*shape))
    data = nets.batches(shape, CLASSES[kind], 5, seed=6)
    options = {
        "momentum": 0.3,
        "momentum_convention": "pytorch",
        "unbiased_running_var": unbiased,
        "optimizer": SGD(momentum=0.9),
    }
    custom, report = build_training_graph(model, **options)
    portable, _ = build_training_graph(model, portable=True, **options)
    bns = [n for n in portable.graph.node if n.op_type == "BatchNormalization"]
    if unbiased:
        assert not bns
    else:
        assert len(bns) == report.batch_norms
        for node in bns:
            attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
            assert attrs["training_mode"] == 1 and attrs["momentum"] == pytest.approx(0.7), node.name
    losses_c, state_c, _ = run_steps(custom, data, lr=0.05)
    losses_p, state_p, _ = run_steps(portable, data, lr=0.05)
    np.testing.assert_allclose(losses_p, losses_c, rtol=1e-5)
    initial = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    spec = read_spec(portable)
    # (not the optimizer state: the MLP's Linear biases feeding BN have a true gradient of 0, their momentum
    # buffers are rounding noise)
    for name in spec.parameters + spec.running_stats:
        assert_close_relative(state_p[name], state_c[name], name)
    for name in spec.running_stats:  # the statistics really were updated
        assert not np.allclose(state_p[name], initial[name]), name


def test_mse_loss_matches_torch() -> None:
    net, shape = nets.make("mlp", seed=5)
    model = nets.export(net, torch.randn(*shape))
    rng = np.random.default_rng(6)
    data = [
        (rng.standard_normal(shape).astype(np.float32), rng.standard_normal((shape[0], 5)).astype(np.float32))
        for _ in range(5)
    ]
    train_model, _ = build_training_graph(model, loss="mse", unbiased_running_var=True)
    losses, state, _ = run_steps(train_model, data, lr=0.1)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    net.train()
    for (x, t), got in zip(data, losses, strict=True):
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(net(torch.from_numpy(x)), torch.from_numpy(t))
        loss.backward()
        opt.step()
        assert abs(got - float(loss.detach())) <= RTOL * abs(float(loss.detach()))
    for name, value in nets.state(net).items():
        assert_close_relative(state[name], value, name)


def test_seed_loss_takes_the_output_gradient_as_input() -> None:
    net, shape = nets.make("mlp", seed=7)
    model = nets.export(net, torch.randn(*shape))
    rng = np.random.default_rng(8)
    x, seed = rng.standard_normal(shape).astype(np.float32), rng.standard_normal((shape[0], 5)).astype(np.float32)
    train_model, _ = build_training_graph(model, loss="seed", unbiased_running_var=True)
    assert read_spec(train_model).targets == ["grad.y"]
    losses, state, _ = run_steps(train_model, [(x, seed)], lr=0.1)
    net.train()
    y = net(torch.from_numpy(x))
    y.backward(torch.from_numpy(seed))
    assert abs(losses[0] - float((y * torch.from_numpy(seed)).sum().detach())) < 1e-4
    with torch.no_grad():
        for param in net.parameters():
            param -= 0.1 * param.grad
    for name, value in nets.state(net).items():
        assert_close_relative(state[name], value, name)


def test_trainable_subset_leaves_the_rest_alone() -> None:
    net, shape = nets.make("mlp", seed=9)
    model = nets.export(net, torch.randn(*shape))
    train_model, report = build_training_graph(model, trainable=["net.6.*"])
    spec = read_spec(train_model)
    assert spec.parameters == ["net.6.weight", "net.6.bias"] and report.parameters == 2
    data = nets.batches(shape, 5, 2)
    _, state, _ = run_steps(train_model, data, lr=0.5)
    exported = export_inference_model(train_model, state)
    before = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    after = {t.name: numpy_helper.to_array(t) for t in exported.graph.initializer}
    np.testing.assert_array_equal(after["net.0.weight"], before["net.0.weight"])
    assert not np.allclose(after["net.6.weight"], before["net.6.weight"])
    assert not np.allclose(after["net.1.running_mean"], before["net.1.running_mean"])  # statistics still update


def test_input_model_is_not_modified() -> None:
    net, shape = nets.make("resnet")
    model = nets.export(net, torch.randn(*shape))
    before = model.SerializeToString()
    build_training_graph(model, optimizer=SGD(momentum=0.9), portable=True)
    assert model.SerializeToString() == before


def test_deduplicated_bn_initializers_are_untied() -> None:
    # a fresh torch network: every BN weight is ones, so the exporter shares one initializer via Identity
    torch.manual_seed(0)
    net = nets.MLP()
    model = nets.export(net, torch.randn(8, 12))
    assert any(n.op_type == "Identity" for n in model.graph.node)
    train_model, report = build_training_graph(model, unbiased_running_var=True)
    assert report.batch_norms == 2 and report.running_stats == 4
    data = nets.batches((8, 12), 5, 3)
    losses, state, _ = run_steps(train_model, data, lr=0.1)
    expected = nets.train_torch(net, data, lr=0.1)
    np.testing.assert_allclose(losses, expected, rtol=RTOL)


def _dynamic_mlp() -> onnx.ModelProto:
    rng = np.random.default_rng(0)
    inits = [
        numpy_helper.from_array(rng.standard_normal((4, 3)).astype(np.float32), "w"),
        numpy_helper.from_array(np.ones(3, np.float32), "s"),
        numpy_helper.from_array(np.zeros(3, np.float32), "b"),
        numpy_helper.from_array(np.zeros(3, np.float32), "m"),
        numpy_helper.from_array(np.ones(3, np.float32), "v"),
    ]
    graph = helper.make_graph(
        [
            helper.make_node("MatMul", ["x", "w"], ["h"]),
            helper.make_node("BatchNormalization", ["h", "s", "b", "m", "v"], ["y"]),
        ],
        "g",
        [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, ["N", 4])],
        [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, ["N", 3])],
        inits,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


def test_dynamic_batch_needs_a_batch_size() -> None:
    with pytest.raises(BnfuseError, match="batch-size"):
        build_training_graph(_dynamic_mlp())
    train_model, _ = build_training_graph(_dynamic_mlp(), batch_size=6, loss="mse")
    x = [i for i in train_model.graph.input if i.name == "x"][0]
    assert [d.dim_value for d in x.type.tensor_type.shape.dim] == [6, 4]
    exported = export_inference_model(train_model)  # the exported model keeps the dynamic batch
    assert exported.graph.input[0].type.tensor_type.shape.dim[0].dim_param == "N"


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"loss": "hinge"}, "unknown loss"),
        ({"optimizer": "lbfgs"}, "unknown optimizer"),
        ({"trainable": ["nothing*"]}, "matches no"),
        ({"frozen_bn": ["nope"]}, "names no BatchNormalization"),
        ({"momentum": 1.5}, "momentum"),
        ({"momentum_convention": "keras"}, "momentum convention"),
        ({"momentum_convention": "pytorch"}, "'pytorch' given without a momentum"),
        ({"momentum_convention": "cudnn"}, "'cudnn' given without a momentum"),
        ({"output": "z"}, "not a model output"),
    ],
)
def test_bad_options_are_one_line_errors(options: dict, message: str) -> None:
    with pytest.raises(BnfuseError, match=message):
        build_training_graph(_dynamic_mlp(), batch_size=2, loss=options.pop("loss", "mse"), **options)


def test_onnx_convention_alias_without_momentum_uses_node_attributes() -> None:
    _, report = build_training_graph(_dynamic_mlp(), batch_size=2, loss="mse", momentum_convention="mxnet")
    assert report.momentum == "node attributes (onnx convention)"
