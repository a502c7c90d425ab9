"""Prompt datasets: local JSONL, local parquet, or HF datasets (hub id or local directory)."""

from __future__ import annotations

import codecs
import contextlib
import hashlib
import os
from collections.abc import Iterator
from pathlib import Path

import orjson

from eyrie.core.errors import EyrieError
from eyrie.data.manifest import DatasetRef

Row = tuple[int, dict | None, str | None]  # (row index, parsed row, why it could not be read)


def _sha256_files(paths: list[Path]) -> str:
    digest = hashlib.sha256()
    for path in sorted(paths):
        digest.update(path.name.encode())
        with path.open("rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                digest.update(block)
    return digest.hexdigest()


DATA_SUFFIXES = {".parquet", ".jsonl", ".json", ".csv", ".arrow"}
MAX_DEPTH, MAX_FILES = 2, 10_000


def dataset_files(root: Path) -> list[Path]:
    """A dataset directory's data files (saved dataset or hub layout: at most 2 levels down, hidden
    and cache folders skipped). Anything else, e.g. "/" or a home directory, is refused before
    any file is read."""
    found = []
    for folder, subdirs, files in os.walk(root):
        depth = len(Path(folder).relative_to(root).parts)
        subdirs[:] = [] if depth >= MAX_DEPTH else [d for d in subdirs if not d.startswith(".")]
        found += [Path(folder) / f for f in files if Path(f).suffix in DATA_SUFFIXES and not f.startswith(".")]
        if len(found) > MAX_FILES:
            break
    if not found or len(found) > MAX_FILES:
        why = "no data files (.parquet, .jsonl, .json, .csv, .arrow)" if not found else f"over {MAX_FILES:,} files"
        raise EyrieError(f"{root} does not look like a dataset directory: {why} within {MAX_DEPTH} levels.",
                         "pass a dataset file (.jsonl/.parquet), a dataset directory, or a hub id.")
    if not any(f.stat().st_size for f in found):
        raise EyrieError(f"dataset directory {root} has only empty data files ({len(found)}).",
                         "check that the download or export finished, or pass another dataset.")
    return found


def resolve(source: str, split: str = "train", revision: str | None = None,
            limit: int | None = None) -> DatasetRef:
    """Identify the dataset exactly (revision or content hash) and how many rows to use."""
    if not source.strip():
        raise EyrieError("no dataset given (an empty name).", "pass a .jsonl/.parquet file, a dataset directory or a hub id.")
    path = Path(source)
    _check_local(path)
    if path.is_file():
        kind = "parquet" if path.suffix == ".parquet" else "jsonl"
        total = _count_parquet(path) if kind == "parquet" else _count_jsonl(path)
        rev = _sha256_files([path])
    elif path.is_dir():
        kind = "hf"
        rev = _sha256_files(dataset_files(path))
        total = len(_load_hf(str(path), split, None))
    elif path.exists():
        raise EyrieError(f"dataset {source} is not a regular file or a directory.",
                         "pass a .jsonl/.parquet file, a dataset directory or a hub id.")
    elif looks_like_path(source):  # a hub id is `name` or `owner/name`, without a file's suffix
        where = "" if path.is_absolute() else f" (looked in {Path.cwd()})"
        raise EyrieError(f"no such file {source}{where}.",
                         "check the path, or give a Hugging Face dataset id such as "
                         "mlabonne/open-perfectblend.")
    else:
        kind = "hf"
        rev = _hub_revision(source, revision)
        total = len(_load_hf(source, split, rev))
    row_end = total if limit is None else min(total, limit)
    if row_end == 0:
        raise EyrieError(f"dataset {source} has no rows.", "give a dataset with at least one row.")
    return DatasetRef(source=str(path.resolve()) if kind != "hf" or path.is_dir() else source,
                      kind=kind, revision=rev, split=split, row_end=row_end)


def iter_rows(ref: DatasetRef) -> Iterator[Row]:
    """Rows [row_start, row_end) in order. A row that cannot be read comes with a reason."""
    if ref.kind == "jsonl":
        yield from _iter_jsonl(Path(ref.source), ref.row_start, ref.row_end)
    elif ref.kind == "parquet":
        yield from _iter_parquet(Path(ref.source), ref.row_start, ref.row_end)
    else:
        ds = _load_hf(ref.source, ref.split, None if Path(ref.source).is_dir() else ref.revision)
        for i in range(ref.row_start, ref.row_end):
            yield _typed_row(i, ds[i])


def _typed_row(i: int, row) -> Row:
    """A parquet/HF row; values of `binary` columns become text when they are UTF-8."""
    try:
        return i, _as_text(row), None
    except UnicodeDecodeError:
        return i, None, "non_utf8_bytes"


def _as_text(value):
    if isinstance(value, (bytes, bytearray)):
        return bytes(value).decode("utf-8")
    if isinstance(value, dict):
        return {k: _as_text(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_as_text(v) for v in value]
    return value


def _check_local(path: Path) -> None:
    """A name the operating system refuses outright (too long, a loop of links) is refused here."""
    try:
        path.stat()
    except (FileNotFoundError, NotADirectoryError):
        pass
    except OSError as exc:
        raise EyrieError(f"cannot use dataset path {str(path)[:120]!r}: {exc.strerror}.",
                         "pass an existing .jsonl/.parquet file, a dataset directory or a hub id.") from None


def looks_like_path(source: str) -> bool:
    return source.startswith((".", "/", "~")) or source.endswith((".jsonl", ".json", ".parquet")) \
        or source.count("/") != 1


def _count_jsonl(path: Path) -> int:
    with path.open("rb") as f:
        return sum(1 for _ in f)


def _iter_jsonl(path: Path, start: int, end: int) -> Iterator[Row]:
    with path.open("rb") as f:
        for i, line in enumerate(f):
            if i >= end:
                break
            if i >= start:
                yield (i, *_parse_line(line.removeprefix(codecs.BOM_UTF8) if i == 0 else line))


def _parse_line(line: bytes) -> tuple[dict | None, str | None]:
    if not line.strip():
        return None, "empty_line"
    try:
        text = line.decode("utf-8")
    except UnicodeDecodeError:
        return None, "not_utf8"
    try:
        return orjson.loads(text), None
    except orjson.JSONDecodeError:
        return None, "invalid_json"


def _open_parquet(path: Path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        return pq.ParquetFile(path)
    except (pa.ArrowInvalid, OSError) as exc:
        raise EyrieError(f"parquet file {path} cannot be read ({exc}).",
                         "re-download or re-export the file; a truncated copy is the usual cause.") from None


def _count_parquet(path: Path) -> int:
    return _open_parquet(path).metadata.num_rows


def _iter_parquet(path: Path, start: int, end: int) -> Iterator[Row]:
    import pyarrow as pa

    pf, offset = _open_parquet(path), 0
    for group in range(pf.num_row_groups):
        n = pf.metadata.row_group(group).num_rows
        if offset + n > start and offset < end:
            try:
                rows = pf.read_row_group(group).to_pylist()
            except (pa.ArrowInvalid, OSError) as exc:
                raise EyrieError(f"parquet file {path} is damaged in row group {group} ({exc}).",
                                 "re-download or re-export the file.") from None
            for j, row in enumerate(rows):
                if start <= offset + j < end:
                    yield _typed_row(offset + j, row)
        offset += n


_HF_CACHE: dict = {}


def _load_hf(source: str, split: str, revision: str | None):
    """A Hugging Face dataset split, loaded once per process (hub id or local directory)."""
    key = (source, split, revision)
    if key not in _HF_CACHE:
        import datasets

        try:
            with _quiet(Path(source).is_dir()):
                _HF_CACHE[key] = datasets.load_dataset(source, split=split, revision=revision)
        except Exception as exc:  # datasets raises many types for a missing/unreadable dataset
            root = _root_cause(exc)
            why = str(root).strip().splitlines()[0].rstrip(".") if str(root).strip() else "(no message)"
            raise EyrieError(f"cannot load dataset {source} (split {split}): {type(root).__name__}: {why}.",
                             "check the id, split and revision, and that the hub (or HF cache) is "
                             "reachable; or pass a local .jsonl/.parquet file.") from None
    return _HF_CACHE[key]


def _root_cause(exc: BaseException) -> BaseException:
    """datasets wraps what went wrong (DatasetGenerationError around pyarrow's parse error)."""
    seen = {id(exc)}
    while exc.__cause__ is not None and id(exc.__cause__) not in seen:
        exc = exc.__cause__
        seen.add(id(exc))
    return exc


@contextlib.contextmanager
def _quiet(local: bool):
    """A local directory loads in moments: no progress bars, and datasets' own error logs (which
    repeat what the EyrieError says) stay off the user's terminal. Hub downloads keep their bars."""
    from datasets.utils import logging as ds_logging

    if not local:
        yield
        return
    bars, verbosity = ds_logging.is_progress_bar_enabled(), ds_logging.get_verbosity()
    ds_logging.disable_progress_bar()
    ds_logging.set_verbosity(ds_logging.CRITICAL)
    try:
        yield
    finally:
        ds_logging.set_verbosity(verbosity)
        if bars:
            ds_logging.enable_progress_bar()


def _hub_revision(source: str, revision: str | None) -> str:
    from huggingface_hub import HfApi

    try:
        return HfApi().dataset_info(source, revision=revision).sha
    except Exception as exc:
        raise EyrieError(f"cannot resolve dataset {source} on the Hugging Face hub ({type(exc).__name__}).",
                         "check the id and network access (HF_HUB_OFFLINE must be unset), or pass "
                         "a local file.") from None
