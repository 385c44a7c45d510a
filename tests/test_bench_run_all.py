"""bench/run_all.py: aggregation of fake benchmark modules into RESULTS.md and plots (no real benchmarking)."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from tests.loaders import bench_module

ROOT = Path(__file__).resolve().parents[1]
PNG = b"\x89PNG\r\n\x1a\n"


run_all = bench_module("run_all", "bnfuse_run_all_under_test")


def fake(bench: Path, topic: str, body: str) -> None:
    """Write bench/bench_<topic>.py whose run(quick) executes ``body``."""
    header = [
        "import sys",
        f"sys.path.insert(0, {str(ROOT)!r})",
        "from bench.common import Section, markdown_table",
        "",
        "def run(quick: bool = False) -> Section:",
    ]
    source = "\n".join(header) + "\n" + textwrap.indent(textwrap.dedent(body).strip(), "    ") + "\n"
    (bench / f"bench_{topic}.py").write_text(source)


@pytest.fixture
def bench(tmp_path: Path) -> Path:
    directory = tmp_path / "bench"
    directory.mkdir()
    fake(directory, "optimize", """
        rows = [[1, 2.5 if quick else 3.5]]
        return Section("Fold pass", "python bench/bench_optimize.py" + (" --quick" if quick else ""),
                       markdown_table(["a", "b"], rows),
                       series={"pass_time": [(1e6, 0.01), (4e6, 0.03), (16e6, 0.11)]})
    """)  # fmt: skip
    fake(directory, "kernels", """
        sweep = {"cpu": [(1e5, 1e-5), (1e6, 8e-5), (1e7, 9e-4)], "reference": [(1e5, 3e-5), (1e7, 3e-3)]}
        return Section("Kernels", "python bench/bench_kernels.py", "kernel table",
                       series={"kernel_sweep": sweep, "bandwidth_gbs": 12.5})
    """)  # fmt: skip
    fake(directory, "training", """
        raise RuntimeError("training graph exploded\\nsecond line")
    """)  # fmt: skip
    fake(directory, "extra", """
        return Section("Extra topic", "python bench/bench_extra.py", "extra markdown")
    """)  # fmt: skip
    return directory


def test_aggregates_sections_reports_missing_and_failed(bench: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    code = run_all.main(["--quick", "--bench-dir", str(bench), "--output-dir", str(out)])
    assert code == 1  # one module failed; the report is written all the same
    text = (out / "RESULTS.md").read_text()
    assert text.startswith("# bnfuse benchmark results\n")
    assert f"- Command: `python bench/run_all.py --quick --bench-dir {bench} --output-dir {out}`" in text
    assert f"- Machine: {run_all.machine_description()}" in text
    assert "## Fold pass\n\n`python bench/bench_optimize.py --quick`\n\n| a | b |\n|---|---|\n| 1 | 2.5 |" in text
    assert "## Kernels" in text and "kernel table" in text and "## Extra topic" in text
    assert "- ortops: missing (" in text and "bench_ortops.py not present)" in text
    assert "- training: failed (RuntimeError: training graph exploded)" in text
    assert "second line" not in text
    # Order: known topics first, then the extra module.
    assert text.index("## Fold pass") < text.index("## Kernels") < text.index("## Extra topic")
    for name in ("pass_time.png", "kernel_bandwidth.png"):
        assert f"![{name}]({name})" in text
        data = (out / name).read_bytes()
        assert data.startswith(PNG) and len(data) > 5000
    assert sorted(p.name for p in out.iterdir()) == ["RESULTS.md", "kernel_bandwidth.png", "pass_time.png"]


def test_only_runs_the_named_topics(bench: Path, tmp_path: Path) -> None:
    code = run_all.main(["--only", "kernels,ortops", "--bench-dir", str(bench), "--output-dir", str(tmp_path)])
    assert code == 0
    text = (tmp_path / "RESULTS.md").read_text()
    assert "## Kernels" in text and "kernel table" in text and "Fold pass" not in text and "training" not in text
    assert "- ortops: missing" in text
    assert sorted(p.name for p in tmp_path.iterdir() if p.is_file()) == ["RESULTS.md", "kernel_bandwidth.png"]


def test_unknown_topic_is_refused(bench: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert run_all.main(["--only", "nope", "--bench-dir", str(bench), "--output-dir", str(tmp_path)]) == 2
    assert "unknown topic(s) nope" in capsys.readouterr().err
    assert not list(tmp_path.glob("*.md"))


def test_missing_series_and_bad_results_are_noted_not_fatal(tmp_path: Path) -> None:
    bench = tmp_path / "bench"
    bench.mkdir()
    fake(bench, "optimize", 'return Section("Fold pass", "cmd", "md")')
    fake(bench, "kernels", 'return Section("Kernels", "cmd", "md", series={"kernel_sweep": "garbage"})')
    fake(bench, "ortops", "return 42")
    assert run_all.main(["--bench-dir", str(bench), "--output-dir", str(tmp_path)]) == 1
    text = (tmp_path / "RESULTS.md").read_text()
    assert "- pass_time.png: not written (the optimize section has no series['pass_time'])" in text
    assert "- kernel_bandwidth.png: not written (series['kernel_sweep'] unusable: TypeError" in text
    assert "- ortops: failed (TypeError: run() returned int, not a bench.common.Section)" in text
    assert not list(tmp_path.glob("*.png")) and not list(tmp_path.glob(".*tmp"))


def test_results_are_replaced_atomically(tmp_path: Path) -> None:
    results = tmp_path / "RESULTS.md"
    results.write_text("previous results\n")

    def fail_midway(handle) -> None:
        handle.write(b"partial")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        run_all._atomic(results, fail_midway)
    assert results.read_text() == "previous results\n"
    assert [p.name for p in tmp_path.iterdir()] == ["RESULTS.md"]  # no temporary left
    run_all.write_text(results, "new\n")
    assert results.read_text() == "new\n" and [p.name for p in tmp_path.iterdir()] == ["RESULTS.md"]


def test_plot_accepts_a_single_line_without_bandwidth(tmp_path: Path) -> None:
    run_all.plot_kernel_bandwidth({"kernel_sweep": [(1e6, 1e-4), (2e6, 2e-4)]}, tmp_path / "k.png")
    run_all.plot_pass_time({"pass_time": {"width series": [(1e6, 0.01), (2e6, 0.02)]}}, tmp_path / "p.png")
    assert (tmp_path / "k.png").read_bytes().startswith(PNG) and (tmp_path / "p.png").read_bytes().startswith(PNG)


def test_targets_make_a_summary_and_the_readme_table(tmp_path: Path) -> None:
    bench = tmp_path / "bench"
    bench.mkdir()
    fake(bench, "optimize", """
        from bench.common import Target
        return Section("Fold pass", "cmd", "md", targets=[Target("pass / onnxsim", 0.15, 0.25),
                                                          Target("pass / onnxruntime", 0.55, 0.25)])
    """)  # fmt: skip
    readme = tmp_path / "README.md"
    readme.write_text("# x\n\nbefore\n<!-- results-table -->\nold table\n<!-- /results-table -->\nafter\n")
    out = tmp_path / "out"
    assert run_all.main(["--only", "optimize", "--bench-dir", str(bench), "--output-dir", str(out),
                         "--readme", str(readme)]) == 0  # fmt: skip
    rows = (
        "| optimize | pass / onnxsim | 0.15x | <= 0.25x | yes |\n"
        "| optimize | pass / onnxruntime | 0.55x | <= 0.25x | **no** |"
    )
    assert "## Summary\n\n| benchmark |" in (out / "RESULTS.md").read_text()
    assert rows in (out / "RESULTS.md").read_text()
    text = readme.read_text()
    assert text.startswith("# x\n\nbefore\n<!-- results-table -->\nThe summary of [bench/RESULTS.md]")
    assert text.endswith("<!-- /results-table -->\nafter\n")
    assert rows in text and "old table" not in text


def test_readme_without_markers_is_left_alone(tmp_path: Path) -> None:
    readme, results = tmp_path / "README.md", tmp_path / "RESULTS.md"
    readme.write_text("no markers here\n")
    results.write_text("# r\n\n## Summary\n\n| benchmark | b |\n|---|---|\n| t | 1 |\n")
    assert not run_all.sync_readme(readme, results)
    assert readme.read_text() == "no markers here\n"


SUMMARY = "| benchmark | figure | measured |\n|---|---|---|\n"


def test_a_partial_run_replaces_only_its_topics_rows_and_the_readme_follows(bench: Path, tmp_path: Path) -> None:
    fake(bench, "kernels", """
        from bench.common import Target
        return Section("Kernels", "cmd", "md", targets=[Target("fwd / onnxruntime", 0.5, 1.5)])
    """)  # fmt: skip
    old_rows = (
        "| optimize | pass / onnxsim | 0.15x |\n| kernels | stale | 9.00x |\n| recalibrate | r / torch | 0.52x |\n"
    )
    (tmp_path / "RESULTS.md").write_text(f"# old\n\n- Machine: M\n\n## Summary\n\n{SUMMARY}{old_rows}\n## Kernels\n")
    readme = tmp_path / "README.md"
    readme.write_text("intro\n<!-- results-table -->\nhand-written 1.18x\n<!-- /results-table -->\nend\n")
    args = ["--only", "kernels", "--bench-dir", str(bench), "--output-dir", str(tmp_path), "--readme", str(readme)]
    assert run_all.main(args) == 0
    summary = run_all.summary_of((tmp_path / "RESULTS.md").read_text())
    rows = summary.splitlines()[2:]
    assert [r.split("|")[1].strip() for r in rows] == ["optimize", "kernels", "recalibrate"]
    assert "stale" not in summary and "| kernels | fwd / onnxruntime | 0.50x | <= 1.5x | yes |" in summary
    text = readme.read_text()
    assert summary in text and "hand-written" not in text and text.endswith("<!-- /results-table -->\nend\n")


def test_sync_readme_copies_an_edited_summary(tmp_path: Path) -> None:
    results, readme = tmp_path / "RESULTS.md", tmp_path / "README.md"
    results.write_text(
        f"# r\n\n- Machine: AMD, 2 cores\n\n## Summary\n\n{SUMMARY}| step_memory | cold | 0.29x |\n\n## S\n"
    )
    readme.write_text("a\n<!-- results-table -->\n| step_memory | cold | 1.18x |\n<!-- /results-table -->\n")
    args = ["--sync-readme", "--output-dir", str(tmp_path), "--readme", str(readme)]
    assert run_all.main(args) == 0
    assert "| step_memory | cold | 0.29x |" in readme.read_text() and "1.18x" not in readme.read_text()
    assert "(AMD, 2 cores)" in readme.read_text()
    assert run_all.main(["--sync-readme", "--output-dir", str(tmp_path / "none"), "--readme", str(readme)]) == 1


def test_sections_after_the_kept_marker_survive_a_rerun(bench: Path, tmp_path: Path) -> None:
    kept = f"{run_all.KEPT_MARKER}\n\n## Keras: BN left\n\n| a | b |\n|---|---|\n| 1 | 2 |\n"
    (tmp_path / "RESULTS.md").write_text("# old results\n\n## Stale section\n\n" + kept)
    run_all.main(["--only", "kernels", "--bench-dir", str(bench), "--output-dir", str(tmp_path)])
    text = (tmp_path / "RESULTS.md").read_text()
    assert text.startswith("# bnfuse benchmark results\n") and "Stale section" not in text
    assert "## Kernels" in text and text.endswith("\n" + kept)
    run_all.main(["--only", "kernels", "--bench-dir", str(bench), "--output-dir", str(tmp_path)])
    assert (tmp_path / "RESULTS.md").read_text().count(run_all.KEPT_MARKER) == 1
