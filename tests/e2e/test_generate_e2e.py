"""End to end on the embedded default: real Redis, real `transformers serve` on the tiny target
(published by `eyrie serve`), real workers, both store backends; a dataset mixing good and
malformed rows, every row accounted for exactly."""

import json

import orjson

from eyrie.core.config import load_settings
from eyrie.data.manifest import Layout, RunManifest
from eyrie.data.store import open_store
from tests.support.harness import TINY, eyrie

GOOD = [
    {"conversations": [{"from": "human", "value": "What is 4 plus 7?"}]},
    {"conversations": [{"from": "system", "value": "You are a helpful assistant."},
                       {"from": "human", "value": "What is the opposite of dark?"}]},
    {"messages": [{"role": "user", "content": "Say hello to Rosa."}]},
    {"conversations": [{"role": "user", "content": "Add 8 and 4."},  # the target answers both turns
                       {"role": "assistant", "content": "DATASET-SENTINEL-1 is never asked or stored"},
                       {"role": "user", "content": "Say hello to Mia."},
                       {"role": "assistant", "content": "DATASET-SENTINEL-2 is never asked or stored"}]},
]
BAD = [  # (raw line, the reason it must be skipped with)
    (b"", "empty_line"),
    (b"{not json", "invalid_json"),
    (b'{"conversations": [{"from": "human", "value": "caf\xe9"}]}', "not_utf8"),
    (b"{}", "no_conversation_field"),
    (b'{"conversations": "hello"}', "conversation_not_a_list"),
    (b'{"conversations": []}', "empty_conversation"),
    (b'{"conversations": [{"from": "wizard", "value": "hi"}]}', "unknown_role"),
    (b'{"conversations": [{"from": "human", "value": null}]}', "null_text"),
    (b'{"conversations": [{"from": "system", "value": "s"}, {"from": "gpt", "value": "a"}]}', "no_human_turn"),
    (b'{"conversations": [{"from": "human", "value": "   "}]}', "empty_prompt"),
    (b'[1, 2]', "row_not_an_object"),
    (json.dumps({"conversations": [{"from": "human", "value": "word " * 800}]}).encode(), "prompt_too_long"),
]


def test_generate_accounts_for_every_row(env, tiny_server, tmp_path):
    lines = [json.dumps(row).encode() for row in GOOD] + [raw for raw, _ in BAD]
    data = tmp_path / "mixed.jsonl"
    data.write_bytes(b"\n".join(lines) + b"\n")

    out = eyrie("generate", "--dataset", str(data), "--run", "mixed", "--concurrency", "4",
                "--max-tokens", "96", "--shard-size", "5", env=env)
    assert "16 rows in 4 shards; 4 tasks enqueued now" in out.stdout
    eyrie("worker", "generate", "--burst", env=env, timeout=600)

    store, layout = open_store(load_settings()), Layout("mixed")
    records = []
    for shard in range(4):
        manifest = store.get_json(layout.generate_shard_manifest(shard))
        raw = store.get_verified(manifest["object"], manifest["sha256"])
        records += [orjson.loads(line) for line in raw.splitlines()]
        assert not store.list(layout.generate_parts(shard)), "parts are removed once the shard is done"

    assert [r["row"] for r in records] == list(range(16))
    done = [r for r in records if r["status"] == "done"]
    skipped = {r["row"]: r["reason"] for r in records if r["status"] == "skipped"}
    assert len(done) == len(GOOD)
    assert skipped == {len(GOOD) + i: reason for i, (_, reason) in enumerate(BAD)}
    assert not [r for r in records if r["status"] == "failed"]

    for r in done:  # the tiny target answers in its trained shape, reasoning split by the server
        assert r["reasoning_source"] == "reasoning_content" and r["reasoning"]
        assert r["content"] and "<think>" not in r["content"]
        assert r["finish_reason"] == "stop" and r["usage"]["completion_tokens"] > 0
    by_row = {r["row"]: r for r in done}
    assert "11" in by_row[0]["content"]
    assert by_row[1]["messages"][0] == {"role": "system", "content": "You are a helpful assistant."}
    conversation = by_row[3]  # every turn answered by the target, its own first answer in the context
    assert [m["role"] for m in conversation["messages"]] == ["user", "assistant", "user"]
    assert [t["finish_reason"] for t in conversation["turns"]] == ["stop", "stop"]
    assert conversation["messages"][1]["content"] == conversation["turns"][0]["content"]
    assert conversation["content"] == conversation["turns"][1]["content"]
    assert conversation["usage"]["completion_tokens"] == sum(t["usage"]["completion_tokens"]
                                                             for t in conversation["turns"])
    assert "DATASET-SENTINEL" not in json.dumps(records)

    status = json.loads(eyrie("status", "mixed", "--json", env=env).stdout)
    gen = status["stages"]["generate"]
    assert gen["state"] == "done"
    assert (gen["total"], gen["done"], gen["skipped"], gen["failed"]) == (16, 4, 12, 0)
    assert gen["tokens"] == sum(r["usage"]["completion_tokens"] for r in done)
    assert gen["skip_reasons"] == {reason: 1 for _, reason in BAD}

    run = RunManifest.model_validate(store.get_json(layout.manifest))
    assert run.dataset.kind == "jsonl" and len(run.dataset.revision) == 64
    assert run.target.server == "transformers" and run.target.chat_template_sha256
    assert run.generate.sampling.max_tokens == 96 and run.code_version
    assert [s.row_end for s in run.generate_shards] == [5, 10, 15, 16]
    human = eyrie("status", "mixed", env=env).stdout
    assert "generate" in human and "done" in human


def test_token_ids_not_sent_again_to_a_server_that_rejects_them(env, tiny_server, tmp_path):
    """Told the server is vLLM, the client asks for token ids; the real transformers serve answers
    422 to the unknown field, so the client drops it and the samples are still answered."""
    data = tmp_path / "p.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in GOOD[:2]))
    wrong = {**env, "EYRIE_INFERENCE_URL": tiny_server.url, "EYRIE_SERVER": "vllm", "EYRIE_MODEL": str(TINY)}
    eyrie("generate", "--dataset", str(data), "--run", "fallback", "--max-tokens", "64", env=wrong)
    eyrie("worker", "generate", "--burst", env=wrong, timeout=300)
    store, layout = open_store(load_settings()), Layout("fallback")
    manifest = store.get_json(layout.generate_shard_manifest(0))
    assert manifest["counts"]["done"] == 2 and manifest["counts"]["failed"] == 0
