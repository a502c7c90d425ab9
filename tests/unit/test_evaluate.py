"""Simulated acceptance length: the alignment on hand-built cases, an oracle drafter, and an
untrained drafter (speculators' Eagle3DraftModel) on hidden states of the tiny target; and
`eyrie evaluate` on held-out samples stored as token ids alone (their states from the service)."""

from __future__ import annotations

import os
import shutil
from collections import Counter

import pytest
import torch
from safetensors.torch import save, save_file

from eyrie.core.errors import EyrieError
from eyrie.data.manifest import Counts, Layout, ShardManifest
from eyrie.data.store import FileStore
from eyrie_extractor.shard import ids_tensors
from eyrie_trainer.evaluate import accepted_lengths, simulate, summarize_walk, untrained_like, walk
from tests.support.builders import make_manifest
from tests.support.harness import OFFLINE, eyrie
from tests.support.hs_fixture import TINY, build_hs_dir

K = 3
DRAFT_VOCAB = 500
AUX = (2, 4, 5)


def t(values):
    return torch.tensor(values, dtype=torch.long)


# x = [p0, p1, a2, a3, a4, a5, a6] (p: prompt, a: assistant), L = 7, starts j = 0..4 (x[j+2] assistant)
X = t([10, 11, 12, 13, 14, 15, 16])
MASK = t([0, 0, 1, 1, 1, 1, 1])


def oracle(x: torch.Tensor, k: int) -> torch.Tensor:
    """draft[s, j] = x[j+2+s] (junk past the end)."""
    n = x.shape[0] - 1
    rows = [[int(x[j + 2 + s]) if j + 2 + s < x.shape[0] else -1 for j in range(n)] for s in range(k)]
    return t(rows)


def test_all_right_counts_up_to_k_and_the_sequence_end():
    # start j predicts x[j+2..j+4]: j=0,1,2 have 3 steps; j=3 has 2 (x5, x6); j=4 has 1 (x6)
    assert accepted_lengths(oracle(X, K), X, MASK).tolist() == [3, 3, 3, 2, 1]


def test_first_wrong_accepts_nothing_and_a_wrong_middle_step_stops_the_count():
    drafts = oracle(X, K)
    drafts[0, 1] = 99  # start 1: first step wrong
    drafts[1, 0] = 99  # start 0: second step wrong, third right -> 1
    drafts[1, 2] = 99  # start 2: second step wrong -> 1
    assert accepted_lengths(drafts, X, MASK).tolist() == [1, 0, 1, 2, 1]


def test_prompt_positions_are_excluded_and_a_non_assistant_token_stops_a_draft():
    mask = t([0, 0, 0, 1, 1, 0, 1])  # x2 prompt (no start j=0); x5 is not an assistant token
    # starts: j=1 (x3, x4 | x5 stops), j=2 (x4 | x5 stops), j=4 (x6, then the end)
    assert accepted_lengths(oracle(X, K), X, mask).tolist() == [2, 1, 1]
    assert accepted_lengths(oracle(X, K), X, torch.zeros(7, dtype=torch.long)).numel() == 0


def test_shape_mismatch_is_refused():
    with pytest.raises(ValueError):
        accepted_lengths(torch.zeros(K, 7, dtype=torch.long), X, MASK)


# The walk (vLLM's bookkeeping): greedy[p] is the target's token after x[p]; here the answer is greedy.
GREEDY = t([11, 12, 13, 14, 15, 16, 3])  # greedy[6]: the target's token after the end (3)


