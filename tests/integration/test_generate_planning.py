"""Generate is planned by its own task, first on the generate queue: with a generator worker up it
plans (the CLI waits and prints the rows as before), a rerun with other settings is the CLI's
one-line error before anything is written, and with no worker up the CLI runs that one task itself.
Real Redis, a real store, real `eyrie` processes, the vLLM stand-in."""

import json
import os
import socket

import pytest
import redis
from rq.job import Job
from rq.serializers import JSONSerializer

from eyrie.stages import PLAN_GENERATE
from eyrie.work.queue import workers_on
from tests.support.harness import eyrie, numbered_prompts, start_worker, wait_for

pytestmark = pytest.mark.parametrize("store_env", ["file"], indirect=True)


def planner_of(conn, run: str) -> str:
    return Job.fetch(PLAN_GENERATE.task_id(run), connection=conn, serializer=JSONSerializer).worker_name


def test_a_generate_worker_plans_the_run_and_a_refusal_it_finds_is_the_clis_error_and_the_runs_status(
        env, stub_server, tmp_path):
    env = {**env, "EYRIE_INFERENCE_URL": stub_server(tokens=2), "EYRIE_SERVER": "vllm"}
    conn = redis.Redis.from_url(env["EYRIE_REDIS_URL"])
    source = numbered_prompts(tmp_path / "p.jsonl", 6)
    worker = start_worker(env, burst=False)
    try:
        wait_for(lambda: workers_on(conn, "generate"), "the generate worker")
        out = eyrie("generate", "--dataset", source, "--run", "wp", "--shard-size", "2", env=env).stdout
        assert "6 rows in 3 shards; 3 tasks enqueued now" in out
        assert planner_of(conn, "wp") == f"generate-{socket.gethostname()}-{worker.pid}"  # not the CLI

        wait_for(lambda: json.loads(eyrie("status", "wp", "--json", env=env).stdout)["stages"]["generate"]["state"]
                 == "done", "the run generated")
        other = eyrie("generate", "--dataset", source, "--run", "wp", "--max-tokens", "9", env=env, check=False)
        assert other.returncode == 1 and other.stderr.count("\n") == 1, other.stderr
        # found where it was started, before anything was written (issue 29: a refusal changes nothing)
        assert "run wp already exists with other settings: max_tokens 9 vs" in other.stderr
        assert planner_of(conn, "wp") == f"generate-{socket.gethostname()}-{worker.pid}"
        generate = json.loads(eyrie("status", "wp", "--json", env=env).stdout)["stages"]["generate"]
        assert generate["state"] == "done" and not generate["errors"], generate  # the run as it was
    finally:
        os.killpg(worker.pid, 9)


def test_with_no_generate_worker_up_the_cli_plans_the_run_itself_once(env, stub_server, tmp_path):
    env = {**env, "EYRIE_INFERENCE_URL": stub_server(tokens=2), "EYRIE_SERVER": "vllm"}
    conn = redis.Redis.from_url(env["EYRIE_REDIS_URL"])
    out = eyrie("generate", "--dataset", numbered_prompts(tmp_path / "p.jsonl", 4), "--run", "here", "--shard-size", "2",
                env=env).stdout
    assert "4 rows in 2 shards; 2 tasks enqueued now" in out
    job = Job.fetch(PLAN_GENERATE.task_id("here"), connection=conn, serializer=JSONSerializer)
    assert job.get_status() == "finished" and job.return_value()["rows"] == 4
    assert conn.llen("rq:queue:eyrie-generate") == 2  # its own task taken off the queue; the shards wait
    status = json.loads(eyrie("status", "here", "--json", env=env).stdout)
    assert status["created_at"] and status["stages"]["generate"]["jobs"] == {"queued": 2}
