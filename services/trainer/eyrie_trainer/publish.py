"""`eyrie publish`: a run's exported drafter shared with its model card (eyrie_trainer.card), written into a
directory (`--to DIR`, for offline or air-gapped hosts) and/or committed to a model repository on a Hugging Face
hub (`--repo OWNER/NAME`: huggingface_hub's own token and endpoint settings, HF_TOKEN and HF_ENDPOINT; private
unless asked otherwise; one commit per publish, its message naming the run). Both get the same files. With
`--with-answers`, the run's generated answers too, as a dataset (eyrie_trainer.answers): DIR/answers, and the
dataset repository of the same name.

Refused, each refusal by its name (ALLOWS; `--allow NAME` overrides that one alone, and the card names each
override): a drafter that vLLM did not verify or whose verify was skipped (`unverified`), that measured another
checkpoint (`other-checkpoint`), saw answers change beyond the target's own batch variance (`outputs-differ`) or
counted no drafts (`no-drafts`). A target whose license this host cannot read, unless the publisher states it
(`--license SPDX`, which the card says); one whose license forbids redistributing derivatives (no option overrides
that); any file that holds a token or a URL with credentials. Publishing again is a no-op where nothing changed (content hashes against what the
directory or the repository holds), and new figures change the card alone."""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path

from eyrie.core.errors import EyrieError
from eyrie.data.answers_set import ANSWERS
from eyrie.data.manifest import RunManifest, load_run_manifest
from eyrie.data.verify_outputs import BEYOND, VERDICTS
from eyrie_trainer.answers import write_answers
from eyrie_trainer.card import ND_ID, UNKNOWN, License, model_card, redact, target_license
from eyrie_trainer.export import download

CARD = "README.md"
# a URL that carries a user or password, and the shape of a Hugging Face token
CREDENTIALS = re.compile(rb"[a-z][a-z0-9+.-]*://[^/\s@\"'`<>]+@|hf_[A-Za-z0-9]{30,}", re.I)
SECRET_NAME = re.compile(r"TOKEN|SECRET|PASSWORD|PASSWD|API_KEY|ACCESS_KEY|PRIVATE_KEY", re.I)


# the refusals `--allow NAME` overrides, one by one, by the names a user passes
ALLOWS = {"unverified": "vLLM did not verify the drafter, or its verify was skipped",
          "other-checkpoint": "vLLM verified another checkpoint than the exported one",
          "outputs-differ": "served with the drafter, vLLM's answers changed beyond the target's own batch variance",
          "no-drafts": "vLLM counted no drafts"}


def publish(store, run: str, repo: str | None = None, to: Path | None = None, allow: tuple[str, ...] = (),
            public: bool = False, with_answers: bool = False, license: str | None = None) -> dict:
    """The run's drafter and card (`with_answers`: and its answers, a dataset) into `to` and/or the hub repository
    `repo` (the answers: the dataset repository of that name): what each of them got."""
    if repo is None and to is None:
        raise EyrieError("nowhere to publish to.", "pass --repo OWNER/NAME, --to DIR, or both.")
    manifest = load_run_manifest(store, run)
    overridden, license = refuse_unshareable(manifest, allow, license)
    result = {"run": run}
    with tempfile.TemporaryDirectory(prefix="eyrie-publish-") as tmp:
        folder, held = Path(tmp), secrets()
        download(store, run, folder)
        if with_answers:
            write_answers(store, manifest, folder / ANSWERS, lambda name, data: refuse_secret(name, data, held))
        answers_id = repo if with_answers and repo else None
        card = model_card(store, manifest, repo or str(to.resolve()), overridden, license, answers_id)
        (folder / CARD).write_bytes(card.content.encode())
        for name in files(folder):
            for chunk in overlapping_chunks(folder / name):
                refuse_secret(name, chunk, held)
        if to is not None:
            result["to"] = {"path": str(to), "changed": write_to(folder, to)}
        if repo is not None:
            message = f"eyrie publish: run {run}, checkpoint {manifest.drafter['checkpoint']}"
            result["repo"] = upload(folder, [n for n in files(folder) if not n.startswith(f"{ANSWERS}/")], repo,
                                    "model", message, public)
            if with_answers:
                result["answers"] = upload(folder / ANSWERS, files(folder / ANSWERS), repo, "dataset",
                                           f"eyrie publish: run {run}'s answers", public)
    return result


