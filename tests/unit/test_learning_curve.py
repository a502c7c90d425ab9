"""bench/learning_curve.py's pure parts, without a process: the nested slices and the held-out set, the refusal
of a slice larger than the pool, the RESULTS.md section, the SVG plot, stage times from shard manifests, and the
training options it gives speculators (the train stage's own)."""

import json
import xml.etree.ElementTree as ET
from types import SimpleNamespace

import pytest

from eyrie.data.manifest import Layout, TrainParams
from eyrie.data.store import FileStore
from eyrie_trainer.data import heldout_ids
from eyrie_trainer.runner import TrainRunner, speculators_options

import learning_curve as lc

SVG = "{http://www.w3.org/2000/svg}"


def samples(n: int) -> list[dict]:
    return [{"sample_id": f"{(i * 7919) % 1000:03d}-s{i}"} for i in range(n)]


def test_slices_are_nested_prefixes_of_the_sorted_pool_without_the_heldout_samples():
    rows = samples(40)
    held = heldout_ids(rows, 5)
    pool, chosen = lc.slices(rows, held, [20, 5, 10, 10])
    assert pool == sorted(pool) and len(pool) == 35 and not set(pool) & held
    assert list(chosen) == [5, 10, 20]
    assert chosen[20][:10] == chosen[10] and chosen[10][:5] == chosen[5] and chosen[20] == pool[:20]
    assert lc.slices(list(reversed(rows)), held, [20])[1][20] == chosen[20]  # the store's order does not matter


def test_a_size_larger_than_the_pool_is_refused_with_the_pool_named():
    rows = samples(12)
    with pytest.raises(SystemExit, match=r"each must be 1 to 10, the training pool .* less the 2 held out"):
        lc.slices(rows, heldout_ids(rows, 2), [5, 11])
    with pytest.raises(SystemExit, match="training pool"):
        lc.slices(rows, heldout_ids(rows, 2), [0])


def figures(acceptance: float, speedup: float) -> dict:
    return {"vllm_acceptance_length": acceptance, "speedup": {"1": speedup, "8": speedup * 1.5},
            "identical_outputs": True}


def result() -> dict:
    sets = {"heldout": 8, "gsm8k": 40}
    points = [{"label": str(n), "prompts": n, "epochs": 2, "train_s": 60.0 * n / 250, "verify_s": 300.0,
               "eyrie_tau": tau, "sets": {"heldout": figures(tau, 1.1), "gsm8k": figures(tau - 0.1, 1.05)}}
              for n, tau in ((250, 1.5), (500, 1.75))]
    anchor = {"label": "anchor", "prompts": 500, "epochs": 2, "train_s": 150.0, "verify_s": 310.0, "eyrie_tau": 1.4,
              "sets": {"heldout": figures(1.4, 1.0), "gsm8k": figures(1.25, 0.9)}, "note": "Epochs 2 ...",
              "given": {"data_path": "/d", "epochs": 2, "target_layer_ids": [1, 15, 27], "draft_attn_impl": "sdpa"},
              "defaults": {"lr": 0.001, "total_seq_len": 8192, "draft_vocab_size": None}}
    return {"run": "r", "target": "assets/smollm2-135m-instruct", "target_name": "smollm2-135m-instruct",
            "command": "python bench/learning_curve.py --run r --sizes 250,500", "date": "2025-01-01 00:00 UTC",
            "commit": "abc1234", "device": "cpu", "heldout_samples": 8, "pool": 600, "epochs": 2, "k": 3,
            "max_tokens": 256, "sets": sets, "points": points, "anchor": anchor,
            "machine": {"cpu": "AMD EPYC", "cpus": 2, "memory_gib": 23.5, "gpu": None},
            "stage_times": {"generate": {"wall_s": 600.0, "prompts": 608, "shards": 2, "s_per_1k": 986.8},
                            "extract": {"n/a": "not every shard has its manifest in the store"}}}


def test_the_section_holds_a_row_per_size_the_stage_times_and_the_ratio_to_speculators():
    lines = lc.section(result(), "results/learning_curve.svg")
    text = "\n".join(lines)
    assert lines[0] == "# Learning curve: smollm2-135m-instruct (bench/learning_curve.py)"
    assert "AMD EPYC" in text and "commit `abc1234`" in text and "`python bench/learning_curve.py --run r" in text
    header = next(line for line in lines if line.startswith("| training prompts"))
    assert "vLLM acceptance heldout" in header and "speedup @1 gsm8k" in header and "train min / 1k" in header
    assert "| 250 | 1.50 | 1.50 | 1.40 | 1.10 | 1.05 | 4.0 |" in lines  # 60 s for 250 prompts: 4 min per 1k
    assert "| 500 | 1.75 | 1.75 | 1.65 | 1.10 | 1.05 | 4.0 |" in lines
    assert "![vLLM acceptance length per set against training prompts](results/learning_curve.svg)" in lines
    assert "| generate | 608 prompts, 2 shards (shard manifests: first start to last finish) | 10.0 | 16.4 |" in lines
    assert any(line.startswith("| extract | n/a: not every shard") for line in lines)
    assert any(line.startswith("| train (speculators' defaults) | 500 prompts, 2 epochs") for line in lines)
    assert "| set | eyrie | speculators | eyrie / speculators |" in lines
    assert "| vLLM acceptance gsm8k | 1.65 | 1.25 | 1.320 |" in lines
    assert "| eyrie τ held-out (simulated) | 1.75 | 1.40 | 1.250 |" in lines
    assert "defaults taken: lr 0.001, total_seq_len 8192, draft_vocab_size None" in text


