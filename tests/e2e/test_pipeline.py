"""`eyrie run`: the whole chain on the embedded default (the same entry points the containers run,
as local processes), each stage starting by itself; `--plan` on the seed's config (the server
handing the GPUs over once generation drains: tests/e2e/test_vllm_serve.py); a generate stage started by one set
of workers and finished by another, from another directory, with only the Redis and store settings."""

import json
import os
import re
import subprocess
import time

import pytest
import redis
import yaml

from eyrie.commands.display import verify_lines
from eyrie.stages import PIPELINE, queues
from eyrie.work import keys

from tests.e2e.test_dashboard import CHART_FACTS, browser, chart, screenshot, stages  # noqa: F401 (browser: a fixture)
from tests.integration.test_api import start_api
from tests.support.harness import BIN, OFFLINE, ROOT, TRAIN_PROMPTS, eyrie, tiny_run_config, wait_for
from tests.support.processes import stop
from tests.support.vllm_real import SMALL, vllm_env

SEED = ROOT / "examples" / "run.kimi-k2.5.yaml"


def test_plan_of_the_seeds_pipeline_needs_no_server_gpu_or_hub(tmp_path):
    out = eyrie("run", "--config", str(SEED), "--plan", env={**os.environ, **OFFLINE}).stdout
    assert "hidden 7168, 61 layers, vocab 163,840 (from target.shape in the run config)" in out
    assert "samples 25,000" in out and "layers [2, 30, 58] + last" in out
    assert "12.48 TB in bf16, 6.24 TB in fp8" in out  # 25,000 x (512 + 8192) tokens x 4 x 7168
    assert "budget 2.80 TB, fp8: the upper bound does NOT fit; it fits while samples average at most 3,904" in out


def test_a_bad_config_names_the_field(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump({"run": "x", "target": {"model": "m"}, "dataset": {"source": "d"},
                                    "generate": {"concurency": 8}, "extract": {"dtype": "fp16"}}))
    result = eyrie("run", "--config", str(path), "--plan", env={**os.environ, **OFFLINE}, check=False)
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert "generate.concurency: Extra inputs are not permitted" in result.stderr
    assert "extract.dtype" in result.stderr


@pytest.mark.timeout(1800)
@pytest.mark.parametrize("store_env", ["file"], indirect=True)
def test_the_chain_runs_by_itself_and_a_rerun_redoes_nothing(env, tiny_server, tmp_path, workers, browser):
    """generate -> extract -> train (evaluate, export) -> verify: the exported drafter served by
    real vLLM (CPU build) with EAGLE-3, greedy outputs identical to the target's alone, and vLLM's
    own acceptance length close to eyrie's (the same bookkeeping); MT-Bench's first 3 questions asked
    both turns by each server (the second after its own first answer)."""
    env = vllm_env(tmp_path / "vllm-cache", {**env, "EYRIE_VLLM_ARGS": " ".join(SMALL[2:]),
                                             "EYRIE_MAX_MODEL_LEN": SMALL[1]})
    workers.env = env
    workers.start(*queues())
    serve = {"max_model_len": int(SMALL[1]), "extra_args": SMALL[2:]}  # verify serves as the run config says
    verify_section = {"enabled": True, "benchmarks": [mt_bench(tmp_path, 3)]}
    path = tiny_run_config(tmp_path, "chain", verify=verify_section, serve=serve)
    out = eyrie("run", "--config", path, "--wait", env=env, timeout=900).stdout
    assert "4 generate tasks enqueued now" in out
    status = json.loads(eyrie("status", "chain", "--json", env=env).stdout)
    assert {name: s["state"] for name, s in status["stages"].items()} == {s.name: "done" for s in PIPELINE}
    train = status["stages"]["train"]
    assert train["evaluation"]["checkpoints"][-1]["tau"] > train["evaluation"]["baseline"]["tau"] + 0.2
    assert status["pipeline"]["blocked"] is None

    verify = wait_for(lambda: json.loads(eyrie("status", "chain", "--json", env=env).stdout)["stages"]["train"]
                      ["verify"], "the verify stage (two vLLM starts)", timeout=900, every=5)
    print(f"verify: {verify}")
    assert verify["identical_outputs"] is True and verify["prompts"] == 30 and verify["k"] == 3
    assert verify["vllm_drafts"] > 0 and len(verify["vllm_per_position_acceptance"]) == 3
    assert verify["eyrie_acceptance_length"] == train["drafter"]["tau"]
    assert verify["relative_difference"] <= 0.05, verify
    assert verify["tokens_per_s_target"] > 0 and verify["speedup"] > 0
    check_mt_bench_was_asked_both_turns(verify)
    check_the_charts_eyrie_show_draws(env, train, verify)
    check_the_dashboard_draws_vllms_figures(env, browser, tmp_path)

    again = eyrie("run", "--config", path, env=env).stdout
    assert "0 generate tasks enqueued now" in again and "stages follow by themselves" in again
    changed = eyrie("run", "--config", tiny_run_config(tmp_path, "chain", train={"epochs": 4}, verify=verify_section,
                                                       serve=serve),
                    env=env, check=False)
    assert changed.returncode == 1 and "differs in: train, of stages already planned" in changed.stderr


