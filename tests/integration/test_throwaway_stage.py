"""The pipeline is data: a stage declared here, in one class (with its two tasks), its settings class
and one entry in eyrie.stages.PIPELINE, is configured in run.yaml, planned from its section, run,
shown, cancelled and retried by eyrie's own config, advance, status, cancel and retry, with no other
file touched (no schema, doc test or README list). Real Redis, a real store, RQ workers in this
process, the vLLM stand-in answering generate."""

import pytest
import redis
from pydantic import Field
from rq.serializers import JSONSerializer

from eyrie import stages
from eyrie.core.config import load_settings
from eyrie.core.errors import EyrieError
from eyrie.core.stage_settings import StageSettings
from eyrie.data.store import open_store
from eyrie.runs.control import cancel_run, retry_run, start_pipeline
from eyrie.runs.pipeline import advance, run_job_ids
from eyrie.runs.status import run_status
from eyrie.stages import PipelineStage, RunView, TaskKind
from eyrie.stages.run_config import load_config, stored_config
from eyrie.tasks.executor import StageTask, execute
from eyrie.work.queue import EyrieJob, job_state, queue
from eyrie.work.status_models import StageStatus
from eyrie.work.worker_loop import InProcessWorker
from tests.support.harness import tiny_run_config

pytestmark = pytest.mark.parametrize("store_env", ["file"], indirect=True)
PLAN_NOTE = TaskKind("plan-note", "note", f"{__name__}.run_plan_note")  # the workers import them by this path
NOTE = TaskKind("note", "note", f"{__name__}.run_note")


class NoteSettings(StageSettings):
    """The note's section of the run config."""

    greeting: str = Field("hello", min_length=1, description="The note's first word.")


class Note(PipelineStage):
    """After generate: plans a count of the generated shards and its greeting, then writes one note per run."""

    name = queue = worker = "note"
    sections = {"note": NoteSettings}
    planner, work = PLAN_NOTE, NOTE

    def planned(self, view: RunView) -> bool:
        return view.store.exists(f"{view.layout.root}/note/plan.json")

    def done(self, view: RunView) -> bool:
        return view.store.exists(f"{view.layout.root}/note/done.json")


class PlanNoteTask(StageTask):
    stage = PLAN_NOTE

    def run(self) -> dict:
        shards = len(self.store.get_json(f"runs/{self.run_name}/manifest.json")["generate_shards"])
        greeting = stored_config(self.store, self.run_name).note.greeting  # its section of the run's config
        self.store.put_json(f"runs/{self.run_name}/note/plan.json", {"shards": shards, "greeting": greeting})
        return self.result("planned", shards=shards)


class NoteTask(StageTask):
    stage = NOTE

    def done_key(self) -> str:
        return f"runs/{self.run_name}/note/done.json"

    def run(self) -> dict:
        self.write_manifest(StageStatus(state="done", total=1, done=1))
        return self.result("done")


def run_plan_note(payload: dict) -> dict:
    return execute(PlanNoteTask, payload)


def run_note(payload: dict) -> dict:
    return execute(NoteTask, payload)


def work(conn, name: str) -> None:
    InProcessWorker([queue(conn, name)], connection=conn, serializer=JSONSerializer,
                    job_class=EyrieJob).work(burst=True)


@pytest.fixture
def note_stage():
    """The one list entry: the note after generate."""
    stages.PIPELINE.insert(1, Note())
    yield
    del stages.PIPELINE[1]


def test_a_stage_declared_in_one_class_and_one_list_entry_is_planned_run_shown_cancelled_and_retried(
        env, stub_server, tmp_path, monkeypatch, note_stage):
    monkeypatch.setenv("EYRIE_INFERENCE_URL", stub_server(tokens=4))
    monkeypatch.setenv("EYRIE_SERVER", "vllm")
    with pytest.raises(EyrieError, match="note.greeting: String should have at least 1 character"):
        load_config(tiny_run_config(tmp_path, "bad", note={"greeting": ""}))  # its settings class checks its section
    cfg = load_config(tiny_run_config(tmp_path, "n", dataset={"limit": 4}, generate={"shard_size": 2},
                                      note={"greeting": "hi"}))
    settings = load_settings(model=cfg.target.model)
    conn, store = redis.Redis.from_url(env["EYRIE_REDIS_URL"]), open_store(settings)

    assert "note" in stages.queues() and f"{__name__}.run_note" in stages.task_funcs()
    start_pipeline(settings, conn, store, cfg)
    work(conn, "generate")  # each finished task advances the run: generate done -> the note's planner
    assert job_state(conn, PLAN_NOTE.task_id("n")) == "queued"
    assert run_job_ids(store, "n")["note"] == ["plan-note-n-00000", "note-n-00000"]

    work(conn, "note")  # planned; its planner's success enqueued its work task, which ran too
    assert store.get_json("runs/n/note/plan.json") == {"shards": 2, "greeting": "hi"}
    status = run_status(conn, store, "n")
    assert list(status.stages) == ["generate", "note"] and status.stages["note"].state == "done"
    assert status.pipeline.tasks["plan-note"].state == "finished"
    assert job_state(conn, stages.PLAN_EXTRACT.task_id("n")) == "queued"  # the pipeline went on past it

    store.delete("runs/n/note/done.json")  # its output gone: the note is to be done again
    assert advance(conn, store, "n") == "note" and job_state(conn, NOTE.task_id("n")) == "queued"
    assert run_status(conn, store, "n").stages["note"].state == "in_progress"
    cancelled = cancel_run(conn, store, "n")
    assert NOTE.task_id("n") in cancelled["cancelled"]
    assert run_status(conn, store, "n").stages["note"].state == "cancelled"

    retried = retry_run(conn, store, "n")
    assert NOTE.task_id("n") in retried["requeued"]
    work(conn, "note")
    assert store.exists("runs/n/note/done.json")
    assert run_status(conn, store, "n").stages["note"].state == "done"