def refuse_unshareable(manifest: RunManifest, allow=(), stated: str | None = None):
    """The refusals `allow` overrode ("--allow NAME: why" each), and the target's license; refused: what should not
    be shared, and a license not known here that the publisher did not state."""
    unknown = sorted(set(allow) - set(ALLOWS))
    if unknown:
        raise EyrieError(f"no refusal named {', '.join(unknown)} to allow.", f"name one of: {', '.join(ALLOWS)}.")
    run, found = manifest.run, refusals(manifest)
    refused = [(name, why) for name, why in found if name not in allow]
    if refused:
        flags = " ".join(f"--allow {name}" for name in dict(refused))
        raise EyrieError(f"run {run}'s drafter is not published: {'; '.join(why for _, why in refused)}.",
                         f"verify it (`eyrie verify --run {run}`, or `eyrie retry {run}`), or pass {flags} to "
                         "publish it anyway: its card then names each refusal it overrode.")
    overridden = [f"--allow {name}: {why}" for name, why in found if name in allow]
    license = stated_license(manifest, stated)
    if license.no_derivatives:
        raise EyrieError(f"run {run}'s target {manifest.target.model} forbids redistributing derivatives: "
                         f"{license.no_derivatives} (read from {license.where}). Nothing was published.",
                         "a drafter trained on its outputs and hidden states is one; share it only with the "
                         "licensor's permission, by hand (`eyrie export`). No option of eyrie overrides a license.")
    return overridden, license


def files(folder: Path) -> list[str]:
    """Every file under `folder`, as a path relative to it."""
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file())


def stated_license(manifest: RunManifest, stated: str | None) -> License:
    """The target's license as its card states it, else as the publisher states it (`--license`); refused where
    neither says it, or where the two differ."""
    read = target_license(manifest.target)
    if read.id == UNKNOWN and stated is None:
        raise EyrieError(f"run {manifest.run}'s target license is not known here ({read.where}). Nothing was "
                         "published.", "state it as the target's own card does: --license SPDX (e.g. "
                         "--license apache-2.0); the card then says the publisher stated it.")
    if read.id == UNKNOWN:
        forbidding = f"its license is {stated} (no derivatives)" if ND_ID.search(stated) else None
        return License(stated, "stated by the publisher (`eyrie publish --license`)", no_derivatives=forbidding)
    if stated is not None and stated.lower() not in read.id.lower().split(", "):
        raise EyrieError(f"--license {stated} is not the target's license: {read.id} ({read.where}).",
                         f"drop --license (the card states {read.id}), or publish a target whose license it is.")
    return read


def refusals(manifest: RunManifest) -> list[tuple[str, str]]:
    """Why the run's drafter should not be shared, each by its name in ALLOWS (`--allow NAME` overrides it);
    none: it may be."""
    drafter, verify = manifest.drafter, manifest.verify
    if not drafter:
        raise EyrieError(f"run {manifest.run} has no exported drafter.",
                         f"train it first: `eyrie train --run {manifest.run} --wait` exports the best checkpoint.")
    if not verify:
        return [("unverified", "vLLM has not verified its drafter (its verify has not run, or its task failed)")]
    if verify.get("skipped"):
        return [("unverified", f"its verify was skipped: {verify['skipped']}")]
    found = []
    if verify.get("checkpoint") != drafter["checkpoint"]:
        found.append(("other-checkpoint", f"vLLM verified checkpoint {verify.get('checkpoint')}, and checkpoint "
                                          f"{drafter['checkpoint']} is exported now"))
    verdict = verify.get("outputs_verdict")
    if verdict in VERDICTS and VERDICTS.index(verdict) >= VERDICTS.index(BEYOND):  # BEYOND, and what is worse
        found.append(("outputs-differ", f"served with it, vLLM's answers were judged: {verdict}"))
    if verify.get("vllm_acceptance_length") is None:
        found.append(("no-drafts", "vLLM counted no drafts on the held-out prompts"))
    return found


def secrets() -> list[bytes]:
    """What no published file may hold: the token huggingface_hub sends, and every environment variable whose name
    says it is a secret (8 characters or more: shorter values are no secret worth the name, and match anywhere)."""
    from huggingface_hub import get_token

    values = {get_token()} | {value for name, value in os.environ.items() if SECRET_NAME.search(name)}
    return [v.encode() for v in values if v and len(v) >= 8]


def refuse_secret(name: str, data: bytes, held: list[bytes]) -> None:
    if any(secret in data for secret in held) or CREDENTIALS.search(data):
        raise EyrieError(f"{name} would publish a token, a secret of this environment or a URL with "
                         "credentials. Nothing was published.",
                         "find where the run holds it (its dataset source, target, recipe, its prompts and answers) "
                         "and restate it without the secret; report it if eyrie wrote it there.")


