"""`--plan` says only what it checks (issue 29, defect 9): the mean sample length estimated from a
local dataset (or a refusal where the budget cannot be checked without it), a missing dataset path
named as one, the target's weights download in the bytes and hours, the GPU-hours hybrid and online
hold the service for, the GPU memory of this host's device, `auto` as it is, and a top-level `fits`
that describes the mode the run takes. In process: project() or the console script's app."""

import json
import os
import stat
from types import SimpleNamespace

import pytest

from eyrie.core.budget import parse_size
from eyrie.stages.run_config import load_config
from eyrie.core.stage_settings import ExtractSettings
from eyrie.core.storage import resolve_mode
from eyrie.runs.projection import project
from eyrie.runs.storage_plan import auto_choice
from tests.support.harness import OFFLINE, ROOT, eyrie_in_process, plan_env, seed_variant, tiny_run_config

SEED = ROOT / "examples" / "run.kimi-k2.5.yaml"


def _plan(path: str, tmp_path, **env) -> dict:
    return json.loads(eyrie_in_process("run", "--config", path, "--plan", "--json", env=plan_env(tmp_path, **env)).stdout)


def test_without_mean_tokens_the_mean_is_estimated_from_a_local_dataset(tmp_path):
    """306 one-line prompts answered in at most 64 tokens: the upper bound (512-token prompt estimate)
    is 91.7 MB of bf16 states; the rows' own prompts say about 75 tokens a sample."""
    path = tiny_run_config(tmp_path, "est", extract={"budget": "20MB"})
    plan = _plan(path, tmp_path)
    assert plan["mean_tokens_from"].startswith("estimated from the dataset's 306 rows"), plan["mean_tokens_from"]
    assert 64 < plan["mean_tokens"] < 100 and plan["hidden_states_bytes_expected"] < 20e6
    assert plan["fits"] is True and plan["refusals"] == []
    out = eyrie_in_process("run", "--config", path, "--plan", env=plan_env(tmp_path)).stdout
    assert "estimated from the dataset's 306 rows" in out and "refused below" not in out
    tight = tiny_run_config(tmp_path, "est-tight", extract={"budget": "5MB"})
    refused = eyrie_in_process("run", "--config", tight, "--plan", env=plan_env(tmp_path), check=False)
    assert refused.returncode == 1 and "extract.budget is 5.00 MB" in refused.stderr, refused.stderr


def test_without_mean_tokens_a_budget_that_cannot_be_checked_is_refused(tmp_path):
    """A hub dataset --plan does not download: no rows to estimate from, and every state (offline) at
    the upper bound over the budget. Refused, naming plan.mean_tokens, not 'refused below' and exit 0.
    (auto and hybrid fill the budget whatever the mean: nothing to refuse there.)"""
    path = seed_variant(tmp_path, "no-mean", plan={"mean_tokens": None}, extract={"storage": "offline"})
    result = eyrie_in_process("run", "--config", path, "--plan", env=plan_env(tmp_path), check=False)
    assert result.returncode == 1, result.stdout
    assert "plan.mean_tokens" in result.stderr and "mlabonne/open-perfectblend" in result.stderr


@pytest.mark.parametrize("source", ["./nowhere.jsonl", "nowhere.jsonl", "assets/nowhere.jsonl", "data/x/y"])
def test_a_missing_dataset_path_is_named_as_one(tmp_path, source):
    path = tiny_run_config(tmp_path, "missing", dataset={"source": source})
    result = eyrie_in_process("run", "--config", path, "--plan", env=plan_env(tmp_path), check=False)
    assert result.returncode == 1
    assert f"no such file {source} (looked in {os.getcwd()})" in result.stderr, result.stderr
    assert "dataset.limit" not in result.stderr


def test_a_hub_shaped_name_not_found_here_is_taken_as_a_hub_id_and_says_so(tmp_path):
    path = tiny_run_config(tmp_path, "hub", dataset={"source": "assets/nowhere"})
    result = eyrie_in_process("run", "--config", path, "--plan", env=plan_env(tmp_path), check=False)
    assert result.returncode == 1
    assert f"assets/nowhere is not a file or directory in {os.getcwd()}, so it is taken as a Hugging Face hub " \
           "dataset id" in result.stderr, result.stderr


def test_the_targets_download_is_counted_in_bytes_and_hours(tmp_path):
    """The seed's target is a hub id: its 540 GB come down before the server answers."""
    plan = _plan(seed_variant(tmp_path, "dl"), tmp_path, EYRIE_SERVE_DEADLINE_S="600")
    assert plan["target_download_bytes"] == parse_size("540GB")
    download = plan["hours"]["download"]
    assert download["bytes_per_s"] == parse_size("500MB") and download["hours"] == round(540 / 0.5 / 3600, 2)
    stages = ("download", "generate", "extract", "train")
    assert plan["hours"]["total"] == round(sum(plan["hours"][s]["hours"] for s in stages), 2)
    out = eyrie_in_process("run", "--config", seed_variant(tmp_path, "dl"), "--plan",
                           env=plan_env(tmp_path, EYRIE_SERVE_DEADLINE_S="600")).stdout
    assert "the target's weights 540.00 GB, downloaded from the hub" in out
    assert "longer than EYRIE_SERVE_DEADLINE_S (600 s)" in out
    unknown = _plan(seed_variant(tmp_path, "dl-unknown", plan={"download_per_s": None}), tmp_path)
    assert unknown["hours"]["download"]["hours"] is None and unknown["hours"]["total"] is None
    local = _plan(tiny_run_config(tmp_path, "local"), tmp_path)  # a local directory: nothing to download
    assert local["target_download_bytes"] == 0 and local["hours"]["download"]["hours"] == 0


