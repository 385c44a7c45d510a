"""The training pass against PyTorch: 20 SGD / Adam steps in onnxruntime vs 20 in torch, same initial weights."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import helper, numpy_helper

from bnfuse.errors import BnfuseError
from bnfuse.passes.training import SGD, Adam, build_training_graph, export_inference_model, read_spec
from tests.loaders import torch_nets

torch = pytest.importorskip("torch")


nets = torch_nets()
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
    kind: str, *, portable: bool, torch_kwargs: dict, torch_momentum: float | None = 0.1, **build_kwargs
) -> tuple[onnx.ModelProto, dict[str, np.ndarray], set[str]]:
    """Train ``kind`` in onnxruntime and in torch from the same weights; returns the training graph, its final
    state and the torch names of BN scales (exported with BN momentum ``torch_momentum``, PyTorch convention;
    None: PyTorch's cumulative moving average). The running variance is PyTorch's by default (unbiased)."""
    net, shape = nets.make(kind, momentum=torch_momentum)
    model = nets.export(net, torch.randn(*shape))
    data = nets.batches(shape, CLASSES[kind], STEPS)
    train_model, report = build_training_graph(model, portable=portable, **build_kwargs)
    losses, state, _ = run_steps(train_model, data, lr=torch_kwargs["lr"])
    expected_losses = nets.train_torch(net, data, **torch_kwargs)
    for step, (got, want) in enumerate(zip(losses, expected_losses, strict=True)):
        assert abs(got - want) <= RTOL * abs(want), f"step {step}: loss {got} vs torch {want}"
    expected = nets.state(net)
    scales = nets.bn_weights(net)
    untrained = scales if build_kwargs.get("fix_gamma") else set()  # fixed scales are not training state
    spec = read_spec(train_model)
    assert set(expected) - untrained == set(state) - set(spec.optimizer_state) - set(spec.counters)
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
    from bnfuse.runtime import conv_grad

    # the Conv weight and input gradients on oneDNN
    weight_grads = {"ConvWeightGrad", "ConvInputGrad"} if conv_grad.available() else set()
    assert {n.op_type for n in custom.graph.node if n.domain == "bnfuse"} == {
        "BatchNormalizationTraining",
        "BatchNormalizationGrad",
        "SGDStep",  # the fused optimizer update
        *weight_grads,
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


def test_static_batch_needs_a_batch_size() -> None:
    with pytest.raises(BnfuseError, match="batch-size"):
        build_training_graph(_dynamic_mlp(), static_batch=True)
    train_model, report = build_training_graph(_dynamic_mlp(), batch_size=6, loss="mse", static_batch=True)
    x = [i for i in train_model.graph.input if i.name == "x"][0]
    assert [d.dim_value for d in x.type.tensor_type.shape.dim] == [6, 4]
    assert report.batch == "static 6" and read_spec(train_model).batch_size == 6
    exported = export_inference_model(train_model)  # the exported model keeps the dynamic batch
    assert exported.graph.input[0].type.tensor_type.shape.dim[0].dim_param == "N"


def test_batch_stays_dynamic_by_default() -> None:
    train_model, report = build_training_graph(_dynamic_mlp(), batch_size=6, loss="mse")
    x = [i for i in train_model.graph.input if i.name == "x"][0]
    assert [d.dim_param or d.dim_value for d in x.type.tensor_type.shape.dim] == ["batch", 4]
    assert report.batch == "dynamic (any size), default 6" and read_spec(train_model).batch_size == 6
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


@pytest.mark.parametrize("portable", [False, True], ids=["custom-ops", "portable"])
@pytest.mark.parametrize("kind", ["resnet", "mlp"])
def test_momentum_none_cumulative_average_matches_torch(kind: str, portable: bool) -> None:
    # BatchNorm(momentum=None) exports as ONNX momentum 1.0; from a PyTorch export that is read as the
    # cumulative moving average, counted in bn.num_batches_tracked
    train_model, state, _ = compare_with_torch(
        kind,
        portable=portable,
        torch_momentum=None,
        optimizer=SGD(momentum=0.9),
        torch_kwargs={"lr": 0.05, "momentum": 0.9},
    )
    assert read_spec(train_model).counters == ["bn.num_batches_tracked"]
    assert float(state["bn.num_batches_tracked"]) == STEPS


def test_cumulative_convention_is_explicit_and_takes_no_momentum() -> None:
    net, shape = nets.make("mlp", momentum=0.1)  # exported momentum 0.9: cumulative only when asked
    model = nets.export(net, torch.randn(*shape))
    _, report = build_training_graph(model)
    assert "cumulative" not in report.momentum
    train_model, report = build_training_graph(model, momentum_convention="cumulative")
    assert report.momentum.startswith("cumulative moving average")
    data = nets.batches(shape, 5, 3)
    _, state, _ = run_steps(train_model, data, lr=0.1)
    nets.train_torch(net, data, lr=0.1, bn_momentum=None)  # the exported 0.1 stays; replace it below
    net2, _ = nets.make("mlp", momentum=None)
    nets.train_torch(net2, data, lr=0.1)
    for name, value in nets.state(net2).items():
        assert_close_relative(state[name], value, name)
    with pytest.raises(BnfuseError, match="takes no momentum"):
        build_training_graph(model, momentum=0.1, momentum_convention="cumulative")


@pytest.mark.parametrize("portable", [False, True], ids=["custom-ops", "portable"])
def test_two_group_sgd_matches_torch(portable: bool) -> None:
    """PyTorch's common recipe: no weight decay (and here half the learning rate) on BN weights and all biases."""
    from bnfuse.passes.training.groups import GroupRule

    net, _ = nets.make("resnet")
    no_decay = nets.bn_weights(net) | {n for n, _ in net.named_parameters() if n.endswith(".bias")}
    decay = {n for n, _ in net.named_parameters()} - no_decay
    rules = [GroupRule("@bn", weight_decay=0.0, lr_scale=0.5), GroupRule("*.bias", weight_decay=0.0, lr_scale=0.5)]
    train_model, _, _ = compare_with_torch(
        "resnet",
        portable=portable,
        optimizer=SGD(momentum=0.9, weight_decay=1e-2),
        param_groups=rules,
        torch_kwargs={
            "lr": 0.05,
            "momentum": 0.9,
            "groups": [(decay, {"weight_decay": 1e-2}), (no_decay, {"weight_decay": 0.0, "lr": 0.025})],
        },
    )
    _, report = build_training_graph(
        nets.export(net, torch.randn(4, 3, 8, 8)), optimizer=SGD(weight_decay=1e-2), param_groups=rules
    )
    assert report.weight_decay == f"0.01 on {len(decay)} tensors, 0 on {len(no_decay)} tensors; lr x0.5 on " + (
        f"{len(no_decay)} tensors"
    )
    assert "weight decay: 0.01 on" in report.format_text()


def test_two_group_adam_matches_torch() -> None:
    from bnfuse.passes.training.groups import GroupRule

    net, _ = nets.make("resnet")
    bn = nets.bn_weights(net) | {n.replace(".weight", ".bias") for n in nets.bn_weights(net)}
    rest = {n for n, _ in net.named_parameters()} - bn
    compare_with_torch(
        "resnet",
        portable=False,
        optimizer=Adam(weight_decay=1e-3),
        param_groups=[GroupRule("@bn", weight_decay=0.0, lr_scale=2.0)],
        torch_kwargs={
            "lr": 1e-3,
            "adam": True,
            "groups": [(rest, {"weight_decay": 1e-3}), (bn, {"weight_decay": 0.0, "lr": 2e-3})],
        },
    )


def test_parameter_group_rules() -> None:
    from bnfuse.passes.training.groups import GroupRule, parse_rule

    assert parse_rule("net.*.bias=0.5", "lr_scale") == GroupRule("net.*.bias", lr_scale=0.5)
    net, shape = nets.make("mlp")
    model = nets.export(net, torch.randn(*shape))
    # last match wins: decay everything, then not the 1-D tensors, then back on for net.0.bias
    rules = [GroupRule("@1d", weight_decay=0.0), GroupRule("net.0.bias", weight_decay=0.5)]
    _, report = build_training_graph(model, optimizer=SGD(weight_decay=0.1), param_groups=rules)
    assert report.weight_decay == "0.5 on 1 tensors, 0.1 on 3 tensors, 0 on 6 tensors"
    for bad, message in [
        (lambda: parse_rule("x", "lr_scale"), "PATTERN=VALUE"),
        (lambda: GroupRule("@convs"), "unknown parameter role"),
        (lambda: GroupRule("*", weight_decay=-1.0), ">= 0"),
        (lambda: build_training_graph(model, param_groups=[GroupRule("nothing*", lr_scale=2.0)]), "matches no"),
    ]:
        with pytest.raises(BnfuseError, match=message):
            bad()


def test_report_names_convention_and_running_variance_estimator() -> None:
    net, shape = nets.make("mlp")
    model = nets.export(net, torch.randn(*shape))
    _, report = build_training_graph(model)  # a PyTorch export: PyTorch's unbiased running variance
    assert report.running_var.startswith("unbiased") and "PyTorch export" in report.momentum
    _, report = build_training_graph(model, momentum=0.2, momentum_convention="pytorch")
    assert report.momentum == "0.2 (pytorch)" and report.running_var.startswith("unbiased")
    _, report = build_training_graph(model, momentum_convention="onnx")
    assert report.momentum == "node attributes (onnx convention)" and report.running_var.startswith("biased")
    _, report = build_training_graph(_dynamic_mlp(), batch_size=2, loss="mse")  # not from PyTorch: ONNX's
    assert report.running_var.startswith("biased")
    text = report.format_text()
    assert "running statistics: momentum node attributes (onnx convention); running variance biased" in text


def test_training_mode_export_trains_and_exports_in_inference_mode() -> None:
    net, shape = nets.make("mlp", seed=21)
    model = nets.export(net, torch.randn(*shape), training=True)
    modes = [a.i for n in model.graph.node for a in n.attribute if a.name == "training_mode"]
    assert modes == [1, 1]
    data = nets.batches(shape, 5, 4, seed=22)
    train_model, report = build_training_graph(model)
    assert report.training_mode_reset == 2 and "exported in training mode (reset)" in report.format_text()
    losses, state, _ = run_steps(train_model, data, lr=0.1)
    np.testing.assert_allclose(losses, nets.train_torch(net, data, lr=0.1), rtol=RTOL)
    exported = export_inference_model(train_model, state)
    assert not [a for n in exported.graph.node for a in n.attribute if a.name == "training_mode"]
    net.eval()
    x = data[0][0]
    with torch.no_grad():
        expected = net(torch.from_numpy(x)).numpy()
    got = ort.InferenceSession(exported.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})
    assert_close_relative(got[0], expected, "eval output")


