"""The target model's identity for the manifest: revision (its content) and chat template hash."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from types import SimpleNamespace

from pydantic import BaseModel

from eyrie.core.errors import EyrieError
from eyrie.core.file_hashes import tree_sha256
from eyrie.core.gguf_target import PROVENANCE


class TargetInfo(BaseModel):
    model: str
    revision: str  # a local directory's "sha256:<its files' digests>", a hub id's commit, or "unresolved"
    chat_template_sha256: str | None
    max_model_len: int | None
    conversion: dict | None = None  # eyrie-conversion.json of a directory eyrie converted (gguf_target)
    files: dict[str, str] | None = None  # relative path -> sha256 (a hub file not in LFS: "git:<blob id>")
    hub_id: str | None = None  # a hub target's id, or the one a local directory was given as a copy of


def describe(model: str, hub_id: str | None = None) -> TargetInfo:
    """Local directory: the sha256 of every file of its tree, each read once per host
    (eyrie.core.file_hashes keeps them by inode, size and mtime). Hub id: the commit sha and the
    hub's own digests of its files. `hub_id`: the hub id a local directory is a copy of."""
    path = Path(model)
    if path.is_dir():
        return _describe_local(path, hub_id)
    return _describe_hub(model)


def _describe_local(path: Path, hub_id: str | None = None) -> TargetInfo:
    # eyrie-conversion.json says how the directory was made (tools, versions), not what it holds: kept
    # as `conversion`, out of the content hash
    files = tree_sha256(path, skip=frozenset({PROVENANCE}))
    conversion = path / PROVENANCE
    return TargetInfo(model=str(path.resolve()), revision=tree_revision(files), files=files, hub_id=hub_id,
                      chat_template_sha256=_template_hash(path), max_model_len=_context(path),
                      conversion=json.loads(conversion.read_text()) if conversion.is_file() else None)


def tree_revision(files: dict[str, str]) -> str:
    """"sha256:" + the sha256 of `sha256sum`'s lines for the files, sorted by path (what
    `find . -type f -not -path '*/.*' | LC_ALL=C sort | xargs sha256sum | sha256sum` prints, less
    eyrie-conversion.json, for paths without backslashes or newlines)."""
    lines = "".join(f"{digest}  ./{rel}\n" for rel, digest in sorted(files.items()))
    return "sha256:" + hashlib.sha256(lines.encode()).hexdigest()


def _describe_hub(model: str) -> TargetInfo:
    from huggingface_hub import HfApi, hf_hub_download

    try:
        info = HfApi().model_info(model, files_metadata=True)
        config_dir = Path(hf_hub_download(model, "tokenizer_config.json", revision=info.sha)).parent
        hf_hub_download(model, "config.json", revision=info.sha)
    except Exception:  # offline or gated: the run still records the name
        return TargetInfo(model=model, revision="unresolved", chat_template_sha256=None,
                          max_model_len=None)
    return TargetInfo(model=model, revision=info.sha, chat_template_sha256=_template_hash(config_dir),
                      max_model_len=_context(config_dir), files=hub_files(info.siblings), hub_id=model)


def hub_files(siblings) -> dict[str, str] | None:
    """The hub's digests of a commit's files (model_info's siblings, with files_metadata): the LFS
    sha256 of a file in LFS (a local copy's own sha256), else "git:" and its git blob id."""
    files = {}
    for s in siblings or []:
        digest = s.lfs.sha256 if s.lfs else f"git:{s.blob_id}" if s.blob_id else None
        if digest and not any(part.startswith(".") for part in s.rfilename.split("/")):
            files[s.rfilename] = digest
    return dict(sorted(files.items())) or None


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
