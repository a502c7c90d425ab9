"""A published answers set (issue 43: `eyrie publish --with-answers` writes one, item 4; a run starts from one at
extraction, item 6): data/*.parquet, one row per answered sample (its messages, the answer, the exact token ids
the target was given and gave, every turn of a conversation, the row and shard it came from); eyrie-answers.json,
the provenance (target and revision, chat template, prompt dataset and its license, sampling, the shards); README.md,
its dataset card. Found where a run config's dataset names it: a directory (the set, or the `--to DIR` holding it
under answers/) or a dataset on the hub."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

import orjson

from eyrie.core.errors import EyrieError
from eyrie.data.dataset import looks_like_path

ANSWERS = "answers"  # the set's directory beside the drafter's files in `eyrie publish --to DIR`
PROVENANCE = "eyrie-answers.json"
JSON_COLUMNS = ("messages", "turns")  # kept as JSON text: their shape varies (message parts, per-turn fields)
COLUMNS = ("sample_id", "row", "shard", "messages", "reasoning", "content", "finish_reason", "prompt_token_ids",
           "completion_token_ids", "turns")


def schema():
    import pyarrow as pa

    types = {"row": pa.int64(), "shard": pa.int32(), "prompt_token_ids": pa.list_(pa.int32()),
             "completion_token_ids": pa.list_(pa.int32())}
    return pa.schema([(name, types.get(name, pa.string())) for name in COLUMNS])


def to_row(record: dict, shard: int) -> dict:
    """A generate record (status done) as the set's row."""
    row = {name: record.get(name) for name in COLUMNS}
    row.update(shard=shard, **{name: orjson.dumps(record[name]).decode() if record.get(name) is not None else None
                               for name in JSON_COLUMNS})
    return row


def to_record(row: dict) -> dict:
    """The set's row as the generate record extraction reads (eyrie_extractor.render): done, its answer and ids."""
    record = {name: row[name] for name in COLUMNS if name != "shard" and row.get(name) is not None}
    record.update({name: orjson.loads(row[name]) for name in JSON_COLUMNS if row.get(name) is not None})
    return {**record, "status": "done"}


@dataclass
class AnswersSet:
    path: Path  # a local directory holding the set (a hub dataset's download)
    where: str  # what the run records: the directory, or the hub dataset and its commit
    revision: str  # the hub commit, or the sha256 of the set's files
    provenance: dict

    def shards(self):
        """(the published shard's entry, its records), in order: the rows of data/ as generate records."""
        import pyarrow.parquet as pq

        for entry in self.provenance["shards"]:
            yield entry, [to_record(row) for row in pq.read_table(self.path / entry["file"]).to_pylist()]


def find(source: str, revision: str | None = None) -> AnswersSet | None:
    """The published answers set a run config's dataset names, else None (prompts, which the target answers)."""
    path = Path(source)
    if path.is_dir():
        folder = next((p for p in (path, path / ANSWERS) if (p / PROVENANCE).is_file()), None)
        return None if folder is None else AnswersSet(folder, f"directory {folder.resolve()}", files_sha256(folder),
                                                      provenance(folder))
    if path.exists() or looks_like_path(source):
        return None
    return _from_hub(source, revision)


def _from_hub(source: str, revision: str | None) -> AnswersSet | None:
    """A hub dataset holding eyrie-answers.json, downloaded (huggingface_hub's cache); a dataset without one, or a
    hub not reachable (offline): None, and the run reads the dataset as prompts as before."""
    import httpx
    from huggingface_hub import HfApi, snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, OfflineModeIsEnabled

    try:
        info = HfApi().dataset_info(source, revision=revision)
    except (HfHubHTTPError, OfflineModeIsEnabled, httpx.HTTPError, ValueError):
        return None
    if PROVENANCE not in {s.rfilename for s in info.siblings or []}:
        return None
    folder = Path(snapshot_download(source, repo_type="dataset", revision=info.sha))
    return AnswersSet(folder, f"hub dataset {source}@{info.sha}", info.sha, provenance(folder))


def provenance(folder: Path) -> dict:
    try:
        return orjson.loads((folder / PROVENANCE).read_bytes())
    except orjson.JSONDecodeError as exc:
        raise EyrieError(f"{folder / PROVENANCE} is not the JSON eyrie publish writes ({exc}).",
                         "publish the answers again (`eyrie publish --run RUN --with-answers`).") from None


def files_sha256(folder: Path) -> str:
    """The set's content: its provenance and data files, by name and bytes."""
    digest = hashlib.sha256()
    for path in [folder / PROVENANCE, *sorted((folder / "data").glob("*.parquet"))]:
        digest.update(path.name.encode() + hashlib.sha256(path.read_bytes()).digest())
    return digest.hexdigest()
