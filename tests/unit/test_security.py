"""Nothing read from Redis or the store is unpickled, checked statically over eyrie/ and services/:
no pickle-family module, no torch.load, eval, exec or unsafe yaml.load outside a short allow-list
(each entry says why it never sees data from Redis or the store), and every RQ queue, worker and
job fetch uses the JSON serializer. `assert_no_pickles` checks a store's objects themselves."""

from __future__ import annotations

import ast
import json
import os
from pathlib import Path

import pytest

from tests.support.harness import ROOT, TINY

CODE = [p for d in ("eyrie", "services") for p in sorted((ROOT / d).rglob("*.py"))]

UNSAFE_MODULES = {"pickle", "cPickle", "_pickle", "dill", "joblib", "cloudpickle", "shelve", "marshal", "pickletools"}
UNSAFE_CALLS = {"torch.load", "eval", "exec", "yaml.load", "yaml.unsafe_load", "yaml.full_load", "yaml.load_all",
                "yaml.unsafe_load_all", "numpy.load", "np.load", "pandas.read_pickle", "pd.read_pickle",
                "torch.serialization.load", "pickle.loads", "pickle.load"}
SAFE_YAML_LOADERS = {"SafeLoader", "CSafeLoader", "yaml.SafeLoader", "yaml.CSafeLoader"}
RQ_CALLS = {"Queue", "Worker", "SimpleWorker", "worker_class", "Job.fetch", "Job.fetch_many", "Job.create",
            "Worker.all", "SimpleWorker.all"}

# (file, call) -> why it is safe. Exact: each entry must match exactly once.
ALLOWED = {
    ("services/trainer/eyrie_trainer/tensorfile.py", "torch.load"):
        "split(): the optimizer/scheduler state speculators torch.save'd on this host a moment ago, read "
        "(weights_only=True) to turn it into safetensors + JSON before upload; never an object from the store",
}

PICKLE_MAGIC = (b"PK\x03\x04", b"\x80\x02", b"\x80\x03", b"\x80\x04", b"\x80\x05")


def dotted(node: ast.AST) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return f"{dotted(node.value)}.{node.attr}"
    return "?"


def findings(path: Path) -> list[tuple[str, int, str]]:
    """(kind, line, what) for every unsafe import, unsafe call, and RQ call without a serializer."""
    tree, found = ast.parse(path.read_text(), str(path)), []
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
            found += [("import", node.lineno, n) for n in names if n.split(".")[0] in UNSAFE_MODULES]
        elif isinstance(node, ast.Call):
            name, keywords = dotted(node.func), {k.arg: k.value for k in node.keywords}
            if name in UNSAFE_CALLS and not _safe_call(name, keywords):
                found.append(("call", node.lineno, name))
            if name in RQ_CALLS and "serializer" not in keywords:
                found.append(("rq-without-json-serializer", node.lineno, name))
    return found


def _safe_call(name: str, keywords: dict) -> bool:
    if name.startswith("yaml.") and name != "yaml.unsafe_load":
        return dotted(keywords["Loader"]) in SAFE_YAML_LOADERS if "Loader" in keywords else False
    if name in ("numpy.load", "np.load"):
        allow = keywords.get("allow_pickle")
        return allow is None or (isinstance(allow, ast.Constant) and allow.value is False)
    return False


def test_no_unpickling_of_anything_read_from_redis_or_the_store():
    assert len(CODE) > 30  # the scan sees the code
    seen, problems = {}, []
    for path in CODE:
        rel = path.relative_to(ROOT).as_posix()
        for kind, line, what in findings(path):
            if (rel, what) in ALLOWED and kind == "call":
                seen[(rel, what)] = seen.get((rel, what), 0) + 1
            else:
                problems.append(f"{rel}:{line}: {kind} {what}")
    assert problems == [], "unsafe deserialization (or RQ without JSONSerializer):\n" + "\n".join(problems)
    assert seen == {key: 1 for key in ALLOWED}, f"allow-list out of date: {seen}"


