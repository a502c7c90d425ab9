"""The target model's identity for the manifest: revision and chat template hash."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from types import SimpleNamespace

from pydantic import BaseModel

from eyrie.core.errors import EyrieError


class TargetInfo(BaseModel):
    model: str
    revision: str
    chat_template_sha256: str | None
    max_model_len: int | None
    conversion: dict | None = None  # eyrie-conversion.json of a directory eyrie converted (gguf_target)


def describe(model: str) -> TargetInfo:
    """Local directory: hash of its config, tokenizer files and weight names/sizes (hashing
    hundreds of GB of weights would take longer than the run). Hub id: the commit sha."""
    path = Path(model)
    if path.is_dir():
        return _describe_local(path)
    return _describe_hub(model)


def _describe_local(path: Path) -> TargetInfo:
    digest = hashlib.sha256()
    for file in sorted(path.iterdir()):
        if file.suffix in (".json", ".jinja", ".txt", ".model") and file.is_file():
            digest.update(file.name.encode() + file.read_bytes())
        elif file.is_file():
            digest.update(f"{file.name}:{file.stat().st_size}".encode())
    conversion = path / "eyrie-conversion.json"
    return TargetInfo(model=str(path.resolve()), revision=f"sha256:{digest.hexdigest()}",
                      chat_template_sha256=_template_hash(path), max_model_len=_context(path),
                      conversion=json.loads(conversion.read_text()) if conversion.is_file() else None)


def _describe_hub(model: str) -> TargetInfo:
    from huggingface_hub import HfApi, hf_hub_download

    try:
        sha = HfApi().model_info(model).sha
        config_dir = Path(hf_hub_download(model, "tokenizer_config.json", revision=sha)).parent
        hf_hub_download(model, "config.json", revision=sha)
    except Exception:  # offline or gated: the run still records the name
        return TargetInfo(model=model, revision="unresolved", chat_template_sha256=None,
                          max_model_len=None)
    return TargetInfo(model=model, revision=sha, chat_template_sha256=_template_hash(config_dir),
                      max_model_len=_context(config_dir))


def _template_hash(path: Path) -> str | None:
    template = None
    if (path / "chat_template.jinja").is_file():
        template = (path / "chat_template.jinja").read_text()
    elif (path / "tokenizer_config.json").is_file():
        template = json.loads((path / "tokenizer_config.json").read_text()).get("chat_template")
    if isinstance(template, list):  # named templates
        template = json.dumps(template, sort_keys=True)
    return hashlib.sha256(template.encode()).hexdigest() if template else None


def _context(path: Path) -> int | None:
    try:
        config = json.loads((path / "config.json").read_text())
    except (OSError, ValueError):
        return None
    config = config.get("text_config", config)
    return config.get("max_position_embeddings")


def text_config(model: str):
    """The target's (text) config, or one clear error when this host cannot read it. Where
    transformers is not installed (the generator and api images), its config.json as read."""
    try:
        from transformers import AutoConfig
    except ImportError:
        AutoConfig = None
    try:
        if AutoConfig is None:
            return _config_json(model)
        return AutoConfig.from_pretrained(model).get_text_config()
    except Exception as exc:
        raise EyrieError(f"cannot read the config of the target {model} ({type(exc).__name__}).",
                         "make the model directory (or HF cache) available to this host.") from None


def _config_json(model: str) -> SimpleNamespace:
    """config.json of a local directory or from the hub (its cache first), its text part where it
    nests one (multimodal targets), its keys as attributes."""
    path = Path(model) / "config.json"
    if not path.is_file():
        from huggingface_hub import hf_hub_download

        path = Path(hf_hub_download(model, "config.json"))
    config = json.loads(path.read_text())
    return SimpleNamespace(**config.get("text_config", config))


def check_served(target, served) -> None:
    """Refuse a served model that is not the run's target (both have model, revision and
    chat_template_sha256): the same content (revision) or the same name, and the same chat
    template where both are known."""
    if not same_target(target, served):
        raise EyrieError(
            f"the inference server serves {_identity(served)}, not the run's target {_identity(target)}.",
            f"serve the run's target (`eyrie serve --model {target.model}`, or the run's config: "
            "`eyrie serve --config RUN.yaml`), or name the served model as the run's target.model.")


def same_target(a, b) -> bool:
    templates = (a.chat_template_sha256, b.chat_template_sha256)
    if None not in templates and templates[0] != templates[1]:
        return False
    resolved = [r for r in (a.revision, b.revision) if r and r != "unresolved"]
    if len(resolved) == 2 and resolved[0].startswith("sha256:") == resolved[1].startswith("sha256:"):
        return resolved[0] == resolved[1]  # same kind (both local contents, or both hub commits)
    return _name(a.model) == _name(b.model)


def _name(model: str) -> str:
    path = Path(model)
    return str(path.resolve()) if path.exists() else model


def _identity(t) -> str:
    template = (t.chat_template_sha256 or "none")[:12]
    return f"{t.model} (revision {t.revision[:19]}, chat template {template})"
