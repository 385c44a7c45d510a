"""What the inference pass did: every BatchNormalization's fate, node counts, time, numerical proof."""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

Status = Literal["folded", "converted", "skipped"]
# A compared tensor: within tolerance, within tolerance but the same on every random input (proves
# little), or beyond tolerance. A rewritten BN whose tensor could not be exposed is "not compared".
Outcome = Literal["ok", "constant", "failed", "not compared"]
OUTCOMES: tuple[Outcome, ...] = ("ok", "constant", "failed", "not compared")


@dataclass
class BatchNormRecord:
    """One BatchNormalization node: folded into a producer, converted to Mul + Add, or skipped."""

    node: str
    graph: str  # "main", or the path of the subgraph / function it lives in
    status: Status
    into: str | None = None  # the producer it was folded into
    reason: str | None = None  # why it was not folded
    output: str | None = None  # the BN's output tensor in the original model
    # The tensor that carries the BN's output values in the optimized model and holds the same values in the
    # original: ``output`` itself (the producer takes over its name), or the output of a per-channel op or
    # BN folded into the same producer after it (``output`` is then gone from the optimized model).
    replacement: str | None = None
    # "backward": into the producer before it; "forward": into the linear consumer after it; "moved": its scale
    # into the readers after an activation, its shift kept as an Add (bnfuse.passes.fold.moves)
    direction: str | None = None
    reset_from_training: bool = False  # the input had it in training mode; optimize reset it to inference


@dataclass
class MergeRecord:
    """An Add / Sum of parallel branches of one tensor: merged into one Conv (bnfuse.passes.fold.reparam) or refused."""

    node: str  # the sum (its top Add / Sum)
    graph: str
    status: Literal["merged", "skipped"]
    into: str | None = None  # the merged Conv
    branches: list[str] = field(default_factory=list)  # each branch's nodes, from the shared input to the sum
    reason: str | None = None  # why it was refused; for a merge, the branches kept apart
    output: str | None = None  # the sum's output tensor in the original model
    input: str | None = None  # the tensor every branch reads (the merged Conv's input)
    replacement: str | None = None  # the tensor carrying ``output``'s values in both models (see BatchNormRecord)
    kernel: list[int] | None = None  # the merged Conv's window
    groups: int | None = None


@dataclass
class AbsorbedOp:
    """A trailing per-channel Mul / Add / Sub / Div folded into its producer."""

    node: str
    op: str
    graph: str
    into: str


@dataclass
class OutputError:
    """One tensor of the optimized model compared with the same tensor of the original."""

    name: str
    max_abs: float
    max_rel: float  # max |optimized - reference| / max |reference|
    tolerance: float
    # What the optimized output was measured against: the original's output, or (float16 / bfloat16) the
    # original widened to float32, with ``noise`` the relative error its precision alone explains.
    reference: str = "original"
    noise: float | None = None
    # The original computed bit-identical values on two different random inputs: the comparison cannot see
    # a wrong weight (a softmax over equal logits, a tensor fed only by constants).
    constant: bool = False

    @property
    def passed(self) -> bool:
        return self.max_rel <= self.tolerance

    @property
    def outcome(self) -> Outcome:
        return "failed" if not self.passed else "constant" if self.constant else "ok"


@dataclass
class FoldCheck:
    """The proof of one rewritten BatchNormalization: its output tensor in both models, compared."""

    node: str
    graph: str
    status: Status | Literal["merged"]  # folded or converted, or merged: a branch sum (MergeRecord)
    into: str | None
    tensor: str | None  # the tensor compared (same name in both models); None when not compared
    error: OutputError | None
    note: str | None = None  # why it was not compared, or where the compared tensor lies past the BN
    # The fold alone: the chain from the producer's data input ``entry`` to ``tensor``, copied in both models
    # and run on seeded random data (no upstream rounding, and still informative where the model makes
    # ``tensor`` the same on every input).
    entry: str | None = None
    isolated: OutputError | None = None

    @property
    def outcome(self) -> Outcome:
        """failed if either comparison fails; constant if neither saw input-dependent values; else ok."""
        if self.error is None:
            return "not compared"
        results = [self.error] + ([self.isolated] if self.isolated is not None else [])
        if any(not r.passed for r in results):
            return "failed"
        return "constant" if all(r.constant for r in results) else "ok"


