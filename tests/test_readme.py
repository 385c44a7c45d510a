"""The README's set-up commands are the ones CI runs; its results table is bench/RESULTS.md's summary."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _readme_commands() -> list[str]:
    text = (ROOT / "README.md").read_text()
    setup = text.split("## Set-up", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```bash\n(.+?)\n```", setup, flags=re.S)


def test_readme_has_exactly_two_setup_commands() -> None:
    commands = _readme_commands()
    assert len(commands) == 2
    assert all("\n" not in command for command in commands)
    assert "bnfuse optimize" in commands[0]
    assert "pytest" in commands[1]


def test_ci_runs_the_readme_test_command() -> None:
    ci_lines = (ROOT / ".ci" / "run").read_text().splitlines()
    assert _readme_commands()[1] in ci_lines


def test_the_results_table_is_the_summary_of_results_md() -> None:
    """README's table is generated from RESULTS.md's (bench/run_all.py, ``--sync-readme``): never edited apart."""
    readme = (ROOT / "README.md").read_text()
    table = readme.split("<!-- results-table -->", 1)[1].split("<!-- /results-table -->", 1)[0]
    results = (ROOT / "bench" / "RESULTS.md").read_text()
    summary = results.split("\n## Summary\n", 1)[1].lstrip("\n").split("\n\n", 1)[0]
    assert summary.startswith("| benchmark |") and summary.count("\n") > 2
    rows = [line for line in table.splitlines() if line.startswith("|")]
    assert rows == summary.splitlines()
