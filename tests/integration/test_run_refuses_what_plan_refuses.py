"""`eyrie run` and POST /runs refuse, before anything is written or enqueued, whatever `eyrie run
--plan` refuses, with the same message: one decision for both (issue 41, item 5)."""

import os

import pytest
import redis
from fastapi.testclient import TestClient

from eyrie.api.app import create_app
from eyrie.core.config import load_settings
from eyrie.stages.run_config import load_config
from eyrie.data.manifest import config_key
from eyrie.data.store import open_store
from eyrie.work import keys
from tests.support.harness import TRAIN_PROMPTS, eyrie_in_process, plan_env, seed_variant, tiny_run_config


@pytest.fixture
def planning_env(tmp_path, redis_url, monkeypatch) -> dict:
    """plan_env with the test's Redis, applied to this process too (the API runs in it)."""
    env = plan_env(tmp_path, EYRIE_REDIS_URL=redis_url)
    for name in [k for k in os.environ if k.startswith("EYRIE_")]:
        monkeypatch.delenv(name)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    return env


def _api_start(tmp_path, path: str):
    settings = load_settings(api_token="tok", api_dataset_roots=f"{tmp_path},{TRAIN_PROMPTS.parent}")
    client = TestClient(create_app(settings))
    return client.post("/runs", json=load_config(path).model_dump(), headers={"Authorization": "Bearer tok"})


def _nothing_started(env: dict, run: str) -> None:
    conn = redis.Redis.from_url(env["EYRIE_REDIS_URL"])
    assert not conn.keys("rq:*") and not conn.smembers(keys.ACTIVE_PIPELINES) and not conn.smembers(keys.RUNS)
    assert not open_store(load_settings()).exists(config_key(run))


def test_the_seed_offline_without_a_mean_is_refused_by_run_and_the_api_as_by_plan(planning_env, tmp_path):
    """The issue's case: extract.storage offline over a 2.8 TB budget at the upper bound, and no
    plan.mean_tokens to show it fits (a hub dataset --plan does not read). `--plan` refuses it;
    `eyrie run` started ~11 h of generation before extract refused."""
    config = seed_variant(tmp_path, "seed-offline", plan={"mean_tokens": None}, extract={"storage": "offline"})
    plan = eyrie_in_process("run", "--config", config, "--plan", env=planning_env, check=False)
    assert plan.returncode == 1 and "plan.mean_tokens" in plan.stderr, plan.stderr
    run = eyrie_in_process("run", "--config", config, env=planning_env, check=False)
    assert run.returncode == 1 and run.stderr == plan.stderr, run.stderr
    reply = _api_start(tmp_path, config)
    assert reply.status_code == 400, reply.text
    assert f"eyrie: error: {reply.json()['detail']} Fix: {reply.json()['fix']}\n" == plan.stderr
    _nothing_started(planning_env, "kimi-k25-perfectblend")


def test_a_run_whose_plan_cannot_be_made_here_is_refused_before_it_starts(planning_env, tmp_path):
    """A target whose config this host cannot read and whose shape the config does not give: --plan
    cannot size it and says so; the API started it (202) and its planning failed afterwards."""
    config = tiny_run_config(tmp_path, "unsized", target={"model": "nobody/not-cached-here"})
    plan = eyrie_in_process("run", "--config", config, "--plan", env=planning_env, check=False)
    assert plan.returncode == 1 and "target.shape" in plan.stderr, plan.stderr
    reply = _api_start(tmp_path, config)
    assert reply.status_code == 400 and "target.shape" in reply.json()["fix"], reply.text
    assert f"eyrie: error: {reply.json()['detail']} Fix: {reply.json()['fix']}\n" == plan.stderr
    _nothing_started(planning_env, "unsized")
