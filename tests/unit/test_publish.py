"""`eyrie publish` (issue 43, items 1-3 and 5): a finished run's drafter and its generated card into a directory
(`--to`) and a hub repository (`--repo`), what it refuses, and publishing again. The run is speculators' own
drafter of the tiny target exported by eyrie's export (test_served_drafter.exported), its store holding the
records the stages write (input rows, answers, shard manifests, hidden-state objects) and a verify record built by
verify's own figure code from vLLM-shaped passes. The hub is tests/support/hub_stub.py: a local stand-in for
huggingface.co (not reachable from here), reached as huggingface_hub reaches the hub (HF_ENDPOINT, HF_TOKEN)."""

from __future__ import annotations

import hashlib
import json
import re
import shlex
import shutil
from pathlib import Path

import orjson
import pytest
from huggingface_hub import ModelCard

from eyrie.core.errors import EyrieError
from eyrie.data.manifest import (Counts, DatasetRef, ExtractParams, Layout, ShardManifest, ShardPlan,
                                 load_run_manifest)
from eyrie.data.store import FileStore
from eyrie.data.verify_outputs import set_blocks, worst
from eyrie_trainer import verify
from eyrie_trainer.card import DRAFTER_DIR, redact
from eyrie_trainer.publish import ALLOWS, files, publish, same_content
from eyrie_trainer.verify_figures import benchmark_result, k_figures
from tests.support.harness import OFFLINE, ROOT, TINY, eyrie
from tests.support.hub_stub import metadata_errors, running
from tests.support.processes import free_port
from tests.unit.test_served_drafter import K, exported

RUN, REPO = "r", "alice/tiny-drafter"
# how verify served the target (a verify record's serve_flags): what the card's command must carry, and what vLLM's
# CPU build serves the tiny target with in the test of that command
SERVED_WITH = ["--tensor-parallel-size", "1", "--max-model-len", "256", "--enforce-eager"]
TOKEN = "hf_" + "Zq7" * 12  # a token's shape: the check finds it by value and by shape
DATA = ROOT / "assets" / "prompts" / "train-mix-1k.jsonl"  # its README.md's table names its license
RECIPE = "lr 1e-3, warmup 3%, linear decay, 256-token packs, 1 epochs = 3 steps, because the test says so"
CREDENTIALS = re.compile(rb"://[^/\s@\"'`<>]+@")


# --- the finished run ------------------------------------------------------------------------------------------

def passes(rate_1: float, rate_8: float, drafts: float = 0, accepted: float = 0, per_pos: dict | None = None,
           answers: list | None = None) -> dict:
    """One server's pass over a set as verify's Client.one_pass records it (8 prompts, all of them at 1 in flight:
    verify's default serial_prompts, the fewest answers its outputs verdict judges)."""
    answers = answers or [[1, 2, 3], [4, 5], [6], [7, 8], [9], [10, 11], [12], [13]]
    before = {"drafts": 0.0, "accepted_tokens": 0.0, "per_pos": {}}
    after = {"drafts": drafts, "accepted_tokens": accepted, "per_pos": per_pos or {}}
    return {"outputs": answers, "serial_outputs": answers, "tokens_per_s": {"1": rate_1, "8": rate_8},
            "seconds": {"1": 1.0, "8": 1.0}, "counters": (before, after)}


def verify_record(drafter: dict, accepted: float = 130.0, changed: bool = False) -> dict:
    """The manifest's `verify` as eyrie_trainer.verify builds it: per set, the target alone against the drafter at
    the trained K (verify_figures.benchmark_result), the held-out set's headline at the top. `changed`: the drafter
    changes answers the target alone gives the same at 1 and 8 in flight."""
    alone = passes(10.0, 40.0)
    spec = passes(15.0, 52.0, 100.0, accepted, {0: 70.0, 1: 40.0, 2: accepted - 110.0},
                  [[9], [9], [6], [7, 8], [9], [10, 11], [12], [13]] if changed else None)
    benchmarks = {name: benchmark_result(alone, {K: spec}, 8) for name in (verify.HELDOUT, "gsm8k")}
    result = verify.headline(benchmarks[verify.HELDOUT], K, drafter)
    verdicts = {f["outputs_verdict"] for b in benchmarks.values() for f in k_figures(b)}
    result.update(benchmarks=benchmarks, ks=[K], verified_at="2026-01-02T03:04:05+00:00", definitions=verify.DEFINITIONS,
                  identical_outputs=verdicts == {"identical"}, outputs_verdict=worst(verdicts),
                  hardware="CPU: test host, 2 cores", vllm_version="0.32.0", serve_flags=SERVED_WITH)
    return result


