"""Differential fuzzing of the training pass (bench/fuzz_training.py): a seeded sample of random PyTorch CNNs in CI.

Each network is exported (TorchScript or dynamo exporter, dynamic or static batch), built by the training pass in a
drawn variant, trained two SGD steps by TrainingSession and compared with PyTorch float64 (PyTorch float32 as the
noise level, mask replay for activation flips), and its float64 graph checked by the oracle. No network may fail to
build, crash or train wrong, except for the known-pending features (``KNOWN_PENDING``), which must be what explains
their failure. The kept regression cases replay, and a planted wrong rule is caught. The long run is in
bench/RESULTS.md.
"""

from __future__ import annotations

import pytest

from tests.loaders import bench_module

torch = pytest.importorskip("torch")
pytest.importorskip("onnxscript")  # the dynamo exporter

SEED = 36
CASES = 20

fuzz = bench_module("fuzz_training", "bnfuse_fuzz_training")
nets = fuzz.nets


def test_seeded_sample_has_no_defect() -> None:
    summary = fuzz.run_cases(CASES, SEED, minimize_defects=False)
    assert not [f for f in summary["failures"] if f["outcome"] in fuzz.DEFECTS], summary["failures"]
    outcomes, oracle, totals = summary["outcomes"], summary["oracle"], summary["totals"]
    assert sum(outcomes.values()) == CASES and "export error" not in outcomes, outcomes
    assert outcomes.get("ok", 0) >= CASES // 2, outcomes
    assert "MISMATCH" not in oracle and "oracle crash" not in oracle and oracle.get("matches", 0) >= CASES // 2, oracle
    assert any(k.startswith("dynamo") for k in totals) and any(k.startswith("torchscript") for k in totals), totals


def test_recipes_are_reproducible() -> None:
    first, again = fuzz.nets.draw_recipe(SEED, 3), fuzz.nets.draw_recipe(SEED, 3)
    assert first == again
    torchscript = fuzz.nets.Recipe(**{**first.__dict__, "exporter": "torchscript"})
    one = nets.export(nets.build(torchscript), torchscript)
    two = nets.export(nets.build(torchscript), torchscript)
    assert one.SerializeToString() == two.SerializeToString()
    assert fuzz.nets.Recipe.from_json(first.to_json()) == first


def test_the_cached_torchlib_op_list_exports_the_same_bytes() -> None:
    """The dynamo exporter with onnxscript's op list built once per process (nets.cache_torchlib) writes the model it
    writes with the list rebuilt for every export."""
    recipe = nets.Recipe(**{**fuzz.nets.draw_recipe(SEED, 5).__dict__, "exporter": "dynamo"})
    net = nets.build(recipe)
    nets.cache_torchlib(enabled=False)
    try:
        rebuilt = nets.export(net, recipe).SerializeToString()
    finally:
        nets.cache_torchlib()
    assert nets.export(net, recipe).SerializeToString() == rebuilt
    assert nets.export(net, recipe).SerializeToString() == rebuilt  # the second from the cached list


def test_worker_processes_tally_as_one_process_does() -> None:
    """--jobs 2 (spawned workers kept for the run) gives the one-process summary, in index order."""
    one = fuzz.run_cases(3, SEED, start=2, oracle="sampled")
    two = fuzz.run_cases(3, SEED, start=2, oracle="sampled", jobs=2)
    for key in ("outcomes", "oracle", "totals", "breakdown", "failures"):
        assert one[key] == two[key], key
    assert sum(one["oracle"].values()) == 3 and one["cpu_seconds"] > 0


def test_minimizer_keeps_only_what_the_failure_needs() -> None:
    recipe = nets.Recipe("torchscript", False, "portable", 6, 3, 9, "bn1d", 1,
                         [("conv", 1), ("pool", 2), ("residual", 3), ("act", 4)])  # fmt: skip

    def fails(candidate) -> bool:  # noqa: ANN001
        ops = [op for op, _ in candidate.steps]
        return "residual" in ops and candidate.side >= 6

    smallest = fuzz.minimize(recipe, fails)
    assert smallest.steps == [("residual", 3)] and smallest.side == 6  # a kept step keeps its own seed
    assert (smallest.batch, smallest.channels, smallest.head) == (2, 1, "linear")


def _static(steps: list[tuple[str, int]], **changes: object) -> object:
    recipe = nets.Recipe("torchscript", False, "default", 4, 3, 7, "linear", 11, steps)
    return nets.Recipe(**{**recipe.__dict__, **changes})