def test_walk_advances_by_accepted_plus_one_from_the_first_answer_token():
    # prefill produced x2; the step at j=1 drafts x3..x5, all right: 3 accepted + the target's x6,
    # the last token: done. Steps: [3].
    drafts = oracle(X, K)
    assert walk(drafts, GREEDY, MASK, K) == [3]
    # x4 wrong at j=1: 1 accepted, advance 2 -> j=3 drafts x5, x6 and one past the end, which is
    # compared with greedy[6] (the target's token there) as vLLM does: [1, 2], or [1, 3] when it matches.
    drafts[1, 1] = 99
    assert walk(drafts, GREEDY, MASK, K) == [1, 2]
    drafts[2, 3] = 3
    assert walk(drafts, GREEDY, MASK, K) == [1, 3]
    assert walk(drafts, GREEDY, torch.zeros(7, dtype=torch.long), K) == []


def test_walk_decodes_each_answer_of_a_conversation_and_never_drafts_the_user_turn_between():
    # x = [p0, a1, a2, a3, u4, u5, a6, a7, a8, a9]: two answers, a user turn between (prefill: no drafts)
    x = t([20, 21, 22, 23, 24, 25, 26, 27, 28, 29])
    mask = t([0, 1, 1, 1, 0, 0, 1, 1, 1, 1])
    greedy = t([21, 22, 23, 99, 0, 26, 27, 28, 29, 3])  # greedy[3]: the target's token after answer 1 ends
    drafts = oracle(x, K)
    # answer 1: prefill gave a1; j=0 drafts a2, a3 and one past its end (greedy[3] = 99, not u4): [2];
    # answer 2: prefill gave a6; j=5 drafts a7, a8, a9: [3]. The user turn's positions are never a step.
    assert walk(drafts, greedy, mask, K) == [2, 3]


def test_walk_compares_with_the_greedy_token_not_the_stored_one():
    greedy = GREEDY.clone()
    greedy[2] = 77  # the target would not have produced x3 after x2: a draft of x3 is rejected
    assert walk(oracle(X, K), greedy, MASK, K)[0] == 0


def test_summarize_walk_is_vllms_mean_acceptance_length_and_per_position_rate():
    report = summarize_walk([3, 1, 0, 2], K, 1)
    assert report["tau"] == report["acceptance_length"] == 1 + 6 / 4 and report["drafts"] == 4
    assert report["per_position_acceptance"] == [3 / 4, 2 / 4, 1 / 4]


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny models gain nothing from threads; on a busy 2-core machine, spinning OpenMP threads
    made one simulate() over 26 samples take from 0.3 s to 47 s."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def hs_dir(tmp_path_factory):
    return build_hs_dir(tmp_path_factory.mktemp("hs"), n=24, aux_layers=AUX)


@pytest.fixture(scope="session")
def samples(hs_dir):
    import datasets

    return list(datasets.load_from_disk(str(hs_dir)))


@pytest.fixture(scope="session")
def drafter(samples):
    from speculators.train.vocab_mapping import build_vocab_mappings_from_distribution
    from speculators.models.eagle3.core import Eagle3DraftModel
    from transformers import AutoConfig

    counts = Counter()
    for s in samples:
        counts.update(s["input_ids"][s["loss_mask"].bool()].tolist())
    config = AutoConfig.from_pretrained(TINY)
    d2t, t2d = build_vocab_mappings_from_distribution(dict(counts), DRAFT_VOCAB, config.vocab_size)
    torch.manual_seed(0)
    return Eagle3DraftModel.from_training_args(
        config, t2d=t2d, d2t=d2t, verifier_name_or_path=str(TINY), target_layer_ids=list(AUX),
        draft_vocab_size=DRAFT_VOCAB, norm_before_residual=True, ttt_steps=K)


def exact_oracle_tau(samples, k: int) -> float:
    """Single-turn samples: the answer runs to the end, so start j (x[j+2] in the answer)
    accepts min(k, L - 2 - j) tokens."""
    total = count = 0
    for s in samples:
        length, first = int(s["seq_len"]), int(s["loss_mask"].argmax())
        for j in range(first - 2, length - 2):
            total += min(k, length - 2 - j)
            count += 1
    return 1 + total / count


