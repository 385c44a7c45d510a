"""Test-wide settings: CI runs hypothesis derandomized, so a red run is reproducible from the same commit."""

import os
import tempfile

import pytest
from hypothesis import settings

settings.register_profile("ci", derandomize=True, print_blob=True)
if os.environ.get("HYPOTHESIS_PROFILE"):
    settings.load_profile(os.environ["HYPOTHESIS_PROFILE"])

REPORT = pytest.StashKey[list]()


# bnfuse train's graph cache (bnfuse/training/graph_cache.py) in a folder of this run, not the user's ~/.cache
os.environ.setdefault("BNFUSE_CACHE_DIR", tempfile.mkdtemp(prefix="bnfuse-test-cache-"))


def pytest_configure(config):
    config.stash[REPORT] = []


@pytest.fixture
def report_lines(request) -> list:
    """Lines a test wants in the run's terminal summary (e.g. measured kernel errors)."""
    return request.config.stash[REPORT]


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    lines = config.stash.get(REPORT, [])
    if lines:
        terminalreporter.section("bnfuse reports")
        for line in lines:
            terminalreporter.write_line(line)
