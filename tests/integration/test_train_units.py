"""speculators' trainer through eyrie's shim, on CPU, on hidden states built straight from the tiny
target (no servers): the pinned internals, the fast path falling back by itself, max-steps as a
total, checkpoints saved through the hook."""

import json

import pytest

from eyrie_trainer import engine
from tests.support.harness import TINY
from tests.support.hs_fixture import build_hs_dir


@pytest.fixture(scope="module")
def hs_dir(tmp_path_factory):
    import torch

    path = build_hs_dir(tmp_path_factory.mktemp("hs") / "data", n=40)
    counts: dict = {}
    from datasets import load_from_disk

    for ids, mask in zip(*(load_from_disk(str(path))[c] for c in ("input_ids", "loss_mask"))):
        for token, m in zip(ids.tolist(), mask.tolist()):
            counts[token] = counts.get(token, 0) + m
    torch.save({t: c for t, c in counts.items() if c}, path / "token_freq.pt")
    return path


def argv(hs_dir, save, *extra):
    return ["--verifier-name-or-path", str(TINY), "--data-path", str(hs_dir), "--save-path", str(save),
            "--num-layers", "1", "--total-seq-len", "128", "--num-workers", "0", "--draft-vocab-size", "300",
            "--target-layer-ids", "2", "4", "5", "--logger", "", "--log-dir", str(save / "logs"), *extra]


def recording_hooks():
    seen = {"steps": [], "checkpoints": [], "metrics": [], "steps_per_epoch": None}
    hooks = engine.Hooks(on_step=seen["steps"].append,
                         on_checkpoint=lambda label, epoch, local: seen["checkpoints"].append((label, local)),
                         on_metrics=seen["metrics"].append,
                         on_start=lambda spe, step: seen.update(steps_per_epoch=spe))
    return hooks, seen


def test_the_pinned_speculators_internals_are_there():
    engine.check_internals()  # speculators 0.9.0: what the shim touches exists


def test_changed_internals_fail_loudly(monkeypatch):
    import speculators.train.trainer as trainer

    def train_epoch(self, epoch):  # a future version without the step callback
        pass

    monkeypatch.setattr(trainer.Trainer, "train_epoch", train_epoch)
    with pytest.raises(RuntimeError, match="step_callback"):
        engine.check_internals()


def test_the_fast_path_and_loader_workers_follow_the_settings_else_the_device():
    from types import SimpleNamespace

    auto, off = SimpleNamespace(train_fast_path="auto", train_loader_workers=None), SimpleNamespace(
        train_fast_path="off", train_loader_workers=3)
    assert (engine.fast_path(auto, "cuda:0"), engine.fast_path(auto, "cpu"), engine.fast_path(off, "cuda:0")) == (
        True, False, False)
    assert (engine.loader_workers(auto, "cuda:0"), engine.loader_workers(auto, "cpu"),
            engine.loader_workers(off, "cpu")) == (2, 0, 3)  # a 2-core host keeps its cores for the step


def test_fast_path_falls_back_to_sdpa_and_eager_by_itself(hs_dir, tmp_path):
    hooks, seen = recording_hooks()
    said = []
    path = engine.train_with_fallback(argv(hs_dir, tmp_path / "ck", "--epochs", "1", "--max-steps", "2"),
                                      "cpu", True, hooks, said.append)
    # On a CPU, flex attention has no backward: the fast path fails before its first step
    assert path["path"] == "fallback" and path["draft_attn_impl"] == "sdpa"
    assert "FlexAttention" in path["fast_path_error"] and "falling back" in said[0]
    assert seen["steps"] == [1, 2]
    run_yaml = (tmp_path / "ck" / "run.yaml").read_text()
    assert "draft_attn_impl: sdpa" in run_yaml and "loss_implementation: eager" in run_yaml


