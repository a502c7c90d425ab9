"""`eyrie verify`: the exported drafter served by real vLLM, its acceptance measured by vLLM itself.

The target is served alone, then with the drafter once per draft length K (`--speculative-config`
eagle3), on the run's held-out prompts (the prompt part of each held-out sample, as token ids) and
on any benchmark sets asked for (mt-bench, gsm8k, humaneval or a file: eyrie_trainer.benchmarks, rendered
with the target's chat template), greedy. Per set and K: vLLM's spec-decode counters (`/metrics`)
give its mean acceptance length (1 + accepted draft tokens / drafts) and the acceptance rate per
draft position; outputs with and without the drafter compared (greedy speculative decoding is lossless
up to numerics: vLLM's docs): the share equal to plain decoding at 1 in flight beside the target's own at 1
vs 8 in flight (its batch variance), a verify failing below it (outputs_verdict: eyrie.data.verify_outputs
states the floor, the margin and the fewest answers judged); tokens/s with 8 requests in flight (every prompt)
and with 1 (the first `serial_prompts`). MT-Bench (and a file with 2+ `turns` a row) is asked its second turn
too, as FastChat asks it: each server after its own first answers (eyrie_trainer.verify_turns), measured per
turn and over both turns. The result goes into the run manifest (`verify`): per set under `benchmarks` (a
set's second turn and both turns under its `turns`: eyrie_trainer.verify_figures), and the held-out set at the
trained K at the top, beside eyrie's own figure (`drafter.tau`, the same bookkeeping: eyrie_trainer.evaluate).
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
import tempfile
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import requests

from eyrie.core.errors import EyrieError
from eyrie.core.run_config import ServeSection, VerifySection
from eyrie.core.target import load_tokenizer
from eyrie.core.vllm import eagle3_flags, on_cpu, serve_argv, serve_env, start_server, stop_server
from eyrie.data.manifest import Layout, load_run_manifest, now_iso
from eyrie.data.verify_outputs import (FAILED, IDENTICAL, MATCH_FLOOR, MATCH_MARGIN, MIN_COMPARED, TOO_FEW, WITHIN,
                                       worst)
from eyrie.stages import VERIFY
from eyrie.stages.run_config import stored_config
from eyrie.stages.verify import record_verify_rates
from eyrie.tasks.executor import StageTask, execute
from eyrie_trainer.benchmarks import load_benchmark
from eyrie_trainer.data import done_samples, heldout_ids, prompt_token_ids
from eyrie_trainer.export import download
from eyrie_trainer.verify_figures import SECOND, benchmark_result, k_figures, summarize  # noqa: F401 (summarize: its users')
from eyrie_trainer.verify_turns import SecondTurns, chat_prompt_ids, second_turn_pass

COUNTER = re.compile(r'^vllm:spec_decode_num_(drafts|accepted_tokens|accepted_tokens_per_pos)_total\{([^}]*)\} (\S+)$')
HELDOUT = "heldout"
# The temperature verify asks its answers at, and serves the drafter for (drafter_flags: draft sampling follows
# it, probabilistic above 0 by eyrie.core.vllm.eagle3_spec's rule). Greedy: outputs comparable with and without.
TEMPERATURE = 0


def heldout_prompts(store, run: str, cache_dir: Path) -> list[list[int]]:
    """The held-out samples' prompts (the samples eyrie's τ was measured on), in stored order."""
    manifest, samples = load_run_manifest(store, run), done_samples(store, run)
    held = heldout_ids(samples, manifest.train.heldout_samples)
    folder = cache_dir / "runs" / run / VERIFY.name / "heldout"
    folder.mkdir(parents=True, exist_ok=True)
    return prompt_token_ids(store, [s for s in samples if s["sample_id"] in held], folder)


def benchmark_prompts(target: str, names: list[str], limit: int | None,
                      trust_remote_code: bool = False) -> dict[str, list[list[int]]]:
    """Each benchmark's chat prompts (a set's first turns) as the target's chat template renders them, as token ids."""
    return benchmark_sets(target, names, limit, 0, None, trust_remote_code)[0]


