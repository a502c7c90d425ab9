"""Every view of a run counts from one source (issue 41, item 10). The samples training left out:
status, `eyrie logs` and the dashboard's API read the trainer's record over every attempt
(train/samples.json), which the trainer saves soon after a step leaves one out; before, `eyrie logs`
and the dashboard counted the running attempt's drops from Redis and read 0 after a retry. Grouped by
speculators' reason with its numbers as N (its words name the row and the attempt: one reason, not
one per sample), one example each. The loss
and accuracy charts: drawn from the trainer's live curve while it trains, to the step just done;
before, from the store's copy, written only with each checkpoint. Real Redis, a real store (a local
directory); the trainer's own code (its runner, its record, speculators' training on CPU)."""

import json

import pytest
import redis
from fastapi.testclient import TestClient

from eyrie.api.app import create_app
from eyrie.core.config import load_settings
from eyrie.data.manifest import Layout
from eyrie.data.store import open_store
from eyrie.runs.status import run_status
from eyrie.tasks.executor import Context, RunTask, execute
from eyrie_trainer import engine
from eyrie_trainer.ledger import TrainedSamples
from eyrie_trainer.runner import TrainRunner
from tests.support.builders import make_manifest
from tests.support.harness import TINY, eyrie_in_process

pytestmark = pytest.mark.parametrize("store_env", ["file"], indirect=True)

MISMATCH = "the generated hidden states' token ids do not match the sample's"  # eyrie_trainer.engine.drop_reason's


def gave_up(row: int, failures: int) -> str:
    """speculators' words for a sample whose extraction-service retries ran out (speculators.train.recovery)."""
    return (f"Hidden-state round trip failed for dataset index {row}, file index {row} (attempt 8/8, consecutive "
            f"failures={failures}/20): ConnectError: [Errno 111] Connection refused")


# one reason for every such sample, its numbers as N
GAVE_UP = ("Hidden-state round trip failed for dataset index N, file index N (attempt N/N, consecutive "
           "failures=N/N): ConnectError: [Errno N] Connection refused")


def attempt(ctx: Context, run: str, samples: list[dict]) -> TrainRunner:
    """A train task's runner as its `run` leaves it when speculators starts: the record of the samples
    read continued, its hooks' state fresh, its curve begun (runner.py, TrainRunner.run)."""
    from eyrie.data.charts import Curve

    runner = TrainRunner(ctx, RunTask(run=run))
    runner.ledger = TrainedSamples.start(ctx.store, runner.layout, samples, 1, 256)
    runner.hooks = engine.Hooks()
    runner.hooks.state.update(read=set(), dropped_rows={})
    runner.curve = Curve()
    return runner


def step(runner: TrainRunner, global_step: int, dropped: dict[int, str]) -> None:
    """One training step through the runner's hooks, as engine.py calls them: speculators' warnings
    for the rows it leaves out, its metrics record, then the step's end (the rows of its batch known)."""
    for why in dropped.values():
        runner._on_dropped(why)
    runner._on_metrics({"global_step": global_step, "epoch": 0,
                        "train": {"loss": 1.0, "loss_0": 1.0, "full_acc_0": 0.5, "error_records": len(dropped)}})
    runner.hooks.state["dropped_rows"].update(dropped)


def dashboard_api() -> TestClient:
    return TestClient(create_app(load_settings().model_copy(update={"api_open_reads": True})))


def views(env: dict, run: str) -> dict[str, dict[str, int]]:
    """Samples left out of training, per reason, as each view shows them."""
    api = dashboard_api()
    status = api.get(f"/runs/{run}").json()["stages"]["train"]
    listed = [r for r in api.get(f"/runs/{run}/failures").json() if r["stage"] == "train" and r["kind"] == "dropped"]
    logs = eyrie_in_process("logs", run, env=env).stdout.splitlines()
    cli = json.loads(eyrie_in_process("status", run, "--json", env=env).stdout)["stages"]["train"]
    shown = eyrie_in_process("status", run, env=env).stdout
    found = {"status API": {"total": status["dropped"]},
             "dashboard failures": {r["reason"]: r["count"] for r in listed},
             "eyrie logs": {line.split(" dropped: ")[1].split(" (e.g.")[0]: int(line.split()[1])
                            for line in logs if line.startswith("train: ") and " dropped: " in line},
             "eyrie status --json": {"total": cli["dropped"]}}
    left = [line for line in shown.splitlines() if "sample(s) left out" in line]
    found["eyrie status"] = {"total": int(left[0].split()[1]) if left else 0}
    assert set(status["drop_reasons"]) == set(found["dashboard failures"]), (status, found)
    return found