def overlapping_chunks(path: Path, size: int = 1 << 24, overlap: int = 4096):
    """A file's bytes in pieces that overlap (a secret across a boundary is whole in one), not all in memory: the
    weights of a large target's drafter are gigabytes."""
    with path.open("rb") as f:
        tail = b""
        while chunk := f.read(size):
            yield tail + chunk
            tail = chunk[-overlap:]


def write_to(folder: Path, to: Path) -> list[str]:
    """The published files into `to` (new, or holding only files eyrie publishes); the names that changed."""
    names = files(folder)
    if to.exists():
        if not to.is_dir():
            raise EyrieError(f"--to {to} is a file.", "pass a directory (a new one is made).")
        others = [n for n in files(to) if n not in names and not n.startswith(f"{ANSWERS}/")]  # answers: eyrie's
        if others:
            raise EyrieError(f"--to {to} holds files eyrie does not publish: {', '.join(others)}.",
                             "pass a new or empty directory, or one an earlier `eyrie publish --to` wrote.")
    changed = [n for n in names if not (to / n).is_file() or sha256(to / n) != sha256(folder / n)]
    for name in changed:
        (to / name).parent.mkdir(parents=True, exist_ok=True)
        part = (to / name).with_name(f".{Path(name).name}.part")
        shutil.copyfile(folder / name, part)
        part.replace(to / name)
    return changed


def upload(folder: Path, names: list[str], repo: str, repo_type: str, message: str, public: bool) -> dict:
    """The files the repository does not hold already (by content), in one commit; none: no commit."""
    from huggingface_hub import CommitOperationAdd, HfApi, get_token
    from huggingface_hub.constants import is_offline_mode
    from huggingface_hub.hf_api import RepoFile

    if is_offline_mode():
        raise EyrieError("HF_HUB_OFFLINE is set: eyrie does not reach the hub.",
                         "unset it to publish to the hub, or publish with --to DIR and carry the directory over.")
    if get_token() is None:
        raise EyrieError("no Hugging Face token to publish with.",
                         "set HF_TOKEN to a token with write access (or log in once with `hf auth login`).")
    api = HfApi()
    with hub_errors(api.endpoint, repo):
        api.create_repo(repo, repo_type=repo_type, private=not public, exist_ok=True)
        held = {f.path: f for f in api.list_repo_tree(repo, repo_type=repo_type, recursive=True)
                if isinstance(f, RepoFile)}
        changed = [name for name in names if not same_content(held.get(name), folder / name)]
        if not changed:
            return {"repo": repo, "commit": None, "changed": []}
        info = api.create_commit(repo, [CommitOperationAdd(name, folder / name) for name in changed],
                                 repo_type=repo_type, commit_message=f"{message} ({', '.join(changed)})")
    return {"repo": repo, "commit": info.oid, "url": info.commit_url, "changed": changed}


@contextmanager
def hub_errors(endpoint: str, repo: str):
    """The hub's refusals and an unreachable hub as errors naming the problem and the fix."""
    import httpx
    from huggingface_hub.errors import HfHubHTTPError

    endpoint = redact(endpoint)
    try:
        yield
    except HfHubHTTPError as exc:
        status = exc.response.status_code if exc.response is not None else None
        fix = {401: "set HF_TOKEN to a valid token with write access",
               403: f"use a token with write access to {repo}'s owner, or a repo of your own"}.get(
            status, "check the repo id and the hub's answer, then publish again")
        raise EyrieError(f"the hub at {endpoint} refused publishing to {repo} ({status}: "
                         f"{exc.server_message or type(exc).__name__}).", fix) from None
    except ValueError as exc:  # huggingface_hub's own words for the hub's check of the card's metadata
        if "Invalid metadata in README.md" not in str(exc):
            raise
        raise EyrieError(f"the hub at {endpoint} refused the card's metadata: {exc}", "report it: eyrie wrote "
                         "that card; `eyrie publish --to DIR` writes it for a look meanwhile.") from None
    except httpx.TransportError as exc:
        raise EyrieError(f"the hub at {endpoint} is not reachable ({type(exc).__name__}).",
                         "check the network and HF_ENDPOINT, then publish again (nothing was committed).") from None


def same_content(remote, path: Path) -> bool:
    """Whether a file the hub lists holds `path`'s bytes: an LFS file by its sha256, another by its git blob id."""
    if remote is None:
        return False
    if remote.lfs is not None:
        return remote.lfs.sha256 == sha256(path)
    return remote.blob_id == git_blob_id(path)


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def git_blob_id(path: Path) -> str:
    """git's object id of the file's bytes (sha1 of 'blob SIZE\\0' + bytes), as the hub lists it."""
    digest = hashlib.sha1(f"blob {path.stat().st_size}\0".encode())
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()
