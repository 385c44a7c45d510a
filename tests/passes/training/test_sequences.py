"""passes/training/sequences.py: the dynamo exporter's SplitToSequence -> SequenceAt (torch.split / chunk) trains
as one Split, at PyTorch parity; pairs that are not constant stay."""

from __future__ import annotations

import warnings

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from bnfuse.passes.training import SGD, build_training_graph
from bnfuse.passes.training.sequences import split_sequences
from bnfuse.training.session import TrainingSession

torch = pytest.importorskip("torch")
nn, F = torch.nn, torch.nn.functional
LR = 0.05


class SplitNet(nn.Module):
    """A channel split by a scalar size (chunk: equal pieces) and by a list, as shufflenet and mixnet write them."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8), nn.ReLU())
        self.left = nn.Sequential(nn.Conv2d(4, 4, 3, padding=1, bias=False), nn.BatchNorm2d(4), nn.ReLU())
        self.head = nn.Linear(8, 5)

    def forward(self, x):  # noqa: ANN001, ANN201
        x = self.stem(x)
        a, b = x.chunk(2, dim=1)
        c, d, e = torch.split(torch.cat([self.left(a), b], 1), [3, 3, 2], dim=1)
        return self.head(F.adaptive_avg_pool2d(torch.cat([e, c, d], 1), 1).flatten(1))


def test_dynamo_split_and_chunk_train_as_in_pytorch() -> None:
    torch.manual_seed(0)
    net = SplitNet().eval()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = torch.onnx.export(net, (torch.randn(4, 3, 8, 8),), dynamo=True, optimize=False, verbose=False)
    model = model.model_proto
    assert [n.op_type for n in model.graph.node].count("SplitToSequence") == 2
    graph, _ = build_training_graph(model, optimizer=SGD(momentum=0.9), batch_size=4, static_batch=True)
    assert not any(n.op_type in ("SplitToSequence", "SequenceAt") for n in graph.graph.node)
    session = TrainingSession(graph, lr=LR, nchwc=False)
    rng = np.random.default_rng(3)
    batches = [(rng.standard_normal((4, 3, 8, 8)).astype(np.float32), rng.integers(0, 5, 4)) for _ in range(2)]
    net.train()
    opt = torch.optim.SGD(net.parameters(), lr=LR, momentum=0.9)
    for x, labels in batches:
        loss = session.step(x, labels)
        opt.zero_grad()
        expected = F.cross_entropy(net(torch.from_numpy(x)), torch.from_numpy(labels))
        expected.backward()
        opt.step()
        assert loss == pytest.approx(expected.item(), rel=1e-5)
    state = session.state()
    for name, value in net.state_dict().items():
        if name in state:
            np.testing.assert_allclose(state[name], value.numpy(), rtol=1e-4, atol=1e-5, err_msg=name)


def _sequence_model(split: np.ndarray | None, index: int, constant_index: bool = True) -> onnx.ModelProto:
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 6, 3])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, None)
    nodes, inits, inputs = [], [], [x]
    to_sequence = ["x"]
    if split is not None:
        inits.append(numpy_helper.from_array(split.astype(np.int64), "split"))
        to_sequence.append("split")
    nodes.append(helper.make_node("SplitToSequence", to_sequence, ["seq"], axis=1))
    if constant_index:
        inits.append(numpy_helper.from_array(np.array(index, np.int64), "i"))
    else:
        inputs.append(helper.make_tensor_value_info("i", TensorProto.INT64, []))
    nodes.append(helper.make_node("SequenceAt", ["seq", "i"], ["y"]))
    graph = helper.make_graph(nodes, "g", inputs, [y], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


@pytest.mark.parametrize(
    ("split", "index", "expected"),
    [(np.array(4), 1, (2, 2, 3)), (np.array([1, 5]), -1, (2, 5, 3)), (np.array(2), 2, (2, 2, 3))],
)
def test_constant_pairs_become_split_with_the_same_values(split, index, expected) -> None:  # noqa: ANN001
    model = _sequence_model(split, index)
    x = np.random.default_rng(0).standard_normal((2, 6, 3)).astype(np.float32)
    from onnx.reference import ReferenceEvaluator

    want = ReferenceEvaluator(model).run(None, {"x": x})[0]
    assert split_sequences(model, {"x": ((2, 6, 3), TensorProto.FLOAT)}) == 1
    assert [n.op_type for n in model.graph.node] == ["Split", "Identity"]
    got = ReferenceEvaluator(model).run(None, {"x": x})[0]
    assert got.shape == expected
    np.testing.assert_array_equal(got, want)


def test_pairs_that_are_not_constant_stay() -> None:
    no_split = _sequence_model(None, 0)  # size-1 pieces: left to onnx-ad's refusal, not guessed
    varying = _sequence_model(np.array(3), 0, constant_index=False)
    for model in (no_split, varying):
        before = model.SerializeToString()
        assert split_sequences(model, {"x": ((2, 6, 3), TensorProto.FLOAT)}) == 0
        assert model.SerializeToString() == before
