"""bnfuse.training.memory: the lean settings TrainingSession applies, and a step that holds no more after 20 steps."""

from __future__ import annotations

import mmap
import re
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest

from bnfuse.errors import BnfuseError
from bnfuse.passes.training import SGD, build_training_graph
from bnfuse.runtime import session_options
from bnfuse.training import memory
from bnfuse.training.session import TrainingSession
from tests.loaders import torch_nets

torch = pytest.importorskip("torch")
nets = torch_nets()


def _resnet_graph(width: int = 8, shape: tuple[int, ...] = (4, 3, 8, 8)):
    torch.manual_seed(3)
    model = nets.export(nets.ResNet(width=width), torch.randn(*shape))
    graph, _ = build_training_graph(model, optimizer=SGD(momentum=0.9))
    return graph, shape


def _settings(session: TrainingSession) -> tuple[bool, ort.ExecutionOrder]:
    options = session._session.get_session_options()
    return options.enable_mem_pattern, options.execution_order


def test_lean_is_the_default_and_speed_keeps_onnxruntimes_settings() -> None:
    graph, _ = _resnet_graph()
    lean, speed = TrainingSession(graph), TrainingSession(graph, memory="speed")
    assert (lean.memory, speed.memory) == ("lean", "speed")
    assert _settings(lean) == (False, ort.ExecutionOrder.PRIORITY_BASED)
    assert _settings(speed) == (True, ort.ExecutionOrder.DEFAULT)
    assert memory.nchwc_weight_grads("speed") and not memory.nchwc_weight_grads("lean")
    assert lean.blocked_weight_grads == 0


def test_the_callers_options_get_the_lean_settings_and_bad_modes_are_refused() -> None:
    graph, _ = _resnet_graph()
    options = session_options(["CPUExecutionProvider"], intra_op_num_threads=1)
    session = TrainingSession(graph, session_options=options)
    assert _settings(session) == (False, ort.ExecutionOrder.PRIORITY_BASED)
    assert session._session.get_session_options().intra_op_num_threads == 1  # the caller's own settings stay
    built = memory.lean_session_options(["CPUExecutionProvider"], intra_op_num_threads=2)
    assert (built.enable_mem_pattern, built.execution_order, built.intra_op_num_threads) == (
        False,
        ort.ExecutionOrder.PRIORITY_BASED,
        2,
    )
    with pytest.raises(BnfuseError, match="memory must be one of lean, speed"):
        TrainingSession(graph, memory="small")


def _rss() -> int:
    with open("/proc/self/status") as status:
        return int(re.search(r"^VmRSS:\s+(\d+) kB", status.read(), re.MULTILINE).group(1)) * 1024


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads VmRSS from /proc")
@pytest.mark.parametrize("mode", ["lean", "speed"])
def test_twenty_steps_hold_no_more_than_the_first_few(mode: str) -> None:
    """After a few steps (arena grown, plans and workspaces made), 20 more steps must not grow the process: a leak of
    one activation of this network (16x16x16x16 float32, 256 KiB) per step would add 5 MiB. The same measurement,
    with such an array kept per step, sees the growth: the bound can fail."""
    graph, shape = _resnet_graph(width=16, shape=(16, 3, 16, 16))
    session = TrainingSession(graph, memory=mode)
    rng = np.random.default_rng(0)
    x = rng.standard_normal(shape).astype(np.float32)
    labels = rng.integers(0, 10, shape[0]).astype(np.int64)
    for _ in range(5):
        session.step(x, labels)
    before = _rss()
    losses = [session.step(x, labels) for _ in range(20)]
    grown = _rss() - before
    assert np.all(np.isfinite(losses)) and losses[-1] < losses[0]
    assert grown < 2 * 2**20, f"{grown / 2**20:.1f} MiB more after 20 steps"

    kept = []
    before = _rss()
    for _ in range(20):
        session.step(x, labels)
        # a deliberate leak: one activation's size per step, in pages of its own (malloc may hand back resident
        # pages the steps freed, which RSS does not see; an anonymous map is new memory once written)
        leak = mmap.mmap(-1, 16 * 16 * 16 * 16 * 4)
        leak.write(b"\x01" * len(leak))
        kept.append(leak)
    assert _rss() - before > 2 * 2**20  # the measurement sees it
