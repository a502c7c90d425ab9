"""verify's figures from its passes (eyrie_trainer.verify asks them): per prompt set and K, vLLM's acceptance from
its spec-decode counters, the answers with the drafter against the target's alone, tokens/s and speedup; for a set
with second turns (MT-Bench: eyrie_trainer.verify_turns) the same per turn, under the set's `turns`.

A pass (Client.one_pass): `outputs` (8 in flight), `serial_outputs` (the first serial prompts, 1 in flight),
`tokens_per_s` and `seconds` at "8" and "1", `counters` (vLLM's before and after the 8-in-flight pass); a second
turn's pass also `asked`: the questions it asked, in order (its outputs are theirs).
"""

from __future__ import annotations

from eyrie.data.verify_outputs import differing, outputs_judged

SECOND, BOTH = "2", "both"  # a set's `turns`: its second turn, and both turns together (the set's own: its first)


def summarize(before: dict, after: dict, k: int) -> dict:
    """vLLM's acceptance between two readings of its counters: mean acceptance length, per draft position."""
    drafts = after["drafts"] - before["drafts"]
    accepted = after["accepted_tokens"] - before["accepted_tokens"]
    per_pos = [(after["per_pos"].get(p, 0.0) - before["per_pos"].get(p, 0.0)) / drafts if drafts else None
               for p in range(k)]
    return {"vllm_acceptance_length": 1 + accepted / drafts if drafts else None, "vllm_drafts": int(drafts),
            "vllm_accepted_tokens": int(accepted), "vllm_per_position_acceptance": per_pos, "k": k}


def counted(before: dict, after: dict) -> dict:
    """What the counters counted between two readings."""
    return {"drafts": after["drafts"] - before["drafts"],
            "accepted_tokens": after["accepted_tokens"] - before["accepted_tokens"],
            "per_pos": {p: n - before["per_pos"].get(p, 0.0) for p, n in after["per_pos"].items()}}


def counted_together(*counters: tuple[dict, dict]) -> tuple[dict, dict]:
    """(before, after) readings that count what several passes' readings counted, together (for summarize)."""
    total = {"drafts": 0.0, "accepted_tokens": 0.0, "per_pos": {}}
    for pair in counters:
        one = counted(*pair)
        total["drafts"] += one["drafts"]
        total["accepted_tokens"] += one["accepted_tokens"]
        for p, n in one["per_pos"].items():
            total["per_pos"][p] = total["per_pos"].get(p, 0.0) + n
    return {"drafts": 0.0, "accepted_tokens": 0.0, "per_pos": {}}, total


def speed(spec_rates: dict, alone_rates: dict) -> dict:
    """Tokens/s with the drafter and its speedup over the target alone, at 1 and at 8 in flight."""
    return {"tokens_per_s": spec_rates,
            "speedup": {n: round(spec_rates[n] / alone_rates[n], 3) if alone_rates[n] else None for n in alone_rates}}


def outputs_compared(alone: tuple[list, list], spec: tuple[list, list], target: tuple[int, int]) -> dict:
    """The answers with the drafter against the target's alone, pairwise: (at 8 in flight, at 1 in flight) each,
    judged beside the target's own (answers differing between 1 and 8 in flight, of its serial prompts)."""
    at_8, at_1 = differing(alone[0], spec[0]), differing(alone[1], spec[1])
    return {"identical_outputs": at_8 == 0 and at_1 == 0, "differing_outputs": at_8, "differing_outputs_at_1": at_1,
            **outputs_judged(at_8, at_1, len(alone[1]), *target)}


def benchmark_result(alone: dict, drafted: dict[int, dict], prompts: int) -> dict:
    """One prompt set: the target alone's pass against the drafter's at each K (the first turn, for a set with
    second turns: theirs under `turns`)."""
    serial = len(alone["serial_outputs"])
    target_differing = differing(alone["serial_outputs"], alone["outputs"])
    by_k = {}
    for k, spec in drafted.items():
        by_k[str(k)] = {**summarize(*spec["counters"], k),
                        **outputs_compared((alone["outputs"], alone["serial_outputs"]),
                                           (spec["outputs"], spec["serial_outputs"]), (target_differing, serial)),
                        **speed(spec["tokens_per_s"], alone["tokens_per_s"])}
    result = {"prompts": prompts, "serial_prompts": serial, "target_differing_1_vs_8": target_differing,
              "tokens_per_s_target": alone["tokens_per_s"], "k": by_k}
    if "second_turn" in alone:
        second = second_turn_result(alone, {k: spec for k, spec in drafted.items()})
        result["turns"] = {SECOND: second, BOTH: both_turns_result(result, second, alone, drafted)}
    return result