def answered(n: int, **more) -> dict:
    """A generate record of a done sample, as the generator writes it (the fields a dataset row keeps and others)."""
    return {"sample_id": f"s{n}", "row": n, "status": "done", "reason": None, "error": None, "attempts": 1,
            "messages": [{"role": "user", "content": f"question {n}"}], "reasoning": f"think {n}",
            "reasoning_source": "reasoning", "content": f"answer {n}", "finish_reason": "stop",
            "usage": {"prompt_tokens": 3, "completion_tokens": 4}, "prompt_token_ids": [1, 2, 100 + n],
            "completion_token_ids": [7, 8, 9, 200 + n], "latency_s": 0.5, **more}


ANSWERED = [answered(0), answered(1, turns=[{"content": "first"}, {"content": "answer 1"}]), answered(2)]


def jsonl(rows: list[dict]) -> bytes:
    return b"".join(orjson.dumps(r) + b"\n" for r in rows)


def shard(stage: str, counts: Counts, **fields) -> dict:
    return ShardManifest(run=RUN, stage=stage, shard=0, counts=counts, failure_errors={}, started_at="t",
                         finished_at="t", worker="w", bytes=0, **fields).model_dump()


def finished_run(tmp_path: Path, *, verified: bool = True, **saved) -> FileStore:
    """Run "r" as its stages leave it: 4 prompts (3 answered, 1 skipped), 3 samples' hidden states, the drafter
    exported, vLLM's verify recorded (`verified`)."""
    store, _ = exported(tmp_path, **saved)
    layout, manifest = Layout(RUN), load_run_manifest(store, RUN)
    ids = [f"s{i}" for i in range(4)]
    rows = store.put_bytes(layout.generate_input(0), jsonl([{"sample_id": i, "row": n} for n, i in enumerate(ids)]))
    answers = store.put_bytes(layout.generate_shard(0), jsonl(ANSWERED + [{"sample_id": ids[3], "row": 3, "status": "skipped",
                                                                           "reason": "prompt over max_length"}]))
    store.put_json(layout.generate_shard_manifest(0), shard(
        "generate", Counts(total=4, done=3, skipped=1), object=answers.key, sha256=answers.sha256,
        skip_reasons={"prompt over max_length": 1}))
    states = [{"sample_id": i, "key": store.put_bytes(layout.extract_sample(0, i), b"states").key} for i in ids[:3]]
    store.put_json(layout.extract_shard_manifest(0), shard("extract", Counts(total=3, done=3), skip_reasons={},
                                                           samples=states))
    manifest.generate_shards = [ShardPlan(index=0, row_start=0, row_end=4, input_key=rows.key, input_sha256=rows.sha256)]
    manifest.dataset = DatasetRef(source=str(DATA), kind="jsonl", revision=hashlib.sha256(DATA.read_bytes()).hexdigest(),
                                  row_end=4)
    manifest.extract = ExtractParams(backend="hf", aux_layers=[2, 4, 5], dtype="bf16", max_length=None, num_layers=8,
                                     hidden_size=64, samples=3, tokens=48, truncated=0, projected_bytes=1,
                                     budget_bytes=None)
    manifest.train.recipe = RECIPE
    manifest.verify = verify_record(manifest.drafter) if verified else None
    store.put_json(layout.manifest, manifest.model_dump())
    return store


def set_manifest(store, **fields) -> None:
    manifest = load_run_manifest(store, RUN)
    store.put_json(Layout(RUN).manifest, manifest.model_copy(update=fields).model_dump())


def expected_figures(manifest) -> dict:
    """What the card's model-index must say: per set (label) and metric name, the manifest's own value."""
    d, figures = manifest.drafter, {}
    figures[("heldout", f"eyrie simulated acceptance length, K={d['k']}")] = d["tau"]
    for label, block in set_blocks(manifest.verify["benchmarks"]):
        for k, f in block["k"].items():
            figures[(label, f"vLLM mean acceptance length, K={k}")] = f["vllm_acceptance_length"]
            for n in ("8", "1"):
                figures[(label, f"speedup at {n} in flight, K={k}")] = f["speedup"][n]
    return figures


def card_figures(card: ModelCard) -> dict:
    return {(r.dataset_name, r.metric_name): r.metric_value for r in card.data.eval_results}


