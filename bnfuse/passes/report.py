"""What the inference pass did: every BatchNormalization's fate, node counts, time, numerical proof."""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

Status = Literal["folded", "converted", "skipped"]


@dataclass
class BatchNormRecord:
    """One BatchNormalization node: folded into a producer, converted to Mul + Add, or skipped."""

    node: str
    graph: str  # "main", or the path of the subgraph / function it lives in
    status: Status
    into: str | None = None  # the producer it was folded into
    reason: str | None = None  # why it was not folded


@dataclass
class AbsorbedOp:
    """A trailing per-channel Mul / Add / Sub / Div folded into its producer."""

    node: str
    op: str
    graph: str
    into: str


@dataclass
class OutputError:
    name: str
    max_abs: float
    max_rel: float  # max |optimized - reference| / max |reference|
    tolerance: float
    # What the optimized output was measured against: the original's output, or (float16 / bfloat16) the
    # original widened to float32, with ``noise`` the relative error its precision alone explains.
    reference: str = "original"
    noise: float | None = None

    @property
    def passed(self) -> bool:
        return self.max_rel <= self.tolerance


@dataclass
class CheckResult:
    seed: int
    input_shapes: dict[str, list[int]]
    outputs: list[OutputError]
    engine: str = "onnxruntime"  # or "onnx reference evaluator" where onnxruntime cannot run the models

    @property
    def passed(self) -> bool:
        return all(o.passed for o in self.outputs)


@dataclass
class Report:
    model: str
    standalone: str
    batchnorms: list[BatchNormRecord] = field(default_factory=list)
    absorbed: list[AbsorbedOp] = field(default_factory=list)
    nodes_before: int = 0
    nodes_after: int = 0
    batchnorms_before: int = 0
    batchnorms_after: int = 0
    elapsed_s: float = 0.0
    check: CheckResult | None = None
    external_data: bool = False  # the input file kept its tensors as external data (the CLI output does too)

    def count(self, status: Status) -> int:
        return sum(1 for r in self.batchnorms if r.status == status)

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["summary"] = {s: self.count(s) for s in ("folded", "converted", "skipped")}
        if self.check is not None:
            data["check"]["passed"] = self.check.passed
            for out, entry in zip(self.check.outputs, data["check"]["outputs"], strict=True):
                entry["passed"] = out.passed
        return data

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, allow_nan=True) + "\n"

    def write_json(self, path: str | os.PathLike[str]) -> Path:
        """Write the report as JSON atomically (temporary file in the target directory, then rename)."""
        from bnfuse.io import write_files

        path = Path(path)
        write_files({path: self.to_json().encode()})
        return path

    def format_text(self) -> str:
        lines = [
            f"bnfuse optimize: {self.model}",
            f"  BatchNormalization: {self.batchnorms_before} -> {self.batchnorms_after} "
            f"({self.count('folded')} folded, {self.count('converted')} converted to Mul+Add, "
            f"{self.count('skipped')} skipped)",
            f"  nodes: {self.nodes_before} -> {self.nodes_after}; trailing ops absorbed: {len(self.absorbed)}",
            f"  elapsed: {self.elapsed_s:.3f} s",
        ]
        for record in self.batchnorms:
            where = "" if record.graph == "main" else f" [{record.graph}]"
            if record.status == "folded":
                lines.append(f"  folded     {record.node}{where} into {record.into}")
            elif record.status == "converted":
                lines.append(f"  converted  {record.node}{where} to Mul+Add ({record.reason})")
            else:
                lines.append(f"  skipped    {record.node}{where}: {record.reason}")
        for op in self.absorbed:
            where = "" if op.graph == "main" else f" [{op.graph}]"
            lines.append(f"  absorbed   {op.op} {op.node}{where} into {op.into}")
        if self.check is not None:
            verdict = "passed" if self.check.passed else "FAILED"
            shapes = ", ".join(f"{k}={'x'.join(map(str, v))}" for k, v in self.check.input_shapes.items())
            lines.append(f"  check {verdict} ({self.check.engine}, seed {self.check.seed}, inputs {shapes}):")
            for out in self.check.outputs:
                mark = "ok" if out.passed else "BEYOND TOLERANCE"
                if out.noise is None:
                    limit = f"(tolerance {out.tolerance:.0e})"
                else:
                    limit = f"vs {out.reference} (precision noise {out.noise:.1e}, tolerance {out.tolerance:.1e})"
                lines.append(f"    {out.name}: max abs {out.max_abs:.3e}, max rel {out.max_rel:.3e} {limit} {mark}")
        return "\n".join(lines)
