"""bench/mask_replay.py's masks: every activation kink's gradient mask found (Cast masks and Where conditions) and
matched between the float32 and the float64 graph, whose generated names differ."""

from __future__ import annotations

import io
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

torch = pytest.importorskip("torch")

from bench import float64_check, mask_replay  # noqa: E402
from bnfuse.passes.training import build_training_graph  # noqa: E402


def _net() -> torch.nn.Module:
    torch.manual_seed(0)

    def unit(c_in: int, c_out: int, act: torch.nn.Module) -> list[torch.nn.Module]:
        return [torch.nn.Conv2d(c_in, c_out, 3, padding=1), torch.nn.BatchNorm2d(c_out), act]

    layers = [*unit(3, 6, torch.nn.ReLU()), *unit(6, 6, torch.nn.LeakyReLU(0.1)), *unit(6, 6, torch.nn.Hardswish())]
    return torch.nn.Sequential(*layers, torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(6, 4))


def _export(net: torch.nn.Module, dtype: torch.dtype) -> onnx.ModelProto:
    buffer = io.BytesIO()
    model = net.to(dtype).eval()
    x = torch.zeros(2, 3, 8, 8, dtype=dtype)
    torch.onnx.export(model, (x,), buffer, dynamo=False, do_constant_folding=False, input_names=["x"])
    return onnx.load_from_string(buffer.getvalue())


def _rename_comparisons(model: onnx.ModelProto) -> None:
    renamed = {o: f"{o}_shifted" for n in model.graph.node if n.op_type in mask_replay.BOOLEAN for o in n.output}
    for node in model.graph.node:
        node.input[:] = [renamed.get(i, i) for i in node.input]
        node.output[:] = [renamed.get(o, o) for o in node.output]


def test_every_kink_mask_is_matched_by_what_it_computes() -> None:
    """ReLU's mask is a Cast, LeakyReLU's and Hardswish's are Where conditions; the float64 graph computes the same
    masks under other generated names. Matched by structure, the float64 run's masks equal the float32 run's on a
    batch far from the kinks, element for element; matched by name they would not even all exist."""
    import copy

    net = _net()
    options = {"batch_size": 2, "static_batch": True, "fuse_relu": False}
    graph32, _ = build_training_graph(_export(copy.deepcopy(net), torch.float32), **options)
    graph64, _ = build_training_graph(_export(copy.deepcopy(net), torch.float64), **options)
    names = mask_replay.mask_values(graph32)
    producers = {o: n.op_type for n in graph32.graph.node for o in n.output}
    assert sorted(producers[n] for n in names) == ["And", "Cast", "Greater"]  # Hardswish: And of two comparisons
    _rename_comparisons(graph64)  # as a float64 export's other node count shifts onnx-ad's numbering
    matched = mask_replay.matched_masks(graph32, graph64)
    assert sorted(matched) == sorted(names) and all(m != m64 for m, m64 in matched.items() if "Relu" not in m)

    x = np.random.default_rng(0).standard_normal((2, 3, 8, 8))
    y = np.array([1, 3], np.int64)
    trainer = float64_check.ReferenceTrainer(graph64)
    trainer.step([x], [y], 0.0, keep=True)
    masks = {m: mask_replay.as_mask(trainer.intermediates[m64]) for m, m64 in matched.items()}
    assert {str(v.dtype) for v in masks.values()} == {"float32", "bool"}
    _, seen = mask_replay.one_step(graph32, x.astype(np.float32), y, {}, False, masks, lr=0.0)
    for name, value in masks.items():
        assert seen[name].shape == value.shape and np.array_equal(seen[name], value), name
    # a mask fed in place of the computed one is what the step reads: all-False LeakyReLU conditions change it
    leaky = next(m for m in names if producers[m] == "Greater")
    forced = dict(masks) | {leaky: np.zeros_like(masks[leaky])}
    replayed = mask_replay.with_mask_inputs(graph32, forced)
    state_a, _ = mask_replay.one_step(replayed, x.astype(np.float32), y, masks, False, {}, lr=0.05)
    state_b, _ = mask_replay.one_step(replayed, x.astype(np.float32), y, forced, False, {}, lr=0.05)
    assert any(not np.allclose(state_a[k], state_b[k]) for k in state_a)