def mt_bench(tmp_path, questions: int) -> str:
    """MT-Bench's first questions, as a file named for it (the run's verify.prompts would cap the held-out
    prompts too): a file of `turns` rows is read as the named set is, its entry is "mt-bench"."""
    rows = (ROOT / "services" / "trainer" / "eyrie_trainer" / "benchmarks" / "data" / "mt-bench" / "question.jsonl")
    path = tmp_path / "mt-bench.jsonl"
    path.write_text("".join(rows.read_text().splitlines(keepends=True)[:questions]))
    return str(path)


def check_mt_bench_was_asked_both_turns(verify: dict) -> None:
    """The first turn's figures where the mt-bench figure always was, the second turn's and both turns' under
    its `turns`: the second pass really drafted, and both turns' counters are the two passes' together."""
    bench = verify["benchmarks"]["mt-bench"]
    one, two, both = bench["k"]["3"], bench["turns"]["2"]["k"]["3"], bench["turns"]["both"]["k"]["3"]
    print(f"mt-bench: turn 1 {one}\nturn 2 {bench['turns']['2']}\nboth {both}")
    assert bench["prompts"] == 3 and 1 <= bench["turns"]["2"]["prompts"] <= 3 and bench["turns"]["2"]["questions"] == 3
    assert one["vllm_drafts"] > 0 and two["vllm_drafts"] > 0 and both["vllm_drafts"] == one["vllm_drafts"] + two["vllm_drafts"]
    for figures in (one, two, both):
        assert 1.0 <= figures["vllm_acceptance_length"] <= 4.0 and len(figures["vllm_per_position_acceptance"]) == 3
        assert all(v > 0 for v in figures["tokens_per_s"].values()), figures
    assert two["compared_prompts"] == two["prompts"] and two["identical_outputs"]  # equal first answers: all compared


def check_the_charts_eyrie_show_draws(env: dict, train: dict, verify: dict) -> None:
    """A sparkline per TTT position of loss and of accuracy, a character per logged step; a bar per
    checkpoint named with its acceptance length, vLLM's beside the verified one; a bar per draft position."""
    charts = json.loads(eyrie("status", "chain", "--json", env=env).stdout)["stages"]["train"]["charts"]
    steps = charts["ttt"]["steps"]
    assert steps[-1] == train["done"] and len(charts["ttt"]["loss"]) == 3  # K series, to the last step
    if charts["ttt"]["stride"] == 1:  # under 512 steps: every logged step a point
        assert steps == list(range(1, train["done"] + 1))
    shown = eyrie("show", "chain", env=env).stdout
    print(shown)
    assert '"run": "chain"' in eyrie("show", "chain", "--json", env=env).stdout and "generate_shards" in shown
    sparks = re.findall(r"^  \+(\d)\s+([▁▂▃▄▅▆▇█]+)  ", shown, re.M)
    assert [p for p, _ in sparks] == ["1", "2", "3"] * 2
    assert {len(line) for _, line in sparks} == {min(len(steps), 48)}  # longer curves are averaged to 48
    evaluation = train["evaluation"]
    for c in [{"label": "untrained", **evaluation["baseline"]}, *evaluation["checkpoints"]]:
        best = " (best)" if c["label"] == evaluation["best"] else ""
        assert re.search(rf"^  {re.escape(c['label'] + best)} +eyrie [█▏▎▍▌▋▊▉]* +{c['tau']:.3f}$", shown, re.M)
    assert re.search(rf"^ +vLLM +█+[▏▎▍▌▋▊▉]? +{verify['vllm_acceptance_length']:.3f}$", shown, re.M)
    assert all(f"vLLM on {name}:" in shown for name in ("mt-bench", "mt-bench turn 2", "mt-bench turns 1+2")), shown
    printed = "\n".join(verify_lines("chain", verify))  # what `eyrie verify` prints of the same result
    assert re.search(r"^  mt-bench turn 2 +\d+  3 +\d\.\d{3} ", printed, re.M), printed
    for p, rate in enumerate(verify["vllm_per_position_acceptance"]):
        assert f"{rate:.3f}" in shown and f"  +{p + 1}   eyrie " in shown


