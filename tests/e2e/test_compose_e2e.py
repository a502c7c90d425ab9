"""The Compose stack for real: our images, built from our Dockerfiles (`make compose-e2e` builds
them first), brought up from docker-compose.yml + compose.ci.yml (the CPU stand-ins, see that file)
on a Docker engine of this machine; `make run CONFIG=examples/run.tiny.vllm.yaml` through it the way
a GPU host runs it (vLLM, its CPU build, serves, extracts and verifies) to an exported drafter with
vLLM's acceptance in the manifest, a generator SIGKILLed mid-run then scaled to 2, a second run right
after it (online, trained from the extraction service) on the same inference service, two runs on two
targets at once (the second started while the first generates waits its turn at the inference
service), `down` then `up` again, and the stack's network checked from inside (Redis needs its
password; only api and inference are published)."""

import json
import os
import secrets
import shutil
import subprocess
import time

import pytest
import requests
import yaml

from tests.support.harness import ROOT, wait_for
from tests.support.processes import free_port
from tests.support.tls_index import WheelIndex, bridge_gateway, download_wheels, make_ca

PROJECT = "eyrie-e2e"
CONFIG = "examples/run.tiny.vllm.yaml"
RUN = "tiny-vllm"  # its run
ONLINE = "tiny-online"  # the same, 40 prompts, with extract.storage online
FIRST, OTHER = "tiny-first", "tiny-other"  # two runs at once: on the tiny target, and on another one
OTHER_TARGET = "assets/tiny-target-b"  # the tiny target with one config key more, built by its test
IMAGES = ["eyrie-generator:local", "eyrie-api:local", "eyrie-extractor:local", "eyrie-trainer:local",
          "eyrie-vllm-cpu:local", "eyrie-inference:local", "eyrie-ci-redis:local", "eyrie-ci-s3:local"]
TIMINGS: dict[str, float] = {}


class Stack:
    def __init__(self, work):
        self.work, self.token = work, secrets.token_hex(16)
        self.api_port, self.inference_port = free_port(), free_port()
        self.redis_password = secrets.token_hex(16)
        for name in ("data", "models"):
            (work / name).mkdir()
        cache = work / "trainer-cache"
        cache.mkdir()
        os.chown(cache, 10001, 10001)  # the trainer runs as uid 10001
        self.env_file = work / "stack.env"
        self.env_file.write_text("\n".join([
            f"EYRIE_REDIS_PASSWORD={self.redis_password}", f"EYRIE_S3_ACCESS_KEY=eyrie-{secrets.token_hex(4)}",
            f"EYRIE_S3_SECRET_KEY={secrets.token_hex(16)}", f"EYRIE_API_TOKEN={self.token}",
            "EYRIE_BUCKET=eyrie", f"EYRIE_DATA_DIR={work / 'data'}", f"EYRIE_MODELS_DIR={work / 'models'}",
            f"EYRIE_TRAINER_CACHE_DIR={cache}", "EYRIE_MODEL=/opt/eyrie/assets/tiny-target",
            f"EYRIE_API_PORT={self.api_port}", f"EYRIE_INFERENCE_PORT={self.inference_port}", ""]))
        self.files = ["--env-file", str(self.env_file), "-f", "docker-compose.yml", "-f", "compose.ci.yml"]
        self.env = {**os.environ, "COMPOSE_PROJECT_NAME": PROJECT}

    def compose(self, *args: str, check: bool = True, timeout: float = 600) -> subprocess.CompletedProcess:
        proc = subprocess.run(["docker", "compose", *self.files, *args], cwd=ROOT, env=self.env,
                              capture_output=True, text=True, timeout=timeout)
        if check and proc.returncode != 0:
            raise AssertionError(f"docker compose {' '.join(args)} -> {proc.returncode}\n{proc.stdout}\n{proc.stderr}")
        return proc

    def api(self, path: str):
        response = requests.get(f"http://127.0.0.1:{self.api_port}{path}", timeout=30,
                                headers={"Authorization": f"Bearer {self.token}"})
        response.raise_for_status()
        return response.json()

    def up(self) -> float:
        started = time.monotonic()
        self.compose("up", "-d")  # inference starts vLLM once a run is to generate (`--run active`)
        wait_for(lambda: self._answers(f"http://127.0.0.1:{self.api_port}/healthz"), "the api", timeout=300, every=1)
        return time.monotonic() - started

    @staticmethod
    def _answers(url: str) -> bool:
        try:
            return requests.get(url, timeout=5).status_code == 200
        except requests.RequestException:
            return False

    def diagnosis(self) -> str:
        """What a failed wait shows: the run's state and the last lines of the services it waits on."""
        logs = self.compose("logs", "--no-color", "--tail=60", "generator", "inference", "extract-server",
                            "extractor", "verifier", "api", check=False)
        try:
            state = json.dumps(self.run_state(), indent=1)
        except requests.RequestException as exc:
            state = f"(the API did not answer: {exc})"
        return f"run state: {state}\n{logs.stdout[-12000:]}"

    def run_state(self, run: str = RUN) -> dict:
        return next((r for r in self.api("/runs") if r["run"] == run), {})

    def make_run(self, config: str) -> subprocess.CompletedProcess:
        files = " ".join(self.files)
        return subprocess.run(["make", "-s", "run", f"CONFIG={config}", f"COMPOSE_FILES={files}"], cwd=ROOT,
                              env=self.env, capture_output=True, text=True, timeout=600)


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    missing = [i for i in IMAGES if subprocess.run(["docker", "image", "inspect", i],
                                                   capture_output=True).returncode != 0]
    assert not missing, f"images {missing} are not built: run `make compose-e2e` (it builds them first)"
    s = Stack(tmp_path_factory.mktemp("stack"))
    s.compose("down", "--volumes", "--remove-orphans", check=False)  # an earlier, interrupted run
    TIMINGS["up"] = s.up()
    yield s
    logs = s.compose("logs", "--no-color", "--tail=200", check=False).stdout
    (tmp_path_factory.getbasetemp() / "stack.log").write_text(logs)
    s.compose("down", "--volumes", "--remove-orphans", check=False)


