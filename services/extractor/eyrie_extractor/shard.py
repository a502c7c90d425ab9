"""One extract task: a generate shard's samples through the target, hidden states to the store
(extract.storage hybrid or online: some or all samples as their token ids alone, no forward pass;
training asks the vLLM extraction service for their states: eyrie_extractor.storage_split).

The forward pass of batch k+1 runs while batch k is copied to the host, serialized and uploaded
by a small thread pool (at most two batches waiting: bounded memory). Results go to the store
in parts as they land, so a retried task forwards only what is missing; the shard manifest
(the proof of completion) is written last.
"""

from __future__ import annotations

import socket
from concurrent.futures import Future, ThreadPoolExecutor
from functools import lru_cache

import redis
import torch
from safetensors.torch import save

from eyrie.core.config import Settings
from eyrie.core.errors import EyrieError
from eyrie.core.target import load_tokenizer
from eyrie.data.manifest import Counts, ExtractParams
from eyrie.stages import EXTRACT
from eyrie.tasks.executor import execute
from eyrie.tasks.gpu_admission import gpu_lease
from eyrie.tasks.sharded import ShardedStageTask
from eyrie.work.cancel import Cancelled, Stopping
from eyrie.work.extract_server import on_demand, server_url, stopped_answering
from eyrie.work.gpu import pick_device
from eyrie.work.queue import LEASE_TTL_S
from eyrie.work.worker_loop import stop_requested
from eyrie_extractor.capture import HFCapture, token_budget_batches
from eyrie_extractor.plan import generated_records
from eyrie_extractor.render import fit, render
from eyrie_extractor.storage_split import split
from eyrie_extractor.tasks import ExtractTask
from eyrie_extractor.vllm_backend import VllmCapture, VllmCaptureError

MAX_PENDING_BATCHES = 2
IDS_PER_PART = 64  # token-ids-only samples stored between two parts (and cancel checks)
TURN_COUNTS = ("spans", "turns_rerendered", "turns_unsupervised")  # what a multi-turn sample adds


def ids_tensors(input_ids: list[int]) -> dict[str, torch.Tensor]:
    """token_ids int64 [seq], as speculators reads them: all an ids-only sample's object holds."""
    return {"token_ids": torch.tensor(input_ids, dtype=torch.long)}


def sample_tensors(states: torch.Tensor, input_ids: list[int], dtype: str) -> dict[str, torch.Tensor]:
    """speculators' per-sample file: hidden_states [seq, n_aux+1, H], token_ids int64 [seq]
    (fp8: e4m3 with one fp32 scale per token, as hs-connectors' fp8 connector writes)."""
    tensors = ids_tensors(input_ids)
    if dtype == "fp8":
        from hs_connectors.fp8_utils import SCALES_KEY, quantize_tensor_to_fp8

        fp8, scales = quantize_tensor_to_fp8(states)
        tensors.update({"hidden_states": fp8.contiguous(), SCALES_KEY: scales.contiguous()})
    else:
        tensors["hidden_states"] = states.to(torch.bfloat16).contiguous()
    return tensors


@lru_cache(maxsize=1)
def loaded_capture(model: str, aux_layers: tuple[int, ...], device: str, params_backend: str = "hf",
                   num_layers: int = 0, hidden_size: int = 0, url: str | None = None,
                   timeout_s: float = 1800.0, trust_remote_code: bool = False):
    """The capture backend, loaded once per worker process and kept for the next task."""
    if params_backend == "vllm":
        if not url:
            raise EyrieError("extract --backend vllm needs EYRIE_EXTRACT_VLLM_URL.",
                             "start the server (docs/vllm-extraction.md) and set EYRIE_EXTRACT_VLLM_URL.")
        return VllmCapture(url, model, list(aux_layers), num_layers, hidden_size, timeout_s)
    return HFCapture(model, list(aux_layers), device, trust_remote_code=trust_remote_code)


def extractor_gpu_lease(settings: Settings, conn: redis.Redis, device: str):
    """The extractor's GPU lease: its release drops the cached target from the device first."""
    return gpu_lease(settings, conn, f"extractor@{socket.gethostname()}", device, caches=(loaded_capture,))


