"""`eyrie run --plan` refuses, before any GPU work, what would stop a run hours in (issue 21): hidden
states expected over extract.budget (with each way out and its number), a serve: section larger
than the inference service's GPUs, a GPU list naming a GPU twice, lists that share a GPU where
nothing sequences their services, a trainer on a GPU the vLLM extraction server holds through hybrid
and online training where the two cannot share it (issue 23). Every shipped example passes its own plan on every .env split
the project documents (.env.example and the README's). On Kubernetes, hybrid and online need a Kueue quota
that holds the extraction server and the trainer at once."""

import json
import re

import pytest
import redis
import yaml

from tests.support.harness import ROOT, eyrie, eyrie_in_process, plan_env, seed_variant, tiny_run_config

EXAMPLES = sorted((ROOT / "examples").glob("*.yaml"))
SEED = ROOT / "examples" / "run.kimi-k2.5.yaml"
SPLIT_VARS = ("EYRIE_INFERENCE_GPU_IDS", "EYRIE_EXTRACTOR_GPU_IDS", "EYRIE_TRAINER_GPU_IDS",
              "EYRIE_TENSOR_PARALLEL_SIZE")
OLD_SPLIT = {"EYRIE_INFERENCE_GPU_IDS": "0,1,2,3", "EYRIE_EXTRACTOR_GPU_IDS": "4,5,6", "EYRIE_TRAINER_GPU_IDS": "7",
             "EYRIE_TENSOR_PARALLEL_SIZE": "4"}  # the .env.example the seed's case failed on


def _assignments(text: str) -> dict[str, str]:
    found = {}
    for line in text.splitlines():
        if m := re.match(r"\s*(EYRIE_[A-Z_]+)=(\S+)", line):
            found[m[1]] = m[2]
    return {k: v for k, v in found.items() if k in SPLIT_VARS}


def documented_splits() -> dict[str, dict[str, str]]:
    """.env.example's split, and every ```bash block of the README that sets the GPU ids."""
    splits = {".env.example": _assignments((ROOT / ".env.example").read_text())}
    blocks = re.findall(r"```bash\n(.*?)```", (ROOT / "README.md").read_text(), re.S)
    for i, block in enumerate(b for b in blocks if "EYRIE_INFERENCE_GPU_IDS=" in b):
        splits[f"README.md split {i + 1}"] = _assignments(block)
    return splits


def test_the_documented_splits_are_found():
    splits = documented_splits()
    assert len(splits) >= 2, splits  # .env.example and the README's GPU quick start
    for name, split in splits.items():
        assert {"EYRIE_INFERENCE_GPU_IDS", "EYRIE_EXTRACTOR_GPU_IDS", "EYRIE_TRAINER_GPU_IDS"} <= set(split), name


@pytest.mark.parametrize("split", [None, *documented_splits()])
@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.name)
def test_every_shipped_example_passes_its_own_plan(example, split, tmp_path):
    gpus = documented_splits()[split] if split else {}
    result = eyrie_in_process("run", "--config", str(example), "--plan", "--json", env=plan_env(tmp_path, **gpus), check=False)
    assert result.returncode == 0, f"{example.name} on {split}: {result.stderr}"
    plan = json.loads(result.stdout)
    assert plan["refusals"] == [] and plan["support"]["refusal"] is None
    if plan["budget_bytes"] is not None and plan["hidden_states_bytes_expected"] is not None:
        storage = plan["storage"]  # the mode the run takes holds its bytes in the budget
        assert storage["modes"][storage["chosen"]]["stored_bytes"] <= plan["budget_bytes"]
    if gpus:
        assert plan["gpus"]["serve_gpus"] <= len(set(gpus["EYRIE_INFERENCE_GPU_IDS"].split(",")))