def no_secrets(files: dict[str, bytes]) -> None:
    for name, data in files.items():
        assert TOKEN.encode() not in data and not CREDENTIALS.search(data), f"{name} holds a secret"


# --- what --to writes: the drafter and its card ----------------------------------------------------------------

def test_to_dir_writes_the_exported_drafter_and_a_card_made_from_the_manifest(tmp_path):
    store = finished_run(tmp_path)
    out = tmp_path / "published"
    result = publish(store, RUN, to=out)
    assert result["to"]["changed"] == ["README.md", "config.json", "model.safetensors"]
    assert sorted(p.name for p in out.iterdir()) == ["README.md", "config.json", "model.safetensors"]
    for name in ("config.json", "model.safetensors"):  # the export's bytes, as `eyrie export` writes them
        assert (out / name).read_bytes() == (tmp_path / "drafter" / name).read_bytes()

    manifest, card = load_run_manifest(store, RUN), ModelCard.load(out / "README.md")
    assert card_figures(card) == expected_figures(manifest)  # metadata parsed by huggingface_hub's card classes
    assert metadata_errors(card.content) == []  # what the hub checks (hub_stub.py), and that check is no formality:
    assert metadata_errors(card.content.replace("type: speedup", "kind: speedup", 1)) != []
    data = card.data.to_dict()
    assert data["license"] == "apache-2.0" and "base_model" not in data and "datasets" not in data  # a local target
    assert {"eagle3", "speculative-decoding"} <= set(data["tags"]) and data["library_name"] == "speculators"
    text = card.text
    spec = json.loads(re.search(r"--speculative-config '(\{.*\})'", text)[1])
    # no path of the publishing host; the flags verify served the target with
    assert text.count(f"vllm serve {TINY.name} {' '.join(SERVED_WITH)} --speculative-config") == 1
    assert spec == {"method": "eagle3", "model": DRAFTER_DIR, "num_speculative_tokens": K}
    heldout = manifest.verify["benchmarks"]["heldout"]["k"][str(K)]
    assert " / ".join(f"{p:.3f}" for p in heldout["vllm_per_position_acceptance"]) in text
    for said in (manifest.target.revision, manifest.dataset.revision, RECIPE, "MIT + Apache-2.0 (as its parts)",
                 "prompt over max_length: 1", "CPU: test host, 2 cores", "vLLM 0.32.0", "1.5x / 1.3x",
                 f"**{manifest.verify['outputs_verdict']}**", "| generate | 4 | 3 | 1 | 0 | 0 | 0 |",
                 "train: counted from the plan"):  # no train/samples.json in this store: audit says so
        assert said in text, said
    assert "--allow" not in text and "refusals" not in text


def test_same_content_compares_lfs_files_by_sha256_and_others_by_git_blob_id(tmp_path):
    from huggingface_hub.hf_api import RepoFile

    path = tmp_path / "f"
    path.write_bytes(b"weights")
    sha, blob = hashlib.sha256(b"weights").hexdigest(), hashlib.sha1(b"blob 7\0weights").hexdigest()
    lfs = {"size": 7, "oid": sha, "pointerSize": 130}
    assert same_content(RepoFile(path="f", size=7, oid="0" * 40, lfs=lfs), path)
    assert not same_content(RepoFile(path="f", size=7, oid=blob, lfs={**lfs, "oid": "1" * 64}), path)
    assert same_content(RepoFile(path="f", size=7, oid=blob), path)
    assert not same_content(RepoFile(path="f", size=7, oid="0" * 40), path) and not same_content(None, path)


@pytest.mark.integration  # on a GPU host it asks nvidia-smi
def test_verify_records_the_hardware_and_the_vllm_version_the_card_states(tmp_path):
    from eyrie.core.vllm import on_cpu

    described = verify.hardware()
    assert described.startswith("CPU: ") and described.endswith(" cores") if on_cpu() else "x " in described
    log = tmp_path / "target.log"
    log.write_text("INFO 01-02 03:04:05 [api_server.py:1] vLLM API server version 0.32.0\nINFO ready\n")
    assert verify.served_version(log) == "0.32.0" and verify.served_version(tmp_path / "none.log") is None


