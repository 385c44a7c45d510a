"""Differential fuzzing of the training pass: random PyTorch CNNs, trained by bnfuse and by PyTorch float64.

    nice -n 10 python bench/fuzz_training.py [--count 200] [--seed 1] [--start 0] [--json result.json]
                                             [--oracle all|sampled|none] [--jobs 2] [--save-cases] [--case N]

Each case (``--seed``, index) is a network drawn from bench/fuzz_training_nets.py's grammar (conv with dilation,
groups / depthwise and padding modes, transposed conv, residual, concat, pre-activation, squeeze-excite, max / avg
pooling with ceil_mode and count_include_pad, channel shuffle, upsample, BatchNorm1d, eight activations, BN
flavours: affine, ``affine=False``, ``momentum=None``, eval-mode BN inside a training module), exported by the
TorchScript exporter (``dynamo=False, do_constant_folding=False``) or the dynamo exporter (``dynamo=True,
optimize=False``) with a dynamic or a static batch, built by ``build_training_graph`` (default, portable, fused
ReLU off or fused optimizer off), and trained two SGD steps (lr 0.05) by ``TrainingSession``. PyTorch float64 from
the same weights is the reference (bench/float64_check.py's: BN epsilon / momentum as the graph holds them), PyTorch
float32 the yardstick of float32 noise. Per step, the largest relative error over the state (per tensor, relative
to its scale, floor 1e-3; bench/archs.py's measure). Outcomes:

- ``ok``: every step within 1e-4 of PyTorch float64; ``ok: float32 noise``: beyond, but within 10x of PyTorch
  float32's own largest error over the steps; ``ok: activation flip``: beyond both, but the float32 graph (fused
  ReLU off, NCHWc on as TrainingSession runs it) replayed with the float64 graph's masks (every ReLU / Clip / Where
  mask, fed from the float64 graph's run in onnx's reference evaluator) lands within that noise: the difference was
  elements on the other side of an activation's kink (bench/mask_replay.py's approach); ``ok: ill-conditioned``:
  beyond that noise with the float64 masks and no flip, but within 10x of PyTorch float32's largest error over
  ULP_RUNS runs on the inputs moved by one ulp (``ulp_noise``: one PyTorch float32 run is one draw of a wide band on
  such a network), with the float64 oracle run and matching (the rules exact);
- ``wrong``: beyond the noise with the float64 masks too (a wrong rule or kernel), or the float64 oracle's graph
  (below) off PyTorch float64 beyond its own spread; ``build error``: build_training_graph refused (BnfuseError);
  ``crash``: any other exception, in the build or a step; ``export error``: PyTorch's exporter failed, or wrote a
  model onnxruntime does not run as PyTorch's eval-mode network (not bnfuse's; counted apart);
- ``known: <feature>``: a failure that goes away when the features another branch is fixing (``KNOWN_PENDING``)
  are swapped for supported ones, one at a time (the swap names the cause). SWAPPABLE: an affine-free BN,
  ``momentum=None``, a Shape-computed reshape with a dynamic batch, a portable graph with a dynamic batch (its
  running variance), a ceil_mode pool whose last window starts in the end padding (ceil_mode off), a portable graph
  with BatchNorm1d on a map (the default variant); the last two are pending (bench/fuzz_training_open.json).

The float64 oracle (bench/float64_check.py): the float64 export's graph in the same variant, two steps in onnx's
reference evaluator with bnfuse's ops on NumPy float64, against PyTorch float64 at 1e-9 (float64-chaotic where
PyTorch's own spread from inputs moved by 1e-15 is larger and the graph within 10x of it). Its verdict is tallied
apart; a MISMATCH makes the case ``wrong``. ``--oracle all`` (the default, and the CI sample's) runs it on every
network that trained. ``--oracle sampled`` (the long runs') runs it on every network that lands beyond 1e-4 of
PyTorch float64 at a step (any outcome but ``ok``), on every TorchScript network and on every ``ORACLE_EVERY``-th
(4th) dynamo network by index; the rest are tallied "not sampled". Its cost is the float64 export (~1 CPU-s with the
dynamo exporter, 0.06 s with TorchScript), not the evaluator (~0.02 s a step at these sizes); onnxruntime has no
float64 Conv, so the evaluator stays. The float64 export is made once per network, for the oracle and the mask
replay alike.

Speed (the profile is in bench/RESULTS.md): the dynamo exporter is most of a network's CPU time. onnxscript's
torchlib op list, which the exporter rebuilds on every export by parsing every function's source, is built once
per process (``fuzz_training_nets.cache_torchlib``: byte-identical exports); ``--jobs N`` keeps N spawned worker
processes for the whole run (imports and the exporter's warm-up once per worker), tallied in index order.

A failure (build error, crash, wrong) is minimized: with every known-pending feature swapped out, steps are dropped
one at a time while the same outcome remains, then the batch, channels and side shrink; ``--save-cases`` appends
the smallest recipe to bench/fuzz_training_cases.json, which tests/test_fuzz_training.py replays.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
import traceback
from collections import Counter
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench import fuzz_training_nets as nets  # noqa: E402

LR = 0.05
STEPS = 2
RTOL = 1e-4
CHAOS_FACTOR = 10  # within this factor of PyTorch float32's own error: float32 noise
ULP_RUNS = 4  # PyTorch float32 runs on inputs 1 ulp apart, for a network beyond the noise after the mask replay
DEFECTS = ("build error", "crash", "wrong")
CASES_FILE = ROOT / "bench" / "fuzz_training_cases.json"  # fixed failures: tests/test_fuzz_training.py replays them
OPEN_FILE = ROOT / "bench" / "fuzz_training_open.json"  # open ones, with their cause (replayed as strict xfail)
# Features whose support another branch was adding (s32-bnflavours): a failure they explain is counted apart, as
# "known: <feature>", while they are listed here. Merged (main 8892c05): every one of them trains at parity, so
# none is listed; the names the attribution knows are SWAPPABLE.
SWAPPABLE = {
    "noaffine": "BN with affine=False (scale / bias Constant-fed)",
    "cumulative": "BN with momentum=None (cumulative average)",
    "size0": "a reshape of a Shape-computed shape (x.size()) with a dynamic batch",
    "portable-dynamic": "a portable graph with a dynamic batch (running variance)",
    "ceilpad": "a ceil_mode pool whose last window starts in the end padding (ONNX shape inference keeps it)",
    "portable-bn1d-map": "a portable graph with BatchNorm1d on a map's (N, C, H*W) view",
}
# Features a branch in progress is fixing: a failure that goes when one is swapped out counts as known (and is not
# minimized again). Empty: the ceil_mode / portable BatchNorm1d pool defects were fixed (session 33, pool_sizes.py).
KNOWN_PENDING: dict[str, str] = {}


@dataclass
class Result:
    outcome: str
    detail: str = ""
    errors: list[float] = field(default_factory=list)  # bnfuse vs PyTorch float64, per step
    noise: list[float] = field(default_factory=list)  # PyTorch float32 vs PyTorch float64, per step
    oracle: str = "not run"  # the float64 oracle's verdict
    flips: int = 0  # mask elements the float32 graph set otherwise than the float64 graph (when replayed)
    refused_dynamic: str = ""  # a dynamic-batch export built static: the pass's reason (first words)
    batch_norms: int = 0
    flavours: dict[str, int] = field(default_factory=dict)
    seconds: float = 0.0


# --- PyTorch ----------------------------------------------------------------------------------------------


def batches(recipe: nets.Recipe, data_seed: int) -> list[tuple[np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(data_seed)
    shape = (recipe.batch, recipe.channels, recipe.side, recipe.side)
    return [
        (rng.standard_normal(shape).astype(np.float32), rng.integers(0, nets.CLASSES, recipe.batch).astype(np.int64))
        for _ in range(STEPS)
    ]


def torch_states(net: Any, data: list, dtype: Any) -> list[dict[str, np.ndarray]]:
    """The state_dict after each SGD step of ``net`` (train mode) in ``dtype``, with the graph's hyperparameters
    (BN epsilon / momentum rounded through float32, as the ONNX attributes hold them)."""
    from bench import float64_check

    return [run.state for run in float64_check.torch_runs(net, data, LR, dtype=dtype)]


# --- bnfuse -----------------------------------------------------------------------------------------------


def build_options(recipe: nets.Recipe, net: Any, model: Any) -> dict[str, Any]:
    options = recipe.options()
    frozen = nets.frozen_nodes(net, model)
    if frozen:
        options["frozen_bn"] = frozen
    return options


def bnfuse_states(train_model: Any, data: list) -> list[dict[str, np.ndarray]]:
    from bnfuse.runtime import session_options
    from bnfuse.training.session import TrainingSession

    options = session_options(["CPUExecutionProvider"], intra_op_num_threads=1)
    session = TrainingSession(train_model, lr=LR, session_options=options)
    states = []
    for x, labels in data:
        session.step(x, labels)
        states.append({k: np.asarray(v, np.float64) for k, v in session.state_dict().items()})
    return states


def worst(actual: dict[str, np.ndarray], expected: dict[str, np.ndarray]) -> tuple[float, str]:
    from bench import float64_check

    return float64_check.worst(actual, expected)


def ulp_noise(net: Any, data: list, references: list, data_seed: int) -> list[float]:
    """PyTorch float32's largest error per step against ``references`` (PyTorch float64 on ``data``) over
    ULP_RUNS runs on the inputs moved by one float32 ulp each (up or down at random): how far rounding alone carries
    this network's float32 steps. An ill-conditioned network (a BatchNorm1d over 2 samples, whose dX is a cancellation
    residual) spreads 40x at step 1 and 340x at step 2 over such runs (bench/RESULTS.md, session 34)."""
    import torch

    rng = np.random.default_rng([data_seed, 1])
    up, down = np.float32(np.inf), np.float32(-np.inf)
    band = [0.0] * len(data)
    for _ in range(ULP_RUNS):
        moved = [(np.nextafter(x, np.where(rng.random(x.shape) < 0.5, up, down)), y) for x, y in data]
        states = torch_states(net, moved, torch.float32)
        band = [max(b, worst(s, r)[0]) for b, s, r in zip(band, states, references, strict=True)]
    return band


def within_noise(errors: list[float], noise: list[float]) -> bool:
    """Every step within RTOL, or within CHAOS_FACTOR of PyTorch float32's largest error over the steps (a network
    whose float32 rounding grows, as a bias gradient that is 0 in exact arithmetic under a BN of a channel far from
    zero mean, does so in PyTorch too, at either step)."""
    return max(errors) <= max(RTOL, CHAOS_FACTOR * max(noise))


@dataclass
class Exports:
    """One network's exports: the float32 model (trained, replayed) and, made once when first asked for, the float64
    model (the oracle's graph and the replay's masks, built from the same export)."""

    net: Any
    recipe: nets.Recipe
    float32: Any
    _float64: Any = None

    def float64(self) -> Any:
        import torch

        if self._float64 is None:
            self._float64 = nets.export(self.net, self.recipe, torch.float64)
        return self._float64


# --- mask replay ------------------------------------------------------------------------------------------


def replay(exports: Exports, data: list, options: dict[str, Any], references: list) -> tuple:
    """The float32 graph with fused ReLU off, stepped in onnxruntime (NCHWc as TrainingSession) with every mask fed
    from the float64 graph's run of the same steps: (errors per step against PyTorch float64, flipped elements)."""
    import onnx
    import onnxruntime
    from onnx import numpy_helper

    from bench import float64_check, mask_replay
    from bnfuse.passes.training import build_training_graph, read_spec
    from bnfuse.runtime import session_options
    from bnfuse.training.session import nchwc_block, nchwc_convs

    options = options | {"fuse_relu": False}
    graph32, _ = build_training_graph(exports.float32, **options)
    graph64, _ = build_training_graph(exports.float64(), **options)
    trainer = float64_check.ReferenceTrainer(graph64)
    names = mask_replay.matched_masks(graph32, graph64)
    masks = []  # per step: the float64 graph's masks, as float32
    for x, labels in data:
        trainer.step([x.astype(np.float64)], [labels], LR, keep=True)
        values = trainer.intermediates
        masks.append({m: mask_replay.as_mask(values[m64]) for m, m64 in names.items() if m64 in values})
    spec = read_spec(graph32)
    sessions = []
    for replayed in (False, True):
        graph = onnx.ModelProto()
        graph.CopyFrom(graph32)
        if replayed:
            graph = mask_replay.with_mask_inputs(graph, masks[0])
        else:  # the masks as built, as outputs: counted against the float64 ones
            graph.graph.output.extend(mask_replay.mask_output(m, v) for m, v in masks[0].items())
        state = [t for t in graph.graph.initializer if t.name in spec.state]
        for tensor in state:  # fed each step, as TrainingSession does
            graph.graph.initializer.remove(tensor)
        nchwc_convs(graph, nchwc_block())
        so = session_options(["CPUExecutionProvider"], intra_op_num_threads=1)
        sessions.append(onnxruntime.InferenceSession(graph.SerializeToString(), so, providers=["CPUExecutionProvider"]))
    initial = {t.name: numpy_helper.to_array(t) for t in graph32.graph.initializer if t.name in spec.state}
    states = [dict(initial), dict(initial)]
    errors, flips = [], 0
    for k, (x, labels) in enumerate(data):
        for replayed, session in enumerate(sessions):
            feeds = {spec.data[0]: x, spec.targets[0]: labels, spec.lr: np.array(LR, np.float32)} | states[replayed]
            outputs = list(spec.state.values()) + ([] if replayed else list(masks[k]))
            values = dict(zip(outputs, session.run(outputs, feeds | (masks[k] if replayed else {})), strict=True))
            states[replayed] = {name: values[out] for name, out in spec.state.items()}
            if not replayed:
                flips += sum(int(np.sum(values[m] != v)) for m, v in masks[k].items())
        state = {spec.original_names.get(n, n): np.asarray(v, np.float64) for n, v in states[1].items()}
        errors.append(worst(state, references[k])[0])
    return errors, flips


