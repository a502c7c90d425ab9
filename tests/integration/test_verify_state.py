"""A run's verify stage has a state of its own (issue 29, defect 2): a failed verify fails the run
in `eyrie status`, the API and /metrics, with its error; `eyrie retry` takes a skipped or failed
verify up again; a verifier that restarts as the run exports does not make the skip permanent; a
verify whose drafter changes more answers than the target alone fails, one judged on too few answers
fails nothing (issue 41, item 8); one killed with its verifier runs again on retry (issue 41, item 12).
In process, on a real Redis and a file store: the run is an exported one written as its stages
write it (no shards, a drafter), its verify task a real RQ job that failed (vLLM stands in for
nothing here: no GPU, so the verifier's failure is the job's record)."""

import json
import subprocess

import psutil
import pytest
import redis
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families
from rq import Worker
from rq.job import Job, JobStatus
from rq.results import Result
from rq.serializers import JSONSerializer

from eyrie.core.config import load_settings
from eyrie.stages.run_config import load_config
from eyrie.data.manifest import (DatasetRef, ExtractParams, GenerateParams, Layout, RunManifest, SamplingParams, TargetRef,
                                 TrainParams, load_run_manifest, now_iso)
from eyrie.data.store import open_store
from eyrie.data.verify_outputs import BEYOND, FAILED, MIN_COMPARED, too_few
from eyrie.runs.control import retry_run
from eyrie.runs.pipeline import advance, save_config
from eyrie.runs.status import overall_state, run_status
from eyrie.stages import VERIFY
from eyrie.stages.verify import verify_skipped
from eyrie.work import keys
from eyrie.work.gpu import GpuLease
from eyrie.work.queue import job_state, queue
from eyrie_trainer.verify import benchmark_result, headline
from tests.support.harness import BIN, TINY, eyrie_in_process, tiny_run_config, wait_for

pytestmark = pytest.mark.parametrize("store_env", ["file"], indirect=True)

ERROR = "EyrieError: vLLM exited with code 1 before it answered: CUDA out of memory"


def exported_run(conn, store, tmp_path, run: str, **verify) -> None:
    """A pipeline run whose drafter is exported (generate and extract had nothing to do)."""
    save_config(conn, store, load_config(tiny_run_config(tmp_path, run, verify=verify or {"enabled": True})))
    manifest = RunManifest(
        run=run, created_at=now_iso(), code_version="test", generate_shards=[],
        target=TargetRef(model=str(TINY), revision="r", chat_template_sha256=None, server="transformers"),
        dataset=DatasetRef(source="synthetic", kind="jsonl", revision="0" * 64, row_end=0),
        generate=GenerateParams(sampling=SamplingParams(max_tokens=16), concurrency=1, request_timeout_s=60.0,
                                max_retries=0, shard_size=3),
        extract=ExtractParams(backend="hf", aux_layers=[2, 4, 5], dtype="bf16", max_length=None, num_layers=8,
                              hidden_size=64, samples=0, tokens=0, truncated=0, projected_bytes=0, budget_bytes=None),
        train=TrainParams(epochs=1, draft_vocab=500, vocab_mapping="frequency", lr=0.003, total_seq_len=256,
                          train_samples=10, heldout_samples=2, speculators_version="test"),
        drafter={"checkpoint": "epoch-0", "tau": 1.5, "k": 3,
                 "files": {"model.safetensors": {"key": f"runs/{run}/drafter/model.safetensors"}}})
    store.put_json(Layout(run).manifest, manifest.model_dump())


def fail_verify_task(conn, run: str) -> None:
    """The verify task as RQ leaves it when its last attempt raised: failed, with its error."""
    job = Job.create(VERIFY.func, args=({"run": run},), id=VERIFY.task_id(run), connection=conn,
                     serializer=JSONSerializer, origin=queue(conn, VERIFY.queue).name)
    job.set_status(JobStatus.FAILED)
    job.save()
    queue(conn, VERIFY.queue).failed_job_registry.add(job, exc_string=f"Traceback ...\n{ERROR}")
    Result.create_failure(job, ttl=600, exc_string=f"Traceback ...\n{ERROR}")