# --- refusals -------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("case, said, allow", [
    ("unverified", "vLLM has not verified its drafter", "unverified"),
    ("skipped", "its verify was skipped: no worker of the verify queue is up", "unverified"),
    ("other checkpoint", "vLLM verified checkpoint 7, and checkpoint 0 is exported now", "other-checkpoint"),
    ("answers changed", "served with it, vLLM's answers were judged", "outputs-differ"),
    ("no drafts", "vLLM counted no drafts on the held-out prompts", "no-drafts"),
])
def test_each_refusal_is_overridden_by_its_own_name_alone_and_the_card_names_it(tmp_path, case, said, allow):
    store = finished_run(tmp_path)
    drafter = load_run_manifest(store, RUN).drafter
    record = {"unverified": None, "skipped": {"skipped": "no worker of the verify queue is up"},
              "other checkpoint": {**verify_record(drafter), "checkpoint": "7"},
              "answers changed": verify_record(drafter, changed=True),
              "no drafts": {**verify_record(drafter), "vllm_acceptance_length": None}}[case]
    set_manifest(store, verify=record)
    out = tmp_path / "published"
    with pytest.raises(EyrieError) as refused:
        publish(store, RUN, to=out)
    assert said in str(refused.value) and f"--allow {allow} " in refused.value.fix and not out.exists()
    others = tuple(name for name in ALLOWS if name != allow)
    with pytest.raises(EyrieError, match=f"--allow {allow} "):  # every other refusal allowed: still refused
        publish(store, RUN, to=out, allow=others)
    with pytest.raises(EyrieError, match="no refusal named outputs-same to allow"):
        publish(store, RUN, to=out, allow=(allow, "outputs-same"))
    publish(store, RUN, to=out, allow=(allow,))
    text = (out / "README.md").read_text()
    assert "Published over these refusals" in text and f"`--allow {allow}`" in text and said in text


def test_a_license_not_known_here_is_refused_unless_stated_and_the_card_says_who_stated_it(tmp_path):
    target = tmp_path / "target"
    shutil.copytree(TINY, target)
    (target / "README.md").write_text("# a target with no license in its card\n")
    store = finished_run(tmp_path)
    set_manifest(store, target=load_run_manifest(store, RUN).target.model_copy(update={"model": str(target)}))
    out = tmp_path / "published"
    with pytest.raises(EyrieError, match="target license is not known here") as refused:
        publish(store, RUN, to=out)
    assert "--license SPDX" in refused.value.fix and not out.exists()
    with pytest.raises(EyrieError, match="forbids redistributing derivatives: its license is cc-by-nd-4.0"):
        publish(store, RUN, to=out, license="cc-by-nd-4.0")
    publish(store, RUN, to=out, license="apache-2.0")
    text = (out / "README.md").read_text()
    assert "license: apache-2.0" in text and "stated by the publisher (`eyrie publish --license`)" in text
    (target / "README.md").write_text("---\nlicense: mit\n---\n")
    with pytest.raises(EyrieError, match="--license apache-2.0 is not the target's license: mit"):
        publish(store, RUN, to=out, license="apache-2.0")


@pytest.mark.parametrize("license, refused", [("cc-by-nc-nd-4.0", True), ("cc-by-nd-4.0", True),
                                              ("apache-2.0", False), ("llama3", False)])
def test_a_target_whose_card_forbids_derivatives_is_refused_whatever_is_allowed(tmp_path, license, refused):
    target = tmp_path / "target"
    shutil.copytree(TINY, target)
    (target / "README.md").write_text(f"---\nlicense: {license}\n---\n\n# a target\n")
    store = finished_run(tmp_path)
    manifest = load_run_manifest(store, RUN)
    set_manifest(store, target=manifest.target.model_copy(update={"model": str(target)}))
    out = tmp_path / "published"
    if refused:
        for allow in ((), tuple(ALLOWS)):
            with pytest.raises(EyrieError, match=f"forbids redistributing derivatives: its license is {license}"):
                publish(store, RUN, to=out, allow=allow)
        assert not out.exists()
    else:
        publish(store, RUN, to=out)
        assert ModelCard.load(out / "README.md").data.license == license  # the drafter carries the target's