def test_the_seeds_example_fits_its_budget_and_its_8_gpus(tmp_path):
    split = documented_splits()[".env.example"]
    out = eyrie_in_process("run", "--config", str(SEED), "--plan", env=plan_env(tmp_path, **split)).stdout
    assert "samples 25,000" in out and "expected 2.94 TB in fp8" in out
    assert ("budget 2.80 TB, fp8: the upper bound does NOT fit; it fits while samples average at most 3,904 tokens; "
            "expected 2.94 TB at 4,096 tokens a sample: does NOT fit in full: extract.storage hybrid stores 95.3% "
            "of the samples' states") in out
    assert "GPUs: inference 0,1,2,3,4,5,6,7, extractor 0,1,2,3,4,5,6,7, trainer 7; serve needs 8" in out
    assert "the GPU lease gives each of them one holder at a time" in out
    assert ("in hybrid the extraction service runs at --gpu-memory-utilization 0.68 on inference's GPUs with the "
            "trainer on GPU 7 beside it") in out  # on the seed's 8 GPUs the two share GPU 7
    config = yaml.safe_load(SEED.read_text())
    assert config["serve"]["tensor_parallel_size"] == 8 and split["EYRIE_TENSOR_PARALLEL_SIZE"] == "8"
    assert config["run"] == "kimi-k25-perfectblend"
    readme = (ROOT / "README.md").read_text()
    assert "make status RUN=kimi-k25-perfectblend" in readme and "RUN=kimi-k2.5 " not in readme


def test_expected_bytes_over_the_budget_are_refused_with_each_way_out(tmp_path):
    """The seed as it ran: 25,000 samples in bf16 all stored (offline), 5.87 TB expected against
    2.8 TB. Refused before any GPU work (not only by the upper bound), and each way out the message
    names then passes (the storage modes among them)."""
    seed = seed_variant(tmp_path, "seed", dataset={"limit": 25000}, extract={"dtype": "bf16", "storage": "offline"})
    result = eyrie_in_process("run", "--config", seed, "--plan", env=plan_env(tmp_path), check=False)
    assert result.returncode == 1 and "Traceback" not in result.stderr
    err = result.stderr
    assert ("the hidden states are expected to need 5.87 TB (25,000 samples x 4,096 tokens x 4 states x 7168 x "
            "bf16) but extract.budget is 2.80 TB: extract would refuse them after 4.98 h of generation.") in err
    assert "extract.dtype: fp8 (2.94 TB, still too big) with dataset.limit: 23,831 or extract.max_length: 3,904" in err
    assert "; or dataset.limit: 11,919; or extract.max_length: 1,952; or extract.budget: 5.88TB" in err
    assert ("; or extract.storage: hybrid (2.80 TB in the bucket, 2.05 extraction passes, 314.2 service GPU-h held, "
            "9 GPUs at once; auto picks it); or extract.storage: online (825.60 MB in the bucket, 3.00 extraction "
            "passes, 277.0 service GPU-h held, 9 GPUs at once)") in err
    assert "expected 5.87 TB at 4,096 tokens a sample: does NOT fit (refused below)" in result.stdout
    offline = {"storage": "offline"}
    ways = {"fp8-limit": {"dataset": {"limit": 23831}, "extract": {"dtype": "fp8", **offline}},
            "fp8-length": {"dataset": {"limit": 25000}, "extract": {"dtype": "fp8", "max_length": 3904, **offline}},
            "limit": {"dataset": {"limit": 11919}, "extract": {"dtype": "bf16", **offline}},
            "length": {"dataset": {"limit": 25000}, "extract": {"dtype": "bf16", "max_length": 1952, **offline}},
            "budget": {"dataset": {"limit": 25000}, "extract": {"dtype": "bf16", "budget": "5.88TB", **offline}}}
    for name, sections in ways.items():
        plan = json.loads(eyrie_in_process("run", "--config", seed_variant(tmp_path, name, **sections), "--plan", "--json",
                                env=plan_env(tmp_path)).stdout)
        assert plan["fits_expected"] is True and plan["refusals"] == [], name
    for mode in ("hybrid", "online"):
        plan = json.loads(eyrie_in_process("run", "--config", seed_variant(tmp_path, mode, dataset={"limit": 25000}, extract={
            "dtype": "bf16", "storage": mode}), "--plan", "--json", env=plan_env(tmp_path)).stdout)
        assert plan["storage"]["chosen"] == mode and plan["refusals"] == [], mode
    # one sample more than the way out names does not fit: the numbers are the largest that do
    over = seed_variant(tmp_path, "over", dataset={"limit": 11920}, extract={"dtype": "bf16", **offline})
    assert eyrie_in_process("run", "--config", over, "--plan", env=plan_env(tmp_path), check=False).returncode == 1


