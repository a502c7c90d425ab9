"""Hidden states from the vLLM extraction service during training (extract.storage hybrid and
online): the extract stage stores some samples (hybrid, within the budget) or none (online) with
their states, the rest as token ids alone; speculators' trainer asks the service for the missing
states (its on_missing "generate"), the held-out ones are fetched once, and the drafter is trained
and exported.

End to end: the tiny target through ONE real vLLM extraction server (the CPU build, started with
extract_command as tests/e2e/test_vllm_backend.py does) for the whole module, published in Redis as
`eyrie serve-extract` publishes it; real Redis, a real store, real `eyrie` commands and workers.
Without processes (the shard's split, its bound on a states file, the planner's refusals, a
materialized directory with samples stored as ids alone): tests/unit/test_storage_mode_units.py."""

import contextlib
import json
import os
import subprocess
import signal
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import redis
import requests
from safetensors import safe_open

from eyrie.core.config import load_settings
from eyrie.data.manifest import Layout, RunManifest, ShardManifest
from eyrie.data.store import open_store
from eyrie.work import inference, progress
from eyrie_extractor.vllm_backend import clear_orphans, connector_env, extract_command
from eyrie_trainer.data import heldout_ids
from tests.support.harness import BIN, OFFLINE, TINY, TRAIN_PROMPTS, clone_run, eyrie, wait_for, wait_http
from tests.support.processes import free_port
from tests.support.vllm_real import SMALL, START_S, VLLM_PYTHON, stop_vllm, vllm_env
from tests.support.vllm_real import requests_served as vllm_requests_served
from tests.unit.test_storage_mode_units import LAYERS

PROMPTS = 12  # two generate shards of 6
HELDOUT = 2


# --- end to end: online and hybrid through the real extraction service ---------------------------

class Service:
    """The module's one real vLLM extraction server (CPU build, our CPU-safe connector), started at
    once and awaited only where a test needs it, published in Redis as `eyrie serve-extract` does."""

    def __init__(self, tmp: Path):
        self.tmp, self.port, self.shared, self.log = tmp, free_port(), tmp / "hs", tmp / "vllm.log"
        self.url = f"http://127.0.0.1:{self.port}"
        self.stopped = threading.Event()
        self.served_before = 0  # requests of earlier vLLM processes (a restart counts from 0)
        self.start()

    def start(self) -> None:
        clear_orphans(self.shared)  # as `eyrie serve-extract` does before each vLLM start
        cmd = extract_command(str(TINY), LAYERS, self.shared, 1, self.port, SMALL, vllm_command=str(VLLM_PYTHON),
                              cpu=True)
        self.proc = subprocess.Popen(cmd, env=connector_env(vllm_env(self.tmp / "cache")), stdout=self.log.open("a"),
                                     stderr=subprocess.STDOUT, start_new_session=True)

    def outage(self) -> None:
        """vLLM goes away (its requests so far kept in the count), the address stays published."""
        self.served_before = self.requests_served()
        stop_vllm(self.proc)

    def ready(self) -> None:
        try:
            wait_http(f"{self.url}/v1/models", timeout=START_S, proc=self.proc)
        except (TimeoutError, RuntimeError):
            pytest.fail(f"vLLM did not start: {self.log.read_text(errors='replace')[-4000:]}")

    def publish(self, conn) -> None:
        """As `eyrie serve-extract` does while its vLLM runs: republished every few seconds."""
        self.conn, self.published = conn, self.url

        def republish():
            while not self.stopped.is_set():
                self._publish()
                self.stopped.wait(3)
        threading.Thread(target=republish, daemon=True).start()

    def route_through(self, url: str) -> None:
        """Publish `url` (a Gate in front of vLLM, or vLLM again) as the service's address, at once."""
        self.published = url
        self._publish()

    def _publish(self) -> None:
        endpoint = inference.Endpoint(name="extract", url=self.published, model=str(TINY), server="vllm",
                                      state="ready")
        inference.publish_extract(self.conn, endpoint)

    def requests_served(self) -> int:
        """vLLM's own count of finished requests, earlier processes' included."""
        return self.served_before + vllm_requests_served(self.url)

    def stop(self) -> None:
        self.stopped.set()
        stop_vllm(self.proc)


