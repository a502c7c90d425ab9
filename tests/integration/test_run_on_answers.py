"""A run on a published answers set (issue 43, item 6): a run config whose dataset is what `eyrie publish
--with-answers` wrote (a directory, or a dataset on the hub) starts at extraction on the same target: nothing is
generated, no inference server is up, and the run manifest names where the answers came from; a set another target
(or revision) answered is refused before anything is written. Real Redis and a file store; the publishing run is
test_publish's finished run (another store: another host), its answers the tiny target's own token ids. The hub is
tests/support/hub_stub.py, a local stand-in for huggingface.co (not reachable from here)."""

from __future__ import annotations

import json

import orjson
import pytest
import redis

from eyrie.core.config import load_settings
from eyrie.core.errors import EyrieError
from eyrie.stages.run_config import load_config
from eyrie.core.target import describe, load_tokenizer
from eyrie.data.manifest import Layout, ShardManifest, TargetRef, load_run_manifest
from eyrie.data.store import open_store
from eyrie.runs.control import pipeline_started, start_and_plan, start_pipeline
from eyrie.runs.pipeline import run_job_ids
from eyrie.runs.plan_lines import render
from eyrie.runs.projection import project
from eyrie.stages import PIPELINE
from eyrie.work import keys
from eyrie.work.queue import job_state
from eyrie_trainer.card import prompts_license
from eyrie_trainer.publish import publish
from tests.support.harness import OFFLINE, TINY, eyrie, tiny_run_config
from tests.unit.test_publish import RUN, REPO, TOKEN, finished_run, set_manifest

pytestmark = pytest.mark.parametrize("store_env", ["file"], indirect=True)
SAMPLES = 12


def tiny_records(n: int) -> list[dict]:
    """Generate records of the tiny target as the generator writes them: its chat template's prompt ids, an answer's
    ids and its end-of-turn token."""
    tokenizer = load_tokenizer(str(TINY))
    records = []
    for i in range(n):
        messages = [{"role": "user", "content": f"Count from {i} to {i + 5}, please."}]
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        prompt = tokenizer.encode(text, add_special_tokens=False)
        answer = " ".join(str(k) for k in range(i, i + 6)) + " and that is all of them."
        completion = [*tokenizer.encode(answer, add_special_tokens=False), tokenizer.eos_token_id]
        records.append({"sample_id": f"s{i}", "row": i, "status": "done", "messages": messages, "reasoning": None,
                        "content": answer, "finish_reason": "stop", "prompt_token_ids": list(prompt),
                        "completion_token_ids": completion})
    return records


def published(tmp_path, model: str = str(TINY)):
    """The finished run of another host, its answers the tiny target's, published with --with-answers into DIR."""
    store = finished_run(tmp_path / "elsewhere")
    layout, manifest = Layout(RUN), load_run_manifest(store, RUN)
    records = tiny_records(SAMPLES)
    answers = store.put_bytes(layout.generate_shard(0), b"".join(orjson.dumps(r) + b"\n" for r in records))
    shard = ShardManifest.model_validate(store.get_json(layout.generate_shard_manifest(0)))
    shard.object, shard.sha256 = answers.key, answers.sha256
    store.put_json(layout.generate_shard_manifest(0), shard.model_dump())
    info = describe(model)
    generate = manifest.generate.model_copy(update={"sampling": manifest.generate.sampling.model_copy(
        update={"max_tokens": 64})})  # tiny_run_config's
    set_manifest(store, generate=generate, dataset=manifest.dataset.model_copy(update={"row_end": SAMPLES}),
                 target=TargetRef(
        model=info.model, revision=info.revision, chat_template_sha256=info.chat_template_sha256, server="vllm"))
    publish(store, RUN, to=tmp_path / "published", with_answers=True)
    return store, records


def session(env):
    settings = load_settings()
    return settings, redis.Redis.from_url(env["EYRIE_REDIS_URL"]), open_store(settings)


def generate_tasks(conn, store, run: str) -> dict:
    return {job: job_state(conn, job) for job in run_job_ids(store, run).get(PIPELINE[0].queue, [])}


