"""Configuration validated at start, and errors that name the problem and the fix."""

import json

import pytest

from conftest import eyrie
from eyrie.config import load_settings
from eyrie.errors import EyrieError


def test_defaults_are_the_embedded_default(monkeypatch):
    for key in ("EYRIE_REDIS_URL", "EYRIE_STORE_URL", "EYRIE_INFERENCE_URL"):
        monkeypatch.delenv(key, raising=False)
    settings = load_settings()
    assert settings.store_url.startswith("file://") and settings.concurrency == 200
    assert settings.max_tokens == 8192 and settings.request_timeout_s == 1800


def test_every_bad_value_is_named(monkeypatch):
    monkeypatch.setenv("EYRIE_REDIS_URL", "http://localhost")
    monkeypatch.setenv("EYRIE_STORE_URL", "ftp://x")
    monkeypatch.setenv("EYRIE_CONCURRENCY", "0")
    monkeypatch.setenv("EYRIE_INFERENCE_URL", "localhost:8000")
    with pytest.raises(EyrieError) as err:
        load_settings()
    text = str(err.value)
    for name in ("EYRIE_REDIS_URL='http://localhost'", "EYRIE_STORE_URL='ftp://x'",
                 "EYRIE_CONCURRENCY='0'", "EYRIE_INFERENCE_URL='localhost:8000'"):
        assert name in text
    assert "Fix:" in text


def one_line_error(result, *needles):
    assert result.returncode == 1, result
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("eyrie: error:"), result.stderr
    assert "Traceback" not in result.stderr
    for needle in needles:
        assert needle in lines[0]


def test_bad_config_is_one_line(env):
    result = eyrie("status", "x", env={**env, "EYRIE_STORE_URL": "bogus://"}, check=False)
    one_line_error(result, "EYRIE_STORE_URL", "file://DIR")


def test_unreachable_redis(env):
    result = eyrie("status", "x", env={**env, "EYRIE_REDIS_URL": "redis://127.0.0.1:1/0"}, check=False)
    one_line_error(result, "cannot reach Redis at redis://127.0.0.1:1/0", "Fix:")


def test_redis_password_never_printed(env):
    url = "redis://:hunter2secret@127.0.0.1:1/0"
    result = eyrie("status", "x", env={**env, "EYRIE_REDIS_URL": url}, check=False)
    one_line_error(result, "redis://***@127.0.0.1:1/0")
    assert "hunter2secret" not in result.stderr + result.stdout


def test_unreachable_store(env):
    bad = {**env, "EYRIE_STORE_URL": "s3://b", "EYRIE_S3_ENDPOINT": "http://127.0.0.1:1",
           "EYRIE_S3_ACCESS_KEY": "a", "EYRIE_S3_SECRET_KEY": "b"}
    one_line_error(eyrie("status", "x", env=bad, check=False), "cannot reach the S3 endpoint")


def test_unknown_run(env):
    one_line_error(eyrie("status", "nope", env=env, check=False), "unknown run 'nope'")


def test_bad_dataset_path(env, tmp_path):
    result = eyrie("generate", "--dataset", str(tmp_path / "missing.jsonl"), "--run", "r", env=env,
                   check=False)
    one_line_error(result, "missing.jsonl does not exist")


def test_bad_run_name(env, tmp_path):
    one_line_error(eyrie("generate", "--dataset", "x.jsonl", "--run", "../evil", env=env, check=False),
                   "invalid run name")


def test_rerun_with_other_settings_is_refused(env, tmp_path):
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps({"conversations": [{"from": "human", "value": "hi"}]}) + "\n")
    eyrie("generate", "--dataset", str(data), "--run", "r1", "--max-tokens", "10", env=env)
    result = eyrie("generate", "--dataset", str(data), "--run", "r1", "--max-tokens", "20", env=env,
                   check=False)
    one_line_error(result, "max_tokens 20 vs 10", "new --run name")
    data.write_text(json.dumps({"conversations": [{"from": "human", "value": "changed"}]}) + "\n")
    one_line_error(eyrie("generate", "--dataset", str(data), "--run", "r1", env=env, check=False),
                   "already exists with other settings: dataset")


def test_the_demo_is_eyrie_run_on_the_tiny_config(env, tmp_path):
    """`eyrie demo` loads its run config as `eyrie run` does, and checks the run name it puts in."""
    one_line_error(eyrie("demo", "--config", str(tmp_path / "none.yaml"), env=env, check=False), "no config file")
    one_line_error(eyrie("demo", "--run", "../evil", env=env, check=False), "invalid run name")
