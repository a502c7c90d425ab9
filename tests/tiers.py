"""The suite's three tiers, given to every test from what it uses: `unit` (no process, no server),
`integration` (real Redis, S3, workers, stubs), `e2e` (vLLM, transformers serve, the real model, the
stack, a browser). `make check` runs `unit`; `make test` runs all three. A unit test that starts a
process fails, naming the tier it belongs to, so the claim "unit = no process" is checked on every run."""

from __future__ import annotations

import subprocess

import pytest

TIERS = ("unit", "integration", "e2e")

# Fixtures (tests/conftest.py and the modules') that start a server or a worker of their own.
E2E_FIXTURES = {"tiny_server", "smollm2_target", "vllm_server", "extract_service", "services"}
INTEGRATION_FIXTURES = {"redis_server", "s3_server", "stub_server", "workers"}
# Modules whose tests start vLLM, Docker or a browser through module-level helpers.
E2E_MODULES = {"test_compose_e2e", "test_dashboard", "test_pipeline", "test_real_model", "test_storage_modes",
               "test_vllm_backend", "test_vllm_serve", "test_extract_server", "test_extract_server_lifetime",
               "test_verify_stage", "test_faults", "test_real_target", "test_learning_curve"}


def tier_of(item: pytest.Item) -> str:
    marked = [tier for tier in TIERS if item.get_closest_marker(tier)]
    if marked:
        return marked[-1]
    module = item.module.__name__.rsplit(".", 1)[-1] if item.module else ""
    names = set(item.fixturenames)
    if module in E2E_MODULES or names & E2E_FIXTURES:
        return "e2e"
    if names & INTEGRATION_FIXTURES or module in INTEGRATION_MODULES:
        return "integration"
    return "unit"


# Modules whose tests start processes of their own (the CLI, docker compose config, helm-like
# renderers, stub servers) without one of the fixtures above.
INTEGRATION_MODULES = {"test_compose", "test_gpu_checks", "test_readme",
                       "test_train_units"}  # speculators' trainer runs `git rev-parse` as it starts


def pytest_configure(config: pytest.Config) -> None:
    for tier in TIERS:
        config.addinivalue_line("markers", f"{tier}: the {tier} tier (tests/tiers.py)")


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
                                 "@pytest.mark.integration (or list its module in tests/tiers.py)")

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
