"""Configuration validated at start, and errors that name the problem and the fix."""

import json

import pytest

from eyrie.core.config import load_settings
from eyrie.core.errors import EyrieError
from eyrie.core.stage_settings import GenerateSettings
from tests.support.harness import eyrie


def test_defaults_are_the_embedded_default(monkeypatch):
    for key in ("EYRIE_REDIS_URL", "EYRIE_STORE_URL", "EYRIE_INFERENCE_URL"):
        monkeypatch.delenv(key, raising=False)
    for key in ("EYRIE_CONCURRENCY", "EYRIE_MAX_TOKENS", "EYRIE_REQUEST_TIMEOUT_S"):
        monkeypatch.delenv(key, raising=False)
    settings = load_settings()
    assert settings.store_url.startswith("file://")
    generate = GenerateSettings().with_host_defaults(settings.generate_defaults())
    assert generate.concurrency == 200 and generate.max_tokens == 8192 and generate.request_timeout_s == 1800


def test_a_stage_setting_not_given_takes_the_hosts_default(monkeypatch):
    """EYRIE_<FIELD> is this host's default for a generate setting the run does not give; what
    the run gives wins, and the host's default does not count as asked (a rerun is not checked on it)."""
    monkeypatch.setenv("EYRIE_MAX_RETRIES", "1")
    monkeypatch.setenv("EYRIE_MAX_TOKENS", "64")
    settings = load_settings()
    assert settings.generate_defaults().given() == {"max_retries": 1, "max_tokens": 64}
    generate = GenerateSettings(max_tokens=32).with_host_defaults(settings.generate_defaults())
    assert (generate.max_retries, generate.max_tokens) == (1, 32) and generate.given() == {"max_tokens": 32}
    monkeypatch.setenv("EYRIE_CONCURRENCY", "0")
    with pytest.raises(EyrieError, match=r"EYRIE_CONCURRENCY='0': Input should be greater than or equal to 1"):
        settings.generate_defaults()


def test_an_internal_error_is_one_line_unless_eyrie_debug(monkeypatch, capsys):
    """A bug of ours: one line; its traceback with EYRIE_DEBUG (Settings.debug, read alone: the
    rest of the configuration may be what failed); a value that is not a yes or a no asks for it."""
    import typer

    from eyrie.commands.cli_app import command

    @command
    def broken():
        raise RuntimeError("boom")

    monkeypatch.setenv("EYRIE_REDIS_URL", "http://not-redis")  # the rest may be invalid
    monkeypatch.delenv("EYRIE_DEBUG", raising=False)
    with pytest.raises(typer.Exit):
        broken()
    assert "eyrie: internal error: RuntimeError: boom Fix: rerun with EYRIE_DEBUG=1" in capsys.readouterr().err
    for value, traceback in (("0", False), ("false", False), ("1", True), ("yes", True), ("please", True)):
        monkeypatch.setenv("EYRIE_DEBUG", value)
        with pytest.raises(RuntimeError if traceback else typer.Exit):
            broken()


def test_the_old_name_of_the_request_timeout_still_reads():
    """A run config (or a stored pipeline.json) from before the rename: timeout_s."""
    assert GenerateSettings.model_validate({"timeout_s": 60}).request_timeout_s == 60


def test_every_bad_value_is_named(monkeypatch):
    monkeypatch.setenv("EYRIE_REDIS_URL", "http://localhost")
    monkeypatch.setenv("EYRIE_STORE_URL", "ftp://x")
    monkeypatch.setenv("EYRIE_PORT", "0")
    monkeypatch.setenv("EYRIE_INFERENCE_URL", "localhost:8000")
    with pytest.raises(EyrieError) as err:
        load_settings()
    text = str(err.value)
    for name in ("EYRIE_REDIS_URL='http://localhost'", "EYRIE_STORE_URL='ftp://x'",
                 "EYRIE_PORT='0'", "EYRIE_INFERENCE_URL='localhost:8000'"):
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
    one_line_error(result, f"no such file {tmp_path / 'missing.jsonl'}.")


@pytest.mark.parametrize("name", ["../evil", "a\n", "", "-a", "a" * 65])
def test_a_bad_run_name_is_refused_where_every_command_checks_it(name):
    from eyrie.core.run_config import check_run_name

    with pytest.raises(EyrieError, match="invalid run name"):
        check_run_name(name)
    assert check_run_name("a.b_c-1" + "d" * 57) == "a.b_c-1" + "d" * 57  # 64 characters


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


def test_a_sigtermed_demo_stops_everything_it_started_and_named_its_server(env, tmp_path):
    """`eyrie demo` stopped with SIGTERM (as a supervisor or `kill` stops it): its server and every
    worker it started go too; its banner names the server it really starts."""
    import signal
    import subprocess

    from tests.support.harness import BIN, children_of, state_of, tiny_run_config, wait_for
    from tests.support.processes import stop

    config = tiny_run_config(tmp_path, "sig")
    demo = subprocess.Popen([str(BIN / "eyrie"), "demo", "--config", config, "--run", "sig"], cwd=tmp_path,
                            env={**env, "EYRIE_SERVER": "transformers"}, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        children = wait_for(lambda: len(kids := children_of(demo.pid)) >= 4 and kids,  # the server, 3+ workers
                            "the demo's server and workers", timeout=180, every=0.5)
        demo.send_signal(signal.SIGTERM)
        banner = " ".join(demo.communicate(timeout=60)[0].split())  # rich wraps it in a pipe
    finally:
        stop(demo)
    assert "on transformers serve (CPU)" in banner, banner
    wait_for(lambda: all(state_of(pid) in ("", "Z") for pid in children),  # gone, or a zombie
             "the demo's children gone", timeout=60, every=0.5)
    # and none it started after that snapshot (a worker started as the SIGTERM came was once orphaned)
    wait_for(lambda: not _living_in(tmp_path), "no process of the demo left in its directory", timeout=60, every=0.5)


def test_a_sigterm_as_the_demo_starts_a_child_waits_until_the_child_is_kept():
    """The race behind a demo child left running after SIGTERM (CI, stop 34): raised inside Popen,
    after the fork, the interrupt left that child unknown to the demo, which stopped the others."""
    import os
    import signal

    from eyrie.commands.embedded import HeldInterrupt

    interrupt, kept = HeldInterrupt(), []
    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        with pytest.raises(KeyboardInterrupt):
            with interrupt.held():
                os.kill(os.getpid(), signal.SIGTERM)
                kept.append("the child")  # Popen returning, and the demo keeping what it returned
        assert kept == ["the child"]
        with pytest.raises(KeyboardInterrupt):  # outside a start: at once
            os.kill(os.getpid(), signal.SIGTERM)
            kept.append("not reached")
        assert kept == ["the child"]
    finally:
        signal.signal(signal.SIGTERM, previous)


def _living_in(folder) -> list[int]:
    """Processes (not zombies) whose working directory is `folder`."""
    import os

    from tests.support.harness import state_of

    living = []
    for entry in os.listdir("/proc"):
        try:
            if entry.isdigit() and os.readlink(f"/proc/{entry}/cwd") == str(folder):
                living.append(int(entry))
        except OSError:
            continue
    return [pid for pid in living if state_of(pid) not in ("", "Z")]

