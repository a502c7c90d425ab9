"""The learning curve's report: its RESULTS.md section (the curve, the stage times, the anchor beside it) and
its SVG plot, from the JSON result bench/learning_curve.py writes."""

import math
from xml.sax.saxutils import escape

from eyrie.data.verify_outputs import TURN_LABELS

# speculators' options the anchor's section names (given or taken as its defaults)
NOTABLE = ("epochs", "lr", "optimizer", "scheduler_type", "total_seq_len", "draft_vocab_size", "num_layers",
           "ttt_steps", "loss_fn", "train_data_ratio", "seed", "draft_attn_impl", "loss_implementation", "num_workers")
COLORS = ("#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b")


def cell(value, spec=".2f") -> str:
    """A table cell: "-" for a figure not measured."""
    return "-" if value is None else format(value, spec)


def row(*cells) -> str:
    return "| " + " | ".join(map(str, cells)) + " |"


def section(r: dict, svg: str | None = None) -> list[str]:
    """The RESULTS.md section from the JSON result: the curve, the stage times, the anchor."""
    sets, m = list(r["sets"]), r["machine"]
    answered = sum(n for s, n in r["sets"].items() if not s.endswith(TURN_LABELS["both"]))  # both turns: counted each
    gpu, per_1k = f", {m['gpu']}" if m["gpu"] else "", lambda s, n: cell(s / 60 / n * 1000, ".1f")
    out = [f"# Learning curve: {r['target_name']} (bench/learning_curve.py)", "",
           f"- Machine: {m['cpus']} CPUs ({m['cpu']}), {m['memory_gib']} GiB RAM{gpu}; {r['date']}; commit "
           f"`{r['commit']}`.", f"- Command: `{r['command']}`",
           f"- Run `{r['run']}` ({r['target']}): {r['heldout_samples']} held-out samples, a pool of {r['pool']}; "
           f"epochs: {r['epochs']}, on {r['device']}; vLLM at K={r['k']}, greedy, at most {r['max_tokens']} tokens; "
           + ", ".join(f"{n} {c} prompts" for n, c in r["sets"].items()) + ".", "",
           row("training prompts", "eyrie τ held-out", *(f"vLLM acceptance {s}" for s in sets),
               *(f"speedup @1 {s}" for s in sets), "train min / 1k prompts"), "|" + "---|" * (3 + 2 * len(sets))]
    for p in r["points"]:
        out.append(row(p["prompts"], cell(p["eyrie_tau"]), *(cell(p["sets"][s]["vllm_acceptance_length"]) for s in sets),
                       *(cell(p["sets"][s]["speedup"]["1"]) for s in sets), per_1k(p["train_s"], p["prompts"])))
    out += ["", f"![vLLM acceptance length per set against training prompts]({svg})"] if svg else []
    out += ["", row("stage", "measured on", "wall min", "min / 1k prompts"), "|---|---|---|---|"]
    for stage, t in r["stage_times"].items():
        out.append(row(stage, f"n/a: {t['n/a']}", "-", "-") if "n/a" in t else row(
            stage, f"{t['prompts']} prompts, {t['shards']} shards (shard manifests: first start to last finish)",
            cell(t["wall_s"] / 60, ".1f"), per_1k(t["wall_s"], t["prompts"]) if t["prompts"] else "-"))
    for p in r["points"] + ([r["anchor"]] if r.get("anchor") else []):
        who = "speculators' defaults" if p["label"] == "anchor" else "eyrie"
        timed = "the run's train stage: extraction's end to its last epoch checkpoint" if p.get("from_run") else "timed here"
        out.append(row(f"train ({who})", f"{p['prompts']} prompts, {p['epochs']} epochs, {timed}",
                       cell(p["train_s"] / 60, ".1f"), per_1k(p["train_s"], p["prompts"])))
        out.append(row(f"verify ({who}, {p['prompts']})", f"{answered} prompts, server start in, timed here",
                       cell(p["verify_s"] / 60, ".1f"), per_1k(p["verify_s"], answered)))
    return out + (anchor_lines(r) if r.get("anchor") else [])


def anchor_lines(r: dict) -> list[str]:
    a, eyrie = r["anchor"], next(p for p in r["points"] if p["prompts"] == r["anchor"]["prompts"])
    given = ", ".join(f"{k} {v}" for k, v in a["given"].items() if k in NOTABLE or k == "target_layer_ids")
    taken = ", ".join(f"{k} {v}" for k, v in a["defaults"].items())
    out = ["", f"Beside speculators' own training on the same {a['prompts']} samples (speculators.train.cli.main "
           f"in eyrie's device shim), given {given}; defaults taken: {taken}. {a['note']}", "",
           row("set", "eyrie", "speculators", "eyrie / speculators"), "|---|---|---|---|"]
    pairs = [("eyrie τ held-out (simulated)", eyrie["eyrie_tau"], a["eyrie_tau"])] + [
        (f"vLLM acceptance {s}", eyrie["sets"][s]["vllm_acceptance_length"], a["sets"][s]["vllm_acceptance_length"])
        for s in r["sets"]]
    return out + [row(name, cell(x), cell(y), cell(x / y, ".3f") if x is not None and y else "-") for name, x, y in pairs]


def svg_plot(curves: dict[str, list[tuple[int, float]]], title: str) -> str:
    """Acceptance length per set against training prompts (log scale): one polyline per set."""
    w, h, left, right, top, bottom = 640, 400, 60, 150, 40, 50
    xs = sorted({x for pts in curves.values() for x, _ in pts}) or [1]
    ys = [y for pts in curves.values() for _, y in pts if y is not None] or [1.0]
    lo_x, hi_x, lo_y, hi_y = math.log(xs[0]), math.log(xs[-1]), min(1.0, min(ys)), max(ys) * 1.05
    px = lambda x: left + (w - left - right) * ((math.log(x) - lo_x) / (hi_x - lo_x) if hi_x > lo_x else 0.5)
    py = lambda y: h - bottom - (h - top - bottom) * (y - lo_y) / ((hi_y - lo_y) or 1)
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" style="font: 12px sans-serif">',
             f'<text x="{w / 2}" y="20" text-anchor="middle" font-size="14">{escape(title)}</text>',
             f'<path d="M{left},{top} V{h - bottom} H{w - right}" fill="none" stroke="black"/>',
             f'<text x="{(left + w - right) / 2}" y="{h - 10}" text-anchor="middle">training prompts</text>',
             f'<text x="15" y="{h / 2}" text-anchor="middle" transform="rotate(-90 15 {h / 2})">'
             'acceptance length</text>']
    parts += [f'<text x="{px(x):.1f}" y="{h - bottom + 16}" text-anchor="middle">{x}</text>' for x in xs]
    parts += [f'<text x="{left - 6}" y="{py(y) + 4:.1f}" text-anchor="end">{y:.2f}</text>'
              for y in (lo_y + (hi_y - lo_y) * i / 4 for i in range(5))]
    for i, (name, pts) in enumerate(curves.items()):
        color, pts = COLORS[i % len(COLORS)], [(x, y) for x, y in pts if y is not None]
        parts.append(f'<polyline fill="none" stroke="{color}" stroke-width="2" points="'
                     + " ".join(f"{px(x):.1f},{py(y):.1f}" for x, y in pts) + '"/>')
        parts.append(f'<text x="{w - right + 10}" y="{top + 18 * i + 10}" fill="{color}">{escape(name)}</text>')
    return "\n".join(parts + ["</svg>"]) + "\n"
