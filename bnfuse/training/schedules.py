"""Learning-rate schedules, per epoch, as torch.optim.lr_scheduler computes them (closed forms).

The schedule is stepped once per epoch, as in the usual PyTorch loop (``scheduler.step()`` after each epoch):
epoch ``e`` (0-based) trains with ``lr(e)``.

* constant: ``base``.
* step (StepLR(step_size, gamma)): ``base * gamma ** (e // step_size)``.
* cosine (CosineAnnealingLR(T_max=epochs - warmup, eta_min)): ``eta_min + (base - eta_min) * (1 + cos(pi * t /
  T_max)) / 2`` with ``t = e - warmup``.
* warmup (LinearLR(start_factor, 1.0, total_iters=warmup) then the schedule, SequentialLR with milestone
  ``warmup``): ``base * (start_factor + (1 - start_factor) * e / warmup)`` for ``e < warmup``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from bnfuse.errors import BnfuseError

SCHEDULES = ("constant", "step", "cosine")


@dataclass(frozen=True)
class Schedule:
    kind: str = "constant"
    base: float = 0.01
    epochs: int = 1
    step_size: int = 1
    gamma: float = 0.1
    min_lr: float = 0.0
    warmup: int = 0
    warmup_start_factor: float = 1.0 / 3.0  # LinearLR's default

    def __post_init__(self) -> None:
        if self.kind not in SCHEDULES:
            raise BnfuseError(f"unknown learning-rate schedule {self.kind!r} (expected {', '.join(SCHEDULES)})")
        if not math.isfinite(self.base) or self.base < 0:
            raise BnfuseError(f"--lr {self.base}: must be a finite number >= 0")
        if self.step_size < 1:
            raise BnfuseError(f"--lr-step-size {self.step_size}: must be >= 1")
        if self.warmup < 0 or self.warmup >= max(self.epochs, 1) and self.warmup:
            raise BnfuseError(f"--warmup-epochs {self.warmup}: must be >= 0 and fewer than --epochs {self.epochs}")
        if not 0 < self.warmup_start_factor <= 1:
            raise BnfuseError(f"--warmup-start-factor {self.warmup_start_factor}: must be in (0, 1]")

    def lr(self, epoch: int) -> float:
        """The learning rate of epoch ``epoch`` (0-based)."""
        if epoch < self.warmup:
            return self.base * (self.warmup_start_factor + (1 - self.warmup_start_factor) * epoch / self.warmup)
        t = epoch - self.warmup
        if self.kind == "step":
            return self.base * self.gamma ** (t // self.step_size)
        if self.kind == "cosine":
            span = max(self.epochs - self.warmup, 1)
            return self.min_lr + (self.base - self.min_lr) * (1 + math.cos(math.pi * t / span)) / 2
        return self.base

    def describe(self) -> str:
        text = {
            "constant": f"constant {self.base:g}",
            "step": f"step {self.base:g} x {self.gamma:g} every {self.step_size} epochs",
            "cosine": f"cosine {self.base:g} -> {self.min_lr:g}",
        }[self.kind]
        return text + (f", {self.warmup} warm-up epochs from x{self.warmup_start_factor:g}" if self.warmup else "")