def test_without_the_anchor_there_is_no_anchor_table():
    r = result() | {"anchor": None}
    assert not any("eyrie / speculators" in line for line in lc.section(r))


def test_the_plot_is_svg_with_one_polyline_per_set():
    curves = {"heldout": [(250, 1.5), (500, 1.75), (1000, 1.9)], "mt-bench": [(250, 1.3), (500, None), (1000, 1.6)],
              "a <b> & c": [(250, 1.2), (500, 1.3), (1000, 1.35)]}
    root = ET.fromstring(lc.svg_plot(curves, "smollm2 <K=3>"))
    lines = root.findall(f"{SVG}polyline")
    assert len(lines) == 3
    assert [len(line.get("points").split()) for line in lines] == [3, 2, 3]  # a missing figure is left out
    labels = [t.text for t in root.findall(f"{SVG}text")]
    assert "a <b> & c" in labels and "1000" in labels and "training prompts" in labels
    single = ET.fromstring(lc.svg_plot({"heldout": [(500, 1.5)]}, "one size"))
    assert len(single.findall(f"{SVG}polyline")) == 1


def test_stage_time_spans_the_first_start_to_the_last_finish():
    shards = [{"started_at": "2025-01-01T10:00:00+00:00", "finished_at": "2025-01-01T10:20:00+00:00",
               "counts": {"done": 500}},
              {"started_at": "2025-01-01T10:05:00+00:00", "finished_at": "2025-01-01T10:30:00+00:00",
               "counts": {"done": 250}}]
    assert lc.stage_time(shards) == {"wall_s": 1800.0, "prompts": 750, "shards": 2, "s_per_1k": 2400.0,
                                     "finished_at": "2025-01-01T10:30:00+00:00"}


@pytest.mark.parametrize("max_steps", [None, 40])
def test_each_slice_trains_with_the_run_plan_and_the_recipe_its_own_tokens_choose(tmp_path, max_steps):
    params = TrainParams(epochs=2, max_steps=max_steps, draft_vocab=8192, vocab_mapping="frequency", lr=1e-3,
                         warmup=0.03, total_seq_len=1024, train_samples=7000, heldout_samples=8,
                         speculators_version="0.9.0")
    manifest = SimpleNamespace(train=params, target=SimpleNamespace(model="assets/smollm2-135m-instruct"),
                               extract=SimpleNamespace(aux_layers=[1, 15, 27], dtype="bf16"))
    small, recipe = lc.slice_params(manifest, [{"seq_len": 300}] * 250, "cpu", None)
    large, _ = lc.slice_params(manifest, [{"seq_len": 300}] * 4000, "cpu", None)
    assert small.epochs > large.epochs >= 2 and small.train_samples == 250  # steps, not epochs, a small set lacks
    assert (small.lr, small.warmup, small.total_seq_len, small.max_steps) == (1e-3, 0.03, 1024, max_steps)
    assert "training tokens" in recipe.statement()
    assert lc.slice_params(manifest, [{"seq_len": 300}] * 250, "cpu", 3)[0].epochs == 3  # --epochs: those
    runner = SimpleNamespace(params=small, manifest=manifest, work=tmp_path, rows=(250, 8),
                             settings=SimpleNamespace(train_loader_workers=0))
    data = tmp_path / "data"
    options = speculators_options(small, manifest, data, tmp_path, 0, (250, 8), "cpu")
    assert options == TrainRunner._options(runner, data, "cpu") and options["epochs"] == small.epochs
    assert lc.GIVEN <= set(options)  # the anchor is given a subset


def test_a_slice_judged_in_an_earlier_sitting_is_reused_and_other_options_start_it_afresh(tmp_path):
    folder, options = tmp_path / "250", {"epochs": 8, "save_path": tmp_path / "250" / "checkpoints"}
    assert lc.kept_point(folder, options) is None
    (folder / "checkpoints" / "3").mkdir(parents=True)  # an interrupted sitting's epoch
    (folder / "train_s").write_text("120.5")
    assert lc.kept_point(folder, options) is None and (folder / "checkpoints" / "3").is_dir()  # resumed from
    lc.keep_point(folder, {"label": "250", "train_s": 300.0, "drafter": folder / "drafter"})
    assert lc.kept_point(folder, dict(options))["drafter"] == str(folder / "drafter")
    assert lc.kept_point(folder, {**options, "epochs": 9}) is None  # another recipe: nothing of the old one kept
    assert not (folder / "checkpoints").exists() and not (folder / "train_s").exists()
    assert lc.kept_point(folder, {**options, "epochs": 9}) is None


