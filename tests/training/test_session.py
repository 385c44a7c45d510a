"""TrainingSession: state kept between steps, parity with PyTorch, export back and fold with bnfuse.optimize."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest

from bnfuse.errors import BnfuseError
from bnfuse.passes.optimize import optimize
from bnfuse.passes.training import SGD, build_training_graph, fast_rules, read_spec
from bnfuse.training.session import TrainingSession
from tests.loaders import torch_nets

torch = pytest.importorskip("torch")
nets = torch_nets()
RTOL = 1e-4


def _rel(actual, expected) -> float:
    actual, expected = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    return float(np.max(np.abs(actual - expected))) / max(float(np.max(np.abs(expected))), 1e-6)


def _steps_as_pytorch(session: TrainingSession, net: torch.nn.Module, data: list) -> None:
    """The session's losses and final state against PyTorch's SGD (lr 0.05, momentum 0.9) over the same batches."""
    losses = [session.step(x, labels) for x, labels in data]
    expected = nets.train_torch(net, data, lr=0.05, momentum=0.9)
    for got, want in zip(losses, expected, strict=True):
        assert abs(got - want) <= RTOL * abs(want)
    state = session.state()
    for name, value in nets.state(net).items():
        assert _rel(state[name], value) <= RTOL, name


def _run(model, x: np.ndarray) -> np.ndarray:
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return sess.run(None, {sess.get_inputs()[0].name: x})[0]


@pytest.mark.parametrize("portable", [False, True], ids=["custom-ops", "portable"])
@pytest.mark.parametrize("kind", ["resnet", "mlp"])
def test_twenty_steps_match_torch_and_export_folds(kind: str, portable: bool) -> None:
    net, shape = nets.make(kind, seed=11)
    model = nets.export(net, torch.randn(*shape))
    classes = 10 if kind == "resnet" else 5
    data = nets.batches(shape, classes, 20, seed=12)
    train_model, _ = build_training_graph(
        model, optimizer=SGD(momentum=0.9, weight_decay=5e-4), unbiased_running_var=True, portable=portable
    )
    session = TrainingSession(train_model, lr=0.05)
    losses = [session.step(x, labels) for x, labels in data]
    expected = nets.train_torch(net, data, lr=0.05, momentum=0.9, weight_decay=5e-4)
    assert session.steps == 20
    for got, want in zip(losses, expected, strict=True):
        assert abs(got - want) <= RTOL * abs(want)
    state = session.state()
    for name, value in nets.state(net).items():
        assert _rel(state[name], value) <= RTOL, name

    # round trip: export -> bnfuse.optimize folds every BN -> same outputs as the trained eval-mode network
    exported = session.export_inference_model()
    folded, report = optimize(exported)
    assert not any(n.op_type == "BatchNormalization" for n in folded.graph.node)
    x = data[0][0]
    net.eval()
    with torch.no_grad():
        reference = net(torch.from_numpy(x)).numpy()
    assert _rel(_run(exported, x), reference) <= RTOL
    assert _rel(_run(folded, x), _run(exported, x)) <= RTOL


def test_state_is_double_buffered_not_copied_back() -> None:
    net, shape = nets.make("mlp", seed=13)
    model = nets.export(net, torch.randn(*shape))
    train_model, _ = build_training_graph(model, optimizer=SGD(momentum=0.9))
    session = TrainingSession(train_model, lr=0.1)
    spec = read_spec(train_model)
    assert set(session.state()) == set(spec.state)

    def pointers() -> list[dict[str, int]]:
        return [{name: value.data_ptr() for name, value in buffer.items()} for buffer in session._buffers]

    before = pointers()
    assert not set(before[0].values()) & set(before[1].values())  # two distinct sets of state memory
    data = nets.batches(shape, 5, 3)
    previous = session.state()
    for step, (x, labels) in enumerate(data):
        session.step(x, labels)
        assert pointers() == before, f"step {step}: state was reallocated"  # written in place, no allocation
        current = session.state()
        changed = {name for name in spec.state if not np.array_equal(current[name], previous[name])}
        # the step wrote new values everywhere, except maybe where the gradient is 0 up to rounding: the Linear
        # biases feeding BN (BN subtracts them again) and their momentum buffers
        missing = {n for n in spec.state if not n.startswith(("net.0.bias", "net.3.bias"))} - changed
        assert not missing, f"step {step}: not updated: {sorted(missing)}"
        read = session._buffers[session._current ^ 1]  # the step's input buffer still holds the old state
        for name in spec.state:
            np.testing.assert_array_equal(read[name].numpy(), previous[name], err_msg=name)
        previous = current
    assert session._current == 1  # three steps: now reading the second buffer


@pytest.mark.parametrize(("kernel_threads", "expected"), [(1, 1), (None, "unchanged")])
def test_bn_kernels_run_with_the_session_thread_count(monkeypatch, kernel_threads, expected) -> None:
    """During a step the CPU BN kernels use kernel_threads threads; the caller's setting comes back. (The Python
    kernels, under registry.python_cpu_kernels(): the native ops run on the session's own intra-op pool.)"""
    from bnfuse.runtime import cpu, registry

    if cpu.MAX_THREADS < 2:
        pytest.skip("needs at least 2 cores")
    seen: list[int] = []
    for name in ("forward_training", "backward"):
        original = getattr(cpu, name)

        def spy(*args, _original=original, **kwargs):
            seen.append(cpu.kernel_thread_count())
            return _original(*args, **kwargs)

        monkeypatch.setattr(cpu, name, spy)
    net, shape = nets.make("mlp", seed=13)
    model = nets.export(net, torch.randn(*shape))
    batchnorms = sum(node.op_type == "BatchNormalization" for node in model.graph.node)
    train_model, _ = build_training_graph(model, optimizer=SGD())
    with registry.python_cpu_kernels():
        session = TrainingSession(train_model, lr=0.1, kernel_threads=kernel_threads)
    x, labels = nets.batches(shape, 1, 3)[0]
    with cpu.kernel_threads(2):
        session.step(x, labels)
        assert cpu.kernel_thread_count() == 2
    assert batchnorms and len(seen) == 2 * batchnorms  # each BN's forward and backward, through the spies
    assert set(seen) == {1 if expected == 1 else 2}


