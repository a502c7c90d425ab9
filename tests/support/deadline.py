"""The helpers' waits end before pytest-timeout ends the test (pyproject's `timeout`, or the test's
own mark): a wait that hangs then fails with its own report (what it waited for; the stacks of the
processes it waited on: harness.eyrie, the workers fixture), where pytest's stop would show only
this process's stacks and cut the test short of them."""

from __future__ import annotations

import time

import pytest

HELPER_MARGIN_S = 30.0  # a helper's wait ends this long before pytest-timeout would end the test
_deadline: list[float] = []  # when pytest-timeout ends the running test (time.monotonic()), while it runs
FAILED = pytest.StashKey[bool]()  # a phase of the test failed (its fixtures' teardown reads it)


@pytest.hookimpl(tryfirst=True)
def pytest_timeout_set_timer(item, settings):
    _deadline[:] = [time.monotonic() + settings.timeout]


@pytest.hookimpl(tryfirst=True)
def pytest_timeout_cancel_timer(item):
    _deadline.clear()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    report = yield
    if report.failed:
        item.stash[FAILED] = True
    return report


def bounded(timeout: float) -> float:
    """`timeout`, cut to end HELPER_MARGIN_S before pytest-timeout ends the running test."""
    if not _deadline:
        return timeout
    return max(1.0, min(timeout, _deadline[0] - time.monotonic() - HELPER_MARGIN_S))