def exact_oracle_walk(samples, k: int) -> float:
    """Every draft right up to the last token, none past it: from j = first - 1, each step accepts
    min(k, L - 2 - j) and advances by that + 1."""
    accepted = []
    for s in samples:
        length, j = int(s["seq_len"]), int(s["loss_mask"].argmax()) - 1
        while j <= length - 3:
            accepted.append(min(k, length - 2 - j))
            j += accepted[-1] + 1
    return 1 + sum(accepted) / len(accepted)


def test_oracle_drafter_gets_one_plus_k_less_the_end_effects(samples):
    got = torch.cat([accepted_lengths(oracle(s["input_ids"], K), s["input_ids"], s["loss_mask"]) for s in samples])
    assert 1 + got.float().mean().item() == pytest.approx(exact_oracle_tau(samples, K))
    assert got.numel() == sum(int(s["loss_mask"].sum()) for s in samples)  # one start per answer token


def test_untrained_drafter_has_tau_near_one(drafter, hs_dir, samples):
    report = simulate(drafter, hs_dir, None, K)
    assert report["samples"] == len(samples) and report["k"] == K
    assert 1.0 <= report["tau"] < 1.3 and report["greedy_from"].startswith("target lm_head")
    assert report["tau"] == pytest.approx(1 + report["accepted_tokens"] / report["drafts"])
    assert len(report["per_position_acceptance"]) == K
    every = report["every_position"]
    assert every["positions"] == sum(int(s["loss_mask"].sum()) for s in samples)
    assert sum(every["histogram"]) == every["positions"] and len(every["histogram"]) == K + 1
    accepted = sum(n * count for n, count in enumerate(every["histogram"]))
    assert 1.0 <= every["tau"] < 1.3 and every["tau"] == pytest.approx(1 + accepted / every["positions"])
    assert len(every["step_acceptance"]) == K
    assert drafter.training  # simulate leaves the train/eval mode as it found it
    assert drafter.config.transformer_layer_config._attn_implementation == "simple_flex_attention"
    part = simulate(drafter, hs_dir, [0, 3], K)
    assert part["samples"] == 2
    assert part["every_position"]["positions"] == sum(int(samples[i]["loss_mask"].sum()) for i in (0, 3))


def test_a_target_named_by_hub_id_is_read_from_this_hosts_cache_or_refused(drafter, hs_dir, tmp_path, monkeypatch):
    """Never the drafter's own head over the draft vocabulary in silence (it misses greedy tokens
    outside it): the target's files from the Hugging Face cache, or an error naming the fix."""
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    with pytest.raises(EyrieError, match="neither a directory on this host nor in its Hugging Face cache") as err:
        simulate(drafter, hs_dir, [0], K, target="acme/tiny-target")
    assert "hf download acme/tiny-target" in str(err.value)
    repo, commit = tmp_path / "hub" / "models--acme--tiny-target", "0123456789abcdef0123456789abcdef01234567"
    shutil.copytree(TINY, repo / "snapshots" / commit)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    report = simulate(drafter, hs_dir, [0], K, target="acme/tiny-target")
    assert report["greedy_from"] == "target lm_head (acme/tiny-target)"
    assert report["tau"] == simulate(drafter, hs_dir, [0], K, target=str(TINY))["tau"]