def test_a_failed_verify_fails_the_run_with_its_error(env, tmp_path):
    conn, store = redis.Redis.from_url(env["EYRIE_REDIS_URL"]), open_store(load_settings())
    exported_run(conn, store, tmp_path, "vf")
    assert overall_state(run_status(conn, store, "vf")) == "in_progress"  # exported, its verify to come
    fail_verify_task(conn, "vf")
    status = run_status(conn, store, "vf")
    assert overall_state(status) == "failed"
    assert status.stages["verify"].state == "failed", status.stages
    assert any("CUDA out of memory" in e for e in status.stages["verify"].errors)
    shown = json.loads(eyrie_in_process("status", "vf", "--json", env=env).stdout)
    assert shown["stages"]["verify"]["state"] == "failed"
    table = eyrie_in_process("status", "vf", env=env).stdout
    assert "verify error" in table and "CUDA out of memory" in table

    from eyrie.api.app import create_app

    client = TestClient(create_app(load_settings().model_copy(update={"api_open_reads": True})))
    assert client.get("/runs/vf").json()["stages"]["verify"]["state"] == "failed"
    assert next(r for r in client.get("/runs").json() if r["run"] == "vf")["state"] == "failed"
    families = {f.name: f for f in text_string_to_metric_families(client.get("/metrics").text)}
    states = {s.labels["state"]: s.value for s in families["eyrie_run_state"].samples if s.labels["run"] == "vf"}
    assert states["failed"] == 1 and states["done"] == 0
    failures = {s.labels["stage"]: s.value for s in families["eyrie_task_failures"].samples if s.labels["run"] == "vf"}
    assert failures["verify"] == 1

    retried = retry_run(conn, store, "vf")  # the failed verify runs again
    assert VERIFY.task_id("vf") in retried["requeued"] and job_state(conn, VERIFY.task_id("vf")) == "queued"
    assert overall_state(run_status(conn, store, "vf")) == "in_progress"


def test_a_verified_or_skipped_run_is_done(env, tmp_path):
    conn, store = redis.Redis.from_url(env["EYRIE_REDIS_URL"]), open_store(load_settings())
    exported_run(conn, store, tmp_path, "vs", enabled=False)
    advance(conn, store, "vs")  # verify.enabled false: skipped, with the reason
    status = run_status(conn, store, "vs")
    assert status.stages["verify"].state == "done" and status.stages["verify"].skipped == 1
    assert overall_state(status) == "done"
    exported_run(conn, store, tmp_path, "vd")
    manifest = load_run_manifest(store, "vd")
    manifest.verify = {"vllm_acceptance_length": 2.25, "identical_outputs": True}  # as the verify task records it
    store.put_json(Layout("vd").manifest, manifest.model_dump())
    status = run_status(conn, store, "vd")
    assert status.stages["verify"].state == "done" and status.stages["verify"].done == 1
    assert overall_state(status) == "done"
    from eyrie.api.metrics import metrics_response

    families = {f.name: f for f in text_string_to_metric_families(metrics_response(conn, store).body.decode())}
    acceptance = {s.labels["source"]: s.value for s in families["eyrie_acceptance_length"].samples
                  if s.labels["run"] == "vd"}
    assert acceptance == {"eyrie": 1.5, "vllm": 2.25}


def test_retry_takes_up_a_skipped_verify_where_a_verifier_is_up_now(env, tmp_path):
    """The skip's fix says: start a verifier, then `eyrie retry`; the retry decides afresh."""
    conn, store = redis.Redis.from_url(env["EYRIE_REDIS_URL"]), open_store(load_settings())
    exported_run(conn, store, tmp_path, "vr", enabled=None)
    advance(conn, store, "vr")  # no verify worker up: skipped, the run done
    assert load_run_manifest(store, "vr").verify["skipped"].startswith("no worker of the verify queue is up")
    assert overall_state(run_status(conn, store, "vr")) == "done"
    verifier = Worker([queue(conn, VERIFY.queue)], connection=conn, serializer=JSONSerializer)
    verifier.register_birth()  # a verify worker is up now (registered as `eyrie worker verify` registers)
    try:
        retry_run(conn, store, "vr")
        assert load_run_manifest(store, "vr").verify is None
        assert job_state(conn, VERIFY.task_id("vr")) == "queued"
        assert run_status(conn, store, "vr").stages["verify"].state == "in_progress"
    finally:
        verifier.register_death()


