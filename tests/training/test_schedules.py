"""Learning-rate schedules: torch.optim.lr_scheduler's values, epoch by epoch."""

from __future__ import annotations

import pytest

from bnfuse.errors import BnfuseError
from bnfuse.training.schedules import Schedule

torch = pytest.importorskip("torch")


def _torch_lrs(make, epochs: int, base: float) -> list[float]:  # noqa: ANN001
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=base)
    scheduler = make(opt)
    values = []
    for _ in range(epochs):
        values.append(opt.param_groups[0]["lr"])
        opt.step()
        scheduler.step()
    return values


@pytest.mark.parametrize(
    ("schedule", "make"),
    [
        (Schedule("constant", 0.1, 6), lambda o: torch.optim.lr_scheduler.LambdaLR(o, lambda e: 1.0)),
        (Schedule("step", 0.1, 9, step_size=3, gamma=0.5), lambda o: torch.optim.lr_scheduler.StepLR(o, 3, 0.5)),
        (Schedule("cosine", 0.1, 8, min_lr=0.001), lambda o: torch.optim.lr_scheduler.CosineAnnealingLR(o, 8, 0.001)),
        (
            Schedule("cosine", 0.05, 10, warmup=3),
            lambda o: torch.optim.lr_scheduler.SequentialLR(
                o,
                [
                    torch.optim.lr_scheduler.LinearLR(o, start_factor=1 / 3, total_iters=3),
                    torch.optim.lr_scheduler.CosineAnnealingLR(o, 7),
                ],
                milestones=[3],
            ),
        ),
        (
            Schedule("step", 0.2, 8, step_size=2, gamma=0.1, warmup=2, warmup_start_factor=0.25),
            lambda o: torch.optim.lr_scheduler.SequentialLR(
                o,
                [
                    torch.optim.lr_scheduler.LinearLR(o, start_factor=0.25, total_iters=2),
                    torch.optim.lr_scheduler.StepLR(o, 2, 0.1),
                ],
                milestones=[2],
            ),
        ),
    ],
    ids=["constant", "step", "cosine", "cosine-warmup", "step-warmup"],
)
def test_schedules_match_torch(schedule: Schedule, make) -> None:  # noqa: ANN001
    expected = _torch_lrs(make, schedule.epochs, schedule.base)
    got = [schedule.lr(epoch) for epoch in range(schedule.epochs)]
    assert got == pytest.approx(expected, rel=1e-12, abs=1e-15)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"kind": "linear"}, "unknown learning-rate schedule"),
        ({"base": -1.0}, "--lr -1.0"),
        ({"step_size": 0}, "--lr-step-size 0"),
        ({"warmup": 5, "epochs": 5}, "--warmup-epochs 5"),
        ({"warmup_start_factor": 0.0}, "--warmup-start-factor 0.0"),
    ],
)
def test_bad_schedules_are_refused(options: dict, message: str) -> None:
    with pytest.raises(BnfuseError, match=message):
        Schedule(**options)
