"""What many tests build the same way, in one place: a run manifest planned as far as a test needs
(`make_manifest`) and an inference endpoint published in Redis (`publish_endpoint`). Workers are
started with harness's `start_worker` or the `workers` fixture."""

from __future__ import annotations

from eyrie.data.manifest import (DatasetRef, ExtractParams, GenerateParams, Layout, RunManifest, SamplingParams,
                                 ShardPlan, TargetRef, TrainParams)
from eyrie.work import inference
from tests.support.harness import TINY


def make_manifest(run: str, rows: int = 4, *, shard_size: int | None = None, server: str = "vllm",
                  source: str = "d", max_tokens: int = 8, concurrency: int = 1, max_retries: int = 1,
                  extract: dict | None = None, train: dict | None = None, **fields) -> RunManifest:
    """A run manifest of `rows` rows on the tiny target, in shards of `shard_size` (default: one shard).
    `extract`/`train`: the plan's fields that differ from a small bf16 plan of layers [2, 4, 5]
    (None: that stage is not planned). `fields`: any other of the manifest's fields."""
    shard_size = shard_size or rows
    layout = Layout(run)
    shards = [ShardPlan(index=i, row_start=start, row_end=min(start + shard_size, rows),
                        input_key=layout.generate_input(i), input_sha256="0" * 64)
              for i, start in enumerate(range(0, rows, shard_size))]
    manifest = {
        "run": run, "created_at": "now", "code_version": "test",
        "target": TargetRef(model=str(TINY), revision="r", chat_template_sha256=None, server=server),
        "dataset": DatasetRef(source=source, kind="jsonl", revision="r", row_end=rows),
        "generate": GenerateParams(sampling=SamplingParams(max_tokens=max_tokens), concurrency=concurrency,
                                   request_timeout_s=60, max_retries=max_retries, shard_size=shard_size),
        "generate_shards": shards, **fields}
    if extract is not None:
        manifest["extract"] = ExtractParams(**{
            "backend": "vllm", "aux_layers": [2, 4, 5], "dtype": "bf16", "max_length": None, "num_layers": 8,
            "hidden_size": 64, "samples": rows, "tokens": 16 * rows, "truncated": 0, "projected_bytes": 1,
            "budget_bytes": None, **extract})
    if train is not None:
        manifest["train"] = TrainParams(**{
            "epochs": 1, "draft_vocab": 500, "vocab_mapping": "frequency", "lr": 1e-3, "total_seq_len": 256,
            "train_samples": rows - 1, "heldout_samples": 1, "speculators_version": "test", **train})
    return RunManifest(**manifest)


def publish_endpoint(conn, model: str, url: str = "http://127.0.0.1:9", *, name: str = "default",
                     server: str = "vllm", state: str = "ready", served_as: str | None = None,
                     extract: bool = False) -> inference.Endpoint:
    """An endpoint as `eyrie serve` (or, `extract`, `eyrie serve-extract`) publishes it: the target's
    revision and chat template read from `model`'s files; `served_as`: the name the server answers to."""
    from eyrie.core.target import describe

    info = describe(model)
    endpoint = inference.Endpoint(name=name, url=url, model=served_as or info.model, server=server, state=state,
                                  revision=info.revision, chat_template_sha256=info.chat_template_sha256)
    (inference.publish_extract if extract else inference.publish)(conn, endpoint)
    return endpoint
