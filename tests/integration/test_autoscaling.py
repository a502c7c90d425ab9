"""What KEDA reads when it scales the generator workers: the chart's triggers (default values) asked
as KEDA asks them (the metrics-api trigger's path, token and valueLocation against a live `eyrie
api`; the redis trigger's list in Redis itself) while a real RQ worker runs a generate task against
a slow server. RQ takes the running task off its list; the count KEDA scales on still holds it."""

import os
from functools import reduce
from urllib.parse import urlsplit

import pytest
import redis
import requests

from eyrie.work.queue import job_state
from tests.integration.test_api import TOKEN, prompts, run_config, start_api
from tests.support.harness import start_worker, wait_for
from tests.support.processes import stop
from tests.unit.test_helm import default_docs, keda_triggers, one, trigger_secret


class Keda:
    """KEDA's two reads, from the rendered chart: the api's live tasks, and RQ's list length."""

    def __init__(self, api_url: str, redis_url: str):
        docs = default_docs(api_token=TOKEN)
        self.live, queued = (keda_triggers(docs)[kind] for kind in ("metrics-api", "redis"))
        ref = trigger_secret(docs, self.live)
        self.token = one(docs, "Secret", ref["name"])["stringData"][ref["key"]]
        self.url = api_url + urlsplit(self.live["metadata"]["url"]).path
        self.list_name = queued["metadata"]["listName"]
        self.conn = redis.Redis.from_url(redis_url)

    def counts(self) -> dict:
        return requests.get(self.url, headers={"Authorization": f"Bearer {self.token}"}, timeout=10).json()

    def live_tasks(self, counts: dict | None = None) -> int:
        """The value at the trigger's valueLocation (a GJSON path: here dotted keys)."""
        path = self.live["metadata"]["valueLocation"].split(".")
        return reduce(lambda node, key: node[key], path, counts or self.counts())

    def queued(self) -> int:
        return self.conn.llen(self.list_name)


@pytest.mark.parametrize("store_env", ["file"], indirect=True)
def test_keda_counts_the_running_generate_task_once_the_list_is_empty(env, stub_server, tmp_path):
    stub = stub_server(latency=6, tokens=4)
    env = {**env, "EYRIE_INFERENCE_URL": stub, "EYRIE_SERVER": "vllm"}
    api, url = start_api(env)
    keda, worker = Keda(url, env["EYRIE_REDIS_URL"]), None
    try:
        started = requests.post(f"{url}/runs", json=run_config("scaled", prompts(tmp_path / "p.jsonl", 2)),
                                headers={"Authorization": f"Bearer {TOKEN}"})
        assert started.status_code == 202 and started.json()["planning"] == "plan-generate-scaled-00000"
        assert keda.live_tasks() == keda.queued() == 1  # its planning task: a worker is scaled up for it too

        worker = start_worker(env, burst=False)  # plans the run, then takes its one shard
        shard = "generate-scaled-00000"
        running = wait_for(lambda: job_state(keda.conn, shard) == "started" and keda.counts(), "the shard to start")
        assert running == {"queue": "generate", "queued": 0, "started": 1, "scheduled": 0, "deferred": 0, "live": 1}
        assert keda.live_tasks(running) == 1 and keda.queued() == 0  # the list alone would let KEDA scale to zero

        wait_for(lambda: keda.live_tasks() == 0, "the task to finish")
        status = requests.get(f"{url}/runs/scaled", headers={"Authorization": f"Bearer {TOKEN}"}).json()
        assert status["stages"]["generate"]["state"] == "done" and status["stages"]["generate"]["done"] == 2
    finally:
        if worker is not None:
            os.killpg(worker.pid, 9)
        stop(api)
