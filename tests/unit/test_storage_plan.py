"""`--plan` for the storage modes (extract.storage: offline, hybrid, online, auto): each mode's
bytes, extraction passes and hours by their formulas, auto's choice, the refusals with the modes
among the ways out, and whether the extraction service and the trainer share GPUs. Logic only:
project() and the storage functions called directly, the CLI once; no server."""

import os
from dataclasses import replace

import pytest
import yaml

from eyrie.core.errors import EyrieError
from eyrie.stages.run_config import load_config, RunConfig
from eyrie.core.storage import resolve_mode, shard_allowance
from eyrie.data.manifest import ExtractParams
from eyrie.runs.plan_checks import over_budget, refuse
from eyrie.runs.plan_lines import render
from eyrie.runs.plan_result import Space
from eyrie.runs.projection import project
from eyrie.runs.storage_plan import gpu_sharing, vllm_utilization
from eyrie_extractor.storage_split import ids_object_bound, split, states_file_bound
from tests.support.harness import OFFLINE, ROOT, eyrie_in_process

SEED = ROOT / "examples" / "run.kimi-k2.5.yaml"
GPU_VARS = ("EYRIE_INFERENCE_GPU_IDS", "EYRIE_EXTRACTOR_GPU_IDS", "EYRIE_TRAINER_GPU_IDS",
            "EYRIE_TENSOR_PARALLEL_SIZE", "EYRIE_GPU_SCHEDULER")
KIMI_H, KIMI_VOCAB = 7168, 163_840
PER_TOKEN_FP8 = 4 * KIMI_H + 4 + 8  # 4 states x H x 1 byte, the fp8 scale, the int64 token id


@pytest.fixture
def settings(monkeypatch):
    from eyrie.core.config import load_settings

    for name in GPU_VARS:
        monkeypatch.delenv(name, raising=False)
    return lambda **gpus: load_settings(**gpus)


def _seed(**extract) -> RunConfig:
    config = load_config(SEED)
    return config.model_copy(update={"extract": config.extract.model_copy(update=extract)}) if extract else config


def _small(storage: str = "auto", budget: str | None = "2GB", **plan) -> RunConfig:
    """3,600 samples of 1,000 tokens, hidden 1024, 2 states: 1.0 h of extraction (1,000 tok/s) and
    1.0 h of training (3 epochs at 3,000 tok/s): the service is slower than the trainer here."""
    return RunConfig.model_validate({
        "run": "small", "target": {"model": "made/up", "shape": {"hidden_size": 1024, "num_hidden_layers": 16,
                                                              "vocab_size": 32000}},
        "dataset": {"source": "made/up-prompts", "limit": 3600}, "serve": {"tensor_parallel_size": 2},
        "extract": {"layers": [8], "backend": "vllm", "storage": storage, **({"budget": budget} if budget else {})},
        "train": {"epochs": 3, "draft_vocab": 8000, "seq_len": 2048},
        "plan": {"mean_tokens": 1000, "generate_tokens_per_s": 1000, "extract_tokens_per_s": 1000,
                 "train_tokens_per_s": 3000, **plan}})


