"""What training on a run's answers costs in tokens that supervise nothing: per category of the prompt mix, the
samples as extraction will store them (eyrie_extractor.render and fit at the train pack length), their tokens,
the share the loss mask covers, and the tokens after a sample's last supervised one (the only ones that feed no
supervised position: every earlier token is context for a later answer). Reads the run's generated records
(finished shards and the parts of unfinished ones) and its dataset's `category` field; no server, no training.

  .venv/bin/python bench/supervised_share.py --run smollm2-general-2k --store file://$EYRIE_HOME/store
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path

import orjson

from eyrie.core.target import load_tokenizer
from eyrie.data.manifest import Layout, RunManifest, ShardManifest
from eyrie.data.store import FileStore
from eyrie_extractor.render import fit, render


def records(store, layout: Layout, shard: int) -> list[bytes]:
    """A shard's records: the finished shard's, else the parts stored so far (a run still generating)."""
    if store.exists(layout.generate_shard_manifest(shard)):
        done = ShardManifest.model_validate(store.get_json(layout.generate_shard_manifest(shard)))
        return store.get_verified(done.object, done.sha256).splitlines()
    return [line for key in store.list(layout.generate_parts(shard)) for line in store.get_bytes(key).splitlines()]


def samples(store, manifest: RunManifest, pack: int, tokenizer):
    """(record, rendered sample or None) of every done record generated so far."""
    layout, think = Layout(manifest.run), (manifest.generate.think_start, manifest.generate.think_end)
    for plan in manifest.generate_shards:
        for line in records(store, layout, plan.index):
            record = orjson.loads(line)
            if record["status"] == "done":
                yield record, fit(render(record, tokenizer, think), pack)[0]


def table(store, run: str, pack: int) -> list[str]:
    manifest = RunManifest.model_validate(store.get_json(Layout(run).manifest))
    rows = Path(manifest.dataset.source).read_text().splitlines()
    tokenizer = load_tokenizer(manifest.target.model, manifest.target.trust_remote_code)
    sums: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    for record, sample in samples(store, manifest, pack, tokenizer):
        category = json.loads(rows[record["row"]]).get("category", "all")
        for key in (category, "all"):
            s = sums[key]
            s["samples"] += 1
            s["turns"] += len(record.get("turns") or [record])
            if sample is None:
                s["skipped"] += 1
                continue
            s["tokens"] += len(sample.input_ids)
            s["supervised"] += sum(end - start for start, end in sample.spans)
            s["trailing"] += len(sample.input_ids) - sample.spans[-1][1]
    out = [f"| category | samples | answers (turns) | tokens a sample (cut at {pack}) | supervised share | "
           "tokens after the last supervised one |", "|---|---|---|---|---|---|"]
    for name, s in sorted(sums.items(), key=lambda kv: (kv[0] == "all", kv[0])):
        n = max(1, s["samples"] - s["skipped"])
        out.append(f"| {name} | {s['samples']:.0f} | {s['turns']:.0f} | {s['tokens'] / n:.0f} | "
                   f"{s['supervised'] / max(1, s['tokens']):.1%} | {s['trailing']:.0f} |")
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--run", required=True)
    p.add_argument("--store", required=True, help="file:///path of the run's file store")
    p.add_argument("--pack", type=int, default=1024, help="the train pack length samples are cut to")
    a = p.parse_args()
    print("\n".join(table(FileStore(Path(a.store.removeprefix("file://"))), a.run, a.pack)))


if __name__ == "__main__":
    main()