class ExtractRunner(ShardedStageTask):
    """One extract shard; the executor (eyrie.tasks.executor) holds its leases and checks for its manifest.
    Its parts, counts and shard manifest are eyrie.tasks.sharded's; its own are the forward passes."""

    stage, Payload = EXTRACT, ExtractTask
    gpu_owner, gpu_caches = "extractor", (loaded_capture,)

    @property
    def params(self) -> ExtractParams:
        return self.manifest.extract

    def devices(self) -> str | None:
        # vLLM holds the GPUs itself when it extracts: this worker then needs no lease
        self.device = "cpu" if self.params.backend == "vllm" else pick_device(self.settings.device)
        return self.device if self.device.startswith("cuda") else None  # CPU-only runs need no GPU lease

    def on_cancel(self) -> dict:
        self._report()
        return self.result("cancelled", **self._counts().model_dump())

    def _vllm_url(self) -> str | None:
        """The configured vLLM extraction server, else the one the stack's extract-server published,
        waited for (eyrie.work.extract_server: shown in status, bounded, ended by a cancel or SIGTERM)."""
        if self.params.backend != "vllm":
            return None
        url = server_url(self.settings, self.conn, self.report_waiting, self.cancelled)
        self._report()  # no longer waiting
        return url

    def _forward(self, capture, input_ids: list[list[int]]) -> torch.Tensor:
        """One batch through the target; a vLLM server that stopped answering is named dead."""
        try:
            return capture.forward(input_ids)
        except VllmCaptureError as exc:
            dead = stopped_answering(self.conn, capture.endpoint_url, exc, self.shard)
            if dead is not None:
                raise dead from exc
            raise

    def run(self) -> dict:
        self.resume()
        todo = self._render_todo()
        with_states, ids_only = split(self.params, self.records.values(), todo)
        self._store_ids_only(ids_only)
        if with_states:  # no server is waited for, nor a target loaded, where none is needed
            self._extract(with_states)
        self._flush()
        return self._finish()

    def _store_ids_only(self, items: list[dict]) -> None:
        """Samples whose states training asks the extraction service for: their token ids alone."""
        with ThreadPoolExecutor(self.settings.extract_write_threads) as pool:
            for start in range(0, len(items), IDS_PER_PART):
                chunk = items[start:start + IDS_PER_PART]
                self._collect([pool.submit(self._put, item, save(ids_tensors(item["input_ids"])), False)
                               for item in chunk], self.gpu)

    def _extract(self, todo: list[dict]) -> None:
        """`todo` through the target in token-budget batches, each sample's states to the store."""
        device, gpu = self.device, self.gpu
        capture = loaded_capture(self.manifest.target.model, tuple(self.params.aux_layers), device,
                                 self.params.backend, self.params.num_layers, self.params.hidden_size,
                                 self._vllm_url(), self.manifest.generate.request_timeout_s,
                                 self.manifest.target.trust_remote_code)
        lengths = [len(r["input_ids"]) for r in todo]
        batches = token_budget_batches(todo, lengths, self.settings.extract_batch_tokens)
        # On a GPU, host copies and serialization run in threads while the device computes. On a
        # CPU the forward already uses every core: serializing beside it only slows it down
        # (bench/RESULTS.md), so serialization stays in this thread and one thread uploads.
        on_cpu = device == "cpu"
        with ThreadPoolExecutor(1 if on_cpu else self.settings.extract_write_threads) as pool:
            in_flight: list[list[Future]] = []
            for batch in batches:
                items = [todo[i] for i in batch]
                states = self._forward(capture, [item["input_ids"] for item in items])
                # A blocking copy: an async device-to-host copy must not be read by the write
                # threads before it lands. The overlap is the threads' work on batch k while
                # the device runs batch k+1.
                host = states.to("cpu")
                rows = [(item, host[row, : len(item["input_ids"])]) for row, item in enumerate(items)]
                if on_cpu:
                    in_flight.append([pool.submit(self._put, item, self._serialize(item, s)) for item, s in rows])
                else:
                    in_flight.append([pool.submit(self._write, item, s) for item, s in rows])
                while len(in_flight) > MAX_PENDING_BATCHES:
                    self._collect(in_flight.pop(0), gpu)
            while in_flight:
                self._collect(in_flight.pop(0), gpu)

    def _render_todo(self) -> list[dict]:
        tokenizer = load_tokenizer(self.manifest.target.model, self.manifest.target.trust_remote_code)
        think = (self.manifest.generate.think_start, self.manifest.generate.think_end)
        todo = []
        for record in generated_records(self.store, self.manifest, self.shard):
            if record["sample_id"] in self.records:
                continue
            base = {"sample_id": record["sample_id"], "row": record["row"]}
            try:
                rendered, note = fit(render(record, tokenizer, think), self.params.max_length)
            except Exception as exc:  # a record we cannot tokenize is failed, with the reason
                self._add({**base, "status": "failed", "error": f"{type(exc).__name__}: {exc}"})
                continue
            if rendered is None:
                self._add({**base, "status": "skipped", "reason": note})
            else:
                todo.append({**base, "input_ids": rendered.input_ids, "prompt_len": rendered.prompt_len,
                             **({"spans": rendered.spans} if len(rendered.spans) > 1 else {}),
                             **{k: v for k in ("turns_rerendered", "turns_unsupervised")
                                if (v := getattr(rendered, k))},
                             "source": rendered.source, "mismatch": rendered.mismatch,
                             "truncated": note == "truncated"})
        return todo

    def _write(self, item: dict, states: torch.Tensor) -> dict:
        return self._put(item, self._serialize(item, states))

    def _serialize(self, item: dict, states: torch.Tensor) -> bytes:
        return save(sample_tensors(states, item["input_ids"], self.params.dtype))

    def _put(self, item: dict, data: bytes, states: bool = True) -> dict:
        """The sample's object stored; its record (`states: false`: token ids alone)."""
        info = self.store.put_bytes(self.layout.extract_sample(self.shard, item["sample_id"]), data)
        return {"sample_id": item["sample_id"], "row": item["row"], "status": "done", "key": info.key,
                "sha256": info.sha256, "bytes": info.size, "seq_len": len(item["input_ids"]),
                "prompt_len": item["prompt_len"], **{k: item[k] for k in TURN_COUNTS if k in item},
                "source": item["source"], "mismatch": item["mismatch"], "truncated": item["truncated"],
                **({} if states else {"states": False})}

    def _collect(self, futures: list[Future], gpu) -> None:
        for future in futures:
            self._add(future.result())
        self._flush()
        self.lease.extend(LEASE_TTL_S, replace_ttl=True)  # raises if the lease was lost: task retried
        if self.cancelled():
            raise Cancelled  # what is stored stays; a retry goes on from there
        if stop_requested():  # its worker is stopping (SIGTERM): what is stored stays, the rest goes back
            raise Stopping(f"{len(self.records)} samples of extract shard {self.shard} stored, the rest is "
                           "extracted by the next worker")
        if gpu:
            gpu.renew()
        self._report()

    def count_fields(self) -> dict:
        done = [e for e in self.records.values() if e["status"] == "done"]
        forwarded = [e for e in done if not on_demand(e)]  # tokens: those through the target
        return {"total": len(self.records), "tokens": sum(e["seq_len"] for e in forwarded),
                "bytes": sum(e["bytes"] for e in done), "on_demand": len(done) - len(forwarded)}

    def manifest_fields(self, records: list[dict], counts: Counts) -> dict:
        return {"bytes": counts.bytes, "samples": [e for e in records if e["status"] == "done"],
                "not_done": [{k: e[k] for k in ("sample_id", "status", "reason", "error") if k in e}
                             for e in records if e["status"] != "done"],
                "mismatches": sum(1 for e in records if e.get("mismatch")),
                **{k: sum(e.get(k, 0) for e in records) for k in TURN_COUNTS[1:]},
                "truncated": sum(1 for e in records if e.get("truncated"))}

    def result_fields(self, counts: Counts, wall: float) -> dict:
        return {"tok_per_s": round(counts.tokens / wall, 1)}  # on_demand: among the counts already


def run_extract_shard(payload: dict) -> dict:
    """RQ entry point."""
    return execute(ExtractRunner, payload)