def test_step_leaves_torchs_thread_count_alone() -> None:
    """PyTorch's OpenMP setting is untouched by a step (oneDNN's OpenMP runtime, the BN kernels' kernel_threads)."""
    net, shape = nets.make("mlp", seed=13)
    train_model, _ = build_training_graph(nets.export(net, torch.randn(*shape)), optimizer=SGD())
    x, labels = nets.batches(shape, 1, 3)[0]
    previous = torch.get_num_threads()
    try:
        for kernel_threads in (1, None):
            session = TrainingSession(train_model, lr=0.1, kernel_threads=kernel_threads)
            for threads in (1, 2):
                torch.set_num_threads(threads)
                session.step(x, labels)
                assert torch.get_num_threads() == threads
    finally:
        torch.set_num_threads(previous)


def test_lr_zero_keeps_parameters_and_updates_statistics() -> None:
    net, shape = nets.make("mlp", seed=14)
    model = nets.export(net, torch.randn(*shape))
    train_model, _ = build_training_graph(model)
    session = TrainingSession(train_model, lr=0.5)
    session.lr = 0.0
    assert session.lr == 0.0
    before = session.state()
    session.step(*nets.batches(shape, 5, 1)[0])
    after = session.state()
    spec = read_spec(train_model)
    for name in spec.parameters:
        np.testing.assert_array_equal(after[name], before[name])
    assert any(not np.array_equal(after[n], before[n]) for n in spec.running_stats)


def test_load_state_and_bad_inputs() -> None:
    net, shape = nets.make("mlp", seed=15)
    model = nets.export(net, torch.randn(*shape))
    train_model, _ = build_training_graph(model)
    session = TrainingSession(train_model)
    name = read_spec(train_model).parameters[0]
    zeros = np.zeros_like(session.state()[name])
    session.load_state({name: zeros})
    np.testing.assert_array_equal(session.parameters()[name], zeros)
    with pytest.raises(BnfuseError, match=r"has shape \[3, 13\], the graph needs \[batch, 12\]"):
        session.step(np.zeros((3, 13), np.float32), np.zeros(3, np.int64))
    with pytest.raises(BnfuseError, match=r"labels has shape \[9\], the graph needs \[8\]"):
        session.step(np.zeros(shape, np.float32), np.zeros(shape[0] + 1, np.int64))
    before = session.state()
    with pytest.raises(BnfuseError, match="empty batch"):
        session.step(np.zeros((0, 12), np.float32), np.zeros(0, np.int64))
    assert all(np.array_equal(v, before[k]) for k, v in session.state().items())
    with pytest.raises(BnfuseError, match="not a state tensor"):
        session.load_state({"nope": zeros})
    with pytest.raises(BnfuseError, match="not a bnfuse training graph"):
        TrainingSession(model)


