"""What POST /runs may read on the API's host: a local dataset only under EYRIE_API_DATASET_ROOTS
(none by default); hub ids always. The CLI, run by the user on their own host, is not limited."""

from __future__ import annotations

from pathlib import Path

from eyrie.core.errors import EyrieError
from eyrie.data.dataset import looks_like_path


def check_dataset_source(source: str, roots: list[str]) -> None:
    """Raise (a 400 naming the setting) for a local path outside every allowed root."""
    path = Path(source)
    if not (path.exists() or looks_like_path(source)):
        return  # a hub id: the generator asks the hub, no local file is read
    if any(_inside(path, root) for root in roots):
        return
    allowed = ", ".join(roots) if roots else "none set, so the API reads no local dataset"
    raise EyrieError(f"dataset.source {source!r} is a local path outside EYRIE_API_DATASET_ROOTS ({allowed}).",
                     "put the dataset under a directory of EYRIE_API_DATASET_ROOTS (set on the API server), "
                     "give a Hugging Face dataset id, or start the run with `eyrie run` on that host.")


def _inside(path: Path, root: str) -> bool:
    try:  # symlinks and '..' resolved first: a link inside a root to a file outside is outside
        return path.resolve().is_relative_to(Path(root).resolve())
    except (OSError, ValueError, RuntimeError):  # a NUL byte, a symlink loop
        return False
