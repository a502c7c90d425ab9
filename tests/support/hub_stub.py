"""A stand-in for huggingface.co, which is not reachable from here: its model and dataset repositories' HTTP API as far as
huggingface_hub (1.x) uses it to create a repository, list its files, commit to it and download from it (repo
info, tree, the check of a card's metadata, preupload, commit, resolve). A new repository holds the hub's own first commit (.gitattributes).
Every file is committed as a regular git blob (base64 in the commit): the real hub takes weights through LFS or
Xet instead, which huggingface_hub handles by itself (eyrie's code is the same either way). Every request must
carry the token it was started with (a write always, a read of a private repository too), as the hub asks; every
commit received is kept, for a test to read.

    with running("hf_token...") as (url, hub): ...  # HF_ENDPOINT=url
"""

from __future__ import annotations

import base64
import hashlib
import json
import re
import socket
import threading
import time
from contextlib import contextmanager

import uvicorn
import yaml
from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse

GITATTRIBUTES = b"*.safetensors filter=lfs diff=lfs merge=lfs -text\n"


def metadata_errors(readme: str) -> list[str]:
    """What the hub's check of a card's metadata (huggingface_hub asks it before a commit that holds a README.md)
    would say, as far as the hub's docs state it: a YAML mapping; `license`, `base_model`, `datasets`, `tags` strings
    or lists of strings; each model-index result with task.type, dataset.type and .name, metrics with type and value."""
    found = re.match(r"^---\n(.*?)\n---\n", readme, re.S)
    data = yaml.safe_load(found[1]) if found else None
    if not isinstance(data, dict):
        return ["no metadata block"]
    errors = [f"{key} must be a string or a list of strings" for key in ("license", "base_model", "datasets", "tags")
              if key in data and not (isinstance(data[key], str)
                                      or isinstance(data[key], list) and all(isinstance(v, str) for v in data[key]))]
    for model in data.get("model-index") or []:
        for result in model.get("results") or []:
            task, dataset = result.get("task") or {}, result.get("dataset") or {}
            if not task.get("type") or not dataset.get("type") or not dataset.get("name"):
                errors.append(f"model-index result without task.type, dataset.type or dataset.name: {result}")
            errors += [f"metric without type or value: {m}" for m in result.get("metrics") or []
                       if not m.get("type") or m.get("value") is None]
    return errors


def web_path(repo: tuple[str, str]) -> str:
    """A repository's path on the hub's site: a dataset's under datasets/."""
    return f"datasets/{repo[1]}" if repo[0] == "dataset" else repo[1]


def blob_id(data: bytes) -> str:
    return hashlib.sha1(f"blob {len(data)}\0".encode() + data).hexdigest()