def test_a_run_on_a_published_directory_starts_at_extract_and_names_where_its_answers_came_from(env, tmp_path):
    _, records = published(tmp_path)
    settings, conn, store = session(env)
    config = load_config(tiny_run_config(tmp_path, "b", {"dataset": {"source": str(tmp_path / "published")}}))
    plan = project(config, settings)  # `eyrie run --plan`: nothing to generate
    where = f"directory {(tmp_path / 'published' / 'answers').resolve()}"
    assert plan.answers_from == where and plan.samples == SAMPLES and plan.hours["generate"]["hours"] == 0
    assert f"generate     0.00 h: none: the answers in {where}" in "\n".join(render(plan))
    out = start_and_plan(settings, conn, store, config)

    where = f"directory {(tmp_path / 'published' / 'answers').resolve()}"
    assert out["answers_from"] == where and out["started"] == "extract" and out["planning"] is None, out
    assert f"starts at extraction on the answers in {where} ({SAMPLES} prompt rows" in pipeline_started(out)
    assert set(generate_tasks(conn, store, "b").values()) == {None}  # none enqueued, none run: nothing generated
    manifest = load_run_manifest(store, "b")
    assert manifest.answers_from["where"] == where and manifest.answers_from["run"] == RUN
    assert manifest.answers_from["samples"] == SAMPLES
    assert prompts_license(manifest).id == "MIT + Apache-2.0 (as its parts)"  # as the set states it: no file here
    assert manifest.target.revision == describe(str(TINY)).revision
    shard = ShardManifest.model_validate(store.get_json(Layout("b").generate_shard_manifest(0)))
    assert shard.counts.done == SAMPLES and shard.worker.startswith("published answers")
    stored = [orjson.loads(line) for line in store.get_verified(shard.object, shard.sha256).splitlines()]
    keep = ("sample_id", "row", "messages", "content", "finish_reason", "prompt_token_ids", "completion_token_ids")
    assert [{k: r[k] for k in keep} for r in stored] == [{k: r[k] for k in keep} for r in records]

    again = start_and_plan(settings, conn, store, config)  # a rerun continues, still on the answers
    assert again["answers_from"] == where and set(generate_tasks(conn, store, "b").values()) == {None}


@pytest.mark.parametrize("change", ["revision", "chat_template_sha256", "max_tokens"])
def test_answers_of_another_target_revision_or_sampling_are_refused_before_anything_is_written(env, tmp_path,
                                                                                                change):
    published(tmp_path)
    answers = tmp_path / "published" / "answers"
    provenance = json.loads((answers / "eyrie-answers.json").read_text())
    if change == "max_tokens":
        provenance["generate"]["sampling"]["max_tokens"] = 32
    else:
        provenance["target"][change] = "sha256:" + "0" * 64
    (answers / "eyrie-answers.json").write_text(json.dumps(provenance))
    settings, conn, store = session(env)
    config = load_config(tiny_run_config(tmp_path, "b", {"dataset": {"source": str(answers)}}))
    with pytest.raises(EyrieError, match="Nothing was started") as refused:
        start_pipeline(settings, conn, store, config)
    said = {"max_tokens": "max_tokens 64 vs 32"}.get(change, "were given by")
    assert said in refused.value.problem and refused.value.fix
    assert store.list(f"{Layout('b').root}/") == [] and not conn.sismember(keys.RUNS, "b")


def test_a_run_on_a_published_hub_dataset_downloads_it_and_names_its_commit(env, tmp_path):
    """`eyrie publish --with-answers` to the hub on one host, `eyrie run` on the dataset's id on another."""
    from tests.support.hub_stub import running

    published(tmp_path)
    with running(TOKEN) as (url, hub):
        online = {**{k: v for k, v in env.items() if k not in OFFLINE}, "HF_ENDPOINT": url, "HF_TOKEN": TOKEN,
                  "HF_HOME": str(tmp_path / "hf")}
        eyrie("publish", "--run", RUN, "--repo", REPO, "--with-answers",
              env={**online, "EYRIE_STORE_URL": f"file://{tmp_path / 'elsewhere' / 'store'}"})
        [commit] = hub.commits(REPO, "dataset")
        said = eyrie("run", "--config", tiny_run_config(tmp_path, "h", {"dataset": {"source": REPO}}),
                     env=online).stdout
    where = f"hub dataset {REPO}@{commit['oid']}"
    assert f"starts at extraction on the answers in {where}" in said and "extract started" in said, said
    manifest = load_run_manifest(session(env)[2], "h")
    assert manifest.answers_from["where"] == where and manifest.answers_from["revision"] == commit["oid"]


@pytest.mark.e2e
@pytest.mark.timeout(1200)
def test_a_run_on_published_answers_reaches_a_drafter_with_no_inference_server_up(env, tmp_path):
    """extract (the HF backend, CPU) and train workers alone, no EYRIE_INFERENCE_URL and no server: the run is
    extracted, trained and exported."""
    published(tmp_path)
    env = {k: v for k, v in env.items() if k != "EYRIE_INFERENCE_URL"}
    env["EYRIE_CACHE_DIR"] = str(tmp_path / "cache")
    config = tiny_run_config(tmp_path, "b", {"dataset": {"source": str(tmp_path / "published")},
                                             "train": {"epochs": 1}})
    said = eyrie("run", "--config", config, env=env).stdout
    assert "starts at extraction on the answers in directory" in said, said
    for stage in ("extract", "train"):
        eyrie("worker", stage, "--burst", env=env, timeout=900)
    manifest = load_run_manifest(open_store(load_settings()), "b")
    assert manifest.extract.samples == SAMPLES and manifest.drafter and manifest.answers_from