def test_the_seeds_modes_follow_the_formulas(settings):
    p = project(_seed(), settings(), measure=False)
    n, tokens = 25_000, 25_000 * 4096
    full, ids = tokens * PER_TOKEN_FP8 + n * 256, tokens * 8 + n * 256
    f = (2.8e12 - ids) / (full - ids)  # hybrid fills the budget: f x full + (1 - f) x ids
    modes = p.storage.modes
    off, hyb, onl = modes["offline"], modes["hybrid"], modes["online"]
    assert (off.stored_bytes, off.extraction_passes, off.stored_fraction) == (full, 1.0, 1.0)
    assert abs(hyb.stored_bytes - 2.8e12) <= 1 and hyb.stored_fraction == round(f, 4) == 0.9533
    assert hyb.extraction_passes == round(f + (1 - f) * 3, 3) == 1.093
    assert (onl.stored_bytes, onl.extraction_passes) == (ids, 3.0)
    batch = 8192 * PER_TOKEN_FP8  # one batch of generated states on the trainer's disk
    assert off.trainer_cache_bytes == full and hyb.trainer_cache_bytes == hyb.stored_bytes + batch
    assert onl.trainer_cache_bytes == ids + batch
    assert hyb.bucket_bytes == hyb.stored_bytes + 25_000 * 8192 * 4  # + the generated records
    extract_h, train_h = 9.77, 34.62  # 102.4 M tokens at 2,912 tok/s; x 3 epochs at 2,465 tok/s
    # busy: extracting; held: offline stops the service once extracted, hybrid and online keep its 8 GPUs
    # until training ends (issue 29)
    assert off.service_gpu_hours_busy == off.service_gpu_hours == round(extract_h * 8, 2) == 78.16
    assert hyb.service_gpu_hours_busy == round(extract_h * 8 * (f + (1 - f) * 3), 2)
    assert onl.service_gpu_hours_busy == round(extract_h * 8 * 3, 2) == 234.48
    assert hyb.service_gpu_hours == pytest.approx(8 * hyb.wall_hours, abs=0.05) == 351.47
    assert onl.service_gpu_hours == pytest.approx(8 * train_h, abs=0.05)
    assert {m.trainer_gpu_hours for m in modes.values()} == {train_h}
    assert off.wall_hours == round(extract_h + train_h, 2) == 44.39
    assert hyb.wall_hours == round(f * extract_h + train_h, 2)  # the service outpaces the trainer
    assert onl.wall_hours == train_h
    assert (off.gpus_at_once, hyb.gpus_at_once, onl.gpus_at_once) == (8, 9, 9)
    assert [off.fits, hyb.fits, onl.fits] == [False, True, True]


def test_a_service_slower_than_the_trainer_paces_the_epochs(settings):
    p = project(_small(storage="hybrid", budget="1.5GB"), settings(), measure=False)
    modes = p.storage.modes
    full, ids = 3600 * 1000 * (2 * 1024 * 2 + 8) + 3600 * 256, 3600 * 1000 * 8 + 3600 * 256
    f = (1.5e9 - ids) / (full - ids)
    assert modes["hybrid"].stored_fraction == round(f, 4)
    assert modes["offline"].wall_hours == 2.0  # 1 h extraction, then 1 h training
    assert modes["online"].wall_hours == 3.0  # each of 3 epochs waits on a full 1 h pass
    assert modes["hybrid"].wall_hours == round(f * 1 + 3 * (f / 3 + (1 - f) * 1), 2)
    assert modes["online"].service_gpu_hours == 6.0  # 3 passes x 1 h x tensor parallel 2
    assert p.storage.chosen == "hybrid" and p.refusals == []


def test_auto_takes_offline_when_it_fits_and_hybrid_when_not(settings):
    roomy = project(_small(budget="20GB"), settings(), measure=False)
    assert roomy.storage.chosen == "offline" and roomy.storage.why.startswith("auto: every hidden state")
    tight = project(_small(budget="1GB"), settings(), measure=False)
    assert tight.storage.chosen == "hybrid" and tight.refusals == []
    assert "hybrid stores" in tight.storage.why
    unbounded = project(_small(budget=None), settings(), measure=False)
    assert unbounded.storage.chosen == "offline"
    for p in (roomy, tight, unbounded):  # the plan and the extract stage's resolve_mode agree
        full = p.storage.modes["offline"].stored_bytes
        assert resolve_mode("auto", full, p.budget_bytes) == p.storage.chosen


def test_an_explicit_offline_over_budget_is_refused_with_the_storage_modes_as_ways_out(settings):
    p = project(_seed(storage="offline"), settings(), measure=False)
    problem, fix = over_budget(p)
    assert "expected to need 2.94 TB (25,000 samples x 4,096 tokens x 4 states x 7168 x fp8)" in problem
    assert "extract.budget: 2.94TB on a disk that holds it" in fix
    assert ("extract.storage: hybrid (2.80 TB in the bucket, 1.09 extraction passes, 351.5 service GPU-h held, "
            "9 GPUs at once; auto picks it)") in fix
    assert "extract.storage: online (825.60 MB in the bucket, 3.00 extraction passes, 277.0 service GPU-h held" in fix
    with pytest.raises(EyrieError):
        refuse(p)
    assert over_budget(project(_seed(storage="hybrid"), settings(), measure=False)) is None