def test_vllm_measures_only_what_no_sitting_has_measured(tmp_path):
    cache, calls = tmp_path / "measured.json", []

    def measure(label):
        return lambda: calls.append(label) or {"label": label, "sets": {"gsm8k": (1, 2)}}

    key = {"sets": {"gsm8k": [["q"]]}, "k": 3}
    assert lc.measured(cache, key, "target alone", measure("alone"))["sets"]["gsm8k"] == [1, 2]
    lc.measured(cache, key, "250", measure("250"))
    assert lc.measured(cache, dict(key), "250", measure("again"))["label"] == "250" and calls == ["alone", "250"]
    lc.forget_measured(cache, "250")  # the slice was trained anew
    lc.measured(cache, key, "250", measure("retrained"))
    lc.measured(cache, {**key, "k": 5}, "target alone", measure("other k"))  # other questions: measured anew
    assert calls == ["alone", "250", "retrained", "other k"]


def test_stage_times_come_from_the_stores_shard_manifests_or_say_why_not(tmp_path):
    store, layout = FileStore(tmp_path), Layout("r")
    manifest = SimpleNamespace(run="r", generate_shards=[SimpleNamespace(index=0), SimpleNamespace(index=1)])
    for index, (start, end) in enumerate((("10:00:00", "10:10:00"), ("10:00:30", "10:12:00"))):
        store.put_json(layout.generate_shard_manifest(index), {
            "started_at": f"2025-01-01T{start}+00:00", "finished_at": f"2025-01-01T{end}+00:00",
            "counts": {"done": 300}})
    store.put_json(layout.extract_shard_manifest(0), store.get_json(layout.generate_shard_manifest(0)))
    times = lc.recorded_stage_times(store, manifest)
    assert times["generate"] == {"wall_s": 720.0, "prompts": 600, "shards": 2, "s_per_1k": 1200.0,
                                 "finished_at": "2025-01-01T10:12:00+00:00"}
    assert "has not finished" in times["extract"]["n/a"]


def test_the_whole_pool_is_the_runs_own_drafter_not_trained_again(tmp_path):
    store, layout = FileStore(tmp_path / "store"), Layout("r")
    manifest = SimpleNamespace(run="r", generate_shards=[SimpleNamespace(index=0)],
                               train=SimpleNamespace(epochs=4, recipe="lr 1e-3 ..."))
    folder = tmp_path / "900"
    assert lc.run_point(store, manifest, folder, 900) is None  # no drafter yet: trained here
    shard = {"started_at": "2025-01-01T10:00:00+00:00", "finished_at": "2025-01-01T10:30:00+00:00",
             "counts": {"done": 1000}}
    for stage in ("generate", "extract"):
        store.put_json(layout.shard_manifest(stage, 0), shard)
    state = tmp_path / "training_state.json"
    state.write_text(json.dumps({"global_step": 42}))
    info = store.put_file(layout.checkpoint_file("1", state.name), state)
    for epoch, saved in ((0, "10:45:00"), (1, "11:00:00"), (1, "11:05:00")):
        files = {state.name: {"sha256": info.sha256, "bytes": info.size}} if saved == "11:00:00" else {}
        store.put_json(layout.checkpoint_manifest(f"e{epoch}-{saved[:2]}{saved[3:5]}"), {
            "label": str(epoch), "epoch": epoch, "local_step": 0 if saved != "11:05:00" else 7, "files": files,
            "saved_at": f"2025-01-01T{saved}+00:00"})
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(b"weights")
    info = store.put_file(layout.drafter_file("model.safetensors"), weights)
    store.put_json(layout.drafter_manifest, {
        "files": {"model.safetensors": {"key": info.key, "sha256": info.sha256, "bytes": info.size}},
        "checkpoint": "1", "training_path": {"path": "safe"}})
    store.put_json(layout.evaluation, {"checkpoints": [
        {"label": "0", "tau": 1.9, "per_position_acceptance": [0.5], "drafts": 10, "samples": 2},
        {"label": "1", "tau": 2.2, "per_position_acceptance": [0.6], "drafts": 12, "samples": 2}]})
    point = lc.run_point(store, manifest, folder, 900)
    assert point["from_run"] and point["eyrie_tau"] == 2.2 and point["eyrie"]["drafts"] == 12
    assert point["steps"] == 42  # the best checkpoint's optimizer steps, from its stored training state
    assert (point["epochs"], point["recipe"]) == (4, "lr 1e-3 ...")  # the run's own plan, as its manifest states it
    assert point["train_s"] == 1800.0  # extraction's end to the last epoch checkpoint, not a mid-epoch one
    assert (folder / "drafter" / "model.safetensors").read_bytes() == b"weights"
    assert "the run's train stage" in "\n".join(lc.section(result() | {"points": [
        {**p, "train_s": 1800.0, "from_run": True} for p in result()["points"]]}))
