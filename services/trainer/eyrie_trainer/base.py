"""A base drafter to finetune from: fetched, converted to speculators' format, checked to fit."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import warnings
from pathlib import Path

from pydantic import BaseModel

from eyrie.core.errors import EyrieError
from eyrie.core.target import text_config

ALLOW_PATTERNS = ["config.json", "*.safetensors", "*.bin", "*.json", "*.npy"]
STAMP = ".eyrie-converted.json"  # written last: a converted directory without it is half-written
WEIGHTS = ("model.safetensors", "pytorch_model.bin")  # the single files speculators' converter reads
CHECKPOINT = "pass the directory of a drafter checkpoint (config.json + weights)."
HUB_ERRORS = (  # (huggingface_hub.errors class, what happened, the fix): the first match wins
    ("GatedRepoError", "is gated", "accept its terms on huggingface.co and set HF_TOKEN (a token with access)"),
    ("RevisionNotFoundError", "has no revision {revision}", "pass a branch, tag or commit of {source}"),
    ("RepositoryNotFoundError", "does not exist or is private", "check the repo id (private: set HF_TOKEN)"),
    ("HFValidationError", "is not a valid repo id", "pass owner/name"),
    ("LocalEntryNotFoundError", "is not in the cache {cache_dir} and {offline}",
     "download it once with network access (HF_HUB_OFFLINE unset) into that cache"))


class BaseInfo(BaseModel):
    """What a run finetunes from, as checked against its target."""

    source: str
    revision: str | None = None
    path: str  # the speculators-format directory training loads
    legacy: bool = False  # converted from the legacy EAGLE-3 format
    hidden_size: int
    target_vocab: int
    draft_vocab: int
    aux_layers: list[int]


def fetch(source: str, revision: str | None, cache_dir: Path) -> Path:
    """A local directory as is (revision ignored), else the hub repo via snapshot_download into
    cache_dir: resumable by huggingface_hub's own mechanism (a rerun fetches only what is missing)."""
    path = Path(source).expanduser()
    if not path.is_dir():
        if source.startswith(("/", ".", "~")) or source.count("/") > 1:
            raise EyrieError(f"base drafter {source}: no such directory.",
                             "pass an existing directory or a Hugging Face repo id (owner/name).")
        from huggingface_hub import snapshot_download

        try:
            path = Path(snapshot_download(repo_id=source, revision=revision, cache_dir=str(cache_dir),
                                          allow_patterns=ALLOW_PATTERNS))
        except Exception as exc:  # every hub failure is the user's to fix: name it, no traceback
            raise _hub_error(source, revision, cache_dir, exc) from None
    if not (path / "config.json").is_file():
        raise EyrieError(f"base drafter {source} has no config.json (in {path}).", CHECKPOINT)
    return path


def _hub_error(source: str, revision: str | None, cache_dir: Path, exc: Exception) -> EyrieError:
    from huggingface_hub import constants, errors

    why, fix = next(((w, f) for name, w, f in HUB_ERRORS if isinstance(exc, getattr(errors, name))),
                    (f"could not be downloaded ({type(exc).__name__})", "check the network and HF_TOKEN, retry"))
    offline = "HF_HUB_OFFLINE is set" if constants.is_offline_mode() else "the hub is unreachable"
    names = {"source": source, "revision": revision, "cache_dir": cache_dir, "offline": offline}
    return EyrieError(f"base drafter {source}{'@' + revision if revision else ''} on the Hugging Face hub "
                      f"{why.format(**names)}.",
                      f"{fix.format(**names)}, or pass a local directory holding the drafter.")


def _config(path: Path) -> dict:
    try:
        return json.loads((Path(path) / "config.json").read_text())
    except (OSError, ValueError) as exc:
        raise EyrieError(f"cannot read {Path(path) / 'config.json'} ({type(exc).__name__}).", CHECKPOINT) from None


def is_legacy(path: Path) -> bool:
    """Legacy EAGLE-3 (SafeAILab, AQ-MedAI: midlayer.*, fc, d2t/t2d): no `speculators_config`."""
    return "speculators_config" not in _config(path)