@pytest.mark.integration
def test_after_a_retry_status_logs_and_the_dashboard_count_the_same_samples_left_out(env, ctx):
    run, layout = "agree", Layout("agree")
    ctx.store.put_json(layout.manifest, make_manifest(run, rows=6, extract={}, train={}).model_dump())
    samples = [{"sample_id": f"s{i}", "seq_len": 100} for i in range(6)]

    first = attempt(ctx, run, samples)  # attempt 1 leaves s0 out, then fails: its record is saved as it ends
    step(first, 0, {0: MISMATCH})
    step(first, 1, {})
    first.hooks.state["read"].update({1, 2})
    first._save_ledger()

    second = attempt(ctx, run, samples)  # the retry: this attempt has left nothing out yet
    second._report(phase="training", force=True)
    for name, counts in views(env, run).items():
        assert sum(counts.values()) == 1, (name, counts)
    assert views(env, run)["dashboard failures"] == views(env, run)["eyrie logs"] == {MISMATCH: 1}

    step(second, 5, {3: gave_up(3, 1), 4: gave_up(4, 2)})  # it leaves s3 and s4 out: one reason (their
    step(second, 6, {})  # numbers aside), in the record by the next step, not the next checkpoint
    found = views(env, run)
    assert {name: sum(c.values()) for name, c in found.items()} == dict.fromkeys(found, 3), found
    assert found["dashboard failures"] == found["eyrie logs"] == {GAVE_UP: 2, MISMATCH: 1}
    failures = dashboard_api().get(f"/runs/{run}/failures").json()
    examples = {r["reason"]: r["example"] for r in failures if r["kind"] == "dropped"}
    assert examples == {MISMATCH: {"sample_id": "s0", "detail": MISMATCH},
                        GAVE_UP: {"sample_id": "s3", "detail": gave_up(3, 1)}}, examples

ROWS = 40


def extracted_run(env: dict, stub_server, tmp_path, monkeypatch, run: str) -> None:
    """`run`'s ROWS samples answered by the vLLM stand-in and extracted (layers 2, 4, 5) in this process."""
    from eyrie_extractor.shard import ExtractRunner
    from eyrie_generator.shard import ShardRunner

    settings_env = {"EYRIE_INFERENCE_URL": stub_server(tokens=24), "EYRIE_SERVER": "vllm", "EYRIE_MODEL": str(TINY),
                    "EYRIE_DEVICE": "cpu", "EYRIE_CACHE_DIR": str(tmp_path / "cache")}
    for key, value in settings_env.items():
        monkeypatch.setenv(key, value)
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"conversations": [{"from": "human", "value": f"question {i}"}]}) + "\n"
                            for i in range(ROWS)))
    env = {**env, **settings_env}
    eyrie_in_process("generate", "--dataset", str(data), "--run", run, "--shard-size", str(ROWS), env=env)
    settings = load_settings()
    ctx = Context(settings, redis.Redis.from_url(settings.redis_url), open_store(settings))
    assert execute(ShardRunner, {"run": run, "shard": 0}, ctx)["status"] == "done"
    eyrie_in_process("extract", "--run", run, "--layers", "2,4,5", env=env)
    assert execute(ExtractRunner, {"run": run, "shard": 0}, ctx)["status"] == "done"


@pytest.mark.timeout(600)
def test_the_charts_reach_the_step_training_is_at_past_its_last_checkpoint(env, stub_server, tmp_path, monkeypatch):
    """A real training (2 epochs, a checkpoint after each), read through the status API's function
    two steps past its first checkpoint: the loss and accuracy charts end at the step the status
    shows, the step just trained, where the store's copy of the curve ends at the checkpoint."""
    import time

    from eyrie.core.stage_settings import TrainSettings
    from eyrie.runs.pipeline import save_config, stage_config
    from eyrie.stages.train import Train
    from eyrie_trainer.plan import PlanTrain

    run, layout = "charts", Layout("charts")
    extracted_run(env, stub_server, tmp_path, monkeypatch, run)
    settings = load_settings()
    ctx = Context(settings, redis.Redis.from_url(settings.redis_url), open_store(settings))
    given = TrainSettings(epochs=2, seq_len=128, draft_vocab=300)  # kept as `eyrie train --run charts` keeps them
    save_config(ctx.conn, ctx.store, stage_config(settings, ctx.store, run, Train(), given))
    assert execute(PlanTrain, {"run": run}, ctx)["status"] == "planned"

    seen: list[dict] = []
    own_step, checkpoint = TrainRunner._on_step, TrainRunner._on_checkpoint

    def on_checkpoint(self, label, epoch, local_step):  # the runner's own, its step noted
        checkpoint(self, label, epoch, local_step)
        seen.append({"checkpoint": self.live["step"]})

    def on_step(self):  # the runner's own; two steps past the first checkpoint, every view is read
        own_step(self)
        past = self.live["step"] - seen[0]["checkpoint"] if len(seen) == 1 else 0
        if past == 1:  # the next step's report is not held back (reports are 0.5 s apart at most)
            time.sleep(0.6)
        if past == 2:
            train = run_status(ctx.conn, ctx.store, run).stages["train"]
            stored = ctx.store.get_json(layout.train_curve)
            seen.append({"step": self.live["step"], "status": train.done, "charts": train.charts["ttt"]["steps"][-1],
                         "stored": stored["steps"][-1]})

    monkeypatch.setattr(TrainRunner, "_on_checkpoint", on_checkpoint)
    monkeypatch.setattr(TrainRunner, "_on_step", on_step)
    assert execute(TrainRunner, {"run": run}, ctx)["status"] == "done"
    assert len(seen) >= 2 and "charts" in seen[1], f"no step two past the first checkpoint was read: {seen}"
    read = seen[1]
    assert read["stored"] == seen[0]["checkpoint"] < read["step"], read  # the store's copy stops at the checkpoint
    assert read["charts"] == read["status"] == read["step"], read  # the charts reach the step just done
    final = run_status(ctx.conn, ctx.store, run).stages["train"]
    assert final.charts["ttt"]["steps"][-1] == final.done == ctx.store.get_json(layout.train_curve)["steps"][-1]
