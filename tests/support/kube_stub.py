"""A stand-in for the Kubernetes API server's Job endpoints (no kube-apiserver runs on our machines).

It does what the real one does with the calls eyrie makes: names a Job from its generateName,
rejects a Job that fails the Kubernetes 1.33 schema (strict) with 422, lists by label selector,
deletes. `admit` and `finish` play Kueue and the Job controller."""

from __future__ import annotations

import json
import secrets
import threading
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import kubernetes_validate

PREFIX = "/apis/batch/v1/namespaces/"


class KubeStub:
    def __init__(self):
        self.jobs: dict[str, dict] = {}
        self.lock = threading.Lock()
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.url = f"http://127.0.0.1:{self.server.server_port}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()

    def admit(self, name: str) -> None:
        """What Kueue does once the quota has room: unsuspend."""
        with self.lock:
            self.jobs[name]["spec"]["suspend"] = False

    def finish(self, name: str, ok: bool = True) -> None:
        with self.lock:
            self.jobs[name]["status"] = {"conditions": [{"type": "Complete" if ok else "Failed", "status": "True"}]}

    def _handler(self):
        stub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def _reply(self, code: int, body: dict):
                data = json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def _route(self):
                url = urllib.parse.urlparse(self.path)
                rest = url.path.removeprefix(PREFIX).split("/")  # NS, "jobs"[, NAME]
                if not url.path.startswith(PREFIX) or len(rest) < 2 or rest[1] != "jobs":
                    return None, None, None
                return rest[0], rest[2] if len(rest) > 2 else None, urllib.parse.parse_qs(url.query)

            def do_POST(self):
                namespace, _, _ = self._route()
                job = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                try:
                    kubernetes_validate.validate(job, "1.33.0", strict=True)
                except kubernetes_validate.ValidationError as exc:
                    return self._reply(422, {"kind": "Status", "message": exc.message})
                with stub.lock:
                    name = job["metadata"].pop("generateName", "") + secrets.token_hex(3)[:5]
                    job["metadata"].update(name=name, namespace=namespace)
                    stub.jobs[name] = job
                self._reply(201, job)

            def do_GET(self):
                _, name, query = self._route()
                with stub.lock:
                    if name:
                        return self._reply(200, stub.jobs[name]) if name in stub.jobs else self._reply(404, {})
                    wanted = [s for s in query.get("labelSelector", [""])[0].split(",") if s]
                    items = [j for j in stub.jobs.values() if all(_matches(j, s) for s in wanted)]
                self._reply(200, {"kind": "JobList", "items": items})

            def do_DELETE(self):
                _, name, _ = self._route()
                with stub.lock:
                    job = stub.jobs.pop(name, None)
                self._reply(200 if job else 404, job or {})

        return Handler


def _matches(job: dict, selector: str) -> bool:
    labels = job["metadata"].get("labels", {})
    key, eq, value = selector.partition("=")
    return key in labels and (not eq or labels[key] == value)