def test_reset_training_mode_keeps_read_statistics_outputs() -> None:
    from bnfuse.passes.training.prepare import reset_training_mode

    graph = _dynamic_mlp().graph
    bn_node = graph.node[1]
    bn_node.attribute.append(helper.make_attribute("training_mode", 1))
    bn_node.output.extend(["new_mean", "new_var"])
    graph.output.append(helper.make_tensor_value_info("new_mean", onnx.TensorProto.FLOAT, [3]))
    assert reset_training_mode(graph) == 1
    assert list(graph.node[1].output) == ["y"] and not graph.node[1].attribute
    assert [(n.op_type, list(n.input), list(n.output)) for n in graph.node[2:]] == [
        ("Identity", ["m"], ["new_mean"])  # read (a graph output): the unchanged running mean; new_var: dropped
    ]
    assert reset_training_mode(graph) == 0


def test_fresh_pytorch_export_keeps_pytorch_names() -> None:
    """A fresh net's equal BN tensors are shared by the exporter behind Identity nodes named after the module's
    parameters: the training state uses those names, every PyTorch name is found."""
    torch.manual_seed(0)
    net = nets.ResNet()
    model = nets.export(net, torch.randn(4, 3, 8, 8))
    assert sum(n.op_type == "Identity" for n in model.graph.node) > 10
    train_model, _ = build_training_graph(model)
    spec = read_spec(train_model)
    assert set(spec.parameters) | set(spec.running_stats) == set(nets.state(net))
    assert spec.original_names == {}


