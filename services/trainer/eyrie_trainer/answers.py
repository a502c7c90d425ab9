"""`eyrie publish --with-answers` (issue 43, item 4): the run's generated answers as a hub dataset, so that training a
drafter for the same target elsewhere can start at extraction. One parquet file per finished generate shard under
data/ (a row per answered sample: its messages, the answer, the exact token ids the target was given and gave,
every turn of a conversation, and which row and shard it came from), the run's provenance (eyrie-answers.json:
target and revision, chat template, prompt dataset, sampling, the shards) and a dataset card naming the prompt
source's license and the target's, whose terms may reach its outputs."""

from __future__ import annotations

import re
from pathlib import Path

import orjson
import pyarrow as pa
import pyarrow.parquet as pq
from huggingface_hub import DatasetCard, DatasetCardData

from eyrie.data.manifest import Layout, RunManifest, ShardManifest
from eyrie_trainer.card import License, dataset_license, redact

ANSWERS = "answers"  # the dataset's directory beside the drafter's files in `--to DIR`
PROVENANCE = "eyrie-answers.json"
# hub license ids a prompt source's license text may name (README tables name them in words: "MIT + Apache-2.0")
HUB_LICENSES = ("apache-2.0", "mit", "cc0-1.0", "cc-by-4.0", "cc-by-sa-4.0", "cc-by-nc-4.0", "cc-by-nc-sa-4.0",
                "bsd-2-clause", "bsd-3-clause", "gpl-3.0", "lgpl-3.0", "odc-by", "odbl", "cdla-permissive-2.0")
SCHEMA = pa.schema([("sample_id", pa.string()), ("row", pa.int64()), ("shard", pa.int32()),
                    ("messages", pa.string()), ("reasoning", pa.string()), ("content", pa.string()),
                    ("finish_reason", pa.string()), ("prompt_token_ids", pa.list_(pa.int32())),
                    ("completion_token_ids", pa.list_(pa.int32())), ("turns", pa.string())])
JSON_COLUMNS = ("messages", "turns")  # kept as JSON text: their shape varies (message parts, per-turn fields)


def write_answers(store, manifest: RunManifest, dest: Path, check) -> dict:
    """The dataset into `dest`; `check(name, data)` sees every answer record's bytes before they are written (the
    parquet files are compressed: a secret in them would not be found there). Returns the provenance."""
    layout, shards = Layout(manifest.run), []
    (dest / "data").mkdir(parents=True, exist_ok=True)
    for plan in manifest.generate_shards:
        key = layout.generate_shard_manifest(plan.index)
        if not store.exists(key):
            continue
        shard = ShardManifest.model_validate(store.get_json(key))
        data = store.get_verified(shard.object, shard.sha256)
        check(f"{ANSWERS} of generate shard {plan.index}", data)
        rows = [_row(r, plan.index) for line in data.splitlines() if line.strip()
                if (r := orjson.loads(line))["status"] == "done"]
        name = f"data/train-{plan.index:05d}.parquet"
        pq.write_table(pa.Table.from_pylist(rows, schema=SCHEMA), dest / name)
        shards.append({"file": name, "shard": plan.index, "samples": len(rows), "answers_sha256": shard.sha256})
    provenance = _provenance(manifest, shards)
    (dest / PROVENANCE).write_bytes(orjson.dumps(provenance, option=orjson.OPT_INDENT_2 | orjson.OPT_SORT_KEYS))
    (dest / "README.md").write_bytes(dataset_card(manifest, provenance).content.encode())
    return provenance


def _row(record: dict, shard: int) -> dict:
    row = {name: record.get(name) for name in SCHEMA.names}
    row.update(shard=shard, **{name: orjson.dumps(record[name]).decode() if record.get(name) is not None else None
                               for name in JSON_COLUMNS})
    return row


def _provenance(manifest: RunManifest, shards: list[dict]) -> dict:
    """What a run starting from these answers checks (the same target, revision and chat template) and names."""
    target = manifest.target.model_dump()
    dataset = {**manifest.dataset.model_dump(), "source": redact(manifest.dataset.source)}
    return {"run": manifest.run, "code_version": manifest.code_version, "target": target, "dataset": dataset,
            "generate": manifest.generate.model_dump(), "shards": shards,
            "samples": sum(s["samples"] for s in shards), "shards_planned": len(manifest.generate_shards)}


def hub_license_ids(stated: License) -> list[str]:
    """The hub license ids a license as read names: its own id, or those its words name; none known: unknown."""
    if re.fullmatch(r"[a-z0-9][a-z0-9.+-]*", stated.id):
        return [stated.id]
    named = [i for i in HUB_LICENSES if re.search(rf"(?<![\w-]){re.escape(i)}(?![\w-])", stated.id, re.I)]
    return named or ["unknown"]


def dataset_card(manifest: RunManifest, provenance: dict) -> DatasetCard:
    stated, target = dataset_license(manifest.dataset), manifest.target
    n = provenance["samples"]
    data = DatasetCardData(
        license=hub_license_ids(stated), task_categories=["text-generation"],
        tags=["eyrie", "speculative-decoding", "eagle3", "synthetic"],
        source_datasets=[manifest.dataset.source] if manifest.dataset.kind == "hf" else None,
        size_categories=["n<1K" if n < 1000 else "1K<n<10K" if n < 10_000 else "10K<n<100K" if n < 100_000 else "n>100K"],
        pretty_name=f"Answers of {Path(target.model).name} (eyrie run {manifest.run})",
        configs=[{"config_name": "default", "data_files": [{"split": "train", "path": "data/*.parquet"}]}])
    s = manifest.generate.sampling
    body = [f"# Answers of `{target.model}` (eyrie run `{manifest.run}`)", "",
            f"{n} prompts answered by the target (revision `{target.revision}`, chat template sha256 "
            f"`{target.chat_template_sha256}`), regenerated by eyrie to train EAGLE-3 drafters for it: max_tokens "
            f"{s.max_tokens}, temperature {s.temperature}, top_p {s.top_p}, turns {manifest.generate.turns}. "
            f"{len(provenance['shards'])} of {provenance['shards_planned']} generate shards.", "",
            "## Licenses", "",
            f"- prompts: `{redact(manifest.dataset.source)}` (revision `{manifest.dataset.revision}`, rows "
            f"{manifest.dataset.row_start}-{manifest.dataset.row_end}): {stated.id}, read from {stated.where}.",
            "- answers: the target's outputs; its license's terms on outputs may apply (see its card).", "",
            "## Columns", "",
            "`sample_id`, `row` (the prompt dataset's row), `shard`; `messages` (JSON: the conversation asked, "
            "the target's own earlier answers in it); `reasoning`, `content`, `finish_reason` of the last answer; "
            "`prompt_token_ids` and `completion_token_ids`: the exact tokens the target was given and gave; "
            "`turns` (JSON, a conversation with every turn answered: each answer).", "",
            f"`{PROVENANCE}` holds the run's target, prompt dataset and sampling as its manifest records them: "
            "a run that starts from these answers checks the target and its revision against it."]
    return DatasetCard(f"---\n{data.to_yaml()}\n---\n\n" + "\n".join(body) + "\n")
