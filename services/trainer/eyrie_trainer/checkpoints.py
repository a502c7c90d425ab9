"""speculators' checkpoints mirrored to the store: uploaded after every save, restored before a
(re)start, so a trainer on any host resumes from the last one. A checkpoint's manifest (files
and sha256) is written last and removed first: a half-uploaded checkpoint is never used.
The store holds safetensors, JSON and text only: speculators' torch.save'd optimizer and scheduler
state goes up as safetensors + JSON (tensorfile.py) and is rebuilt locally on restore."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

from concurrent.futures import ThreadPoolExecutor

from eyrie.core.errors import EyrieError
from eyrie.data.manifest import Layout, now_iso
from eyrie.data.store import CorruptObject
from eyrie_trainer import tensorfile


class UnsafeObject(EyrieError):
    """A stored checkpoint file that would have to be unpickled: never read."""


def saved_files(root: Path, label: str) -> list[Path]:
    """What speculators' checkpointer wrote into the folder, listed when the save returns (files it
    adds later, like val_metrics.json, are not part of the checkpoint)."""
    return sorted(p for p in (root / label).iterdir() if p.is_file())


def upload(store, layout: Layout, files: list[Path], label: str, epoch: int, local_step: int) -> dict:
    store.delete(layout.checkpoint_manifest(label))
    entries, rebuilds = {}, {}
    with tempfile.TemporaryDirectory(prefix=".eyrie-upload-", dir=files[0].parent.parent) as tmp:
        for path in files:
            parts = tensorfile.split(path, Path(tmp)) if tensorfile.is_pickled(path) else [path]
            if parts != [path]:
                rebuilds[path.name] = [p.name for p in parts]
            for part in parts:
                info = store.put_file(layout.checkpoint_file(label, part.name), part)
                entries[part.name] = {"sha256": info.sha256, "bytes": info.size}
    manifest = {"label": label, "epoch": epoch, "local_step": local_step, "files": entries,
                "rebuilds": rebuilds, "saved_at": now_iso()}
    store.put_json(layout.checkpoint_manifest(label), manifest)
    return manifest


def stored(store, layout: Layout) -> list[dict]:
    """Every complete checkpoint in the store, oldest first."""
    keys = [k for k in store.list(layout.checkpoints) if k.endswith(".manifest.json")]
    manifests = [store.get_json(k) for k in keys]
    return sorted(manifests, key=lambda m: (m["epoch"], m["local_step"] == 0, m["local_step"]))


def fetch(store, layout: Layout, manifest: dict, folder: Path, names: list[str] | None = None) -> Path:
    """A stored checkpoint's files (all, or `names`) into `folder`, each checked on the way; the
    pickled files speculators reads are rebuilt here from their safetensors + JSON parts."""
    for name, entry in manifest["files"].items():
        if names is None or name in names:
            _check_name(manifest["label"], name)
            store.get_file(layout.checkpoint_file(manifest["label"], name), entry["sha256"], folder / name)
    for name, parts in manifest.get("rebuilds", {}).items() if names is None else ():
        if Path(name).name != name or not all(p in manifest["files"] for p in parts):
            raise UnsafeObject(f"checkpoint {manifest['label']}: bad rebuild entry {name!r}.",
                               "delete that checkpoint; training restarts from the one before.")
        tensorfile.rebuild(folder, name, parts)
    return folder


def _check_name(label: str, name: str) -> None:
    if Path(name).name != name or name in (".", ".."):
        raise UnsafeObject(f"checkpoint {label} names a file {name!r} outside its folder.",
                           "delete that checkpoint; training restarts from the one before.")
    if tensorfile.pickled_name(name):
        raise UnsafeObject(f"checkpoint {label} stores {name}, a pickle: eyrie never loads one from the store.",
                           "delete that checkpoint (it predates safetensors-only checkpoints); training "
                           "restarts from the one before, or from scratch.")


def restore(store, layout: Layout, root: Path, log) -> dict | None:
    """The newest stored checkpoint that verifies, into `root` (emptied first: the store is the
    record, whatever this host had locally). None: training starts from scratch."""
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    for manifest in reversed(stored(store, layout)):
        folder = root / manifest["label"]
        try:
            fetch(store, layout, manifest, folder)
            return manifest
        except (CorruptObject, UnsafeObject, KeyError) as exc:
            log(f"checkpoint {manifest['label']} is unusable ({exc}); trying the one before")
            shutil.rmtree(folder, ignore_errors=True)
    return None


class Uploader:
    """Checkpoints go up in one background thread while training goes on; `drain` waits for them
    (before evaluation, and before a task ends for any reason) and re-raises an upload's error."""

    def __init__(self, store, layout: Layout, root: Path, on_done):
        self.store, self.layout, self.root, self.on_done = store, layout, root, on_done
        self.pool, self.pending = ThreadPoolExecutor(1, thread_name_prefix="eyrie-upload"), []

    def submit(self, label: str, epoch: int, local_step: int) -> None:
        files = saved_files(self.root, label)
        self.pending.append(self.pool.submit(self._upload, files, label, epoch, local_step))

    def _upload(self, files, label, epoch, local_step) -> None:
        self.on_done(label, epoch, local_step, upload(self.store, self.layout, files, label, epoch, local_step))

    def drain(self) -> None:
        pending, self.pending = self.pending, []
        for future in pending:
            future.result()