@dataclass
class CheckResult:
    seed: int
    input_shapes: dict[str, list[int]]
    outputs: list[OutputError]
    engine: str = "onnxruntime"  # or "onnx reference evaluator" where onnxruntime cannot run the models
    folds: list[FoldCheck] = field(default_factory=list)
    elapsed_s: float = 0.0

    @property
    def passed(self) -> bool:
        return all(o.passed for o in self.outputs) and all(f.outcome != "failed" for f in self.folds)

    def first_failed_fold(self) -> FoldCheck | None:
        """The most upstream failing fold (records are in graph order): errors propagate downstream."""
        return next((f for f in self.folds if f.outcome == "failed"), None)


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
    external_data: bool = False  # the output keeps its tensors as external data (see external_data_reason)
    external_data_reason: str = ""  # "input": the input did too; "2 GiB": the output outgrew one protobuf
    transposes_cancelled: int = 0  # Transpose pairs composing to the identity, removed before folding
    # input-model names of the weights / biases the folds rewrote
    rewritten_weights: list[str] = field(default_factory=list)
    # optimized-model names of the constants holding values the folds computed (their one rounding is what the
    # check's twins move: see bnfuse.passes.check.tolerances)
    written_weights: list[str] = field(default_factory=list)
    noops_removed: int = 0  # identity Transposes, Identity and inference Dropout nodes bypassed before folding
    merges: list[MergeRecord] = field(default_factory=list)  # branch sums merged into one Conv, or refused

    def count(self, status: Status) -> int:
        return sum(1 for r in self.batchnorms if r.status == status)

    @property
    def forward_folds(self) -> int:
        return sum(1 for r in self.batchnorms if r.status == "folded" and r.direction == "forward")

    @property
    def merged_batchnorms(self) -> int:
        return sum(1 for r in self.batchnorms if r.status == "folded" and r.direction == "merged")

    @property
    def moved_folds(self) -> int:
        """BNs whose scale moved through an activation into its readers, their shift left as an Add."""
        return sum(1 for r in self.batchnorms if r.status == "folded" and r.direction == "moved")

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["summary"] = {s: self.count(s) for s in ("folded", "converted", "skipped")}
        data["summary"]["folded_forward"] = self.forward_folds
        data["summary"]["folded_in_merges"] = self.merged_batchnorms
        data["summary"]["merges"] = sum(1 for m in self.merges if m.status == "merged")
        data["summary"]["folded_moved"] = self.moved_folds
        if self.check is not None:
            check = data["check"]
            check["passed"] = self.check.passed
            for out, entry in zip(self.check.outputs, check["outputs"], strict=True):
                entry["passed"], entry["outcome"] = out.passed, out.outcome
            for fold, entry in zip(self.check.folds, check["folds"], strict=True):
                entry["outcome"] = fold.outcome
                for key in ("error", "isolated"):
                    result = getattr(fold, key)
                    if result is not None:
                        entry[key]["passed"], entry[key]["outcome"] = result.passed, result.outcome
            check["summary"] = {
                "folds": _outcome_counts(f.outcome for f in self.check.folds),
                "outputs": _outcome_counts(o.outcome for o in self.check.outputs),
            }
        return data

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, allow_nan=True) + "\n"

    def write_json(self, path: str | os.PathLike[str]) -> Path:
        """Write the report as JSON atomically (temporary file in the target directory, then rename)."""
        from bnfuse.io import write_files

        path = Path(path)
        write_files({path: self.to_json().encode()})
        return path

    def format_text(self, *, verbose: bool = False, hint: bool = True) -> str:
        """A summary table (counts, worst errors, times, warnings); ``verbose`` adds one line per BN; ``hint``
        says how to get them (off where the caller, such as ``bnfuse train --fold``, has no such option)."""
        lines = [
            f"bnfuse optimize: {self.model} ({self.elapsed_s:.3f} s)",
            f"  {'':<20}{'original':>10}{'optimized':>11}",
            f"  {'BatchNormalization':<20}{self.batchnorms_before:>10}{self.batchnorms_after:>11}   "
            f"{self.count('folded')} folded ({self.forward_folds} forward"
            + (f", {self.merged_batchnorms} in branch merges" if self.merged_batchnorms else "")
            + (f", {self.moved_folds} moved through an activation" if self.moved_folds else "")
            + "), "
            f"{self.count('converted')} converted to Mul+Add, "
            f"{self.count('skipped')} skipped",
            f"  {'nodes':<20}{self.nodes_before:>10}{self.nodes_after:>11}   "
            f"{len(self.absorbed)} trailing per-channel ops absorbed"
            + (f", {self.transposes_cancelled} Transpose pairs cancelled" if self.transposes_cancelled else "")
            + (f", {self.noops_removed} no-op nodes bypassed" if self.noops_removed else ""),
        ]
        if self.merges:
            merged = [m for m in self.merges if m.status == "merged"]
            lines.append(
                f"  {'branch sums':<20}{'':>21}   {len(merged)} merged into one Conv "
                f"({sum(len(m.branches) for m in merged)} branches), {len(self.merges) - len(merged)} refused"
            )
        if self.check is not None:
            lines += _check_summary(self.check)
        if verbose:
            lines += self._per_node_lines()
        elif self.batchnorms and hint:
            lines.append("  (-v, format_text(verbose=True): one line per BatchNormalization)")
        return "\n".join(lines)

    def _per_node_lines(self) -> list[str]:
        folds = {(f.graph, f.node): f for f in self.check.folds} if self.check is not None else {}
        lines = []
        for record in self.batchnorms:
            where = "" if record.graph == "main" else f" [{record.graph}]"
            reset = " (reset from training mode)" if record.reset_from_training else ""
            if record.status == "folded" and record.direction == "merged":
                line = f"  folded     {record.node}{where} into {record.into} (a branch merged){reset}"
            elif record.status == "folded" and record.direction == "moved":
                line = f"  moved      {record.node}{where}: {record.into}{reset}"
            elif record.status == "folded" and record.direction == "forward":
                line = f"  folded     {record.node}{where} forward into {record.into}{reset}"
            elif record.status == "folded":
                line = f"  folded     {record.node}{where} into {record.into}{reset}"
            elif record.status == "converted":
                line = f"  converted  {record.node}{where} to Mul+Add ({record.reason})"
            else:
                line = f"  skipped    {record.node}{where}: {record.reason}"
            fold = folds.get((record.graph, record.node))
            if fold is not None:
                line += f": {_fold_text(fold)}"
            lines.append(line)
        for op in self.absorbed:
            where = "" if op.graph == "main" else f" [{op.graph}]"
            lines.append(f"  absorbed   {op.op} {op.node}{where} into {op.into}")
        for merge in self.merges:
            where = "" if merge.graph == "main" else f" [{merge.graph}]"
            branches = " + ".join(f"[{b}]" for b in merge.branches)
            if merge.status == "merged":
                window = "x".join(map(str, merge.kernel or []))
                conv = f"{merge.into} ({window}, group {merge.groups})"
                line = f"  merged     {merge.node}{where}: {branches} into {conv}"
                line += f"; {merge.reason}" if merge.reason else ""
            else:
                line = f"  not merged {merge.node}{where}: {branches}: {merge.reason}"
            fold = folds.get((merge.graph, merge.node))
            if fold is not None and merge.status == "merged":
                line += f": {_fold_text(fold)}"
            lines.append(line)
        if self.check is not None:
            for out in self.check.outputs:
                lines.append(f"  output     {out.name}: {_error_text(out)}")
        return lines


