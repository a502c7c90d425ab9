"""One train task: the run's hidden states to a local cache, speculators' trainer on them
(resuming from the last stored checkpoint), every checkpoint to the store as it is saved, then
each one evaluated on held-out samples and the best exported. Samples stored as token ids alone
(extract.storage hybrid or online) get their states from the vLLM extraction service: speculators
asks it for them every epoch; the held-out ones are fetched once."""

from __future__ import annotations

import logging
import os
import signal
import time
from pathlib import Path

from eyrie.core.errors import EyrieError
from eyrie.core.storage import trains_on_demand
from eyrie.data.charts import Curve, per_position
from eyrie.data.manifest import Layout, load_run_manifest
from eyrie.data.store import CorruptObject
from eyrie.stages import EXTRACT, TRAIN
from eyrie.tasks.executor import Context, RunTask, StageTask, execute
from eyrie.work.cancel import Stopping
from eyrie.work.extract_server import on_demand
from eyrie.work.gpu import pick_device
from eyrie.work.queue import enqueue
from eyrie.work.worker_loop import stop_requested
from eyrie_trainer import checkpoints, engine
from eyrie_trainer.base import prepare_base, save_vocab_mapping
from eyrie_trainer.data import done_samples, fetch_heldout_states, heldout_ids, materialize, split_ratio
from eyrie_trainer.events import EventUploads
from eyrie_trainer.export import evaluate_and_export
from eyrie_trainer.ledger import TrainedSamples
from eyrie_trainer.stall import Stalled, StallWatch

log = logging.getLogger("eyrie.trainer")
# speculators backs a failed request to the extraction service off 2, 4, ..., 128 s (~4 min) and
# tries the whole round 3 times (its generation_validation_retries 2): an outage of ~12 min makes
# training wait; past it the sample is dropped, and 20 in a row stop training
SERVICE_RETRIES = 7
STALL_RETRIES = 2  # a training that stalls again after two resumes is not a passing hang
LEDGER_SAVE_S = 30  # samples left out reach train/samples.json (what status counts) this soon, checkpoint or not


class TaskLost(RuntimeError):
    """Another worker took the task over (this one stalled past its lease): stop, retry later."""