def _conv_model(cases: list[tuple[list[int], list[int], dict]]):  # noqa: ANN202
    """One Conv per case, weights (and biases) as graph inputs, as in a training graph."""
    import onnx
    from onnx import TensorProto, helper

    nodes, inputs, outputs = [], [], []
    for i, (xs, ws, attrs) in enumerate(cases):
        names = [f"x{i}", f"w{i}"] + ([f"b{i}"] if attrs.pop("bias", False) else [])
        shapes = [xs, ws, [ws[0]]]
        inputs += [helper.make_tensor_value_info(n, TensorProto.FLOAT, s) for n, s in zip(names, shapes, strict=False)]
        nodes.append(helper.make_node("Conv", names, [f"y{i}"], kernel_shape=ws[2:], **attrs))
        outputs.append(helper.make_tensor_value_info(f"y{i}", TensorProto.FLOAT, None))
    graph = helper.make_graph(nodes, "convs", inputs, outputs)
    return onnx.helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_nchwc_convs_match_plain_convs() -> None:
    from bnfuse.training.session import NCHWC, nchwc_block, nchwc_convs

    block = nchwc_block()
    if not block:
        pytest.skip("onnxruntime has no NCHWc kernels on this CPU")
    cases = [
        ([2, 16, 9, 9], [16, 16, 3, 3], {"pads": [1, 1, 1, 1]}),
        ([2, 3, 11, 11], [16, 3, 3, 3], {"pads": [1, 1, 1, 1], "strides": [2, 2], "bias": True}),  # OIHWBo
        ([2, 16, 10, 12], [32, 16, 3, 2], {"pads": [2, 0, 1, 1], "dilations": [2, 1]}),
        ([2, 16, 8, 8], [16, 16, 1, 1], {"strides": [2, 2]}),  # 1x1: stays
        ([2, 16, 8, 8], [16, 8, 3, 3], {"pads": [1, 1, 1, 1], "group": 2}),  # grouped: stays
        ([2, 20, 8, 8], [16, 20, 3, 3], {}),  # channels past a block, not a multiple of it: stays
        # depthwise (OIHWBo on a blocked input): a 5x5 kernel larger than the map, strided with a bias
        ([2, 2 * block, 3, 3], [2 * block, 1, 5, 5], {"pads": [2, 2, 2, 2], "group": 2 * block}),
        ([2, block, 9, 7], [block, 1, 3, 3], {"pads": [1, 0, 1, 2], "strides": [2, 2], "group": block, "bias": True}),
        ([2, block, 6, 6], [2 * block, 1, 3, 3], {"pads": [1, 1, 1, 1], "group": block}),  # multiplier 2: stays
        # depthwise channels past a block multiple: padded (X by ReorderInput, weight and bias by Pad), then cropped
        ([2, block + 4, 5, 4], [block + 4, 1, 3, 3], {"pads": [1, 1, 1, 1], "group": block + 4, "bias": True}),
        ([2, 6, 5, 4], [6, 1, 3, 3], {"pads": [1, 1, 1, 1], "group": 6}),  # not a multiple of 4: stays
    ]
    model = _conv_model(cases)
    rewritten = model.__class__()
    rewritten.CopyFrom(model)
    assert nchwc_convs(rewritten, block, min_pixels=0) == 6  # the layouts, on small maps too
    assert sum(n.op_type == "Conv" and n.domain == NCHWC for n in rewritten.graph.node) == 6
    rng = np.random.default_rng(0)
    feeds = {
        i.name: rng.standard_normal([d.dim_value for d in i.type.tensor_type.shape.dim]).astype(np.float32)
        for i in model.graph.input
    }
    want = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)
    got = ort.InferenceSession(rewritten.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)
    for g, w in zip(got, want, strict=True):
        assert g.shape == w.shape
        assert _rel(g, w) <= 1e-5


