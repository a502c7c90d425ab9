"""Every sample of a run accounted for, from the store alone: per stage, how many came in and how
many are done, skipped, failed, duplicated, lost, or still pending (the fault suite's figures)."""

from __future__ import annotations

from collections import Counter

import orjson
from pydantic import BaseModel

from eyrie.data.manifest import Layout, RunManifest, ShardManifest, load_run_manifest
from eyrie.stages.extract import Extract
from eyrie.stages.generate import Generate
from eyrie.stages.train import Train


class Figure(BaseModel):
    stage: str
    samples_in: int = 0
    done: int = 0
    skipped: int = 0
    failed: int = 0
    duplicated: int = 0
    lost: int = 0
    pending: int = 0
    note: str | None = None  # a figure not counted from the store's record of it: how it was counted

    def add(self, ids_in: list[str], entries: list[dict]) -> None:
        """One finished shard: what came in, and the entries it recorded (sample_id, status)."""
        seen = Counter(e["sample_id"] for e in entries)
        wanted = set(ids_in)
        self.samples_in += len(ids_in)
        self.duplicated += sum(n - 1 for n in seen.values()) + sum(1 for i in seen if i not in wanted)
        self.lost += len(wanted - set(seen))
        statuses = Counter({e["sample_id"]: e["status"] for e in entries if e["sample_id"] in wanted}.values())
        self.done, self.skipped, self.failed = (self.done + statuses["done"], self.skipped + statuses["skipped"],
                                                self.failed + statuses["failed"])


def audit(store, run: str) -> list[Figure]:
    manifest, layout = load_run_manifest(store, run), Layout(run)
    generate, records = _generate(store, manifest, layout)
    figures = [generate]
    if manifest.extract:
        extract, extracted = _extract(store, manifest, layout, records)
        figures.append(extract)
        if manifest.train:
            read = store.get_json(layout.train_samples) if store.exists(layout.train_samples) else None
            figures.append(_train(manifest, extracted, read))
    return figures


def _jsonl(data: bytes) -> list[dict]:
    return [orjson.loads(line) for line in data.splitlines() if line.strip()]


def _generate(store, manifest: RunManifest, layout: Layout) -> tuple[Figure, dict[int, list[dict]]]:
    figure, records = Figure(stage=Generate.name), {}
    for plan in manifest.generate_shards:
        ids_in = [r["sample_id"] for r in _jsonl(store.get_verified(plan.input_key, plan.input_sha256))]
        if not store.exists(layout.generate_shard_manifest(plan.index)):
            figure.samples_in, figure.pending = figure.samples_in + len(ids_in), figure.pending + len(ids_in)
            continue
        shard = ShardManifest.model_validate(store.get_json(layout.generate_shard_manifest(plan.index)))
        records[plan.index] = _jsonl(store.get_verified(shard.object, shard.sha256))
        figure.add(ids_in, records[plan.index])
    return figure, records


def _extract(store, manifest: RunManifest, layout: Layout,
             records: dict[int, list[dict]]) -> tuple[Figure, list[str]]:
    figure, extracted = Figure(stage=Extract.name), []
    stored = set(store.list(layout.extract_shards))
    if manifest.states_from:  # a run on an earlier run's states: its samples are that run's objects
        stored |= set(store.list(Layout(manifest.states_from).extract_shards))
    for plan in manifest.generate_shards:
        ids_in = [r["sample_id"] for r in records.get(plan.index, []) if r["status"] == "done"]
        key = layout.extract_shard_manifest(plan.index)
        if plan.index not in records or not store.exists(key):
            figure.samples_in, figure.pending = figure.samples_in + len(ids_in), figure.pending + len(ids_in)
            continue
        shard = ShardManifest.model_validate(store.get_json(key))
        present = [s for s in shard.samples if s["key"] in stored]  # a done sample whose object is gone: lost
        figure.add(ids_in, [{**s, "status": "done"} for s in present] + shard.not_done)
        extracted += [s["sample_id"] for s in present]
    return figure, extracted


def _train(manifest: RunManifest, extracted: list[str], read: dict | None) -> Figure:
    """Every extracted sample trained on or held out, once, as the trainer recorded what it read
    (train/samples.json: eyrie_trainer.ledger): done = trained on + held out (once the drafter is
    evaluated), failed = left out by speculators (the reasons are in the record), lost = the rest.
    Without that record (a run trained before it existed, or the object gone) it is counted from
    the plan, and says so: a sample speculators left out is then counted as done."""
    unique = len(set(extracted))
    if read is None:
        p = manifest.train
        used = p.train_samples + p.heldout_samples
        return Figure(stage=Train.name, samples_in=unique, done=min(used, unique) if manifest.drafter else 0,
                      pending=0 if manifest.drafter else unique, duplicated=len(extracted) - unique,
                      lost=max(0, unique - used),
                      note=f"counted from the plan: {Layout(manifest.run).train_samples} (what the trainer read) "
                           "is not in the store, so samples it left out count as done")
    if not manifest.drafter:
        return Figure(stage=Train.name, samples_in=unique, pending=unique, duplicated=len(extracted) - unique)
    done, failed = len(read["read_rows"]) + read["heldout_samples"], len(read["dropped"])
    return Figure(stage=Train.name, samples_in=unique, done=done, failed=failed,
                  duplicated=len(extracted) - unique, lost=max(0, unique - done - failed))


def render(figures: list[Figure]) -> list[str]:
    """The figures as `eyrie audit` prints them: a table, then what a figure's count rests on."""
    lines = [f"{'stage':<9}{'in':>8}{'done':>8}{'skipped':>9}{'failed':>8}{'dup':>6}{'lost':>6}{'pending':>9}"]
    lines += [f"{f.stage:<9}{f.samples_in:>8}{f.done:>8}{f.skipped:>9}{f.failed:>8}{f.duplicated:>6}{f.lost:>6}"
              f"{f.pending:>9}" for f in figures]
    return lines + [f"{f.stage}: {f.note}" for f in figures if f.note]


def clean(figures: list[Figure]) -> bool:
    return all(f.lost == 0 and f.duplicated == 0 for f in figures)
