"""Generate against the vLLM stand-in (vLLM cannot run here; the stub speaks its response shape):
reasoning shapes, token ids, retries, recorded failures, a SIGKILLed worker, exactly-once."""

import json
import signal
import time

import orjson
import psutil
import pytest
import redis
import requests

from eyrie.core.config import load_settings
from eyrie.data.manifest import Layout
from eyrie.data.store import open_store
from eyrie.work import keys
from eyrie_generator.shard import FLUSH_EVERY
from tests.support.harness import eyrie, start_worker


def kill_worker(worker) -> None:
    """SIGKILL a worker and its work horse (RQ starts the horse in a session of its own), the worker
    first: killed after its horse, it could see the horse die and schedule the task's retry, RQ's
    own recovery, which a burst worker started before the retry is due does not run."""
    horses = psutil.Process(worker.pid).children(recursive=True)
    for proc in [psutil.Process(worker.pid), *horses]:
        proc.send_signal(signal.SIGKILL)
    worker.wait()


def write_prompts(path, n, prefix="q"):
    with open(path, "w") as f:
        for i in range(n):
            f.write(json.dumps({"conversations": [{"from": "human", "value": f"{prefix}{i}"}]}) + "\n")
    return path


def records(run):
    store, layout = open_store(load_settings()), Layout(run)
    out = []
    for key in store.list(f"{layout.root}/generate/shards/"):
        if key.endswith(".jsonl"):
            out += [orjson.loads(line) for line in store.get_bytes(key).splitlines()]
    return out


@pytest.mark.parametrize("shape,source", [("reasoning", "reasoning"),
                                          ("reasoning_content", "reasoning_content"),
                                          ("think_tags", "think_tags")])
def test_reasoning_captured_from_each_response_shape(env, stub_server, tmp_path, shape, source):
    url = stub_server(shape=shape, tokens=6)
    env = {**env, "EYRIE_INFERENCE_URL": url, "EYRIE_SERVER": "vllm"}
    data = write_prompts(tmp_path / "p.jsonl", 5)
    eyrie("generate", "--dataset", str(data), "--run", "shapes", "--concurrency", "3", env=env)
    eyrie("worker", "generate", "--burst", env=env)
    recs = records("shapes")
    assert len(recs) == 5 and all(r["status"] == "done" for r in recs)
    for r in recs:
        assert r["reasoning_source"] == source
        assert r["reasoning"] == "step step step"
        assert r["content"].startswith("answer answer answer [q")
        assert "<think>" not in r["content"]
        assert r["finish_reason"] == "stop" and r["usage"]["completion_tokens"] == 6
        # vLLM returns exact token ids when asked with return_token_ids
        assert r["prompt_token_ids"] == list(range(10))
        assert r["completion_token_ids"] == list(range(100, 106))


def test_server_errors_are_retried_and_final_failures_recorded(env, stub_server, tmp_path):
    faults = {"q0": [500, 503, "ok"], "q1": [429, "ok"], "q2": ["drop", "ok"], "q3": [503],
              "q4": [400], "q5": [408, "ok"]}
    url = stub_server(faults=faults, tmp=tmp_path)
    env = {**env, "EYRIE_INFERENCE_URL": url, "EYRIE_SERVER": "vllm", "EYRIE_MAX_RETRIES": "3"}
    eyrie("generate", "--dataset", str(write_prompts(tmp_path / "p.jsonl", 8)), "--run", "errs", env=env)
    eyrie("worker", "generate", "--burst", env=env)
    by_prompt = {r["messages"][-1]["content"]: r for r in records("errs")}
    assert by_prompt["q0"]["status"] == "done" and by_prompt["q0"]["attempts"] == 3
    assert by_prompt["q1"]["status"] == "done" and by_prompt["q1"]["attempts"] == 2
    assert by_prompt["q2"]["status"] == "done" and by_prompt["q2"]["attempts"] == 2
    assert by_prompt["q5"]["status"] == "done" and by_prompt["q5"]["attempts"] == 2
    assert by_prompt["q3"]["status"] == "failed" and by_prompt["q3"]["attempts"] == 4
    assert "HTTP 503" in by_prompt["q3"]["error"]
    assert by_prompt["q4"]["status"] == "failed" and by_prompt["q4"]["attempts"] == 1  # 400: no retry
    assert "HTTP 400" in by_prompt["q4"]["error"]
    stats = requests.get(f"{url}/stats").json()["requests"]
    assert stats["q3"] == 4 and stats["q4"] == 1 and stats["q6"] == 1
    status = json.loads(eyrie("status", "errs", "--json", env=env).stdout)["stages"]["generate"]
    assert (status["state"], status["total"], status["done"], status["failed"]) == ("done", 8, 6, 2)