@pytest.mark.parametrize("portable", [False, True], ids=["custom-ops", "portable"])
def test_nchwc_session_matches_torch(portable: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """Width 16: the convolutions (forward, and stride-1 dX where they are Convs) run as NCHWc kernels; same steps as
    PyTorch."""
    from bnfuse.training import session as session_module
    from bnfuse.training.session import nchwc_block

    monkeypatch.setattr(session_module, "NCHWC_MIN_PIXELS", 0)  # every Conv, on these 8x8 / 4x4 maps too
    monkeypatch.setattr(fast_rules, "FLIP_MIN_PIXELS", 0)  # the stride-1 dX as Convs (NCHWc) here too

    torch.manual_seed(5)
    net, shape = nets.randomize_bn(nets.ResNet(width=16), 5, 0.1), (4, 3, 8, 8)
    model = nets.export(net, torch.randn(*shape))
    data = nets.batches(shape, 10, 5, seed=6)
    train_model, _ = build_training_graph(
        model, optimizer=SGD(momentum=0.9), unbiased_running_var=True, portable=portable
    )
    session = TrainingSession(train_model, lr=0.05)
    from bnfuse.runtime import conv_grad

    flipped_dx = 0 if conv_grad.available() and not portable else 3  # with oneDNN: bnfuse.ConvInputGrad instead
    assert session.nchwc_convs == (5 + flipped_dx if nchwc_block() else 0)  # 5 forward, stride-1 dX; 1x1 ones stay
    _steps_as_pytorch(session, net, data)


def test_depthwise_convs_run_blocked_and_train_as_in_pytorch() -> None:
    """Depthwise Convs (group = channels) run as NCHWc kernels on any map, 5x5 on 2x2 included (the plain grouped
    Conv loops over the groups), the 8-channel one padded to the block; the 1x1 ones stay plain. Same steps as
    PyTorch (the 5x5 weight gradients run on the core's direct depthwise loop)."""
    from bnfuse.training.session import nchwc_block

    nn = torch.nn
    block = nchwc_block()
    torch.manual_seed(3)

    def unit(channels: int, kernel: int, stride: int) -> list:
        dw = nn.Conv2d(channels, channels, kernel, stride, kernel // 2, groups=channels, bias=False)
        return [dw, nn.BatchNorm2d(channels), nn.ReLU()]

    net = nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8), nn.ReLU(), *unit(8, 3, 1),
        nn.Conv2d(8, 32, 1, bias=False), nn.BatchNorm2d(32), nn.ReLU(), *unit(32, 3, 2), *unit(32, 5, 2),
        *unit(32, 5, 1), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(32, 10),
    )  # fmt: skip
    net = nets.randomize_bn(net, 5, 0.1)
    shape = (4, 3, 8, 8)  # the 5x5 kernels on 2x2 maps
    model = nets.export(net, torch.randn(*shape))
    data = nets.batches(shape, 10, 3, seed=6)
    train_model, _ = build_training_graph(model, optimizer=SGD(momentum=0.9), unbiased_running_var=True)
    session = TrainingSession(train_model, lr=0.05)
    from bnfuse.runtime import conv_grad

    if block == 16 and conv_grad.available():  # the four depthwise (8 channels padded); no flipped-weight dX Convs
        assert session.nchwc_convs == 4
    elif block:  # AVX2's block 8: the stem too
        assert session.nchwc_convs >= 4
    _steps_as_pytorch(session, net, data)


def test_nchwc_skips_convs_on_small_maps(monkeypatch: pytest.MonkeyPatch) -> None:
    """A Conv with fewer than NCHWC_MIN_PIXELS output pixels per image stays a plain Conv: the NCHWc kernel does not
    repay its weight's per-step reorder there (torchvision resnet18's 2x2 / 4x4 stages). The output shapes come
    through bnfuse's BN nodes (shape inference sees them as Identity): stem and layer1 run at 8x8 = 64 pixels
    (3 forward, 2 dX), layer2 at 4x4 stays plain (2 forward, 1 dX). Same steps as PyTorch."""
    from bnfuse.training.session import NCHWC_MIN_PIXELS, nchwc_block

    if not nchwc_block():
        pytest.skip("onnxruntime has no NCHWc kernels on this CPU")
    assert NCHWC_MIN_PIXELS == 64
    monkeypatch.setattr(fast_rules, "FLIP_MIN_PIXELS", 0)  # the stride-1 dX as Convs here too
    torch.manual_seed(5)
    net, shape = nets.randomize_bn(nets.ResNet(width=16), 5, 0.1), (4, 3, 8, 8)
    model = nets.export(net, torch.randn(*shape))
    data = nets.batches(shape, 10, 3, seed=6)
    train_model, _ = build_training_graph(model, optimizer=SGD(momentum=0.9), unbiased_running_var=True)
    session = TrainingSession(train_model, lr=0.05)
    from bnfuse.runtime import conv_grad

    assert session.nchwc_convs == (3 if conv_grad.available() else 5)  # with oneDNN the dX are ConvInputGrad nodes
    _steps_as_pytorch(session, net, data)