# --- the float64 oracle -----------------------------------------------------------------------------------


def oracle(exports: Exports, data: list, options: dict[str, Any], references: list) -> tuple[str, str]:
    """The float64 graph of the same variant in the reference evaluator against PyTorch float64: (verdict, detail)."""
    import torch

    from bench import float64_check
    from bnfuse.passes.training import build_training_graph

    try:
        graph, _ = build_training_graph(exports.float64(), **options)
        trainer = float64_check.ReferenceTrainer(graph)
        errors = []
        for k, (x, labels) in enumerate(data):
            trainer.step([x.astype(np.float64)], [labels], LR)
            errors.append(worst(trainer.state_dict(), references[k]))
    except NotImplementedError as exc:
        return "n/a", _first_line(exc)
    values = [e for e, _ in errors]
    if all(e <= float64_check.RTOL for e in values):
        return "matches", ""
    moved = [(x.astype(np.float64) * (1.0 + float64_check.PERTURBATION), y) for x, y in data]
    spread = [worst(s, r)[0] for s, r in zip(torch_states(exports.net, moved, torch.float64), references, strict=True)]
    verdict = float64_check.verdict(values, spread)
    return verdict, f"float64 graph {max(values):.1e} ({errors[-1][1]}) vs PyTorch f64 spread {max(spread):.1e}"


