"""torch.save'd state (speculators' optimizer and scheduler state) as safetensors + JSON, and back.

What goes to the store holds no pickle: a pickled file of a checkpoint is split into its tensors
(one safetensors file) and the structure around them (JSON: dicts with their key types, lists,
tuples, numbers, strings), and rebuilt with torch.save on the host that restores it. Nothing read
from the store is ever unpickled; only files speculators wrote on this host are (weights_only)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from eyrie.core.errors import EyrieError

PICKLE_MAGIC = (b"PK\x03\x04", b"\x80\x02", b"\x80\x03", b"\x80\x04", b"\x80\x05")  # torch zip, pickle 2-5
PICKLE_SUFFIXES = (".pt", ".pth", ".bin", ".pkl", ".pickle", ".ckpt")
TENSORS, STRUCTURE = ".state.safetensors", ".state.json"


def is_pickled(path: Path) -> bool:
    """A torch.save / pickle file (by name or by its first bytes; safetensors files excepted)."""
    if path.suffix == ".safetensors":
        return False
    with open(path, "rb") as f:
        return path.suffix in PICKLE_SUFFIXES or f.read(4).startswith(PICKLE_MAGIC)


def pickled_name(name: str) -> bool:
    return Path(name).suffix in PICKLE_SUFFIXES


def split(path: Path, dest: Path) -> list[Path]:
    """`path` (written by speculators on this host) as DEST/<stem>.state.safetensors + .state.json."""
    # weights_only: a local file speculators just wrote, never one read from the store
    state = torch.load(path, weights_only=True, map_location="cpu")
    tensors: dict[str, torch.Tensor] = {}
    structure = _encode(state, tensors, set())
    out = [dest / (path.stem + TENSORS), dest / (path.stem + STRUCTURE)]
    save_file(tensors, str(out[0]))
    out[1].write_text(json.dumps({"file": path.name, "state": structure}))
    return out


def rebuild(folder: Path, name: str, parts: list[str]) -> Path:
    """FOLDER/name from its two stored parts (checked against the manifest already); parts removed."""
    tensors_part, structure_part = (folder / p for p in parts)
    tensors = load_file(str(tensors_part), device="cpu")
    structure = json.loads(structure_part.read_text())
    target = folder / name
    torch.save(_decode(structure["state"], tensors), target)  # written here, read by speculators here
    tensors_part.unlink()
    structure_part.unlink()
    return target


def _encode(obj, tensors: dict, storages: set):
    if isinstance(obj, torch.Tensor):
        return {"tensor": _add_tensor(obj, tensors, storages)}
    if isinstance(obj, dict):
        return {"dict": [[_encode(k, tensors, storages), _encode(v, tensors, storages)] for k, v in obj.items()]}
    if isinstance(obj, (list, tuple)):
        return {type(obj).__name__: [_encode(v, tensors, storages) for v in obj]}
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return {"value": obj}
    raise EyrieError(f"checkpoint state holds a {type(obj).__name__}, which eyrie cannot store without pickle.",
                     "report it: eyrie stores tensors, dicts, lists, tuples, numbers and strings only.")


def _add_tensor(t: torch.Tensor, tensors: dict, storages: set) -> str:
    t = t.detach().cpu().contiguous()
    ptr = t.untyped_storage().data_ptr()
    if ptr in storages and t.numel():  # safetensors refuses tensors sharing memory
        t = t.clone()
    storages.add(t.untyped_storage().data_ptr())
    key = str(len(tensors))
    tensors[key] = t
    return key


def _decode(node: dict, tensors: dict):
    (kind, value), = node.items()
    if kind == "tensor":
        return tensors[value]
    if kind == "dict":
        return {_decode(k, tensors): _decode(v, tensors) for k, v in value}
    if kind in ("list", "tuple"):
        items = [_decode(v, tensors) for v in value]
        return items if kind == "list" else tuple(items)
    if kind == "value":
        return value
    raise ValueError(f"unknown node {kind!r} in a checkpoint's structure")