def test_a_planted_wrong_gradient_rule_is_reported_wrong(monkeypatch: pytest.MonkeyPatch) -> None:
    """Gemm's weight gradient scaled by 1.01 (the Linear head's rule): the float32 step is wrong beyond the float32
    noise, the float64 masks do not explain it, and the float64 oracle reports a MISMATCH."""
    from bnfuse.passes.training import fast_rules

    recipe = _static([("conv", 5), ("residual", 6)])
    assert fuzz.evaluate(recipe, 1).outcome == "ok"
    real = fast_rules._gemm_reverse

    def planted(original):  # noqa: ANN001, ANN202
        rule = real(original)

        def wrong(ctx, node, grads):  # noqa: ANN001, ANN202
            results = list(rule(ctx, node, grads))
            results[1] = ctx.b.op("Mul", [results[1], ctx.constant(1.01, ctx.dtype(node.input[1]))])
            return results

        return wrong

    monkeypatch.setattr(fast_rules, "_gemm_reverse", planted)
    result = fuzz.evaluate(recipe, 1)
    assert result.outcome == "wrong" and result.oracle == "MISMATCH", result
    assert "with float64 masks" in result.detail and "head.layers.0.weight" in result.detail, result.detail
    # --oracle sampled, the network outside the sample: the oracle runs all the same (beyond 1e-4)
    unsampled = fuzz.evaluate(recipe, 1, run_oracle=False, oracle_if_off=True)
    assert unsampled.outcome == "wrong" and unsampled.oracle == "MISMATCH", unsampled


def test_the_oracle_sample_skips_only_networks_at_parity() -> None:
    """--oracle sampled: a network within 1e-4 outside the sample is "not sampled"; the sample is every TorchScript
    network and every ORACLE_EVERY-th dynamo one."""
    recipe = _static([("conv", 5), ("residual", 6)])
    result = fuzz.evaluate(recipe, 1, run_oracle=False, oracle_if_off=True)
    assert result.outcome == "ok" and result.oracle == "not sampled", result
    dynamo = nets.Recipe(**{**recipe.__dict__, "exporter": "dynamo"})
    assert fuzz.oracle_sampled(recipe, 3) and fuzz.oracle_sampled(dynamo, fuzz.ORACLE_EVERY)
    assert not fuzz.oracle_sampled(dynamo, fuzz.ORACLE_EVERY + 1)


def test_a_failure_is_attributed_to_the_pending_feature_that_causes_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """A network whose only unusual BN is affine-free, "noaffine" listed as pending: either it trains (s32-bnflavours
    merged) or its failure is attributed to "noaffine", and swapping that BN for an affine one trains."""
    monkeypatch.setitem(fuzz.KNOWN_PENDING, "noaffine", fuzz.SWAPPABLE["noaffine"])
    nets_module = fuzz.nets
    saved = dict(nets_module.FLAVOURS)
    nets_module.FLAVOURS.clear()
    nets_module.FLAVOURS["noaffine"] = 1.0
    try:
        recipe = _static([("conv", 5)])
        result = fuzz.evaluate(recipe, 1, run_oracle=False)
        assert fuzz.pending_features(recipe) == ["noaffine"]
        if result.outcome in fuzz.DEFECTS:
            assert fuzz.attribute(recipe, 1) == ["noaffine"]
        else:
            assert result.outcome == "ok", result
        assert fuzz.evaluate(fuzz.swapped(recipe, ["noaffine"]), 1, run_oracle=False).outcome == "ok"
    finally:
        nets_module.FLAVOURS.clear()
        nets_module.FLAVOURS.update(saved)


def test_kept_regression_cases_replay() -> None:
    """Networks long runs found failing (minimized), now fixed: each trains at PyTorch parity."""
    cases = fuzz.load_cases()
    for case in cases:
        recipe = nets.Recipe.from_json(case["recipe"])
        result = fuzz.evaluate(recipe, case["data_seed"])
        assert result.outcome not in fuzz.DEFECTS and result.oracle != "MISMATCH", (case["found"], result)


OPEN = fuzz.load_cases(fuzz.OPEN_FILE)


@pytest.mark.parametrize("index", range(len(OPEN)))
def test_open_defects_are_known_only_by_their_own_feature(index: int) -> None:
    """An open defect with a known-pending feature (KNOWN_PENDING: a long run counts it as known, not minimized
    again) trains with that feature swapped out; one without (not located) stays a defect, attributed to nothing."""
    case = OPEN[index]
    recipe = nets.Recipe.from_json(case["recipe"])
    present = fuzz.pending_features(recipe)
    if present:
        result = fuzz.evaluate(fuzz.swapped(recipe, present), case["data_seed"], run_oracle=False)
        assert result.outcome not in fuzz.DEFECTS, (present, result)
    else:
        assert fuzz.attribute(recipe, case["data_seed"]) == [], case["cause"]


@pytest.mark.parametrize("index", range(len(OPEN)))
@pytest.mark.xfail(strict=True, reason="an open defect (bench/fuzz_training_open.json, its 'cause'); fixed: move it")
def test_open_defects_still_fail(index: int) -> None:
    """Minimized failures of files this branch does not own (their cause and fix in the file): strict xfail, so
    the fix shows as XPASS and the case moves to bench/fuzz_training_cases.json."""
    case = OPEN[index]
    result = fuzz.evaluate(nets.Recipe.from_json(case["recipe"]), case["data_seed"], run_oracle=False)
    assert result.outcome not in fuzz.DEFECTS, (case["cause"], result)
