"""The exported drafter as vLLM serves it (issue 41's serving points): its config names its method and its
reduced draft vocabulary carries its mapping, whatever folder it is served from; every speculative config eyrie
builds names `eagle3`; draft sampling is probabilistic exactly where answers are sampled (temperature > 0).
The drafter is speculators' own Eagle3DraftModel, stored as a checkpoint and exported by eyrie's export."""

from __future__ import annotations

import ast
import json
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from eyrie.core.errors import EyrieError
from eyrie.core.target import load_tokenizer
from eyrie.core.vllm import eagle3_flags, eagle3_spec, serve_argv
from eyrie.data.manifest import Layout
from eyrie.data.store import FileStore
from eyrie_trainer import checkpoints, verify
from eyrie_trainer.export import download, export, vllm_command
from eyrie_trainer.verify_turns import chat_prompt_ids
from tests.support.builders import make_manifest
from tests.support.harness import ROOT, TINY
from tests.support.processes import free_port
from tests.support.vllm_real import SMALL, VLLM_PYTHON, start_vllm, stop_vllm, vllm_env

K, DRAFT_VOCAB, AUX = 3, 500, [2, 4, 5]
# The drafter the vLLM test serves maps its 500 draft ids onto the target's ids 264..763 (" is": in nearly every
# answer of the tiny target) and has a zero head: every draft is the lowest id it maps to, 264. Read without its
# mapping, draft id 0 would be the target's token 0 (<unk>), never accepted.
FIRST_MAPPED = 264


