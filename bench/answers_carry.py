"""A run's generated answers carried from one sitting to the next: its plan and every generate object (input
shards, finished shards and their manifests, the parts of unfinished ones) as one .tar.xz of store keys.

A sitting's store does not survive it, and the real-model runs generate for longer than one sitting: the
answers (a few MB) are what is worth keeping. Restored into a store that does not have the run, the next
`eyrie run --config` continues it: finished shards are done, a shard with parts asks only for the rest.
Hidden states, checkpoints and verify figures are not carried (gigabytes; remade from the answers).

  bench/real_model.py --config C --save-answers bench/answers/RUN.tar.xz      (after or while it runs)
  bench/real_model.py --config C --restore-answers bench/answers/RUN.tar.xz   (a new sitting)
"""

from __future__ import annotations

import io
import json
import tarfile
from pathlib import Path

from eyrie.data.manifest import Layout

CARRIED = ("manifest.json", "pipeline.json", "generate/")
ROOT = Path(__file__).resolve().parents[1]
# where the run config and the run manifest name a path of the saving machine: carried relative to the
# repository (or by name), since the restoring machine's paths are its own and its inputs are matched by
# content (eyrie.runs.identity)
PATHS = {"pipeline.json": (("target", "model"), ("dataset", "source")),
         "manifest.json": (("target", "model"), ("dataset", "source"))}


def carried_keys(store, run: str) -> list[str]:
    root = Layout(run).root
    keys = [f"{root}/{name}" for name in CARRIED if not name.endswith("/") and store.exists(f"{root}/{name}")]
    return keys + sorted(store.list(f"{root}/generate/"))


def save_answers(store, run: str, out: Path) -> int:
    """Every carried key of `run` into `out` (.tar.xz); returns how many objects. While the run generates, a
    shard that finishes between the listing and the reads removes its parts: listed and read again."""
    for _ in range(5):
        try:
            objects = [(key, portable(key, store.get_bytes(key))) for key in carried_keys(store, run)]
            break
        except KeyError:
            continue
    else:
        raise SystemExit(f"run {run}: objects kept vanishing while they were read; save again once it settles.")
    if not objects:
        raise SystemExit(f"run {run} has nothing generated in {store.url} to save.")
    out.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(out, "w:xz") as tar:
        for key, data in objects:
            info = tarfile.TarInfo(key)
            info.size = len(data)  # mtime 0: the same answers make the same archive
            tar.addfile(info, io.BytesIO(data))
    return len(objects)


def portable(key: str, data: bytes) -> bytes:
    """The object as carried: a run config's or manifest's paths of this machine made relative to the
    repository (a path elsewhere: its name alone)."""
    fields = PATHS.get(key.rsplit("/", 1)[-1]) if key.count("/") == 2 else None
    if not fields:
        return data
    doc = json.loads(data)
    moved = False
    for section, name in fields:
        value = (doc.get(section) or {}).get(name)
        if value and Path(value).is_absolute():
            path, moved = Path(value), True
            doc[section][name] = str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else path.name
    return json.dumps(doc, indent=2).encode() if moved else data


def restore_answers(store, run: str, archive: Path) -> int:
    """The archive's objects into `store`, where it does not have the run yet; returns how many (0: it has)."""
    if store.exists(Layout(run).manifest):
        return 0
    prefix = f"{Layout(run).root}/"
    with tarfile.open(archive, "r:xz") as tar:
        members = [m for m in tar.getmembers() if m.isfile()]
        strangers = [m.name for m in members if not m.name.startswith(prefix)]
        if strangers:
            raise SystemExit(f"{archive} holds objects of another run ({strangers[0]}), not of run {run}: "
                             "give the archive saved for this config's run.")
        # the run manifest last: a restore cut short is restored again, not taken for a run
        for member in sorted(members, key=lambda m: m.name.endswith("/manifest.json")):
            store.put_bytes(member.name, tar.extractfile(member).read())
    return len(members)
