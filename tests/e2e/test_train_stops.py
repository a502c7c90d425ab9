"""A training task whose worker is SIGTERMed (a rollout, a node drain: `docker stop`) hands its task
back as generate and extract do: speculators saves a resumable checkpoint, the task goes back to
its queue at once with no failed attempt counted, and the next worker resumes from the checkpoint
(issue 41, item 7: RQ's three retries made the fourth stop of one training fail the run). The tiny
target on the CPU; samples answered by the vLLM stand-in and extracted in this process."""

import json
import os
import signal

import pytest
import redis
from rq.job import Job
from rq.serializers import JSONSerializer

from eyrie.core.config import load_settings
from eyrie.data.store import open_store
from eyrie.tasks.executor import Context, execute
from eyrie.work import progress
from tests.support.harness import TINY, eyrie, eyrie_in_process, wait_for

RUN, TASK, ROWS, STOPS = "stops", "train-stops-00000", 40, 4
# 12 steps an epoch, 180 in all: each attempt is held at its first reported step past its start
# (reports are 0.5 s apart: a step or a few on any CPU), so the 4 stops land far from the end
EPOCHS = 15


def extracted_run(env: dict, stub_server, tmp_path, monkeypatch) -> dict:
    """RUN's ROWS samples generated and extracted (layers 2, 4, 5); the environment to train it in."""
    from eyrie_extractor.shard import ExtractRunner
    from eyrie_generator.shard import ShardRunner

    settings_env = {"EYRIE_INFERENCE_URL": stub_server(tokens=24), "EYRIE_SERVER": "vllm", "EYRIE_MODEL": str(TINY),
                    "EYRIE_DEVICE": "cpu", "EYRIE_CACHE_DIR": str(tmp_path / "cache")}
    for key, value in settings_env.items():
        monkeypatch.setenv(key, value)
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"conversations": [{"from": "human", "value": f"question {i}"}]}) + "\n"
                            for i in range(ROWS)))
    env = {**env, **settings_env}
    eyrie_in_process("generate", "--dataset", str(data), "--run", RUN, "--shard-size", str(ROWS), env=env)
    settings = load_settings()
    ctx = Context(settings, redis.Redis.from_url(settings.redis_url), open_store(settings))
    assert execute(ShardRunner, {"run": RUN, "shard": 0}, ctx)["status"] == "done"
    eyrie_in_process("extract", "--run", RUN, "--layers", "2,4,5", env=env)
    assert execute(ExtractRunner, {"run": RUN, "shard": 0}, ctx)["status"] == "done"
    return env


def stepped(conn: redis.Redis, before: float | None) -> dict | None:
    """The training's live report (straight from Redis) once an attempt other than the one that
    started at `before` has trained a step of its own."""
    live = progress.read(conn, RUN, "train").get("0", {})
    ours = live.get("started") != before and live.get("resumed_at_step") is not None
    return live if ours and live["step"] > live["resumed_at_step"] else None


@pytest.mark.e2e
@pytest.mark.timeout(1200)
@pytest.mark.parametrize("store_env", ["file"], indirect=True)
def test_a_training_sigtermed_four_times_in_one_task_finishes_without_a_failed_attempt(
        env, stub_server, workers, tmp_path, monkeypatch):
    workers.env = env = extracted_run(env, stub_server, tmp_path, monkeypatch)
    eyrie("train", "--run", RUN, "--epochs", str(EPOCHS), "--seq-len", "128", "--draft-vocab", "300", env=env)
    conn = redis.Redis.from_url(env["EYRIE_REDIS_URL"])

    attempt, reached = None, 0
    for stop in range(STOPS):
        workers.start("train")
        worker = workers.procs["train"][-1]
        wait_for(lambda: stepped(conn, attempt), f"a step of attempt {stop + 1}", timeout=300, every=0.02)
        os.killpg(worker.pid, signal.SIGSTOP)  # held at a known step: the SIGTERM lands there
        held = progress.read(conn, RUN, "train")["0"]
        assert held["step"] < held["total_steps"] - 1, f"held too late to stop a training: {held}"
        worker.send_signal(signal.SIGTERM)  # what `docker stop` sends
        os.killpg(worker.pid, signal.SIGCONT)
        assert worker.wait(120) == 0
        workers.procs["train"].remove(worker)
        log = (tmp_path / f"train-{stop}.log").read_text()
        assert f"handed back {TASK}" in log and "Traceback" not in log, log[-3000:]
        if stop:  # from the checkpoint the last stop saved
            assert "resuming from checkpoint" in log and held["resumed_at_step"] >= reached, (held, log[-3000:])
        job = Job.fetch(TASK, connection=conn, serializer=JSONSerializer)
        assert job.get_status() == "queued" and job.retries_left == 3  # back at once, no failure counted
        attempt, reached = held["started"], held["step"]

    workers.start("train")
    train = wait_for(lambda: (lambda t: t["state"] in ("done", "failed") and t)(
        json.loads(eyrie_in_process("status", RUN, "--json", env=env).stdout)["stages"]["train"]),
        "the training's end", timeout=600, every=1)
    assert train["state"] == "done" and not train["errors"], train
    final = (tmp_path / f"train-{STOPS}.log").read_text()
    assert "resuming from checkpoint" in final, final[-3000:]
    assert train["done"] > reached  # it went on from the last stop
    assert Job.fetch(TASK, connection=conn, serializer=JSONSerializer).retries_left == 3