def test_shared_bn_initializer_copies_map_back_to_the_original_name() -> None:
    from bnfuse.passes.training.untie import untie_parameters

    model = _dynamic_mlp()
    graph = model.graph
    graph.node.append(helper.make_node("BatchNormalization", ["y", "s", "b", "m", "v"], ["y2"]))
    graph.output[0].name = "y2"
    renamed = untie_parameters(model).renamed
    assert renamed == {"s.1": "s", "b.1": "b", "m.1": "m", "v.1": "v"}  # the last reader keeps the name
    assert [list(n.input[1:]) for n in graph.node[1:]] == [["s.1", "b.1", "m.1", "v.1"], ["s", "b", "m", "v"]]


def _depthwise_model(through_reshape: bool) -> onnx.ModelProto:
    """Conv(depthwise) -> BN -> GlobalAveragePool -> Flatten -> Gemm; the Conv kernel either direct or, as tf2onnx
    writes it, an HWCM-shaped initializer through Reshape -> Transpose."""
    rng = np.random.default_rng(3)
    kernel = rng.standard_normal((4, 1, 3, 3)).astype(np.float32)
    nodes = []
    if through_reshape:
        raw = numpy_helper.from_array(np.ascontiguousarray(kernel.transpose(2, 3, 1, 0)), "dw_hwcm")
        shape = numpy_helper.from_array(np.array([3, 3, 1, 4], np.int64), "dw_shape")
        nodes += [
            helper.make_node("Reshape", ["dw_hwcm", "dw_shape"], ["dw_r"]),
            helper.make_node("Transpose", ["dw_r"], ["dw"], perm=[3, 2, 0, 1]),
        ]
        weights = [raw, shape]
    else:
        weights = [numpy_helper.from_array(kernel, "dw_hwcm")]
    nodes += [
        helper.make_node("Conv", ["x", "dw" if through_reshape else "dw_hwcm"], ["c"], group=4, pads=[1, 1, 1, 1]),
        helper.make_node("BatchNormalization", ["c", "s", "b", "m", "v"], ["n"]),
        helper.make_node("GlobalAveragePool", ["n"], ["p"]),
        helper.make_node("Flatten", ["p"], ["f"]),
        helper.make_node("Gemm", ["f", "w", "wb"], ["y"], transB=1),
    ]
    inits = weights + [
        numpy_helper.from_array((0.5 + rng.random(4)).astype(np.float32), "s"),
        numpy_helper.from_array(rng.standard_normal(4).astype(np.float32), "b"),
        numpy_helper.from_array(np.zeros(4, np.float32), "m"),
        numpy_helper.from_array(np.ones(4, np.float32), "v"),
        numpy_helper.from_array(rng.standard_normal((3, 4)).astype(np.float32), "w"),
        numpy_helper.from_array(np.zeros(3, np.float32), "wb"),
    ]
    graph = helper.make_graph(
        nodes,
        "dw",
        [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [2, 4, 5, 5])],
        [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [2, 3])],
        inits,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