class Hub:
    def __init__(self, token: str):
        self.token, self.url = token, ""
        # (type, id) -> {"private": bool, "commits": [{oid, message, files, changed}]}; type: model | dataset
        self.repos: dict[tuple[str, str], dict] = {}
        self.requests: list[str] = []  # "METHOD path -> status", for a failing test to show

    def commits(self, repo: str, kind: str = "model") -> list[dict]:
        """The commits a repository received after its first (the hub's own), oldest first."""
        return self.repos[kind, repo]["commits"][1:]

    def files(self, repo: str, kind: str = "model", revision: str = "main") -> dict[str, bytes]:
        return self._commit((kind, repo), revision)["files"]

    def _commit(self, repo: tuple[str, str], revision: str) -> dict:
        commits = self.repos[repo]["commits"]
        return commits[-1] if revision == "main" else next(c for c in commits if c["oid"] == revision)

    def _add_commit(self, repo: tuple[str, str], message: str, changed: dict[str, bytes]) -> dict:
        commits = self.repos[repo]["commits"]
        files = {**(commits[-1]["files"] if commits else {}), **changed}
        oid = hashlib.sha1(f"{repo}{len(commits)}{message}".encode()).hexdigest()
        commits.append({"oid": oid, "message": message, "files": files, "changed": changed})
        return commits[-1]

    def app(self) -> FastAPI:
        app = FastAPI()

        @app.middleware("http")
        async def record(request: Request, call_next):
            response = await call_next(request)
            self.requests.append(f"{request.method} {request.url.path} -> {response.status_code}")
            return response

        def refused(request: Request, repo: tuple[str, str] | None = None, write: bool = True) -> Response | None:
            if repo is not None and repo not in self.repos:
                return JSONResponse({"error": "Repository not found"}, 404, headers={"X-Error-Code": "RepoNotFound"})
            if not write and repo is not None and not self.repos[repo]["private"]:
                return None
            if request.headers.get("authorization") != f"Bearer {self.token}":
                return JSONResponse({"error": "Invalid credentials in Authorization header"}, 401)
            return None

        @app.post("/api/validate-yaml")
        async def validate_yaml(request: Request):
            errors = metadata_errors((await request.json())["content"])
            return JSONResponse({"errors": [{"message": e} for e in errors]}, 400) if errors else {"warnings": []}

        @app.post("/api/repos/create")
        async def create(request: Request):
            body = await request.json()
            repo = (body.get("type") or "model", f"{body['organization']}/{body['name']}")
            if denied := refused(request):
                return denied
            url = f"{self.url}/{web_path(repo)}"
            if repo in self.repos:
                return JSONResponse({"error": f"You already created this {repo[0]} repo", "url": url}, 409)
            self.repos[repo] = {"private": body.get("visibility", "public") == "private", "commits": []}
            self._add_commit(repo, "initial commit", {".gitattributes": GITATTRIBUTES})
            return {"url": url, "name": repo[1], "id": repo[1]}

        def of(kind: str, owner: str, name: str) -> tuple[str, str]:
            return kind.removesuffix("s"), f"{owner}/{name}"  # /api/models/..., /api/datasets/...

        @app.get("/api/{kind}/{owner}/{name}")
        @app.get("/api/{kind}/{owner}/{name}/revision/{revision}")
        async def info(kind: str, owner: str, name: str, request: Request, revision: str = "main"):
            repo = of(kind, owner, name)
            if denied := refused(request, repo, write=False):
                return denied
            commit = self._commit(repo, revision)
            return {"id": repo[1], "sha": commit["oid"], "private": self.repos[repo]["private"],
                    "siblings": [{"rfilename": path} for path in sorted(commit["files"])]}

        @app.get("/api/{kind}/{owner}/{name}/tree/{revision}")
        async def tree(kind: str, owner: str, name: str, revision: str, request: Request):
            repo = of(kind, owner, name)
            if denied := refused(request, repo, write=False):
                return denied
            return [{"type": "file", "path": path, "size": len(data), "oid": blob_id(data)}
                    for path, data in sorted(self._commit(repo, revision)["files"].items())]

        @app.post("/api/{kind}/{owner}/{name}/preupload/{revision}")
        async def preupload(kind: str, owner: str, name: str, revision: str, request: Request):
            repo = of(kind, owner, name)
            if denied := refused(request, repo):
                return denied
            held = self._commit(repo, revision)["files"]
            return {"files": [{"path": f["path"], "uploadMode": "regular", "shouldIgnore": False,
                               "oid": blob_id(held[f["path"]]) if f["path"] in held else None}
                              for f in (await request.json())["files"]]}

        @app.post("/api/{kind}/{owner}/{name}/commit/{revision}")
        async def commit(kind: str, owner: str, name: str, revision: str, request: Request):
            repo = of(kind, owner, name)
            if denied := refused(request, repo):
                return denied
            lines = [json.loads(line) for line in (await request.body()).splitlines() if line.strip()]
            header = next(item["value"] for item in lines if item["key"] == "header")
            changed = {item["value"]["path"]: base64.b64decode(item["value"]["content"])
                       for item in lines if item["key"] == "file"}
            made = self._add_commit(repo, header["summary"], changed)
            return {"commitUrl": f"{self.url}/{web_path(repo)}/commit/{made['oid']}", "commitOid": made["oid"],
                    "pullRequestUrl": None}

        @app.api_route("/datasets/{owner}/{name}/resolve/{revision}/{path:path}", methods=["GET", "HEAD"])
        async def resolve_dataset(owner: str, name: str, revision: str, path: str, request: Request):
            return download(("dataset", f"{owner}/{name}"), revision, path, request)

        @app.api_route("/{owner}/{name}/resolve/{revision}/{path:path}", methods=["GET", "HEAD"])
        async def resolve(owner: str, name: str, revision: str, path: str, request: Request):
            return download(("model", f"{owner}/{name}"), revision, path, request)

        def download(repo: tuple[str, str], revision: str, path: str, request: Request) -> Response:
            if denied := refused(request, repo, write=False):
                return denied
            commit = self._commit(repo, revision)
            if path not in commit["files"]:
                return JSONResponse({"error": "Entry not found"}, 404, headers={"X-Error-Code": "EntryNotFound"})
            data = commit["files"][path]
            headers = {"X-Repo-Commit": commit["oid"], "ETag": f'"{blob_id(data)}"', "Content-Length": str(len(data))}
            return Response(b"" if request.method == "HEAD" else data, headers=headers,
                            media_type="application/octet-stream")

        return app


@contextmanager
def running(token: str):
    """The hub stand-in on a free loopback port, in a thread of this process: (its URL, the Hub)."""
    hub = Hub(token)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    hub.url = f"http://127.0.0.1:{port}"
    server = uvicorn.Server(uvicorn.Config(hub.app(), host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "the hub stand-in did not start"
        time.sleep(0.05)
    try:
        yield hub.url, hub
    finally:
        server.should_exit = True
        thread.join(10)
