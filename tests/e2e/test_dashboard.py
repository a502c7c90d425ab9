"""The dashboard in Debian's headless chromium (driven by selenium through Debian's chromedriver)
against a live API, over real runs on the tiny target. A run whose generate went through a faulty
network (tests/support/fault_proxy.py) and read malformed rows: its failures by reason, one example each.
A whole pipeline: the page lists the run, shows every stage (verify included) with its state, what
runs now, and its progress moving by itself; then each uPlot chart is drawn with its axes and data
points (read from the canvas). One screenshot per case in the test's tmp dir and in
.eyrie/artifacts/ (EYRIE_DOCS_SCREENSHOT=1 also refreshes docs/dashboard.png for the README)."""

import os
import shutil
import signal
import subprocess
import time

import pytest
import requests

from tests.e2e.test_faults import fault_proxy
from tests.e2e.test_generate_e2e import BAD
from tests.integration.test_api import AUTH, start_api
from tests.support.harness import BIN, ROOT, TINY, TRAIN_PROMPTS, eyrie_in_process, start_worker, wait_for
from tests.support.processes import stop

ARTIFACTS = ROOT / ".eyrie" / "artifacts"
MALFORMED = [(raw, reason) for raw, reason in BAD if reason != "prompt_too_long"]  # (that one is by max_tokens)
# Per chart: its axes' ticks, each series' values, and whether the canvas shows the series' own
# colour at one of its points at least (drawn, not only configured; series may overlap elsewhere).
CHART_FACTS = """
const chart = window.eyrieCharts[arguments[0]];
if (!chart) return null;
const rgb = (hex) => [1, 3, 5].map((i) => parseInt(hex.slice(i, i + 2), 16));
const near = (x, y, want) => {
  const pixels = chart.ctx.getImageData(Math.round(x) - 2, Math.round(y) - 2, 5, 5).data;
  for (let p = 0; p < pixels.length; p += 4) {
    if (pixels[p + 3] > 200 && want.every((c, j) => Math.abs(c - pixels[p + j]) < 40)) return true;
  }
  return false;
};
const series = chart.series.slice(1).map((s, i) => {
  const ys = chart.data[i + 1], want = rgb(s.stroke());
  const at = ys.map((v, j) => j).filter((j) => ys[j] !== null && ys[j] !== undefined);
  const drawn = at.some((j) => near(chart.valToPos(chart.data[0][j], "x", true), chart.valToPos(ys[j], s.scale, true), want));
  return { label: s.label, points: at.length, drawn };
});
return { ticks: chart.axes.map((a) => (a._values || []).filter((v) => v !== null && v !== "").length),
         labels: chart.axes.map((a) => a.label || ""), series,
         markers: (chart.eyrieMarkers || []).map((m) => m.label) };
"""


@pytest.fixture
def browser():
    from selenium import webdriver
    from selenium.webdriver.chrome.options import Options
    from selenium.webdriver.chrome.service import Service

    chromium, driver_path = shutil.which("chromium"), shutil.which("chromedriver")
    if not (chromium and driver_path):
        pytest.fail("chromium and chromedriver are not installed: `make test` installs them "
                    "(apt-get install chromium chromium-driver)")
    options = Options()
    options.binary_location = chromium
    for flag in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                 "--window-size=1400,1000"):
        options.add_argument(flag)
    driver = webdriver.Chrome(service=Service(driver_path), options=options)
    yield driver
    driver.quit()


def stages(driver) -> dict[str, tuple[str, int]]:
    """What the page shows now: stage -> (state, samples processed), read in one go (the page
    redraws itself every refresh)."""
    rows = driver.execute_script("return Array.from(document.querySelectorAll('#stages li[data-stage]'))"
                                 ".map(li => [li.dataset.stage, li.dataset.state, Number(li.dataset.processed)])")
    return {name: (state, processed) for name, state, processed in rows}


def attrs(driver, selector: str, attr: str) -> list[str]:
    return driver.execute_script("return Array.from(document.querySelectorAll(arguments[0]))"
                                 ".map(e => e.getAttribute(arguments[1]))", selector, attr)


def text(driver, selector: str) -> str:
    return driver.execute_script("return document.querySelector(arguments[0]).textContent", selector)


