"""Finetuning from a base drafter: fetch, legacy -> speculators conversion (speculators' own
converter, real files), and the refusals of a base that does not fit the target or the run."""

import json

import pytest
import torch
from safetensors.torch import load_file

from eyrie.core.errors import EyrieError
from eyrie_trainer.base import BaseInfo, check_base, fetch, is_legacy, prepare_base, to_speculators
from tests.support.harness import TINY
from tests.support.legacy_drafter import build_legacy_drafter, write_speculators_config

TARGET = str(TINY.resolve())
AUX = [2, 4, 5]


@pytest.fixture(scope="module")
def legacy(tmp_path_factory):
    return build_legacy_drafter(tmp_path_factory.mktemp("base") / "legacy", TINY)


@pytest.fixture(scope="module")
def converted(legacy, tmp_path_factory):
    return to_speculators(legacy, TARGET, tmp_path_factory.mktemp("conv") / "out")


def test_legacy_converts_and_loads_with_the_legacy_weights(legacy, converted):
    from speculators.models.eagle3 import Eagle3DraftModel

    assert is_legacy(legacy) and not is_legacy(converted)
    config = json.loads((converted / "config.json").read_text())
    assert config["eagle_aux_hidden_state_layer_ids"] == AUX  # carried over from eagle_config
    model = Eagle3DraftModel.from_pretrained(str(converted))
    old, new = load_file(str(legacy / "model.safetensors")), model.state_dict()
    assert torch.equal(new["fc.weight"], old["fc.weight"])
    assert torch.equal(new["layers.0.self_attn.q_proj.weight"], old["midlayer.self_attn.q_proj.weight"])
    assert torch.equal(new["layers.0.hidden_norm.weight"], old["midlayer.hidden_norm.weight"])
    assert torch.equal(new["d2t"], old["d2t"]) and torch.equal(new["t2d"], old["t2d"])
    assert model.target_layer_ids == AUX
    assert to_speculators(converted, TARGET, converted.parent / "unused") == converted  # passes through


def test_conversion_is_reused_and_a_half_written_one_redone(legacy, tmp_path):
    out = to_speculators(legacy, TARGET, tmp_path / "out")
    weights = out / "model.safetensors"
    before = weights.stat().st_mtime_ns
    assert to_speculators(legacy, TARGET, out) == out and weights.stat().st_mtime_ns == before
    half = tmp_path / "half"
    half.mkdir()
    (half / "config.json").write_text("{")  # a crash mid-write: no stamp, broken config
    assert to_speculators(legacy, TARGET, half) == half
    assert json.loads((half / "config.json").read_text())["speculators_model_type"] == "eagle3"
    assert torch.equal(load_file(str(half / "model.safetensors"))["fc.weight"],
                       load_file(str(weights))["fc.weight"])
    assert not [p for p in tmp_path.iterdir() if ".tmp-" in p.name]


def test_a_changed_source_is_converted_again(tmp_path):
    legacy = build_legacy_drafter(tmp_path / "legacy", TINY, seed=0)
    out = to_speculators(legacy, TARGET, tmp_path / "out")
    build_legacy_drafter(legacy, TINY, draft_vocab=400, seed=1)  # same directory, other weights
    assert to_speculators(legacy, TARGET, out) == out
    assert torch.equal(load_file(str(out / "model.safetensors"))["fc.weight"],
                       load_file(str(legacy / "model.safetensors"))["fc.weight"])


def test_legacy_without_aux_ids_gets_speculators_default(tmp_path):
    legacy = build_legacy_drafter(tmp_path / "legacy", TINY, aux_layers=None)
    out = to_speculators(legacy, TARGET, tmp_path / "out")
    assert json.loads((out / "config.json").read_text())["eagle_aux_hidden_state_layer_ids"] is None
    assert check_base(out, TARGET, AUX, None).aux_layers == AUX  # [2, 8 // 2, 8 - 3]
    with pytest.raises(EyrieError, match=r"aux layers \[2, 4, 5\] \(base\) vs \[1, 4, 6\] \(this run\)"):
        check_base(out, TARGET, [1, 4, 6], None)


