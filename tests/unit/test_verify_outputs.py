"""verify's judgement of the drafter's answers: its match rate (equal to plain decoding at 1 in flight) beside the
target's own at 1 vs 8 in flight, against a floor and a margin, on at least MIN_COMPARED answers. Pure logic, no vLLM (the passes it judges are the real
ones in test_pipeline and bench/greedy_identity.py)."""

import pytest

from eyrie.commands.display import verify_lines
from eyrie.data.charts import benchmark_series
from eyrie.data.verify_outputs import (BEYOND, FAILED, IDENTICAL, MATCH_FLOOR, MATCH_MARGIN, MIN_COMPARED, WITHIN,
                                       outputs_failure, outputs_judged, too_few, worst)
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
    assert (figures["match_rate"], figures["target_match_rate"], figures["match_rate_required"]) == (0.875, 0.125, 0.5)
    assert figures["outputs_verdict"] == WITHIN and figures["vllm_acceptance_length"] == 2.5
    series = benchmark_series({"gsm8k": bench})["gsm8k"]["3"]
    assert series["outputs"] == (f"6 of 40 differ at 8 in flight; at 1 in flight 88% equal to plain decoding (the "
                                 f"target alone at 1 vs 8 in flight 12%; at least 50% asked): {WITHIN}")
    assert series["outputs_beyond_variance"] is False


def test_a_drafter_that_changes_more_answers_than_the_target_alone_fails_however_batch_variant_the_target():
    """The defect: any share passed wherever the target alone differed at 1 vs 8 in flight at all."""
    alone = a_pass(answers(40, set()), answers(8, {0}))  # alone: 1 of 8 differs between 1 and 8 in flight
    drafted = a_pass(answers(40, set(range(30)), tag=5), answers(8, {0, 1, 2, 3, 4}, tag=5))  # 5 of 8 at 1
    figures = benchmark_result(alone, {3: drafted}, 40)["k"]["3"]
    assert (figures["match_rate"], figures["target_match_rate"]) == (0.375, 0.875)
    assert figures["match_rate_required"] == 0.875 - MATCH_MARGIN and figures["outputs_verdict"] == FAILED
    # the target alone batch-variant on every serial prompt excuses the drafter only down to the floor
    assert outputs_judged(53, 5, 8, 8, 8)["outputs_verdict"] == FAILED  # 3 of 8 equal at 1 in flight
    assert outputs_judged(53, 4, 8, 8, 8)["match_rate_required"] == MATCH_FLOOR
    assert outputs_judged(53, 4, 8, 8, 8)["outputs_verdict"] == WITHIN  # 4 of 8: at the floor


@pytest.mark.parametrize("drafter, target, verdict", [
    # bench/RESULTS.md, "Learning curve" (bf16, AMX host; 80 prompts, the first 4 at 1 in flight): the drafter's
    # answers differing at 8 in flight, at 1 in flight, and the target alone's at 1 vs 8 in flight
    ((53, 0), 4, WITHIN),  # held out, 1,000 prompts
    ((45, 2), 2, WITHIN),  # HumanEval, 1,000 prompts: as many as the target alone, at the floor
    ((36, 2), 2, WITHIN),  # HumanEval, 1,800 prompts
    ((50, 0), 2, WITHIN),  # GSM8K, 1,800 prompts
    ((0, 0), 0, IDENTICAL),  # float32 (bench/greedy_identity.py): the target alone batch-invariant
])
def test_every_measured_drafter_passes(drafter, target, verdict):
    """Measured on 4 serial prompts: too few to judge, failing nothing; the same shares of verify's default 8 pass."""
    assert outputs_judged(*drafter, 4, target, 4)["outputs_verdict"] == (IDENTICAL if verdict == IDENTICAL else too_few(4))
    assert outputs_judged(drafter[0], 2 * drafter[1], 8, 2 * target, 8)["outputs_verdict"] == verdict


def test_where_the_target_alone_is_batch_invariant_one_answer_in_eight_is_the_margin():
    assert MATCH_MARGIN * MIN_COMPARED == 1  # on the fewest answers judged, one near-tie flip is the margin
    assert outputs_judged(1, 1, 8, 0, 8)["outputs_verdict"] == WITHIN  # one near-tie flip of verify's default 8
    assert outputs_judged(2, 2, 8, 0, 8)["outputs_verdict"] == FAILED
    assert outputs_judged(1, 1, 4, 0, 4)["outputs_verdict"] == too_few(4)  # one flip of 4 would be over the margin