def _wide(data: list) -> list:
    return [(np.asarray(x, np.float64), y) for x, y in data]


# --- one case ---------------------------------------------------------------------------------------------


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"[:240]


def evaluate(
    recipe: nets.Recipe,
    data_seed: int,
    *,
    run_oracle: bool = True,
    judge_flips: bool = True,
    oracle_if_off: bool = False,
) -> Result:
    """One network: built, trained, compared (the module docstring's outcomes). ``run_oracle``: the float64 oracle
    on it; ``oracle_if_off``: on it only where the float32 step lands beyond 1e-4 of PyTorch float64 (any outcome but
    "ok" once trained; the ``--oracle sampled`` policy's network outside the sample)."""
    import onnx  # noqa: F401
    import torch

    from bnfuse.errors import BnfuseError
    from bnfuse.passes.training import build_training_graph

    started = time.perf_counter()
    torch.set_num_threads(1)
    net = nets.build(recipe)
    kinds = Counter(nets.flavours(net).values())
    result = Result("ok", batch_norms=sum(kinds.values()), flavours=dict(kinds))
    if not result.batch_norms:  # every BN-bearing step skipped: the pass refuses such a model, by design
        result.outcome = "no BN"
        return result
    data = batches(recipe, data_seed)
    try:
        model = nets.export(net, recipe)
    except Exception as exc:  # noqa: BLE001 - PyTorch's exporter, not bnfuse: counted apart
        result.outcome, result.detail = "export error", _first_line(exc)
        return result
    problem = export_problem(net, model, data[0][0])
    if problem:  # the exporter wrote a model onnxruntime does not run as PyTorch does: nothing for bnfuse to train
        result.outcome, result.detail = "export error", problem
        return result
    exports = Exports(net, recipe, model)
    options = build_options(recipe, net, model)
    try:
        train_model, report = build_training_graph(model, **options)
    except BnfuseError as exc:
        result.outcome, result.detail = "build error", _first_line(exc)
        return result
    except Exception as exc:  # noqa: BLE001
        result.outcome, result.detail = "crash", "build: " + _crash_line(exc)
        return result
    if recipe.dynamic and "dynamic refused" in report.batch:
        result.refused_dynamic = report.batch.split("dynamic refused: ", 1)[1][:60]
    try:
        states = bnfuse_states(train_model, data)
    except Exception as exc:  # noqa: BLE001
        result.outcome, result.detail = "crash", "step: " + _crash_line(exc)
        return result
    references = torch_states(net, _wide(data), torch.float64)
    ref32 = torch_states(net, data, torch.float32)
    found = [worst(s, r) for s, r in zip(states, references, strict=True)]
    result.errors = [e for e, _ in found]
    result.noise = [worst(s, r)[0] for s, r in zip(ref32, references, strict=True)]
    missing = [k for k in references[0] if k not in states[0]]
    if missing:
        result.outcome, result.detail = "wrong", f"state_dict names missing: {missing[:3]}"
    elif not within_noise(result.errors, result.noise):
        result.outcome = "wrong"
        result.detail = f"float32 {max(result.errors):.1e} ({found[-1][1]}) vs PyTorch f32 {max(result.noise):.1e}"
        if judge_flips:
            try:
                replayed, result.flips = replay(exports, data, options, references)
            except Exception as exc:  # noqa: BLE001
                result.detail += f"; replay failed: {_crash_line(exc)}"
            else:
                result.detail += f"; with float64 masks {max(replayed):.1e}, {result.flips} flipped elements"
                if result.flips and within_noise(replayed, result.noise):
                    result.outcome = "ok: activation flip"
                elif within_noise(replayed, band := ulp_noise(net, data, references, data_seed)):
                    # rounding alone, as large as PyTorch float32's own on inputs 1 ulp apart; the float64 oracle
                    # must prove the rules (below)
                    result.outcome, run_oracle = "ok: ill-conditioned", True
                    result.detail += f"; PyTorch f32 on inputs 1 ulp apart up to {max(band):.1e}"
    elif max(result.errors) > RTOL:
        result.outcome = "ok: float32 noise"
    if run_oracle or (oracle_if_off and result.outcome != "ok"):
        try:
            result.oracle, detail = oracle(exports, data, options, references)
        except Exception as exc:  # noqa: BLE001
            result.oracle, detail = "oracle crash", _crash_line(exc)
        if result.oracle == "MISMATCH" or (result.outcome == "ok: ill-conditioned" and result.oracle != "matches"):
            result.outcome = "wrong"
        if detail and result.oracle != "n/a":
            result.detail = f"{result.detail}; oracle: {detail}".lstrip("; ")
    elif oracle_if_off:
        result.oracle = "not sampled"
    result.seconds = time.perf_counter() - started
    return result


