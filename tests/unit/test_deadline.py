"""The helpers' waits end before pytest's timeout (issue 41, item 11): a wait asked for longer than
the test may run fails with its own message (and, for a process, its stacks) instead of pytest-timeout
stopping the test inside it, as a 600 s wait in a 600 s test did."""

import time

import pytest

from tests.support.deadline import HELPER_MARGIN_S
from tests.support.harness import wait_for

LIMIT_S = HELPER_MARGIN_S + 5


@pytest.mark.timeout(LIMIT_S)
def test_a_helpers_wait_longer_than_the_test_may_run_ends_first_naming_what_it_waited_for():
    started = time.monotonic()
    with pytest.raises(AssertionError, match="waiting for a thing that never comes"):
        wait_for(lambda: False, "a thing that never comes", timeout=600, every=0.1)
    assert time.monotonic() - started < LIMIT_S - HELPER_MARGIN_S + 1
