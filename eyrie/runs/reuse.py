"""Train on the states a run already has (issue 28 item 2): a new run whose target, dataset, generate
and extract settings equal an earlier run's trains on that run's generated answers and hidden
states, with its own train settings; nothing is generated or extracted again, nothing copied.

Once a pipeline's states are complete, `advance` records them under their fingerprint
(`states/SETTINGS/TARGET/DATASET_REVISION.json`: the settings that make them, the target's identity
as its run manifest recorded it (eyrie.core.target.describe: a local directory's content hash, a hub
id's commit, and its chat template), then the dataset's content hash or hub commit). A new run that
finds its own fingerprint there gets a run manifest and shard manifests of its own (small JSON)
that refer to the earlier run's objects, and `states_from` naming it; the earlier run records it
as a user (eyrie.data.shared_states), so the store refuses to delete those objects while it needs
them. Its training then reads them through the same data path
(stored states, and in hybrid and online the extraction service for the rest)."""

from __future__ import annotations

import hashlib

import orjson

from eyrie.core.errors import EyrieError, UnknownRun
from eyrie.core.provenance import RUN_CONFIG, as_used, values
from eyrie.core.stage_settings import pacing_fields
from eyrie.core.target import describe
from eyrie.data import dataset
from eyrie.data.manifest import Layout, RunManifest, code_version, load_run_manifest, now_iso, states_index
from eyrie.data.shared_states import add_user
from eyrie.stages import PIPELINE
from eyrie.stages.generate import Generate

# how the target is served that changes its answers (--dtype, --quantization, ... in extra_args)
SERVE_ANSWERS = ("reasoning_parser", "max_model_len", "extra_args")


def settings_fingerprint(config, generate_used: dict) -> str:
    """The settings that make a run's answers and states, as used (`generate_used`: the generate
    settings as the generator's planner resolved them, its host's EYRIE_<FIELD> defaults included;
    eyrie.core.provenance), less the fields marked PACING (how fast the answers were fetched, not
    what they are). Paths are no part of it: the target's and the dataset's contents are keyed
    apart (target_identity, the dataset's revision and rows)."""
    what = {"serve": {field: getattr(config.serve, field) for field in SERVE_ANSWERS}}
    for name in states_sections():  # the dataset, generate and extract sections
        section = getattr(config, name)
        keep = set(type(section).model_fields) - pacing_fields(type(section)) - {"source"}
        used = values(generate_used) if name == Generate.own_section() else {field: getattr(section, field) for field in keep}
        what[name] = {field: used[field] for field in sorted(keep)}
    return hashlib.sha256(orjson.dumps(what, option=orjson.OPT_SORT_KEYS)).hexdigest()[:32]


def generate_used(manifest: RunManifest) -> dict:
    """A planned run's generate settings as used: as its planner recorded them, or (a manifest
    from before that record) as its plan holds them."""
    if Generate.own_section() in manifest.settings:
        return manifest.settings[Generate.own_section()]
    params = manifest.generate
    return {name: {"value": value, "source": "plan"} for name, value in
            {**params.model_dump(exclude={"sampling"}), **params.sampling.model_dump(),
             "prompt_tokens_estimate": None}.items()}


def target_identity(target) -> str | None:
    """Which weights and chat template answered (a manifest's target, or describe()'s): a local
    directory's content hash or a hub id's commit, with its template's sha256. None where that is
    not known (a hub id unresolved offline, a directory this host lacks): no states are shared then."""
    if not target.revision or target.revision == "unresolved":
        return None
    what = {"revision": target.revision, "chat_template_sha256": target.chat_template_sha256}
    return hashlib.sha256(orjson.dumps(what, option=orjson.OPT_SORT_KEYS)).hexdigest()[:32]


def index_key(config, used: dict, target, dataset_revision: str) -> str | None:
    identity = target_identity(target)
    return None if identity is None else states_index(f"{settings_fingerprint(config, used)}/{identity}",
                                                      dataset_revision)


def record_states(view) -> None:
    """A pipeline whose states are complete (advance, once the stage that makes them is done):
    findable by its settings as used and its target as its manifest recorded it (nothing hashed
    again). A run on another's states records nothing: that one is found; nor does one whose config
    did not run every stage that made them (its config may not say how the earlier ones ran)."""
    manifest = view.manifest
    if view.config is None or manifest is None or manifest.states_from or not _made_here(view.config):
        return
    key = index_key(view.config, generate_used(manifest), manifest.target, manifest.dataset.revision)
    if key is not None and not view.store.exists(key):
        view.store.put_json(key, {"run": view.run, "dataset": manifest.dataset.model_dump(), "recorded_at": now_iso()})


