"""The pipeline's plan-extract and fetch tasks, run in this process through the one executor
(eyrie.tasks.executor.execute) on real Redis and a real store: their results, a refusal blocking the
run, and payloads with more than the run refused before anything runs."""

import pytest
import redis
from pydantic import ValidationError

from conftest import TINY, tiny_run_config
from eyrie.core.config import load_settings
from eyrie.data.store import open_store
from eyrie.runs.pipeline import load_config, save_config
from eyrie.tasks.executor import Context, execute
from eyrie.work import keys
from eyrie_extractor.plan import PlanExtract
from eyrie_trainer.plan import FetchBase
from legacy_drafter import build_legacy_drafter

pytestmark = pytest.mark.parametrize("store_env", ["file"], indirect=True)


@pytest.fixture
def ctx(env, tmp_path, monkeypatch) -> Context:
    monkeypatch.setenv("EYRIE_CACHE_DIR", str(tmp_path / "cache"))
    settings = load_settings()
    return Context(settings, redis.Redis.from_url(env["EYRIE_REDIS_URL"]), open_store(settings))


def pipeline(ctx: Context, tmp_path, run: str, **sections) -> None:
    save_config(ctx.conn, ctx.store, load_config(tiny_run_config(tmp_path, run, **sections)))


def blocked(ctx: Context, run: str) -> str | None:
    text = ctx.conn.get(keys.blocked(run))
    return text.decode() if text else None


def test_fetch_without_a_base_has_nothing_to_do(ctx, tmp_path):
    pipeline(ctx, tmp_path, "nobase")
    assert execute(FetchBase, {"run": "nobase"}, ctx) == {"status": "no_base"}
    assert execute(FetchBase, {"run": "no-pipeline"}, ctx) == {"status": "no_base"}


def test_fetch_readies_a_fitting_base_and_blocks_the_run_on_one_that_does_not_fit(ctx, tmp_path):
    legacy = build_legacy_drafter(tmp_path / "legacy", TINY)
    pipeline(ctx, tmp_path, "fits", train={"base": str(legacy)})
    ready = execute(FetchBase, {"run": "fits"}, ctx)
    assert ready["status"] == "ready" and ready["legacy"] and ready["aux_layers"] == [2, 4, 5], ready
    assert ready["path"].startswith(str(tmp_path / "cache" / "base")) and blocked(ctx, "fits") is None

    narrow = build_legacy_drafter(tmp_path / "narrow", TINY, hidden_size=32)
    pipeline(ctx, tmp_path, "misfit", train={"base": str(narrow)})
    refused = execute(FetchBase, {"run": "misfit"}, ctx)
    assert refused["status"] == "refused" and "hidden size 32 (base) vs 64 (target)" in refused["error"]
    assert "hidden size 32 (base) vs 64 (target)" in blocked(ctx, "misfit")


def test_plan_extract_refused_blocks_the_run(ctx, tmp_path):
    pipeline(ctx, tmp_path, "unplanned")  # a config kept, no run manifest: nothing generated to plan from
    result = execute(PlanExtract, {"run": "unplanned"}, ctx)
    assert result["run"] == "unplanned" and result["status"] == "refused" and "unknown run" in result["error"]
    assert result["error"] == blocked(ctx, "unplanned")


@pytest.mark.parametrize("stage", [PlanExtract, FetchBase])
@pytest.mark.parametrize("payload", [{"run": "r1", "shard": 0}, {"run": "r1", "request": {}}, {"run": "../r1"}, {}])
def test_a_payload_with_more_than_a_valid_run_is_refused_unrun(ctx, stage, payload):
    with pytest.raises(ValidationError):
        execute(stage, payload, ctx)
    assert blocked(ctx, "r1") is None