def export_problem(net: Any, model: Any, x: np.ndarray) -> str:
    """Why the exported inference model is not PyTorch's eval-mode network in onnxruntime ("" where it is): e.g. an
    AvgPool2d with ceil_mode whose last window starts in the padding (PyTorch drops it, ONNX shape inference keeps
    it, so onnxruntime refuses the model)."""
    import onnxruntime
    import torch

    try:
        options = onnxruntime.SessionOptions()
        options.intra_op_num_threads = options.inter_op_num_threads = 1
        session = onnxruntime.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
        got = session.run(None, {session.get_inputs()[0].name: x})[0]
    except Exception as exc:  # noqa: BLE001
        return "onnxruntime does not run the export: " + _first_line(exc)
    with torch.no_grad():
        want = net.eval()(torch.from_numpy(x)).numpy()
    error = float(np.max(np.abs(got - want))) / max(float(np.max(np.abs(want))), 1e-3)
    return f"the export's output differs from PyTorch's by {error:.1e}" if error > RTOL else ""


def _crash_line(exc: BaseException) -> str:
    frames = traceback.extract_tb(exc.__traceback__)
    where = next((f"{Path(f.filename).name}:{f.lineno}" for f in reversed(frames) if "bnfuse" in f.filename), "")
    return f"{_first_line(exc)} [{where}]" if where else _first_line(exc)