def test_draft_ids_are_mapped_to_target_ids(drafter, hs_dir, samples, monkeypatch):
    """A drafter that predicts every true token as its DRAFT id reaches the oracle's tau only
    when simulate maps draft ids through d2t; the test data makes the mapping matter."""
    to_draft = torch.cumsum(drafter.t2d.long(), 0) - 1  # target id -> draft id (where t2d)
    answer_tokens = torch.cat([s["input_ids"][s["loss_mask"].bool()] for s in samples])
    assert drafter.t2d[answer_tokens].all()
    assert (to_draft[answer_tokens] != answer_tokens).float().mean() > 0.2

    def forward(hidden_states, input_ids, ttt_steps, **_):
        shifted = input_ids[0]  # x[1:]; step s at j predicts x[j+2+s] = shifted[j+1+s]
        n = shifted.shape[0]
        rows = [torch.cat([to_draft[shifted[1 + s:]], torch.zeros(1 + s, dtype=torch.long)]) for s in range(ttt_steps)]
        assert all(r.shape[0] == n for r in rows)
        return [r.unsqueeze(0) for r in rows]

    monkeypatch.setattr(drafter, "forward", forward)
    report = simulate(drafter, hs_dir, None, K)
    assert report["every_position"]["tau"] == pytest.approx(exact_oracle_tau(samples, K))
    assert report["every_position"]["step_acceptance"][0] == 1.0
    # the tiny target's answers are its greedy ones: the walk accepts every draft up to the end
    assert report["tau"] == pytest.approx(exact_oracle_walk(samples, K))
    assert report["per_position_acceptance"][0] == 1.0


def test_untrained_like_is_a_fresh_drafter_with_the_same_vocabulary(drafter):
    fresh, again = untrained_like(drafter, seed=1), untrained_like(drafter, seed=1)
    assert torch.equal(fresh.d2t, drafter.d2t) and torch.equal(fresh.t2d, drafter.t2d)
    for name in ("embed_tokens", "lm_head", "verifier_lm_head", "verifier_norm"):
        assert torch.equal(getattr(fresh, name).weight, getattr(drafter, name).weight), name
    assert not torch.equal(fresh.fc.weight, drafter.fc.weight)
    assert torch.equal(fresh.fc.weight, again.fc.weight)
    assert not torch.equal(untrained_like(drafter, seed=2).fc.weight, fresh.fc.weight)


# --- `eyrie evaluate` on a run whose held-out samples are stored as token ids alone --------------

def _ids_only_run(store_dir, run: str, rows: int, heldout: int) -> None:
    """A trained-looking run (extract.storage online) whose one extract shard holds token ids alone."""
    store, layout, records = FileStore(store_dir), Layout(run), []
    for row in range(rows):
        ids = [5 + row, 6, 7, 8]
        info = store.put_bytes(layout.extract_sample(0, f"s{row}"), save(ids_tensors(ids)))
        records.append({"sample_id": f"s{row}", "row": row, "status": "done", "key": info.key, "sha256": info.sha256,
                        "bytes": info.size, "seq_len": len(ids), "prompt_len": 2, "states": False})
    store.put_json(layout.manifest, make_manifest(
        run, rows, extract={"aux_layers": list(AUX), "max_length": 64, "tokens": 4 * rows, "storage": "online"},
        train={"draft_vocab": DRAFT_VOCAB, "total_seq_len": 64, "train_samples": rows - heldout,
               "heldout_samples": heldout}).model_dump())
    store.put_json(layout.extract_shard_manifest(0), ShardManifest(
        run=run, stage="extract", shard=0, bytes=0, counts=Counts(), skip_reasons={}, failure_errors={},
        started_at="now", finished_at="now", worker="test", samples=records).model_dump())


