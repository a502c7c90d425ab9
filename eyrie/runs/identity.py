"""Whether a run config names the inputs a planned run was made of: by content, never by path. The
same target and dataset at another path (another machine, a clone elsewhere) are the same run, and
the run's manifest is told where they lie now; weights changed in place at the same path are not."""

from __future__ import annotations

from pathlib import Path

from eyrie.core.errors import EyrieError
from eyrie.core.target import describe
from eyrie.data import dataset
from eyrie.data.manifest import Layout, RunManifest


def differing_inputs(kept, config, manifest: RunManifest, sections: list[str]) -> list[str]:
    """Of `sections` (planned sections whose values differ between the kept config and `config`), those
    that differ in more than where the target or the dataset lies."""
    return [name for name in sections if not (name in SAME_CONTENT and SAME_CONTENT[name](kept, config, manifest))]


def _same_target(kept, config, manifest: RunManifest) -> bool:
    if kept.target.model_copy(update={"model": config.target.model}) != config.target:
        return False  # more than the path differs (the shape, the hub id)
    same = compare_target(manifest, config.target.model)[0]
    return same if same is not None else same_place(kept.target.model, config.target.model)


def _same_dataset(kept, config, manifest: RunManifest) -> bool:
    if kept.dataset.model_copy(update={"source": config.dataset.source}) != config.dataset:
        return False
    ref, source = manifest.dataset, config.dataset
    try:
        here = dataset.resolve(source.source, source.split, source.revision, source.limit)
    except EyrieError:  # not here (an API host without the data): where it lies, as the kept config names it
        return same_place(kept.dataset.source, source.source)
    return (here.revision, here.row_start, here.row_end) == (ref.revision, ref.row_start, ref.row_end)


def same_place(kept: str, given: str) -> bool:
    """Where this host cannot read an input (the API's image holds no model or data): a relative path given is
    the kept absolute one named from the directory the run's services work in (`assets/x` and
    `/opt/eyrie/assets/x`), else nothing this host can tell is the same."""
    given_path, kept_path = Path(given), Path(kept)
    if given_path.is_absolute() or given_path.exists() or not kept_path.is_absolute():
        return False
    return kept_path.parts[-len(given_path.parts):] == given_path.parts


def located(kept, config):
    """`config` with the kept config's absolute paths where it names the same place by a relative path this
    host cannot see (same_place): the stored config keeps naming where the inputs lie."""
    update = {}
    if same_place(kept.target.model, config.target.model):
        update["target"] = config.target.model_copy(update={"model": kept.target.model})
    if same_place(kept.dataset.source, config.dataset.source):
        update["dataset"] = config.dataset.model_copy(update={"source": kept.dataset.source})
    return config.model_copy(update=update) if update else config


SAME_CONTENT = {"target": _same_target, "dataset": _same_dataset}


def compare_target(manifest: RunManifest, model: str) -> tuple[bool | None, str]:
    """Whether `model`, as this host reads it, has the content and chat template the run was planned
    with: None where this host cannot tell (a directory it lacks, a hub id unresolved offline, or
    identities of two kinds: a local content hash against a hub commit); and a line naming both."""
    recorded = manifest.target
    if _kind(recorded.revision) and not Path(model).is_dir():  # a directory's content, and none here to read
        return None, f"the target {model} is not a directory on this host"
    here = describe(model)
    line = f"the target at {model} is {_identity(here)}; run {manifest.run} was made with {_identity(recorded)}"
    if "unresolved" in (here.revision, recorded.revision) or _kind(here.revision) != _kind(recorded.revision):
        return None, line
    return (here.revision, here.chat_template_sha256) == (recorded.revision, recorded.chat_template_sha256), line


def _kind(revision: str) -> bool:
    return revision.startswith("sha256:")


def _identity(target) -> str:
    return f"revision {target.revision[:23]}, chat template {(target.chat_template_sha256 or 'none')[:12]}"


def refuse_other_target(manifest: RunManifest, model: str) -> None:
    """A planned run continues only on the target it was made with (the weights read by content);
    where this host cannot tell, the host that loads it is trusted to have it."""
    same, line = compare_target(manifest, model)
    if same is False:
        raise EyrieError(f"{line}: its answers and hidden states belong to those weights.",
                         f"give run {manifest.run} the target it was made with, or start a new run (another "
                         "run name) on this one.")


def relocate(store, manifest: RunManifest, config) -> None:
    """The run's manifest told where its target and dataset lie now (the same content, checked): the
    stages after it read them there."""
    moved = {}
    if manifest.target.model != config.target.model:
        moved["target"] = manifest.target.model_copy(update={"model": config.target.model})
    if manifest.dataset.source != config.dataset.source:
        moved["dataset"] = manifest.dataset.model_copy(update={"source": config.dataset.source})
    if moved:
        store.put_json(Layout(manifest.run).manifest, manifest.model_copy(update=moved).model_dump())
