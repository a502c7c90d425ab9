"""Whether the drafter changed the target's answers in `eyrie verify`: its match rate (answers equal to plain
decoding at 1 in flight) beside the target's own (its answers alone at 1 and at 8 in flight: its batch variance),
judged against a floor and a margin, on no fewer answers than MIN_COMPARED."""

from __future__ import annotations

import re

# The share of answers with the drafter that must equal plain decoding at 1 in flight, whatever the target's own
# batch variance. vLLM's greedy correctness test for EAGLE asks more than 60 of 100 (tests/v1/e2e/spec_decode/
# test_spec_decode.py: `matches > int(0.6 * len(ref_outputs))`); verify compares 4-8 serial prompts, and in bf16 on
# the AMX host a drafter that changed 0 of 80 answers in float32 matched plain decoding on 2 of 4 HumanEval prompts,
# as the target alone matched itself at 1 vs 8 in flight (bench/RESULTS.md, "Learning curve"): 60% of 4 fails it.
MATCH_FLOOR = 0.5
# How far the drafter's match rate may fall below the target's own before verify fails. On every measured set the
# drafter changed no more answers at 1 in flight than the target alone did at 1 vs 8 (bench/RESULTS.md: 0-2 of 4
# against 2-4 of 4 in bf16, 0 against 0 in float32), and vLLM's acceptance test allows 5%: less than one answer of
# verify's serial prompts. One answer of its default 8: a single near-tie flip beyond the target's own passes there.
MATCH_MARGIN = 0.125
# The fewest answers compared at 1 in flight that verify judges: one near-tie flip (which greedy speculative decoding
# allows, lossless only up to numerics) moves the match rate by 1/n, within MATCH_MARGIN only from 8 answers on; on
# fewer, one flip would fail a batch-invariant target (tests/e2e/test_real_model.py verifies 2 prompts a set: one
# flip of 1 compared failed it). vLLM's own test judges 100 prompts. Fewer: recorded, said, and failing nothing.
MIN_COMPARED = 8

IDENTICAL = "identical"
WITHIN = "within the target's own batch variance"
TOO_FEW = "too few answers compared to judge"  # recorded as too_few(n): fewer than MIN_COMPARED at 1 in flight
BEYOND = "differ beyond the target's own batch variance"  # recorded before match rates: worth a look, never failed
FAILED = "fails: the drafter changes more answers than the target's own batch variance"
VERDICTS = [IDENTICAL, WITHIN, TOO_FEW, BEYOND, FAILED]  # worst last


def differing(a: list[list[int]], b: list[list[int]]) -> int:
    """How many answers differ, pairwise."""
    return sum(x != y for x, y in zip(a, b))


def match_rate(differ: int, of: int) -> float | None:
    return round((of - differ) / of, 4) if of else None


def required_match_rate(target_match_rate: float | None) -> float:
    """The drafter's match rate that passes: the target's own less MATCH_MARGIN, never under MATCH_FLOOR (a target
    that answers differently at 1 and at 8 in flight excuses the drafter's changes only down to the floor). Where
    the target's own was not measured, no variance excuses any."""
    own = 1.0 if target_match_rate is None else target_match_rate
    return round(max(MATCH_FLOOR, own - MATCH_MARGIN), 4)


def outputs_judged(differ_at_8: int, differ_at_1: int, compared_at_1: int, target_differing: int,
                   target_serial: int) -> dict:
    """Greedy speculative decoding is lossless up to numerics (vLLM's docs); with 8 in flight each answer is computed
    in batches whose shape changes as requests come and go, and the drafter's verification computes K+1 positions
    where plain decoding computes one. So the answers with the drafter at 1 in flight are compared with the target's
    alone at 1 in flight (`match_rate`), and the target's own answers at 1 and at 8 in flight say how much its
    arithmetic depends on the batch (`target_match_rate`): the drafter fails where it changes more than that."""
    rate, own = match_rate(differ_at_1, compared_at_1), match_rate(target_differing, target_serial)
    required = required_match_rate(own)
    if not differ_at_8 and not differ_at_1:
        verdict = IDENTICAL
    elif compared_at_1 < MIN_COMPARED:
        verdict = too_few(compared_at_1)
    else:
        verdict = WITHIN if rate >= required else FAILED
    return {"match_rate": rate, "target_match_rate": own, "match_rate_required": required, "outputs_verdict": verdict}