def _outcome_counts(outcomes: Any) -> dict[str, int]:
    counts = dict.fromkeys(OUTCOMES, 0)
    for outcome in outcomes:
        counts[outcome] += 1
    return counts


def _check_summary(check: CheckResult) -> list[str]:
    verdict = "passed" if check.passed else "FAILED"
    shapes = ", ".join(f"{k}={'x'.join(map(str, v))}" for k, v in check.input_shapes.items())
    lines = [
        f"  check {verdict} ({check.engine}, seed {check.seed}, inputs {shapes}; {check.elapsed_s:.2f} s)",
        f"  {'':<20}{'ok':>10}{'constant':>11}{'failed':>8}{'not compared':>14}   worst max rel",
    ]
    rows: list[tuple[str, dict[str, int], list[tuple[str, OutputError]]]] = [
        (
            "per fold",
            _outcome_counts(f.outcome for f in check.folds),
            [(f.node, f.error) for f in check.folds if f.error is not None]
            + [(f"{f.node}' alone at '{f.entry}", f.isolated) for f in check.folds if f.isolated is not None],
        ),
        ("outputs", _outcome_counts(o.outcome for o in check.outputs), [(o.name, o) for o in check.outputs]),
    ]
    for label, counts, errors in rows:
        worst_text = "-"
        if errors:
            name, worst = max(errors, key=lambda e: _badness(e[1]))
            worst_text = f"{worst.max_rel:.1e} at '{name}' (tolerance {worst.tolerance:.1e})"
        lines.append(
            f"  {label:<20}{counts['ok']:>10}{counts['constant']:>11}{counts['failed']:>8}"
            f"{counts['not compared']:>14}   {worst_text}"
        )
    lines += [f"  warning: {text}" for text in check_warnings(check)]
    return lines