def test_eyrie_run_itself_refuses_it_before_anything_is_enqueued(tmp_path, redis_url):
    import redis

    seed = seed_variant(tmp_path, "seed-run", dataset={"limit": 25000}, extract={"dtype": "bf16", "storage": "offline"})
    result = eyrie("run", "--config", seed, env=plan_env(tmp_path, EYRIE_REDIS_URL=redis_url), check=False)
    assert result.returncode == 1 and "expected to need 5.87 TB" in result.stderr
    assert not redis.Redis.from_url(redis_url).keys("rq:*")  # nothing enqueued
    assert not (tmp_path / "store" / "runs" / "kimi-k25-perfectblend").exists()


def test_a_serve_section_larger_than_inferences_gpus_is_refused(tmp_path):
    result = eyrie_in_process("run", "--config", str(SEED), "--plan", env=plan_env(tmp_path, **OLD_SPLIT), check=False)
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert ("serve: tensor_parallel_size 8 needs 8 GPUs but inference has 4 (EYRIE_INFERENCE_GPU_IDS=0,1,2,3; "
            "the vLLM extraction server and the verifier serve the target on the same GPUs).") in result.stderr
    assert "give inference 8 GPUs in .env (EYRIE_INFERENCE_GPU_IDS=0,1,2,3,4,5,6,7;" in result.stderr
    pp = tiny_run_config(tmp_path, "pp", serve={"tensor_parallel_size": 2, "pipeline_parallel_size": 2})
    result = eyrie_in_process("run", "--config", pp, "--plan", env=plan_env(tmp_path, EYRIE_INFERENCE_GPU_IDS="0,1,2"), check=False)
    assert "tensor_parallel_size 2 x pipeline_parallel_size 2 needs 4 GPUs but inference has 3" in result.stderr
    fallback = eyrie_in_process("run", "--config", tiny_run_config(tmp_path, "tp1"), "--plan", check=False,
                     env=plan_env(tmp_path, EYRIE_INFERENCE_GPU_IDS="0,1", EYRIE_TENSOR_PARALLEL_SIZE="4"))
    assert "EYRIE_TENSOR_PARALLEL_SIZE=4 (eyrie serve without a run config) needs 4 GPUs but inference has 2" \
        in fallback.stderr


def test_device_lists_are_refused_where_they_must_not_overlap(tmp_path):
    """Shared GPUs are fine under the Redis GPU lease (never two holders of one GPU); under kueue
    every stage gets its GPUs at once, so lists sharing a GPU would give it two owners. A list
    naming a GPU twice overstates the GPUs vLLM gets."""
    split = documented_splits()[".env.example"]
    tiny = tiny_run_config(tmp_path, "ov")
    assert eyrie_in_process("run", "--config", tiny, "--plan", env=plan_env(tmp_path, **split)).returncode == 0
    kueue = eyrie_in_process("run", "--config", tiny, "--plan", env=plan_env(tmp_path, **split, EYRIE_GPU_SCHEDULER="kueue"),
                  check=False)
    assert kueue.returncode == 1 and "Traceback" not in kueue.stderr
    assert ("EYRIE_INFERENCE_GPU_IDS and EYRIE_EXTRACTOR_GPU_IDS share GPU 0,1,2,3,4,5,6,7, and nothing runs them "
            "one at a time (EYRIE_GPU_SCHEDULER=kueue") in kueue.stderr
    disjoint = {**OLD_SPLIT, "EYRIE_TENSOR_PARALLEL_SIZE": "1", "EYRIE_GPU_SCHEDULER": "kueue"}
    assert eyrie_in_process("run", "--config", tiny, "--plan", env=plan_env(tmp_path, **disjoint)).returncode == 0
    twice = eyrie_in_process("run", "--config", tiny, "--plan", env=plan_env(tmp_path, EYRIE_INFERENCE_GPU_IDS="0,1,1"), check=False)
    assert twice.returncode == 1
    assert "EYRIE_INFERENCE_GPU_IDS=0,1,1 names GPU 1 twice: inference gets 2 GPUs, not 3." in twice.stderr