# --- known categories, minimization -----------------------------------------------------------------------


def pending_features(recipe: nets.Recipe) -> list[str]:
    """The known-pending features this recipe's network has (nets' ``replace`` names, and portable-dynamic)."""
    net = nets.build(recipe)
    present = [f for f in ("noaffine", "cumulative") if f in nets.flavours(net).values()]
    shape_computed = ("size0", "sizes")
    if recipe.dynamic and any(getattr(m, "style", getattr(m, "flatten", "")) in shape_computed for m in net.modules()):
        present.append("size0")
    if recipe.dynamic and recipe.variant == "portable":
        present.append("portable-dynamic")
    if any(getattr(m, "ceil_in_padding", False) for m in net.modules()):
        present.append("ceilpad")
    if recipe.variant == "portable" and any(isinstance(m, nets.BatchNorm1dOnMap) for m in net.modules()):
        present.append("portable-bn1d-map")
    return [f for f in present if f in KNOWN_PENDING]


def swapped(recipe: nets.Recipe, features: list[str]) -> nets.Recipe:
    """The recipe with ``features`` swapped for supported ones."""
    names = sorted(set(recipe.replace) | {f for f in features if f not in ("portable-dynamic", "portable-bn1d-map")})
    variant = "default" if "portable-bn1d-map" in features else recipe.variant
    dynamic = recipe.dynamic and "portable-dynamic" not in features
    return replace(recipe, replace=names, dynamic=dynamic, variant=variant)