# pytest's 600 s default cut the test's own bounds (300 + 1200 + 900 s) short when the stack ran beside the
# rest of the suite (`make test`): 228 s alone, over 600 s beside two pytest processes
@pytest.mark.timeout(2400)
def test_make_run_through_the_stack_survives_a_killed_generator_and_scales(stack, capsys):
    started = time.monotonic()
    result = stack.make_run(CONFIG)
    assert result.returncode == 0 and f"run {RUN}:" in result.stdout, result.stdout + result.stderr
    generate = lambda: stack.run_state().get("stages", {}).get("generate", {})  # noqa: E731
    try:
        wait_for(lambda: generate().get("done", 0) >= 1, "a first generated sample", timeout=300, every=1)
    except AssertionError as exc:
        raise AssertionError(f"{exc}\n{stack.diagnosis()}") from None
    assert generate()["done"] < generate()["total"], "generation ended before the kill: grow the run"
    stack.compose("kill", "-s", "SIGKILL", "generator")  # mid-run
    stack.compose("up", "-d", "--no-deps", "--scale", "generator=2", "generator")  # back, and a second one
    assert len(stack.compose("ps", "-q", "generator").stdout.split()) == 2
    try:
        final = wait_for(lambda: (r := stack.run_state()).get("state") in ("done", "failed", "cancelled") and r,
                         "the run to end", timeout=1200, every=3)
    except AssertionError as exc:
        raise AssertionError(f"{exc}\n{stack.diagnosis()}") from None
    TIMINGS["make run to an exported drafter"] = time.monotonic() - started
    assert final["state"] == "done", json.dumps(final, indent=1) + stack.diagnosis()
    manifest = stack.api(f"/runs/{RUN}/manifest")
    assert manifest["drafter"], "no drafter exported"
    assert manifest["extract"]["backend"] == "vllm"  # the hidden states came from the vLLM extraction service
    verify = wait_for(lambda: stack.api(f"/runs/{RUN}/manifest")["verify"], "the verifier's vLLM measure",
                      timeout=900, every=5)
    TIMINGS["verified"] = time.monotonic() - started
    assert verify.get("vllm_acceptance_length") and verify["vllm_drafts"] > 0, verify
    assert verify["identical_outputs"] is True and verify["prompts"] == 20, verify
    audit = stack.api(f"/runs/{RUN}/audit")
    assert {f["stage"] for f in audit} >= {"generate", "extract", "train"}, audit
    for figure in audit:
        accounted = figure["done"] + figure["skipped"] + figure["failed"]
        assert figure["lost"] == figure["duplicated"] == figure["pending"] == 0, figure
        assert figure["samples_in"] > 0 and accounted == figure["samples_in"], figure
    assert audit[0]["samples_in"] == 306  # every prompt of tests/data/tiny_train_prompts.jsonl
    with capsys.disabled():
        print(f"\n[compose-e2e] {', '.join(f'{k}: {v:.0f} s' for k, v in TIMINGS.items())}")