def test_no_file_holds_a_token_or_a_url_with_credentials(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    store = finished_run(tmp_path)
    source = f"https://alice:s3cret-pass@data.example/prompts.jsonl?token={TOKEN}"
    set_manifest(store, dataset=load_run_manifest(store, RUN).dataset.model_copy(update={"source": source}))
    out = tmp_path / "published"
    publish(store, RUN, to=out)
    files = {p.name: p.read_bytes() for p in out.iterdir()}
    no_secrets(files)
    assert b"s3cret" not in files["README.md"] and redact(source).encode() in files["README.md"]

    manifest = load_run_manifest(store, RUN)  # a secret where no redaction knows to look: refused, nothing written
    set_manifest(store, train=manifest.train.model_copy(update={"recipe": f"{RECIPE} (key {TOKEN})"}))
    with pytest.raises(EyrieError, match="README.md would publish a token") as refused:
        publish(store, RUN, to=tmp_path / "again")
    assert TOKEN not in str(refused.value) and not (tmp_path / "again").exists()


def test_to_dir_refuses_a_directory_holding_other_files_and_publishing_again_changes_nothing(tmp_path):
    store, out = finished_run(tmp_path), tmp_path / "published"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    with pytest.raises(EyrieError, match="holds files eyrie does not publish: notes.txt"):
        publish(store, RUN, to=out)
    (out / "notes.txt").unlink()
    publish(store, RUN, to=out)
    assert publish(store, RUN, to=out)["to"]["changed"] == []
    set_manifest(store, verify=verify_record(load_run_manifest(store, RUN).drafter, accepted=150.0))
    assert publish(store, RUN, to=out)["to"]["changed"] == ["README.md"]


# --- the hub ----------------------------------------------------------------------------------------------------

def hub_env(tmp_path: Path, url: str) -> dict:
    """The `eyrie` command's environment: the run's store, and huggingface_hub's own settings aimed at the stub."""
    import os

    env = {k: v for k, v in os.environ.items() if k not in OFFLINE and not k.startswith(("HF_", "EYRIE_"))}
    return {**env, "HF_ENDPOINT": url, "HF_TOKEN": TOKEN, "HF_HOME": str(tmp_path / "hf"),
            "HF_HUB_DISABLE_TELEMETRY": "1", "EYRIE_STORE_URL": f"file://{tmp_path / 'store'}",
            "EYRIE_CACHE_DIR": str(tmp_path / "cache")}


@pytest.mark.integration
def test_publish_commits_once_what_to_dir_holds_and_again_only_what_changed(tmp_path):
    store = finished_run(tmp_path)
    out = tmp_path / "published"
    with running(TOKEN) as (url, hub):
        env = hub_env(tmp_path, url)
        said = eyrie("publish", "--run", RUN, "--repo", REPO, "--to", str(out), "--with-answers", env=env).stdout
        assert f"model {REPO}: commit" in said and f"dataset {REPO}: commit" in said
        [first], [answers] = hub.commits(REPO), hub.commits(REPO, "dataset")
        written = {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()}
        assert first["changed"] == written  # the commit holds exactly the files of --to DIR (the answers: DIR/answers)
        assert answers["changed"] == {n: (out / "answers" / n).read_bytes() for n in files(out / "answers")}
        assert len(answers["changed"]) == 3 and hub.repos["dataset", REPO]["private"]
        assert f"run {RUN}" in first["message"] and hub.repos["model", REPO]["private"]
        assert "POST /api/validate-yaml -> 200" in hub.requests  # huggingface_hub had the hub check the card
        no_secrets({**first["changed"], **answers["changed"]})
        card = ModelCard.load(out / "README.md")
        assert card_figures(card) == expected_figures(load_run_manifest(store, RUN))
        assert f'"model": "{REPO}"' in card.text  # the card serves the drafter from the repository

        again = eyrie("publish", "--run", RUN, "--repo", REPO, "--to", str(out), "--with-answers", env=env).stdout
        assert again.count("no commit") == 2 and "unchanged" in again
        assert len(hub.commits(REPO)) == len(hub.commits(REPO, "dataset")) == 1

        set_manifest(store, verify=verify_record(load_run_manifest(store, RUN).drafter, accepted=150.0))
        eyrie("publish", "--run", RUN, "--repo", REPO, env=env)
        assert [sorted(c["changed"]) for c in hub.commits(REPO)] == [sorted(written), ["README.md"]]
        updated = ModelCard(hub.files(REPO)["README.md"].decode())
        assert card_figures(updated) == expected_figures(load_run_manifest(store, RUN)) != card_figures(card)


@pytest.mark.integration
def test_refusals_and_hub_errors_name_their_fix_and_commit_nothing(tmp_path):
    finished_run(tmp_path, verified=False)
    with running(TOKEN) as (url, hub):
        env = hub_env(tmp_path, url)
        refused = eyrie("publish", "--run", RUN, "--repo", REPO, env=env, check=False)
        assert refused.returncode == 1 and "vLLM has not verified its drafter" in refused.stderr
        assert "--allow unverified" in refused.stderr and not hub.repos
        gone = eyrie("publish", "--run", RUN, "--repo", REPO, "--force", env=env, check=False)
        assert gone.returncode == 1 and "--force is gone" in gone.stderr and "--allow NAME" in gone.stderr
        bad = eyrie("publish", "--run", RUN, "--repo", REPO, "--allow", "unverified",
                    env={**env, "HF_TOKEN": "hf_wrong"}, check=False)
        assert bad.returncode == 1 and "refused publishing to alice/tiny-drafter (401" in bad.stderr
        assert "HF_TOKEN" in bad.stderr and "hf_wrong" not in bad.stderr + bad.stdout
        offline = eyrie("publish", "--run", RUN, "--repo", REPO, "--allow", "unverified", env={**env, **OFFLINE},
                        check=False)
        assert offline.returncode == 1 and "HF_HUB_OFFLINE is set" in offline.stderr
        assert not hub.repos
        eyrie("publish", "--run", RUN, "--repo", REPO, "--allow", "unverified", env=env)
        assert "`--allow unverified`" in hub.files(REPO)["README.md"].decode()


@pytest.mark.integration
def test_eyrie_fetch_of_the_published_drafter_gives_the_same_bytes(tmp_path):
    """`eyrie fetch` from the directory (as is) and through the upload path (huggingface_hub's download from the
    repository): the drafter's bytes as `--to` wrote them."""
    finished_run(tmp_path)
    out = tmp_path / "published"
    with running(TOKEN) as (url, hub):
        env = hub_env(tmp_path, url)
        eyrie("publish", "--run", RUN, "--repo", REPO, "--to", str(out), env=env)
        for source in (REPO, str(out)):
            fetched = Path(eyrie("fetch", source, env=env).stdout.strip().split(": ", 1)[1])
            for name in ("config.json", "model.safetensors"):
                assert (fetched / name).read_bytes() == (out / name).read_bytes(), (source, name)


# --- vLLM -------------------------------------------------------------------------------------------------------

@pytest.mark.e2e
@pytest.mark.timeout(900)
def test_vllm_serves_the_drafter_from_the_published_directory_with_the_cards_command(tmp_path):
    """What `--to DIR` writes, served by vLLM's CPU build as the card says (its `--speculative-config`): vLLM runs
    eagle3 from DIR, and the drafter's drafts (a zero head: always the mapped token) are accepted."""
    from eyrie.core.target import load_tokenizer
    from eyrie.core.vllm import serve_argv
    from eyrie_trainer.verify_turns import chat_prompt_ids
    from tests.unit.test_served_drafter import FIRST_MAPPED
    from tests.support.vllm_real import VLLM_PYTHON, start_vllm, stop_vllm, vllm_env

    store = finished_run(tmp_path, zero_head=True)
    out = tmp_path / "published"
    publish(store, RUN, to=out)
    words = shlex.split(re.search(r"```bash\n(vllm serve .*)\n```", (out / "README.md").read_text())[1])
    assert words[:3] == ["vllm", "serve", TINY.name] and words[3:-2] == SERVED_WITH
    # the card's placeholders: the target by the path it lies at here, the drafter by where it was published to
    flags = [word.replace(DRAFTER_DIR, str(out.resolve())) for word in words[3:]]
    port, log = free_port(), tmp_path / "vllm.log"
    cmd = [*serve_argv(str(VLLM_PYTHON), str(TINY)), "--host", "127.0.0.1", "--port", str(port), *flags]
    proc = start_vllm(cmd, log, vllm_env(tmp_path / "vllm-cache"), port)
    try:
        client = verify.Client(f"http://127.0.0.1:{port}", str(TINY), log)
        tokenizer = load_tokenizer(str(TINY))
        rows = [json.loads(line) for line in (ROOT / "tests" / "data" / "tiny_prompts.jsonl").read_text().splitlines()]
        prompts = [chat_prompt_ids(tokenizer, [{"role": "user" if t["from"] == "human" else t["from"],
                                                 "content": t["value"]} for t in r["conversations"]]) for r in rows[:24]]
        answers, _ = client.greedy(prompts, [48] * len(prompts), 4)
        counters = verify.spec_counters(client.url)
    finally:
        stop_vllm(proc)
    text = log.read_text(errors="replace")
    assert f"SpeculativeConfig(method='eagle3', model='{out.resolve()}', num_spec_tokens={K})" in text, text[-3000:]
    assert counters["drafts"] > 0 and counters["per_pos"][0] > 0 and any(FIRST_MAPPED in a for a in answers)
