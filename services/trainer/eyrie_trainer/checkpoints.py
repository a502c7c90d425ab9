"""speculators' checkpoints mirrored to the store: uploaded after every save, restored before a
(re)start, so a trainer on any host resumes from the last one. A checkpoint's manifest (files
and sha256) is written last and removed first: a half-uploaded checkpoint is never used."""

from __future__ import annotations

import shutil
from pathlib import Path

from eyrie.manifest import Layout, now_iso
from eyrie.store import CorruptObject


def upload(store, layout: Layout, root: Path, label: str, epoch: int, local_step: int) -> dict:
    folder = root / label
    store.delete(layout.checkpoint_manifest(label))
    files = {}
    for path in sorted(p for p in folder.iterdir() if p.is_file()):
        info = store.put_bytes(layout.checkpoint_file(label, path.name), path.read_bytes())
        files[path.name] = {"sha256": info.sha256, "bytes": info.size}
    manifest = {"label": label, "epoch": epoch, "local_step": local_step, "files": files,
                "saved_at": now_iso()}
    store.put_json(layout.checkpoint_manifest(label), manifest)
    return manifest


def stored(store, layout: Layout) -> list[dict]:
    """Every complete checkpoint in the store, oldest first."""
    keys = [k for k in store.list(f"{layout.train}/checkpoints/") if k.endswith(".manifest.json")]
    manifests = [store.get_json(k) for k in keys]
    return sorted(manifests, key=lambda m: (m["epoch"], m["local_step"] == 0, m["local_step"]))


def fetch(store, layout: Layout, manifest: dict, folder: Path, names: list[str] | None = None) -> Path:
    """A stored checkpoint's files (all, or `names`) into `folder`, each checked on the way."""
    folder.mkdir(parents=True, exist_ok=True)
    for name, entry in manifest["files"].items():
        if names is None or name in names:
            data = store.get_verified(layout.checkpoint_file(manifest["label"], name), entry["sha256"])
            (folder / name).write_bytes(data)
    return folder


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
        except (CorruptObject, KeyError) as exc:
            log(f"checkpoint {manifest['label']} is unusable ({exc}); trying the one before")
            shutil.rmtree(folder, ignore_errors=True)
    return None