def _badness(error: OutputError) -> tuple[bool, float]:
    """Failures first, then by how much of its tolerance an error uses."""
    ratio = error.max_rel / error.tolerance if error.tolerance > 0 else (0.0 if error.max_rel == 0 else float("inf"))
    return (not error.passed, ratio)


def check_warnings(check: CheckResult) -> list[str]:
    """What the proof could not show: tensors the same on every random input, folds not compared."""
    warnings = []
    proven = sum(1 for f in check.folds if f.outcome == "ok")
    constant_outputs = [o.name for o in check.outputs if o.outcome == "constant"]
    if constant_outputs:
        carried = f"the {proven} per-fold comparisons carry the proof" if proven else "nothing else was compared"
        warnings.append(
            f"output{'s' if len(constant_outputs) > 1 else ''} {_names(constant_outputs)} "
            f"{'are' if len(constant_outputs) > 1 else 'is'} the same on every random input: comparing "
            f"{'them' if len(constant_outputs) > 1 else 'it'} proves little ({carried})"
        )
    washed = [f.node for f in check.folds if f.error is not None and f.error.constant and f.outcome == "ok"]
    if washed:
        warnings.append(
            f"{len(washed)} fold(s) see a tensor the model makes the same on every random input (its weights "
            f"wash the input out): only their comparison on random data fed to the producer proves them: "
            f"{_names(washed)}"
        )
    constant_folds = [f.node for f in check.folds if f.outcome == "constant"]
    if constant_folds:
        warnings.append(
            f"{len(constant_folds)} fold(s) compared a tensor that is the same on every random input, which "
            f"proves little: {_names(constant_folds)}"
        )
    unprobed = [f.node for f in check.folds if f.outcome == "not compared"]
    if unprobed:
        warnings.append(
            f"{len(unprobed)} rewritten BatchNormalization not compared on their own (inside a subgraph or "
            f"function): only the outputs cover {_names(unprobed)}"
        )
    return warnings


def _names(names: list[str], limit: int = 3) -> str:
    shown = ", ".join(f"'{n}'" for n in names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")


def _error_text(error: OutputError) -> str:
    if error.noise is None:
        limit = f"tolerance {error.tolerance:.0e}"
    else:
        limit = f"vs {error.reference}, precision noise {error.noise:.1e}, tolerance {error.tolerance:.1e}"
    mark = {"ok": "ok", "constant": "ok but constant on every input", "failed": "BEYOND TOLERANCE"}[error.outcome]
    return f"max abs {error.max_abs:.3e}, max rel {error.max_rel:.3e} ({limit}) {mark}"


def _fold_text(fold: FoldCheck) -> str:
    if fold.error is None:
        return f"not compared ({fold.note})"
    at = f"at '{fold.tensor}'" + (f" ({fold.note})" if fold.note else "")
    text = f"{at} {_error_text(fold.error)}"
    if fold.isolated is not None:
        text += f"; on random data fed at '{fold.entry}': {_error_text(fold.isolated)}"
    return text
