"""`eyrie verify`: the exported drafter served by real vLLM, its acceptance measured by vLLM itself.

The target is served twice on the run's held-out prompts (the prompt part of each held-out
sample, as token ids, greedy): alone, then with the drafter (`--speculative-config` eagle3, K =
the steps it was trained for). vLLM's spec-decode counters (`/metrics`) give its mean acceptance
length (1 + accepted draft tokens / drafts) and the acceptance rate per draft position; the two
runs' outputs must be identical (greedy speculative decoding never changes them). The result goes
into the run manifest (`verify`) beside eyrie's own figure (`drafter.tau`, the same bookkeeping:
eyrie_trainer.evaluate).
"""

from __future__ import annotations

import json
import re
import shlex
import socket
import subprocess
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import requests

from eyrie.errors import EyrieError
from eyrie.executor import StageTask, execute
from eyrie.manifest import Layout, load_run_manifest, now_iso
from eyrie.stages import VERIFY
from eyrie.vllm import serve_argv, serve_env
from eyrie_trainer.data import done_samples, heldout_ids, materialize
from eyrie_trainer.export import download

COUNTER = re.compile(r'^vllm:spec_decode_num_(drafts|accepted_tokens|accepted_tokens_per_pos)_total\{([^}]*)\} (\S+)$')


def heldout_prompts(store, run: str, cache_dir: Path) -> list[list[int]]:
    """The held-out samples' prompts: their token ids before the first answer token."""
    import datasets

    manifest = load_run_manifest(store, run)
    held = heldout_ids(done_samples(store, run), manifest.train.heldout_samples)
    eval_dir = cache_dir / "runs" / run / "data" / "heldout"
    materialize(store, run, eval_dir, lambda s: s["sample_id"] in held)
    prompts = []
    for row in datasets.load_from_disk(str(eval_dir)):
        mask, ids = [int(m) for m in row["loss_mask"]], [int(t) for t in row["input_ids"]]
        prompts.append(ids[: mask.index(1) if 1 in mask else len(mask)])
    return prompts


def spec_counters(url: str) -> dict:
    """vLLM's spec-decode counters, summed over engines: drafts, accepted tokens, per position."""
    counts = {"drafts": 0.0, "accepted_tokens": 0.0, "per_pos": {}}
    for line in requests.get(f"{url}/metrics", timeout=30).text.splitlines():
        match = COUNTER.match(line)
        if not match:
            continue
        name, labels, value = match.groups()
        if name == "accepted_tokens_per_pos":
            pos = int(re.search(r'position="(\d+)"', labels).group(1))
            counts["per_pos"][pos] = counts["per_pos"].get(pos, 0.0) + float(value)
        else:
            counts[name] += float(value)
    return counts