class Gate:
    """A relay in front of the extraction service that holds its `hold_at`-th request for states
    until let go. The tiny target answers in milliseconds and a trainer reports its step every 0.5 s:
    stopped "a few steps in" by its reports, it had finished its epoch on a fast host (CI saw it);
    held at a known sample, it is stopped at a known point. A held request let go with
    forward_held False is dropped unanswered (its client was killed); one for a service that is down
    has its connection closed unanswered, as a dead server's is reset: the client retries either."""

    def __init__(self, upstream: str, hold_at: int, forward_held: bool = True):
        self.upstream, self.hold_at, self.forward_held = upstream, hold_at, forward_held
        self.posts, self.lock = 0, threading.Lock()
        self.holding, self.release = threading.Event(), threading.Event()
        gate = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_GET(self):
                gate._relay(self, "GET")

            def do_POST(self):
                gate._relay(self, "POST")

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_port}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def _relay(self, handler: BaseHTTPRequestHandler, method: str) -> None:
        body = handler.rfile.read(int(handler.headers.get("Content-Length") or 0))
        if method == "POST" and self._count() == self.hold_at:
            self.holding.set()
            self.release.wait(600)
            if not self.forward_held:
                handler.close_connection = True
                return
        try:
            answer = requests.request(method, self.upstream + handler.path, data=body, timeout=600,
                                      headers={"Content-Type": handler.headers.get("Content-Type", "application/json")})
        except requests.ConnectionError:
            handler.close_connection = True
            return
        handler.send_response(answer.status_code)
        handler.send_header("Content-Type", answer.headers.get("Content-Type", "application/json"))
        handler.send_header("Content-Length", str(len(answer.content)))
        handler.end_headers()
        handler.wfile.write(answer.content)

    def _count(self) -> int:
        with self.lock:
            self.posts += 1
            return self.posts

    def close(self) -> None:
        self.release.set()
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture(scope="module")
def runs(redis_server, tiny_server, tmp_path_factory):
    """12 prompts generated once, then two runs over them: "on" (online) extracted while the
    service is still starting (it needs none), "hy" (hybrid, a budget of about half the states)
    through it; both trained (1 epoch) and exported against it."""
    tmp = tmp_path_factory.mktemp("storage-modes")
    service = Service(tmp)
    env = {**os.environ, **OFFLINE, "EYRIE_REDIS_URL": redis_server.replace("/0", "/6"),
           "EYRIE_STORE_URL": f"file://{tmp / 'store'}", "EYRIE_CACHE_DIR": str(tmp / "cache"),
           "EYRIE_INFERENCE_URL": tiny_server.url, "EYRIE_SERVE_DEADLINE_S": str(START_S),
           "EYRIE_MODEL": str(TINY)}  # the target named: a server at EYRIE_INFERENCE_URL does not say which it is
    env.pop("EYRIE_EXTRACT_VLLM_URL", None)  # the published server, as in the stack
    try:
        store = _generate(env, tmp)
        _extract(env, "on", "--storage", "online")
        need = RunManifest.model_validate(store.get_json(Layout("on").manifest)).extract.projected_bytes
        service.ready()
        service.publish(redis.Redis.from_url(env["EYRIE_REDIS_URL"]))
        before_hybrid = service.requests_served()
        _extract(env, "hy", "--storage", "hybrid", "--budget", f"{need // 2}B")
        before_training = service.requests_served()
        for run in ("on", "hy"):
            _train(env, run, "--epochs", "1", "--seq-len", "256")
        with HighWater({f"{what} {run}": path for run in ("on", "hy") for what, path in (
                ("bucket", Path(store.root) / Layout(run).root / "extract" / "shards"),
                ("cache", tmp / "cache" / "runs" / run / "data" / "train" / "hidden_states"))}
                | {"service": service.shared}) as peaks:
            eyrie("worker", "train", "--burst", env=env, timeout=600)
        yield {"env": env, "store": store, "service": service, "need": need, "peaks": peaks,
               "requests": {"before_hybrid": before_hybrid, "hybrid_extract": before_training - before_hybrid,
                            "training": service.requests_served() - before_training}}
    finally:
        service.stop()


class HighWater:
    """The most bytes each folder held, sampled every 0.1 s while the block runs."""

    def __init__(self, folders: dict[str, Path]):
        self.folders, self.peaks, self.done = folders, dict.fromkeys(folders, 0), threading.Event()
        self.thread = threading.Thread(target=self._sample, daemon=True)

    def __enter__(self) -> dict[str, int]:
        self.thread.start()
        return self.peaks

    def __exit__(self, *exc) -> None:
        self.done.set()
        self.thread.join()

    def _sample(self) -> None:
        while True:
            for name, folder in self.folders.items():
                self.peaks[name] = max(self.peaks[name], _bytes_in(folder))
            if self.done.wait(0.1):
                return