def test_max_steps_is_a_total_over_all_epochs(hs_dir, tmp_path):
    hooks, seen = recording_hooks()
    # learn the epoch length first, then ask for one epoch and two steps in total over four epochs
    engine.train_with_fallback(argv(hs_dir, tmp_path / "probe", "--epochs", "1", "--max-steps", "1"), "cpu",
                               False, hooks, print)
    per_epoch = seen["steps_per_epoch"]
    assert per_epoch >= 3
    hooks, seen = recording_hooks()
    engine.train_with_fallback(argv(hs_dir, tmp_path / "ck", "--epochs", "4", "--max-steps", str(per_epoch + 2)),
                               "cpu", False, hooks, print)
    assert seen["steps"] == list(range(1, per_epoch + 3))  # speculators' own loop: one more step per epoch
    state = json.loads((tmp_path / "ck" / "1" / "training_state.json").read_text())
    assert state["global_step"] == per_epoch + 2
    assert not (tmp_path / "ck" / "2").exists()  # no epochs run after the total was reached
    assert [label for label, _ in seen["checkpoints"]] == ["0", "1"]
    losses = [m["train"]["loss"] for m in seen["metrics"] if "train" in m]
    assert len(losses) == per_epoch + 2 and all(loss > 0 for loss in losses)
    assert all(f"full_acc_{k}" in seen["metrics"][0]["train"] for k in range(3))


def test_a_new_run_resumes_from_the_last_checkpoint(hs_dir, tmp_path):
    hooks, seen = recording_hooks()
    engine.train_with_fallback(argv(hs_dir, tmp_path / "ck", "--epochs", "1"), "cpu", False, hooks, print)
    first = len(seen["steps"])
    hooks, seen = recording_hooks()
    engine.train_with_fallback(argv(hs_dir, tmp_path / "ck", "--epochs", "2"), "cpu", False, hooks, print)
    assert seen["steps"][0] == first + 1  # global steps continue from the checkpoint of epoch 0
    assert [label for label, _ in seen["checkpoints"]] == ["1"]


def same_state(a, b, where="state") -> None:
    """Two state trees equal: the same structure and types, every tensor equal in dtype, shape, value."""
    import torch

    assert type(a) is type(b), where
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert list(a) == list(b), where
        for key in a:
            same_state(a[key], b[key], f"{where}[{key!r}]")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            same_state(x, y, f"{where}[{i}]")
    else:
        assert a == b or (a != a and b != b), where  # NaN equals NaN here


def test_stored_checkpoints_hold_no_pickle_and_restore_the_same_optimizer_state(hs_dir, tmp_path):
    import torch

    from eyrie.data.manifest import Layout
    from eyrie.data.store import FileStore
    from eyrie_trainer import checkpoints
    from tests.unit.test_security import assert_no_pickles

    hooks, seen = recording_hooks()
    engine.train_with_fallback(argv(hs_dir, tmp_path / "ck", "--epochs", "1", "--max-steps", "2"), "cpu",
                               False, hooks, print)
    store, layout = FileStore(tmp_path / "store"), Layout("units")
    files = checkpoints.saved_files(tmp_path / "ck", "0")
    pickled = {p.name for p in files if p.suffix == ".pt"}
    assert {"optimizer_state_dict.pt", "scheduler_state_dict.pt"} <= pickled
    manifest = checkpoints.upload(store, layout, files, "0", 0, 0)
    assert set(manifest["rebuilds"]) == pickled and not any(n.endswith(".pt") for n in manifest["files"])
    assert assert_no_pickles(store, layout.train) >= len(files)

    said = []
    assert checkpoints.restore(store, layout, tmp_path / "restored", said.append)["label"] == "0"
    restored = sorted(p.name for p in (tmp_path / "restored" / "0").iterdir())
    assert restored == sorted(p.name for p in files)  # speculators finds its own files, nothing more
    for name in sorted(pickled):  # torch.load of local files: the original and what we rebuilt
        original = torch.load(tmp_path / "ck" / "0" / name, weights_only=True)
        if name == "optimizer_state_dict.pt":  # one state dict per optimizer (a list when there are several)
            states = original if isinstance(original, list) else [original]
            assert sum(len(s["state"]) for s in states) > 3  # the moments of 2 steps, not an empty state
        same_state(original, torch.load(tmp_path / "restored" / "0" / name, weights_only=True), name)
    assert said == []