def test_weight_gradients_read_the_forward_convs_blocked_copies(monkeypatch: pytest.MonkeyPatch) -> None:
    """With oneDNN and memory="speed", each ConvWeightGrad whose X the forward already reordered to NCHWc reads that
    copy (x_block): the 3x3 convolutions' and those of the 1x1 shortcuts sharing their X; same bits as reading plain
    X, which memory="lean" (the default) does."""
    from bnfuse.runtime import conv_grad
    from bnfuse.training import session as session_module

    if not conv_grad.available() or not session_module.nchwc_block():
        pytest.skip("needs oneDNN and onnxruntime's NCHWc kernels")
    monkeypatch.setattr(session_module, "NCHWC_MIN_PIXELS", 0)  # every 3x3 Conv blocked, on the 4x4 maps too
    monkeypatch.setattr(fast_rules, "FLIP_MIN_PIXELS", 0)
    torch.manual_seed(5)
    net, shape = nets.randomize_bn(nets.ResNet(width=16), 5, 0.1), (4, 3, 8, 8)
    model = nets.export(net, torch.randn(*shape))
    data = nets.batches(shape, 10, 3, seed=6)
    train_model, _ = build_training_graph(model, optimizer=SGD(momentum=0.9))
    blocked = TrainingSession(train_model, lr=0.05, memory="speed")  # speed: the blocked copies by default
    plain = TrainingSession(train_model, lr=0.05)  # lean (the default): plain X
    weights = {t.name: list(t.dims) for t in model.graph.initializer}
    convs = [n for n in model.graph.node if n.op_type == "Conv"]
    block = session_module.nchwc_block()
    reordered = {  # inputs of the Convs the session runs as NCHWc with a blocked X: 3x3, channels a block multiple
        n.input[0] for n in convs if weights[n.input[1]][2:] != [1, 1] and weights[n.input[1]][1] % block == 0
    }
    expected = sum(n.input[0] in reordered for n in convs)  # every Conv reading such an X, 1x1 shortcuts too
    assert expected > len([n for n in convs if n.input[0] in reordered and weights[n.input[1]][2:] != [1, 1]]) > 0
    assert (blocked.blocked_weight_grads, plain.blocked_weight_grads) == (expected, 0)
    for x, labels in data:
        assert blocked.step(x, labels) == plain.step(x, labels)
    for name, value in plain.state().items():
        np.testing.assert_array_equal(blocked.state()[name], value, err_msg=name)


def test_state_snapshot_survives_later_steps() -> None:
    """state() and parameters() are copies: a "best so far" snapshot stays put while training goes on."""
    net, shape = nets.make("mlp", seed=16)
    model = nets.export(net, torch.randn(*shape))
    train_model, _ = build_training_graph(model, optimizer=SGD(momentum=0.9))
    session = TrainingSession(train_model, lr=0.1)
    data = nets.batches(shape, 5, 6, seed=17)
    session.step(*data[0])
    snapshot, params = session.state(), session.parameters()
    frozen = {name: value.copy() for name, value in snapshot.items()}
    for x, labels in data[1:]:  # both buffers are written several times over
        session.step(x, labels)
    current = session.state()
    for name, value in frozen.items():
        np.testing.assert_array_equal(snapshot[name], value, err_msg=name)
    for name in params:
        np.testing.assert_array_equal(params[name], frozen[name], err_msg=name)
    changed = [name for name in frozen if not np.array_equal(current[name], frozen[name])]
    assert len(changed) >= len(frozen) - 4  # (the two Linear biases feeding BN and their buffers may stay)
    snapshot["net.0.weight"][...] = 0  # writing a snapshot does not reach the session
    assert np.any(session.state()["net.0.weight"])