@pytest.mark.timeout(2400)  # its own bounds: 1200 + 120 + 900 s (see above)
def test_an_online_run_trains_from_the_extraction_service_in_the_stack(stack, tmp_path):
    """extract.storage online (issue 23) through the stack: the bucket gets token ids alone, and the
    trainer container asks the extract-server container's vLLM for every sample's hidden states in
    each epoch (over the stack's network, the states through the shared volume); the server serves
    the run until its drafter is trained, then stops. No sample is dropped. Second, right after the
    first run, in the same stack: the inference service serves run after run (issue 29 item 1),
    without Compose restarting it, and the second run ends verified by vLLM as the first does."""
    body = yaml.safe_load((ROOT / CONFIG).read_text())
    body.update(run=ONLINE, dataset={**body["dataset"], "limit": 40})  # verified, as the first run is
    body["generate"]["shard_size"] = 20
    body["extract"]["storage"] = "online"
    body["train"]["epochs"] = 2
    config = tmp_path / "online.yaml"
    config.write_text(yaml.safe_dump(body))
    started = time.monotonic()
    result = stack.make_run(str(config))
    assert result.returncode == 0 and f"run {ONLINE}:" in result.stdout, result.stdout + result.stderr
    try:
        final = wait_for(lambda: (r := stack.run_state(ONLINE)).get("state") in ("done", "failed", "cancelled") and r,
                         "the online run to end", timeout=1200, every=3)
    except AssertionError as exc:
        raise AssertionError(f"{exc}\n{stack.diagnosis()}") from None
    TIMINGS["online run trained"] = time.monotonic() - started
    assert final["state"] == "done", json.dumps(final, indent=1) + stack.diagnosis()
    full = stack.api(f"/runs/{ONLINE}")  # the whole status: the list's summary has counts alone
    train, extract = full["stages"]["train"], full["stages"]["extract"]
    assert train["dropped"] == 0 and not train["errors"], train
    manifest = stack.api(f"/runs/{ONLINE}/manifest")
    assert manifest["drafter"] and manifest["extract"]["storage"] == "online", manifest["extract"]
    assert extract["on_demand"] == extract["done"] > 0, extract  # every sample stored as its token ids alone
    # it stops once the run is trained, seen at its next look at the run, seconds after the run is done; a
    # run that finished is always said trained (serve-extract reads can_go_on before the drafter's record)
    stops = [f"run {ONLINE} is trained: stopping vLLM"]

    def logs() -> str:
        return stack.compose("logs", "--no-color", "extract-server").stdout

    try:
        wait_for(lambda: any(stop in logs() for stop in stops), "the extract-server to stop vLLM", timeout=120, every=3)
    except AssertionError as exc:
        raise AssertionError(f"{exc}\n{logs()[-4000:]}") from None
    inference = stack.compose("ps", "-q", "inference").stdout.split()
    restarts = subprocess.run(["docker", "inspect", "-f", "{{.State.Status}} {{.RestartCount}}", *inference],
                              capture_output=True, text=True).stdout.split()
    assert restarts == ["running", "0"], restarts  # the same process waits for the next run
    verify = wait_for(lambda: stack.api(f"/runs/{ONLINE}/manifest")["verify"], "the second run's vLLM verify",
                      timeout=900, every=5)
    TIMINGS["online run verified"] = time.monotonic() - started
    assert verify.get("vllm_acceptance_length") and verify["vllm_drafts"] > 0, verify
    assert verify["identical_outputs"] is True, verify


def _other_target() -> str:
    """Another target (another revision) where every container reads the tiny one (the repository's
    assets/, mounted in each and in `make run`'s; git ignores it): the tiny target, one config key more."""
    other = ROOT / OTHER_TARGET
    shutil.copytree(ROOT / "assets" / "tiny-target", other, dirs_exist_ok=True)
    config = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**config, "eyrie_e2e_variant": 1}, indent=2))
    return OTHER_TARGET


