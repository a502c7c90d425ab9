"""The artifact store: one interface, a local-filesystem backend and an S3/MinIO backend."""

from __future__ import annotations

import contextlib
import functools
import hashlib
import io
import logging
import os
import shutil
import tempfile
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlparse

import orjson

from eyrie.core.config import safe_url
from eyrie.core.errors import EyrieError
from eyrie.data.shared_states import refuse_deleting_used

log = logging.getLogger("eyrie.data.store")
OUTAGE_S = 300  # how long an S3 call is retried while the endpoint is away (restart, network)


@dataclass(frozen=True)
class ObjectInfo:
    key: str
    size: int
    sha256: str


class CorruptObject(EyrieError):
    """An object whose bytes do not match the sha256 recorded when it was written."""

    def __init__(self, problem: str, fix: str, key: str):
        super().__init__(problem, fix)
        self.key = key


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            digest.update(block)
    return digest.hexdigest()


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _check_key(key: str) -> str:
    if not key or key.startswith("/") or ".." in key.split("/"):
        raise ValueError(f"invalid store key {key!r}")
    return key


class Store(ABC):
    """Objects by key. A put is atomic: readers see the old object, or the whole new one."""

    url: str

    @abstractmethod
    def put_bytes(self, key: str, data: bytes) -> ObjectInfo: ...

    @abstractmethod
    def get_bytes(self, key: str) -> bytes: ...

    @abstractmethod
    def exists(self, key: str) -> bool: ...

    @abstractmethod
    def list(self, prefix: str) -> list[str]:
        """Every key under `prefix` (recursive), sorted."""

    def delete(self, key: str) -> None:
        """Removes the object; refused (StatesInUse) for a run's answers or hidden states that
        another run trains on (eyrie.data.shared_states)."""
        refuse_deleting_used(self, key)
        self._delete(key)

    @abstractmethod
    def _delete(self, key: str) -> None: ...

    @abstractmethod
    def free_bytes(self) -> int | None:
        """Free space behind the store, or None where it cannot be known (S3)."""

    def put_json(self, key: str, obj) -> ObjectInfo:
        return self.put_bytes(key, orjson.dumps(obj, option=orjson.OPT_INDENT_2))

    def get_json(self, key: str):
        return orjson.loads(self.get_bytes(key))

    @abstractmethod
    def put_file(self, key: str, path: Path) -> ObjectInfo:
        """A local file as an object, streamed (checkpoints are gigabytes)."""

    @abstractmethod
    def _download(self, key: str, dest: Path) -> None: ...

    def get_file(self, key: str, sha256: str, dest: Path) -> Path:
        """The object into `dest` (streamed), replaced only once its sha256 matches."""
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = dest.with_name(f".{dest.name}.part")
        try:
            self._download(key, tmp)
            if sha256_file(tmp) != sha256:
                raise self._corrupt(key, sha256)
            os.replace(tmp, dest)
        finally:
            tmp.unlink(missing_ok=True)
        return dest

    def _corrupt(self, key: str, sha256: str) -> "CorruptObject":
        return CorruptObject(f"object {key} in {self.url} does not match its recorded sha256 {sha256[:12]}…",
                             "delete the object so the stage that wrote it produces it again.", key)

    def get_verified(self, key: str, sha256: str) -> bytes:
        data = self.get_bytes(key)
        if sha256_bytes(data) != sha256:
            raise self._corrupt(key, sha256)
        return data