def test_a_stored_pickle_is_never_restored(tmp_path):
    from eyrie.data.manifest import Layout
    from eyrie.data.store import FileStore
    from eyrie_trainer import checkpoints

    store, layout = FileStore(tmp_path / "store"), Layout("old")
    info = store.put_bytes(layout.checkpoint_file("0", "optimizer_state_dict.pt"), b"PK\x03\x04 a pickle")
    store.put_json(layout.checkpoint_manifest("0"), {
        "label": "0", "epoch": 0, "local_step": 0, "saved_at": "", "files": {
            "optimizer_state_dict.pt": {"sha256": info.sha256, "bytes": info.size}}})
    said = []
    assert checkpoints.restore(store, layout, tmp_path / "ck", said.append) is None  # from scratch
    assert "a pickle" in said[0] and not (tmp_path / "ck" / "0" / "optimizer_state_dict.pt").exists()


def test_the_training_curve_and_the_charts_eyrie_show_draws(hs_dir, tmp_path):
    """Real speculators metrics through the trainer's Curve, an evaluation and a vLLM verify built
    by their own summarizing functions, drawn as `eyrie show` draws them."""
    import io
    import re

    from rich.console import Console

    from eyrie.commands.display import render_charts
    from eyrie.data.charts import Curve, chart_series
    from eyrie_trainer.verify import summarize
    from eyrie_trainer.evaluate import summarize_walk

    hooks, seen = recording_hooks()
    engine.train_with_fallback(argv(hs_dir, tmp_path / "ck", "--epochs", "1", "--max-steps", "6"), "cpu",
                               False, hooks, print)
    curve, halved = Curve(), Curve(max_points=4)
    for record in seen["metrics"]:
        curve.add_record(record)
        halved.add_record(record)
    train = [m["train"] for m in seen["metrics"] if "train" in m]
    data = curve.snapshot()
    assert data["steps"] == [1, 2, 3, 4, 5, 6] and data["stride"] == 1
    assert data["loss"][0] == [train[0][f"loss_{k}"] for k in range(3)]
    assert data["acc"][-1] == [train[-1][f"full_acc_{k}"] for k in range(3)]
    # past max_points, neighbours are averaged in pairs: 4 points -> 2 of 2 steps, then steps 5-6
    small = halved.snapshot()
    assert small["steps"] == [2, 4, 6] and small["stride"] == 2
    assert small["loss"][0][1] == pytest.approx((train[0]["loss_1"] + train[1]["loss_1"]) / 2)
    curve.resumed_at(4)  # a run resumed from a checkpoint at step 4 drops what came after it
    assert curve.snapshot()["steps"] == [1, 2, 3, 4]

    k, epoch_steps = 3, {"0": [1, 0, 2, 3], "1": [3, 2, 3, 1, 3]}
    checkpoints = [{"label": label, "epoch": int(label), **summarize_walk(steps, k, 2)}
                   for label, steps in epoch_steps.items()]
    evaluation = {"k": k, "baseline": summarize_walk([0, 0, 1, 0], k, 2), "checkpoints": checkpoints, "best": "1"}
    verify = {**summarize({"drafts": 0, "accepted_tokens": 0, "per_pos": {}},
                          {"drafts": 10, "accepted_tokens": 25, "per_pos": {0: 9, 1: 9, 2: 7}}, k), "checkpoint": "1"}
    series = chart_series(evaluation, verify, data)
    out = Console(file=io.StringIO(), width=80, color_system=None)
    render_charts(series, out)
    lines = out.file.getvalue().splitlines()
    print("\n".join(lines))

    sparks = [m for line in lines if (m := re.match(r"  \+(\d)\s+([▁▂▃▄▅▆▇█]+)  (\S+) → (\S+)$", line))]
    assert [m.group(1) for m in sparks] == ["1", "2", "3"] * 2  # loss, then accuracy, per TTT position
    assert all(len(m.group(2)) == 6 for m in sparks)  # one character per logged step
    assert [float(m.group(3)) for m in sparks[:3]] == [round(train[0][f"loss_{p}"], 3) for p in range(3)]
    assert [float(m.group(4)) for m in sparks[3:]] == [round(train[-1][f"full_acc_{p}"], 3) for p in range(3)]
    assert lines[0].startswith("loss per TTT position, steps 1..6, 1 step a column")

    bars = [line.split() for line in lines if re.search(r"(eyrie|vLLM) +[█▏▎▍▌▋▊▉]*\s+\d\.\d{3}$", line)]
    assert [b[0] for b in bars[:4]] == ["untrained", "0", "1", "vLLM"] and bars[2][1] == "(best)"
    assert float(bars[1][-1]) == round(checkpoints[0]["tau"], 3) == 2.5
    assert float(bars[2][-1]) == 3.4 and float(bars[3][-1]) == 3.5  # eyrie's best, vLLM's verified figure
    assert bars[3][1] == "█" * 33 + "▎"  # (3.5 - 1) / 3 of 40 cells: the bars run from 1 to K + 1
    positions = [(b[0], b[-1]) for b in bars[4:]]
    assert positions == [("+1", "1.000"), ("vLLM", "0.900"), ("+2", "0.800"), ("vLLM", "0.900"),
                         ("+3", "0.600"), ("vLLM", "0.700")]