def to_speculators(path: Path, target_model: str, out_dir: Path) -> Path:
    """A speculators-format directory as is; a legacy one converted by speculators' Eagle3Converter
    into out_dir (built beside it, then renamed; a finished conversion of the same files is reused)."""
    path, out_dir = Path(path), Path(out_dir)
    if not is_legacy(path):
        return path
    stamp = _stamp(path, target_model)
    if (out_dir / STAMP).is_file() and json.loads((out_dir / STAMP).read_text()) == stamp:
        return out_dir
    _check_eagle3_weights(path)
    legacy = _config(path)
    # The converter reads no aux layer ids from the legacy config (only from its argument), so it
    # would write none: pass the ids kept in eagle_config (AQ-MedAI; where vLLM reads them).
    aux = (legacy.get("eagle_config") or legacy).get("eagle_aux_hidden_state_layer_ids")
    tmp = out_dir.with_name(f".{out_dir.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        from speculators.convert.eagle.eagle3_converter import Eagle3Converter

        Eagle3Converter().convert(path, tmp, target_model, validate=False,
                                  eagle_aux_hidden_state_layer_ids=aux)
    except Exception as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        why = f"{type(exc).__name__}: {(str(exc).splitlines() or [''])[0]}"
        raise EyrieError(f"cannot convert the legacy EAGLE-3 drafter {path} for {target_model} ({why}).",
                         "pass an EAGLE-3 drafter made for this target (speculators or legacy).") from None
    (tmp / STAMP).write_text(json.dumps(stamp))
    shutil.rmtree(out_dir, ignore_errors=True)
    try:
        os.replace(tmp, out_dir)
    except OSError:  # another worker renamed in the same conversion first: keep that one
        shutil.rmtree(tmp, ignore_errors=True)
    return out_dir


def _stamp(path: Path, target_model: str) -> dict:
    """What a conversion is made from: these files (size, mtime) for this target."""
    files = {f.name: [f.stat().st_size, f.stat().st_mtime_ns]
             for f in (path / name for name in ("config.json", *WEIGHTS)) if f.is_file()}
    return {"source": str(path.resolve()), "target_model": target_model, "files": files}


def _check_eagle3_weights(path: Path) -> None:
    """The converter loads weights non-strictly: anything else would 'convert' to random weights."""
    from speculators.convert.utils import load_checkpoint_weights

    single = any((path / name).is_file() for name in WEIGHTS)  # else it raises: none, or sharded
    names = set(load_checkpoint_weights(path)) if single else set()  # what the converter reads
    if "fc.weight" not in names or not any(n.startswith("midlayer.") for n in names):
        raise EyrieError(f"{path} is not a legacy EAGLE-3 drafter (no {' or '.join(WEIGHTS)} with "
                         "fc.weight and midlayer.* weights).", "pass an EAGLE-3 drafter (one weights file).")


def check_base(path: Path, target_model: str, aux_layers: list[int], draft_vocab: int | None,
               trust_remote_code: bool = False) -> BaseInfo:
    """Refuse, with one error naming every mismatch, a base that cannot be finetuned on this run."""
    config = _config(path)
    if config.get("speculators_model_type") != "eagle3":
        raise EyrieError(f"base drafter {path} is a {config.get('speculators_model_type')} speculator, "
                         "not EAGLE-3.", "pass an EAGLE-3 drafter.")
    layer, target = config.get("transformer_layer_config") or {}, text_config(target_model, trust_remote_code)
    # vLLM concatenates aux states in ascending layer order, so order within the ids is moot
    info = BaseInfo(source=str(path), path=str(path), hidden_size=layer.get("hidden_size", -1),
                    target_vocab=layer.get("vocab_size", -1), draft_vocab=config.get("draft_vocab_size", -1),
                    aux_layers=sorted(_resolve_aux(config.get("eagle_aux_hidden_state_layer_ids"), target_model)))
    ours = "a base drafter made for this target"
    checks = [("hidden size", info.hidden_size, target.hidden_size, "target", ours),
              ("target vocab size", info.target_vocab, target.vocab_size, "target", ours),
              ("aux layers", info.aux_layers, sorted(aux_layers), "this run",
               f"extract a run with --layers {','.join(map(str, info.aux_layers))}")]
    if draft_vocab is not None:
        checks.append(("draft vocab size", info.draft_vocab, draft_vocab, "requested",
                       f"request draft vocab {info.draft_vocab} (or none)"))
    bad = [(f"{name} {base} (base) vs {want} ({whose})", fix)
           for name, base, want, whose, fix in checks if base != want]
    if bad:
        fixes = "; ".join(dict.fromkeys(fix for _, fix in bad))
        raise EyrieError(f"base drafter {path} does not fit target {target_model}: "
                         f"{'; '.join(p for p, _ in bad)}.", f"{fixes}; or train from scratch (no base).")
    return info


def _resolve_aux(ids: list[int] | None, target_model: str) -> list[int]:
    """The base's ids, else what Eagle3DraftModel.from_pretrained resolves: speculators'
    resolve_target_layer_ids default ([2, n // 2, n - 3]) for the target; [] if that is invalid."""
    from speculators.models.utils import resolve_target_layer_ids

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # its "not explicitly set" warning: we compare, not guess
        try:
            return list(ids) if ids is not None else resolve_target_layer_ids(None, target_model)
        except ValueError:
            return []


def prepare_base(source: str, revision: str | None, target_model: str, aux_layers: list[int],
                 draft_vocab: int | None, cache_dir: Path, trust_remote_code: bool = False) -> tuple[Path, BaseInfo]:
    """Fetch, convert if legacy, check: the speculators-format directory to finetune from."""
    cache_dir = Path(cache_dir)
    path = fetch(source, revision, cache_dir / "hub")
    legacy = is_legacy(path)
    key = hashlib.sha256(f"{path.resolve()}\0{target_model}".encode()).hexdigest()[:16]
    ready = to_speculators(path, target_model, cache_dir / "converted" / key)
    info = check_base(ready, target_model, aux_layers, draft_vocab, trust_remote_code)
    return ready, info.model_copy(update={"source": source, "revision": revision, "legacy": legacy})


def save_vocab_mapping(path: Path, out_dir: Path) -> tuple[Path, Path]:
    """The base's own d2t/t2d as the .npy files speculators' --d2t-path/--t2d-path read: a
    finetune keeps the vocabulary its lm_head was trained on."""
    import numpy as np
    from safetensors import safe_open

    out_dir.mkdir(parents=True, exist_ok=True)
    with safe_open(str(path / "model.safetensors"), "pt") as weights:
        names = set(weights.keys())
        if not {"d2t", "t2d"} <= names:
            raise EyrieError(f"base drafter {path} has no d2t/t2d vocabulary mapping.",
                             "finetune from an EAGLE-3 drafter with a draft vocabulary, or train without --base.")
        d2t, t2d = weights.get_tensor("d2t"), weights.get_tensor("t2d")
    np.save(out_dir / "d2t.npy", d2t.numpy())
    np.save(out_dir / "t2d.npy", t2d.numpy())
    return out_dir / "d2t.npy", out_dir / "t2d.npy"