def benchmark_sets(target: str, names: list[str], limit: int | None, max_tokens: int, context: int | None,
                   trust_remote_code: bool = False) -> tuple[dict[str, list[list[int]]], dict[str, SecondTurns]]:
    """benchmark_prompts, and the second turns of the sets that have them (MT-Bench), asked with answers of
    `max_tokens` within the served `context`."""
    if not names:
        return {}, {}
    tokenizer = load_tokenizer(target, trust_remote_code)
    sets, second_turns = {}, {}
    for name in names:
        bench = load_benchmark(name, limit)
        sets[bench.name] = [chat_prompt_ids(tokenizer, m) for m in bench.prompts]
        if turns := SecondTurns.of(bench, tokenizer, max_tokens, context):
            second_turns[bench.name] = turns
    return sets, second_turns


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


class Client:
    """verify's requests to a server of the target at `url`: greedy answers, timed, and vLLM's counters."""

    def __init__(self, url: str, model: str, log: Path | None = None):
        self.url, self.model, self.log = url, model, log

    def greedy(self, prompts: list[list[int]], max_tokens: list[int], in_flight: int) -> tuple[list[list[int]], float]:
        """Every prompt answered greedily, `in_flight` at a time; the answers' token ids and tokens/s."""
        def one(args):
            prompt, limit = args
            body = {"model": self.model, "prompt": prompt, "max_tokens": limit, "temperature": TEMPERATURE,
                    "return_token_ids": True}
            res = requests.post(f"{self.url}/v1/completions", json=body, timeout=600)
            if res.status_code != 200:
                raise EyrieError(f"vLLM answered {res.status_code}: {res.text[:300]}", f"read the vLLM log {self.log}.")
            return res.json()["choices"][0]["token_ids"]

        started = time.monotonic()
        with ThreadPoolExecutor(in_flight) as pool:
            outputs = list(pool.map(one, zip(prompts, max_tokens)))
        return outputs, sum(map(len, outputs)) / (time.monotonic() - started)

    def measure(self, sets: dict, limits: dict, serial: int, second_turns: dict[str, SecondTurns] | None = None) -> dict:
        """Per prompt set, its pass (one_pass); a set with second turns is then asked them after this server's
        own first answers (its `second_turn` pass: eyrie_trainer.verify_turns)."""
        passes = {}
        for name, prompts in sets.items():
            passes[name] = self.one_pass(prompts, limits[name], serial)
            if name in (second_turns or {}):
                passes[name]["second_turn"] = second_turn_pass(self, second_turns[name], passes[name]["outputs"], serial)
        return passes

    def one_pass(self, prompts: list[list[int]], limits: list[int], serial: int) -> dict:
        """The answers at 8 in flight and at 1 (the first `serial`), tokens/s and seconds at each, and the
        spec-decode counters read before and after the 8-in-flight pass."""
        before = spec_counters(self.url)
        outputs, at_8 = self.greedy(prompts, limits, 8)
        counters = spec_counters(self.url)
        serial_outputs, at_1 = self.greedy(prompts[:serial], limits[:serial], 1)
        seconds = {n: sum(map(len, out)) / rate if rate else 0.0
                   for n, out, rate in (("1", serial_outputs, at_1), ("8", outputs, at_8))}
        return {"outputs": outputs, "serial_outputs": serial_outputs, "tokens_per_s": {"1": round(at_1, 2), "8": round(at_8, 2)},
                "seconds": seconds, "counters": (before, counters)}


class Served(Client):
    """One vLLM server for the run's target (EYRIE_VLLM_COMMAND, the run's serve flags), stopped on exit."""

    def __init__(self, settings, model: str, flags: list[str], log: Path):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        super().__init__(f"http://127.0.0.1:{self.port}", model, log)
        self.cmd = [*serve_argv(settings.vllm_command, model), "--host", "127.0.0.1", "--port", str(self.port), *flags]
        self.deadline_s = settings.serve_deadline_s

    def __enter__(self) -> "Served":
        self.proc = start_server(self.cmd, env=serve_env(), stdout=self.log.open("w"), stderr=subprocess.STDOUT)
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
        self.__exit__()
        raise EyrieError(f"vLLM did not answer within {self.deadline_s:g} s.", "raise EYRIE_SERVE_DEADLINE_S.")

    def __exit__(self, *_) -> None:
        stop_server(self.proc, grace_s=60)


