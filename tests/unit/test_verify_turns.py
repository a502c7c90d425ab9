"""MT-Bench's second turn as FastChat asks it (issue 40): each server verify starts is asked a question's second
user turn after ITS OWN first answer, rendered by the target's chat template; its figures per turn and over both
turns, in the manifest and wherever verify's figures show. The tiny target's tokenizer, no vLLM (the real passes:
tests/e2e/test_pipeline.py's chain)."""

import json

from eyrie.commands.display import verify_lines
from eyrie.core.target import load_tokenizer
from eyrie.data.charts import benchmark_series
from eyrie.data.manifest import RunManifest
from eyrie.data.verify_outputs import IDENTICAL, too_few
from eyrie.work.status_models import TrainStatus
from eyrie_trainer.benchmarks import load_benchmark
from eyrie_trainer.verify import Client, benchmark_result, benchmark_sets, measured_paces
from eyrie_trainer.verify_turns import SecondTurns
from tests.support.builders import make_manifest
from tests.support.harness import TINY

TOKENIZER = load_tokenizer(str(TINY))


def ids(text: str) -> list[int]:
    """An answer as vLLM returns its token ids: the text's, then the end token."""
    return TOKENIZER(text, add_special_tokens=False)["input_ids"] + [TOKENIZER.eos_token_id]


def rendered(messages: list[dict]) -> str:
    return TOKENIZER.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def test_the_second_turn_prompt_holds_the_servers_own_first_answer_rendered_by_the_chat_template():
    bench = load_benchmark("mt-bench", limit=2)
    turns = SecondTurns.of(bench, TOKENIZER, 64, None)
    first, second = bench.prompts[0][0]["content"], bench.second_turns[0]
    assert second.startswith("Rewrite your previous response") and first not in second
    asked, prompts = turns.prompts([ids("<think>travel</think>Aloha from Hawaii!"), ids("Another answer.")])
    assert asked == [0, 1]
    text = TOKENIZER.decode(prompts[0])
    assert text == rendered([{"role": "user", "content": first},
                             {"role": "assistant", "content": "<think>travel</think>Aloha from Hawaii!"},
                             {"role": "user", "content": second}])
    assert text.index(first) < text.index("Aloha from Hawaii!<|eos|><|user|>") < text.index(second)
    assert text.endswith(second + "<|eos|><|assistant|>")  # the generation prompt added, the answer's end token once
    other = TOKENIZER.decode(turns.prompts([ids("Mahalo, a different answer."), ids("x")])[1][0])
    assert "Mahalo, a different answer." in other and "Aloha" not in other  # each server: its own first answer


def test_a_second_turn_that_leaves_no_room_for_an_answer_is_not_asked():
    bench = load_benchmark("mt-bench", limit=2)
    answers = [ids("short"), ids("long " * 200)]
    asked, prompts = SecondTurns.of(bench, TOKENIZER, 64, 256).prompts(answers)
    assert asked == [0] and len(prompts[0]) < 256
    assert SecondTurns.of(bench, TOKENIZER, 64, 256).limits([[1] * 250, [1] * 10]) == [6, 64]


def test_a_set_without_second_turns_has_none(tmp_path):
    assert load_benchmark("gsm8k", limit=3).second_turns == [] and load_benchmark("humaneval", limit=3).second_turns == []
    assert SecondTurns.of(load_benchmark("gsm8k", limit=3), TOKENIZER, 64, None) is None
    path = tmp_path / "mine.jsonl"
    path.write_text(json.dumps({"turns": ["a", "b", "c"]}) + "\n" + json.dumps({"prompt": "d"}) + "\n")
    sets, second_turns = benchmark_sets(str(TINY), ["gsm8k", "mt-bench", str(path)], 2, 64, 256)
    assert list(sets) == ["gsm8k", "mt-bench", "mine"] and list(second_turns) == ["mt-bench", "mine"]
    assert second_turns["mine"].second == ["b", None] and second_turns["mt-bench"].questions() == 2
    assert sets["mt-bench"][0] == TOKENIZER(rendered(load_benchmark("mt-bench", 1).prompts[0]),
                                            add_special_tokens=False)["input_ids"]


class Scripted(Client):
    """A server that answers from a script (a prompt's answer by a text it holds) and counts, per pass, the
    (drafts, accepted tokens, accepted at the first position) it is given, as vLLM's counters do: summed up."""

    def __init__(self, answers: dict[str, str], counts: list[tuple[float, float, float]]):
        super().__init__("http://unused", "tiny")
        self.answers, self.counts, self.asked = answers, iter(counts), []
        self.counters = {"drafts": 0.0, "accepted_tokens": 0.0, "per_pos": {0: 0.0}}

    def one_pass(self, prompts, limits, serial):
        self.asked.append([TOKENIZER.decode(p) for p in prompts])
        outputs = [ids(next(a for q, a in self.answers.items() if q in text)) for text in self.asked[-1]]
        before, (drafts, accepted, first) = self.counters, next(self.counts)
        self.counters = {"drafts": before["drafts"] + drafts, "accepted_tokens": before["accepted_tokens"] + accepted,
                         "per_pos": {0: before["per_pos"][0] + first}}
        after = self.counters
        return {"outputs": outputs, "serial_outputs": outputs[:serial], "tokens_per_s": {"1": 10.0, "8": 40.0},
                "seconds": {n: sum(map(len, outputs[:serial] if n == "1" else outputs)) / r
                            for n, r in (("1", 10.0), ("8", 40.0))}, "counters": (before, after)}


