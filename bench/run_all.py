"""Run every bnfuse benchmark and write bench/RESULTS.md plus plots, in one command.

    python bench/run_all.py [--quick] [--only optimize,kernels,...]

Each ``bench/bench_<topic>.py`` present is imported and its ``run(quick)`` called (see bench/common.py for
the Section contract). A module that is absent is listed as missing; one that raises is listed as failed
with its error, and the others still run. RESULTS.md gets the machine, the date and the exact command,
then every Section's markdown. Plots (matplotlib, Agg), from the sections' raw series:

- pass_time.png from the optimize section's ``series["pass_time"]``: a list of (parameter bytes, seconds)
  pairs, or a dict {label: [(bytes, seconds), ...]} for several lines;
- kernel_bandwidth.png from the kernels section's ``series["kernel_sweep"]``: a dict {label: [(bytes
  moved, seconds), ...]} (or one such list), with the memory-bandwidth line drawn from
  ``series["bandwidth_gbs"]`` (GB/s measured on the same machine) when the section provides it.

Every file is written atomically (temporary file in the same directory, then a rename).

README.md's results table is RESULTS.md's summary table, copied (``sync_readme``) after every run that writes
RESULTS.md, or alone with ``python bench/run_all.py --sync-readme`` after RESULTS.md was edited by hand; a run of
some topics (``--only``) replaces only their rows of the summary. tests/test_readme.py checks the two agree.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import shlex
import sys
import tempfile
import textwrap
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

BENCH_DIR = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH_DIR.parent))

from bench.common import Section, machine_description, markdown_table  # noqa: E402

README = BENCH_DIR.parent / "README.md"
README_MARKERS = ("<!-- results-table -->", "<!-- /results-table -->")
# RESULTS.md from this line on is measured by scripts that need more than CI installs (bench/bn_left.py: the
# `keras` extra): run_all keeps it as it is, below its own sections.
KEPT_MARKER = "<!-- kept by run_all.py: sections measured by other scripts -->"
TOPICS = ("optimize", "memory", "kernels", "ortops", "training")  # in report order; other bench_*.py files follow
PLOTS = {
    "pass_time.png": ("optimize", "pass_time"),
    "kernel_bandwidth.png": ("kernels", "kernel_sweep"),
}
Points = list[tuple[float, float]]


@dataclass
class Outcome:
    topic: str
    status: str  # "ok", "missing" or "failed"
    section: Section | None = None
    error: str | None = None
    seconds: float = 0.0


def discover(bench_dir: Path) -> list[str]:
    """The known topics, then any other bench_<topic>.py in ``bench_dir``, alphabetically."""
    found = sorted(p.stem.removeprefix("bench_") for p in bench_dir.glob("bench_*.py"))
    return [*TOPICS, *(t for t in found if t not in TOPICS)]


def run_topic(topic: str, bench_dir: Path, quick: bool) -> Outcome:
    path = bench_dir / f"bench_{topic}.py"
    if not path.exists():
        return Outcome(topic, "missing", error=f"{_display(path)} not present")
    start = time.perf_counter()
    try:
        module = _load(path, topic)
        section = module.run(quick=quick)
        if not all(isinstance(getattr(section, a, None), str) for a in ("title", "command", "markdown")):
            raise TypeError(f"run() returned {type(section).__name__}, not a bench.common.Section")
    except (Exception, SystemExit) as exc:  # a broken benchmark must not take the report down
        traceback.print_exc(file=sys.stderr)
        first = (str(exc).strip().splitlines() or [""])[0][:300]
        error = f"{type(exc).__name__}: {first}" if first else type(exc).__name__
        return Outcome(topic, "failed", error=error, seconds=time.perf_counter() - start)
    return Outcome(topic, "ok", section=section, seconds=time.perf_counter() - start)


def _load(path: Path, topic: str) -> Any:
    spec = importlib.util.spec_from_file_location(f"bnfuse_bench_{topic}", path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot import {path}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses and pickling look modules up by name
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[spec.name]
        raise
    return module


def render(
    outcomes: Sequence[Outcome],
    *,
    command: str,
    machine: str,
    date: str,
    plots: dict[str, str],
    kept: str = "",
    summary: str | None = None,
) -> str:
    """RESULTS.md: header, the summary (default: the outcomes' targets), each section, what did not run, the plots
    (name -> note or '' if written), then ``kept`` (the previous file's text from KEPT_MARKER on) unchanged."""
    lines = [
        "# bnfuse benchmark results",
        "",
        f"- Command: `{command}`",
        f"- Machine: {machine}",
        f"- Date: {date}",
        "- Sections: "
        + ", ".join(
            f"{o.topic} ({o.status}{f', {o.seconds:.0f} s' if o.status != 'missing' else ''})" for o in outcomes
        ),
        "",
    ]
    summary = summary_table(outcomes) if summary is None else summary
    if summary:
        lines += ["## Summary", "", summary, ""]
    for outcome in outcomes:
        if outcome.section is not None:
            section = outcome.section
            lines += [f"## {section.title}", "", f"`{section.command}`", "", section.markdown.strip(), ""]
    not_run = [o for o in outcomes if o.status != "ok"]
    if not_run:
        lines += ["## Not run", ""]
        lines += [f"- {o.topic}: {o.status} ({o.error})" for o in not_run]
        lines.append("")
    if plots:
        lines += ["## Plots", ""]
        for name, note in plots.items():
            lines.append(f"![{name}]({name})" if not note else f"- {name}: not written ({note})")
        lines.append("")
    text = "\n".join(lines)
    return f"{text}\n{kept}" if kept else text


def kept_sections(results: Path) -> str:
    """The text of ``results`` from KEPT_MARKER on ('' when the file or the marker is absent)."""
    text = results.read_text() if results.exists() else ""
    return text[text.index(KEPT_MARKER) :] if KEPT_MARKER in text else ""


def summary_table(outcomes: Sequence[Outcome]) -> str:
    """Every section's headline targets in one table ('' when none): what README.md shows."""
    rows = [
        [o.topic, t.what, f"{t.value:.2f}{t.unit}", f"<= {t.limit:g}{t.unit}", "yes" if t.met else "**no**"]
        for o in outcomes
        if o.section is not None
        for t in o.section.targets
    ]
    if not rows:
        return ""
    return markdown_table(["benchmark", "figure (x: bnfuse time / peer time)", "measured", "target", "met"], rows)


def summary_of(results_text: str) -> str:
    """The summary table of a RESULTS.md text ('' when it has none)."""
    if "\n## Summary\n" not in results_text:
        return ""
    rest = results_text.split("\n## Summary\n", 1)[1].lstrip("\n")
    table = []
    for line in rest.splitlines():
        if not line.startswith("|"):
            break
        table.append(line)
    return "\n".join(table)


def merged_summary(previous: str, fresh: str, topics: Sequence[str]) -> str:
    """``previous`` summary table with the rows of ``topics`` (those just run) replaced by ``fresh``'s, in place
    (a topic new to the table: its rows at the end)."""
    if not previous:
        return fresh
    header, old_rows = previous.splitlines()[:2], previous.splitlines()[2:]
    new_rows = fresh.splitlines()[2:] if fresh else []
    run = set(topics)

    def topic(row: str) -> str:
        return row.strip("|").split("|", 1)[0].strip()

    rows: list[str] = []
    placed: set[str] = set()
    for row in old_rows:
        name = topic(row)
        if name not in run:
            rows.append(row)
        elif name not in placed:
            placed.add(name)
            rows += [r for r in new_rows if topic(r) == name]
    rows += [r for r in new_rows if topic(r) not in placed]
    return "\n".join(header + rows) if rows else ""


def sync_readme(readme: Path, results: Path) -> bool:
    """Put RESULTS.md's summary table between README's result markers; False (file untouched) when either is
    missing."""
    if not readme.exists() or not results.exists():
        return False
    results_text = results.read_text()
    table = summary_of(results_text)
    text = readme.read_text()
    start, end = README_MARKERS
    if not table or start not in text or end not in text.split(start, 1)[1]:
        return False
    prefix = "- Machine: "
    machine = next((line[len(prefix) :] for line in results_text.splitlines() if line.startswith(prefix)), "")
    before, rest = text.split(start, 1)
    after = rest.split(end, 1)[1]
    intro = (
        f"The summary of [bench/RESULTS.md](bench/RESULTS.md){f' ({machine})' if machine else ''}, copied by "
        "`python bench/run_all.py` (`--sync-readme`: copy only); RESULTS.md's header gives each row's run, command "
        "and date:"
    )
    body = textwrap.fill(intro, width=120, break_long_words=False, break_on_hyphens=False) + f"\n\n{table}"
    new = f"{before}{start}\n{body}\n{end}{after}"
    if new != text:
        write_text(readme, new)
    return True


# ----- plots --------------------------------------------------------------------------------------


def _lines(value: Any) -> dict[str, Points]:
    """A series as {label: [(x, y), ...]}: accepts one list of pairs or a dict of them."""
    if isinstance(value, dict):
        groups = value
    elif isinstance(value, list | tuple):
        groups = {"": value}
    else:
        raise TypeError(f"expected a list of (x, y) pairs or a dict of them, got {type(value).__name__}")
    result = {}
    for label, points in groups.items():
        pairs = [(float(x), float(y)) for x, y in points]
        if pairs:
            result[str(label)] = sorted(pairs)
    if not result:
        raise ValueError("no points")
    return result


def plot_pass_time(series: dict[str, Any], path: Path) -> None:
    lines = _lines(series["pass_time"])

    def draw(ax: Any) -> None:
        for label, points in lines.items():
            mb = [x / 1e6 for x, _ in points]
            ax.plot(mb, [y * 1e3 for _, y in points], "o-", label=label or "bnfuse optimize (in memory)")
        ax.set_xlabel("model parameters (MB)")
        ax.set_ylabel("pass time (ms)")
        ax.set_title("BatchNormalization folding time against model size")

    _save_plot(draw, path)


def plot_kernel_bandwidth(series: dict[str, Any], path: Path) -> None:
    sweep = series["kernel_sweep"]
    bandwidth = series.get("bandwidth_gbs")
    if isinstance(sweep, dict) and "lines" in sweep:  # {"lines": {...}, "bandwidth_gbs": x}
        bandwidth = sweep.get("bandwidth_gbs", bandwidth)
        sweep = sweep["lines"]
    lines = _lines(sweep)

    def draw(ax: Any) -> None:
        for label, points in lines.items():
            ax.plot([x / 1e6 for x, _ in points], [y * 1e3 for _, y in points], "o-", label=label or "kernel")
        if bandwidth:
            xs = sorted({x for points in lines.values() for x, _ in points})
            ax.plot(
                [x / 1e6 for x in xs], [x / (float(bandwidth) * 1e9) * 1e3 for x in xs], "k--",
                label=f"measured copy bandwidth {float(bandwidth):.1f} GB/s (read + write)",
            )  # fmt: skip
        ax.set_xlabel("bytes moved (MB)")
        ax.set_ylabel("kernel time (ms)")
        ax.set_title("BatchNormalization kernel time against tensor size")

    _save_plot(draw, path)


def _save_plot(draw: Callable[[Any], None], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=100)
    try:
        draw(ax)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.grid(True, which="both", alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend()
        fig.tight_layout()
        _atomic(path, lambda handle: fig.savefig(handle, format="png"))
    finally:
        plt.close(fig)


PLOTTERS: dict[str, Callable[[dict[str, Any], Path], None]] = {
    "pass_time.png": plot_pass_time,
    "kernel_bandwidth.png": plot_kernel_bandwidth,
}


def make_plots(outcomes: Sequence[Outcome], out_dir: Path) -> dict[str, str]:
    """Write each plot whose section ran; name -> '' when written, else why not."""
    sections = {o.topic: o for o in outcomes}
    notes = {}
    for name, (topic, key) in PLOTS.items():
        outcome = sections.get(topic)
        if outcome is None:
            continue  # not asked for (--only)
        if outcome.section is None:
            notes[name] = f"{topic} benchmark {outcome.status}"
        elif key not in outcome.section.series:
            notes[name] = f"the {topic} section has no series['{key}']"
        else:
            try:
                PLOTTERS[name](outcome.section.series, out_dir / name)
                notes[name] = ""
            except Exception as exc:  # a malformed series costs its plot, not the report
                notes[name] = f"series['{key}'] unusable: {type(exc).__name__}: {exc}"
    return notes


# ----- files --------------------------------------------------------------------------------------


def _atomic(path: Path, write: Callable[[Any], None]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as handle:
            write(handle)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_text(path: Path, text: str) -> None:
    _atomic(path, lambda handle: handle.write(text.encode()))


def _display(path: Path) -> str:
    try:
        return str(path.resolve().relative_to(Path.cwd()))
    except ValueError:
        return str(path)


# ----- entry point --------------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer repeats and sizes (each module's quick mode)")
    parser.add_argument("--only", metavar="TOPIC,...", help="run only these topics (e.g. optimize,kernels)")
    parser.add_argument("--bench-dir", type=Path, default=BENCH_DIR, help=argparse.SUPPRESS)
    parser.add_argument("--output-dir", type=Path, default=None, help="where RESULTS.md and plots go (default: bench/)")
    parser.add_argument(
        "--readme", type=Path, default=None, help="README whose results table to update (default: the project's, "
        "when writing to bench/; never with --quick)",
    )  # fmt: skip
    parser.add_argument(
        "--sync-readme", action="store_true", help="only copy RESULTS.md's summary into the README's results table"
    )
    args = parser.parse_args(argv)
    argv = list(sys.argv[1:] if argv is None else argv)
    bench_dir: Path = args.bench_dir
    out_dir: Path = args.output_dir or bench_dir
    results = out_dir / "RESULTS.md"
    readme: Path | None = args.readme if args.readme is not None else (README if out_dir == BENCH_DIR else None)
    if args.sync_readme:
        if readme is None or not sync_readme(readme, results):
            print(f"run_all: no summary in {_display(results)} or no results markers in the README", file=sys.stderr)
            return 1
        print(f"run_all: copied the summary of {_display(results)} into {_display(readme)}", file=sys.stderr)
        return 0
    topics = discover(bench_dir)
    if args.only:
        wanted = [t.strip().removeprefix("bench_") for t in args.only.split(",") if t.strip()]
        unknown = [t for t in wanted if t not in topics]
        if unknown:
            print(f"run_all: unknown topic(s) {', '.join(unknown)} (known: {', '.join(topics)})", file=sys.stderr)
            return 2
        topics = [t for t in topics if t in wanted]

    start = time.perf_counter()
    outcomes = []
    for topic in topics:
        print(f"run_all: {topic} ...", file=sys.stderr, flush=True)
        outcome = run_topic(topic, bench_dir, args.quick)
        detail = f": {outcome.error}" if outcome.error else f" in {outcome.seconds:.0f} s"
        print(f"run_all: {topic} {outcome.status}{detail}", file=sys.stderr, flush=True)
        outcomes.append(outcome)

    plots = make_plots(outcomes, out_dir)
    date = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    command = shlex.join(["python", "bench/run_all.py", *argv])
    machine = machine_description()
    kept = kept_sections(results)
    summary = summary_table(outcomes)
    if args.only:  # the other topics' rows stay
        summary = merged_summary(summary_of(results.read_text()) if results.exists() else "", summary, topics)
    write_text(
        results,
        render(outcomes, command=command, machine=machine, date=date, plots=plots, kept=kept, summary=summary),
    )
    print(f"run_all: wrote {_display(results)} in {time.perf_counter() - start:.0f} s", file=sys.stderr)
    if readme is not None and not args.quick and sync_readme(readme, results):
        print(f"run_all: copied the summary into the results table of {_display(readme)}", file=sys.stderr)
    return 1 if any(o.status == "failed" for o in outcomes) else 0


if __name__ == "__main__":
    sys.exit(main())