def check_the_dashboard_draws_vllms_figures(env: dict, browser, tmp_path) -> None:
    """The dashboard (headless Chromium) on the verified run: vLLM's measured acceptance beside eyrie's
    τ and per draft position, in uPlot's charts, and verify listed as a stage, done."""
    api, url = start_api(env, EYRIE_API_OPEN_READS="true")
    try:
        browser.get(f"{url}/?refresh=60000#chain")
        wait_for(lambda: browser.execute_script(CHART_FACTS, "position-chart"), "the charts on the page", timeout=60)
        vllm = [s for s in chart(browser, "tau-chart")["series"] if s["label"].startswith("vLLM ")]
        assert vllm and all(s["points"] == 1 for s in vllm), vllm  # one measured point per benchmark
        positions = chart(browser, "position-chart")["series"]
        assert [s["points"] for s in positions] == [3] * (1 + len(vllm)), positions  # eyrie's, then vLLM's
        assert stages(browser)["verify"][0] == "done"
        screenshot(browser, tmp_path, "dashboard-verified.png")
    finally:
        stop(api)


@pytest.mark.parametrize("store_env", ["s3"], indirect=True)
def test_generate_started_on_one_host_is_finished_on_another(env, tiny_server, tmp_path, workers):
    """Host B: another working directory, an environment with only Redis and the store (the
    inference endpoint is found in Redis, where `eyrie serve` published it)."""
    eyrie("generate", "--dataset", str(TRAIN_PROMPTS), "--run", "moved", "--concurrency", "4", "--max-tokens", "64",
          "--shard-size", "40", env=env)
    workers.start("generate")  # host A
    generate = lambda: json.loads(eyrie("status", "moved", "--json", env=env).stdout)["stages"]["generate"]  # noqa: E731
    first = wait_for(lambda: (g := generate())["shards_done"] >= 2 and g, "2 shards done on host A", timeout=300)
    workers.kill("generate")  # host A goes away mid-stage
    assert first["shards_done"] < first["shards_total"]

    host_b_dir = tmp_path / "host-b"
    host_b_dir.mkdir()
    only = {k: v for k, v in env.items() if k.startswith(("EYRIE_REDIS", "EYRIE_STORE", "EYRIE_S3"))}
    host_b_env = {"PATH": os.environ["PATH"], "HOME": str(host_b_dir), **OFFLINE, **only}
    assert set(only) == {"EYRIE_REDIS_URL", "EYRIE_STORE_URL", "EYRIE_S3_ENDPOINT", "EYRIE_S3_ACCESS_KEY",
                         "EYRIE_S3_SECRET_KEY"}
    conn = redis.Redis.from_url(env["EYRIE_REDIS_URL"])
    while any(conn.scan_iter(keys.task_lease("generate-moved-*"))):
        time.sleep(0.5)  # host A's task leases lapse (15 s)
    subprocess.run([str(BIN / "eyrie"), "generate", "--dataset", str(TRAIN_PROMPTS), "--run", "moved", "--concurrency",
                    "4", "--max-tokens", "64", "--shard-size", "40"], env=host_b_env, cwd=host_b_dir, check=True,
                   capture_output=True, timeout=300)
    subprocess.run([str(BIN / "eyrie"), "worker", "generate", "--burst"], env=host_b_env, cwd=host_b_dir,
                   check=True, capture_output=True, timeout=600)
    status = json.loads(eyrie("status", "moved", "--json", env=env).stdout)["stages"]["generate"]
    assert status["state"] == "done" and status["done"] + status["skipped"] + status["failed"] == 306

    from eyrie.core.config import load_settings
    from eyrie.data.manifest import Layout
    from eyrie.data.store import open_store

    store, layout = open_store(load_settings()), Layout("moved")
    ids = []
    for index in range(status["shards_total"]):
        manifest = store.get_json(layout.generate_shard_manifest(index))
        ids += [json.loads(line)["sample_id"] for line in store.get_bytes(manifest["object"]).splitlines()]
    assert len(ids) == len(set(ids)) == 306  # none lost, none twice
