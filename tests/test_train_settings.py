"""The train stage's settings declared once (eyrie.train_settings.TrainSettings): the run config's
section, the `eyrie train` options and the plan's check come from it; speculators' trainer gets its
own TrainConfig built from settings by name, the same one its CLI makes from the command line."""

import pytest
from typer.testing import CliRunner

from conftest import TINY
from eyrie.pipeline import RunConfig
from eyrie.train_settings import TrainSettings


def test_a_setting_not_given_takes_the_default_and_is_not_written_out():
    config = RunConfig.model_validate({"run": "s", "target": {"model": "m"}, "dataset": {"source": "d"},
                                       "train": {"epochs": 3, "lr": None}})  # null: not given (older configs)
    assert (config.train.epochs, config.train.seq_len, config.train.draft_vocab) == (3, 8192, 32000)
    assert config.model_dump()["train"] == {"epochs": 3} == config.train.given()
    again = RunConfig.model_validate(config.model_dump())  # the stored config, a task's payload
    assert again == config and again.train.given() == {"epochs": 3}
    assert TrainSettings().heldout_for(20_000) == 500 and TrainSettings().heldout_for(5) == 1
    assert TrainSettings(heldout=7).heldout_for(20_000) == 7


def test_the_train_options_are_the_settings_fields():
    from eyrie.cli import app

    from typer.main import get_command

    options = {p.name: p for p in get_command(app).commands["train"].params}
    assert list(options) == ["run", *TrainSettings.model_fields, "wait"]
    for name, field in TrainSettings.model_fields.items():
        assert options[name].opts == [f"--{name.replace('_', '-')}"] and options[name].default is None
        assert options[name].help.startswith(field.description.rstrip("."))
        assert field.default is None or f"(default {field.default})" in options[name].help
    result = CliRunner().invoke(app, ["train", "--run", "r", "--ttt-steps", "17"])
    assert result.exit_code == 2  # the field's bound, checked by click as before


def test_a_rerun_is_checked_against_the_settings_given_only():
    from eyrie.errors import EyrieError
    from eyrie.manifest import TrainParams
    from eyrie_trainer.plan import _check_same

    planned = TrainParams(epochs=5, draft_vocab=300, vocab_mapping="frequency", lr=1e-3, total_seq_len=256,
                          train_samples=90, heldout_samples=10, speculators_version="0.9.0")
    _check_same(planned, TrainSettings())  # nothing asked: the plan holds, whatever the defaults
    _check_same(planned, TrainSettings(epochs=5, seq_len=256, heldout=10, draft_vocab=32000))
    with pytest.raises(EyrieError, match="seq_len 512 vs 256; heldout 3 vs 10"):
        _check_same(planned, TrainSettings(seq_len=512, heldout=3))


def settings_by_name(tmp_path) -> dict:
    return {"verifier_name_or_path": str(TINY), "data_path": str(tmp_path / "data"),
            "save_path": str(tmp_path / "ck"), "epochs": 3, "ttt_steps": 3, "lr": 0.003, "total_seq_len": 256,
            "num_workers": 0, "target_layer_ids": [2, 4, 5], "log_dir": str(tmp_path / "logs"), "logger": "",
            "hidden_states_backend": "file", "checkpoint_freq": 1, "log_freq": 1, "draft_vocab_size": 500,
            "num_layers": 1, "max_steps": 5, **{"draft_attn_impl": "sdpa", "loss_implementation": "eager"}}


def test_speculators_config_is_what_its_cli_makes_of_the_same_settings(tmp_path):
    from eyrie_trainer import engine

    settings = settings_by_name(tmp_path)
    built, parsed = engine.speculators_config(settings), engine.resolve_argv(engine.as_argv(settings))
    assert built.flatten() == parsed.flatten() and dict(built.provenance) == dict(parsed.provenance)
    assert built.dump_yaml() == parsed.dump_yaml() and dict(built.backend_args) == dict(parsed.backend_args)
    assert built.data.total_seq_len == 256 and built.draft.target_layer_ids == [2, 4, 5]
    assert list(built.argv[:2]) == ["speculators", "train"]  # recorded in train_command.txt


def test_settings_speculators_refuses_are_one_error(tmp_path):
    from eyrie_trainer import engine

    with pytest.raises(RuntimeError, match=r"no training settings \['total_seq_length'\]"):
        engine.speculators_config({"total_seq_length": 256})
    base = {**settings_by_name(tmp_path), "from_pretrained": str(tmp_path / "base")}  # and --num-layers
    with pytest.raises(RuntimeError, match="refused the training settings: --from-pretrained .* --num-layers"):
        engine.speculators_config(base)
