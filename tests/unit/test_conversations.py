"""Every assistant turn regenerated (`generate.turns: all`): a row's requests, the conversation asked
turn by turn with the target's own answers in the context, the record that keeps each turn, and
the loss mask that covers every answer and never a user turn. No server: `ask` stands in for the
chat client, whose real requests the generate e2e tests make."""

import asyncio
import json


from eyrie.data.prompts import Skip, to_turns
from eyrie_extractor.render import Rendered, fit, render
from eyrie_generator.client import Completion
from eyrie_generator.conversation import answer_turns
from eyrie_trainer.data import sample_loss_mask

THINK = ("<think>", "</think>")
ROW = {"conversations": [{"from": "system", "value": "S"}, {"from": "human", "value": "U1"},
                         {"from": "gpt", "value": "DATASET-A1"}, {"from": "human", "value": "U2"},
                         {"from": "gpt", "value": "DATASET-A2"}, {"from": "human", "value": "U3"}]}


def test_all_turns_ask_each_user_turn_without_the_datasets_answers():
    assert to_turns(ROW, "all") == [[{"role": "system", "content": "S"}, {"role": "user", "content": "U1"}],
                                    [{"role": "user", "content": "U2"}], [{"role": "user", "content": "U3"}]]
    last = to_turns(ROW, "last")
    assert len(last) == 1 and [m["content"] for m in last[0]] == ["S", "U1", "DATASET-A1", "U2", "DATASET-A2", "U3"]
    # user turns with no answer between them are asked together; an empty one asked is refused
    together = {"messages": [{"role": "user", "content": "a"}, {"role": "user", "content": "b"},
                             {"role": "assistant", "content": "x"}, {"role": "user", "content": "c"}]}
    assert [[m["content"] for m in r] for r in to_turns(together)] == [["a", "b"], ["c"]]
    empty = {"messages": [{"role": "user", "content": " "}, {"role": "assistant", "content": "x"},
                          {"role": "user", "content": "c"}]}
    assert to_turns(empty) == Skip("empty_prompt") and to_turns({"messages": []}) == Skip("empty_conversation")


def _asker(outcomes: dict[int, Completion] | None = None):
    """Answers request i with `own answer i` and prompt/completion ids that extend each other, as a
    server's would; `outcomes` replaces the answer to some requests (a failure, a skip)."""
    asked = []

    async def ask(messages):
        asked.append([dict(m) for m in messages])
        i = len(asked)
        if outcomes and i in outcomes:
            return outcomes[i]
        prompt = [100 + len(m["content"]) for m in messages]
        return Completion("done", content=f"own answer {i}", finish_reason="stop", attempts=1, latency_s=0.5,
                          usage={"prompt_tokens": len(prompt), "completion_tokens": 2},
                          prompt_token_ids=prompt, completion_token_ids=[i, 2])
    return ask, asked


def test_each_turn_is_asked_after_the_targets_own_answer_and_every_turn_is_kept():
    ask, asked = _asker()
    record = asyncio.run(answer_turns(to_turns(ROW), ask))
    assert [m["content"] for m in asked[1]] == ["S", "U1", "own answer 1", "U2"]
    assert [m["content"] for m in asked[2]] == ["S", "U1", "own answer 1", "U2", "own answer 2", "U3"]
    assert record["status"] == "done" and record["messages"] == asked[2] and record["content"] == "own answer 3"
    assert [t["content"] for t in record["turns"]] == ["own answer 1", "own answer 2", "own answer 3"]
    assert [t["completion_token_ids"] for t in record["turns"]] == [[1, 2], [2, 2], [3, 2]]
    assert record["usage"] == {"prompt_tokens": 2 + 4 + 6, "completion_tokens": 6} and record["attempts"] == 3
    assert "DATASET" not in repr(record)
    single, _ = _asker()
    one = asyncio.run(answer_turns(to_turns({"messages": [{"role": "user", "content": "q"}]}), single))
    assert "turns" not in one and one["content"] == "own answer 1"  # a one-turn record is as it always was


def test_a_turn_that_fails_fails_the_sample_naming_the_turn_and_a_turn_that_cannot_fit_ends_it():
    ask, _ = _asker({2: Completion("failed", error="HTTP 400: bad", attempts=1)})
    failed = asyncio.run(answer_turns(to_turns(ROW), ask))
    assert failed["status"] == "failed" and failed["error"] == "turn 2 of 3: HTTP 400: bad"
    assert [t["content"] for t in failed["turns"]] == ["own answer 1"]
    ask, _ = _asker({3: Completion("skipped", reason="prompt_too_long")})
    cut = asyncio.run(answer_turns(to_turns(ROW), ask))
    assert cut["status"] == "done" and cut["turns_cut"] == {"turn": 3, "of": 3, "reason": "prompt_too_long"}
    assert [t["content"] for t in cut["turns"]] == ["own answer 1", "own answer 2"]
    assert [m["content"] for m in cut["messages"]] == ["S", "U1", "own answer 1", "U2"]  # the last answer's request
    ask, _ = _asker({1: Completion("skipped", reason="prompt_too_long")})
    assert asyncio.run(answer_turns(to_turns(ROW), ask))["status"] == "skipped"


