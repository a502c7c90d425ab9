"""The dashboard in Debian's headless chromium (driven by selenium through Debian's chromedriver)
against a live API, over a real pipeline on the tiny target: the page lists the run, shows the
stages with their states, and its progress moves by itself as work completes; τ per checkpoint
appears once evaluated. Screenshots are kept in the test's tmp dir (EYRIE_DOCS_SCREENSHOT=1 also
refreshes docs/dashboard.png for the README)."""

import os
import shutil
import signal
import subprocess
import time

import pytest
import requests

from conftest import BIN, ROOT, TINY, TRAIN_PROMPTS, stop, wait_for
from test_api import AUTH, start_api



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


@pytest.mark.parametrize("store_env", ["file"], indirect=True)
def test_the_dashboard_follows_a_real_run(env, tiny_server, browser, tmp_path):
    procs = [subprocess.Popen([str(BIN / "eyrie"), "worker", stage], env=env, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL, start_new_session=True)
             for stage in ("generate", "extract", "train")]
    api, url = start_api(env, EYRIE_API_OPEN_READS="true")
    try:
        config = {"run": "dash", "target": {"model": str(TINY)}, "dataset": {"source": str(TRAIN_PROMPTS), "limit": 120},
                  "generate": {"concurrency": 8, "max_tokens": 48, "shard_size": 30}, "extract": {"layers": [2, 4, 5]},
                  "train": {"epochs": 2, "seq_len": 256, "lr": 0.003, "draft_vocab": 500},
                  "verify": {"enabled": False}}  # vLLM would verify by itself (the project's .venv-vllm is found)
        assert requests.post(f"{url}/runs", json=config, headers=AUTH).status_code == 202
        browser.get(f"{url}/?refresh=500#dash")
        seen, deadline = [], time.monotonic() + 900
        while time.monotonic() < deadline:
            shown = stages(browser)
            if not seen or shown != seen[-1]:
                seen.append(shown)
            if len(seen) == 4:
                browser.save_screenshot(str(tmp_path / "dashboard-running.png"))
            if shown.get("train", ("",))[0] == "done" and attrs(browser, "#tau tr", "data-checkpoint"):
                break
            time.sleep(0.3)
        else:
            pytest.fail(f"the page never showed the run done; last: {seen[-1:]}")
        generated = sorted({s["generate"][1] for s in seen if "generate" in s})
        assert len(generated) >= 3 and generated[-1] == 120, generated  # progress moved as shards finished
        assert any(s.get("generate", ("",))[0] == "in_progress" for s in seen)
        first = next(s for s in seen if s)
        assert first["extract"] == first["train"] == ("pending", 0)  # the whole checklist from the start
        assert seen[-1] == {"generate": ("done", 120), "extract": ("done", 120), "train": seen[-1]["train"],
                            "evaluate": ("done", 2), "export": ("done", 1)}
        assert seen[-1]["train"][0] == "done"
        assert attrs(browser, "#runs tr[data-run]", "data-run") == ["dash"]
        taus = attrs(browser, "#tau tr", "data-checkpoint")
        assert taus[0] == "untrained" and len(taus) == 3, taus  # the baseline and one row per epoch
        # the charts: acceptance length per checkpoint (a point each), acceptance per draft position (K bars)
        assert attrs(browser, "#tau-chart circle.eyrie", "data-checkpoint") == taus
        assert len(attrs(browser, "#tau-chart polyline.eyrie", "points")[0].split()) == len(taus)
        assert attrs(browser, "#position-chart rect.eyrie", "data-position") == ["0", "1", "2"]
        assert '"run": "dash"' in text(browser, "#manifest") and "GPU lease" in text(browser, "#lease")
        wait_for(lambda: "verify.enabled is false in the run config" in text(browser, "#verify-skipped"),
                 "the page saying why verify did not run", timeout=30)
        browser.save_screenshot(str(tmp_path / "dashboard.png"))
        if os.environ.get("EYRIE_DOCS_SCREENSHOT") == "1":
            shutil.copy(tmp_path / "dashboard.png", ROOT / "docs" / "dashboard.png")
    finally:
        stop(api)
        for proc in procs:
            os.killpg(proc.pid, signal.SIGKILL)
