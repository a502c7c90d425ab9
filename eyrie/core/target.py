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


class RemoteCodeRefused(EyrieError):
    """The target ships code of its own (an `auto_map`) and the run does not trust it."""

    def __init__(self, model: str, what: str):
        super().__init__(
            f"the target {model} needs its own code to load its {what} (an auto_map in its config.json or "
            "tokenizer_config.json), and the run does not run it.",
            "if you trust that repository's code, set serve.trust_remote_code: true in the run config (it then "
            "runs in vLLM and in eyrie's workers); `eyrie generate`/`eyrie serve` without a run config: "
            "EYRIE_VLLM_ARGS=--trust-remote-code.")


def hf_load(load, model: str, what: str, trust_remote_code: bool):
    """`load(model, trust_remote_code=...)` (a transformers from_pretrained), its refusal of the
    target's own code as RemoteCodeRefused."""
    try:
        return load(model, trust_remote_code=trust_remote_code)
    except ValueError as exc:
        if "trust_remote_code" in str(exc):
            raise RemoteCodeRefused(model, what) from None
        raise


def text_config(model: str, trust_remote_code: bool = False):
    """The target's (text) config, or one clear error when this host cannot read it. Where
    transformers is not installed (the generator and api images), its config.json as read."""
    try:
        from transformers import AutoConfig
    except ImportError:
        AutoConfig = None
    try:
        if AutoConfig is None:
            return _config_json(model)
        return hf_load(AutoConfig.from_pretrained, model, "config", trust_remote_code).get_text_config()
    except RemoteCodeRefused:
        raise
    except Exception as exc:
        raise EyrieError(f"cannot read the config of the target {model} ({type(exc).__name__}).",
                         "make the model directory (or HF cache) available to this host.") from None


def load_tokenizer(model: str, trust_remote_code: bool = False):
    """The target's tokenizer (transformers' AutoTokenizer), running the target's own code only
    where the run trusts it."""
    from transformers import AutoTokenizer

    return hf_load(AutoTokenizer.from_pretrained, model, "tokenizer", trust_remote_code)


def refuse_remote_code(model: str, trust_remote_code: bool) -> None:
    """Before a run starts: a target whose config or tokenizer names code of its own, which this
    host's transformers cannot load without it, is refused unless the run trusts it. Reads only
    files already here (a local directory or the HF cache); transformers confirms where installed
    (a model type it has classes for loads without the target's code)."""
    if trust_remote_code:
        return
    for name, what in (("config.json", "config"), ("tokenizer_config.json", "tokenizer")):
        if _auto_map(model, name) and not _loads_without_code(model, what):
            raise RemoteCodeRefused(model, what)


def _auto_map(model: str, name: str) -> bool:
    path = Path(model) / name
    if not path.is_file():
        from huggingface_hub import try_to_load_from_cache

        try:  # a path this host lacks (a container given another's path) is no hub id: nothing to read
            cached = try_to_load_from_cache(model, name) if "/" in model and not Path(model).exists() else None
        except ValueError:  # huggingface_hub's HFValidationError
            cached = None
        path = Path(cached) if isinstance(cached, str) else None
    try:
        return path is not None and bool(json.loads(path.read_text()).get("auto_map"))
    except (OSError, ValueError):
        return False


def _loads_without_code(model: str, what: str) -> bool:
    try:
        import transformers  # noqa: F401
    except ImportError:
        return False  # nothing here can tell: the auto_map is taken at its word
    try:
        (text_config if what == "config" else load_tokenizer)(model, False)
    except RemoteCodeRefused:
        return False
    except Exception:  # another problem, for the stage that loads it to report
        return True
    return True


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