def chart(driver, chart_id: str) -> dict:
    facts = driver.execute_script(CHART_FACTS, chart_id)
    assert facts, f"no chart {chart_id} on the page"
    assert all(n >= 2 for n in facts["ticks"]), facts  # both axes with ticks, labelled
    assert all(facts["labels"]), facts
    assert facts["series"] and all(s["points"] and s["drawn"] for s in facts["series"]), facts
    return facts


def screenshot(driver, tmp_path, name: str) -> None:
    """The whole page (the window made as tall as it), then the window as it was."""
    size = driver.get_window_size()
    driver.set_window_size(size["width"], driver.execute_script("return document.body.scrollHeight") + 150)
    driver.save_screenshot(str(tmp_path / name))
    driver.set_window_size(size["width"], size["height"])
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    shutil.copy(tmp_path / name, ARTIFACTS / name)


def failures_shown(driver) -> list[dict]:
    return driver.execute_script(
        "return Array.from(document.querySelectorAll('#failures tbody tr')).map(tr => ({stage: tr.dataset.stage, "
        "kind: tr.dataset.kind, count: Number(tr.querySelector('.count').textContent), "
        "reason: tr.querySelector('.reason').textContent, example: tr.querySelector('.example').textContent}))")


def generate_through_faults(env: dict, url: str, tiny_server, tmp_path) -> None:
    """The run `broken`: generate alone on 12 prompts and the malformed rows, every request through a
    proxy that answers half of them with a fault, no retries."""
    good = TRAIN_PROMPTS.read_bytes().splitlines()[:12]
    data = tmp_path / "prompts" / "mixed.jsonl"
    data.parent.mkdir()
    data.write_bytes(b"\n".join(good + [raw for raw, _ in MALFORMED]) + b"\n")
    proxy, proxied = fault_proxy("http", tiny_server.url, "--rate", "0.5", "--hang-s", "0.3")
    try:
        config = {"run": "broken", "target": {"model": str(TINY)}, "dataset": {"source": str(data)},
                  "generate": {"concurrency": 4, "max_tokens": 16, "max_retries": 0, "shard_size": 40}}
        assert requests.post(f"{url}/runs?stage=generate", json=config, headers=AUTH).status_code == 202
        worker = start_worker({**env, "EYRIE_INFERENCE_URL": proxied}, burst=True)
        assert worker.wait(300) == 0, worker.stdout.read()
    finally:
        stop(proxy)