def test_verifys_vllm_dies_with_the_worker_that_started_it():
    """vLLM runs in a session of its own (stopped as a group): a SIGKILLed worker must not leave it
    serving. Here the 'worker' starts `sleep 60` the way verify starts vLLM, then is SIGKILLed."""
    import os
    import subprocess
    import sys
    import time

    starter = ("import subprocess, sys, time\n"
               "from eyrie.core.vllm import start_server\n"
               "child = start_server(['sleep', '60'])\n"
               "print(child.pid, flush=True)\ntime.sleep(60)\n")
    worker = subprocess.Popen([sys.executable, "-c", starter], stdout=subprocess.PIPE, text=True)
    child = int(worker.stdout.readline())
    time.sleep(0.5)  # setpriv has exec'd sleep
    worker.kill()
    worker.wait()
    deadline = time.monotonic() + 10
    while os.path.exists(f"/proc/{child}") and "Z (zombie)" not in open(f"/proc/{child}/status").read():
        assert time.monotonic() < deadline, "the child outlived the process that started it"
        time.sleep(0.1)


def test_a_sample_whose_states_do_not_match_its_ids_is_counted_as_dropped_with_the_reason(hs_dir, tmp_path):
    """speculators leaves out a sample whose hidden states file holds other token ids (what a
    mixed-up generated file would be) and trains on the rest: eyrie counts it and says why."""
    import shutil

    from eyrie_trainer.runner import TrainRunner

    data = tmp_path / "data"
    shutil.copytree(hs_dir, data)
    shutil.copy(data / "hidden_states" / "hs_1.safetensors", data / "hidden_states" / "hs_0.safetensors")
    hooks, seen = recording_hooks()
    reasons: list[str] = []
    hooks.on_dropped = reasons.append
    engine.train_with_fallback(argv(data, tmp_path / "ck", "--epochs", "1"), "cpu", False, hooks, print)
    dropped = sum(round(m["train"].get("error_records", 0)) for m in seen["metrics"] if "train" in m)
    assert dropped == 1
    assert reasons == ["the generated hidden states' token ids do not match the sample's"]

    runner = TrainRunner.__new__(TrainRunner)  # its counting alone: no task, no store
    runner.live = {}
    for reason in reasons:
        runner._on_dropped(reason)
    for record in seen["metrics"]:
        if "train" in record:
            runner._count_dropped(round(record["train"].get("error_records", 0)), record.get("epoch"))
    assert runner.live["dropped"] == 1
    assert runner.live["notes"] == ["1 sample(s) left out of a step of epoch 0: the generated hidden states' "
                                    "token ids do not match the sample's"]


