"""Real timm / torchvision architectures train as in PyTorch (the ``oracle`` extra: torch, torchvision, timm).

Each: random init, eval-mode TorchScript export with BN kept, the default training graph at batch 4, one SGD step
(the gradient; bench/train_architectures.py runs two) from the same weights as PyTorch float64. The trained state has
every ``state_dict()`` name of the module and is within 1e-4 of PyTorch float64 (per tensor, relative to its scale),
or, where PyTorch's own float32 run is further than that from float64 (a ReLU boundary flips under float32
rounding), within 3x of PyTorch float32's error.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

if not all(importlib.util.find_spec(m) for m in ("torch", "torchvision", "timm")):
    pytest.skip("needs the oracle extra (torch, torchvision, timm)", allow_module_level=True)
sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from bench import archs  # noqa: E402
from bnfuse.passes.training import build_training_graph  # noqa: E402
from bnfuse.training.session import TrainingSession  # noqa: E402

RTOL = 1e-4
STEPS = 1  # the state after one step is the gradient; later steps amplify float32 ReLU-boundary flips chaotically
# what each exercises: tied squeeze-excite biases (merged by the exporter), ceil_mode AveragePool (ResNet-D
# shortcuts), Shape-computed Reshape for the channel shuffle, channel Slice + Concat (ghost modules)
CASES = {
    "mobilenetv3_small_050": (4, 3, 32, 32),
    "resnet26d": (4, 3, 32, 32),
    "shufflenet_v2_x0_5": (4, 3, 32, 32),
    "ghostnet_050": (4, 3, 64, 64),  # at 32x32 its last maps are 1x1: 4 values per BN channel, float32-chaotic
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_architecture_trains_as_in_pytorch(name: str) -> None:
    import torch

    shape = CASES[name]
    net = archs.create(name)
    model = archs.export(net, shape)
    data = archs.batches(shape, 10, STEPS)
    train_model, report = build_training_graph(model, batch_size=shape[0])
    session = TrainingSession(train_model, lr=0.05)
    losses = [session.step(x, y) for x, y in data]
    state = session.state_dict()
    ref = archs.torch_steps(net, data, 0.05, torch.float64)
    assert set(ref.state) <= set(state), sorted(set(ref.state) - set(state))[:5]
    assert abs(losses[0] - ref.losses[0]) <= RTOL * abs(ref.losses[0])
    error = max(archs.relative_error(state[k], v) for k, v in ref.state.items())
    if error > RTOL:
        ref32 = archs.torch_steps(net, data, 0.05, torch.float32)
        floor = max(archs.relative_error(ref32.state[k], v) for k, v in ref.state.items())
        assert floor > RTOL and error <= 3 * floor, f"{name}: error {error:.2e}, PyTorch float32's {floor:.2e}"


def test_tied_initializers_are_reported() -> None:
    shape = (4, 3, 32, 32)
    model = archs.export(archs.create("mobilenetv3_small_050"), shape)
    _, report = build_training_graph(model, batch_size=4)
    untied = [note for note in report.notes if note.startswith("untied ")]
    assert untied and int(untied[0].split()[1]) > 10, report.notes