@pytest.mark.parametrize("storage", ["auto", "offline", "hybrid", "online"])
def test_a_budget_too_small_for_the_token_ids_is_refused_in_every_mode(storage, settings):
    p = project(_small(storage=storage, budget="20MB"), settings(), measure=False)  # ids: 29.7 MB
    assert not any(m.fits for m in p.storage.modes.values())
    with pytest.raises(EyrieError) as err:
        refuse(p)
    if storage == "offline":
        assert "the hidden states are expected to need" in str(err.value)
        assert "extract.storage:" not in str(err.value)  # no mode to offer
    else:
        assert "even the token ids alone are expected to need 29.72 MB (3,600 samples x 1,000 tokens x 8 B)" \
            in str(err.value)
        assert "dataset.limit: 2,422" in str(err.value)  # 20 MB / (1,000 x 8 + 256) B a sample, rounded down


def test_the_seed_with_25000_samples_fits_its_budget_through_hybrid(settings):
    config = _seed()
    assert config.dataset.limit == 25_000 and config.extract.storage == "auto" and config.extract.budget == "2.8TB"
    p = project(config, settings(), measure=False)
    s = p.storage
    assert s.chosen == "hybrid" and s.modes["hybrid"].stored_bytes <= 2.8e12 and p.refusals == []
    assert "online would end sooner (34.6 h) at 277.0 service GPU-h held and 9 GPUs at once" in s.why


def test_the_extract_shards_fill_the_budget_by_the_plans_rule(settings):
    """hybrid's bucket in the plan (f x states + (1 - f) x token ids = the budget) and the extract
    shards' rule are one: a shard's states files and ids-only objects, at their bounds, stay within
    its allowance, and it keeps the plan's share of states to within one sample. At 1.79 GB a shard's
    49.7 MB hold 12 states files and a tenth of another: not the ids of the other 88 as well."""
    shards, per_shard, tokens = 36, 100, 1000
    p = project(_small(storage="hybrid", budget="1.79GB"), settings(), measure=False)
    hybrid = p.storage.modes["hybrid"]
    assert p.samples == shards * per_shard and abs(hybrid.stored_bytes - p.budget_bytes) <= 1
    params = ExtractParams(backend="vllm", aux_layers=p.aux_layers, dtype=p.dtype, max_length=tokens,
                           num_layers=p.num_layers, hidden_size=p.hidden_size, samples=p.samples,
                           tokens=p.samples * tokens, truncated=0, projected_bytes=1, budget_bytes=p.budget_bytes,
                           storage="hybrid", shard_allowance_bytes=shard_allowance("hybrid", p.budget_bytes, shards))
    todo = [{"sample_id": f"s{row}", "row": row, "input_ids": [0] * tokens} for row in range(per_shard)]
    kept, ids_only = split(params, [], todo)
    shard_bytes = len(kept) * states_file_bound(tokens, params) + len(ids_only) * ids_object_bound(tokens)
    assert shard_bytes <= params.shard_allowance_bytes and shards * shard_bytes <= hybrid.stored_bytes
    assert hybrid.stored_fraction * per_shard - 1 <= len(kept) <= hybrid.stored_fraction * per_shard