def second_turn_result(alone: dict, drafted: dict[int, dict]) -> dict:
    """The second turn: each server asked it after its own first answers, so its answers are compared only on the
    questions whose first answers were equal (the same second prompt): `compared_prompts` says how many."""
    own = alone["second_turn"]
    target_differing = differing(own["serial_outputs"], own["outputs"])
    by_k = {}
    for k, spec in drafted.items():
        theirs = spec["second_turn"]
        same_first = {q for q, (a, b) in enumerate(zip(alone["outputs"], spec["outputs"])) if a == b}
        at_8 = _paired(own["asked"], own["outputs"], theirs["asked"], theirs["outputs"], same_first)
        at_1 = _paired(own["asked"], own["serial_outputs"], theirs["asked"], theirs["serial_outputs"], same_first)
        by_k[str(k)] = {**summarize(*theirs["counters"], k), "prompts": len(theirs["asked"]),
                        "compared_prompts": len(at_8[0]), "compared_prompts_at_1": len(at_1[0]),
                        **outputs_compared((at_8[0], at_1[0]), (at_8[1], at_1[1]),
                                           (target_differing, len(own["serial_outputs"]))),
                        **speed(theirs["tokens_per_s"], own["tokens_per_s"])}
    return {"prompts": len(own["asked"]), "questions": own["questions"], "serial_prompts": len(own["serial_outputs"]),
            "target_differing_1_vs_8": target_differing, "tokens_per_s_target": own["tokens_per_s"], "k": by_k}


def _paired(asked_a: list[int], outputs_a: list, asked_b: list[int], outputs_b: list, questions: set) -> tuple[list, list]:
    """Two servers' answers to the questions both asked that are in `questions`, side by side."""
    theirs = dict(zip(asked_b, outputs_b))
    pairs = [(a, theirs[q]) for q, a in zip(asked_a, outputs_a) if q in theirs and q in questions]
    return [a for a, _ in pairs], [b for _, b in pairs]


def both_turns_result(first: dict, second: dict, alone: dict, drafted: dict[int, dict]) -> dict:
    """Both turns together: acceptance over the two 8-in-flight passes' counters, tokens/s over both passes' tokens
    and seconds, and the two turns' answer comparisons summed and judged together (each turn is judged too)."""
    target_rates = joint_rates(alone, alone["second_turn"])
    by_k = {}
    for k, spec in drafted.items():
        one, two = first["k"][str(k)], second["k"][str(k)]
        by_k[str(k)] = {**summarize(*counted_together(spec["counters"], spec["second_turn"]["counters"]), k),
                        "prompts": first["prompts"] + two["prompts"],
                        "compared_prompts": first["prompts"] + two["compared_prompts"],
                        "identical_outputs": one["identical_outputs"] and two["identical_outputs"],
                        "differing_outputs": one["differing_outputs"] + two["differing_outputs"],
                        "differing_outputs_at_1": one["differing_outputs_at_1"] + two["differing_outputs_at_1"],
                        **both_judged(first, second, one, two),
                        **speed(joint_rates(spec, spec["second_turn"]), target_rates)}
    return {"prompts": first["prompts"] + second["prompts"], "serial_prompts": first["serial_prompts"] + second["serial_prompts"],
            "target_differing_1_vs_8": first["target_differing_1_vs_8"] + second["target_differing_1_vs_8"],
            "tokens_per_s_target": target_rates, "k": by_k}


def both_judged(first: dict, second: dict, one: dict, two: dict) -> dict:
    """Both turns' answers judged together: the first turn's serial prompts and the second's compared ones at 1 in
    flight, beside the target's own serial prompts of both turns."""
    return outputs_judged(one["differing_outputs"] + two["differing_outputs"],
                          one["differing_outputs_at_1"] + two["differing_outputs_at_1"],
                          first["serial_prompts"] + two["compared_prompts_at_1"],
                          first["target_differing_1_vs_8"] + second["target_differing_1_vs_8"],
                          first["serial_prompts"] + second["serial_prompts"])


def joint_rates(*passes: dict) -> dict:
    """Tokens/s over several passes: their answers' tokens over their seconds, at 8 and at 1 in flight."""
    tokens = {"8": sum(sum(map(len, p["outputs"])) for p in passes),
              "1": sum(sum(map(len, p["serial_outputs"])) for p in passes)}
    seconds = {n: sum(p["seconds"][n] for p in passes) for n in tokens}
    return {n: round(tokens[n] / seconds[n], 2) if seconds[n] else 0.0 for n in tokens}


def k_figures(bench: dict) -> list[dict]:
    """A set's figures at every K, its turns' included."""
    return [f for block in (bench, *(bench.get("turns") or {}).values()) for f in block["k"].values()]