def test_weight_through_shape_only_ops_trains() -> None:
    """tf2onnx's depthwise kernels reach Conv through Reshape -> Transpose: they train, exactly as a direct one."""
    rng = np.random.default_rng(4)
    data = [(rng.standard_normal((2, 4, 5, 5)).astype(np.float32), rng.integers(0, 3, 2)) for _ in range(3)]
    shaped, report = build_training_graph(_depthwise_model(True), optimizer=SGD(momentum=0.9))
    direct, _ = build_training_graph(_depthwise_model(False), optimizer=SGD(momentum=0.9))
    assert "dw_hwcm" in read_spec(shaped).parameters and report.parameters == 5
    assert not [n for n in report.notes if "constant" in n]
    losses_s, state_s, _ = run_steps(shaped, data, lr=0.1)
    losses_d, state_d, _ = run_steps(direct, data, lr=0.1)
    np.testing.assert_allclose(losses_s, losses_d, rtol=1e-6)
    assert_close_relative(state_s["dw_hwcm"].transpose(3, 2, 0, 1), state_d["dw_hwcm"], "dw_hwcm")
    assert not np.allclose(state_s["dw_hwcm"], numpy_helper.to_array(_depthwise_model(True).graph.initializer[0]))


def test_report_lists_weights_left_constant_and_folded_scale_shifts() -> None:
    model = _depthwise_model(False)
    graph = model.graph
    # Gemm weight computed by a Mul of two constants; a Keras-3-style BN: per-channel Mul -> Add on constants
    graph.initializer.append(numpy_helper.from_array(np.full((1,), 2.0, np.float32), "two"))
    graph.node.insert(0, helper.make_node("Mul", ["w", "two"], ["w2"]))
    graph.node[-1].input[1] = "w2"
    graph.initializer.append(numpy_helper.from_array(np.full((1, 4, 1, 1), 1.5, np.float32), "k_scale"))
    graph.initializer.append(numpy_helper.from_array(np.full((1, 4, 1, 1), 0.1, np.float32), "k_shift"))
    index = [n.op_type for n in graph.node].index("GlobalAveragePool")
    graph.node[index].input[0] = "n2"
    graph.node.insert(index, helper.make_node("Add", ["n1", "k_shift"], ["n2"]))
    graph.node.insert(index, helper.make_node("Mul", ["n", "k_scale"], ["n1"]))
    _, report = build_training_graph(model, trainable=["s", "b", "wb"])
    text = report.format_text()
    assert "1 weights are computed from constants by other ops and stay constant: Gemm" in text
    assert "1 weights not matched by --trainable stay constant: dw_hwcm" in text
    assert "1 per-channel Mul -> Add scale-shifts on constants" in text