def test_gpu_memory_of_the_service_and_the_trainer(settings):
    p = project(_seed(), settings(), measure=False)
    g = p.storage.gpu_sharing
    svc, trn = g.service, g.trainer
    assert svc.weights == 540e9 / 8 and svc.weights_from == "plan.target_weights"
    assert svc.kv_floor == 2 * 61 * KIMI_H * 2 * 16384 // 8  # K and V, every layer, bf16, max_model_len
    h = KIMI_H
    assert trn.trainable_params == 3 * h * h + 7 * h * h + 3 * h * (7 * h // 2) + h * 32000
    assert trn.frozen == (KIMI_VOCAB + 32000) * h * 4
    assert round(svc.total / 1e9, 2) == 75.08 and round(trn.total / 1e9, 2) == 44.0
    assert g.utilization == 0.9 and g.trainer_fits_beside is False  # 14.1 GB left at 0.9
    assert g.utilization_for_both == 0.68 and g.gpus_apart == 9
    tight = _seed().model_copy(update={"plan": _seed().plan.model_copy(update={"gpu_memory": "100GB"})})
    assert gpu_sharing(tight, p).utilization_for_both is None  # 75 GB + 44 GB > 100 GB
    assert vllm_utilization(["--gpu-memory-utilization", "0.5"]) == 0.5
    assert vllm_utilization(["--enforce-eager", "--gpu-memory-utilization=0.6"]) == 0.6
    with pytest.raises(EyrieError, match="--gpu-memory-utilization most is not a share of the GPU"):
        vllm_utilization(["--gpu-memory-utilization", "most"])


def test_a_small_target_shares_and_a_shared_trainer_gpu_is_named(settings):
    small = project(_small(), settings(), measure=False).storage.gpu_sharing
    assert small.trainer_fits_beside and "estimated as a dense bf16 model" in small.service.weights_from
    split = {"inference_gpu_ids": "0,1,2,3,4,5,6,7", "extractor_gpu_ids": "0,1,2,3,4,5,6,7", "trainer_gpu_ids": "7"}
    lines = "\n".join(render(replace(project(_seed(), settings(**split), measure=False), space=_no_space())))
    assert "this host's split gives the trainer GPU 7, one of inference's (8 GPUs in all)" in lines
    assert "on 8 GPUs hybrid runs only with the service at --gpu-memory-utilization 0.68 and the trainer on GPU 7" \
        in lines
    nine = project(_seed(), settings(**{**split, "trainer_gpu_ids": "8"}), measure=False)
    assert nine.storage.gpu_sharing.trainer_on_service_gpus == []


def _no_space() -> Space:
    return Space(basis="expected mean", mode="hybrid", bucket_bytes=0, trainer_copy_bytes=0, bucket_dir=None,
                 trainer_dir=None, bucket_free=None, trainer_free=None, same_device=False)


def test_plan_prints_each_modes_bytes_and_hours(tmp_path):
    clean = {k: v for k, v in os.environ.items() if not k.startswith("EYRIE_")}
    env = {**clean, **OFFLINE, "EYRIE_STORE_URL": f"file://{tmp_path / 'store'}",
           "EYRIE_CACHE_DIR": str(tmp_path / "cache")}
    out = eyrie_in_process("run", "--config", str(SEED), "--plan", env=env).stdout
    assert ("mode    |    bucket | trainer cache | extraction passes | service GPU-h held (busy) | trainer GPU-h "
            "|  wall h | fits" in out)
    rows = {"offline": "  2.94 TB |       2.94 TB |              1.00 |               78.2 (78.2) |          34.6 |    44.4 | no",
            "hybrid ": "  2.80 TB |       2.80 TB |              1.09 |              351.5 (85.5) |          34.6 |    43.9 | yes",
            "online ": "825.60 MB |       1.06 GB |              3.00 |             277.0 (234.5) |          34.6 |    34.6 | yes"}
    for mode, row in rows.items():
        assert f"{mode} | {row}" in out, mode
    assert "chosen: hybrid (auto: offline's 2.94 TB exceed extract.budget 2.80 TB; hybrid stores 95.3%" in out
    assert "extraction service: 75.08 GB a GPU on 8 (target 540.00 GB (plan.target_weights) / 8 = 67.50 GB" in out
    assert "trainer: 44.00 GB on 1" in out and "it does at 0.68" in out
    assert "so hybrid needs a host with 9 GPUs" in out
    assert yaml.safe_load(SEED.read_text())["extract"]["storage"] == "auto"


def test_what_the_extract_stage_would_refuse_in_hybrid_and_online_is_refused_first(settings):
    hf = _small(budget="1GB").model_copy(update={"extract": _small(budget="1GB").extract.model_copy(
        update={"backend": "hf"})})
    p = project(hf, settings(), measure=False)
    assert p.storage.chosen == "hybrid"
    problem, fix = next(r for r in p.refusals if "extract.backend is hf" in r[0])
    # offline: 3.6 M tokens x 4,104 B (2 states x 1,024 x bf16 + the token id)
    assert "extract.storage hybrid (auto's choice: offline's 14.78 GB exceed extract.budget 1.00 GB" in problem
    assert fix.startswith("set extract.backend: vllm")
    no_budget = project(_small(storage="hybrid", budget=None), settings(), measure=False)
    assert any("extract.storage: hybrid stores hidden states up to extract.budget, and none is set" in problem
               for problem, _ in no_budget.refusals)
    assert project(_small(storage="online", budget=None), settings(), measure=False).refusals == []