def _made_here(config) -> bool:
    last = next(i for i, stage in enumerate(PIPELINE) if stage.makes_states)
    return config.stages is None or {stage.name for stage in PIPELINE[:last + 1]} <= set(config.stages)


def goes_on_to_train(config) -> bool:
    """A run that would make its states and go on past them: one that may train on an earlier run's."""
    last = next(i for i, stage in enumerate(PIPELINE) if stage.makes_states)
    return _made_here(config) and (config.stages is None or bool(set(config.stages) - {s.name for s in PIPELINE[:last + 1]}))


def states_to_reuse(store, config, used: dict | None = None) -> RunManifest | None:
    """For a run not planned yet: the manifest of the earlier run whose answers and states it can
    train on (the same settings as used, the same target content and template, the same dataset
    content and rows, every shard extracted), else None. `used`: its generate settings as resolved
    where they apply (the generator's planner; eyrie.core.provenance.as_used), else as the config
    gives them over the code's defaults. The target is described and the dataset read (hashed) only
    where some run has these settings; a target changed since (a directory updated in place, a hub
    id at a new commit) or not identifiable here shares nothing: the new run generates."""
    if store.exists(Layout(config.run).manifest):
        return None
    used = used if used is not None else as_used(config.generate, RUN_CONFIG)
    fingerprint = settings_fingerprint(config, used)
    if not store.list(states_index(fingerprint)):
        return None
    source = config.dataset
    ref = dataset.resolve(source.source, source.split, source.revision, source.limit)
    key = index_key(config, used, describe(config.target.model), ref.revision)
    if key is None or not store.exists(key):
        return None
    try:
        found = load_run_manifest(store, store.get_json(key)["run"])
    except UnknownRun:
        return None
    same_rows = (found.dataset.revision, found.dataset.row_start, found.dataset.row_end) == (
        ref.revision, ref.row_start, ref.row_end)
    return found if same_rows and extracted(store, found) else None


def extracted(store, manifest: RunManifest) -> bool:
    layout = Layout(manifest.run)
    return manifest.extract is not None and all(
        store.exists(layout.extract_shard_manifest(p.index)) for p in manifest.generate_shards)


def owner_of(store, manifest: RunManifest) -> RunManifest:
    """The run that holds the objects (a run on another's states points at that one)."""
    return load_run_manifest(store, manifest.states_from) if manifest.states_from else manifest


def train_on_states(store, source: RunManifest, run: str) -> RunManifest:
    """Run `run` made a run on `source`'s answers and states: its shard manifests (copies of the
    owner's, which name the owner's objects) and its run manifest (written last: the run is then
    planned up to train). The owner records it first, so the guard holds before anything refers."""
    owner = owner_of(store, source)
    _refuse_unextracted(store, owner, run)
    add_user(store, owner.run, run)
    mine, theirs = Layout(run), Layout(owner.run)
    for plan in owner.generate_shards:
        for shard_manifest in (Layout.generate_shard_manifest, Layout.extract_shard_manifest):
            store.put_json(shard_manifest(mine, plan.index),
                           {**store.get_json(shard_manifest(theirs, plan.index)), "run": run})
    manifest = RunManifest(run=run, created_at=now_iso(), code_version=code_version(), states_from=owner.run,
                           **{name: getattr(owner, name) for name in _states_fields()})
    store.put_json(mine.manifest, manifest.model_dump())
    return manifest


def states_sections() -> tuple[str, ...]:
    """The run config's sections (and run manifest's records) of the stages up to the one that
    makes the states: dataset, generate, extract."""
    last = next(i for i, stage in enumerate(PIPELINE) if stage.makes_states)
    return tuple(name for stage in PIPELINE[:last + 1] for name in stage.sections)


def _states_fields() -> tuple[str, ...]:
    """What a run on another's states takes of its manifest: what its answers and states are."""
    return ("target", "generate_shards", "input_skips", *states_sections())


def _refuse_unextracted(store, owner: RunManifest, run: str) -> None:
    if not extracted(store, owner):
        raise EyrieError(f"run {owner.run}: its hidden states are not all extracted.",
                         f"wait for its extract stage (`eyrie status {owner.run}`), then start {run} again.")


def check_train_as(store, source: RunManifest, run: str) -> None:
    """`eyrie train --run A --as B`, refused before anything is written: A's states not complete,
    or B a run of its own (not one on A's states)."""
    _refuse_unextracted(store, owner_of(store, source), run)
    if store.exists(Layout(run).manifest):
        existing = load_run_manifest(store, run)
        if existing.states_from != owner_of(store, source).run:
            raise EyrieError(f"run {run} exists already, with states of its own"
                             + (f" (run {existing.states_from}'s)" if existing.states_from else "") + ".",
                             f"name a new run: `eyrie train --run {source.run} --as NEW_RUN ...`.")
