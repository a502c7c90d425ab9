"""Where `eyrie run --plan`'s bytes go, against the free space there: the bucket's and the
trainer's local copy of the hidden states (eyrie.runs.projection calls it where it measures)."""

from __future__ import annotations

import shutil
import time
from pathlib import Path
from urllib.parse import urlparse

from eyrie.core.errors import EyrieError
from eyrie.data.store import open_store
from eyrie.runs.plan_result import Plan, Space
from eyrie.stages.train import Train
from eyrie.work.disk import reported


def space(config, settings, p: Plan) -> Space:
    """Bucket + the trainer's local copy of the hidden states (as the storage mode keeps them:
    offline all, hybrid what the budget holds, online none), against the free space where they
    go: the bucket's directory where this host sees it (plan.store_path, a file:// store), else
    what the S3 server says (MinIO's admin info), else EYRIE_DATA_DIR; the trainer's cache as the
    trainers report it to Redis (eyrie.work.disk; in the stack --plan runs in another container), or
    this host's own with a file:// store or plan.trainer_cache_path; and the configured budget."""
    chosen = p.storage.chosen or "offline"
    mode = p.storage.modes[chosen]
    local = urlparse(settings.store_url).scheme == "file"
    bucket_dir = _existing(config.plan.store_path or _store_dir(settings.store_url))
    cache_dir = _existing(config.plan.trainer_cache_path or (settings.cache_dir if local else None))
    s = Space(bucket_bytes=mode.bucket_bytes, trainer_copy_bytes=mode.trainer_cache_bytes, mode=chosen,
              bucket_dir=bucket_dir and str(bucket_dir), trainer_dir=cache_dir and str(cache_dir),
              basis="upper bound" if p.hidden_states_bytes_expected is None else "expected mean")
    bucket_dir = _bucket_free(s, settings, bucket_dir)
    _trainer_free(s, settings, cache_dir)
    if bucket_dir and cache_dir:
        s.same_device = bucket_dir.stat().st_dev == cache_dir.stat().st_dev
    need_one = s.bucket_bytes + s.trainer_copy_bytes if s.same_device else s.bucket_bytes
    s.fits_bucket = None if s.bucket_free is None else need_one <= s.bucket_free
    s.fits_trainer = None if s.trainer_free is None or s.same_device else s.trainer_copy_bytes <= s.trainer_free
    return s


def _bucket_free(s: Space, settings, bucket_dir: Path | None) -> Path | None:
    """The bucket's free space where it is seen, into `s`; the directory it was read at, if any."""
    if bucket_dir:
        s.bucket_free = shutil.disk_usage(bucket_dir).free
    elif (said := _s3_free(settings)) is not None:
        s.bucket_free, s.bucket_dir = said, f"{settings.store_url} (the S3 server's own figure)"
    elif data_dir := _existing(settings.data_dir):
        bucket_dir, s.bucket_dir, s.bucket_free = data_dir, str(data_dir), shutil.disk_usage(data_dir).free
    return bucket_dir


def _trainer_free(s: Space, settings, cache_dir: Path | None) -> None:
    """The trainer's free space, into `s`: this host's cache directory, else the trainers' reports."""
    if cache_dir:
        s.trainer_free = shutil.disk_usage(cache_dir).free
    elif reports := reported(settings.redis_url, Train.queue):
        least = reports[0]  # any trainer may take the run's train task: the one with the least room
        age = max(0.0, time.time() - least["at"])
        several = f"; {len(reports)} trainers, the least free" if len(reports) > 1 else ""
        s.trainer_free = least["free"]
        s.trainer_dir = f"{least['dir']} on {least['host']} (its report, {age:.0f} s old{several})"


def _s3_free(settings) -> int | None:
    """What the S3 server behind an s3:// store says it has free (None: it does not say)."""
    if urlparse(settings.store_url).scheme != "s3":
        return None
    try:
        return open_store(settings).free_bytes()
    except EyrieError:
        return None


def _store_dir(store_url: str) -> str | None:
    parsed = urlparse(store_url)
    return (parsed.netloc + parsed.path) if parsed.scheme == "file" else None


def _existing(path: str | None) -> Path | None:
    """The directory, or its nearest existing parent (free space is the same device's)."""
    if not path:
        return None
    try:
        current = Path(path).expanduser().resolve()
        while not current.exists() and current != current.parent:
            current = current.parent
        return current
    except (OSError, ValueError, RuntimeError):  # a path this host cannot even look at
        return None