@pytest.mark.parametrize("source, expected", [
    ("import pickle", ["import pickle"]),
    ("from joblib import load", ["import joblib"]),
    ("import dill.settings", ["import dill.settings"]),
    ("import torch\ntorch.load(p)", ["call torch.load"]),
    ("x = eval(s)", ["call eval"]),
    ("model.eval()", []),
    ("import yaml\nyaml.load(s)", ["call yaml.load"]),
    ("import yaml\nyaml.load(s, Loader=yaml.SafeLoader)", []),
    ("import yaml\nyaml.safe_load(s)", []),
    ("import numpy as np\nnp.load(p, allow_pickle=True)", ["call np.load"]),
    ("import numpy as np\nnp.load(p)", []),
    ("Queue('q', connection=c)", ["rq-without-json-serializer Queue"]),
    ("Job.fetch(i, connection=c, serializer=JSONSerializer)", []),
    ("Worker.all(queue=q)", ["rq-without-json-serializer Worker.all"]),
])
def test_the_scan_catches_what_it_looks_for(tmp_path, source, expected):
    path = tmp_path / "m.py"
    path.write_text(source + "\n")
    assert [f"{kind} {what}" for kind, _, what in findings(path)] == expected


def assert_no_pickles(store, prefix: str) -> int:
    """No object under `prefix` is a pickle or a torch zip; every .safetensors object parses as one.
    Returns how many objects were checked."""
    from safetensors.torch import load

    keys = store.list(prefix)
    for key in keys:
        data = store.get_bytes(key)
        if key.endswith(".safetensors"):
            load(data)  # raises unless it is a safetensors file (whose header length may start with 0x80)
        else:
            assert not data.startswith(PICKLE_MAGIC), f"{key} is a pickle"
            assert b"PK\x03\x04" not in data[:1024], f"{key} holds a zip (torch.save) header"
    return len(keys)


# ---------------------------------------------------------------------------------------------
# secrets never in logs, status, responses, Redis or the store