def test_evaluate_fetches_ids_only_heldout_states_from_the_extraction_service(redis_url, tmp_path):
    """No service: after the bounded wait, the error names the way to start one (not a missing file).
    Their states already on this host (fetched once before): no service is waited for."""
    import datasets

    _ids_only_run(tmp_path / "store", "m", rows=6, heldout=2)
    env = {**os.environ, **OFFLINE, "EYRIE_REDIS_URL": redis_url, "EYRIE_STORE_URL": f"file://{tmp_path / 'store'}",
           "EYRIE_CACHE_DIR": str(tmp_path / "cache"), "EYRIE_SERVE_DEADLINE_S": "1"}
    env.pop("EYRIE_EXTRACT_VLLM_URL", None)
    result = eyrie("evaluate", "--run", "m", env=env, check=False)
    assert result.returncode == 1
    assert ("run m: 2 held-out samples have no hidden states here (extract.storage online): fetching them from "
            "the vLLM extraction service") in result.stdout
    assert "waiting for the vLLM extraction server (state: never published)" in result.stdout
    assert "no vLLM extraction server became ready within 1 s (EYRIE_SERVE_DEADLINE_S)" in result.stderr
    assert "`eyrie serve-extract`" in result.stderr and "EYRIE_EXTRACT_VLLM_URL" in result.stderr

    heldout = tmp_path / "cache" / "runs" / "m" / "data" / "heldout"
    for index, row in enumerate(datasets.load_from_disk(str(heldout)).with_format(None)):
        save_file({"hidden_states": torch.zeros(4, 4, 64), "token_ids": torch.tensor(row["input_ids"])},
                  str(heldout / "hidden_states" / f"hs_{index}.safetensors"))
    again = eyrie("evaluate", "--run", "m", env=env, check=False)
    assert "fetching them" not in again.stdout and "run m has no finished epoch checkpoint" in again.stderr


def test_the_targets_greedy_tokens_are_computed_once_and_kept_beside_the_samples(drafter, hs_dir, tmp_path,
                                                                                   monkeypatch):
    """Issue 28 item 3: evaluation computed the target's greedy continuations again for every
    checkpoint; `target_greedy` computes them once (the same tokens as the per-sample head) and keeps
    them for a retried task, for these samples and this target only."""
    import eyrie_trainer.evaluate as evaluate

    data = tmp_path / "heldout"
    shutil.copytree(hs_dir, data)
    greedy = evaluate.target_greedy(data, str(TINY))
    assert (data / "greedy.safetensors").exists()
    head = evaluate.TargetHead(None, str(TINY))
    from speculators.train.data import ArrowDataset

    dataset = ArrowDataset(evaluate.UNBOUNDED_LEN, str(data), on_missing="raise")
    assert len(greedy) == len(dataset)
    assert all(torch.equal(g, head.greedy(dataset[i]["verifier_last_hidden_states"])) for i, g in enumerate(greedy))
    assert simulate(drafter, data, None, K, greedy=greedy)["tau"] == simulate(drafter, data, None, K)["tau"]

    built = []
    original = evaluate.TargetHead.__init__
    monkeypatch.setattr(evaluate.TargetHead, "__init__",
                        lambda self, *a, **kw: built.append(1) or original(self, *a, **kw))
    again = evaluate.target_greedy(data, str(TINY))  # kept: no head built
    assert not built and all(torch.equal(a, b) for a, b in zip(again, greedy))
    with pytest.raises(EyrieError):  # another target: looked up anew (a name that is none here), not the kept ones
        evaluate.target_greedy(data, str(data / "other-target-name"))
    assert built == [1]


def test_the_targets_head_is_read_from_a_remote_code_targets_files_without_its_code(tmp_path):
    """A target whose architecture needs trust_remote_code (a model_type transformers does not know,
    its auto_map naming code that is not there): its final norm and lm_head are read as data, with
    no code run, and give the same greedy tokens as the plain target's."""
    import json

    import eyrie_trainer.evaluate as evaluate

    custom = tmp_path / "custom-target"
    shutil.copytree(TINY, custom)
    config = json.loads((custom / "config.json").read_text())
    config.update(model_type="eyrie_custom_lm", architectures=["EyrieCustomForCausalLM"],
                  auto_map={"AutoConfig": "configuration_custom.CustomConfig"})
    config = {"model_type": "eyrie_custom_vlm", "auto_map": config["auto_map"], "text_config": config}
    (custom / "config.json").write_text(json.dumps(config))
    hidden = torch.randn(5, json.loads((TINY / "config.json").read_text())["hidden_size"])
    assert torch.equal(evaluate.TargetHead(None, str(custom)).greedy(hidden),
                       evaluate.TargetHead(None, str(TINY)).greedy(hidden))