def mapping(ids: torch.Tensor, target_vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """speculators' d2t (target id = draft id + offset) and t2d (a mask over the target's ids) for `ids`."""
    t2d = torch.zeros(target_vocab, dtype=torch.bool)
    t2d[ids] = True
    return ids - torch.arange(len(ids)), t2d


def checkpoint(dest: Path, *, drop: tuple[str, ...] = (), zero_head: bool = False) -> list[Path]:
    """A one-layer EAGLE-3 drafter of the tiny target as speculators saves it (config.json, model.safetensors),
    its draft vocabulary the target's ids FIRST_MAPPED.. ; `drop`: weights left out, `zero_head`: drafts
    always the lowest mapped id."""
    from speculators.models.eagle3.core import Eagle3DraftModel
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(TINY)
    config.num_hidden_layers = 1
    d2t, t2d = mapping(torch.arange(FIRST_MAPPED, FIRST_MAPPED + DRAFT_VOCAB), config.vocab_size)
    torch.manual_seed(0)
    model = Eagle3DraftModel.from_training_args(config, t2d=t2d, d2t=d2t, verifier_name_or_path=str(TINY),
                                                target_layer_ids=AUX, draft_vocab_size=DRAFT_VOCAB,
                                                norm_before_residual=True, ttt_steps=K)
    model.save_pretrained(str(dest))
    weights = {k: v for k, v in load_file(dest / "model.safetensors").items() if k not in drop}
    if zero_head:
        weights["lm_head.weight"] = torch.zeros_like(weights["lm_head.weight"])
    save_file(weights, str(dest / "model.safetensors"))
    return [dest / "config.json", dest / "model.safetensors"]


def exported(tmp_path: Path, **saved) -> tuple[FileStore, Path]:
    """The checkpoint stored as run "r"'s only one, exported by eyrie (export) and fetched (`eyrie export`)."""
    store, layout = FileStore(tmp_path / "store"), Layout("r")
    store.put_json(layout.manifest, make_manifest("r", train={"ttt_steps": K}).model_dump())
    checkpoints.upload(store, layout, checkpoint(tmp_path / "ck" / "0", **saved), "0", 0, 0)
    best = {"label": "0", "tau": 1.0, "per_position_acceptance": [0.0] * K, "every_position": {"tau": 1.0}}
    export(store, "r", {"best": "0", "checkpoints": [best], "baseline": {"tau": 1.0}, "k": K}, {})
    out = tmp_path / "drafter"
    download(store, "r", out)
    return store, out


# --- unit: the speculative configs eyrie builds ------------------------------------------------------------

@pytest.mark.parametrize("temperature", [0, 0.0, 1e-6, 0.7, 1.0, 2])
def test_every_speculative_config_names_eagle3_and_samples_drafts_as_the_answers_are(temperature):
    spec = eagle3_spec("d/", K, temperature)
    assert spec["method"] == "eagle3" and spec["model"] == "d/" and spec["num_speculative_tokens"] == K
    assert spec.get("draft_sample_method") == ("probabilistic" if temperature > 0 else None)  # None: vLLM's greedy
    assert json.loads(eagle3_flags("d/", K, temperature)[1]) == spec


def test_verify_and_export_serve_the_drafter_as_eagle3_with_greedy_drafts_at_verifys_temperature_0():
    assert verify.TEMPERATURE == 0  # verify asks greedy answers: draft sampling stays vLLM's greedy default
    flags = verify.drafter_flags(Path("/x/my-eagle-3"), 5)
    assert flags[0] == "--speculative-config"
    assert json.loads(flags[1]) == {"method": "eagle3", "model": "/x/my-eagle-3", "num_speculative_tokens": 5}
    shown = vllm_command("T", "my-eagle-3/", 3)
    assert shown.startswith("vllm serve T --speculative-config '") and shown.endswith("'")
    assert json.loads(shown.split("'")[1]) == eagle3_spec("my-eagle-3/", 3)


def speculative_dicts(path: Path) -> list[tuple[int, set]]:
    """Every dict literal in a module with a `num_speculative_tokens` key: its line and its keys."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Dict):
            keys = {k.value for k in node.keys if isinstance(k, ast.Constant)}
            if "num_speculative_tokens" in keys:
                found.append((node.lineno, keys))
    return found


def test_every_speculative_config_in_the_code_names_its_method():
    """Wherever the code spells a speculative config out (not through eagle3_spec), it names `method`:
    without it vLLM guesses from the drafter's folder name."""
    sources = [p for top in ("eyrie", "services", "bench", "scripts") for p in sorted((ROOT / top).rglob("*.py"))]
    built = {f"{p.relative_to(ROOT)}:{line}": keys for p in sources for line, keys in speculative_dicts(p)}
    assert "eyrie/core/vllm.py" in " ".join(built)  # eagle3_spec is seen
    assert {where for where, keys in built.items() if "method" not in keys} == set()


# --- unit: what export writes -------------------------------------------------------------------------------

def test_the_export_names_eagle3_and_carries_its_vocabulary_mapping(tmp_path):
    _, out = exported(tmp_path)
    config = json.loads((out / "config.json").read_text())
    assert config["speculators_model_type"] == config["speculators_config"]["algorithm"] == "eagle3"
    assert config["draft_vocab_size"] == DRAFT_VOCAB < config["transformer_layer_config"]["vocab_size"]
    weights = load_file(out / "model.safetensors")
    d2t, t2d = mapping(torch.arange(FIRST_MAPPED, FIRST_MAPPED + DRAFT_VOCAB), len(weights["t2d"]))
    assert torch.equal(weights["d2t"], d2t) and torch.equal(weights["t2d"], t2d)


@pytest.mark.parametrize("drop", [("d2t",), ("t2d",), ("d2t", "t2d")])
def test_a_reduced_vocabulary_without_its_mapping_is_refused_and_nothing_is_exported(tmp_path, drop):
    with pytest.raises(EyrieError) as refused:
        exported(tmp_path, drop=drop)
    said = str(refused.value)
    assert f"draft vocabulary of {DRAFT_VOCAB} of the target's 771 tokens" in said
    assert f"its weights hold no {' or '.join(drop)} mapping" in said and "first 500 ids" in said
    assert "Nothing was exported" in said and "--draft-vocab 771" in refused.value.fix
    store, layout = FileStore(tmp_path / "store"), Layout("r")
    assert store.list(layout.drafter_file("")) == [] and store.get_json(layout.manifest)["drafter"] is None


# --- vLLM itself ----------------------------------------------------------------------------------------------

READ_CONFIG = """
import json, sys, typing
from vllm.config.speculative import DraftSampleMethod
from vllm.transformers_utils.config import maybe_override_with_speculators
model, _, spec = maybe_override_with_speculators(model=sys.argv[1], tokenizer=None, trust_remote_code=False)
print(json.dumps({"target": model, "spec": spec, "draft_sample_methods": typing.get_args(DraftSampleMethod)}))
"""


@pytest.mark.integration
@pytest.mark.timeout(300)
def test_vllm_reads_the_method_from_the_exported_config_whatever_its_folder_is_named(tmp_path):
    """`vllm serve FOLDER`: vLLM's own speculators reader takes the method from the config alone; and the
    draft sampling key eagle3_spec sets above temperature 0 is one vLLM's SpeculativeConfig accepts."""
    _, out = exported(tmp_path)
    folder = tmp_path / "my-eagle-3"
    shutil.copytree(out, folder)
    read = subprocess.run([str(VLLM_PYTHON), "-c", READ_CONFIG, str(folder)], env=vllm_env(tmp_path / "cache"),
                          capture_output=True, text=True, timeout=240)
    assert read.returncode == 0, read.stderr[-3000:]
    seen = json.loads(read.stdout.strip().splitlines()[-1])
    assert seen["target"] == TINY.name  # the export's public name of its target (TargetRef.public_name)
    assert seen["spec"] == {"method": "eagle3", "num_speculative_tokens": K, "model": str(folder)}
    assert eagle3_spec("d", K, 0.7)["draft_sample_method"] in seen["draft_sample_methods"]


@pytest.mark.e2e
@pytest.mark.timeout(900)
def test_vllm_serves_the_export_as_eagle3_with_its_mapping_from_a_folder_whose_name_says_nothing(tmp_path):
    """The tiny target served as verify serves it (verify.drafter_flags) with the export copied to
    `my-eagle-3/` (a name vLLM would read as EAGLE-1): vLLM says it runs eagle3, drafts 3 positions, and its
    drafts are the mapped token (accepted), not draft id 0 read as the target's token 0 (never accepted)."""
    _, out = exported(tmp_path, zero_head=True)
    folder = tmp_path / "my-eagle-3"
    shutil.copytree(out, folder)
    port, log = free_port(), tmp_path / "vllm.log"
    cmd = [*serve_argv(str(VLLM_PYTHON), str(TINY)), "--host", "127.0.0.1", "--port", str(port), *SMALL,
           *verify.drafter_flags(folder, K)]
    proc = start_vllm(cmd, log, vllm_env(tmp_path / "vllm-cache"), port)
    try:
        client = verify.Client(f"http://127.0.0.1:{port}", str(TINY), log)
        tokenizer = load_tokenizer(str(TINY))
        rows = [json.loads(line) for line in (ROOT / "tests" / "data" / "tiny_prompts.jsonl").read_text().splitlines()]
        prompts = [chat_prompt_ids(tokenizer, [{"role": "user" if t["from"] == "human" else t["from"],
                                                 "content": t["value"]} for t in r["conversations"]]) for r in rows[:24]]
        answers, _ = client.greedy(prompts, [48] * len(prompts), 4)
        counters = verify.spec_counters(client.url)
    finally:
        stop_vllm(proc)
    text = log.read_text(errors="replace")
    assert f"SpeculativeConfig(method='eagle3', model='{folder}', num_spec_tokens={K})" in text, text[-3000:]
    drafted = sum(FIRST_MAPPED in a for a in answers)
    print(f"counters {counters}; {drafted} of {len(answers)} answers hold token {FIRST_MAPPED}")
    assert counters["drafts"] > 0 and sorted(counters["per_pos"]) == list(range(K))
    assert drafted > 0 and counters["per_pos"][0] > 0  # the mapped token drafted, and accepted where it came