@pytest.fixture
def secrets_env(stub_server, tmp_path):
    """A Redis with a password, an S3 server for random keys and an API token, each a distinctive
    random value."""
    import secrets as random
    import shutil
    import subprocess

    import redis

    from tests.support.harness import OFFLINE
    from tests.support.processes import free_port, stop

    values = {"redis": f"rp{random.token_hex(12)}", "access": f"AK{random.token_hex(8)}",
              "secret": f"sk{random.token_hex(16)}", "token": f"tk{random.token_hex(16)}"}
    port = free_port()
    proc = subprocess.Popen([shutil.which("redis-server"), "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                             "--appendonly", "no", "--requirepass", values["redis"], "--dir", str(tmp_path)],
                            stdout=subprocess.DEVNULL)
    url = f"redis://:{values['redis']}@127.0.0.1:{port}/0"
    wait_redis(redis.Redis.from_url(url))
    from tests.support import seaweed

    s3, s3_server = seaweed.start(tmp_path / "s3", values["access"], values["secret"])
    env = {**os.environ, **OFFLINE, "EYRIE_REDIS_URL": url, "EYRIE_STORE_URL": f"s3://sec-{port}/pre",
           "EYRIE_S3_ENDPOINT": s3_server, "EYRIE_S3_ACCESS_KEY": values["access"],
           "EYRIE_S3_SECRET_KEY": values["secret"], "EYRIE_INFERENCE_URL": stub_server(tokens=4),
           "EYRIE_SERVER": "vllm", "EYRIE_RETRY_BACKOFF_S": "0.05", "EYRIE_MODEL": str(TINY)}
    yield env, values
    stop(proc)
    stop(s3)


def wait_redis(conn) -> None:
    import time

    import redis

    for _ in range(100):
        try:
            conn.ping()
            return
        except redis.ConnectionError:
            time.sleep(0.05)


def test_secrets_never_appear_in_output_status_responses_redis_or_the_store(secrets_env, tmp_path):
    import requests

    from tests.support.harness import eyrie
    from tests.support.processes import stop
    from tests.integration.test_api import prompts, run_config, start_api

    env, values = secrets_env
    seen: dict[str, str] = {}  # what was said, by where it was said
    auth = {"Authorization": f"Bearer {values['token']}"}
    cli = lambda name, *args, **kw: seen.__setitem__(name, _said(eyrie(*args, env=env, **kw)))  # noqa: E731
    cli("generate", "generate", "--dataset", prompts(tmp_path / "p.jsonl", 6), "--run", "sec", "--shard-size", "3")
    api, url = start_api(env, EYRIE_API_TOKEN=values["token"])
    try:
        started = requests.post(f"{url}/runs", json=run_config("secapi", prompts(tmp_path / "q.jsonl", 4)),
                                headers=auth)
        assert started.status_code == 202, started.text
        cli("worker", "worker", "generate", "--burst")
        for path in ("/runs", "/runs/sec", "/runs/secapi", "/runs/sec/manifest", "/runs/sec/errors", "/metrics",
                     "/queues/generate", "/openapi.json", "/healthz", "/"):
            reply = requests.get(f"{url}{path}", headers=auth)
            assert reply.status_code == 200, path
            seen[f"GET {path}"] = reply.text
        seen["wrong token"] = requests.get(f"{url}/runs", headers={"Authorization": "Bearer nope"}).text
    finally:
        stop(api)
        seen["api process"] = api.stdout.read()
    assert json.loads(seen["GET /runs/sec"])["stages"]["generate"]["done"] == 6  # a real step ran ...
    assert "Started server process" in seen["api process"] and "generate" in seen["worker"]  # ... and was heard
    for args in (("status", "sec"), ("status", "sec", "--json"), ("status", "secapi", "--json"), ("runs", "--json"),
                 ("logs", "sec"), ("show", "sec", "--json")):
        cli(" ".join(args), *args)
    assert json.loads(seen["status sec --json"].split("\n--\n")[0])["stages"]["generate"]["done"] == 6
    _refusals(env, values, seen)
    seen.update(_redis_dump(env["EYRIE_REDIS_URL"]))
    seen.update(_store_dump(env))
    assert any(k.startswith("redis rq:job:") for k in seen) and any(k.endswith("manifest.json") for k in seen)
    leaks = [f"{name} in {where}" for where, text in seen.items() for name, value in values.items() if value in text]
    assert leaks == [], leaks


def _said(result) -> str:
    return f"{result.stdout}\n--\n{result.stderr}"


def _refusals(env: dict, values: dict, seen: dict) -> None:
    """The error paths: a wrong Redis password, an unreachable S3 endpoint, refused values."""
    from tests.support.harness import eyrie

    wrong = env["EYRIE_REDIS_URL"].replace(values["redis"], values["redis"][::-1])
    values["wrong redis password"] = values["redis"][::-1]
    refused = eyrie("status", "sec", env={**env, "EYRIE_REDIS_URL": wrong}, check=False)
    assert refused.returncode == 1 and "redis://***@127.0.0.1" in refused.stderr
    seen["wrong redis password"] = _said(refused)
    bad = {**env, "EYRIE_REDIS_URL": env["EYRIE_REDIS_URL"].replace("redis://", "http://"),
           "EYRIE_S3_ENDPOINT": f"ftp://{values['access']}:{values['secret']}@127.0.0.1:1"}
    invalid = eyrie("status", "sec", env=bad, check=False)
    assert invalid.returncode == 1 and "EYRIE_REDIS_URL='http://***@127.0.0.1" in invalid.stderr
    seen["invalid settings"] = _said(invalid)
    away = {**env, "EYRIE_S3_ENDPOINT": f"http://{values['access']}:{values['secret']}@127.0.0.1:1"}
    unreachable = eyrie("status", "sec", env=away, check=False)
    assert unreachable.returncode == 1 and "Traceback" not in unreachable.stderr
    assert "EYRIE_S3_ENDPOINT='http://***@127.0.0.1:1': Value error, must not hold credentials" in unreachable.stderr
    seen["credentials in the S3 endpoint"] = _said(unreachable)


def _redis_dump(url: str) -> dict[str, str]:
    """Every key of every type (RQ's job hashes, results, registries, our own keys), as text."""
    import redis

    conn, out = redis.Redis.from_url(url), {}
    readers = {b"hash": conn.hgetall, b"string": conn.get, b"set": conn.smembers,
               b"list": lambda k: conn.lrange(k, 0, -1), b"zset": lambda k: conn.zrange(k, 0, -1, withscores=True),
               b"stream": lambda k: conn.xrange(k)}
    for key in conn.scan_iter(count=1000):
        out[f"redis {key.decode()}"] = repr(readers[conn.type(key)](key))
    return out


def _store_dump(env: dict) -> dict[str, str]:
    from eyrie.core.config import load_settings
    from eyrie.data.store import open_store

    settings = load_settings(**{k.removeprefix("EYRIE_").lower(): v for k, v in env.items()
                                if k.startswith("EYRIE_") and k != "EYRIE_INFERENCE_URL"})
    store = open_store(settings)
    return {f"store {o.object_name}": repr(store.client.get_object(store.bucket, o.object_name).read())
            for o in store.client.list_objects(store.bucket, recursive=True)}
