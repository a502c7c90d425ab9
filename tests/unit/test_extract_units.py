"""Extract's pieces: rendering and its agreement check, the long-sample rule, aux layers,
token-budget batching, sizes and the storage projection."""

import pytest

from eyrie.core.budget import bytes_per_token, check_fits, parse_size
from eyrie.core.errors import EyrieError
from eyrie.core.layers import default_aux_layers, resolve_aux_layers
from eyrie_extractor.capture import token_budget_batches
from eyrie_extractor.render import Rendered, fit, render

THINK = ("<think>", "</think>")
RECORD = {"messages": [{"role": "user", "content": "What is 4 plus 7?"}], "reasoning": "4 plus 7 is 11.",
          "content": "The answer is 11.", "finish_reason": "stop"}


def test_template_rendering_puts_reasoning_in_think_markers(tokenizer):
    r = render(RECORD, tokenizer, THINK)
    assert r.source == "chat_template" and not r.mismatch
    assert tokenizer.decode(r.input_ids[r.prompt_len:]) == \
        "<think>4 plus 7 is 11.</think>The answer is 11.<|eos|>"
    assert tokenizer.decode(r.input_ids[: r.prompt_len]).endswith("<|assistant|>")


def test_server_token_ids_win_and_disagreement_is_counted(tokenizer):
    templated = render(RECORD, tokenizer, THINK)
    same = {**RECORD, "prompt_token_ids": templated.input_ids[: templated.prompt_len],
            "completion_token_ids": templated.input_ids[templated.prompt_len:]}
    r = render(same, tokenizer, THINK)
    assert (r.source, r.mismatch, r.input_ids) == ("server_token_ids", False, templated.input_ids)
    other = {**same, "completion_token_ids": [5, 6, 7]}
    r = render(other, tokenizer, THINK)
    assert r.source == "server_token_ids" and r.mismatch and r.input_ids[-3:] == [5, 6, 7]


def test_long_samples_rule():
    r = Rendered(list(range(10)), [[4, 10]], "chat_template")
    assert fit(r, None) == (r, None) and fit(r, 10) == (r, None)
    cut, note = fit(r, 6)
    assert note == "truncated" and cut.input_ids == list(range(6)) and cut.prompt_len == 4
    assert fit(r, 4) == (None, "prompt_exceeds_max_length")


def test_aux_layers():
    assert default_aux_layers(61) == [2, 30, 58]  # the seed's Kimi-K2.5 layers
    assert resolve_aux_layers(None, 8) == [2, 4, 5]
    with pytest.raises(EyrieError, match="not distinct"):
        resolve_aux_layers(None, 4)  # [2, 2, 1]: tiny targets need explicit layers
    with pytest.raises(EyrieError, match=r"out of range \[0, 8\]"):
        resolve_aux_layers([1, 9], 8)


def test_token_budget_batches_sorted_and_bounded():
    lengths = [5, 50, 20, 45, 10, 30]
    batches = token_budget_batches(list(range(6)), lengths, 100)
    assert sorted(i for b in batches for i in b) == list(range(6))
    for batch in batches:
        assert max(lengths[i] for i in batch) * len(batch) <= 100 or len(batch) == 1
    assert batches[0][0] == 1  # longest first


def test_sizes_and_projection():
    assert parse_size("2.8TB") == 2_800_000_000_000 and parse_size("64GiB") == 64 * 2**30
    with pytest.raises(EyrieError, match="2.8TB"):
        parse_size("lots")
    assert bytes_per_token(4, 7168, "bf16") == 4 * 7168 * 2 + 8
    assert bytes_per_token(4, 7168, "fp8") / bytes_per_token(4, 7168, "bf16") < 0.51
    # The seed: 25k samples x ~3.6k tokens at Kimi's width: 5.2 TB in bf16 does not fit 2.8 TB; fp8 does.
    with pytest.raises(EyrieError, match=r"needs 5\.\d+ TB .* is 2\.80 TB.*--dtype fp8 \(2\.\d+ TB, fits\)"):
        check_fits(90_000_000, 25_000, 4, 7168, "bf16", parse_size("2.8TB"), None)
    assert check_fits(90_000_000, 25_000, 4, 7168, "fp8", parse_size("2.8TB"), None) < 2.8e12
