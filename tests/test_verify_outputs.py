"""verify's judgement of the drafter's answers beside the target's own batch variance: pure logic, no vLLM (the
passes it judges are the real ones in test_pipeline and bench/greedy_identity.py)."""

from eyrie.commands.display import verify_lines
from eyrie.data.charts import benchmark_series
from eyrie.data.verify_outputs import BEYOND, IDENTICAL, WITHIN, outputs_verdict, worst
from eyrie_trainer.verify import benchmark_result

COUNTERS = ({"drafts": 10, "accepted_tokens": 10, "per_pos": {0: 5.0}}, {"drafts": 20, "accepted_tokens": 25, "per_pos": {0: 10.0}})


def answers(n: int, changed: set[int], tag: int = 9) -> list[list[int]]:
    return [[i, tag] if i in changed else [i, 0] for i in range(n)]


def a_pass(outputs: list[list[int]], serial_outputs: list[list[int]]) -> dict:
    return {"outputs": outputs, "serial_outputs": serial_outputs, "tokens_per_s": {"1": 10.0, "8": 40.0},
            "counters": COUNTERS}


def test_answers_that_differ_no_more_than_the_target_alone_does_are_its_variance():
    alone = a_pass(answers(40, set()), answers(8, set(range(7))))  # alone: 7 of 8 differ between 1 and 8 in flight
    at_1 = answers(8, set(range(7)))
    at_1[1] = [1, 5]  # with the drafter at 1 in flight: one answer differs from the target's alone at 1
    drafted = a_pass(answers(40, {3, 11, 20, 25, 30, 39}, tag=5), at_1)
    bench = benchmark_result(alone, {3: drafted}, 40)
    figures = bench["k"]["3"]
    assert (bench["target_differing_1_vs_8"], bench["serial_prompts"]) == (7, 8)
    assert (figures["differing_outputs"], figures["differing_outputs_at_1"], figures["identical_outputs"]) == (6, 1, False)
    assert figures["outputs_verdict"] == WITHIN and figures["vllm_acceptance_length"] == 2.5
    series = benchmark_series({"gsm8k": bench})["gsm8k"]["3"]
    assert series["outputs"] == f"6 of 40 differ: {WITHIN} (alone, 7 of 8 differ at 1 vs 8 in flight)"
    assert series["outputs_beyond_variance"] is False


def test_a_difference_where_the_target_alone_is_batch_invariant_is_flagged():
    alone = a_pass(answers(40, set()), answers(8, set()))  # float32: alone, 1 and 8 in flight agree
    drafted = a_pass(answers(40, {17}, tag=5), answers(8, set()))
    bench = benchmark_result(alone, {3: drafted, 5: a_pass(answers(40, set()), answers(8, set()))}, 40)
    assert bench["k"]["3"]["outputs_verdict"] == BEYOND and bench["k"]["5"]["outputs_verdict"] == IDENTICAL
    assert benchmark_series({"gsm8k": bench})["gsm8k"]["3"]["outputs_beyond_variance"] is True
    assert worst([IDENTICAL, BEYOND, WITHIN]) == BEYOND and worst([IDENTICAL, IDENTICAL]) == IDENTICAL
    lines = verify_lines("r", {"benchmarks": {"gsm8k": bench}})
    assert lines[-1] == f"  gsm8k K=3: outputs 1 of 40 differ: {BEYOND} (alone, 0 of 8 differ at 1 vs 8 in flight)"
    assert not any("K=5: outputs" in line for line in lines)  # identical answers need no line


def test_any_share_is_within_where_the_target_alone_is_batch_variant_and_none_where_it_is_not():
    assert outputs_verdict(44, 2) == WITHIN  # measured: 44 of 80 with the drafter, 2 of 4 alone (bf16, AMX host)
    assert outputs_verdict(1, 0) == BEYOND
    assert outputs_verdict(0, 3) == IDENTICAL


def test_a_result_from_before_the_variance_was_measured_still_shows():
    old = {"prompts": 40, "tokens_per_s_target": {"1": 1.0, "8": 1.0},
           "k": {"3": {"vllm_acceptance_length": 2.0, "vllm_per_position_acceptance": [0.5], "speedup": {"1": 1.0, "8": 1.0},
                       "tokens_per_s": {"1": 1.0, "8": 1.0}, "identical_outputs": False, "differing_outputs": 2}}}
    assert benchmark_series({"gsm8k": old})["gsm8k"]["3"]["outputs"] == "differ"
    assert verify_lines("r", {"benchmarks": {"gsm8k": old}})[-1] == "  gsm8k K=3: outputs differ"