def test_dropout_without_a_ratio_drops_half_and_a_computed_ratio_is_refused() -> None:
    model = _dynamic_mlp()
    graph = model.graph
    graph.node[1].output[0] = "h2"
    graph.node.append(helper.make_node("Dropout", ["h2"], ["y"]))
    train_model, report = build_training_graph(model, batch_size=64, loss="mse")
    assert report.notes == ["1 Dropout nodes drop in training (seed 0; masks are onnxruntime's, not PyTorch's)"]
    rng = np.random.default_rng(0)
    x, target = rng.standard_normal((64, 4)).astype(np.float32), np.zeros((64, 3), np.float32)
    _, _, outputs = run_steps(train_model, [(x, target)], lr=0.0)
    dropped = float(np.mean(outputs[0]["y"] == 0))
    assert 0.35 < dropped < 0.65
    graph.node.insert(0, helper.make_node("Sqrt", ["r0"], ["r"]))
    graph.initializer.append(numpy_helper.from_array(np.array(0.25, np.float32), "r0"))
    graph.node[-1].input.append("r")
    with pytest.raises(BnfuseError, match="ratio is not a constant"):
        build_training_graph(model, batch_size=2, loss="mse")
    _, report = build_training_graph(model, batch_size=2, loss="mse", dropout="off")
    assert report.notes == ["1 Dropout nodes run as in inference (identity): training runs without dropout"]


class _FixedMaskDropout(torch.nn.Module):
    """PyTorch's Dropout with the masks onnxruntime drew (one per step), to check the backward against."""

    def __init__(self, ratio: float, masks: list[np.ndarray]) -> None:
        super().__init__()
        self.ratio, self.masks = ratio, list(masks)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.from_numpy(self.masks.pop(0).astype(np.float32)) / (1 - self.ratio)


