"""`eyrie publish --with-answers` (issue 43, item 4): the run's generated answers as a hub dataset (parquet, one row
per answered sample with its token ids and provenance, a dataset card naming the prompt source's license), in
`--to DIR`/answers and in the dataset repository of the model repository's name. The run is test_publish's
finished run; the hub is tests/support/hub_stub.py, a local stand-in for huggingface.co (not reachable from here)."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from huggingface_hub import DatasetCard

from eyrie.data.manifest import load_run_manifest
from eyrie_trainer.publish import files, publish
from tests.support.harness import eyrie
from tests.support.hub_stub import metadata_errors, running
from tests.unit.test_publish import ANSWERED, REPO, RUN, TOKEN, finished_run, hub_env, no_secrets

DATA_FILES = ["README.md", "data/train-00000.parquet", "eyrie-answers.json"]


def test_with_answers_the_runs_answers_are_a_dataset_with_token_ids_provenance_and_licenses(tmp_path):
    store = finished_run(tmp_path)
    out, manifest = tmp_path / "published", load_run_manifest(store, RUN)
    publish(store, RUN, to=out, with_answers=True)
    answers = out / "answers"
    assert files(answers) == DATA_FILES
    rows = pq.read_table(answers / "data" / "train-00000.parquet").to_pylist()
    assert len(rows) == len(ANSWERED)  # one row per answered sample (the skipped one is not an answer)
    for row, record in zip(rows, ANSWERED):
        assert {k: row[k] for k in ("sample_id", "row", "content", "reasoning", "finish_reason", "prompt_token_ids",
                                    "completion_token_ids")} == {k: record[k] for k in row if k in record and
                                                                 k not in ("messages", "turns")}
        assert json.loads(row["messages"]) == record["messages"] and row["shard"] == 0
        assert (json.loads(row["turns"]) if row["turns"] else None) == record.get("turns")
    provenance = json.loads((answers / "eyrie-answers.json").read_text())
    # the target as a user elsewhere names it (its public name), its identity as recorded
    assert provenance["target"] == {**manifest.target.model_dump(), "model": manifest.target.public_name(),
                                    "hub_id": manifest.target.public_hub_id()} and provenance["samples"] == 3
    assert provenance["dataset"]["revision"] == manifest.dataset.revision
    assert provenance["generate"] == manifest.generate.model_dump()
    card = DatasetCard.load(answers / "README.md")
    assert card.data.license == ["apache-2.0", "mit"] and "MIT + Apache-2.0 (as its parts)" in card.text
    assert metadata_errors(card.content) == []
    assert publish(store, RUN, to=out, with_answers=True)["to"]["changed"] == []
    assert publish(store, RUN, to=out)["to"]["changed"] == []  # the answers stay: eyrie's files, not the user's


def test_the_answers_load_as_a_hub_dataset_by_the_layout_their_card_states(tmp_path):
    """`datasets` reads the directory as the hub would show it: the card's `configs` name the parquet files."""
    import datasets

    store = finished_run(tmp_path)
    publish(store, RUN, to=tmp_path / "published", with_answers=True)
    loaded = datasets.load_dataset(str(tmp_path / "published" / "answers"), split="train",
                                   cache_dir=str(tmp_path / "hf-cache"))
    assert loaded.num_rows == len(ANSWERED)
    assert loaded["completion_token_ids"] == [r["completion_token_ids"] for r in ANSWERED]


@pytest.mark.integration
def test_the_dataset_repository_holds_what_to_dir_answers_holds_and_downloads_the_same(tmp_path, monkeypatch):
    from huggingface_hub import constants, snapshot_download

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)  # this process is offline (conftest): not for the stub

    store = finished_run(tmp_path)
    out = tmp_path / "published"
    with running(TOKEN) as (url, hub):
        env = hub_env(tmp_path, url)
        said = eyrie("publish", "--run", RUN, "--repo", REPO, "--to", str(out), "--with-answers", env=env).stdout
        assert f"dataset {REPO}: commit" in said and f"{url}/datasets/{REPO}/commit/" in said
        [answers] = hub.commits(REPO, "dataset")
        assert answers["changed"] == {n: (out / "answers" / n).read_bytes() for n in DATA_FILES}
        assert hub.repos["dataset", REPO]["private"] and f"run {RUN}" in answers["message"]
        no_secrets(answers["changed"])
        model_card = hub.files(REPO)["README.md"].decode()
        assert f"the dataset `{REPO}`" in model_card and not any(n.startswith("answers/") for n in hub.files(REPO))
        fetched = snapshot_download(REPO, repo_type="dataset", endpoint=url, token=TOKEN,
                                    cache_dir=str(tmp_path / "hf-cache"))
        assert {n: (out / "answers" / n).read_bytes() for n in DATA_FILES} == {
            n: Path(fetched, n).read_bytes() for n in DATA_FILES}
        again = eyrie("publish", "--run", RUN, "--repo", REPO, "--with-answers", env=env).stdout
        assert again.count("no commit") == 2 and len(hub.commits(REPO, "dataset")) == 1