def test_speculators_words_for_a_sample_it_gave_up_on_become_the_reason():
    from speculators.train.recovery import GenerationRecoveryGuard

    reasons: list[str] = []
    with engine.speculators_patched("cpu", engine.Hooks(on_dropped=reasons.append)):
        result = GenerationRecoveryGuard(retries=1, max_consecutive_failures=20).run(
            lambda: (_ for _ in ()).throw(ConnectionError("Connection refused")),
            description="Hidden-state round trip failed for dataset index 3, file index 3")
    assert result.counts_as_failure
    assert reasons == ["Hidden-state round trip failed for dataset index 3, file index 3 (attempt 2/2, "
                       "consecutive failures=1/20): ConnectionError: Connection refused"]


def runner_on(data_dir, work, train_rows: int, heldout_rows: int, **plan):
    """A TrainRunner's speculators settings for a materialized directory (its counting and options
    alone: no task, no store): `train_rows` training samples, then `heldout_rows` held-out ones."""
    from types import SimpleNamespace

    from eyrie.data.manifest import TrainParams
    from eyrie_trainer.runner import TrainRunner

    runner = TrainRunner.__new__(TrainRunner)
    runner.params = TrainParams(**{"epochs": 1, "draft_vocab": 300, "vocab_mapping": "frequency", "lr": 1e-3,
                                   "total_seq_len": 256, "train_samples": train_rows,
                                   "heldout_samples": heldout_rows, "speculators_version": "0.9.0", **plan})
    runner.manifest = SimpleNamespace(target=SimpleNamespace(model=str(TINY)),
                                      extract=SimpleNamespace(aux_layers=[2, 4, 5], dtype="bf16"))
    runner.work, runner.settings, runner.live = work, SimpleNamespace(train_loader_workers=0), {}
    runner.rows, runner.on_demand, runner.service_url = (train_rows, heldout_rows), 0, None
    return runner


@pytest.mark.integration  # speculators' TrainConfig from settings runs `git rev-parse` (its provenance)
def test_every_training_sample_is_trained_on_and_the_held_out_ones_validate(hs_dir, tmp_path, monkeypatch):
    """Issue 29, defect 4: speculators' train_data_ratio (0.9 unless set) made the last tenth of the
    training samples a second validation set, never trained on. The trainer's directory holds the
    training samples, then eyrie's held-out ones: speculators trains on exactly the first and
    validates on the second, and the trainer counts what it read."""
    from speculators.train.data import ArrowDataset

    read: dict[str, set] = {"train": set(), "val": set()}
    getitem = ArrowDataset.__getitem__

    def seen(self, index):  # speculators' own dataset, its reads recorded
        read["train" if self.start_file_idx == 0 else "val"].add(self.start_file_idx + index)
        return getitem(self, index)

    monkeypatch.setattr(ArrowDataset, "__getitem__", seen)
    runner = runner_on(hs_dir, tmp_path, 32, 8)
    hooks, _ = recording_hooks()
    engine.train_with_fallback(runner._options(hs_dir, "cpu"), "cpu", False, hooks, print)
    assert read["train"] == set(range(32))  # every training sample, no held-out one
    assert read["val"] == set(range(32, 40))  # validation: eyrie's held-out samples
    assert hooks.state["read"] == set(range(32)) and hooks.state["dropped_rows"] == {}