def verify(settings, store, run: str, request: VerifySection | None = None, log=print) -> dict:
    """Measure the run's exported drafter in vLLM (see the module docstring); the result is stored
    as the manifest's `verify` and returned. `request`: the sets and Ks (default: the run config's
    verify section)."""
    manifest, config = load_run_manifest(store, run), stored_config(store, run)
    if not manifest.drafter:
        raise EyrieError(f"run {run} has no exported drafter to verify.",
                         f"train it first: `eyrie train --run {run} --wait` exports the best checkpoint.")
    request = request or (config.verify if config else VerifySection())
    trained_k, target = manifest.drafter["k"], manifest.target.model
    ks = request.ks or [trained_k]
    flags = serve_flags(settings, config)
    max_tokens, context = request.max_tokens or manifest.generate.sampling.max_tokens, max_model_len(flags)
    benches, second_turns = benchmark_sets(target, request.benchmarks, request.prompts, max_tokens, context,
                                           manifest.target.trust_remote_code)
    sets = {HELDOUT: heldout_prompts(store, run, Path(settings.cache_dir))[:request.prompts], **benches}
    limits = answer_limits(sets, max_tokens, context)
    logs = Path(settings.cache_dir) / "runs" / run / VERIFY.name
    logs.mkdir(parents=True, exist_ok=True)
    counts = ", ".join(f"{name} {len(p)}" + (" (then their second turns)" if name in second_turns else "")
                       for name, p in sets.items())
    with tempfile.TemporaryDirectory() as tmp:
        drafter = Path(tmp) / "drafter"
        download(store, run, drafter)
        log(f"verify {run}: vLLM serving {target} alone on {counts} prompts, greedy")
        with Served(settings, target, flags, logs / "target.log") as server:
            alone = server.measure(sets, limits, request.serial_prompts, second_turns)
        drafted = {}
        for k in ks:
            log(f"verify {run}: vLLM serving {target} with the drafter (eagle3, K={k})")
            with Served(settings, target, [*flags, *drafter_flags(drafter, k)], logs / f"drafter-k{k}.log") as server:
                drafted[k] = server.measure(sets, limits, request.serial_prompts, second_turns)
    benchmarks = {name: benchmark_result(alone[name], {k: drafted[k][name] for k in ks}, len(sets[name]))
                  for name in sets}
    result = headline(benchmarks[HELDOUT], trained_k if trained_k in ks else ks[0], manifest.drafter)
    verdicts = {f["outputs_verdict"] for b in benchmarks.values() for f in k_figures(b)}
    result.update(benchmarks=benchmarks, ks=ks, verified_at=now_iso(), definitions=DEFINITIONS,
                  identical_outputs=verdicts == {IDENTICAL}, outputs_verdict=worst(verdicts),
                  hardware=hardware(), vllm_version=served_version(logs / "target.log"), serve_flags=flags)
    manifest.verify = result
    store.put_json(Layout(run).manifest, manifest.model_dump())
    return result


def hardware() -> str:
    """What the figures were measured on (the published card states it): the host's GPUs, else its CPU and the
    cores this process may use."""
    if not on_cpu():
        try:
            names = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                                   text=True, timeout=60).stdout.split("\n")
        except (OSError, subprocess.SubprocessError):
            names = []
        gpus = Counter(n.strip() for n in names if n.strip())
        if gpus:
            return ", ".join(f"{count}x {name}" for name, count in gpus.items())
    cpu = re.search(r"model name\s*:\s*(.+)", Path("/proc/cpuinfo").read_text()) if Path("/proc/cpuinfo").is_file() else None
    return f"CPU: {cpu[1].strip() if cpu else 'unknown model'}, {len(os.sched_getaffinity(0))} cores"


def served_version(log: Path) -> str | None:
    """The vLLM version its server's log names."""
    found = re.search(r"vLLM API server version (\S+)", log.read_text(errors="replace")) if log.is_file() else None
    return found[1] if found else None


def drafter_flags(drafter: Path, k: int) -> list[str]:
    """How verify serves the drafter: EAGLE-3 named, K draft tokens, draft sampling for verify's TEMPERATURE."""
    return eagle3_flags(str(drafter), k, TEMPERATURE)


def serve_flags(settings, config) -> list[str]:
    """How the run's target is served: its config's serve section, else the host's EYRIE_* vLLM flags."""
    return (config.serve if config is not None else ServeSection.of_host(settings)).vllm_flags()


def max_model_len(flags: list[str]) -> int | None:
    return int(flags[flags.index("--max-model-len") + 1]) if "--max-model-len" in flags else None


def answer_limits(sets: dict, max_tokens: int, context: int | None) -> dict[str, list[int]]:
    """max_tokens per prompt, within the served context length."""
    return {name: [max(1, min(max_tokens, context - len(p))) if context else max_tokens for p in prompts]
            for name, prompts in sets.items()}