def test_hybrid_and_online_count_the_service_gpu_hours_they_hold(tmp_path):
    """The service holds its 8 GPUs from extraction to the end of training in hybrid and online:
    the seed's hybrid holds them 43.9 h (351 GPU-h), busy 85.5 GPU-h of it."""
    modes = _plan(str(SEED), tmp_path)["storage"]["modes"]
    for mode in ("hybrid", "online"):
        m = modes[mode]
        assert m["service_gpu_hours"] == pytest.approx(8 * m["wall_hours"], abs=0.1), mode
        assert m["service_gpu_hours_busy"] < m["service_gpu_hours"]
    assert modes["hybrid"]["service_gpu_hours_busy"] == pytest.approx(85.5, abs=0.1)
    assert modes["offline"]["service_gpu_hours"] == modes["offline"]["service_gpu_hours_busy"]


@pytest.mark.integration  # it runs a (stand-in) nvidia-smi
def test_gpu_memory_is_this_hosts_device_where_the_plan_runs_on_one(tmp_path, monkeypatch):
    """A test double for the GPU: an `nvidia-smi` that reports an 80 GB card (81,559 MiB)."""
    config = load_config(seed_variant(tmp_path, "device", plan={"gpu_memory": None}))
    from eyrie.core.config import load_settings

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    smi = bin_dir / "nvidia-smi"
    smi.write_text("#!/bin/sh\necho 81559\n")
    smi.chmod(smi.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    sharing = project(config, load_settings(), measure=False).storage.gpu_sharing
    assert sharing.gpu_bytes == 81559 * 2**20 and "nvidia-smi" in sharing.gpu_memory_from
    assert sharing.utilization_for_both is None  # 75 GB of service + 44 GB of trainer: not on 80 GB
    given = project(load_config(str(SEED)), load_settings(), measure=False).storage.gpu_sharing
    assert given.gpu_bytes == parse_size("141GB") and given.gpu_memory_from == "plan.gpu_memory"
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))  # no GPU here
    assumed = project(config, load_settings(), measure=False).storage.gpu_sharing
    assert assumed.gpu_bytes == parse_size("141GB") and "assumed" in assumed.gpu_memory_from


def test_auto_is_described_as_what_it_does():
    """auto: offline where every state fits, else hybrid; never online (--plan and the extract stage agree)."""
    description = ExtractSettings.model_fields["storage"].description
    assert "fastest" not in description and "never online" in description
    for need, budget in ((10, None), (10, 20), (30, 20), (10**9, 20)):
        asked = resolve_mode("auto", need, budget)
        assert asked != "online"
    modes = {mode: SimpleNamespace(fits=fits) for mode, fits in (("offline", False), ("hybrid", True), ("online", True))}
    assert auto_choice(modes) == "hybrid"


def test_the_top_level_fits_describes_the_chosen_mode(tmp_path):
    """The seed: every state (2.94 TB) is over the 2.8 TB budget, hybrid (auto's choice) fits it."""
    plan = _plan(str(SEED), tmp_path)
    assert plan["storage"]["chosen"] == "hybrid"
    assert plan["fits"] is True and plan["fits_expected"] is True
    assert plan["all_states_fit"] is False and plan["all_states_fit_expected"] is False
    from eyrie.core.config import load_settings

    offline = project(load_config(seed_variant(tmp_path, "offline", extract={"storage": "offline"})), load_settings(),
                      measure=False)
    assert offline.fits is False and offline.fits_expected is False  # refused: the mode asked does not fit


def test_eyrie_run_refuses_what_the_estimated_mean_shows_over_the_budget(tmp_path, monkeypatch):
    """`eyrie run` (and POST /runs) checks before anything is enqueued what --plan refuses: with a
    local dataset, at the mean its rows give; a budget no known mean can check (a hub dataset, no
    plan.mean_tokens) is refused as --plan refuses it (issue 41: it started, and extract refused it)."""
    from eyrie.core.config import load_settings
    from eyrie.core.errors import EyrieError
    from eyrie.runs.projection import refuse_before_start

    for name, value in {**OFFLINE, "EYRIE_STORE_URL": f"file://{tmp_path / 'store'}"}.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(EyrieError, match="extract.budget is 5.00 MB"):
        refuse_before_start(load_config(tiny_run_config(tmp_path, "tight", extract={"budget": "5MB"})), load_settings())
    refuse_before_start(load_config(tiny_run_config(tmp_path, "roomy", extract={"budget": "20MB"})), load_settings())
    unknown = load_config(seed_variant(tmp_path, "no-mean", plan={"mean_tokens": None}, extract={"storage": "offline"}))
    with pytest.raises(EyrieError, match="set plan.mean_tokens"):
        refuse_before_start(unknown, load_settings())