def _bytes_in(folder: Path) -> int:
    """Its tensor files' bytes (not the shard manifests beside them, nor the target's greedy tokens
    the trainer keeps for evaluation: greedy.safetensors, token ids, no hidden state)."""
    total = 0
    for path in folder.rglob("*") if folder.exists() else ():
        with contextlib.suppress(FileNotFoundError):  # read and deleted in between
            # a held-out sample's states are hard-linked into the training folder for speculators'
            # validation split (fetched once, for evaluation): they are no training sample's states
            stat = path.stat()
            counted = path.is_file() and path.suffix != ".json" and path.name != "greedy.safetensors"
            total += stat.st_size if counted and stat.st_nlink == 1 else 0
    return total


def _train(env: dict, run: str, *options: str) -> None:
    eyrie("train", "--run", run, *options, "--lr", "3e-3", "--draft-vocab", "500", "--heldout", str(HELDOUT),
          env=env)


def _generate(env: dict, tmp: Path):
    """Run "g" generated, its generate stage cloned into "on" and "hy" (the same shard objects)."""
    prompts = tmp / "prompts.jsonl"
    prompts.write_text("".join(TRAIN_PROMPTS.read_text().splitlines(keepends=True)[:PROMPTS]))
    eyrie("generate", "--dataset", str(prompts), "--run", "g", "--concurrency", "6", "--max-tokens", "48",
          "--shard-size", str(PROMPTS // 2), env=env)
    eyrie("worker", "generate", "--burst", env=env, timeout=600)
    store = open_store(load_settings(store_url=env["EYRIE_STORE_URL"], redis_url=env["EYRIE_REDIS_URL"]))
    source = Layout("g")
    for run in ("on", "hy"):
        store.put_json(Layout(run).manifest, {**store.get_json(source.manifest), "run": run})
        for shard in (0, 1):
            generated = store.get_json(source.generate_shard_manifest(shard))
            store.put_json(Layout(run).generate_shard_manifest(shard), {**generated, "run": run})
    return store


def _extract(env: dict, run: str, *storage: str) -> None:
    eyrie("extract", "--run", run, "--backend", "vllm", "--layers", ",".join(map(str, LAYERS)),
          "--max-length", "200", *storage, env=env)
    eyrie("worker", "extract", "--burst", env=env, timeout=600)


def _shards(store, run: str) -> list[ShardManifest]:
    return [ShardManifest.model_validate(store.get_json(Layout(run).extract_shard_manifest(i))) for i in (0, 1)]


def _object_keys(store, sample: dict) -> set[str]:
    path = Path(store.root) / sample["key"]
    with safe_open(str(path), "pt") as tensors:
        return set(tensors.keys())


def _status(run: str, env: dict) -> dict:
    return json.loads(eyrie("status", run, "--json", env=env).stdout)["stages"]


def _assert_trained_and_exported(runs: dict, run: str) -> dict:
    """The train stage done (steps, a loss), its best checkpoint exported; the service's files gone."""
    store, env = runs["store"], runs["env"]
    train = _status(run, env)["train"]
    assert train["state"] == "done" and train["done"] > 0 and train["loss"] > 0, train
    drafter = store.get_json(Layout(run).drafter_manifest)
    assert set(drafter["files"]) == {"config.json", "model.safetensors"} and drafter["tau"] >= 1.0
    assert not list(runs["service"].shared.iterdir())  # every file the service wrote was read and deleted
    return train


def _accounted(shards: list[ShardManifest]) -> None:
    """Every generated sample is done, skipped or failed, once."""
    for shard in shards:
        assert shard.counts.done + shard.counts.skipped + shard.counts.failed == shard.counts.total
        assert shard.counts.done == len(shard.samples)
    assert sum(s.counts.total for s in shards) == PROMPTS


def test_online_stores_no_hidden_states_and_training_asks_the_service(runs):
    store = runs["store"]
    params = RunManifest.model_validate(store.get_json(Layout("on").manifest)).extract
    assert (params.storage, params.shard_allowance_bytes) == ("online", None)
    shards = _shards(store, "on")
    _accounted(shards)
    samples = [e for s in shards for e in s.samples]
    assert samples and all(e["states"] is False for e in samples)
    assert all(_object_keys(store, e) == {"token_ids"} for e in samples)  # no hidden-state tensor in the bucket
    assert sum(s.bytes for s in shards) == sum(e["bytes"] for e in samples) < runs["need"] / 20
    assert runs["requests"]["before_hybrid"] == 0  # extracted before the service was up: it needed none

    train = _assert_trained_and_exported(runs, "on")
    on_demand = len(samples) - HELDOUT
    assert any(f"({on_demand} on demand from the extraction service" in n for n in train["notes"]), train["notes"]
    assert any(f"{HELDOUT} held-out samples' states fetched from the extraction service" in n for n in train["notes"])
    peaks = runs["peaks"]  # sampled while both runs trained
    assert peaks["cache on"] == 0  # the trainer's cache held no hidden states at any moment
    assert 0 < peaks["bucket on"] == sum(e["bytes"] for e in samples)  # token ids alone, nothing added
    assert 0 < peaks["service"] < runs["need"] / 3  # a few samples' states at a time, each deleted once read


def test_hybrid_stores_states_within_the_budget_and_training_asks_for_the_rest(runs):
    store = runs["store"]
    params = RunManifest.model_validate(store.get_json(Layout("hy").manifest)).extract
    assert params.storage == "hybrid" and params.budget_bytes == runs["need"] // 2
    assert params.shard_allowance_bytes == params.budget_bytes // 2
    shards = _shards(store, "hy")
    _accounted(shards)
    kept = [[e for e in s.samples if e.get("states", True)] for s in shards]
    for shard_kept in kept:
        assert sum(e["bytes"] for e in shard_kept) <= params.shard_allowance_bytes
    assert sum(e["bytes"] for k in kept for e in k) <= params.budget_bytes
    samples = [e for s in shards for e in s.samples]
    ids_only = [e for e in samples if e.get("states") is False]
    assert kept[0] and kept[1] and ids_only  # both kinds
    assert all(_object_keys(store, e) == {"hidden_states", "token_ids"} for k in kept for e in k)
    assert all(_object_keys(store, e) == {"token_ids"} for e in ids_only)
    assert runs["requests"]["hybrid_extract"] == sum(len(k) for k in kept)  # the service forwarded those alone

    train = _assert_trained_and_exported(runs, "hy")
    held = heldout_ids(samples, HELDOUT)
    on_demand, held_on_demand = [sum(1 for e in ids_only if (e["sample_id"] in held) == h) for h in (False, True)]
    assert any(f"({on_demand} on demand from the extraction service" in n for n in train["notes"]), train["notes"]
    # training asked the service for each on-demand sample once (1 epoch), the held-out ones once,
    # and for no stored one: online's all, hybrid's rest
    assert runs["requests"]["training"] == PROMPTS + on_demand + held_on_demand, runs["requests"]
    # the high-water marks while it trained: the bucket and the trainer's cache within the budget,
    # the cache holding the stored part alone (nothing generated kept)
    stored = sum(e["bytes"] for k in kept for e in k)
    peaks = runs["peaks"]
    assert peaks["bucket hy"] <= params.budget_bytes and peaks["cache hy"] <= params.budget_bytes
    assert peaks["cache hy"] == sum(e["bytes"] for k in kept for e in k if e["sample_id"] not in held) > 0
    assert stored <= params.budget_bytes


def _on_demand_training(runs, run: str) -> tuple[int, int]:
    """(on-demand training samples, on-demand held-out samples) of a run."""
    samples = [e for s in _shards(runs["store"], run) for e in s.samples]
    held = heldout_ids(samples, HELDOUT)
    ids_only = [e for e in samples if e.get("states") is False]
    return sum(e["sample_id"] not in held for e in ids_only), sum(e["sample_id"] in held for e in ids_only)


def _train_worker(env: dict, log: Path) -> subprocess.Popen:
    return subprocess.Popen([str(BIN / "eyrie"), "worker", "train"], env=env, stdout=log.open("a"),
                            stderr=subprocess.STDOUT, start_new_session=True)


def _finish(env: dict, run: str, worker: subprocess.Popen) -> dict:
    try:
        wait_for(lambda: _status(run, env)["train"]["state"] in ("done", "failed"), f"run {run} trained", 900, 1)
    finally:
        os.killpg(worker.pid, signal.SIGKILL)
        worker.wait()
    return _status(run, env)["train"]


def _live(env: dict, run: str) -> dict:
    """The train task's live progress, straight from Redis (a status command takes too long here)."""
    tasks = progress.read(redis.Redis.from_url(env["EYRIE_REDIS_URL"]), run, "train")
    return next(iter(tasks.values()), {})


def _states_files(folder: Path) -> dict[str, tuple[int, int]]:
    return {p.name: (p.stat().st_mtime_ns, p.stat().st_size) for p in folder.glob("hs_*.safetensors")}


def test_a_trainer_killed_mid_epoch_resumes_without_asking_twice_or_fetching_its_cache_again(runs, tmp_path):
    """Hybrid, 2 epochs: SIGTERM (`docker stop`) while the trainer waits for epoch 0's last on-demand
    sample (a step or more done, the epoch not); the retried task resumes there: the service is asked
    once per on-demand sample per epoch (give or take the batch in flight at the kill), the stored
    states in the trainer's cache are not fetched again."""
    env, service = runs["env"], runs["service"]
    clone_run(runs["store"], "hy", "kill")
    on_demand, held_on_demand = _on_demand_training(runs, "kill")
    assert on_demand >= 4  # the premise: epoch 0's last on-demand sample comes after its first step
    gate = Gate(service.url, hold_at=held_on_demand + on_demand, forward_held=False)
    service.route_through(gate.url)
    try:
        _train(env, "kill", "--epochs", "2", "--seq-len", "64")
        start = service.requests_served()
        worker = _train_worker(env, tmp_path / "worker.log")
        wait_for(gate.holding.is_set, "training at epoch 0's last on-demand sample", 600, 0.05)
        worker.send_signal(signal.SIGTERM)
        assert worker.wait(120) == 0  # the worker itself stops, after the checkpoint
        first = service.requests_served() - start - held_on_demand
        saved = runs["store"].get_json(Layout("kill").checkpoint_manifest("0"))
        assert (saved["epoch"], saved["local_step"] > 0) == (0, True), saved
        cache = Path(env["EYRIE_CACHE_DIR"]) / "runs" / "kill" / "data" / "train" / "hidden_states"
        cached = _states_files(cache)
        assert cached  # the stored part, fetched by the first attempt

        gate.release.set()
        resumed_from = service.requests_served()
        train = _finish(env, "kill", _train_worker(env, tmp_path / "worker.log"))
        second = service.requests_served() - resumed_from
    finally:
        service.route_through(service.url)
        gate.close()
    assert train["state"] == "done" and train["dropped"] == 0, train
    assert any(f"resuming from checkpoint 0 (step {saved['local_step']} of epoch 0)" in n for n in train["notes"])
    assert _states_files(cache) == cached  # nothing in the cache fetched or written again
    assert second < 2 * on_demand  # epoch 0's trained batches were skipped, not asked again
    assert 2 * on_demand <= first + second <= 2 * on_demand + 2, (first, second, on_demand)
    assert train["charts"]["ttt"]["steps"] == list(range(1, train["done"] + 1))  # no step twice


def test_training_waits_out_an_extraction_service_outage(runs, tmp_path):
    """Online, 1 epoch: vLLM stops while the trainer waits for its third training sample's states
    and comes back a while later on the same address; training waits (speculators' retries), then
    goes on; no sample is left out. The trainer is held at that sample (a Gate) while vLLM stops:
    left running, on a fast host it asked for its last samples before the stop landed, and the
    outage tested nothing."""
    env, service = runs["env"], runs["service"]
    clone_run(runs["store"], "on", "out")
    gate = Gate(service.url, hold_at=HELDOUT + 3)
    service.route_through(gate.url)
    try:
        _train(env, "out", "--epochs", "1", "--seq-len", "64")
        worker = _train_worker(env, tmp_path / "worker.log")
        try:
            wait_for(gate.holding.is_set, "training at its third sample", 600, 0.05)
            time.sleep(1)  # the trainer waits on the gate: its next report (0.5 s apart) says where
            during = _live(env, "out")
            assert during["step"] <= during["total_steps"] - 3, f"held too late to leave samples to ask: {during}"
            service.outage()
        finally:
            gate.release.set()  # the held request goes on to the stopped service: its connection is closed
        time.sleep(10)
        after = _status("out", env)["train"]
        # at most the step whose samples it was fetching, and a report behind
        assert worker.poll() is None and after["state"] != "failed" and after["done"] <= during["step"] + 2, after
        service.start()
        service.ready()
        train = _finish(env, "out", worker)
    finally:
        service.route_through(service.url)
        gate.close()
    assert train["state"] == "done" and train["dropped"] == 0 and not train["errors"], train
    # the restarted service made the rest (vLLM's counter of the stopped process can lag its last
    # answers, so the two processes' counts are not summed); dropped == 0: every sample was trained
    assert service.requests_served() > service.served_before
    assert train["charts"]["ttt"]["steps"] == list(range(1, train["done"] + 1))  # no step twice or missed
    assert not list(service.shared.iterdir())  # the cut-off request's file went with the restart
