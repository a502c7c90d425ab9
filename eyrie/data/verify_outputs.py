"""Whether the drafter changed the target's answers in `eyrie verify`, judged beside the target's own batch variance."""

from __future__ import annotations

IDENTICAL = "identical"
WITHIN = "within the target's own batch variance"
BEYOND = "differ beyond the target's own batch variance"
VERDICTS = [IDENTICAL, WITHIN, BEYOND]  # worst last


def differing(a: list[list[int]], b: list[list[int]]) -> int:
    """How many answers differ, pairwise."""
    return sum(x != y for x, y in zip(a, b))


def outputs_verdict(drafter_differing: int, target_differing: int) -> str:
    """Greedy speculative decoding is lossless up to numerics (vLLM's docs), and with 8 in flight each answer is
    computed in batches whose shape changes as requests come and go. Where the target by itself answers differently
    at 1 and at 8 in flight (bf16 on a CPU does, on most prompts), its arithmetic depends on the batch, and answers
    that part with the drafter are that variance (how many differ is no measure of the drafter: a near-tie flips or
    not). Where the target alone is batch-invariant (float32), any difference is beyond it: worth a look."""
    if not drafter_differing:
        return IDENTICAL
    return WITHIN if target_differing else BEYOND


def worst(verdicts) -> str:
    return max(verdicts, key=VERDICTS.index)


def outputs_summary(bench: dict, figures: dict) -> str:
    """One prompt set at one K in words: 'identical', or how many answers differ beside the target's own variance
    (a result from before the variance was measured: 'differ'). A second turn's answers are compared only where
    the first answers were equal: of its compared prompts."""
    if figures.get("identical_outputs"):
        return IDENTICAL
    if "outputs_verdict" not in figures:
        return "differ"
    compared = figures.get("compared_prompts", bench["prompts"])
    of = f"{compared} compared" if compared != bench["prompts"] else f"{compared}"
    return (f"{figures['differing_outputs']} of {of} differ: {figures['outputs_verdict']} (alone, "
            f"{bench['target_differing_1_vs_8']} of {bench['serial_prompts']} differ at 1 vs 8 in flight)")


TURN_LABELS = {"2": "turn 2", "both": "turns 1+2"}  # a set's `turns` (its own figures: its first turn)


def set_blocks(benchmarks: dict) -> list[tuple[str, dict]]:
    """(label, figures) per verified prompt set, then its second turn and both turns where it has them (MT-Bench):
    'mt-bench', 'mt-bench turn 2', 'mt-bench turns 1+2'."""
    return [(f"{name} {TURN_LABELS.get(turn, turn)}" if turn else name, block)
            for name, bench in benchmarks.items()
            for turn, block in ((None, bench), *(bench.get("turns") or {}).items())]