@pytest.mark.timeout(1200)  # three runs (~4 min on an idle 2-core host; twice that with other jobs beside it)
@pytest.mark.parametrize("store_env", ["file"], indirect=True)
def test_the_dashboard_shows_failures_and_follows_a_real_run(env, tiny_server, browser, tmp_path):
    api, url = start_api(env, EYRIE_API_OPEN_READS="true")
    procs = []
    try:
        generate_through_faults(env, url, tiny_server, tmp_path)
        status = requests.get(f"{url}/runs/broken", headers=AUTH).json()["stages"]["generate"]
        assert status["failed"] and status["done"] and status["skipped"] == len(MALFORMED), status
        browser.get(f"{url}/?refresh=500#broken")
        wait_for(lambda: failures_shown(browser), "the failures by reason on the page", timeout=30)
        shown = failures_shown(browser)
        skipped = {f["reason"]: f for f in shown if f["kind"] == "skipped"}
        assert set(skipped) == {reason for _, reason in MALFORMED}, shown
        assert all(f["stage"] == "generate" and f["count"] == 1 and "row " in f["example"] for f in skipped.values())
        failed = [f for f in shown if f["kind"] == "failed"]
        assert sum(f["count"] for f in failed) == status["failed"] and len(failed) >= 2, shown  # by reason
        assert all("sample " in f["example"] and "row " in f["example"] for f in failed), failed
        assert text(browser, "#logs-command") == "eyrie logs broken"
        logs = eyrie_in_process("logs", "broken", env=env).stdout  # the command the page names
        assert "generate: 1 skipped: invalid_json (e.g. sample " in logs
        assert f"generate: {failed[0]['count']} failed: {failed[0]['reason']}" in logs
        chart(browser, "rate-chart")
        screenshot(browser, tmp_path, "dashboard-failures.png")

        procs = [subprocess.Popen([str(BIN / "eyrie"), "worker", stage], env=env, stdout=subprocess.DEVNULL,
                                  stderr=subprocess.DEVNULL, start_new_session=True)
                 for stage in ("generate", "extract", "train")]
        config = {"run": "dash", "target": {"model": str(TINY)}, "dataset": {"source": str(TRAIN_PROMPTS), "limit": 120},
                  "generate": {"concurrency": 8, "max_tokens": 48, "shard_size": 30}, "extract": {"layers": [2, 4, 5]},
                  "train": {"epochs": 2, "seq_len": 256, "lr": 0.003, "draft_vocab": 500},
                  "verify": {"enabled": False}}  # vLLM would verify by itself (the project's .venv-vllm is found)
        assert requests.post(f"{url}/runs", json=config, headers=AUTH).status_code == 202
        browser.get(f"{url}/?refresh=500#dash")
        wait_for(lambda: text(browser, "#run-title") == "run dash", "the page on the new run", timeout=30)
        seen, running, deadline = [], set(), time.monotonic() + 900
        while time.monotonic() < deadline:
            shown = stages(browser)
            if not seen or shown != seen[-1]:
                seen.append(shown)
            running.update(attrs(browser, "#now tr[data-worker]", "data-worker"))
            if len(seen) == 4:
                screenshot(browser, tmp_path, "dashboard-running.png")
            if shown.get("train", ("",))[0] == "done" and attrs(browser, "#tau tr", "data-checkpoint"):
                break
            time.sleep(0.3)
        else:
            pytest.fail(f"the page never showed the run done; last: {seen[-1:]}")
        generated = sorted({s["generate"][1] for s in seen if "generate" in s})
        assert len(generated) >= 3 and generated[-1] == 120, generated  # progress moved as shards finished
        assert any(s.get("generate", ("",))[0] == "in_progress" for s in seen)
        assert {name.split("-")[0] for name in running} >= {"generate", "train"}, running  # what ran, by worker
        first = next(s for s in seen if s)
        assert first["extract"] == first["train"] == ("pending", 0)  # the whole checklist from the start
        assert first["verify"] == ("pending", 0)
        wait_for(lambda: stages(browser).get("verify") == ("skipped", 1), "verify listed, skipped", timeout=30)
        assert stages(browser) == {"generate": ("done", 120), "extract": ("done", 120), "train": seen[-1]["train"],
                                   "evaluate": ("done", 2), "export": ("done", 1), "verify": ("skipped", 1)}
        assert seen[-1]["train"][0] == "done"
        assert attrs(browser, "#runs tr[data-run]", "data-run") == ["broken", "dash"]
        taus = attrs(browser, "#tau tr", "data-checkpoint")
        assert taus[0] == "untrained" and len(taus) == 3, taus  # the baseline and one row per epoch
        loss = chart(browser, "loss-chart")
        assert [s["label"] for s in loss["series"]] == ["loss @1", "loss @2", "loss @3"]  # per TTT step
        assert loss["markers"][0] == "epoch 1" and loss["markers"][-1].startswith("chosen: "), loss
        assert chart(browser, "acc-chart")["markers"] == loss["markers"]
        assert [s["points"] for s in chart(browser, "tau-chart")["series"]] == [len(taus)]  # eyrie's; no vLLM here
        assert [s["points"] for s in chart(browser, "position-chart")["series"]] == [3]  # K draft positions
        assert {s["label"] for s in chart(browser, "rate-chart")["series"]} >= {"generate", "extract", "train"}
        assert '"run": "dash"' in text(browser, "#manifest") and "GPU lease" in text(browser, "#lease")
        assert "verify.enabled is false in the run config" in text(browser, "#verify-skipped")
        wait_for(lambda: "nothing of this run runs now" in text(browser, "#now-none"), "nothing running", timeout=30)
        screenshot(browser, tmp_path, "dashboard.png")
        if os.environ.get("EYRIE_DOCS_SCREENSHOT") == "1":
            shutil.copy(tmp_path / "dashboard.png", ROOT / "docs" / "dashboard.png")

        # a recipe sweep: the same states trained again with another lr and fewer epochs (nothing regenerated)
        sweep = {**config, "run": "dash-lr", "train": {**config["train"], "epochs": 1, "lr": 0.01}}
        assert requests.post(f"{url}/runs", json=sweep, headers=AUTH).status_code == 202
        family = lambda: browser.execute_script(CHART_FACTS, "family-chart")  # noqa: E731
        wait_for(lambda: family() and family()["series"][0]["points"] == 2, "the sweep's drafter in the family chart",
                 timeout=600)
        facts = chart(browser, "family-chart")
        assert facts["labels"][0] == "epochs, lr" and [s["label"] for s in facts["series"]] == ["eyrie τ"], facts
        screenshot(browser, tmp_path, "dashboard-family.png")
    finally:
        stop(api)
        for proc in procs:
            os.killpg(proc.pid, signal.SIGKILL)


