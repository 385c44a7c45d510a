"""Random calls of the BN custom ops in onnxruntime sessions, against float64 formulas, and random bad input.

    python bench/fuzz_ops.py [--count 10000] [--seed 1] [--bad-every 4] [--json result.json]

Each case draws an op (BatchNormalizationInference / Training / Grad), a type pair (float32 / float16 /
float16 data with float32 parameters), a rank 2-6 shape of small dimensions (some 1), a mode and axis, and
every attribute (fix_gamma, use_global_stats, unbiased_running_var, the five momentum conventions, momentum,
epsilon, activation); every ``--large-every``-th case grows its batch until X is 8.4 MiB in float32 (the pooled
path). It builds the one-node model, runs it in a session with bnfuse's library registered
(``bnfuse.runtime.session_options``; whichever implementation is registered) and compares every output with
tests/runtime/op_oracle.py's formulas, written from the attribute values (not bnfuse's config parsing or its
reference). Every ``--bad-every``-th case is also broken one way (a bad attribute value or type, a rank outside
2-8, a parameter of the wrong length or rank, an input of the wrong type, axis 0 or out of range): it must fail
with an onnxruntime error that names the op (or, for a type onnxruntime checks itself, the input), and a good
call right after (same session where the break was at the run) must give the right values. Outcomes: ``ok``,
``refused`` (bad input, refused properly), and the defects ``wrong``, ``error`` (a valid case refused),
``accepted`` (bad input run without an error), ``unclear`` (an error that names neither op nor input),
``unusable`` (a good call after a refused one fails). A crash ends the process: that is a defect too.
tests/runtime/test_op_matrix.py runs a seeded sample of the valid draws; bench/RESULTS.md has the long run.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
from onnx import helper

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.runtime.op_oracle import (  # noqa: E402
    INFERENCE,
    TRAINING,
    Case,
    expected,
    feeds,
    mismatches,
    model_bytes,
    random_case,
    session,
)

DEFECTS = ("wrong", "error", "accepted", "unclear", "unusable")
POOLED_ELEMENTS = 2_200_000  # 8.4 MiB of float32: above every serial-path limit of the CPU kernels


def _bad_attributes(case: Case, rng: np.random.Generator) -> tuple[dict[str, Any], list[Any]]:
    """A bad value or type for one attribute the op reads."""
    values: list[tuple[str, Any]] = [("epsilon", 0.0), ("epsilon", -1.0), ("mode", "channels"), ("axis", 0)]
    if case.op != INFERENCE:
        values += [("fix_gamma", 2), ("use_global_stats", -1), ("activation", "tanh")]
    else:
        values += [("activation", "relu")]
    if case.op == TRAINING:
        values += [("momentum", 1.5), ("momentum", -0.5), ("momentum_convention", "keras"), ("unbiased_running_var", 3)]
    types = [helper.make_attribute("epsilon", 1), helper.make_attribute("axis", 1.5), helper.make_attribute("mode", 2)]
    if rng.random() < 0.25:
        attribute = types[int(rng.integers(len(types)))]
        return {k: v for k, v in case.attributes.items() if k != attribute.name}, [attribute]
    name, value = values[int(rng.integers(len(values)))]
    attributes = {**case.attributes, name: value}
    if name == "axis":
        attributes.pop("mode", None)
    return attributes, []


def _bad_feeds(case: Case, inputs: dict[str, np.ndarray], rng: np.random.Generator) -> dict[str, np.ndarray]:
    """The inputs with one broken: X of rank 1 or 9, a parameter one element short or of another rank, or the
    wrong type."""
    broken = dict(inputs)
    kind = int(rng.integers(4))
    params = [n for n in inputs if n not in ("X", "dY", "Y")]
    if kind == 0:
        shape = (3,) if rng.random() < 0.5 else (1,) * 9
        for name in ("X", "dY", "Y"):
            if name in broken:
                broken[name] = np.ones(shape, inputs[name].dtype)
    elif kind == 1:
        name = params[int(rng.integers(len(params)))]
        flat = inputs[name].reshape(-1)
        broken[name] = np.concatenate([flat, flat[:1]]) if flat.size else np.ones(1, flat.dtype)
    elif kind == 2:
        name = params[int(rng.integers(len(params)))]
        broken[name] = inputs[name].reshape(1, *inputs[name].shape)
    else:
        name = list(inputs)[int(rng.integers(len(inputs)))]
        broken[name] = inputs[name].astype(np.float64)
    return broken


def _names_the_problem(message: str, op: str) -> bool:
    """The op's own errors name it; a feed whose type differs from the model's is refused by onnxruntime itself
    before any op runs ("Unexpected input data type")."""
    return op in message or "Unexpected input data type" in message


def run_one(case: Case, bad: bool, rng: np.random.Generator) -> tuple[str, str]:
    """(outcome, detail) of one case."""
    inputs = feeds(case)
    want = expected(case, inputs)
    model = model_bytes(case.op, case.attributes, case.data_type, case.param_type)
    if not bad:
        try:
            got = session(model, threads=1).run(None, inputs)
        except Exception as exc:  # noqa: BLE001 - a valid case refused is a finding, whatever the exception
            return "error", str(exc)[-300:]
        problems = mismatches(case, got, want)
        return ("wrong", "; ".join(problems)) if problems else ("ok", "")
    if rng.random() < 0.5:  # a broken node: session creation (or, for axis / rank, the run) must refuse it
        attributes, raw = _bad_attributes(case, rng)
        try:
            sess = session(model_bytes(case.op, attributes, case.data_type, case.param_type, raw_attributes=raw), 1)
            sess.run(None, inputs)
        except Exception as exc:  # noqa: BLE001
            message = str(exc)
            if not _names_the_problem(message, case.op):
                return "unclear", message[-300:]
        else:
            return "accepted", f"attributes {attributes} {[a.name for a in raw]}"
        sess = session(model, 1)
    else:  # a broken call on a good session: the run must refuse it, the session must stay usable
        sess = session(model, 1)
        try:
            sess.run(None, _bad_feeds(case, inputs, rng))
        except Exception as exc:  # noqa: BLE001
            message = str(exc)
            if not _names_the_problem(message, case.op):
                return "unclear", message[-300:]
        else:
            return "accepted", "bad feeds ran"
    try:
        problems = mismatches(case, sess.run(None, inputs), want)
    except Exception as exc:  # noqa: BLE001
        return "unusable", str(exc)[-300:]
    return ("unusable", "; ".join(problems)) if problems else ("refused", "")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--count", type=int, default=10000)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--bad-every", type=int, default=4, help="every N-th case is also broken (0: none)")
    parser.add_argument("--large-every", type=int, default=100, help="every N-th case has X past 8 MiB (0: none)")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    rng = np.random.default_rng(args.seed)
    outcomes: Counter[str] = Counter()
    by_op: Counter[tuple[str, str]] = Counter()
    findings = []
    start = time.perf_counter()
    for index in range(args.count):
        case = random_case(rng, seed=args.seed * 1_000_003 + index)
        if args.large_every and index % args.large_every == 0:  # the pooled path: X past 8 MiB in float32
            case = dataclasses.replace(case, shape=(-(-POOLED_ELEMENTS // math.prod(case.shape[1:])), *case.shape[1:]))
        bad = bool(args.bad_every) and index % args.bad_every == args.bad_every - 1
        outcome, detail = run_one(case, bad, rng)
        outcomes[outcome] += 1
        by_op[(case.op.removeprefix("BatchNormalization"), outcome)] += 1
        if outcome in DEFECTS:
            findings.append({"index": index, "case": case.describe(), "bad": bad, "outcome": outcome, "detail": detail})
            print(f"{index}: {outcome}: {case.describe()}: {detail}", flush=True)
    seconds = time.perf_counter() - start
    summary = {
        "count": args.count,
        "seed": args.seed,
        "seconds": round(seconds, 1),
        "outcomes": dict(outcomes),
        "by_op": {f"{op} {outcome}": n for (op, outcome), n in sorted(by_op.items())},
        "defects": sum(outcomes[d] for d in DEFECTS),
        "findings": findings[:50],
    }
    print(json.dumps({k: v for k, v in summary.items() if k != "findings"}, indent=1))
    if args.json:
        args.json.write_text(json.dumps(summary, indent=1))
    return 1 if summary["defects"] else 0


if __name__ == "__main__":
    sys.exit(main())