def attribute(recipe: nets.Recipe, data_seed: int, oracle: bool = False) -> list[str]:
    """The known-pending features that explain this recipe's failure: [] where swapping all of them out still
    fails (a real failure), else those whose swap alone makes it pass (all of them if none does alone)."""
    present = pending_features(recipe)
    if not present:
        return []
    if _fails(swapped(recipe, present), data_seed, oracle=oracle):
        return []
    alone = (
        [f for f in present if not _fails(swapped(recipe, [f]), data_seed, oracle=oracle)]
        if len(present) > 1
        else present
    )
    return alone or present


def signature(outcome: str, detail: str) -> str:
    """What a minimized failure must keep: the outcome, and for a build error or crash the exception type and the
    first words of its message (names and numbers change as steps are dropped)."""
    if outcome not in ("build error", "crash"):
        return outcome
    words = re.sub(r"'[^']*'|[0-9][0-9.e+-]*", "#", detail).split()
    return " ".join([outcome, *words[:4]])


def _fails(recipe: nets.Recipe, data_seed: int, wanted: str | None = None, oracle: bool = False) -> bool:
    """Does the recipe fail (with the ``signature`` ``wanted``)? ``oracle``: with the float64 oracle (a failure only it
    saw)."""
    result = evaluate(recipe, data_seed, run_oracle=oracle)
    return signature(result.outcome, result.detail) == wanted if wanted else result.outcome in DEFECTS


def minimize(recipe: nets.Recipe, still_fails) -> nets.Recipe:  # noqa: ANN001
    """Drop steps (then shrink batch, channels, side, head) while ``still_fails(recipe)`` holds; the smallest."""
    current = recipe
    changed = True
    while changed:
        changed = False
        for index in reversed(range(len(current.steps))):
            candidate = replace(current, steps=current.steps[:index] + current.steps[index + 1 :])
            if still_fails(candidate):
                current, changed = candidate, True
        for key, smallest in (("batch", 2), ("channels", 1), ("side", 4)):
            for smaller in range(smallest, getattr(current, key)):
                candidate = replace(current, **{key: smaller})
                if still_fails(candidate):
                    current, changed = candidate, True
                    break
        if current.head != "linear" and still_fails(replace(current, head="linear")):
            current, changed = replace(current, head="linear"), True
    return current


# --- driver -----------------------------------------------------------------------------------------------


ORACLES = ("all", "sampled", "none")
ORACLE_EVERY = 4  # --oracle sampled: the oracle on every dynamo network whose index is a multiple of this


def oracle_sampled(recipe: nets.Recipe, index: int) -> bool:
    """In ``--oracle sampled``'s fixed sample: every TorchScript network (its float64 export costs ~0.06 CPU-s) and
    every ORACLE_EVERY-th dynamo one (its float64 export, ~1 CPU-s, is most of the oracle's cost)."""
    return recipe.exporter == "torchscript" or index % ORACLE_EVERY == 0