def test_training_mode_dropout_matches_torch_with_the_same_masks() -> None:
    torch.manual_seed(3)
    net = torch.nn.Sequential(
        torch.nn.Linear(12, 16),
        torch.nn.BatchNorm1d(16),
        torch.nn.ReLU(),
        torch.nn.Dropout(0.3),
        torch.nn.Linear(16, 5),
    )
    nets.randomize_bn(net, 3)
    model = nets.export(net, torch.randn(8, 12), training=True)  # Dropout(x, ratio, training_mode=True)
    assert [len(n.input) for n in model.graph.node if n.op_type == "Dropout"] == [3]
    train_model, report = build_training_graph(model, optimizer=SGD(momentum=0.9), dropout_seed=5)
    assert "1 Dropout nodes drop in training (seed 5;" in report.format_text()
    drop = next(n for n in train_model.graph.node if n.op_type == "Dropout")
    assert helper.get_attribute_value(next(a for a in drop.attribute if a.name == "seed")) == 5
    train_model.graph.output.append(helper.make_tensor_value_info(drop.output[1], onnx.TensorProto.BOOL, None))
    data = nets.batches((8, 12), 5, 4, seed=4)
    losses, state, outputs = run_steps(train_model, data, lr=0.05)
    masks = [out[drop.output[1]] for out in outputs]
    assert 0.5 < np.mean(masks) < 0.9 and not np.array_equal(masks[0], masks[1])  # ~70% kept, new every step
    again, _, _ = run_steps(train_model, data, lr=0.05)
    assert again == losses  # the same seed: the same masks in a new session
    net[3] = _FixedMaskDropout(0.3, masks)
    expected = nets.train_torch(net, data, lr=0.05, momentum=0.9)
    np.testing.assert_allclose(losses, expected, rtol=RTOL)
    for name, value in nets.state(net).items():
        assert_close_relative(state[name], value, name)
    exported = export_inference_model(train_model, state)  # an inference model: Dropout without training_mode
    assert [len(n.input) for n in exported.graph.node if n.op_type == "Dropout"] == [2]
    off, report = build_training_graph(model, dropout="off")
    assert not [n for n in off.graph.node if n.op_type == "Dropout" and len(n.input) > 2]
    assert "1 Dropout nodes run as in inference (identity)" in report.format_text()


def test_matmul_add_bias_trains_like_a_gemm_bias() -> None:
    """MatMul + Add(bias) (Linear / Dense on rank > 2, tf2onnx's Dense) trains its bias, as Gemm's would."""
    gemm = _depthwise_model(False)
    split = _depthwise_model(False)
    graph = split.graph
    index = [n.op_type for n in graph.node].index("Gemm")
    graph.node.remove(graph.node[index])
    graph.node.insert(index, helper.make_node("Add", ["yw", "wb"], ["y"]))
    graph.node.insert(index, helper.make_node("MatMul", ["f", "wt"], ["yw"]))
    w = next(t for t in graph.initializer if t.name == "w")
    graph.initializer.append(numpy_helper.from_array(numpy_helper.to_array(w).T.copy(), "wt"))
    graph.initializer.remove(w)
    rng = np.random.default_rng(5)
    data = [(rng.standard_normal((2, 4, 5, 5)).astype(np.float32), rng.integers(0, 3, 2)) for _ in range(3)]
    trained_split, _ = build_training_graph(split, optimizer=SGD(momentum=0.9))
    trained_gemm, _ = build_training_graph(gemm, optimizer=SGD(momentum=0.9))
    assert "wb" in read_spec(trained_split).parameters
    losses_s, state_s, _ = run_steps(trained_split, data, lr=0.1)
    losses_g, state_g, _ = run_steps(trained_gemm, data, lr=0.1)
    np.testing.assert_allclose(losses_s, losses_g, rtol=1e-6)
    assert_close_relative(state_s["wb"], state_g["wb"], "wb")
    assert_close_relative(state_s["wt"].T, state_g["w"], "w")
    assert not np.allclose(state_s["wb"], 0)


def test_export_resets_training_mode_left_in_an_older_training_graph() -> None:
    from bnfuse.passes.training.spec import read_inference_graph, write_spec

    train_model, _ = build_training_graph(_dynamic_mlp(), batch_size=2, loss="mse")
    skeleton = read_inference_graph(train_model)  # as a build before the reset wrote it
    next(n for n in skeleton.node if n.op_type == "BatchNormalization").attribute.append(
        helper.make_attribute("training_mode", 1)
    )
    write_spec(train_model, read_spec(train_model), skeleton)
    exported = export_inference_model(train_model)
    assert not [a for n in exported.graph.node for a in n.attribute if a.name == "training_mode"]


