"""bench/recipe_sweep.py's pure parts, without a process: a recipe is parsed and checked by `eyrie train`'s own
settings (a wrong name or value is refused, naming the fix), it changes only what it names in the run's plan, and
the RESULTS.md section has a row per recipe with its steps, time, eyrie τ and vLLM's figures per set."""

import pytest

from eyrie.data.manifest import TrainParams

import recipe_sweep as rs

PLAN = TrainParams(epochs=2, draft_vocab=8192, vocab_mapping="frequency", lr=1e-3, warmup=0.03, total_seq_len=1024,
                   train_samples=360, heldout_samples=40, speculators_version="0.9.0", recipe="lr 1e-3 ... because")


def test_recipes_are_parsed_typed_and_labelled_as_given():
    recipes = rs.parse_recipes("lr=3e-3; seq_len=2048,epochs=4 ;draft_vocab=4096;")
    assert recipes == {"lr=3e-3": {"lr": 3e-3}, "seq_len=2048,epochs=4": {"seq_len": 2048, "epochs": 4},
                       "draft_vocab=4096": {"draft_vocab": 4096}}


@pytest.mark.parametrize("text, named", [("learning_rate=3e-3", "learning_rate"), ("lr", "lr"),
                                          ("ttt_steps=40", "ttt_steps"), ("schedule=step", "schedule")])
def test_a_wrong_name_or_value_is_refused_naming_it_and_the_fix(text, named):
    with pytest.raises(SystemExit, match=named) as refused:
        rs.parse_recipes(text)
    assert "recipe" in str(refused.value)
    if "=" not in text or text.startswith("learning"):
        assert "e.g. 'lr=3e-3" in str(refused.value)


def test_a_recipe_changes_only_what_it_names_in_the_runs_plan():
    changed = rs.recipe_params(PLAN, {"seq_len": 2048, "ttt_steps": 2})
    assert (changed.total_seq_len, changed.ttt_steps) == (2048, 2)
    assert changed.model_dump(exclude={"total_seq_len", "ttt_steps"}) == PLAN.model_dump(
        exclude={"total_seq_len", "ttt_steps"})
    assert "2,048-token packs" in rs.describe(changed) and "TTT 2" in rs.describe(changed)


def test_the_section_has_a_row_per_recipe_with_its_steps_time_and_figures(tmp_path):
    figures = lambda acc, sp: {"vllm_acceptance_length": acc, "speedup": {"1": sp, "8": sp}}  # noqa: E731
    points = [{"label": "the run's own recipe", "train_s": 720.0, "eyrie_tau": 1.91, "recipe": "lr 1e-3 ...",
               "sets": {"heldout": figures(1.93, 1.4), "gsm8k": figures(1.95, 1.45)}},
              {"label": "lr=3e-3", "steps": 276, "train_s": 700.0, "eyrie_tau": 2.01, "recipe": rs.describe(PLAN),
               "sets": {"heldout": figures(2.02, 1.5), "gsm8k": figures(2.04, 1.52)}}]
    result = {"run": "r", "command": "python bench/recipe_sweep.py --run r --recipes lr=3e-3", "date": "2025-01-01",
              "commit": "abc", "device": "cpu", "pool": 360, "heldout_samples": 40, "plan": rs.describe(PLAN), "k": 3,
              "max_tokens": 256, "sets": {"heldout": 40, "gsm8k": 40}, "points": points,
              "machine": {"cpu": "AMD EPYC", "cpus": 2, "memory_gib": 23.5}}
    text = "\n".join(rs.section(result))
    assert "| the run's own recipe | - | 12.0 | 1.91 | 1.93 | 1.95 | 1.40 | 1.45 |" in text
    assert "| lr=3e-3 | 276 | 11.7 | 2.01 | 2.02 | 2.04 | 1.50 | 1.52 |" in text
    assert "- lr=3e-3: lr 0.001, warmup 3%, linear, 1,024-token packs, 2 epochs" in text