def test_on_demand_storage_is_refused_only_where_the_trainer_cannot_train_beside_the_extraction_server(
        tmp_path, redis_url):
    """hybrid and online train while the vLLM extraction server holds inference's GPUs (issue 23). A
    trainer given one of them trains beside it, the service at the plan's --gpu-memory-utilization
    (their GPU leases share the GPU). Where the two do not fit one GPU at any utilization (an 8 GB
    GPU: the tiny target's service needs 4.00 GB and its trainer 4.01 GB) the trainer would wait for
    the server forever: refused with the fixes. offline hands the GPUs over before training."""
    split = documented_splits()[".env.example"]
    shared = ("(EYRIE_INFERENCE_GPU_IDS=0,1,2,3,4,5,6,7) until training ends, and EYRIE_TRAINER_GPU_IDS=7 shares "
              "GPU 7 with them, where the trainer cannot train beside the service: the service needs 4.00 GB a GPU "
              "and the trainer 4.01 GB, more than a GPU's 8.00 GB (plan.gpu_memory) at any --gpu-memory-utilization, "
              "so the trainer would wait for the server forever.")
    fix = ("give the trainer a GPU of its own (2 GPUs at once: the service's 1 and the trainer's 1): "
           "EYRIE_INFERENCE_GPU_IDS=0,1,2,3,4,5,6 beside EYRIE_TRAINER_GPU_IDS=7 in .env; or set extract.storage: "
           "offline with extract.budget: ")
    disjoint = {**split, "EYRIE_INFERENCE_GPU_IDS": "0,1,2,3,4,5,6", "EYRIE_EXTRACTOR_GPU_IDS": "0,1,2,3,4,5,6",
                "EYRIE_TENSOR_PARALLEL_SIZE": "1"}
    modes = {"online": {"storage": "online"}, "hybrid": {"storage": "hybrid", "budget": "5MB"},
             "auto": {"storage": "auto", "budget": "5MB"}}  # auto takes hybrid: 5 MB hold part of the states
    small_gpu = {"mean_tokens": 200, "gpu_memory": "8GB"}
    for name, extract in modes.items():
        config = tiny_run_config(tmp_path, name, extract={"backend": "vllm", **extract}, plan=small_gpu)
        refused = eyrie_in_process("run", "--config", config, "--plan", env=plan_env(tmp_path, **split), check=False)
        assert refused.returncode == 1 and "Traceback" not in refused.stderr, name
        mode = "hybrid (auto's choice: " if name == "auto" else f"{name} trains while the vLLM extraction server"
        assert f"extract.storage {mode}" in refused.stderr and shared in refused.stderr, refused.stderr
        assert fix in refused.stderr, refused.stderr
        # disjoint lists pass, and so does the same split on an H200 (141 GB), where the two share GPU 7
        assert eyrie_in_process("run", "--config", config, "--plan", env=plan_env(tmp_path, **disjoint)).returncode == 0, name
        roomy = tiny_run_config(tmp_path, f"{name}-roomy", extract={"backend": "vllm", **extract},
                                plan={"mean_tokens": 200})
        plan = eyrie_in_process("run", "--config", roomy, "--plan", env=plan_env(tmp_path, **split)).stdout
        assert (f"in {'hybrid' if name == 'auto' else name} the extraction service runs at --gpu-memory-utilization "
                "0.97 on inference's GPUs with the trainer on GPU 7 beside it") in plan, name
    offline = tiny_run_config(tmp_path, "offline", extract={"backend": "vllm"}, plan=small_gpu)
    assert eyrie_in_process("run", "--config", offline, "--plan", env=plan_env(tmp_path, **split)).returncode == 0
    online = tiny_run_config(tmp_path, "online-run", extract={"backend": "vllm", "storage": "online"}, plan=small_gpu)
    started = eyrie("run", "--config", online, env=plan_env(tmp_path, **split, EYRIE_REDIS_URL=redis_url), check=False)
    assert started.returncode == 1 and shared in started.stderr  # `eyrie run` itself, before anything is enqueued
    assert not redis.Redis.from_url(redis_url).keys("rq:*")