def test_weights_listed_as_inputs_too_train() -> None:
    """IR 3 models (older zoos) list every initializer as a graph input as well: they are still the weights."""
    model = _dynamic_mlp()
    graph = model.graph
    graph.input.extend(helper.make_tensor_value_info(t.name, t.data_type, list(t.dims)) for t in graph.initializer)
    del model.opset_import[:]
    model.opset_import.append(helper.make_opsetid("", 9))
    model.ir_version = 3
    train_model, report = build_training_graph(model, batch_size=2, loss="mse")
    assert read_spec(train_model).parameters == ["w", "s", "b"] and read_spec(train_model).data == ["x"]
    rng = np.random.default_rng(2)
    batch = (rng.standard_normal((2, 4)).astype(np.float32), rng.standard_normal((2, 3)).astype(np.float32))
    _, state, _ = run_steps(train_model, [batch], lr=0.1)
    assert not np.allclose(state["w"], numpy_helper.to_array(graph.initializer[0]))
    assert [i.name for i in export_inference_model(train_model, state).graph.input] == ["x"]


@pytest.mark.parametrize("kind", ["resnet", "mlp"])
def test_fused_relu_graph_equals_unfused_graph(kind: str) -> None:
    """BN -> ReLU fused into the BN ops (fuse_relu=True) trains exactly as the unfused graph: same losses and state
    over several steps; the Relu and its Greater / Cast / Mul backward nodes are gone."""
    net, shape = nets.make(kind, seed=5)
    model = nets.export(net, torch.randn(*shape))
    data = nets.batches(shape, CLASSES[kind], 5, seed=6)
    relus = sum(n.op_type == "Relu" for n in model.graph.node)
    bn_relu = {
        n.output[0]
        for n in model.graph.node
        if n.op_type == "BatchNormalization"
        and [m.op_type for m in model.graph.node if n.output[0] in m.input] == ["Relu"]
    }
    assert bn_relu  # the nets have BN -> ReLU
    fused, _ = build_training_graph(model, optimizer=SGD(momentum=0.9))  # fused by default
    unfused, _ = build_training_graph(model, optimizer=SGD(momentum=0.9), fuse_relu=False)

    def count(graph: onnx.ModelProto, op_type: str, activation: str | None = None) -> int:
        def fused_with(node: onnx.NodeProto) -> str:
            return next((helper.get_attribute_value(a).decode() for a in node.attribute if a.name == "activation"), "")

        return sum(n.op_type == op_type and activation in (None, fused_with(n)) for n in graph.graph.node)

    assert count(fused, "Relu") == count(unfused, "Relu") - len(bn_relu) == relus - len(bn_relu)
    for op_type in ("Greater", "Cast"):
        assert count(fused, op_type) == count(unfused, op_type) - len(bn_relu)
    assert count(fused, "BatchNormalizationTraining", activation="relu") == len(bn_relu)
    assert count(fused, "BatchNormalizationGrad", activation="relu") == len(bn_relu)
    assert count(unfused, "BatchNormalizationTraining", activation="relu") == 0
    assert all(
        len(n.input) == 6 for n in fused.graph.node if n.op_type == "BatchNormalizationGrad" and len(n.attribute) > 5
    )
    losses_f, state_f, _ = run_steps(fused, data, lr=0.05)
    losses_u, state_u, _ = run_steps(unfused, data, lr=0.05)
    np.testing.assert_allclose(losses_f, losses_u, rtol=1e-6)
    assert set(state_f) == set(state_u)
    for name in state_u:
        assert_close_relative(state_f[name], state_u[name], name)


def test_portable_graph_never_fuses_relu() -> None:
    net, shape = nets.make("resnet", seed=5)
    model = nets.export(net, torch.randn(*shape))
    portable, _ = build_training_graph(model, portable=True, fuse_relu=True)
    unfused, _ = build_training_graph(model, portable=True, fuse_relu=False)
    assert portable.graph.SerializeToString() == unfused.graph.SerializeToString()


@pytest.mark.parametrize("kind", ["resnet", "mlp"])
def test_fused_relu_graph_matches_torch(kind: str) -> None:
    train_model, _, _ = compare_with_torch(
        kind,
        portable=False,
        fuse_relu=True,
        optimizer=SGD(momentum=0.9, weight_decay=1e-3),
        torch_kwargs={"lr": 0.05, "momentum": 0.9, "weight_decay": 1e-3},
    )
    assert any(a.name == "activation" for n in train_model.graph.node for a in n.attribute)
