"""The target's shape where transformers is not installed (the generator and api images plan runs
and refuse them before anything is enqueued): read from its config.json, the same numbers."""

import json
import shutil
import sys

from eyrie.core.config import load_settings
from eyrie.stages.run_config import load_config
from eyrie.core.target import text_config
from eyrie.runs.projection import project
from tests.support.harness import TINY, tiny_run_config

FIELDS = ("hidden_size", "num_hidden_layers", "vocab_size")


def test_without_transformers_the_config_json_gives_the_same_shape(monkeypatch, tmp_path):
    full = text_config(str(TINY))
    nested = tmp_path / "multimodal"
    shutil.copytree(TINY, nested)
    config = json.loads((TINY / "config.json").read_text())
    (nested / "config.json").write_text(json.dumps({"architectures": ["SomeVLM"], "hidden_size": 1,
                                                     "text_config": config}))
    monkeypatch.setitem(sys.modules, "transformers", None)  # `import transformers` raises ImportError
    for model in (TINY, nested):
        light = text_config(str(model))
        assert [getattr(light, f) for f in FIELDS] == [getattr(full, f) for f in FIELDS], model


def test_an_online_run_is_planned_without_transformers(monkeypatch, tmp_path):
    config = load_config(tiny_run_config(tmp_path, "light", extract={"backend": "vllm", "storage": "online"}))
    monkeypatch.setenv("EYRIE_STORE_URL", f"file://{tmp_path / 'store'}")
    monkeypatch.setitem(sys.modules, "transformers", None)
    plan = project(config, load_settings(), measure=False)
    assert plan.storage.chosen == "online" and plan.refusals == [], plan.refusals