@pytest.mark.integration  # speculators' TrainConfig from settings runs `git rev-parse` (its provenance)
def test_a_left_out_sample_is_recorded_with_its_reason_survives_a_retry_and_the_audit_counts_it(hs_dir, tmp_path):
    """Issue 29, defect 4: what speculators left out is in the store's record (not only in this
    attempt's live status), a retried task continues that record, and `eyrie audit`'s train figure
    is what the trainer read, not the plan."""
    import shutil
    from types import SimpleNamespace

    from eyrie.data.manifest import Layout
    from eyrie.data.store import FileStore
    from eyrie.runs.audit import _train
    from eyrie_trainer.ledger import TrainedSamples

    data = tmp_path / "data"
    shutil.copytree(hs_dir, data)
    shutil.copy(data / "hidden_states" / "hs_1.safetensors", data / "hidden_states" / "hs_0.safetensors")
    runner = runner_on(data, tmp_path, 32, 8)
    hooks, _ = recording_hooks()
    engine.train_with_fallback(runner._options(data, "cpu"), "cpu", False, hooks, print)
    why = "the generated hidden states' token ids do not match the sample's"
    assert hooks.state["dropped_rows"] == {0: why} and hooks.state["read"] == set(range(1, 32))

    store, layout = FileStore(tmp_path / "store"), Layout("r")
    samples = [{"sample_id": f"s{i}", "seq_len": 300 if i == 5 else 100} for i in range(32)]
    ledger = TrainedSamples.start(store, layout, samples, 8, 256)
    ledger.update(hooks.state["read"], hooks.state["dropped_rows"])
    ledger.save()
    retried = TrainedSamples.start(store, layout, samples, 8, 256)  # the next attempt reads none of it again
    retried.update(set(), {})
    assert retried.summary() == {"train_samples": 32, "trained": 31, "dropped": {"s0": why}, "heldout_samples": 8,
                                 "truncated": 1, "truncated_to": 256}

    manifest = SimpleNamespace(drafter={"tau": 2.0}, train=SimpleNamespace(train_samples=32, heldout_samples=8))
    extracted = [f"s{i}" for i in range(40)]
    figure = _train(manifest, extracted, retried.record)
    assert (figure.done, figure.failed, figure.lost) == (39, 1, 0)
    retried.update({0}, {})  # a later attempt read it after all
    assert retried.summary()["dropped"] == {} and _train(manifest, extracted, retried.record).done == 40
    short = {**retried.record, "read_rows": list(range(20))}  # a trainer that read 20 of the 32
    assert _train(manifest, extracted, short).lost == 12


def test_muon_orthogonalizes_in_fp32_where_the_cpu_would_emulate_bf16():
    """Issue 28 item 3: torch.optim.Muon runs its Newton-Schulz iteration in bf16, which an AVX2 CPU
    emulates (~30x the CPU time of fp32 at the SmolLM2 drafter's shapes): there eyrie's shim runs the
    same iteration in fp32 while it trains, and puts torch's back after."""
    import torch
    import torch.optim._muon as muon

    grad = torch.randn(96, 40, generator=torch.Generator().manual_seed(0))
    theirs = muon._zeropower_via_newtonschulz(grad, (3.4445, -4.775, 2.0315), 5, 1e-7)
    ours = engine._newton_schulz_fp32(grad, (3.4445, -4.775, 2.0315), 5, 1e-7)
    assert ours.dtype == torch.float32 and ours.shape == theirs.shape
    assert torch.allclose(ours, theirs.float(), atol=0.03)  # the same iteration, bf16's rounding apart
    original = muon._zeropower_via_newtonschulz
    with engine.speculators_patched("cpu", engine.Hooks()):
        patched = muon._zeropower_via_newtonschulz
    assert muon._zeropower_via_newtonschulz is original
    assert (patched is engine._newton_schulz_fp32) == (not engine.native_bf16("cpu"))
    assert engine.autocast_dtype("cpu") == ("bfloat16" if engine.native_bf16("cpu") else "float32")
    assert engine.autocast_dtype("cuda") == "bfloat16"