def test_a_verifier_restarting_as_the_run_exports_does_not_skip_verify(env, tmp_path):
    """A verify worker that has just stopped (a restart: `docker compose up` recreating it, a new
    image) is a verifier of this deployment: the run enqueues its verify and waits for it."""
    conn = redis.Redis.from_url(env["EYRIE_REDIS_URL"])
    config = load_config(tiny_run_config(tmp_path, "vw", verify={"enabled": None}))
    assert verify_skipped(conn, config) is not None  # none has been up here
    stopped = subprocess.run([str(BIN / "eyrie"), "worker", "verify", "--burst"], env=env, capture_output=True,
                             text=True, timeout=300)  # up, then stopped: the queue was empty
    assert stopped.returncode == 0, stopped.stderr
    wait_for(lambda: not Worker.count(queue=queue(conn, VERIFY.queue)), "the verify worker gone", timeout=10)
    assert verify_skipped(conn, config) is None


def test_a_verify_whose_drafter_changes_more_answers_than_the_target_fails_the_run_and_retry_runs_it_again(env, tmp_path):
    """The verdict fails: its outputs' verdict (eyrie.data.verify_outputs) reads as the stage's failure, with the
    sets named; `eyrie retry` verifies again. A verdict recorded before match rates fails nothing."""
    conn, store = redis.Redis.from_url(env["EYRIE_REDIS_URL"]), open_store(load_settings())
    exported_run(conn, store, tmp_path, "vo")
    counters = ({"drafts": 0, "accepted_tokens": 0, "per_pos": {}}, {"drafts": 10, "accepted_tokens": 10, "per_pos": {0: 5}})
    answers = [[i, 0] for i in range(40)]
    alone = {"outputs": answers, "serial_outputs": [[0, 1], *answers[1:8]], "tokens_per_s": {"1": 1.0, "8": 4.0}}
    drafted = {"outputs": [[i, 5] for i in range(30)] + answers[30:],  # 5 of 8 changed at 1 in flight
               "serial_outputs": [[i, 5] for i in range(5)] + answers[5:8], "tokens_per_s": {"1": 1.0, "8": 4.0},
               "counters": counters}
    bench = benchmark_result(alone, {3: drafted}, 40)  # as the verify task measures it
    assert bench["k"]["3"]["outputs_verdict"] == FAILED  # 3 of 8 equal, the target alone 7 of 8
    manifest = load_run_manifest(store, "vo")
    manifest.verify = {**headline(bench, 3, manifest.drafter), "benchmarks": {"heldout": bench},
                       "identical_outputs": False, "outputs_verdict": bench["k"]["3"]["outputs_verdict"]}
    store.put_json(Layout("vo").manifest, manifest.model_dump())
    status = run_status(conn, store, "vo")
    assert overall_state(status) == "failed" and status.stages["verify"].state == "failed"
    assert "heldout K=3: 30 of 40 differ" in status.stages["verify"].errors[0]
    assert "verify error" in eyrie_in_process("status", "vo", env=env).stdout
    retry_run(conn, store, "vo")
    assert load_run_manifest(store, "vo").verify is None and job_state(conn, VERIFY.task_id("vo")) == "queued"

    manifest.verify["outputs_verdict"] = bench["k"]["3"]["outputs_verdict"] = BEYOND  # as a verify before match rates
    for key in ("match_rate", "target_match_rate", "match_rate_required"):
        del bench["k"]["3"][key]
    exported_run(conn, store, tmp_path, "vb")
    store.put_json(Layout("vb").manifest, {**manifest.model_dump(), "run": "vb"})
    assert overall_state(run_status(conn, store, "vb")) == "done"