def test_the_seed_on_a_gpu_too_small_to_share_is_refused_with_a_ninth_gpu_or_offline(tmp_path):
    """The seed's target (75.08 GB a GPU) and trainer (44.00 GB) on 100 GB GPUs: no utilization
    leaves the trainer room, and the service needs all 8 of the host's GPUs: a 9th, or offline."""
    split = documented_splits()[".env.example"]
    small = seed_variant(tmp_path, "seed-100gb", plan={"gpu_memory": "100GB"})
    refused = eyrie_in_process("run", "--config", small, "--plan", env=plan_env(tmp_path, **split), check=False)
    assert refused.returncode == 1 and "Traceback" not in refused.stderr
    assert ("the service needs 75.08 GB a GPU and the trainer 44.00 GB, more than a GPU's 100.00 GB "
            "(plan.gpu_memory) at any --gpu-memory-utilization") in refused.stderr
    assert ("give the trainer a GPU of its own (9 GPUs at once: the service's 8 and the trainer's 1): a host with 9 "
            "GPUs, EYRIE_TRAINER_GPU_IDS=8 beside EYRIE_INFERENCE_GPU_IDS=0,1,2,3,4,5,6,7 in .env; or set "
            "extract.storage: offline with extract.budget: 2.94TB on a disk that holds it") in refused.stderr
    nine = {**split, "EYRIE_TRAINER_GPU_IDS": "8"}
    assert eyrie_in_process("run", "--config", small, "--plan", env=plan_env(tmp_path, **nine)).returncode == 0
    offline = seed_variant(tmp_path, "seed-100gb-offline", plan={"gpu_memory": "100GB"},
                       extract={"storage": "offline", "budget": "2.94TB"})
    assert eyrie_in_process("run", "--config", offline, "--plan", env=plan_env(tmp_path, **split)).returncode == 0


def test_on_demand_on_kubernetes_is_refused_where_kueues_quota_cannot_hold_the_server_and_the_trainer(tmp_path):
    """Under kueue the extraction server's Job holds its GPUs while the train Job trains (hybrid and
    online): the seed-8gpu chart's 8-GPU server and 1-GPU trainer in an 8-GPU ClusterQueue would
    leave the train Job waiting for the server forever; a 9-GPU quota admits both."""
    from tests.unit.test_k8s_jobs import chart_templates

    templates = chart_templates("seed-8gpu")
    assert templates["gpuQuota"] == 8
    jobs = tmp_path / "gpu-jobs.json"
    kueue = {"EYRIE_GPU_SCHEDULER": "kueue", "EYRIE_KUEUE_JOBS_FILE": str(jobs)}
    for quota, refused in ((8, True), (9, False)):
        jobs.write_text(json.dumps({**templates, "gpuQuota": quota}))
        result = eyrie_in_process("run", "--config", str(SEED), "--plan", env=plan_env(tmp_path, **kueue), check=False)
        assert (result.returncode == 1) == refused and "Traceback" not in result.stderr, result.stderr
    jobs.write_text(json.dumps(templates))
    refusal = eyrie_in_process("run", "--config", str(SEED), "--plan", env=plan_env(tmp_path, **kueue), check=False).stderr
    assert ("extract.storage hybrid (auto's choice: " in refusal and "trains while the vLLM extraction server's Job "
            "holds its 8 GPUs and the train Job asks 1 more, 9 at once, but Kueue's ClusterQueue has 8 "
            "(kueue.clusterQueue.quota.gpus): the train Job would wait for the server forever.") in refusal, refusal
    assert ("set kueue.clusterQueue.quota.gpus: 9 (nodes with GPUs for both), or set extract.storage: offline with "
            "extract.budget: 2.94TB on a disk that holds it") in refusal, refusal
    offline = seed_variant(tmp_path, "seed-offline", extract={"storage": "offline", "budget": "2.94TB"})
    assert eyrie_in_process("run", "--config", offline, "--plan", env=plan_env(tmp_path, **kueue)).returncode == 0
    no_server = {**templates, "stages": {k: v for k, v in templates["stages"].items() if k != "extract-server"}}
    jobs.write_text(json.dumps(no_server))
    refusal = eyrie_in_process("run", "--config", str(SEED), "--plan", env=plan_env(tmp_path, **kueue), check=False).stderr
    assert "the chart renders no Job for it (gpuJobs.extractServer)" in refusal and "enable gpuJobs.extractServer" in refusal