class TrainRunner(StageTask):
    """The run's one train task; the executor (eyrie.tasks.executor) holds its leases and checks for
    the exported drafter's manifest. The constructor reads nothing: the plan (made by plan-train,
    eyrie_trainer.plan) is read in `run`, after the done-check."""

    stage, gpu_owner = TRAIN, "trainer"
    _drops_unsaved, _ledger_saved = False, float("-inf")  # samples left out since the ledger's last save; when
    curve: Curve | None = None  # loss and accuracy per step, once training starts

    def __init__(self, ctx: Context, payload: RunTask):
        super().__init__(ctx, payload)
        self.layout = Layout(self.run_name)
        self.work = Path(self.settings.cache_dir) / "runs" / self.run_name
        self.live: dict = {"phase": "starting", "step": 0, "tokens": 0, "checkpoints": []}
        self._last_report = 0.0
        self.on_demand = 0  # training samples whose states the extraction service makes, every epoch
        self.service_url: str | None = None  # its API, where any sample is on demand

    def done_key(self) -> str:
        return self.layout.drafter_manifest

    def devices(self) -> str | None:
        self.device = pick_device(self.settings.device)
        return self.device if self.device.startswith("cuda") else None

    def gpu_mode(self) -> str:
        """Beside the vLLM extraction service, which shares its GPUs with the trainer of a run that
        trains on demand (eyrie.core.storage.trains_on_demand); else the GPU is the trainer's own."""
        return "beside" if trains_on_demand(load_run_manifest(self.store, self.run_name)) else "own"

    def report_waiting(self, what: str) -> None:
        self._report(phase="waiting", waiting_for=what, force=True)

    def on_cancel(self) -> dict:
        """Cancelled while it waited for the extraction service: nothing trained, nothing to save."""
        self._report(phase="cancelled", force=True)
        return self.result("cancelled")

    def load_plan(self) -> None:
        """The run's train plan, as its planning task recorded it in the run manifest (plan-train)."""
        self.manifest = load_run_manifest(self.store, self.run_name)
        self.params = self.manifest.train
        if self.params is None:
            raise EyrieError(f"run {self.run_name} has no train plan.", f"run `eyrie train --run {self.run_name}`.")

    def run(self) -> dict:
        device = self.device
        self.load_plan()
        self._report(phase="data", force=True)
        try:
            train_dir, eval_dir = self._prepare_data()
        except CorruptObject as exc:
            return self._extract_again(exc)
        base = self._prepare_base() if self.params.base else {}
        self.stop_if_asked()  # a cancel or the worker's SIGTERM while the data and the base were prepared
        restored = checkpoints.restore(self.store, self.layout, self.work / "checkpoints", self._say)
        if restored:
            self._say(f"resuming from checkpoint {restored['label']} (step {restored['local_step']} of epoch "
                      f"{restored['epoch']})")
        self.uploads = checkpoints.Uploader(self.store, self.layout, self.work / "checkpoints", self._stored)
        self.events = EventUploads(self.store, self.layout, self.work / "logs") if self.params.loggers else None
        stored_curve = self.layout.train_curve
        self.curve = Curve(self.store.get_json(stored_curve) if self.store.exists(stored_curve) else None)
        hooks = self.hooks = engine.Hooks(on_metrics=self._on_metrics, on_checkpoint=self._on_checkpoint,
                                          on_step=lambda step: self._on_step(), on_start=self._on_start,
                                          on_dropped=self._on_dropped)
        if self.params.recipe:
            self._say(f"recipe: {self.params.recipe}")
        self._report(phase="training", force=True)
        try:
            settings = {**self._options(train_dir, device), **self._on_missing(), **base}
            if settings["hidden_states_dtype"] == "float32":
                self._say("training in fp32: this CPU has no native bf16 (bf16 autocast would be ~60x slower here)")
            path = self._train(settings, device, hooks)
            path["dtype"] = settings["hidden_states_dtype"]
        finally:
            self.uploads.drain()  # every checkpoint saved is in the store before the task ends
            self.store.put_json(self.layout.train_curve, self.curve.snapshot())
            self._save_ledger()
            self._push_events()
        if hooks.state.get("interrupted") and self.cancelled.seen:
            self._report(phase="cancelled", force=True)
            return {"status": "cancelled", "step": self.live.get("step")}
        if hooks.state.get("interrupted"):
            self._hand_back()
        if hooks.state.get("signalled"):  # it came as training ended: finish the task, then the worker stops
            self._say(f"{hooks.state['signalled']} as training ended: the drafter is exported, then the worker stops")
            os.kill(os.getpid(), signal.SIGTERM)
        # the total was an estimate: speculators packs each epoch's shuffle into batches anew
        self._report(phase="evaluating", path=path, total_steps=self.live["step"], force=True)
        with engine.verifier_code(self.manifest.target.trust_remote_code):  # each checkpoint's load reads it
            result = evaluate_and_export(self.store, self.run_name, eval_dir, device, path, self._say,
                                         samples=self.ledger.summary())
        self._report(phase="done", path=path, final=True, force=True)
        return {"status": "done", **result}

    def _hand_back(self) -> None:
        """A SIGTERM: what was trained is in the store (speculators saved a resumable checkpoint); the
        task goes back to its queue with no failed attempt counted (the executor's Stopping), and
        the next attempt resumes there. speculators' handler took the signal meant for the worker:
        it is handed on, so the worker stops after this task instead of taking the next one."""
        if not stop_requested():
            os.kill(os.getpid(), signal.SIGTERM)
        self._say(f"the worker is stopping (SIGTERM): training handed back at step {self.live.get('step')}; "
                  "the next attempt resumes from its checkpoint")
        self._report(phase="queued", force=True)
        raise Stopping(f"training stopped at step {self.live.get('step')}; its checkpoint is in the store")

    def _prepare_data(self) -> tuple[Path, Path]:
        """The held-out samples (evaluation's), their states fetched where the service makes them;
        then the training directory: every training sample, then the held-out ones (linked, not
        copied) as speculators' validation split (`_options`: train_data_ratio)."""
        samples = done_samples(self.store, self.run_name)
        held = heldout_ids(samples, self.params.heldout_samples)
        train_dir, eval_dir = self.work / "data" / "train", self.work / "data" / "heldout"
        n_eval = materialize(self.store, self.run_name, eval_dir, lambda s: s["sample_id"] in held)
        from_service = [s for s in samples if on_demand(s)]
        self.on_demand = sum(1 for s in from_service if s["sample_id"] not in held)
        if from_service:
            self._fetch_heldout_states(eval_dir)
        n_train = materialize(self.store, self.run_name, train_dir, lambda s: s["sample_id"] not in held,
                              validation=lambda s: s["sample_id"] in held, linked_from=eval_dir)
        self.rows = (n_train, n_eval)
        self.ledger = TrainedSamples.start(self.store, self.layout, [s for s in samples if s["sample_id"] not in held],
                                           n_eval, self.params.total_seq_len)
        self._say(f"data: {n_train} training samples ({self.on_demand} on demand from the extraction "
                  f"service, every epoch), {n_eval} held out (speculators' validation), in {self.work / 'data'}")
        self._report(on_demand=self.on_demand, force=True)
        return train_dir, eval_dir

    def _fetch_heldout_states(self, eval_dir: Path) -> None:
        """The extraction service waited for (training asks it too), then the held-out on-demand
        samples' states fetched from it once, as `eyrie evaluate` fetches them."""
        self.service_url, fetched = fetch_heldout_states(
            self.settings, self.conn, self.manifest, eval_dir, SERVICE_RETRIES, self.report_waiting, self.cancelled,
            on_ready=lambda: self._report(phase="data", waiting_for=None, force=True))
        if fetched:
            self._say(f"{fetched} held-out samples' states fetched from the extraction service at {self.service_url}")

    def _extract_again(self, exc: CorruptObject) -> dict:
        """A stored sample that fails its checksum: its extract shard is produced again (the
        pipeline trains once that is done; by hand, rerun `eyrie train`). Never trained on."""
        shard = self.layout.shard_of_extract_sample(exc.key)
        self.store.delete(exc.key)
        self.store.delete(self.layout.extract_shard_manifest(shard))
        enqueue(self.conn, EXTRACT, {"run": self.run_name, "shard": shard}, shard)
        self._say(f"{exc.problem} Extract shard {shard} is produced again; training starts once it is done.")
        self._report(phase="waiting", waiting_for=f"extract shard {shard}", force=True)
        return {"status": "extracting_again", "shard": shard, "corrupt": exc.key}

    def _prepare_base(self) -> dict:
        """The base as planned (fetched and converted again on a new host), checked again here."""
        ref = self.params.base
        path, _ = prepare_base(ref.source, ref.revision, self.manifest.target.model, self.manifest.extract.aux_layers,
                               ref.draft_vocab, Path(self.settings.cache_dir) / "base",
                               self.manifest.target.trust_remote_code)
        d2t, t2d = save_vocab_mapping(path, self.work / "base-vocab")
        return {"from_pretrained": str(path), "d2t_path": str(d2t), "t2d_path": str(t2d)}

    def _train(self, settings: dict, device: str, hooks: engine.Hooks) -> dict:
        """speculators' training, watched: stalled (no step, no new epoch for train_stall_s), it resumes
        from its last checkpoint, STALL_RETRIES times at most."""
        fast, stalls, limit_s = engine.fast_path(self.settings, device), 0, self.settings.train_stall_s
        no_loader_workers = settings["num_workers"] == 0  # nothing to end: the training itself is interrupted
        while True:
            watch = StallWatch(limit_s, lambda: (hooks.state.get("steps"), hooks.state.get("epoch")), self._say,
                               interrupt=no_loader_workers)
            try:
                with watch:
                    return engine.train_with_fallback(settings, device, fast, hooks, self._say)
            except (Exception, Stalled) as exc:
                if not watch.fired:
                    raise
                stalls += 1
                if stalls > STALL_RETRIES:
                    raise EyrieError(f"training stalled {stalls} times (no step for {limit_s:g} s); the last "
                                     f"ended in {type(exc).__name__}: {str(exc)[:200]}",
                                     "read the stacks in the trainer's log; raise EYRIE_TRAIN_STALL_S if a step "
                                     "or a validation pass really takes that long.") from exc
                self._say(f"resuming from the last checkpoint after the stall ({type(exc).__name__})")

    def _options(self, train_dir: Path, device: str) -> dict:
        workers = engine.loader_workers(self.settings, device)
        return speculators_options(self.params, self.manifest, train_dir, self.work, workers, self.rows, device)

    def _on_missing(self) -> dict:
        """What speculators does for a sample without a states file: ask the extraction service where
        the training set has on-demand samples; anywhere else it is eyrie's bug, raised (speculators'
        default would ask a server at localhost:8000)."""
        if self.service_url is None:
            return {"on_missing": "raise"}
        return {"on_missing": "generate", "vllm_endpoint": self.service_url, "max_retries": SERVICE_RETRIES,
                "request_timeout": float(self.manifest.generate.request_timeout_s)}

    def _argv(self, train_dir: Path, device: str) -> list[str]:
        """The same settings as a `speculators train` command line (bench/train_throughput.py)."""
        return engine.as_argv(self._options(train_dir, device))

    def _on_start(self, steps_per_epoch: int, global_step: int) -> None:
        total = steps_per_epoch * self.params.epochs
        self.live.update(steps_per_epoch=steps_per_epoch, step=global_step, resumed_at_step=global_step,
                         total_steps=min(total, self.params.max_steps or total))
        self.curve.resumed_at(global_step)
        self._report(force=True)

    def _on_metrics(self, record: dict) -> None:
        self.curve.add_record(record)
        if "train" in record:
            self._save_drops()
            metrics, profile = record["train"], record.get("profile") or {}
            self.live.update(step=record["global_step"] + 1, epoch=record.get("epoch"), loss=metrics.get("loss"),
                             acc=per_position(metrics, "full_acc"), lr=record.get("lr"))
            self.live["tokens"] += round(profile.get("tokens_per_s", 0) * profile.get("step_ms", 0) / 1000)
            self._count_dropped(round(metrics.get("error_records", 0)), record.get("epoch"))
        elif "val" in record:
            self.live["val_loss"] = record["val"].get("loss_epoch")
        self._report()

    def _on_dropped(self, reason: str) -> None:
        self.live["drop_reasons"] = [*self.live.get("drop_reasons", [])[-4:], reason]

    def _count_dropped(self, dropped: int, epoch: int | None) -> None:
        """Samples speculators left out of this step (it trains on the rest): counted, with why."""
        if dropped:
            self.live["dropped"] = self.live.get("dropped", 0) + dropped
            self._drops_unsaved = True
            why = (self.live.get("drop_reasons") or ["see the trainer's log"])[-1]
            self._say(f"{dropped} sample(s) left out of a step of epoch {epoch}: {why}")

    def _on_checkpoint(self, label: str, epoch: int, local_step: int) -> None:
        """The curve up to this checkpoint goes to the store with it (a resumed run continues it), and
        the record of the samples read."""
        self.store.put_json(self.layout.train_curve, self.curve.snapshot())
        self._save_ledger()
        self._push_events()
        self.uploads.submit(label, epoch, local_step)

    def _push_events(self) -> None:
        """TensorBoard's event files (train.loggers) to the store: at each checkpoint and at the end."""
        if self.events is not None:
            self.events.push()

    def _save_drops(self) -> None:
        """The steps before this one left samples out (their rows are known once their step ended):
        the ledger goes to the store, at most every LEDGER_SAVE_S."""
        if self._drops_unsaved and time.monotonic() - self._ledger_saved > LEDGER_SAVE_S:
            self._save_ledger()

    def _save_ledger(self) -> None:
        self.ledger.update(self.hooks.state.get("read", set()), self.hooks.state.get("dropped_rows", {}))
        self.ledger.save()
        self._drops_unsaved, self._ledger_saved = False, time.monotonic()

    def _stored(self, label: str, epoch: int, local_step: int, entry: dict) -> None:
        self.live["checkpoints"].append({"label": label, "step": self.live.get("step"), "epoch": epoch,
                                         "local_step": local_step})
        self._say(f"checkpoint {label} stored ({sum(f['bytes'] for f in entry['files'].values()):,} bytes)")
        self._report(force=True)

    def _on_step(self) -> None:
        if self.beat.lost:
            raise TaskLost("the task lease was lost (another worker took the task over)")
        # speculators saves a resumable checkpoint, then training returns; a SIGTERM the worker's own
        # handler took (it came before speculators' was installed) is seen here
        stop = "cancelled" if self.cancelled() else "SIGTERM" if stop_requested() else None
        if stop:
            from speculators.train.graceful_shutdown import TrainingInterruptedError

            if stop == "cancelled":
                self._say("run cancelled: saving a checkpoint and stopping")
            raise TrainingInterruptedError(stop)

    def _say(self, message: str) -> None:
        log.warning(message)
        self.live.setdefault("notes", []).append(message)
        self.live["notes"] = self.live["notes"][-10:]

    def _report(self, force: bool = False, **fields) -> None:
        self.live.update(fields)
        if force or time.monotonic() - self._last_report > 0.5:
            self._last_report = time.monotonic()
            self.progress.report(**self.live)
            if self.curve is not None:  # the charts reach the step the status shows
                self.progress.curve(self.curve.snapshot())