def test_a_verdict_on_too_few_answers_is_recorded_and_said_and_fails_nothing(env, tmp_path):
    """tests/e2e/test_real_model.py[s3] verifies 2 prompts a set, so a second turn compares 1 answer at 1 in flight: its
    one near-tie flip read 0% and failed the run. Under MIN_COMPARED the verdict says so and the run is done."""
    conn, store = redis.Redis.from_url(env["EYRIE_REDIS_URL"]), open_store(load_settings())
    exported_run(conn, store, tmp_path, "vt")
    counters = ({"drafts": 0, "accepted_tokens": 0, "per_pos": {}}, {"drafts": 10, "accepted_tokens": 10, "per_pos": {0: 5}})
    alone = {"outputs": [[0, 0], [1, 0]], "serial_outputs": [[0, 0]], "tokens_per_s": {"1": 1.0, "8": 4.0}}
    drafted = {"outputs": [[0, 5], [1, 0]], "serial_outputs": [[0, 5]], "tokens_per_s": {"1": 1.0, "8": 4.0},
               "counters": counters}
    bench = benchmark_result(alone, {3: drafted}, 2)  # the one answer compared at 1 in flight differs
    assert bench["k"]["3"]["outputs_verdict"] == too_few(1)
    manifest = load_run_manifest(store, "vt")
    manifest.verify = {**headline(bench, 3, manifest.drafter), "benchmarks": {"heldout": bench},
                       "identical_outputs": False, "outputs_verdict": bench["k"]["3"]["outputs_verdict"]}
    store.put_json(Layout("vt").manifest, manifest.model_dump())
    status = run_status(conn, store, "vt")
    assert overall_state(status) == "done" and status.stages["verify"].state == "done", status.stages["verify"]
    shown = " ".join(eyrie_in_process("status", "vt", env=env).stdout.split())
    assert f"outputs too few answers compared to judge (1 of {MIN_COMPARED})" in shown, shown
    assert load_run_manifest(store, "vt").verify["outputs_verdict"] == too_few(1)  # recorded as it was judged


def test_a_verify_killed_with_its_verifier_runs_again_on_retry(env, tmp_path):
    """A verifier SIGKILLed mid-task (an OOM kill, `docker kill`) leaves its task listed as started by RQ for good:
    it is neither finished nor skipped, and `eyrie retry` (or a rerun) puts it back on the queue."""
    conn, store = redis.Redis.from_url(env["EYRIE_REDIS_URL"]), open_store(load_settings())
    exported_run(conn, store, tmp_path, "vk")
    holder = GpuLease(conn, "another stage", ttl_s=600)  # the task waits for the GPUs inside: mid-task
    assert holder.acquire(5)
    verifier = subprocess.Popen([str(BIN / "eyrie"), "worker", "verify"], env=env, stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL)
    task = VERIFY.task_id("vk")
    try:
        wait_for(lambda: Worker.count(queue=queue(conn, VERIFY.queue)), "the verify worker up", timeout=120)
        advance(conn, store, "vk")
        wait_for(lambda: conn.hlen(keys.GPU_WAITING), "the verify task waiting for the GPUs", timeout=60)
        forked = psutil.Process(verifier.pid).children(recursive=True)  # RQ's scheduler
        verifier.kill()
        verifier.wait(10)
        for child in forked:
            child.kill()
        wait_for(lambda: not conn.exists(keys.task_lease(task), keys.job_alive(task)), "its leases lapsed", timeout=60)
        assert job_state(conn, task) == "started"  # as RQ left it
        retry_run(conn, store, "vk")
        assert job_state(conn, task) == "queued" and load_run_manifest(store, "vk").verify is None
        assert run_status(conn, store, "vk").stages["verify"].jobs == {"queued": 1}
    finally:
        holder.release()
        if verifier.poll() is None:
            verifier.kill()