def run_case(seed: int, index: int, oracle_policy: str = "all", minimize_defects: bool = True) -> dict:
    """One case of a run, attributed and (a defect) minimized: what run_cases tallies, as plain data (a --jobs
    worker's answer)."""
    cpu = time.process_time()
    recipe = nets.draw_recipe(seed, index)
    data_seed = seed + index
    sampled = oracle_policy == "all" or oracle_policy == "sampled" and oracle_sampled(recipe, index)
    result = evaluate(recipe, data_seed, run_oracle=sampled, oracle_if_off=oracle_policy == "sampled" and not sampled)
    defect = result.outcome
    by_oracle = result.oracle == "MISMATCH"
    if defect in DEFECTS:
        known = attribute(recipe, data_seed, oracle=by_oracle)
        if known:
            result.outcome = f"known: {', '.join(known)} ({result.outcome})"
    entry = None
    if result.outcome in DEFECTS or result.oracle in ("MISMATCH", "oracle crash"):
        entry = {"index": index, "outcome": result.outcome, "detail": result.detail, "recipe": recipe.describe()}
        if minimize_defects and result.outcome in DEFECTS:
            base = swapped(recipe, pending_features(recipe))
            wanted = signature(result.outcome, result.detail)
            smallest = minimize(base, lambda r, w=wanted, s=data_seed, b=by_oracle: _fails(r, s, w, b))
            entry["minimized"] = smallest.describe()
            entry["minimized_recipe"] = smallest.to_json()
            entry["minimized_detail"] = evaluate(smallest, data_seed, run_oracle=by_oracle).detail
            entry["data_seed"] = data_seed
    return {
        "index": index,
        "recipe": recipe.to_json(),
        "result": result.__dict__,
        "entry": entry,
        "cpu_seconds": time.process_time() - cpu,
    }


def _worker_init() -> None:
    import onnxruntime
    import torch

    torch.set_num_threads(1)
    onnxruntime.set_default_logger_severity(3)  # shape-merge warnings of every ceil_mode pool: errors only
    nets.cache_torchlib()


def _run_case_star(job: tuple) -> dict:
    return run_case(*job)


def run_cases(
    count: int, seed: int, *, start: int = 0, run_oracle: bool = True, minimize_defects: bool = True,
    save_cases: bool = False, progress: bool = False, checkpoint: Path | None = None, oracle: str | None = None,
    jobs: int = 1,
) -> dict:  # fmt: skip
    """Cases start .. start + count - 1: the summary (outcomes, oracle verdicts, BN flavours, per-category outcomes,
    failures, CPU seconds). ``oracle``: "all", "sampled" (``oracle_sampled`` plus every network beyond 1e-4) or
    "none" (default: "all", or "none" where ``run_oracle`` is false). ``jobs``: worker processes kept for the whole
    run (each imports once and warms the dynamo exporter once); the tally is in index order either way."""
    policy = oracle or ("all" if run_oracle else "none")
    tally = _Tally(seed, start)
    work = [(seed, index, policy, minimize_defects) for index in range(start, start + count)]
    if jobs > 1:
        import multiprocessing

        # the workers' functions by an importable name (this file may run as __main__ or be loaded by path)
        from bench import fuzz_training as importable

        context = multiprocessing.get_context("spawn")  # no fork of a process holding torch / onnxruntime threads
        with context.Pool(jobs, initializer=importable._worker_init) as pool:
            answers = pool.imap(importable._run_case_star, work)
            for answer in answers:
                _record(tally, answer, seed, count, save_cases, progress, checkpoint)
    else:
        _worker_init()
        for job in work:
            _record(tally, run_case(*job), seed, count, save_cases, progress, checkpoint)
    return tally.summary(count)


@dataclass
class _Tally:
    seed: int
    start: int
    started: float = field(default_factory=time.time)
    outcomes: Counter = field(default_factory=Counter)
    oracles: Counter = field(default_factory=Counter)
    totals: Counter = field(default_factory=Counter)
    breakdown: dict = field(default_factory=dict)  # category -> Counter of outcomes
    failures: list = field(default_factory=list)
    cpu_seconds: float = 0.0
    done: int = 0

    def summary(self, count: int) -> dict:
        return {
            "seed": self.seed,
            "start": self.start,
            "count": count,
            "done": self.done,
            "seconds": round(time.time() - self.started),
            "cpu_seconds": round(self.cpu_seconds, 1),
            "outcomes": dict(self.outcomes),
            "oracle": dict(self.oracles),
            "totals": dict(self.totals),
            "breakdown": {k: dict(v) for k, v in sorted(self.breakdown.items())},
            "failures": self.failures,
        }