def _templated_record(tokenizer) -> dict:
    messages = [{"role": "user", "content": "Add 2 and 3."}, {"role": "assistant", "content": "It is 5."},
                {"role": "user", "content": "And 4 more?"}]
    return {"messages": messages, "content": "It is 9.", "finish_reason": "stop",
            "turns": [{"content": "It is 5.", "finish_reason": "stop"}, {"content": "It is 9.", "finish_reason": "stop"}]}


def test_the_loss_mask_covers_every_answer_and_no_user_turn(tokenizer):
    r = render(_templated_record(tokenizer), tokenizer, THINK)
    assert r.source == "chat_template" and len(r.spans) == 2 and r.turns_unsupervised == 0
    answers = [tokenizer.decode(r.input_ids[s:e]) for s, e in r.spans]
    assert answers == ["It is 5.<|eos|>", "It is 9.<|eos|>"]
    mask = sample_loss_mask({"prompt_len": r.prompt_len, "spans": r.spans, "seq_len": len(r.input_ids)})
    supervised = tokenizer.decode([t for t, m in zip(r.input_ids, mask) if m])
    assert supervised == "It is 5.<|eos|>It is 9.<|eos|>"
    unsupervised = tokenizer.decode([t for t, m in zip(r.input_ids, mask) if not m])
    assert "Add 2 and 3." in unsupervised and "And 4 more?" in unsupervised
    # a one-answer sample, as stored before spans existed: everything after the prompt
    assert sample_loss_mask({"prompt_len": 3, "seq_len": 5}) == [0, 0, 0, 1, 1]


def test_server_token_ids_give_the_spans_and_a_rerendered_earlier_answer_is_counted(tokenizer):
    templated = render(_templated_record(tokenizer), tokenizer, THINK)
    (s1, e1), (s2, _) = templated.spans
    ids = templated.input_ids
    written = _templated_record(tokenizer)["turns"]
    turns = [{**written[0], "prompt_token_ids": ids[:s1], "completion_token_ids": ids[s1:e1]},
             {**written[1], "prompt_token_ids": ids[:s2], "completion_token_ids": ids[s2:]}]
    exact = render({**_templated_record(tokenizer), "turns": turns, **turns[-1]}, tokenizer, THINK)
    assert (exact.source, exact.spans, exact.mismatch) == ("server_token_ids", templated.spans, False)
    # the first answer as generated differs from what the template put back in the context (its
    # reasoning dropped, or other tokens): supervised as the context holds it, to its end-of-turn token
    other = [{**turns[0], "completion_token_ids": [7, 7] + ids[e1 - 1:e1]}, turns[1]]
    r = render({**_templated_record(tokenizer), "turns": other, **other[-1]}, tokenizer, THINK)
    assert r.spans == templated.spans and (r.turns_rerendered, r.turns_unsupervised) == (1, 0)
    # cut at max_tokens (no end-of-turn token): as far as the context holds its tokens
    cut = [{**turns[0], "finish_reason": "length", "completion_token_ids": ids[s1:s1 + 2] + [7]}, turns[1]]
    r = render({**_templated_record(tokenizer), "turns": cut, **cut[-1]}, tokenizer, THINK)
    assert r.spans == [[s1, s1 + 2], [s2, len(ids)]] and r.turns_rerendered == 1
    # a request whose prompt the final context does not begin with cannot be placed: counted
    moved = [{**turns[0], "prompt_token_ids": [9] + ids[1:s1]}, turns[1]]
    r = render({**_templated_record(tokenizer), "turns": moved, **moved[-1]}, tokenizer, THINK)
    assert r.spans == [[s2, len(ids)]] and r.turns_unsupervised == 1


def test_a_reasoning_answer_put_back_without_its_reasoning_is_supervised_as_the_context_holds_it(tokenizer):
    record = _templated_record(tokenizer)
    record["turns"][0]["reasoning"] = "2 plus 3 is 5."
    r = render(record, tokenizer, THINK)
    assert r.turns_rerendered == 1 and len(r.spans) == 2
    assert [tokenizer.decode(r.input_ids[s:e]).replace("<think></think>", "") for s, e in r.spans] == \
        ["It is 5.<|eos|>", "It is 9.<|eos|>"]


def test_long_samples_rule_keeps_the_spans_inside():
    r = Rendered(list(range(12)), [[2, 4], [6, 12]], "chat_template")
    cut, note = fit(r, 8)
    assert note == "truncated" and cut.spans == [[2, 4], [6, 8]] and cut.prompt_len == 2
    cut, _ = fit(r, 5)  # cut inside the user turn after the first answer: that turn's tokens feed nothing
    assert cut.spans == [[2, 4]] and cut.input_ids == [0, 1, 2, 3]
    assert fit(r, 2) == (None, "prompt_exceeds_max_length")


def test_the_plan_says_what_generating_costs_in_requests(tmp_path):
    from eyrie.data.dataset import resolve
    from eyrie.runs.plan_inputs import requests

    rows = tmp_path / "rows.jsonl"
    rows.write_text("\n".join(json.dumps(r) for r in [ROW, {"messages": [{"role": "user", "content": "q"}]}]) + "\n")
    ref = resolve(str(rows))
    assert requests(2, ref, "all")["statement"] == "generate.turns all: ~4 requests (2.00 a row, one per user turn)"
    assert requests(2, ref, "last")["requests"] == 2
    assert requests(2, None, "all")["statement"] == "generate.turns all: one per user turn"  # a hub dataset
