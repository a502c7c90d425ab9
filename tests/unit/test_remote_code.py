"""A target that ships its own code (config.json / tokenizer_config.json with an `auto_map`): every
HF load of it runs that code exactly when the run says so (serve.trust_remote_code, recorded in the
manifest's target), and a run without the setting is refused before anything is generated, naming it.

The target here is the tiny one whose config, tokenizer and model classes are subclasses defined in
.py files beside its config.json, as a hub repository with custom code has them."""

import json
import shutil
from types import SimpleNamespace

import pytest

from eyrie.core.config import load_settings
from eyrie.core.errors import EyrieError
from eyrie.stages.run_config import load_config
from eyrie.core.stage_settings import DatasetSection, GenerateSettings
from eyrie.core.target import load_tokenizer, text_config
from eyrie.data.manifest import Layout, config_key
from eyrie.data.store import open_store
from eyrie.runs.control import start_pipeline
from eyrie.runs.projection import project
from tests.support.harness import TINY, tiny_run_config

CODE = {
    "configuration_eyrie.py": "from transformers import LlamaConfig\n\n\n"
                              "class EyrieTestConfig(LlamaConfig):\n    model_type = 'eyrie_test_llama'\n",
    "modeling_eyrie.py": "from transformers import LlamaForCausalLM\n\nfrom .configuration_eyrie import EyrieTestConfig"
                         "\n\n\nclass EyrieTestForCausalLM(LlamaForCausalLM):\n    config_class = EyrieTestConfig\n",
    "tokenization_eyrie.py": "from transformers import PreTrainedTokenizerFast\n\n\n"
                             "class EyrieTestTokenizer(PreTrainedTokenizerFast):\n    pass\n",
}


@pytest.fixture(scope="module")
def own_code_target(tmp_path_factory, monkeypatch_module):
    path = tmp_path_factory.mktemp("own-code") / "target"
    shutil.copytree(TINY, path)
    for name, text in CODE.items():
        (path / name).write_text(text)
    config = json.loads((path / "config.json").read_text())
    config.update(model_type="eyrie_test_llama", architectures=["EyrieTestForCausalLM"],
                  auto_map={"AutoConfig": "configuration_eyrie.EyrieTestConfig",
                            "AutoModelForCausalLM": "modeling_eyrie.EyrieTestForCausalLM"})
    (path / "config.json").write_text(json.dumps(config))
    tokenizer = json.loads((path / "tokenizer_config.json").read_text())
    tokenizer.update(tokenizer_class="EyrieTestTokenizer",
                     auto_map={"AutoTokenizer": [None, "tokenization_eyrie.EyrieTestTokenizer"]})
    (path / "tokenizer_config.json").write_text(json.dumps(tokenizer))
    # transformers copies a repository's code into its modules cache: the test's own
    monkeypatch_module.setenv("HF_MODULES_CACHE", str(path.parent / "modules"))
    return str(path)


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as patch:
        yield patch


def _refused(load) -> str:
    with pytest.raises(EyrieError) as refused:
        load()
    assert "trust_remote_code" in refused.value.fix, refused.value
    return refused.value.problem


def test_each_hf_load_of_the_target_runs_its_code_only_when_trusted(own_code_target, tmp_path):
    from eyrie_extractor.capture import HFCapture
    from eyrie_extractor.plan import target_shape
    from eyrie_generator.prompt_budget import PromptBudget
    from eyrie_trainer.verify import benchmark_prompts

    bench = tmp_path / "bench.jsonl"
    bench.write_text(json.dumps({"conversations": [{"from": "human", "value": "hello"}]}) + "\n")
    loads = {  # each load, and the class of what it made where that shows the target's own code ran
        "config": (lambda trust: text_config(own_code_target, trust), "EyrieTestConfig"),
        "extract plan's shape": (lambda trust: target_shape(own_code_target, trust), None),
        "tokenizer": (lambda trust: load_tokenizer(own_code_target, trust), "EyrieTestTokenizer"),
        "generate's prompt budget": (lambda trust: PromptBudget.load(own_code_target, 512, trust).tokenizer,
                                     "EyrieTestTokenizer"),
        "verify's benchmark prompts": (lambda trust: benchmark_prompts(own_code_target, [str(bench)], 1, trust),
                                       "dict"),
        "extract's forward": (lambda trust: HFCapture(own_code_target, [1, 2], "cpu", trust_remote_code=trust).model,
                              "EyrieTestForCausalLM"),
    }
    for name, (load, made) in loads.items():
        assert own_code_target in _refused(lambda: load(False)), name
        loaded = load(True)
        assert made is None or type(loaded).__name__ == made, (name, type(loaded))


