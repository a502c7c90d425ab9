"""A run on a published answers set (issue 43, item 6): a run config whose dataset names the answers `eyrie publish
--with-answers` wrote (a directory, or a dataset on the hub: eyrie.data.answers_set) starts at extraction. Its
target must be the one that gave the answers (the same revision and chat template, as eyrie.runs.reuse compares
targets), checked before anything is written; the run's generate stage is then planned and done from the set (its
input shards, its answers as generate records, its shard manifests), nothing is generated and no inference server
is needed, and the run manifest's `answers_from` names where the answers came from."""

from __future__ import annotations

import orjson

from eyrie.core.errors import EyrieError
from eyrie.core.target import describe
from eyrie.data.answers_set import AnswersSet, find
from eyrie.data.manifest import (Counts, DatasetRef, GenerateParams, Layout, RunManifest, ShardManifest, ShardPlan,
                                 TargetRef, code_version, now_iso)
from eyrie.runs.reuse import target_identity
from eyrie.stages import PIPELINE


def answers_of(config) -> AnswersSet | None:
    """The published answers set the run config's dataset names, checked against its target and its generate
    settings as given; None where the dataset is prompts."""
    answers = find(config.dataset.source, config.dataset.revision)
    if answers is not None:
        check_target(answers, config.target.model)
        check_generate(answers, config.generate)
    return answers


def check_target(answers: AnswersSet, model: str, hub_id: str | None = None) -> TargetRef:
    """The run's target as the answers' own: refused where it is another model, another revision or another chat
    template (the answers' token ids are that target's, and so would be the drafter's training data). `hub_id`: the
    run config's target.hub_id, else the one the answers' target recorded."""
    theirs, mine = TargetRef.model_validate(answers.provenance["target"]), describe(model)
    if target_identity(mine) is None or target_identity(mine) != target_identity(theirs):
        raise EyrieError(f"the answers in {answers.where} were given by {theirs.model} (revision {theirs.revision}, "
                         f"chat template sha256 {theirs.chat_template_sha256}); this run's target {model} is "
                         f"revision {mine.revision}, chat template sha256 {mine.chat_template_sha256}. Nothing was "
                         "started.", "name that target at that revision (target.model: a directory holding it, or "
                         "its hub id), or give this target's prompts as the dataset: its own answers are generated.")
    return TargetRef(model=mine.model, hub_id=hub_id or theirs.hub_id, revision=mine.revision,
                     chat_template_sha256=mine.chat_template_sha256,
                     server=theirs.server, conversion=mine.conversion, trust_remote_code=theirs.trust_remote_code)


def check_generate(answers: AnswersSet, request) -> None:
    """The run config's generate settings as given (not its defaults) are how the answers were generated."""
    made = GenerateParams.model_validate(answers.provenance["generate"])
    stated = {**made.sampling.model_dump(), "turns": made.turns}
    changed = [f"{name} {value} vs {stated[name]}" for name, value in request.given().items()
               if name in stated and value != stated[name]]
    if changed:
        raise EyrieError(f"the answers in {answers.where} were generated with other settings than the run config's "
                         f"generate: {'; '.join(changed)}. Nothing was started.",
                         "drop those settings from the run config (the answers are what they are), or give the "
                         "prompts as the dataset to generate answers with them.")


def plan_from_answers(store, run: str, answers: AnswersSet, model: str, hub_id: str | None = None) -> RunManifest:
    """The run's generate stage planned and done from the set: its shards' inputs, records and manifests, then its
    run manifest (written last: the run is then planned up to extract)."""
    target, layout, plans, samples = check_target(answers, model, hub_id), Layout(run), [], 0
    for _, records in answers.shards():
        if records:
            plans.append(_shard(store, layout, len(plans), records, answers.where))
            samples += len(records)
    if not plans:
        raise EyrieError(f"the answers in {answers.where} hold no answered sample.",
                         "publish a run whose generate stage answered some prompts (`eyrie publish --with-answers`).")
    p = answers.provenance
    made = GenerateParams.model_validate(p["generate"])
    manifest = RunManifest(run=run, created_at=now_iso(), code_version=code_version(), target=target,
                           dataset=DatasetRef.model_validate(p["dataset"]), generate=made, generate_shards=plans,
                           answers_from={"where": answers.where, "revision": answers.revision, "run": p["run"],
                                         "samples": samples,
                                         "dataset_license": p.get("dataset_license")})
    store.put_json(layout.manifest, manifest.model_dump())
    return manifest


def _shard(store, layout: Layout, index: int, records: list[dict], where: str) -> ShardPlan:
    """One generate shard as the generator leaves it: its input rows, its records (every one done) and its
    manifest (the proof of completion, written last)."""
    def jsonl(rows) -> bytes:
        return b"".join(orjson.dumps(r) + b"\n" for r in rows)

    records = sorted(records, key=lambda r: r["row"])
    inputs = store.put_bytes(layout.generate_input(index), jsonl(
        {"row": r["row"], "sample_id": r["sample_id"], "data": {"messages": r["messages"]}} for r in records))
    answers = store.put_bytes(layout.generate_shard(index), jsonl(records))
    turns = [t for r in records for t in (r.get("turns") or [r])]
    prompt = sum(len(t.get("prompt_token_ids") or []) for t in turns)
    completion = sum(len(t.get("completion_token_ids") or []) for t in turns)
    counts = Counts(total=len(records), done=len(records), prompt_tokens=prompt, completion_tokens=completion,
                    tokens=completion, bytes=answers.size)
    at = now_iso()
    store.put_json(layout.generate_shard_manifest(index), ShardManifest(
        run=layout.run, stage=PIPELINE[0].name, shard=index, object=answers.key, sha256=answers.sha256, bytes=answers.size,
        counts=counts, skip_reasons={}, failure_errors={}, started_at=at, finished_at=at,
        worker=f"published answers ({where})").model_dump())
    return ShardPlan(index=index, row_start=records[0]["row"], row_end=records[-1]["row"] + 1, input_key=inputs.key,
                     input_sha256=inputs.sha256)