@pytest.mark.integration  # speculators' TrainConfig from settings runs `git rev-parse` (its provenance)
def test_tensorboard_event_files_go_to_the_runs_store_prefix(hs_dir, tmp_path):
    """Issue 28 item 7: train.loggers [tensorboard] has speculators write its event files, and the
    trainer puts them under the run's train/tensorboard/ in the store, readable by TensorBoard."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from eyrie.data.manifest import Layout
    from eyrie.data.store import FileStore
    from eyrie_trainer.events import EventUploads

    runner = runner_on(hs_dir, tmp_path, 32, 8, loggers=["tensorboard"], max_steps=3)
    options = runner._options(hs_dir, "cpu")
    assert options["logger"] == "tensorboard"
    hooks, _ = recording_hooks()
    engine.train_with_fallback(options, "cpu", False, hooks, print)
    store = FileStore(tmp_path / "store")
    uploads = EventUploads(store, Layout("r"), tmp_path / "logs")
    assert uploads.push() >= 1 and uploads.push() == 0  # nothing new: nothing sent again
    losses = []
    for key in store.list("runs/r/train/tensorboard/"):
        events = EventAccumulator(str(store._path(key)))
        events.Reload()
        if "train/loss" in events.Tags()["scalars"]:
            losses += events.Scalars("train/loss")
    assert len(losses) == 3  # one a step


@pytest.mark.integration  # speculators' TrainConfig from settings runs `git rev-parse` (its provenance)
def test_a_mid_epoch_resume_counts_the_rows_of_the_batches_it_trains_on(hs_dir, tmp_path):
    """Found by bench/real_model.py's second sitting: resumed mid-epoch, speculators' fast-skip leaves only the
    epoch's remaining batches in the sampler's cache, and the trainer's row count indexed that slice as the whole
    epoch (the wrong rows, then an IndexError at the epoch's last steps: every mid-epoch resume failed)."""
    options = runner_on(hs_dir, tmp_path, 32, 8)._options(hs_dir, "cpu")

    def train() -> list[set[int]]:
        """The rows read so far, after each step."""
        hooks, reads = engine.Hooks(), []
        hooks.on_step = lambda step: reads.append(set(hooks.state["read"]))
        engine.train_with_fallback(options, "cpu", False, hooks, print)
        return reads

    whole, skip = train(), 2  # epoch 0, whole
    assert len(whole) > skip and whole[-1] == set(range(32))
    state = tmp_path / "checkpoints" / "0" / "training_state.json"
    state.write_text(json.dumps({"epoch": 0, "local_step": skip, "global_step": skip}))  # as a stop there leaves it
    resumed = train()  # epoch 0 again, after its first `skip` batches
    assert len(resumed) == len(whole) - skip
    assert resumed[-1] == whole[-1] - whole[skip - 1]  # the rows of the batches trained on, each once


def test_a_sigterm_in_a_steps_report_saves_that_step_counted(hs_dir, tmp_path):
    """A SIGTERM that lands between a step's update and speculators' `global_step += 1` (its metrics log and
    eyrie's progress report sit there) waits for the step's end: the interrupt checkpoint holds the step
    counted. Raised at once, the checkpoint held the update with the step uncounted, so the next attempt
    resumed a step short of the one reported and trained that batch again (test_train_stops, CI)."""
    import os
    import signal

    hooks, seen = recording_hooks()
    train_records = []

    def on_metrics(record: dict) -> None:
        if "train" in record:
            train_records.append(record)
            if len(train_records) == 3:  # the third step's report: its update is applied, not yet counted
                os.kill(os.getpid(), signal.SIGTERM)

    hooks.on_metrics = on_metrics
    engine.train_with_fallback(argv(hs_dir, tmp_path / "ck", "--epochs", "1"), "cpu", False, hooks, print)
    assert hooks.state.get("interrupted") and hooks.state["signalled"] == "SIGTERM"
    assert len(train_records) == 3 and seen["checkpoints"] == [("0", 3)]
    state = json.loads((tmp_path / "ck" / "0" / "training_state.json").read_text())
    assert state["global_step"] == 3 and state["local_step"] == 3
