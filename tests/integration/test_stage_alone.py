"""A stage started on its own is a run of that stage alone (issue 42 item 2): its config is kept naming
it, its planner plans it from that config, status says so, nothing after it starts by itself, and
`eyrie run` on it later continues it as a whole pipeline. In process: real Redis, a file store, the
tiny target's prompts; generate's planning runs here (no worker is up)."""

import pytest
import redis

from eyrie.core.config import load_settings
from eyrie.core.stage_settings import GenerateSettings
from eyrie.data.store import open_store
from eyrie.runs.control import await_planned, start_pipeline, start_stage
from eyrie.runs.status import run_status
from eyrie.stages import PIPELINE, PLAN_GENERATE
from eyrie.stages.generate import Generate
from eyrie.stages.run_config import load_config, stored_config
from eyrie.work import keys
from eyrie.work.queue import job_state
from tests.support.harness import tiny_run_config

pytestmark = pytest.mark.parametrize("store_env", ["file"], indirect=True)


def test_a_stage_alone_is_a_run_of_it_and_eyrie_run_makes_it_a_pipeline(env, tmp_path):
    cfg = load_config(tiny_run_config(tmp_path, "alone", dataset={"limit": 8}))
    settings = load_settings(model=cfg.target.model)
    conn, store = redis.Redis.from_url(env["EYRIE_REDIS_URL"]), open_store(settings)

    given = GenerateSettings(**cfg.generate.given())  # `eyrie generate --concurrency 8 --max-tokens 64 ...`
    planned = await_planned(conn, store, "alone", start_stage(settings, conn, store, "alone", Generate.name, given,
                                                              cfg.dataset))
    kept = stored_config(store, "alone")
    assert kept.stages == ["generate"] and kept.generate.given() == cfg.generate.given()
    assert planned.enqueued == len(planned.manifest.generate_shards) > 0
    status = run_status(conn, store, "alone")
    assert status.pipeline.stages == ["generate"] and list(status.stages) == ["generate"]
    assert conn.sismember(keys.ACTIVE_PIPELINES, "alone")

    start_pipeline(settings, conn, store, cfg)  # the same run, now as a whole pipeline: planned again, checked
    assert stored_config(store, "alone").stages is None
    assert run_status(conn, store, "alone").pipeline.stages == [s.name for s in PIPELINE]
    assert job_state(conn, PLAN_GENERATE.task_id("alone")) == "queued"