def run_train_task(payload: dict) -> dict:
    """RQ entry point."""
    return execute(TrainRunner, payload)


def speculators_options(p, manifest, train_dir: Path, work: Path, workers: int, rows: tuple[int, int],
                        device: str) -> dict:
    """speculators' training settings, by its names, from the plan `p` (engine builds its TrainConfig): the
    training directory holds `rows` (training, validation) samples; checkpoints and logs go under `work`
    (bench/learning_curve.py trains its slices with these too)."""
    extract = manifest.extract
    options = {"verifier_name_or_path": manifest.target.model, "data_path": str(train_dir),
               "save_path": str(work / "checkpoints"), "epochs": p.epochs, "ttt_steps": p.ttt_steps,
               "lr": p.lr, "total_seq_len": p.total_seq_len, "num_workers": workers,
               "target_layer_ids": list(extract.aux_layers), "log_dir": str(work / "logs"),
               "logger": ",".join(p.loggers), "scheduler_type": p.schedule,
               "hidden_states_backend": "fp8" if extract.dtype == "fp8" else "file",
               "checkpoint_freq": 1, "log_freq": 1, "draft_vocab_size": p.draft_vocab,
               "train_data_ratio": split_ratio(*rows), "hidden_states_dtype": engine.autocast_dtype(device)}
    if not p.base:  # a base drafter defines its own decoder (speculators refuses both)
        options["num_layers"] = p.num_layers
    if p.max_steps:
        options["max_steps"] = p.max_steps
    if p.warmup is not None:  # else a plan from before warmup was planned: speculators' 1%
        options["scheduler_warmup_ratio"] = p.warmup
    if getattr(manifest.target, "trust_remote_code", False):  # serve.trust_remote_code: its loads run the code
        options["trust_remote_code"] = True  # (and engine.verifier_code, where speculators' option misses)
    return options
