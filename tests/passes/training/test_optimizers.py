"""The fused optimizer update (bnfuse.SGDStep / AdamStep): a built training graph with it trains bit for bit like the
same graph with the standard-ONNX update, and like itself after expand_fused_steps (what the CUDA provider runs)."""

from __future__ import annotations

import numpy as np
import onnx
import pytest

from bnfuse.passes.training import SGD, Adam, build_training_graph
from bnfuse.passes.training.groups import GroupRule
from bnfuse.passes.training.optimizers import expand_fused_steps
from bnfuse.runtime import optimizer_ops
from bnfuse.training import TrainingSession
from tests.loaders import torch_nets

torch = pytest.importorskip("torch")
nets = torch_nets()

GROUPS = (GroupRule("@bn", weight_decay=0.0, lr_scale=0.5), GroupRule("@1d", lr_scale=2.0))
OPTIMIZERS = {
    "sgd": SGD(),
    "sgd-momentum-groups": SGD(momentum=0.9, weight_decay=1e-3),
    "sgd-nesterov": SGD(momentum=0.9, weight_decay=1e-4, nesterov=True),
    "adam-groups": Adam(weight_decay=1e-3),
}


def _fused_steps(model: onnx.ModelProto) -> list[onnx.NodeProto]:
    return [n for n in model.graph.node if n.domain == optimizer_ops.DOMAIN and n.op_type in optimizer_ops.OP_NAMES]


# every optimizer on the MLP; the ResNet (slower) with one
@pytest.mark.parametrize(("kind", "name"), [*(("mlp", name) for name in OPTIMIZERS), ("resnet", "sgd-nesterov")])
def test_fused_update_trains_bit_for_bit_like_the_standard_nodes(kind: str, name: str) -> None:
    net, shape = nets.make(kind, seed=5)
    model = nets.export(net, torch.randn(*shape))
    options = {"optimizer": OPTIMIZERS[name], "param_groups": GROUPS if "groups" in name else ()}
    fused, report = build_training_graph(model, **options)
    standard, _ = build_training_graph(model, fused_optimizer=False, **options)
    (step,) = _fused_steps(fused)
    assert not _fused_steps(standard)
    assert len(step.output) == report.parameters * (1 + len(OPTIMIZERS[name].state_names("p")))
    expanded = onnx.ModelProto()
    expanded.CopyFrom(fused)
    assert expand_fused_steps(expanded) == 1 and not _fused_steps(expanded)

    rng = np.random.default_rng(0)
    batches = [rng.standard_normal(shape).astype(np.float32) for _ in range(3)]
    labels = rng.integers(0, 5 if kind == "mlp" else 10, shape[0]).astype(np.int64)
    sessions = [TrainingSession(m, lr=0.05) for m in (fused, standard, expanded)]
    losses = [[s.step(x, labels) for x in batches] for s in sessions]
    assert losses[0] == losses[1] == losses[2]
    assert losses[0][-1] != losses[0][0]  # it trains
    states = [s.state() for s in sessions]
    for key, value in states[0].items():
        np.testing.assert_array_equal(value, states[1][key], err_msg=key)
        np.testing.assert_array_equal(value, states[2][key], err_msg=key)


def test_portable_graphs_keep_the_standard_update() -> None:
    net, shape = nets.make("mlp", seed=5)
    model = nets.export(net, torch.randn(*shape))
    portable, _ = build_training_graph(model, optimizer=SGD(momentum=0.9), portable=True)
    assert not _fused_steps(portable)
    assert {n.domain for n in portable.graph.node} <= {""}
