"""`eyrie run --plan` counts free space where the bytes go (issue 21): the trainer's cache as the
trainer itself reports it (in the stack --plan runs in a generator container, whose own disk
says nothing about EYRIE_TRAINER_CACHE_DIR), and the bucket's as the S3 server says it (MinIO's
admin info; a server that does not say leaves it "not visible")."""

import http.server
import json
import os
import shutil
import subprocess
import threading
import time

import pytest
import redis

from tests.support.harness import BIN, OFFLINE, S3_KEYS, eyrie_in_process, tiny_run_config
from tests.support.processes import stop

TIB = 2**40


class _FakeMinio(http.server.BaseHTTPRequestHandler):
    """Just enough of MinIO for --plan: the bucket exists, no object does, and the admin info
    (signed with the store's keys, as MinIO wants) says what its drives have free."""

    info: dict = {}
    signed_by: list = []

    def _reply(self, code: int, body: bytes = b"", kind: str = "application/xml") -> None:
        self.send_response(code)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def do_GET(self):
        if self.path.startswith("/minio/admin/v3/info"):
            self.signed_by.append(self.headers.get("Authorization", ""))
            return self._reply(200, json.dumps(self.info).encode(), "application/json")
        if "location" in self.path:
            return self._reply(200, b'<LocationConstraint xmlns="http://s3.amazonaws.com/doc/2006-03-01/">'
                                    b"</LocationConstraint>")
        return self._reply(404)

    def do_HEAD(self):
        bucket_only = self.path.split("?")[0].strip("/").count("/") == 0
        return self._reply(200 if bucket_only else 404)

    def log_message(self, *args):
        pass


@pytest.fixture
def fake_minio():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _FakeMinio)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    _FakeMinio.signed_by = []
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def _drive(avail: int) -> dict:
    return {"path": "/data", "state": "ok", "totalspace": 3 * TIB, "usedspace": 3 * TIB - avail, "availspace": avail}


def test_the_s3_servers_own_free_space_is_read(fake_minio):
    from eyrie.data.store import minio_free_bytes

    _FakeMinio.info = {"mode": "online", "servers": [{"drives": [_drive(2_800_000_000_000)]}]}
    assert minio_free_bytes(fake_minio, "ak-eyrie", "sk-secret-key") == 2_800_000_000_000
    assert "Credential=ak-eyrie/" in _FakeMinio.signed_by[-1]  # signed with the store's keys (MinIO's root user)
    # erasure-coded: the least free drive, times the drives, less the parity's share
    _FakeMinio.info = {"servers": [{"drives": [_drive(100), _drive(80), _drive(90), _drive(100)]}],
                       "backend": {"backendType": "Erasure", "standardSCParity": 2, "totalDrivesPerSet": [4]}}
    assert minio_free_bytes(fake_minio, "ak-eyrie", "sk-secret-key") == 160
    _FakeMinio.info = {"servers": []}
    assert minio_free_bytes(fake_minio, "ak-eyrie", "sk-secret-key") is None
    assert minio_free_bytes("http://127.0.0.1:1", "ak", "sk", timeout_s=1) is None  # nothing listens


def test_plan_reads_the_buckets_free_space_from_the_s3_server(fake_minio, tmp_path):
    _FakeMinio.info = {"servers": [{"drives": [_drive(2_800_000_000_000)]}]}
    env = {**os.environ, **OFFLINE, "EYRIE_STORE_URL": "s3://eyrie", "EYRIE_S3_ENDPOINT": fake_minio,
           "EYRIE_S3_ACCESS_KEY": "ak-eyrie", "EYRIE_S3_SECRET_KEY": "sk-secret-key",
           "EYRIE_REDIS_URL": "redis://127.0.0.1:1/0", "EYRIE_CACHE_DIR": str(tmp_path / "cache")}
    env.pop("EYRIE_DATA_DIR", None)
    path = tiny_run_config(tmp_path, "sp", plan={"mean_tokens": 200})
    out = eyrie_in_process("run", "--config", path, "--plan", env=env).stdout
    assert "free at s3://eyrie (the S3 server's own figure): 2.80 TB: fits" in out
    plan = json.loads(eyrie_in_process("run", "--config", path, "--plan", "--json", env=env).stdout)
    assert plan["space"]["bucket_free"] == 2_800_000_000_000 and plan["space"]["same_device"] is False
    # no trainer reports to this (unreachable) Redis: said, not measured on this container's own disk
    assert plan["space"]["trainer_free"] is None
    assert "the trainer's free space is not known here: no `eyrie worker train` reports it" in out
    _FakeMinio.info = {"servers": []}  # the S3 server says nothing: the bucket's directory here (EYRIE_DATA_DIR)
    plan = json.loads(eyrie_in_process("run", "--config", path, "--plan", "--json",
                            env={**env, "EYRIE_DATA_DIR": str(tmp_path)}).stdout)
    assert plan["space"]["bucket_dir"] == str(tmp_path) and plan["space"]["bucket_free"] > 0


def test_the_trainer_reports_its_caches_free_space_and_plan_uses_it(redis_url, s3_server, tmp_path):
    """A real `eyrie worker train` reports EYRIE_CACHE_DIR's free space; --plan, in another
    process with another cache directory and an S3 store (as in the stack), prints the trainer's."""
    store = {"EYRIE_STORE_URL": "s3://eyrie-space", "EYRIE_S3_ENDPOINT": s3_server, **S3_KEYS,
             "EYRIE_REDIS_URL": redis_url}
    trainer_cache = tmp_path / "trainer-cache"
    trainer_cache.mkdir()
    worker_env = {**os.environ, **OFFLINE, **store, "EYRIE_CACHE_DIR": str(trainer_cache)}
    log = tmp_path / "worker.log"
    proc = subprocess.Popen([str(BIN / "eyrie"), "worker", "train"], env=worker_env, stdout=log.open("w"),
                            stderr=subprocess.STDOUT, start_new_session=True)
    conn = redis.Redis.from_url(redis_url)
    reports = "eyrie:disk:train:*"  # eyrie.work.keys.disk_report("train", HOST)
    try:
        deadline = time.monotonic() + 120
        while not list(conn.scan_iter(reports)):
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.5)
        key = next(conn.scan_iter(reports))
        report = json.loads(conn.get(key))
        assert report["dir"] == str(trainer_cache) and 0 < conn.ttl(key) <= 120
        assert abs(report["free"] - shutil.disk_usage(trainer_cache).free) < 2e9
        plan_env = {**os.environ, **OFFLINE, **store, "EYRIE_CACHE_DIR": str(tmp_path / "plan-cache")}
        path = tiny_run_config(tmp_path, "tr", plan={"mean_tokens": 200})
        out = eyrie_in_process("run", "--config", path, "--plan", env=plan_env).stdout
        plan = json.loads(eyrie_in_process("run", "--config", path, "--plan", "--json", env=plan_env).stdout)
    finally:
        stop(proc)
    space = plan["space"]
    assert space["trainer_dir"].startswith(f"{trainer_cache} on {report['host']} (its report")
    assert space["trainer_free"] == report["free"] or abs(space["trainer_free"] - report["free"]) < 2e9
    assert space["fits_trainer"] is True and f"free at {trainer_cache} on {report['host']}" in out
    # SeaweedFS does not say its free space: not visible, and not measured on this host's disk instead
    assert space["bucket_free"] is None and "the S3 server does not say it" in out