class Served:
    """One vLLM server for the run's target, started from EYRIE_VLLM_COMMAND, stopped on exit."""

    def __init__(self, settings, model: str, extra: list[str], log: Path):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url, self.model, self.log = f"http://127.0.0.1:{self.port}", model, log
        self.cmd = [*serve_argv(settings.vllm_command, model), "--host", "127.0.0.1", "--port", str(self.port),
                    *(["--max-model-len", str(settings.max_model_len)] if settings.max_model_len else []),
                    *shlex.split(settings.vllm_args), *extra]
        self.deadline_s = settings.serve_deadline_s

    def __enter__(self) -> "Served":
        self.proc = subprocess.Popen(self.cmd, env=serve_env(), stdout=self.log.open("w"),
                                     stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + self.deadline_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise EyrieError(f"vLLM exited with code {self.proc.returncode} before it answered: "
                                 f"{self.log.read_text(errors='replace')[-1500:]}",
                                 "read its log above; EYRIE_VLLM_COMMAND names the vLLM to run.")
            try:
                if requests.get(f"{self.url}/v1/models", timeout=2).status_code == 200:
                    return self
            except requests.RequestException:
                pass
            time.sleep(1)
        raise EyrieError(f"vLLM did not answer within {self.deadline_s:g} s.", "raise EYRIE_SERVE_DEADLINE_S.")

    def __exit__(self, *_) -> None:
        import os
        import signal

        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()

    def greedy(self, prompts: list[list[int]], max_tokens: list[int]) -> tuple[list[list[int]], float]:
        """Every prompt answered greedily (8 in flight); the answers' token ids and tokens per second."""
        def one(args):
            prompt, limit = args
            body = {"model": self.model, "prompt": prompt, "max_tokens": limit, "temperature": 0,
                    "return_token_ids": True}
            res = requests.post(f"{self.url}/v1/completions", json=body, timeout=600)
            if res.status_code != 200:
                raise EyrieError(f"vLLM answered {res.status_code}: {res.text[:300]}", "read the vLLM log.")
            return res.json()["choices"][0]["token_ids"]

        started = time.monotonic()
        with ThreadPoolExecutor(8) as pool:
            outputs = list(pool.map(one, zip(prompts, max_tokens)))
        return outputs, sum(map(len, outputs)) / (time.monotonic() - started)


def verify(settings, store, run: str, log=print) -> dict:
    manifest, layout = load_run_manifest(store, run), Layout(run)
    if not manifest.drafter:
        raise EyrieError(f"run {run} has no exported drafter to verify.",
                         f"train it first: `eyrie train --run {run} --wait` exports the best checkpoint.")
    k, target = manifest.drafter["k"], manifest.target.model
    cache = Path(settings.cache_dir)
    prompts = heldout_prompts(store, run, cache)
    limits = [manifest.generate.sampling.max_tokens] * len(prompts)
    if settings.max_model_len:
        limits = [max(1, min(m, settings.max_model_len - len(p))) for m, p in zip(limits, prompts)]
    with tempfile.TemporaryDirectory() as tmp:
        drafter = Path(tmp) / "drafter"
        download(store, run, drafter)
        logs = cache / "runs" / run / "verify"
        logs.mkdir(parents=True, exist_ok=True)
        log(f"verify {run}: vLLM serving {target} alone, {len(prompts)} held-out prompts, greedy")
        with Served(settings, target, [], logs / "target.log") as server:
            alone, alone_tps = server.greedy(prompts, limits)
        spec = json.dumps({"method": "eagle3", "model": str(drafter), "num_speculative_tokens": k})
        log(f"verify {run}: vLLM serving {target} with the drafter (eagle3, K={k})")
        with Served(settings, target, ["--speculative-config", spec], logs / "drafter.log") as server:
            before = spec_counters(server.url)
            drafted, drafted_tps = server.greedy(prompts, limits)
            after = spec_counters(server.url)
    result = summarize(before, after, k)
    result.update(identical_outputs=alone == drafted, prompts=len(prompts),
                  differing_outputs=sum(a != b for a, b in zip(alone, drafted)),
                  tokens_per_s_target=round(alone_tps, 2), tokens_per_s_drafter=round(drafted_tps, 2),
                  speedup=round(drafted_tps / alone_tps, 3) if alone_tps else None,
                  eyrie_acceptance_length=manifest.drafter["tau"], checkpoint=manifest.drafter["checkpoint"],
                  verified_at=now_iso(), definitions=DEFINITIONS)
    vllm_tau = result["vllm_acceptance_length"]
    result["relative_difference"] = (abs(result["eyrie_acceptance_length"] - vllm_tau) / vllm_tau
                                     if vllm_tau else None)
    manifest.verify = result
    store.put_json(layout.manifest, manifest.model_dump())
    return result


DEFINITIONS = {
    "vllm_acceptance_length": "1 + accepted draft tokens / drafts, from vLLM's /metrics counters; drafts "
                              "accepted past the end token count too",
    "eyrie_acceptance_length": "the same bookkeeping walked over the stored held-out answers against the "
                               "target's greedy tokens; past the end token only as far as the stored states "
                               "reach (one token)",
}


def summarize(before: dict, after: dict, k: int) -> dict:
    drafts = after["drafts"] - before["drafts"]
    accepted = after["accepted_tokens"] - before["accepted_tokens"]
    per_pos = [(after["per_pos"].get(p, 0.0) - before["per_pos"].get(p, 0.0)) / drafts if drafts else None
               for p in range(k)]
    return {"vllm_acceptance_length": 1 + accepted / drafts if drafts else None, "vllm_drafts": int(drafts),
            "vllm_accepted_tokens": int(accepted), "vllm_per_position_acceptance": per_pos, "k": k}


class VerifyRunner(StageTask):
    """The pipeline's verify stage (train queue), under the GPU lease: vLLM takes the GPUs, as
    `eyrie serve --server vllm` does, never beside another owner."""

    stage, gpu_owner = VERIFY, "verify"

    def devices(self) -> str:
        return "all"

    def run(self) -> dict:
        result = verify(self.settings, self.store, self.run_name)
        return {"run": self.run_name, **{k: result[k] for k in ("vllm_acceptance_length", "eyrie_acceptance_length",
                                                                "identical_outputs", "speedup")}}


def run_verify_task(payload: dict) -> dict:
    """RQ entry point."""
    return execute(VerifyRunner, payload)
