"""The NCHWc rewrite written into the training graph (build_training_graph(nchwc=True), train-graph --nchwc): the file
is the graph TrainingSession runs, so a plain onnxruntime session with bnfuse's library, stepping it by hand, gets
TrainingSession's step bit for bit; a session on another block refuses it."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import numpy_helper

from bnfuse.errors import BnfuseError
from bnfuse.passes.training import SGD, build_training_graph, nchwc
from bnfuse.passes.training.spec import read_spec
from bnfuse.training.session import TrainingSession
from tests.loaders import torch_nets

torch = pytest.importorskip("torch")
nets = torch_nets()
pytestmark = pytest.mark.skipif(not nchwc.nchwc_block(), reason="onnxruntime has no NCHWc kernels on this CPU")


def _graphs() -> tuple[onnx.ModelProto, onnx.ModelProto, list]:
    torch.manual_seed(5)
    net, shape = nets.randomize_bn(nets.ResNet(width=16), 5, 0.1), (4, 3, 16, 16)
    model = nets.export(net, torch.randn(*shape))
    options = {"optimizer": SGD(momentum=0.9), "unbiased_running_var": True}
    plain, _ = build_training_graph(model, **options)
    written, report = build_training_graph(model, nchwc=True, **options)
    assert any("NCHWc:" in note for note in report.notes)
    return plain, written, nets.batches(shape, 10, 3, seed=6)


def test_the_file_carries_the_rewrite_the_session_makes() -> None:
    plain, written, data = _graphs()
    assert nchwc.rewritten_block(written) == nchwc.nchwc_block() and nchwc.rewritten_block(plain) is None
    assert sum(n.domain == nchwc.NCHWC for n in written.graph.node) > 0
    assert not any(n.domain == nchwc.NCHWC for n in plain.graph.node)
    ours, theirs = TrainingSession(written, lr=0.05), TrainingSession(plain, lr=0.05)
    assert ours.nchwc_convs == theirs.nchwc_convs > 0
    for x, labels in data:
        assert ours.step(x, labels) == theirs.step(x, labels)
    for name, value in theirs.state().items():
        np.testing.assert_array_equal(ours.state()[name], value, err_msg=name)
    speed = TrainingSession(written, lr=0.05, memory="speed")  # weight gradients read the file's NCHWc copies
    assert speed.blocked_weight_grads == TrainingSession(plain, lr=0.05, memory="speed").blocked_weight_grads > 0


def test_a_plain_onnxruntime_host_steps_as_the_training_session() -> None:
    from bnfuse.runtime import session_options

    _, written, data = _graphs()
    spec = read_spec(written)
    options = session_options(["CPUExecutionProvider"])
    options.intra_op_num_threads = 1
    options.log_severity_level = 3  # state initializers are also inputs, on purpose
    host = ort.InferenceSession(written.SerializeToString(), options, providers=["CPUExecutionProvider"])
    state = {t.name: numpy_helper.to_array(t) for t in written.graph.initializer if t.name in spec.state}
    session = TrainingSession(written, lr=0.05, intra_op_threads=1)
    outputs = [spec.loss, *(spec.state[name] for name in state)]
    for x, labels in data:
        feeds = {spec.data[0]: x, spec.targets[0]: labels.astype(np.int64), spec.lr: np.array(0.05, np.float32)}
        loss, *new = host.run(outputs, {**feeds, **state})
        state = dict(zip(state, new, strict=True))
        assert float(loss) == session.step(x, labels)
    for name, value in session.state().items():
        np.testing.assert_array_equal(state[name], value, err_msg=name)


def test_a_session_on_another_block_refuses_the_file() -> None:
    _, written, _ = _graphs()
    for prop in written.metadata_props:
        if prop.key == nchwc.BLOCK_KEY:
            prop.value = str(nchwc.nchwc_block() * 2)
    with pytest.raises(BnfuseError, match="NCHWc layout for block"):
        TrainingSession(written, lr=0.05)
