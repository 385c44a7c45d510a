"""bench/arch_float32.py's table logic and bench/train_architectures.py's verdict (no torch: hand-made rows)."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import arch_float32, train_architectures  # noqa: E402


def _row(error1: float, error1_32: float, **extra: object) -> dict:
    return {"error1": error1, "error1_32": error1_32, "error": 2 * error1, "error32": 2 * error1_32, **extra}


def test_verdict_tells_a_match_a_flip_and_a_mismatch() -> None:
    assert train_architectures.verdict(_row(5e-5, 1e-3), []) == "matches"
    assert train_architectures.verdict(_row(5e-3, 1e-3), []) == "float32-chaotic"  # within 10x of PyTorch f32
    assert train_architectures.verdict(_row(2e-2, 1e-3), []) == "MISMATCH"  # beyond 10x
    assert train_architectures.verdict(_row(2e-4, 5e-5), []) == "MISMATCH"  # PyTorch f32 itself matches
    assert train_architectures.verdict(_row(0.0, 0.0), ["conv.weight"]).startswith("MISMATCH: 1 state_dict")


def test_errors_compare_each_step_against_float64_and_count_missing_names() -> None:
    ref64 = [{"w": np.array([1.0, 2.0]), "b": np.array([0.5])}, {"w": np.array([1.0, 4.0]), "b": np.array([0.5])}]
    ref32 = [{"w": np.array([1.0, 2.002]), "b": np.array([0.5])}, {"w": np.array([1.0, 4.0]), "b": np.array([0.5])}]
    ours = [{"w": np.array([1.0, 2.02])}, {"w": np.array([1.4, 4.0])}]
    found = arch_float32.errors(ours, ref64, ref32)
    assert np.isclose(found["error1"], 0.01) and np.isclose(found["error1_32"], 0.001)
    assert np.isclose(found["error"], 0.1) and found["error32"] == 0.0
    assert found["missing"] == 1 and found["missing_names"] == ["b"]


def test_markdown_has_a_column_pair_per_exporter_and_lr() -> None:
    rows = [
        dict(_row(1e-5, 2e-5), name="a", exporter="torchscript", lr=0.05, status="matches"),
        dict(name="a", exporter="dynamo", lr=0.05, status="build fails: no shape"),
        dict(_row(3e-3, 1e-3), name="b", exporter="torchscript", lr=0.05, status="float32-chaotic"),
    ]
    lines = arch_float32.markdown(rows).splitlines()
    assert lines[0].count("verdict") == 2 and "dynamo lr 0.05" in lines[0]
    assert (
        lines[2] == "| a | 1.0e-05 / 2.0e-05 = 0.5x; 2.0e-05 / 4.0e-05 = 0.5x | matches | - | build fails: no shape |"
    )
    assert lines[3] == "| b | 3.0e-03 / 1.0e-03 = 3.0x; 6.0e-03 / 2.0e-03 = 3.0x | float32-chaotic | not run | - |"


def test_bad_exporter_is_one_line_and_exit_2(capsys) -> None:
    assert train_architectures.main(["--no-timing", "--exporter", "jit", "--models", "resnet18"]) == 2
    assert capsys.readouterr().err.count("\n") == 1