def headline(heldout: dict, k: int, drafter: dict) -> dict:
    """The held-out set at the trained K, beside eyrie's own figure (the fields `eyrie status` shows)."""
    figures = heldout["k"][str(k)]
    vllm_tau, eyrie_tau = figures["vllm_acceptance_length"], drafter["tau"]
    return {key: figures[key] for key in ("vllm_acceptance_length", "vllm_drafts", "vllm_accepted_tokens",
                                          "vllm_per_position_acceptance", "k", "differing_outputs")} | {
        "match_rate": figures.get("match_rate"), "target_match_rate": figures.get("target_match_rate"),
        "prompts": heldout["prompts"], "tokens_per_s_target": heldout["tokens_per_s_target"]["8"],
        "tokens_per_s_drafter": figures["tokens_per_s"]["8"], "speedup": figures["speedup"]["8"],
        "speedup_1_in_flight": figures["speedup"]["1"], "eyrie_acceptance_length": eyrie_tau,
        "checkpoint": drafter["checkpoint"],
        "relative_difference": abs(eyrie_tau - vllm_tau) / vllm_tau if vllm_tau else None}


DEFINITIONS = {
    "vllm_acceptance_length": "1 + accepted draft tokens / drafts, from vLLM's /metrics counters over the "
                              "8-in-flight pass; drafts accepted past the end token count too",
    "eyrie_acceptance_length": "the same bookkeeping walked over the stored held-out answers against the "
                               "target's greedy tokens; past the end token only as far as the stored states "
                               "reach (one token)",
    "tokens_per_s": "completion tokens / wall time: every prompt with 8 requests in flight ('8'), the first "
                    "serial_prompts one at a time ('1')",
    "speedup": "tokens/s with the drafter / tokens/s of the target alone, same prompts and in-flight count",
    "differing_outputs": "prompts whose greedy answer with the drafter differs from the target's alone (8 in flight; "
                         "differing_outputs_at_1: the first serial_prompts, 1 in flight)",
    "target_differing_1_vs_8": "of the first serial_prompts, those the target alone answers differently at 1 and at "
                               "8 in flight: its own batch variance (bf16 on a CPU: most; float32: none)",
    "match_rate": "the share of the first serial_prompts whose answer with the drafter equals plain decoding's, "
                  "both at 1 in flight",
    "target_match_rate": "the share of the first serial_prompts the target alone answers the same at 1 and at 8 in "
                         "flight (1 - target_differing_1_vs_8 / serial_prompts)",
    "match_rate_required": f"the match rate that passes: target_match_rate - {MATCH_MARGIN}, at least {MATCH_FLOOR}",
    "outputs_verdict": f"identical; {WITHIN} (match_rate >= match_rate_required); '{FAILED}' (below it: the verify "
                       f"fails); or '{TOO_FEW} (n of {MIN_COMPARED})' where fewer answers were compared at 1 in "
                       "flight (a single near-tie flip would decide it: fails nothing)",
    "turns": "a set with second turns (MT-Bench): its own figures are its first turn; turns['2'] its second, asked "
             "by each server after its own first answer (FastChat's way), its answers compared only where the first "
             "answers were equal (compared_prompts); turns['both'] the two turns together: acceptance over both "
             "passes' counters, tokens/s over both passes, answer comparisons summed",
}


def measured_paces(result: dict) -> list[dict]:
    """Every pass's tokens/s at 8 and at 1 in flight: per set, the target alone and with the drafter per K."""
    return [pace for bench in result["benchmarks"].values()
            for block in (bench, (bench.get("turns") or {}).get(SECOND))
            if block for pace in (block["tokens_per_s_target"], *(f["tokens_per_s"] for f in block["k"].values()))]


class VerifyRunner(StageTask):
    """The pipeline's verify stage (train queue), under the GPU lease: vLLM takes the GPUs, as
    `eyrie serve --server vllm` does, never beside another owner."""

    stage, gpu_owner = VERIFY, VERIFY.name

    def devices(self) -> str:
        return "all"

    def run(self) -> dict:
        result = verify(self.settings, self.store, self.run_name)
        target = load_run_manifest(self.store, self.run_name).target.model
        record_verify_rates(self.conn, target, measured_paces(result))  # its next verify's time limit
        return {"run": self.run_name, **{k: result[k] for k in ("vllm_acceptance_length", "eyrie_acceptance_length",
                                                                "identical_outputs", "outputs_verdict", "speedup")}}


def run_verify_task(payload: dict) -> dict:
    """RQ entry point."""
    return execute(VerifyRunner, payload)
