"""Shared helpers for bnfuse benchmarks: median timing and a description of the machine.

Every benchmark module `bench/bench_<topic>.py` exposes ``run(quick: bool = False) -> Section``;
`bench/run_all.py` gathers the sections into bench/RESULTS.md and the plots.
"""

from __future__ import annotations

import datetime as _dt
import os
import platform
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Target:
    """A headline figure and the most it may be: a time ratio bnfuse / peer measured side by side (unit "x"),
    or an absolute cost such as per-call overhead (unit "µs")."""

    what: str
    value: float
    limit: float
    unit: str = "x"

    @property
    def met(self) -> bool:
        return self.value <= self.limit


@dataclass
class Section:
    """One benchmark's results: a markdown table, raw series for plots, and its headline targets."""

    title: str
    command: str
    markdown: str
    series: dict[str, Any] = field(default_factory=dict)
    targets: list[Target] = field(default_factory=list)


def median_seconds(fn: Callable[[], object], *, repeat: int = 7, warmup: int = 1) -> float:
    """Median wall time of ``fn()`` over ``repeat`` calls after ``warmup`` untimed calls."""
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def interleaved_medians(fns: dict[str, Callable[[], object]], *, repeat: int = 7, warmup: int = 1) -> dict[str, float]:
    """Median times of several contenders measured round-robin, so machine noise hits all alike."""
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    samples: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeat):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            samples[name].append(time.perf_counter() - start)
    return {name: statistics.median(values) for name, values in samples.items()}


def machine_description() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as info:
            for line in info:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return f"{cpu}, {os.cpu_count()} cores, Python {platform.python_version()}, {platform.system()}"


def today() -> str:
    return _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d")


def markdown_table(header: list[str], rows: list[list[object]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    return "\n".join(lines)


def main(run: Callable[..., Section], description: str) -> None:
    """Command line of one benchmark module: ``[--quick]``, prints its section as RESULTS.md would."""
    import argparse
    import sys

    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--quick", action="store_true", help="small sizes and few rounds (smoke run)")
    start = time.perf_counter()
    section = run(quick=parser.parse_args().quick)
    print(f"## {section.title}\n\n`{section.command}`\n\n{section.markdown}\n")
    print(f"(benchmark took {time.perf_counter() - start:.0f} s)", file=sys.stderr)