def _tiny_variant(tmp_path, run: str, target: str, limit: int, concurrency: int, shards: int):
    """CONFIG as run `run` on `target`: `limit` prompts (not an earlier run's: nothing reused) in
    `shards` generate tasks, 2 epochs, no verify (the first runs measure it)."""
    body = yaml.safe_load((ROOT / CONFIG).read_text())
    body.update(run=run, target={"model": target}, dataset={**body["dataset"], "limit": limit},
                verify={"enabled": False})
    body["generate"].update(concurrency=concurrency, shard_size=-(-limit // shards))
    body["train"]["epochs"] = 2
    config = tmp_path / f"{run}.yaml"
    config.write_text(yaml.safe_dump(body))
    return str(config)


def _failed_attempts(stack, run: str) -> list[int]:
    """Each of the run's generate tasks' failed attempts (RQ's retries spent), read inside the stack."""
    probe = ("import json, os, redis\n"
             "from eyrie.work.queue import RETRY_INTERVALS_S, EyrieJob, JSONSerializer\n"
             "conn = redis.Redis.from_url(os.environ['EYRIE_REDIS_URL'])\n"
             f"ids = ['generate-{run}-00000', 'generate-{run}-00001']\n"
             "jobs = [EyrieJob.fetch(i, connection=conn, serializer=JSONSerializer) for i in ids]\n"
             "print(json.dumps([len(RETRY_INTERVALS_S) - (j.retries_left or 0) for j in jobs]))")
    return json.loads(stack.compose("exec", "-T", "api", "python", "-c", probe).stdout)


@pytest.mark.timeout(3300)  # its own bounds: 300 + 300 + 2 x 1200 s
def test_a_second_run_on_another_target_started_while_the_first_generates_finishes(stack, tmp_path):
    """Issue 41, item 2: `make run` returns after planning; a second run on another target, started
    while the first one generates, waits its turn at the stack's one inference service (its generate
    tasks hand themselves back, no attempt counted; its status names the run it waits for), is
    served once the first one's generation is done, and both runs finish. Before, its tasks failed
    after EYRIE_SERVE_DEADLINE_S each and after 4 attempts the run had failed."""
    # one task, one request at a time (minutes): the stack's other generator worker plans the second run
    first = _tiny_variant(tmp_path, FIRST, "assets/tiny-target", 300, 1, 1)
    other = _tiny_variant(tmp_path, OTHER, _other_target(), 40, 8, 2)
    started = time.monotonic()
    result = stack.make_run(first)
    assert result.returncode == 0 and f"run {FIRST}:" in result.stdout, result.stdout + result.stderr
    generate = lambda run: stack.run_state(run).get("stages", {}).get("generate", {})  # noqa: E731
    try:
        wait_for(lambda: generate(FIRST).get("done", 0) >= 1, "the first run's first sample", timeout=300, every=1)
        result = stack.make_run(other)
        assert result.returncode == 0 and f"run {OTHER}:" in result.stdout, result.stdout + result.stderr
        assert generate(FIRST)["done"] < generate(FIRST)["total"], "the first run's generation ended: grow it"
        waits = f"run {FIRST}'s generation holds it"
        wait_for(lambda: any(waits in w for w in stack.api(f"/runs/{OTHER}")["stages"]["generate"]["waiting_for"]),
                 "the second run's status naming the run it waits for", timeout=300, every=2)
        ended = {}
        for run in (FIRST, OTHER):
            ended[run] = wait_for(lambda: (r := stack.run_state(run)).get("state") in ("done", "failed", "cancelled")
                                  and r, f"run {run} to end", timeout=1200, every=3)
    except AssertionError as exc:
        raise AssertionError(f"{exc}\n{stack.diagnosis()}") from None
    TIMINGS["two runs on two targets"] = time.monotonic() - started
    assert {run: r["state"] for run, r in ended.items()} == {FIRST: "done", OTHER: "done"}, \
        json.dumps(ended, indent=1) + stack.diagnosis()
    assert _failed_attempts(stack, OTHER) == [0, 0]  # waiting its turn is no attempt
    assert stack.api(f"/runs/{OTHER}/manifest")["target"]["model"].endswith(OTHER_TARGET)
    log = stack.compose("logs", "--no-color", "inference").stdout
    assert f"run {OTHER} waits its turn" in log and f"serving run {OTHER}'s target" in log, log[-4000:]
    inference = stack.compose("ps", "-q", "inference").stdout.split()
    restarts = subprocess.run(["docker", "inspect", "-f", "{{.State.Status}} {{.RestartCount}}", *inference],
                              capture_output=True, text=True).stdout.split()
    assert restarts == ["running", "0"], restarts  # switched targets by itself, no crash, no restart


SERVICES = ("eyrie_generator", "eyrie_extractor", "eyrie_trainer", "eyrie_inference")
# the inference image runs vLLM for the services on the GPU box: the extraction server (the
# extractor's vLLM command and connector) and the verify Job (the trainer's verify)
SHIPS = {"eyrie-api:local": [], "eyrie-generator:local": ["eyrie_generator"],
         "eyrie-extractor:local": ["eyrie_extractor"], "eyrie-trainer:local": ["eyrie_trainer"],
         "eyrie-inference:local": ["eyrie_extractor", "eyrie_trainer", "eyrie_inference"]}


@pytest.mark.parametrize("image", sorted(SHIPS))
def test_each_image_ships_only_its_own_service_package(image):
    probe = f"import importlib.util as u; print(' '.join(m for m in {SERVICES!r} if u.find_spec(m)))"
    found = subprocess.run(["docker", "run", "--rm", "--entrypoint", "python3", image, "-c", probe],
                           capture_output=True, text=True, timeout=120)
    assert found.returncode == 0, found.stderr
    assert sorted(found.stdout.split()) == sorted(SHIPS[image]), found.stdout


def test_extract_started_through_the_apis_image_is_planned_on_the_extract_queue(stack):
    """POST /runs?stage=extract on the finished run, to the API's own image (no service package in
    it): checked there at once, then planned by the stack's extractor worker (its plan checked
    against, nothing missing, nothing enqueued)."""
    body = yaml.safe_load((ROOT / CONFIG).read_text())
    reply = requests.post(f"http://127.0.0.1:{stack.api_port}/runs?stage=extract", json=body, timeout=30,
                          headers={"Authorization": f"Bearer {stack.token}"})
    task = f"plan-extract-{RUN}-00000"
    assert reply.status_code == 202 and reply.json() == {"run": RUN, "stage": "extract", "enqueued": 0,
                                                         "planning": task}, reply.text
    probe = ("import json, os, redis\n"
             "from eyrie.work.queue import EyrieJob, JSONSerializer, task_result\n"
             "conn = redis.Redis.from_url(os.environ['EYRIE_REDIS_URL'])\n"
             f"job = EyrieJob.fetch('{task}', connection=conn, serializer=JSONSerializer)\n"
             f"print(json.dumps([job.origin, job.get_status().value, task_result(conn, '{task}')]))")
    origin, state, result = wait_for(
        lambda: (out := json.loads(stack.compose("exec", "-T", "api", "python", "-c", probe).stdout))[1] == "finished"
        and out, "the extractor's worker to plan it", timeout=120, every=2)
    assert origin == "eyrie-extract" and result["status"] == "planned" and result["enqueued"] == 0, result
    assert stack.run_state()["state"] == "done"


def test_the_run_and_its_objects_survive_down_and_up(stack):
    before = stack.api(f"/runs/{RUN}/audit"), stack.api(f"/runs/{RUN}/manifest")["drafter"]
    stack.compose("down")  # the containers go; the Redis AOF volume and the bucket's /data stay
    assert not stack.compose("ps", "-q").stdout.strip()
    TIMINGS["up again"] = stack.up()
    assert (stack.api(f"/runs/{RUN}/audit"), stack.api(f"/runs/{RUN}/manifest")["drafter"]) == before
    assert stack.run_state()["state"] == "done"
    files = " ".join(stack.files)  # `make status`: eyrie status inside the stack (Redis is not published)
    status = subprocess.run(["make", "-s", "status", f"RUN={RUN}", f"COMPOSE_FILES={files}"], cwd=ROOT,
                            env=stack.env, capture_output=True, text=True, timeout=120)
    assert status.returncode == 0 and RUN in status.stdout and "train" in status.stdout, status.stdout + status.stderr


def test_redis_needs_its_password_and_only_api_and_inference_are_published(stack):
    probe = ("import os, redis\n"
             "try:\n    redis.Redis(host='redis').ping(); print('open')\n"
             "except redis.exceptions.AuthenticationError as exc: print('refused', exc)\n"
             "print('with password', redis.Redis.from_url(os.environ['EYRIE_REDIS_URL']).ping())")
    out = stack.compose("exec", "-T", "api", "python", "-c", probe).stdout
    assert "refused" in out and "open" not in out and "with password True" in out, out
    published = {}
    for line in stack.compose("ps", "--format", "json").stdout.splitlines():
        for container in (json.loads(line) if line.startswith("[") else [json.loads(line)]):
            ports = {(p["URL"], p["PublishedPort"]) for p in container.get("Publishers") or [] if p["PublishedPort"]}
            if ports:
                published[container["Service"]] = ports
    assert published == {"api": {("127.0.0.1", stack.api_port)},
                         "inference": {("127.0.0.1", stack.inference_port)}}, published


def test_behind_the_tls_proxy_the_base_builds_only_with_the_ca_secret_and_keeps_it_out(tmp_path):
    """A package index behind TLS under a CA of the test's own (what a TLS-intercepting proxy or a
    private index gives pip), as PIP_INDEX_URL: with no wheelhouse, eyrie-base builds from it only when
    given that CA as the BuildKit secret `ca` (without it pip refuses the certificate), and no layer,
    file or variable of the image keeps the CA."""
    gateway = bridge_gateway()  # where the build's RUN steps reach this host
    (tmp_path / "wheels").mkdir()
    download_wheels(tmp_path / "wheels", ROOT / "wheelhouse", "setuptools>=68", "async-timeout>=4.0.3",
                    "-r", str(ROOT / "requirements" / "generator.txt"))
    ca, cert, key = make_ca(tmp_path, gateway)
    ca_line = ca.read_text().splitlines()[2]  # a line of the CA's body, to look for in the image
    context = tmp_path / "context"
    for part in ("services/base", "requirements"):
        shutil.copytree(ROOT / part, context / part)
    (context / "wheelhouse").mkdir()  # no wheels: pip goes to the index
    base = subprocess.run([str(ROOT / "scripts" / "base-image.sh")], capture_output=True, text=True,
                          check=True).stdout.strip()
    tags = ["eyrie-base-no-ca-test", "eyrie-base-ca-test"]
    try:
        with WheelIndex(gateway, tmp_path / "wheels", cert, key) as index:
            # NO_PROXY: a proxy the Docker client hands to builds must not take the index's connections
            build = ["docker", "build", "--progress=plain", "--no-cache", "--build-arg", f"BASE_IMAGE={base}",
                     "--build-arg", f"PIP_INDEX_URL={index.url}", "--build-arg", f"NO_PROXY={gateway}",
                     "--build-arg", f"no_proxy={gateway}", "-f", str(context / "services/base/Dockerfile"),
                     str(context)]
            without = subprocess.run([*build, "-t", tags[0]], capture_output=True, text=True, timeout=600)
            assert without.returncode != 0, "the build trusted the test CA without the secret"
            assert "CERTIFICATE_VERIFY_FAILED" in without.stderr, without.stderr[-3000:]
            assert index.refused and not any(p.startswith("/files/") for p in index.served), \
                (index.refused, index.served)  # it reached our index and refused our certificate
            with_ca = subprocess.run([*build, "--secret", f"id=ca,src={ca}", "-t", tags[1]],
                                     capture_output=True, text=True, timeout=900)
            assert with_ca.returncode == 0, with_ca.stderr[-3000:]
            assert any(p.startswith("/files/redis-") for p in index.served), index.served  # from our index
        probe = subprocess.run(["docker", "run", "--rm", tags[1], "sh", "-c",
                                "ls -A /run/secrets 2>/dev/null; env | grep -c -e PIP_CERT -e PIP_INDEX_URL; "
                                f"grep -rlsF -e '{ca_line}' / --exclude-dir=proc --exclude-dir=sys --exclude-dir=dev; "
                                "python -c 'import redis, rq, datasets; print(\"deps ok\")'"],
                               capture_output=True, text=True, timeout=300)
        assert probe.stdout.split() == ["0", "deps", "ok"], probe.stdout + probe.stderr
        history = subprocess.run(["docker", "history", "--no-trunc", tags[1]], capture_output=True, text=True,
                                 check=True).stdout
        assert "BEGIN CERTIFICATE" not in history and ca_line not in history and str(ca) not in history
    finally:
        subprocess.run(["docker", "image", "rm", "-f", *tags], capture_output=True)