def measured() -> tuple[dict, dict, Scripted]:
    """The target alone and with a drafter (K=3) on MT-Bench's first 3 questions: the drafter's server answers the
    second question's first turn differently, and the third's second turn."""
    sets, second_turns = benchmark_sets(str(TINY), ["mt-bench"], 3, 64, None)
    first = [p[0]["content"][:40] for p in second_turns["mt-bench"].first]
    second = [s[:40] for s in second_turns["mt-bench"].second]
    # a second turn's prompt holds the first turn's text too: its answer is looked up first
    script = {**{s: f"second {i}" for i, s in enumerate(second)}, **{f: f"first {i}" for i, f in enumerate(first)}}
    alone = Scripted(script, [(0, 0, 0)] * 2).measure(sets, {"mt-bench": [64] * 3}, 2, second_turns)["mt-bench"]
    drafter = Scripted({**script, first[1]: "first 1, drafted", second[2]: "second 2, drafted"},
                       [(10, 10, 5), (10, 15, 5)])
    return alone, drafter.measure(sets, {"mt-bench": [64] * 3}, 2, second_turns)["mt-bench"], drafter


def test_each_server_is_asked_the_second_turn_after_its_own_first_answer_and_compared_where_those_agree():
    alone, drafted, drafter = measured()
    assert len(drafter.asked) == 2 and drafter.asked[1][1].count("first 1, drafted") == 1  # its own answer, in turn 2
    assert drafted["second_turn"]["asked"] == [0, 1, 2]
    bench = benchmark_result(alone, {3: drafted}, 3)
    one, two, both = bench["k"]["3"], bench["turns"]["2"]["k"]["3"], bench["turns"]["both"]["k"]["3"]
    assert (one["differing_outputs"], one["match_rate"], one["outputs_verdict"]) == (1, 0.5, too_few(2))
    # question 1's second prompts differ (other first answers): compared on questions 0 and 2; question 2 differs
    assert (two["prompts"], two["compared_prompts"], two["differing_outputs"]) == (3, 2, 1)
    assert (two["compared_prompts_at_1"], two["differing_outputs_at_1"]) == (1, 0)  # the first 2 asked at 1 in flight
    assert (two["outputs_verdict"], both["outputs_verdict"]) == (too_few(1), too_few(3))  # 2 + 1 compared at 1
    assert bench["turns"]["2"]["prompts"] == 3 and bench["turns"]["2"]["questions"] == 3
    assert one["vllm_drafts"] == two["vllm_drafts"] == 10 and both["vllm_drafts"] == 20  # turn 1 + turn 2 counted
    assert one["vllm_acceptance_length"] == 2.0 and two["vllm_acceptance_length"] == 2.5  # the counters read per pass
    assert both["vllm_acceptance_length"] == 2.25 and both["vllm_per_position_acceptance"][0] == 0.5
    assert both["differing_outputs"] == 2 and both["compared_prompts"] == 5 and not both["identical_outputs"]
    assert bench["turns"]["both"]["tokens_per_s_target"] == {"8": 40.0, "1": 10.0} and both["speedup"]["8"] == 1.0
    assert len(measured_paces({"benchmarks": {"mt-bench": bench}})) == 4  # alone and K=3, per turn


def test_the_figures_of_each_turn_show_and_survive_the_manifest_and_status_round_trip():
    alone, drafted, _ = measured()
    bench = benchmark_result(alone, {3: drafted}, 3)
    one_turn = {key: value for key, value in alone.items() if key != "second_turn"}
    result = {"benchmarks": {"gsm8k": benchmark_result(one_turn, {3: one_turn}, 3), "mt-bench": bench}}
    assert "turns" not in result["benchmarks"]["gsm8k"]
    lines = verify_lines("r", result)
    assert [" ".join(line.split()[:3]) for line in lines[2:6]] == [
        "gsm8k 3 3", "mt-bench 3 3", "mt-bench turn 2", "mt-bench turns 1+2"]
    assert lines[4].split()[3:6] == ["3", "3", "2.500"]  # prompts, K, vLLM's acceptance of turn 2
    assert "  mt-bench turn 2 K=3: outputs 1 of 2 compared differ" in "\n".join(lines)
    assert lines[-1].startswith("  turn 2: the second turn, asked after each server's own first answer")
    series = benchmark_series(result["benchmarks"])
    assert list(series) == ["gsm8k", "mt-bench", "mt-bench turn 2", "mt-bench turns 1+2"]
    assert series["mt-bench turn 2"]["3"]["acceptance_length"] == 2.5 and series["gsm8k"]["3"]["outputs"] == IDENTICAL
    verify = json.loads(json.dumps(result))
    manifest = RunManifest.model_validate(json.loads(json.dumps(make_manifest("r", verify=verify).model_dump())))
    assert manifest.verify["benchmarks"]["mt-bench"]["turns"] == verify["benchmarks"]["mt-bench"]["turns"]
    assert TrainStatus(state="done", verify=manifest.verify).model_dump()["verify"] == verify
