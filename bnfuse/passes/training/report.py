"""What the training pass built: ``TrainingReport``, returned beside the training graph and printed by train-graph."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class TrainingReport:
    """What the training pass built."""

    loss: str
    optimizer: str
    batch_norms: int
    frozen_batch_norms: int
    parameters: int
    parameter_elements: int
    running_stats: int
    optimizer_state: int
    forward_nodes: int
    training_nodes: int
    portable: bool
    momentum: str
    running_var: str = "biased (batch variance)"
    weight_decay: str = "0"
    training_mode_reset: int = 0  # BN nodes exported in training mode, made inference nodes
    notes: list[str] = field(default_factory=list)  # what is frozen or left out, and why
    seconds: float = 0.0
    op_counts: dict[str, int] = field(default_factory=dict)
    batch: str = ""  # "dynamic (any size)" or "static N" (and why)

    def format_text(self) -> str:
        ops = ", ".join(f"{k} {v}" for k, v in sorted(self.op_counts.items(), key=lambda kv: -kv[1])[:8])
        return "\n".join(
            [
                f"training graph: {self.training_nodes} nodes (inference model: {self.forward_nodes})"
                + (" [portable: standard ONNX ops only]" if self.portable else " [bnfuse custom ops]"),
                f"  batch norms: {self.batch_norms} in training mode, {self.frozen_batch_norms} frozen"
                + (f", {self.training_mode_reset} exported in training mode (reset)" * bool(self.training_mode_reset)),
                *([f"  batch: {self.batch}"] if self.batch else []),
                f"  running statistics: momentum {self.momentum}; running variance {self.running_var}",
                f"  trainable: {self.parameters} tensors, {self.parameter_elements} values; "
                f"loss {self.loss}; optimizer {self.optimizer} ({self.optimizer_state} state tensors)",
                f"  weight decay: {self.weight_decay}",
                *(f"  note: {note}" for note in self.notes),
                f"  most used ops: {ops}",
                f"  built in {self.seconds:.2f} s",
            ]
        )