def _record(tally: _Tally, answer: dict, seed: int, count: int, save_cases: bool, progress: bool,
            checkpoint: Path | None) -> None:  # fmt: skip
    recipe = nets.Recipe.from_json(answer["recipe"])
    result = Result(**answer["result"])
    index = answer["index"]
    tally.done += 1
    tally.cpu_seconds += answer["cpu_seconds"]
    tally.outcomes[result.outcome] += 1
    tally.oracles[result.oracle] += 1
    tally.totals["batch_norms"] += result.batch_norms
    tally.totals.update({f"bn {k}": v for k, v in result.flavours.items()})
    batch = f"{recipe.exporter} {'dynamic' if recipe.dynamic else 'static'}"
    tally.totals[batch] += 1
    tally.totals[f"variant {recipe.variant}"] += 1
    tally.totals["flipped elements"] += result.flips
    if result.refused_dynamic:  # trained all the same, at the static batch
        tally.totals[f"dynamic batch refused: {result.refused_dynamic}"] += 1
    for category in [batch, f"variant {recipe.variant}", *(f"bn {k}" for k in result.flavours)]:
        tally.breakdown.setdefault(category, Counter())[result.outcome] += 1
    entry = answer["entry"]
    if entry is not None:
        if save_cases and "minimized_recipe" in entry:
            found = f"seed {seed} index {index}: {result.outcome}: {result.detail}"
            save_case(nets.Recipe.from_json(entry["minimized_recipe"]), entry["data_seed"], found)
        tally.failures.append(entry)
        print(json.dumps(entry), file=sys.stderr, flush=True)
    if progress:
        print(
            f"[{tally.done}/{count} {time.time() - tally.started:.0f}s] {index}: {result.outcome} ({result.oracle}) "
            f"{result.seconds:.1f}s {recipe.describe()} {result.detail}",
            file=sys.stderr,
            flush=True,
        )
    if checkpoint is not None and (tally.done % 10 == 0 or tally.done == count):
        checkpoint.write_text(json.dumps(tally.summary(count), indent=1))


def save_case(recipe: nets.Recipe, data_seed: int, found: str) -> None:
    cases = load_cases()
    if any(c["recipe"] == recipe.to_json() and c["data_seed"] == data_seed for c in cases):
        return
    cases.append({"recipe": recipe.to_json(), "data_seed": data_seed, "found": found})
    CASES_FILE.write_text(json.dumps(cases, indent=1) + "\n")


def load_cases(path: Path = CASES_FILE) -> list[dict]:
    return json.loads(path.read_text()) if path.exists() else []


def markdown(summary: dict) -> str:
    """The summary table for bench/RESULTS.md."""
    lines = ["| outcome | networks |", "|---|---|"]
    lines += [f"| {k} | {v} |" for k, v in sorted(summary["outcomes"].items(), key=lambda kv: -kv[1])]
    lines += ["", "| float64 oracle | networks |", "|---|---|"]
    lines += [f"| {k} | {v} |" for k, v in sorted(summary["oracle"].items(), key=lambda kv: -kv[1])]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--count", type=int, default=200)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--start", type=int, default=0, help="first case index (to split a run)")
    parser.add_argument("--case", type=int, help="run and print this one case (index)")
    parser.add_argument("--no-oracle", action="store_true", help="skip the float64 oracle (= --oracle none)")
    parser.add_argument("--oracle", choices=ORACLES, default="all",
                        help="the float64 oracle on every network, on a fixed sample and every network beyond 1e-4 "
                        "of PyTorch float64 (oracle_sampled), or on none")  # fmt: skip
    parser.add_argument("--jobs", type=int, default=1, help="worker processes (kept for the whole run)")
    parser.add_argument("--no-minimize", action="store_true")
    parser.add_argument("--save-cases", action="store_true", help=f"append minimized failures to {CASES_FILE.name}")
    parser.add_argument("--json", type=Path, help="write the summary here (also every 10 cases)")
    args = parser.parse_args(argv)
    if args.case is not None:
        recipe = nets.draw_recipe(args.seed, args.case)
        result = evaluate(recipe, args.seed + args.case, run_oracle=not args.no_oracle)
        print(recipe.describe(), "->", result)
        if result.outcome in DEFECTS:
            known = attribute(recipe, args.seed + args.case, oracle=result.oracle == "MISMATCH")
            print("attributed to:", known or "nothing known")
        return 1 if result.outcome in DEFECTS else 0
    summary = run_cases(
        args.count, args.seed, start=args.start, minimize_defects=not args.no_minimize, save_cases=args.save_cases,
        progress=True, checkpoint=args.json, oracle="none" if args.no_oracle else args.oracle, jobs=args.jobs,
    )  # fmt: skip
    print(json.dumps({k: v for k, v in summary.items() if k != "failures"}, indent=1))
    print(markdown(summary))
    print(f"failures: {len(summary['failures'])}")
    if args.json:
        args.json.write_text(json.dumps(summary, indent=1))
    return 1 if any(f["outcome"] in DEFECTS for f in summary["failures"]) else 0


if __name__ == "__main__":
    sys.exit(main())