def test_a_run_of_such_a_target_without_the_setting_is_refused_before_it_starts(own_code_target, tmp_path,
                                                                               redis_url, monkeypatch):
    import redis

    from eyrie_generator.plan import plan_generate

    monkeypatch.setenv("EYRIE_STORE_URL", f"file://{tmp_path / 'store'}")
    settings = load_settings(model=own_code_target)
    conn, store = redis.Redis.from_url(redis_url), open_store(settings)
    untrusted = load_config(tiny_run_config(tmp_path, "untrusted", target={"model": own_code_target}))
    problem = _refused(lambda: start_pipeline(settings, conn, store, untrusted))
    assert "auto_map" in problem, problem
    assert not store.exists(config_key("untrusted")) and not store.exists(Layout("untrusted").manifest)
    _refused(lambda: project(untrusted, settings, measure=False))  # --plan: not "add target.shape"

    trusted = load_config(tiny_run_config(tmp_path, "trusted", target={"model": own_code_target},
                                          serve={"trust_remote_code": True}))
    assert project(trusted, settings, measure=False).hidden_size == 64
    # the generate stage records it in the manifest's target, which every later load reads
    source = DatasetSection(source=trusted.dataset.source, limit=4)
    settings = settings.model_copy(update={"inference_url": "http://127.0.0.1:9"})  # no server is asked
    manifest, _ = plan_generate(settings, conn, store, "trusted", source, GenerateSettings(),
                                 trust_remote_code=True)
    assert manifest.target.trust_remote_code
    _refused(lambda: plan_generate(settings, conn, store, "untrusted-generate", source, GenerateSettings()))


def test_a_target_path_this_host_lacks_is_not_taken_for_a_hub_id(tmp_path):
    """The generator's container plans runs whose target path only the GPU containers hold: the
    check reads what is here and refuses nothing it cannot see (it raised HFValidationError)."""
    from eyrie.core.target import refuse_remote_code

    refuse_remote_code(str(tmp_path / "elsewhere" / "tiny-target"), False)
    refuse_remote_code("/opt/eyrie/assets/tiny-target", False)


def _train_options(target: str, trust: bool, data, work) -> dict:
    """The train stage's speculators settings (runner.speculators_options) for a run on `target`,
    its manifest's target trusted or not: 2 steps of a 1-layer drafter on `data`."""
    from eyrie.data.manifest import ExtractParams, TargetRef, TrainParams
    from eyrie_trainer.runner import speculators_options

    target_ref = TargetRef(model=target, revision="local", chat_template_sha256=None, server="transformers",
                           trust_remote_code=trust)
    extract = ExtractParams(backend="hf", aux_layers=[2, 4, 5], dtype="bf16", max_length=None, num_layers=6,
                            hidden_size=64, samples=8, tokens=1, truncated=0, projected_bytes=1, budget_bytes=None)
    manifest = SimpleNamespace(target=target_ref, extract=extract)
    params = TrainParams(epochs=1, draft_vocab=300, vocab_mapping="frequency", lr=1e-3, total_seq_len=128,
                         train_samples=6, heldout_samples=2, speculators_version="0.9.0", max_steps=2, num_layers=1)
    return speculators_options(params, manifest, data, work, 0, (6, 2), "cpu")


def test_speculators_options_carry_the_targets_trust_only_when_the_run_trusts_it(tmp_path):
    trusted = _train_options(str(TINY), True, tmp_path, tmp_path)
    assert trusted["trust_remote_code"] is True
    assert "trust_remote_code" not in _train_options(str(TINY), False, tmp_path, tmp_path)


@pytest.mark.integration  # speculators' TrainConfig from settings runs `git rev-parse` (its provenance)
def test_training_and_export_of_a_trusted_targets_run_load_it_with_its_code(own_code_target, tmp_path):
    """Issue 41 item 4: speculators' training (through eyrie's shim, as the train stage runs it) and the
    drafter's load for evaluation and export read the target's config with its own code where the run
    trusts it; untrusted, the same training is refused naming trust_remote_code."""
    import torch

    from tests.support.hs_fixture import build_hs_dir
    from eyrie_trainer import engine
    from eyrie_trainer.export import load_drafter

    data = build_hs_dir(tmp_path / "data", n=8)
    torch.save({token: 1 for token in range(400)}, data / "token_freq.pt")  # as materialize writes it
    hooks = engine.Hooks()
    with pytest.raises(Exception, match="trust_remote_code"):
        engine.train_with_fallback(_train_options(own_code_target, False, data, tmp_path / "untrusted"), "cpu",
                                   False, hooks, print)
    engine.train_with_fallback(_train_options(own_code_target, True, data, tmp_path / "trusted"), "cpu", False,
                               hooks, print)
    assert hooks.state["steps"] == 2
    saved = sorted(p.parent for p in (tmp_path / "trusted" / "checkpoints").rglob("config.json"))
    assert saved, list((tmp_path / "trusted").rglob("*"))
    with pytest.raises(ValueError, match="trust_remote_code"):  # speculators' own load of it, unwrapped
        load_drafter(saved[-1])
    with engine.verifier_code(True):  # as the train stage's evaluate_and_export loads each checkpoint
        assert load_drafter(saved[-1]).config.speculators_config.verifier.name_or_path == own_code_target
