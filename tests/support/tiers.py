"""The suite's three tiers: `unit` (no process, no server), `integration` (real Redis, S3, workers,
stubs), `e2e` (vLLM, transformers serve, the real model, the stack, a browser). A test's tier is its
folder's (tests/unit, tests/integration, tests/e2e), raised by a fixture that starts a server or a
worker of a higher tier, or the one its own mark names. `make check` runs `unit`; `make test` runs
all three. A unit test that starts a process fails, naming the tier it belongs to, so the claim
"unit = no process" is checked on every run."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

TIERS = ("unit", "integration", "e2e")

# Fixtures (tests/conftest.py and the modules') that start a server or a worker of their own.
E2E_FIXTURES = {"tiny_server", "smollm2_target", "vllm_server", "extract_service", "services"}
INTEGRATION_FIXTURES = {"redis_server", "s3_server", "stub_server", "workers"}
TESTS = Path(__file__).resolve().parents[1]


def folder_tier(path: Path) -> str:
    """The tier a test module's folder names: tests/<tier>/..."""
    folder = Path(path).resolve().relative_to(TESTS).parts[0]
    if folder not in TIERS:
        raise pytest.UsageError(f"{path}: a test module belongs in one of tests/{{{','.join(TIERS)}}}/")
    return folder


def tier_of(item: pytest.Item) -> str:
    marked = [tier for tier in TIERS if item.get_closest_marker(tier)]
    if marked:
        return marked[-1]
    names = set(item.fixturenames)
    by_fixtures = "e2e" if names & E2E_FIXTURES else "integration" if names & INTEGRATION_FIXTURES else "unit"
    return max(folder_tier(item.path), by_fixtures, key=TIERS.index)


def pytest_configure(config: pytest.Config) -> None:
    for tier in TIERS:
        config.addinivalue_line("markers", f"{tier}: the {tier} tier (tests/support/tiers.py)")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        tier = tier_of(item)
        if not item.get_closest_marker(tier):
            item.add_marker(getattr(pytest.mark, tier))
        item.user_properties.append(("tier", tier))  # in --junitxml's report: scripts/suite_profile.py


class _NoProcess:
    """Popen for the length of one unit test: refuses, naming the test's tier as the fix."""

    def __init__(self, nodeid: str):
        self.nodeid, self.original = nodeid, subprocess.Popen.__init__

    def __enter__(self):
        nodeid = self.nodeid

        def refuse(popen, args, *rest, **kwargs):
            raise AssertionError(f"{nodeid} is in the unit tier but started a process ({args!r}): mark it "
                                 "@pytest.mark.integration (or move its module to tests/integration/)")

        subprocess.Popen.__init__ = refuse
        return self

    def __exit__(self, *exc):
        subprocess.Popen.__init__ = self.original


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item: pytest.Item):
    if tier_of(item) != "unit":
        yield
        return
    with _NoProcess(item.nodeid):
        yield