def test_adam_step_is_a_scalar_as_the_graph_declares() -> None:
    from bnfuse.passes.training import Adam

    net, shape = nets.make("mlp", seed=18)
    model = nets.export(net, torch.randn(*shape))
    train_model, _ = build_training_graph(model, optimizer=Adam())
    declared = {i.name: i for i in train_model.graph.input}["adam.step"]
    assert len(declared.type.tensor_type.shape.dim) == 0
    session = TrainingSession(train_model, lr=1e-3)
    assert session.state()["adam.step"].shape == ()
    for x, labels in nets.batches(shape, 5, 3):
        session.step(x, labels)
    step = session.state()["adam.step"]
    assert step.shape == () and float(step) == 3.0
    session.load_state({"adam.step": np.float32(10.0)})
    session.step(*nets.batches(shape, 5, 1)[0])
    assert float(session.state()["adam.step"]) == 11.0


@pytest.mark.parametrize("bnfuse_options", [False, True], ids=["plain-options", "bnfuse-options"])
def test_user_session_options_get_the_library(bnfuse_options: bool) -> None:
    """The caller's SessionOptions (here: one intra-op thread) work for a graph with bnfuse ops, also when they
    already have the library (registered a second time, harmlessly)."""
    from bnfuse.runtime import session_options

    net, shape = nets.make("mlp", seed=19)
    model = nets.export(net, torch.randn(*shape))
    train_model, _ = build_training_graph(model)
    assert any(n.domain == "bnfuse" for n in train_model.graph.node)
    options = session_options(["CPUExecutionProvider"]) if bnfuse_options else ort.SessionOptions()
    options.intra_op_num_threads = 1
    data = nets.batches(shape, 5, 3, seed=20)
    losses = [TrainingSession(train_model, lr=0.1, session_options=options).step(*data[0])]
    default = TrainingSession(train_model, lr=0.1)
    assert losses == [default.step(*data[0])]


def test_options_with_the_library_registered_by_hand_are_one_line_errors() -> None:
    from bnfuse.runtime import library_path

    net, shape = nets.make("mlp", seed=19)
    train_model, _ = build_training_graph(nets.export(net, torch.randn(*shape)))
    options = ort.SessionOptions()
    options.register_custom_ops_library(library_path())
    with pytest.raises(BnfuseError, match="registered by hand"):
        TrainingSession(train_model, session_options=options)


def test_state_dict_loads_into_a_pytorch_module_by_name() -> None:
    """A fresh ResNet (its equal BN tensors shared by the exporter) trained 5 steps in both; bnfuse's state_dict
    loads into a new torch module by name and gives the trained torch module's eval outputs."""
    torch.manual_seed(7)
    net = nets.ResNet()
    shape = (4, 3, 8, 8)
    model = nets.export(net, torch.randn(*shape))
    data = nets.batches(shape, 10, 5, seed=8)
    train_model, _ = build_training_graph(model, optimizer=SGD(momentum=0.9))
    session = TrainingSession(train_model, lr=0.05)
    for x, labels in data:
        session.step(x, labels)
    nets.train_torch(net, data, lr=0.05, momentum=0.9)
    state_dict = session.state_dict()
    fresh = nets.ResNet()
    result = fresh.load_state_dict({k: torch.from_numpy(v) for k, v in state_dict.items()}, strict=False)
    assert not result.unexpected_keys
    assert all(k.endswith("num_batches_tracked") for k in result.missing_keys)
    assert set(state_dict) == {k for k in net.state_dict() if not k.endswith("num_batches_tracked")}
    fresh.eval(), net.eval()
    x = torch.from_numpy(data[0][0])
    with torch.no_grad():
        assert _rel(fresh(x).numpy(), net(x).numpy()) <= RTOL


def test_state_dict_carries_num_batches_tracked_with_a_cumulative_average() -> None:
    net, shape = nets.make("mlp", seed=23, momentum=None)
    model = nets.export(net, torch.randn(*shape))
    train_model, report = build_training_graph(model)
    assert "2 of 2 with momentum 1.0 = PyTorch momentum=None: cumulative" in report.momentum
    session = TrainingSession(train_model, lr=0.1)
    data = nets.batches(shape, 5, 4, seed=24)
    for x, labels in data:
        session.step(x, labels)
    nets.train_torch(net, data, lr=0.1)
    state_dict = session.state_dict()
    assert state_dict["net.1.num_batches_tracked"].dtype == np.int64
    expected = net.state_dict()
    assert set(state_dict) == set(expected)
    for name, value in expected.items():
        assert _rel(state_dict[name], value.numpy()) <= RTOL, name