def test_a_model_that_is_no_eagle3_drafter_is_refused(tmp_path):
    with pytest.raises(EyrieError, match="not a legacy EAGLE-3 drafter"):
        to_speculators(TINY, TARGET, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_fetch_local_dir_and_missing_ones(legacy, tmp_path):
    assert fetch(str(legacy), None, tmp_path) == legacy
    (tmp_path / "empty").mkdir()
    with pytest.raises(EyrieError, match="has no config.json"):
        fetch(str(tmp_path / "empty"), None, tmp_path)
    with pytest.raises(EyrieError, match="no such directory"):
        fetch(str(tmp_path / "nope"), None, tmp_path)


def test_fetch_from_the_hub_offline_names_the_repo(tmp_path, monkeypatch):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(EyrieError) as err:
        fetch("AQ-MedAI/Kimi-K2-Instruct-eagle3", "main", tmp_path / "hub")
    text = str(err.value)
    assert "AQ-MedAI/Kimi-K2-Instruct-eagle3@main" in err.value.problem and "HF_HUB_OFFLINE" in text
    assert "local directory" in err.value.fix and "Traceback" not in text and "\n" not in text
    assert err.value.__cause__ is None


def test_a_fitting_base_is_described(converted):
    info = check_base(converted, TARGET, [5, 2, 4], 500)
    assert (info.hidden_size, info.target_vocab, info.draft_vocab, info.aux_layers) == (64, 771, 500, AUX)


def test_hidden_size_mismatch_is_refused(tmp_path):
    legacy = build_legacy_drafter(tmp_path / "legacy", TINY, hidden_size=32)
    out = to_speculators(legacy, TARGET, tmp_path / "out")
    with pytest.raises(EyrieError, match=r"hidden size 32 \(base\) vs 64 \(target\)"):
        check_base(out, TARGET, AUX, None)


def test_aux_layers_mismatch_is_refused(converted):
    with pytest.raises(EyrieError, match=r"aux layers \[2, 4, 5\] \(base\) vs \[1, 4, 7\] \(this run\)") as err:
        check_base(converted, TARGET, [1, 4, 7], None)
    assert "--layers 2,4,5" in err.value.fix


def test_draft_vocab_mismatch_is_refused(converted):
    with pytest.raises(EyrieError, match=r"draft vocab size 500 \(base\) vs 300 \(requested\)"):
        check_base(converted, TARGET, AUX, 300)


def test_target_vocab_mismatch_is_refused(tmp_path):
    base = write_speculators_config(tmp_path / "spec", TINY, vocab_size=1000)
    with pytest.raises(EyrieError, match=r"target vocab size 1000 \(base\) vs 771 \(target\)"):
        check_base(base, TARGET, AUX, None)


def test_all_mismatches_in_one_message(tmp_path):
    base = write_speculators_config(tmp_path / "spec", TINY, hidden_size=32, vocab_size=1000,
                                    aux_layers=[1, 2, 3], draft_vocab=400)
    with pytest.raises(EyrieError) as err:
        check_base(base, TARGET, AUX, 300)
    problem = err.value.problem
    for part in ("hidden size 32 (base) vs 64 (target)", "target vocab size 1000 (base) vs 771 (target)",
                 "aux layers [1, 2, 3] (base) vs [2, 4, 5] (this run)",
                 "draft vocab size 400 (base) vs 300 (requested)"):
        assert part in problem
    assert "--layers 1,2,3" in err.value.fix and "request draft vocab 400" in err.value.fix


def test_prepare_base_from_a_local_legacy_dir(legacy, tmp_path):
    path, info = prepare_base(str(legacy), None, TARGET, AUX, 500, tmp_path)
    assert path.parent == tmp_path / "converted" and not is_legacy(path)
    assert isinstance(info, BaseInfo) and info.legacy and info.source == str(legacy)
    assert info.path == str(path) and info.aux_layers == AUX
    assert prepare_base(str(legacy), None, TARGET, AUX, 500, tmp_path)[0] == path