def test_vllms_figures_equal_to_eyries_do_not_hide_eyries_line(browser, tmp_path):
    """The per-position chart with vLLM's figures exactly eyrie's (a drafter verified on its own held-out
    set: CI saw eyrie's line drawn under vLLM's, invisible): every series shows on the canvas.
    The page's own charts.js and uPlot, no server: the chart is drawn from figures given here."""
    static = ROOT / "eyrie" / "api" / "static"
    page = tmp_path / "positions.html"
    page.write_text(f"""<link rel="stylesheet" href="{static}/vendor/uplot/uPlot.min.css">
<div id="position-chart" style="width: 700px"></div>
<script src="{static}/vendor/uplot/uPlot.iife.min.js"></script><script src="{static}/charts.js"></script>""")
    rates = [0.49, 0.07, 0.07]
    train = {"charts": {"per_position": {"eyrie": rates},
                        "benchmarks": {"heldout": {"3": {"per_position": rates}},
                                       "gsm8k": {"3": {"per_position": [0.5, 0.2, 0.1]}}}}}
    browser.get(page.as_uri())
    assert browser.execute_script("return drawPositions(arguments[0])", train)
    facts = chart(browser, "position-chart")
    assert facts["series"][0]["label"] == "eyrie (held out)", facts
    assert sorted((s["label"], s["points"]) for s in facts["series"]) == [
        ("eyrie (held out)", 3), ("vLLM gsm8k", 3), ("vLLM heldout", 3)], facts  # and each drawn (chart())


def test_tokens_per_second_over_time_from_the_progress_reports(redis_url, monkeypatch):
    """The rate chart's series: each task's reports turned into tokens per interval; a retried task
    (a new attempt, its count from zero) adds its own tokens, never a negative rate."""
    import redis as redis_client

    from eyrie.work import keys, progress

    conn, clock = redis_client.Redis.from_url(redis_url), [0.0]
    monkeypatch.setattr(progress.time, "time", lambda: clock[0])
    for at, task, started, tokens in [(1001, "0", 1000, 100), (1002, "0", 1000, 200), (1002, "1", 1001, 30),
                                      (1004, "0", 1003, 50)]:  # task 0 retried at 1003
        clock[0] = at
        progress.report(conn, "r", "generate", task, started, tokens=tokens)
    assert progress.token_rates(conn, "r", "generate") == [(1001, 100), (1002, 130), (1003, 0), (1004, 50)]
    clock[0] = 1004.5  # a later report in the same second replaces the one before
    progress.report(conn, "r", "generate", "0", 1003, tokens=80)
    assert conn.hlen(keys.rates("r", "generate")) == 4
    assert sum(rate for _, rate in progress.token_rates(conn, "r", "generate")) == 100 + 100 + 30 + 80
    progress.reset(conn, "r", "generate")
    assert progress.token_rates(conn, "r", "generate") == []


def test_a_task_hours_long_shows_its_lease_renewals_as_its_heartbeat(redis_url):
    """What runs now: RQ renews a worker's own heartbeat only between tasks when the task runs in
    the worker's process (a 29-minute training showed "last heartbeat 29m ago" on a real SmolLM2
    run); eyrie's lease heartbeat renews the task's lease every few seconds, and that is its beat."""
    import redis as redis_lib

    from eyrie.work.queue import task_lease
    from eyrie.work.workers import lease_renewed_at

    conn = redis_lib.Redis.from_url(redis_url)
    assert lease_renewed_at(conn, "train-nobody-00000") is None  # no lease: no beat
    lease = task_lease(conn, "train-long-00000")
    assert lease.acquire(blocking=False)
    time.sleep(2)
    assert 1.5 < time.time() - lease_renewed_at(conn, "train-long-00000") < 3.5  # taken 2 s ago
    lease.extend(15, replace_ttl=True)  # what Heartbeat does every 5 s
    assert time.time() - lease_renewed_at(conn, "train-long-00000") < 0.5
    lease.release()
