"""A package index of a test's own, over HTTPS under a CA of its own: what a host behind a
TLS-intercepting proxy, or with a private index, gives pip. tests/e2e/test_compose_e2e.py builds eyrie-base
against it from inside `docker build` (the build reaches the host at Docker's bridge gateway)."""

from __future__ import annotations

import hashlib
import http.server
import ipaddress
import json
import os
import re
import shutil
import ssl
import subprocess
import sys
import threading
from pathlib import Path


def canonical(name: str) -> str:
    """PEP 503's normalized project name."""
    return re.sub(r"[-_.]+", "-", name).lower()


def bridge_gateway() -> str:
    """The host's address on Docker's default bridge network: where a `docker build` step reaches it."""
    out = subprocess.run(["docker", "network", "inspect", "bridge", "--format", "{{json .IPAM.Config}}"],
                         capture_output=True, text=True, check=True).stdout
    configs = [c for c in json.loads(out) or [] if ":" not in c.get("Subnet", ":")]  # IPv4
    for config in configs:
        if config.get("Gateway"):
            return config["Gateway"]
    return str(ipaddress.ip_network(configs[0]["Subnet"])[1])  # Docker's default: the first address


def make_ca(work: Path, ip: str) -> tuple[Path, Path, Path]:
    """A fresh CA (ca.pem) and a server certificate it signed for `ip`: (ca.pem, server.pem, server.key)."""
    def openssl(*args: str) -> None:
        subprocess.run(["openssl", *args], cwd=work, check=True, capture_output=True, timeout=60)

    key = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    openssl("req", "-x509", *key, "-keyout", "ca.key", "-out", "ca.pem", "-days", "2", "-subj", "/CN=eyrie test CA",
            "-addext", "basicConstraints=critical,CA:TRUE", "-addext", "keyUsage=critical,keyCertSign,cRLSign")
    openssl("req", "-new", *key, "-keyout", "server.key", "-out", "server.csr", "-subj", f"/CN={ip}")
    (work / "server.ext").write_text("basicConstraints=CA:FALSE\nkeyUsage=critical,digitalSignature\n"
                                     f"extendedKeyUsage=serverAuth\nsubjectAltName=IP:{ip}\n"
                                     "authorityKeyIdentifier=keyid\n")
    openssl("x509", "-req", "-in", "server.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
            "-days", "2", "-extfile", "server.ext", "-out", "server.pem")
    return work / "ca.pem", work / "server.pem", work / "server.key"


def download_wheels(dest: Path, wheelhouse: Path, *requirements: str) -> None:
    """The wheels `requirements` need, into dest: copied out of the wheelhouse (`make wheelhouse`) when
    it holds them all, else fetched from the host's configured index (its pip settings apply)."""
    download = [sys.executable, "-m", "pip", "download", "-q", "--only-binary=:all:", "--dest", str(dest),
                *requirements]
    errors = []
    if list(wheelhouse.glob("*.whl")):
        # the wheelhouse alone: none of the host's pip settings (its extra indexes, find-links)
        env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
        proc = subprocess.run([*download, "--no-index", "--find-links", str(wheelhouse)], capture_output=True,
                              text=True, timeout=600, env={**env, "PIP_CONFIG_FILE": os.devnull})
        if proc.returncode == 0:
            return
        errors.append(proc.stderr[-2000:])
    proc = subprocess.run(download, capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, "\n".join([*errors, proc.stderr[-3000:]])


class WheelIndex(http.server.ThreadingHTTPServer):
    """A PEP 503 "simple" index of the wheels in a folder, over HTTPS, on a thread of its own:
    https://HOST:PORT/simple/. It records the TLS handshakes clients refused and the paths it served."""

    daemon_threads = True

    def __init__(self, host: str, wheels: Path, cert: Path, key: Path):
        self.files = {p.name: p for p in sorted(wheels.glob("*.whl"))}
        self.sha256 = {name: hashlib.sha256(p.read_bytes()).hexdigest() for name, p in self.files.items()}
        self.projects: dict[str, list[str]] = {}
        for name in self.files:
            self.projects.setdefault(canonical(name.split("-")[0]), []).append(name)
        self.refused: list[str] = []  # TLS handshakes that failed, e.g. the client does not know our CA
        self.served: list[str] = []
        super().__init__((host, 0), _IndexHandler)
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.load_cert_chain(cert, key)
        # the handshake happens on the request's thread, never blocking the accept loop
        self.socket = context.wrap_socket(self.socket, server_side=True, do_handshake_on_connect=False)
        self.url = f"https://{host}:{self.server_address[1]}/simple/"
        self._thread = threading.Thread(target=self.serve_forever, daemon=True)

    def finish_request(self, request, client_address):
        try:
            request.do_handshake()
        except (ssl.SSLError, OSError) as exc:
            self.refused.append(str(exc))
            return
        super().finish_request(request, client_address)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self.shutdown()
        self.server_close()


class _IndexHandler(http.server.BaseHTTPRequestHandler):
    server: WheelIndex

    def do_GET(self):  # noqa: N802
        index, parts = self.server, self.path.split("?", 1)[0].strip("/").split("/")
        if parts == ["simple"]:
            self._page("".join(f'<a href="/simple/{p}/">{p}</a>\n' for p in sorted(index.projects)))
        elif len(parts) == 2 and parts[0] == "simple" and canonical(parts[1]) in index.projects:
            self._page("".join(f'<a href="/files/{n}#sha256={index.sha256[n]}">{n}</a>\n'
                               for n in index.projects[canonical(parts[1])]))
        elif len(parts) == 2 and parts[0] == "files" and parts[1] in index.files:
            path = index.files[parts[1]]
            self.send_response(200)
            self.send_header("Content-Type", "application/octet-stream")
            self.send_header("Content-Length", str(path.stat().st_size))
            self.end_headers()
            with path.open("rb") as f:
                shutil.copyfileobj(f, self.wfile)
        else:
            self.send_error(404)
            return
        index.served.append(self.path)

    def _page(self, links: str) -> None:
        body = f"<!DOCTYPE html>\n<html><body>\n{links}</body></html>\n".encode()
        self.send_response(200)
        self.send_header("Content-Type", "text/html")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass
