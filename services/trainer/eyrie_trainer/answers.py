"""`eyrie publish --with-answers` (issue 43, item 4): the run's generated answers as a hub dataset (its layout:
eyrie.data.answers_set), so that training a drafter for the same target elsewhere starts at extraction (item 6).
One parquet file per finished generate shard under data/, the run's provenance (eyrie-answers.json: target and
revision, chat template, prompt dataset and its license, sampling, the shards) and a dataset card naming the prompt
source's license and the target's, whose terms may reach its outputs."""

from __future__ import annotations

import re
from pathlib import Path

import orjson
import pyarrow as pa
import pyarrow.parquet as pq
from huggingface_hub import DatasetCard, DatasetCardData

from eyrie.data.answers_set import ANSWERS, PROVENANCE, schema, to_row
from eyrie.data.manifest import Layout, RunManifest, ShardManifest
from eyrie_trainer.card import License, prompts_license, redact

# hub license ids a prompt source's license text may name (README tables name them in words: "MIT + Apache-2.0")
HUB_LICENSES = ("apache-2.0", "mit", "cc0-1.0", "cc-by-4.0", "cc-by-sa-4.0", "cc-by-nc-4.0", "cc-by-nc-sa-4.0",
                "bsd-2-clause", "bsd-3-clause", "gpl-3.0", "lgpl-3.0", "odc-by", "odbl", "cdla-permissive-2.0")


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
        rows = [to_row(r, plan.index) for line in data.splitlines() if line.strip()
                if (r := orjson.loads(line))["status"] == "done"]
        name = f"data/train-{plan.index:05d}.parquet"
        pq.write_table(pa.Table.from_pylist(rows, schema=schema()), dest / name)
        shards.append({"file": name, "shard": plan.index, "samples": len(rows), "answers_sha256": shard.sha256})
    license = prompts_license(manifest)
    provenance = _provenance(manifest, shards, license)
    (dest / PROVENANCE).write_bytes(orjson.dumps(provenance, option=orjson.OPT_INDENT_2 | orjson.OPT_SORT_KEYS))
    (dest / "README.md").write_bytes(dataset_card(manifest, provenance, license).content.encode())
    return provenance


def _provenance(manifest: RunManifest, shards: list[dict], license: License) -> dict:
    """What a run starting from these answers checks (the same target, revision and chat template) and keeps."""
    # named as a user elsewhere names it, never by the making host's path (checked by content where used)
    target = {**manifest.target.model_dump(), "model": manifest.target.public_name(),
              "hub_id": manifest.target.public_hub_id()}
    dataset = {**manifest.dataset.model_dump(), "source": redact(manifest.dataset.source)}
    return {"run": manifest.run, "code_version": manifest.code_version, "target": target, "dataset": dataset,
            "dataset_license": {"id": license.id, "where": license.where},
            "generate": manifest.generate.model_dump(), "shards": shards,
            "samples": sum(s["samples"] for s in shards), "shards_planned": len(manifest.generate_shards)}


def hub_license_ids(stated: License) -> list[str]:
    """The hub license ids a license as read names: its own id, or those its words name; none known: unknown."""
    if re.fullmatch(r"[a-z0-9][a-z0-9.+-]*", stated.id):
        return [stated.id]
    named = [i for i in HUB_LICENSES if re.search(rf"(?<![\w-]){re.escape(i)}(?![\w-])", stated.id, re.I)]
    return named or ["unknown"]


def dataset_card(manifest: RunManifest, provenance: dict, stated: License) -> DatasetCard:
    target = manifest.target
    n = provenance["samples"]
    data = DatasetCardData(
        license=hub_license_ids(stated), task_categories=["text-generation"],
        tags=["eyrie", "speculative-decoding", "eagle3", "synthetic"],
        source_datasets=[manifest.dataset.source] if manifest.dataset.kind == "hf" else None,
        size_categories=["n<1K" if n < 1000 else "1K<n<10K" if n < 10_000 else "10K<n<100K" if n < 100_000 else "n>100K"],
        pretty_name=f"Answers of {target.public_name()} (eyrie run {manifest.run})",
        configs=[{"config_name": "default", "data_files": [{"split": "train", "path": "data/*.parquet"}]}])
    s = manifest.generate.sampling
    body = [f"# Answers of `{target.public_name()}` (eyrie run `{manifest.run}`)", "",
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