def test_a_verdict_on_too_few_answers_says_so_and_fails_nothing():
    """tests/e2e/test_real_model.py[s3] verifies 2 prompts a set: one answer compared at 1 in flight, which differed
    (a near tie), read as a match rate of 0% and failed the run. Below MIN_COMPARED the verdict is not taken."""
    alone = a_pass(answers(2, set()), answers(1, set()))
    drafted = a_pass(answers(2, {0}, tag=5), answers(1, {0}, tag=5))
    bench = benchmark_result(alone, {3: drafted}, 2)
    figures = bench["k"]["3"]
    assert (figures["match_rate"], figures["differing_outputs_at_1"]) == (0.0, 1)
    assert figures["outputs_verdict"] == too_few(1) == f"too few answers compared to judge (1 of {MIN_COMPARED})"
    verify = {"outputs_verdict": worst([IDENTICAL, WITHIN, too_few(4), too_few(1)]), "benchmarks": {"gsm8k": bench}}
    assert verify["outputs_verdict"] == too_few(1)  # of those too few, the fewest
    assert worst([too_few(0), FAILED]) == FAILED and worst([BEYOND, too_few(2)]) == BEYOND
    assert outputs_failure(verify) is None
    assert verify_lines("r", verify)[-1].endswith(f"at 1 in flight 0% equal to plain decoding (the target alone at 1 "
                                                  f"vs 8 in flight 100%; at least 88% asked): {too_few(1)}")
    assert benchmark_series({"gsm8k": bench})["gsm8k"]["3"]["outputs_beyond_variance"] is False
    assert outputs_judged(0, 0, 1, 0, 1)["outputs_verdict"] == IDENTICAL  # nothing differs: no judgement needed
    assert outputs_judged(1, 0, 0, 0, 0)["outputs_verdict"] == too_few(0)  # a second turn none compared at 1


def test_a_failed_verdict_fails_the_verify_with_the_sets_named():
    alone = a_pass(answers(40, set()), answers(8, set()))
    drafted = a_pass(answers(40, {17}, tag=5), answers(8, {1, 2}, tag=5))
    bench = benchmark_result(alone, {3: drafted, 5: a_pass(answers(40, set()), answers(8, set()))}, 40)
    assert bench["k"]["3"]["outputs_verdict"] == FAILED and bench["k"]["5"]["outputs_verdict"] == IDENTICAL
    assert benchmark_series({"gsm8k": bench})["gsm8k"]["3"]["outputs_beyond_variance"] is True
    assert worst([IDENTICAL, FAILED, WITHIN]) == FAILED and worst([IDENTICAL, IDENTICAL]) == IDENTICAL
    lines = verify_lines("r", {"benchmarks": {"gsm8k": bench}})
    assert lines[-1].startswith("  gsm8k K=3: outputs 1 of 40 differ at 8 in flight; at 1 in flight 75% equal")
    assert not any("K=5: outputs" in line for line in lines)  # identical answers need no line
    problem, fix = outputs_failure({"outputs_verdict": FAILED, "benchmarks": {"gsm8k": bench}})
    assert "gsm8k K=3: 1 of 40 differ" in problem and "K=5" not in problem and "float32" in fix
    assert outputs_failure({"outputs_verdict": WITHIN, "benchmarks": {"gsm8k": bench}}) is None


def test_a_result_from_before_match_rates_reads_as_before_and_fails_nothing():
    bench = {"prompts": 40, "serial_prompts": 8, "target_differing_1_vs_8": 0, "tokens_per_s_target": {"1": 1.0, "8": 1.0},
             "k": {"3": {"vllm_acceptance_length": 2.0, "vllm_per_position_acceptance": [0.5], "speedup": {"1": 1.0, "8": 1.0},
                         "tokens_per_s": {"1": 1.0, "8": 1.0}, "identical_outputs": False, "differing_outputs": 1,
                         "differing_outputs_at_1": 0, "outputs_verdict": BEYOND}}}
    assert verify_lines("r", {"benchmarks": {"gsm8k": bench}})[-1] == \
        f"  gsm8k K=3: outputs 1 of 40 differ: {BEYOND} (alone, 0 of 8 differ at 1 vs 8 in flight)"
    assert outputs_failure({"outputs_verdict": BEYOND, "benchmarks": {"gsm8k": bench}}) is None


def test_a_result_from_before_the_variance_was_measured_still_shows():
    old = {"prompts": 40, "tokens_per_s_target": {"1": 1.0, "8": 1.0},
           "k": {"3": {"vllm_acceptance_length": 2.0, "vllm_per_position_acceptance": [0.5], "speedup": {"1": 1.0, "8": 1.0},
                       "tokens_per_s": {"1": 1.0, "8": 1.0}, "identical_outputs": False, "differing_outputs": 2}}}
    assert benchmark_series({"gsm8k": old})["gsm8k"]["3"]["outputs"] == "differ"
    assert verify_lines("r", {"benchmarks": {"gsm8k": old}})[-1] == "  gsm8k K=3: outputs differ"