def too_few(compared: int) -> str:
    return f"{TOO_FEW} ({compared} of {MIN_COMPARED})"


def worst(verdicts) -> str:
    """The worst verdict; of those with too few answers compared, the one with the fewest."""
    return max(verdicts, key=_severity)


def _severity(verdict: str) -> tuple[int, int]:
    if not verdict.startswith(TOO_FEW):
        return VERDICTS.index(verdict), 0
    return VERDICTS.index(TOO_FEW), -int(re.search(r"\((\d+) of", verdict)[1])


def outputs_summary(bench: dict, figures: dict) -> str:
    """One prompt set at one K in words: 'identical', or how many answers differ and the match rates beside the
    target's own (a result from before match rates: the count beside the target's own variance; from before that
    was measured: 'differ'). A second turn's answers are compared only where the first answers were equal: of its
    compared prompts."""
    if figures.get("identical_outputs"):
        return IDENTICAL
    if "outputs_verdict" not in figures:
        return "differ"
    compared = figures.get("compared_prompts", bench["prompts"])
    of = f"{compared} compared" if compared != bench["prompts"] else f"{compared}"
    if "match_rate" not in figures:
        return (f"{figures['differing_outputs']} of {of} differ: {figures['outputs_verdict']} (alone, "
                f"{bench['target_differing_1_vs_8']} of {bench['serial_prompts']} differ at 1 vs 8 in flight)")
    return (f"{figures['differing_outputs']} of {of} differ at 8 in flight; at 1 in flight "
            f"{_share(figures['match_rate'])} equal to plain decoding (the target alone at 1 vs 8 in flight "
            f"{_share(figures['target_match_rate'])}; at least {_share(figures['match_rate_required'])} asked): "
            f"{figures['outputs_verdict']}")


def _share(rate: float | None) -> str:
    return "none compared" if rate is None else f"{rate:.0%}"


def outputs_failure(verify: dict | None) -> tuple[str, str] | None:
    """(the problem, its fix) where a recorded verify failed on its outputs; None where it passed, was skipped, or
    was recorded before match rates (its verdict never failed a run)."""
    if not verify or verify.get("outputs_verdict") != FAILED:
        return None
    failing = [f"{name} K={k}: {outputs_summary(bench, f)}" for name, bench in set_blocks(verify.get("benchmarks", {}))
               for k, f in bench["k"].items() if f.get("outputs_verdict") == FAILED]
    return ("verify: with the drafter, vLLM changes more answers than the target alone does between 1 and 8 in "
            "flight (greedy speculative decoding is lossless up to numerics): " + "; ".join(failing),
            "to tell numerics from a defect, serve the target in float32 (serve.extra_args: [--dtype, float32]) "
            "and verify again (`eyrie retry RUN`, or `eyrie verify --run RUN`): answers that still differ there "
            "point at the serving (vLLM, its speculative config), not at bf16's arithmetic.")


TURN_LABELS = {"2": "turn 2", "both": "turns 1+2"}  # a set's `turns` (its own figures: its first turn)


def set_blocks(benchmarks: dict) -> list[tuple[str, dict]]:
    """(label, figures) per verified prompt set, then its second turn and both turns where it has them (MT-Bench):
    'mt-bench', 'mt-bench turn 2', 'mt-bench turns 1+2'."""
    return [(f"{name} {TURN_LABELS.get(turn, turn)}" if turn else name, block)
            for name, bench in benchmarks.items()
            for turn, block in ((None, bench), *(bench.get("turns") or {}).items())]