@contextlib.contextmanager
def _replacing(path: Path):
    """A temporary file beside `path`, synced and renamed onto it once written: a reader never
    sees half an object, and a failed write leaves nothing behind."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


class FileStore(Store):
    """Local directory. Atomic by writing a temporary file beside the target, then rename."""

    def __init__(self, root: str | Path):
        self.root = Path(root).resolve()
        self.url = f"file://{self.root}"
        try:
            self.root.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise EyrieError(
                f"cannot create the store directory {self.root}: {exc.strerror}.",
                "set EYRIE_STORE_URL=file://DIR to a writable directory.",
            ) from None

    def _path(self, key: str) -> Path:
        return self.root / _check_key(key)

    def put_bytes(self, key: str, data: bytes) -> ObjectInfo:
        with _replacing(self._path(key)) as f:
            f.write(data)
        return ObjectInfo(key, len(data), sha256_bytes(data))

    def put_file(self, key: str, path: Path) -> ObjectInfo:
        digest, size = hashlib.sha256(), 0
        with _replacing(self._path(key)) as out, open(path, "rb") as src:
            for block in iter(lambda: src.read(1 << 22), b""):
                digest.update(block)
                out.write(block)
                size += len(block)
        return ObjectInfo(key, size, digest.hexdigest())

    def _download(self, key: str, dest: Path) -> None:
        try:
            shutil.copyfile(self._path(key), dest)
        except FileNotFoundError:
            raise KeyError(key) from None

    def get_bytes(self, key: str) -> bytes:
        try:
            return self._path(key).read_bytes()
        except FileNotFoundError:
            raise KeyError(key) from None

    def exists(self, key: str) -> bool:
        return self._path(key).is_file()

    def list(self, prefix: str) -> list[str]:
        base = self.root / prefix.rstrip("/") if prefix else self.root
        start = base if base.is_dir() else base.parent
        if not start.is_dir():
            return []
        keys = []
        for path in start.rglob("*"):
            if path.is_file() and not path.name.startswith("."):
                key = path.relative_to(self.root).as_posix()
                if key.startswith(prefix):
                    keys.append(key)
        return sorted(keys)

    def _delete(self, key: str) -> None:
        self._path(key).unlink(missing_ok=True)

    def free_bytes(self) -> int | None:
        return shutil.disk_usage(self.root).free


def _through_outages(method):
    """An S3 call retried (backoff up to 10 s) while the endpoint is unreachable or answers 5xx,
    for up to OUTAGE_S: a MinIO restart costs time, not the task. A put is atomic, so a retried
    one leaves no partial object."""
    @functools.wraps(method)
    def call(self, *args, **kwargs):
        import urllib3
        from minio.error import ServerError

        deadline, delay = time.monotonic() + OUTAGE_S, 0.5
        while True:
            try:
                return method(self, *args, **kwargs)
            except (urllib3.exceptions.HTTPError, ServerError, ConnectionError, TimeoutError) as exc:
                if time.monotonic() + delay > deadline:
                    raise EyrieError(f"the S3 endpoint {self.endpoint} failed for {OUTAGE_S} s "
                                     f"({type(exc).__name__}).", "bring MinIO/S3 back; the task is retried "
                                     "from what is stored.") from None
                log.warning("S3 %s: %s; retried in %.1f s", method.__name__, type(exc).__name__, delay)
                time.sleep(delay)
                delay = min(delay * 2, 10.0)
    return call


class S3Store(Store):
    """S3 or MinIO through the minio SDK. A PUT becomes visible only once complete."""

    def __init__(self, bucket: str, prefix: str, endpoint: str, access_key: str, secret_key: str,
                 region: str | None = None):
        from minio import Minio

        parsed = urlparse(endpoint)
        self.bucket, self.prefix, self.endpoint = bucket, prefix.strip("/"), endpoint
        self.region, self._keys = region, (access_key, secret_key)  # for the admin info (free_bytes)
        self.url = f"s3://{bucket}/{self.prefix}".rstrip("/")
        self.client = Minio(parsed.netloc, access_key=access_key, secret_key=secret_key,
                            secure=parsed.scheme == "https", region=region)
        self._ensure_bucket(endpoint)

    def _ensure_bucket(self, endpoint: str) -> None:
        from minio.error import S3Error

        try:
            if not self.client.bucket_exists(self.bucket):
                self.client.make_bucket(self.bucket)
        except S3Error as exc:
            if exc.code == "BucketAlreadyOwnedByYou":  # another process of ours made it in between: ours
                return
            raise EyrieError(
                f"S3 endpoint {safe_url(endpoint)} refused bucket {self.bucket}: {exc.code}.",
                "check EYRIE_S3_ACCESS_KEY / EYRIE_S3_SECRET_KEY and the bucket name.",
            ) from None
        except Exception as exc:  # urllib3 raises several kinds of connection errors
            raise EyrieError(
                f"cannot reach the S3 endpoint {safe_url(endpoint)}: {type(exc).__name__}.",
                "start MinIO (or your S3 service) or correct EYRIE_S3_ENDPOINT.",
            ) from None

    def _name(self, key: str) -> str:
        return f"{self.prefix}/{_check_key(key)}" if self.prefix else _check_key(key)

    @_through_outages
    def put_bytes(self, key: str, data: bytes) -> ObjectInfo:
        digest = sha256_bytes(data)
        self.client.put_object(self.bucket, self._name(key), io.BytesIO(data), len(data),
                               metadata={"sha256": digest})
        return ObjectInfo(key, len(data), digest)

    @_through_outages
    def put_file(self, key: str, path: Path) -> ObjectInfo:
        digest = sha256_file(path)  # a first pass: the sha256 travels as the object's metadata
        self.client.fput_object(self.bucket, self._name(key), str(path), metadata={"sha256": digest})
        return ObjectInfo(key, Path(path).stat().st_size, digest)

    @_through_outages
    def _download(self, key: str, dest: Path) -> None:
        from minio.error import S3Error

        try:
            self.client.fget_object(self.bucket, self._name(key), str(dest))
        except S3Error as exc:
            if exc.code == "NoSuchKey":
                raise KeyError(key) from None
            raise

    @_through_outages
    def get_bytes(self, key: str) -> bytes:
        from minio.error import S3Error

        try:
            resp = self.client.get_object(self.bucket, self._name(key))
        except S3Error as exc:
            if exc.code == "NoSuchKey":
                raise KeyError(key) from None
            raise
        try:
            return resp.read()
        finally:
            resp.close()
            resp.release_conn()

    @_through_outages
    def exists(self, key: str) -> bool:
        from minio.error import S3Error

        try:
            self.client.stat_object(self.bucket, self._name(key))
            return True
        except S3Error as exc:
            if exc.code in ("NoSuchKey", "NoSuchObject", "ResourceNotFound"):
                return False
            raise

    @_through_outages
    def list(self, prefix: str) -> list[str]:
        strip = len(self.prefix) + 1 if self.prefix else 0
        objects = self.client.list_objects(self.bucket, prefix=self._name(prefix) if prefix else
                                           (self.prefix + "/" if self.prefix else None),
                                           recursive=True)
        return sorted(o.object_name[strip:] for o in objects)

    @_through_outages
    def _delete(self, key: str) -> None:
        self.client.remove_object(self.bucket, self._name(key))

    def free_bytes(self) -> int | None:
        """What the S3 server says it has free: MinIO's admin info (the store's keys are MinIO's
        root user in the stack); None from a server that does not say (AWS S3, SeaweedFS)."""
        return minio_free_bytes(self.endpoint, *self._keys, self.region)


def minio_free_bytes(endpoint: str, access_key: str, secret_key: str, region: str | None = None,
                     timeout_s: float = 5.0) -> int | None:
    """Usable free bytes of a MinIO deployment from `GET /minio/admin/v3/info`: the least free
    drive times the drives, less the erasure parity's share (one drive: its free space)."""
    import urllib3
    from minio.credentials import StaticProvider
    from minio.minioadmin import MinioAdmin

    parsed = urlparse(endpoint)
    http = urllib3.PoolManager(timeout=urllib3.Timeout(connect=timeout_s, read=timeout_s), retries=False)
    try:
        admin = MinioAdmin(endpoint=parsed.netloc, credentials=StaticProvider(access_key, secret_key),
                           region=region or "", secure=parsed.scheme == "https", http_client=http)
        info = orjson.loads(admin.info())
        drives = [d for server in info.get("servers") or [] for d in server.get("drives") or server.get("disks") or []
                  if isinstance(d, dict) and d.get("state", "ok") == "ok" and d.get("availspace") is not None]
        if not drives:
            return None
        backend = info.get("backend") or {}
        per_set = (backend.get("totalDrivesPerSet") or [len(drives)])[0] or len(drives)
        parity = min(backend.get("standardSCParity") or 0, per_set - 1)
        return int(min(int(d["availspace"]) for d in drives) * len(drives) * (per_set - parity) / per_set)
    except Exception as exc:  # not MinIO, not its admin, unreachable, or a shape we do not know: not visible
        log.debug("no free space from %s: %s", safe_url(endpoint), exc)
        return None


def open_store(settings) -> Store:
    """The store named by EYRIE_STORE_URL (file:// or s3://)."""
    parsed = urlparse(settings.store_url)
    if parsed.scheme == "file":
        return FileStore(parsed.netloc + parsed.path)
    if not settings.s3_endpoint:
        raise EyrieError(
            f"EYRIE_STORE_URL={settings.store_url} is an S3 URL but EYRIE_S3_ENDPOINT is not set.",
            "set EYRIE_S3_ENDPOINT=http://HOST:9000 and the access/secret keys.",
        )
    if not (settings.s3_access_key and settings.s3_secret_key):
        raise EyrieError(
            "EYRIE_S3_ACCESS_KEY and EYRIE_S3_SECRET_KEY must be set for an s3:// store.",
            "set both to the credentials of your MinIO/S3 service.",
        )
    return S3Store(parsed.netloc, parsed.path, settings.s3_endpoint,
                   settings.s3_access_key.get_secret_value(),
                   settings.s3_secret_key.get_secret_value(), settings.s3_region)
