"""Two runs on two targets in one stack (issue 41, item 2): the stack's inference service (`eyrie serve
--run active`) serves one target at a time, the runs in the order they started; a run on another
target started while the first generates waits its turn (its generate tasks hand themselves back: no
attempt counted, no failure; status names the run it waits for) and is served once the first one's
generation is done. Real Redis, store, `eyrie run`, generate workers and `eyrie serve`;
tests/fake_vllm stands in for `vllm` (tests/support/stub_openai.py answers: the supervision is under test)."""

import json
import os
import shutil
import subprocess

from rq.job import Job
from rq.serializers import JSONSerializer

from eyrie.core.config import load_settings
from eyrie.stages.run_config import load_config
from eyrie.core.target import describe
from eyrie.data.manifest import Layout, config_key
from eyrie.data.store import open_store
from eyrie.runs import serve_turns
from eyrie.runs.status import run_status
from eyrie.stages import GENERATE
from eyrie.work import inference, keys
from eyrie.work.queue import RETRY_INTERVALS_S, enqueue
from tests.support.builders import make_manifest
from tests.support.harness import BIN, OFFLINE, ROOT, TINY, Workers, eyrie, own_db, tiny_run_config, wait_for
from tests.support.processes import free_port, stop

DEADLINE_S = 15  # the generate workers' EYRIE_SERVE_DEADLINE_S: the second run waits its turn longer


def _other_target(tmp_path) -> str:
    """The tiny target with one more key in its config: another target (another revision)."""
    other = tmp_path / "other-target"
    shutil.copytree(TINY, other)
    config = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**config, "eyrie_test_variant": 1}))
    return str(other)


def test_runs_are_served_in_the_order_they_started_and_one_on_another_target_waits_for_the_one_served(
        redis_url, tmp_path):
    conn, _ = own_db(redis_url, 4)
    store = open_store(load_settings(store_url=f"file://{tmp_path / 'store'}"))
    for run, started in (("b-first", "2026-01-01T00:00:00+00:00"), ("a-second", "2026-01-01T00:00:05+00:00")):
        store.put_json(config_key(run), load_config(tiny_run_config(tmp_path, run)).model_dump())
        store.put_json(Layout(run).manifest, make_manifest(run, created_at=started).model_dump())
        conn.sadd(keys.ACTIVE_PIPELINES, run)
        enqueue(conn, GENERATE, {"run": run, "shard": 0})
    assert serve_turns.serve_order(conn, store) == ["b-first", "a-second"]  # started first, not first by name
    other = describe(_other_target(tmp_path))
    served = inference.Endpoint(url="http://127.0.0.1:9", model=str(TINY), server="vllm", state="ready",
                                revision=describe(str(TINY)).revision, run="b-first")
    inference.publish(conn, served)
    assert serve_turns.holder(conn, store, "a-second", other) == "b-first"
    assert serve_turns.holder(conn, store, "a-second", describe(str(TINY))) is None  # its target is served
    assert serve_turns.holder(conn, store, "b-first", other) is None  # its own server
    conn.set(keys.cancelled("b-first"), "now")  # the run served cannot go on: nothing to wait for
    assert serve_turns.holder(conn, store, "a-second", other) is None
    assert serve_turns.serve_order(conn, store) == ["a-second"]


def _failed_attempts(conn, runs: list[str]) -> dict[str, int]:
    """Each generate task's attempts that failed (RQ's retries spent), by task."""
    spent = {}
    for run in runs:
        for shard in range(2):
            job_id = GENERATE.task_id(run, shard)
            if conn.exists(f"rq:job:{job_id}"):
                job = Job.fetch(job_id, connection=conn, serializer=JSONSerializer)
                spent[job_id] = len(RETRY_INTERVALS_S) - (job.retries_left or 0)
    return spent


def test_a_second_run_on_another_target_waits_its_turn_and_both_generate(redis_url, tmp_path):
    """The first run answers 40 prompts one at a time at 1 s each; the second, on another target,
    is started while it does: its tasks wait past EYRIE_SERVE_DEADLINE_S, hand themselves back, and
    status says they wait for the first run; then the service switches targets and both finish
    generating, no attempt failed. Before: its tasks failed after EYRIE_SERVE_DEADLINE_S each."""
    conn, url = own_db(redis_url, 4)
    store_url = f"file://{tmp_path / 'store'}"
    store = open_store(load_settings(store_url=store_url))
    base = {**os.environ, **OFFLINE, "EYRIE_REDIS_URL": url, "EYRIE_STORE_URL": store_url,
            "PATH": f"{ROOT / 'tests' / 'fake_vllm'}:{BIN}:{os.environ['PATH']}"}
    work_env = {**base, "EYRIE_SERVE_DEADLINE_S": str(DEADLINE_S)}
    log = tmp_path / "serve.log"
    server = subprocess.Popen([str(BIN / "eyrie"), "serve", "--server", "vllm", "--run", "active",
                               "--port", str(free_port())], env={**base, "FAKE_VLLM_LATENCY": "1"},
                              stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True)
    workers = Workers(work_env, tmp_path)
    workers.start("generate", "generate")  # one answers the first run, the other plans and waits for the second
    first = tiny_run_config(tmp_path, "first", dataset={"limit": 40}, generate={"concurrency": 1, "shard_size": 40})
    second = tiny_run_config(tmp_path, "second", target={"model": _other_target(tmp_path)},
                             dataset={"limit": 8}, generate={"concurrency": 8, "shard_size": 4})
    runs = ["first", "second"]

    def generated(run: str) -> bool:
        assert not any(_failed_attempts(conn, runs).values()), _failed_attempts(conn, runs)
        return run_status(conn, store, run).stages["generate"].state == "done"

    try:
        eyrie("run", "--config", first, env=work_env)
        wait_for(lambda: (e := inference.read(conn)) is not None and e.state == "ready" and e.run == "first",
                 "the first run served", timeout=120)
        eyrie("run", "--config", second, env=work_env)
        assert run_status(conn, store, "first").stages["generate"].state != "done"  # started while it generates
        waits = serve_turns.turn_text("first")
        wait_for(lambda: waits in run_status(conn, store, "second").stages["generate"].waiting_for,
                 "status saying the second run waits for the first", timeout=60)
        wait_for(lambda: generated("first"), "the first run's generation", timeout=180, every=1)
        wait_for(lambda: generated("second"), "the second run's generation", timeout=180, every=1)
        text = log.read_text()
        assert "serving run second's target" in text and "run second waits its turn" in text, text
        assert "waits its turn in its queue" in workers.log_text("generate")  # handed back, past the deadline
        assert server.poll() is None, text
    except AssertionError:
        print(workers.stacks(), log.read_text()[-4000:])
        raise
    finally:
        stop(server)
        workers.stop_all()