@pytest.mark.parametrize("recovery", ["rerun", "new_worker"])
def test_sigkilled_worker_then_rerun_gives_exactly_one_record_per_sample(env, stub_server, tmp_path, recovery):
    n, concurrency = 400, 8
    url = stub_server(latency=0.05, tokens=4)
    env = {**env, "EYRIE_INFERENCE_URL": url, "EYRIE_SERVER": "vllm"}
    data = write_prompts(tmp_path / "p.jsonl", n)
    args = ("generate", "--dataset", str(data), "--run", "crash", "--concurrency", str(concurrency),
            "--shard-size", "200")
    eyrie(*args, env=env)
    worker = start_worker(env, burst=True)
    store, layout = open_store(load_settings()), Layout("crash")
    deadline = time.monotonic() + 120
    while not store.list(layout.generate_parts(0)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert store.list(layout.generate_parts(0)), "no part was flushed before the kill"
    kill_worker(worker)  # mid-shard
    answered_before = requests.get(f"{url}/stats").json()["total"]
    assert answered_before < n, "the worker finished before it was killed: the test proves nothing"

    conn = redis.Redis.from_url(env["EYRIE_REDIS_URL"])
    deadline = time.monotonic() + 60  # a dead worker's lease and keep-alive lapse within LEASE_TTL_S
    while conn.exists(keys.task_lease("generate-crash-00000"), keys.job_alive("generate-crash-00000")) and \
            time.monotonic() < deadline:
        time.sleep(0.5)
    if recovery == "rerun":  # the same command again: continues, re-enqueues what is missing
        before = tasks_state(conn, "crash", 2)
        assert "1 tasks enqueued now" in eyrie(*args, env=env).stdout, before
    # else: a new worker finds the dead worker's task (RQ still lists it as started) and takes it
    eyrie("worker", "generate", "--burst", env=env, timeout=600)

    recs = records("crash")
    ids = [r["sample_id"] for r in recs]
    assert len(ids) == n and len(set(ids)) == n
    assert sorted(r["row"] for r in recs) == list(range(n))
    assert all(r["status"] == "done" for r in recs)
    asked = requests.get(f"{url}/stats").json()["requests"]
    # Resumed from the flushed parts: asked twice are only answers not yet flushed at the kill
    # (at most FLUSH_EVERY) and requests in flight then (at most the concurrency).
    assert sum(asked.values()) - n <= FLUSH_EVERY + concurrency
    assert max(asked.values()) <= 2
    status = json.loads(eyrie("status", "crash", "--json", env=env).stdout)["stages"]["generate"]
    assert status["state"] == "done" and status["done"] == n


def test_same_run_enqueued_twice_is_done_once(env, stub_server, tmp_path):
    url = stub_server(tokens=4)
    env = {**env, "EYRIE_INFERENCE_URL": url, "EYRIE_SERVER": "vllm"}
    args = ("generate", "--dataset", str(write_prompts(tmp_path / "p.jsonl", 30)), "--run", "twice",
            "--shard-size", "10")
    first, second = eyrie(*args, env=env), eyrie(*args, env=env)
    assert "3 tasks enqueued now" in first.stdout and "0 tasks enqueued now" in second.stdout
    eyrie("worker", "generate", "--burst", env=env)
    assert requests.get(f"{url}/stats").json()["total"] == 30
    assert "0 tasks enqueued now" in eyrie(*args, env=env).stdout


@pytest.mark.parametrize("store_env", ["file"], indirect=True)
def test_several_endpoints_each_keep_their_share_in_flight(env, stub_server, tmp_path):
    big, small = stub_server(latency=0.2, tokens=4), stub_server(latency=0.2, tokens=4)
    env = {**env, "EYRIE_INFERENCE_URL": f"{big}#2,{small}", "EYRIE_SERVER": "vllm"}
    data = write_prompts(tmp_path / "p.jsonl", 90)
    eyrie("generate", "--dataset", str(data), "--run", "shares", "--concurrency", "9", env=env)
    eyrie("worker", "generate", "--burst", env=env)
    assert len(records("shares")) == 90
    stats = [requests.get(f"{url}/stats", timeout=5).json() for url in (big, small)]
    assert [s["max_in_flight"] for s in stats] == [6, 3]  # 9 in flight, split 2:1
    assert stats[0]["total"] + stats[1]["total"] == 90 and stats[0]["total"] > stats[1]["total"]


@pytest.mark.parametrize("store_env", ["file"], indirect=True)
def test_lanes_move_on_to_the_next_shard_while_the_last_answers_arrive(env, stub_server, tmp_path):
    """Shards of 12 at C=8: alone, each shard keeps at most 6 in flight on average (8, then 4);
    taken on in turn by one task, the lanes never wait for a shard's end: 48 rows, 6 full waves."""
    url = stub_server(latency=0.5, tokens=4)
    env = {**env, "EYRIE_INFERENCE_URL": url, "EYRIE_SERVER": "vllm"}
    data = write_prompts(tmp_path / "p.jsonl", 48)
    eyrie("generate", "--dataset", str(data), "--run", "chain", "--concurrency", "8", "--shard-size", "12", env=env)
    eyrie("worker", "generate", "--burst", env=env)
    from rq.job import Job
    from rq.serializers import JSONSerializer

    conn = redis.Redis.from_url(env["EYRIE_REDIS_URL"])
    result = Job.fetch("generate-chain-00000", connection=conn, serializer=JSONSerializer).return_value()
    assert result["chained_shards"] == [1, 2, 3] and result["chained_done"] == 36
    assert result["mean_in_flight"] >= 7.0, result  # 8 at most; per shard alone at most 6
    stats = requests.get(f"{url}/stats").json()
    assert stats["total"] == 48 and max(stats["requests"].values()) == 1 and stats["max_in_flight"] == 8
    recs = records("chain")
    assert sorted(r["row"] for r in recs) == list(range(48))
    store, layout = open_store(load_settings()), Layout("chain")
    for shard in range(4):  # every sample's record in its own shard, each shard with its manifest
        manifest = store.get_json(layout.generate_shard_manifest(shard))
        rows = [orjson.loads(line)["row"] for line in store.get_bytes(manifest["object"]).splitlines()]
        assert rows == list(range(12 * shard, 12 * shard + 12)) and manifest["counts"]["done"] == 12
    assert not conn.exists(keys.generate_claims("generate-chain-00000"))
    status = json.loads(eyrie("status", "chain", "--json", env=env).stdout)["stages"]["generate"]
    assert status["state"] == "done" and status["shards_done"] == 4


def tasks_state(conn, run: str, shards: int) -> dict:
    """Each generate task's RQ state, lease and keep-alive TTLs (ms) and claims, and the queue: what a
    failed recovery test prints."""
    from rq.job import Job
    from rq.serializers import JSONSerializer

    state = {"queue": [j.decode() for j in conn.lrange("rq:queue:eyrie-generate", 0, -1)]}
    for shard in range(shards):
        task = f"generate-{run}-{shard:05d}"
        job = Job.fetch(task, connection=conn, serializer=JSONSerializer) if conn.exists(f"rq:job:{task}") else None
        state[task] = (job and job.get_status(), conn.pttl(keys.task_lease(task)), conn.pttl(keys.job_alive(task)),
                       sorted(int(c) for c in conn.smembers(keys.generate_claims(task))))
    return state


@pytest.mark.parametrize("store_env", ["file"], indirect=True)
@pytest.mark.parametrize("recovery", ["rerun", "worker"])
def test_a_worker_killed_while_on_a_shard_it_took_on_loses_and_duplicates_nothing(env, stub_server, tmp_path,
                                                                                 recovery):
    n = 60
    url = stub_server(latency=0.3, tokens=4)
    env = {**env, "EYRIE_INFERENCE_URL": url, "EYRIE_SERVER": "vllm"}
    data = write_prompts(tmp_path / "p.jsonl", n)
    args = ("generate", "--dataset", str(data), "--run", "took", "--concurrency", "8", "--shard-size", "20")
    eyrie(*args, env=env)
    conn = redis.Redis.from_url(env["EYRIE_REDIS_URL"])
    worker = start_worker(env, burst=True)
    deadline = time.monotonic() + 120
    while not conn.sismember(keys.generate_claims("generate-took-00000"), 1) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert conn.sismember(keys.generate_claims("generate-took-00000"), 1), "shard 1 was never taken on"
    kill_worker(worker)
    assert requests.get(f"{url}/stats").json()["total"] < n, "finished before the kill: proves nothing"
    deadline = time.monotonic() + 60
    # the dead worker's leases and its keep-alive (which a worker's start-up reclaim checks) lapsed
    while conn.exists(keys.task_lease("generate-took-00000"), keys.task_lease("generate-took-00001"),
                      keys.job_alive("generate-took-00000")) and time.monotonic() < deadline:
        time.sleep(0.5)
    said = [f"after the kill: {tasks_state(conn, 'took', 3)}", f"dead worker: {worker.stdout.read()[-2000:]}"]
    if recovery == "rerun":  # shard 1's job, marked started by the dead task, is abandoned: replaced
        said.append(eyrie(*args, env=env).stdout)
    said.append(f"before recovery: {tasks_state(conn, 'took', 3)}")
    said.append(eyrie("worker", "generate", "--burst", env=env, timeout=600).stdout)
    if recovery == "worker":  # the dead task is requeued and, first, requeues what it had taken on
        said.append(eyrie("worker", "generate", "--burst", env=env, timeout=600).stdout)
    recs = records("took")
    assert sorted(r["row"] for r in recs) == list(range(n)) and all(r["status"] == "done" for r in recs), \
        "\n".join(said + [f"at the end: {tasks_state(conn, 'took', 3)}"])
    asked = requests.get(f"{url}/stats").json()["requests"]
    # asked twice: answers not yet flushed at the kill (under FLUSH_EVERY in each of the two open
    # shards) and the requests then in flight (at most C)
    assert max(asked.values()) <= 2 and sum(asked.values()) - n <= 2 * FLUSH_EVERY + 8


@pytest.mark.parametrize("store_env", ["file"], indirect=True)
def test_a_shard_taken_out_of_the_queue_by_a_chain_that_died_before_marking_it_started_is_requeued(env, tmp_path):
    """The kill window of the test above: the claim listed and the job out of the queue, its RQ
    state still `queued`. Recovery puts it back in the queue; a job waiting there is never doubled."""
    from rq.job import Job
    from rq.serializers import JSONSerializer

    from eyrie.work.queue import enqueue, queue
    from eyrie.stages import GENERATE
    from eyrie_generator.chain import recover_claims

    eyrie("generate", "--dataset", str(write_prompts(tmp_path / "p.jsonl", 60)), "--run", "out",
          "--shard-size", "20", env=env)
    conn = redis.Redis.from_url(env["EYRIE_REDIS_URL"])
    waiting = queue(conn, GENERATE.queue)
    assert not enqueue(conn, GENERATE, {"run": "out", "shard": 1}, 1)  # queued: not enqueued twice
    conn.sadd(keys.generate_claims("generate-out-00000"), 1)  # what _take_next does first
    assert waiting.remove("generate-out-00001")  # then: out of the queue; then the death
    assert Job.fetch("generate-out-00001", connection=conn, serializer=JSONSerializer).get_status() == "queued"

    assert recover_claims(conn, open_store(load_settings()), "out", "generate-out-00000") == 1
    assert "generate-out-00001" in waiting.job_ids and waiting.job_ids.count("generate-out-00001") == 1
    assert not conn.exists(keys.generate_claims("generate-out-00000"))
