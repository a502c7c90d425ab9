"""No absolute path of a user's machine or work tree in anything the repository ships (issue 49 item 5): every
file git tracks (read from its index), text files only, and the JSON members of the answers
archives under bench/answers/. A path a user elsewhere cannot open says nothing to them and names the making host.

The rule: a path is a machine path where it starts (after no path character: `eyrie/work/` is relative) with
- `/work/<name>`: this host's workspace, where checkouts and their shared folders stand side by side;
- `/root/`, `/home/<name>/`, `/Users/<name>/`: a user's home; `/home/eyrie/` is not one, it is the home of the
  images' own user (services/base/Dockerfile: `useradd --home-dir /home/eyrie eyrie`), a container path;
- `/tmp/pytest-` (pytest's temporary folders), `/tmp/tmpXXXXXXXX` (tempfile's);
- the checkout's own absolute path, read here (a clone at any other path is caught too), unless the checkout
  stands at a container path the repository names itself (`/opt/eyrie`, the images' working directory).
Container paths (/opt/eyrie, /opt/venv, /data, /models, /home/eyrie) and paths relative to the checkout pass."""

from __future__ import annotations

import re
import tarfile
from pathlib import Path

import pytest

from tests.support.harness import ROOT

CONTAINER_ROOTS = ("/opt/eyrie", "/home/eyrie")  # a checkout there is an image's copy: its paths are the images'
MACHINE = r"/work/[\w.-]+|/root/|/home/(?!eyrie/)[\w.-]+/|/Users/[\w.-]+/|/tmp/pytest-|/tmp/tmp[a-z0-9_]{8}\b"
START = r"(?<![\w.~-])"  # not inside a relative path (eyrie/work/..., x/root/...)
REST = re.compile(r"[^\s\"'`<>,;)]{0,80}")  # the rest of a path found, to show it whole
# Where such a string is the point, each with its reason; any other match fails.
ALLOWED = {
    "tests/unit/test_no_machine_paths.py": (re.compile(r".*"), "this test names the paths it looks for"),
    "assets/prompts/": (re.compile(r"/home/user/|/Users/johndoe/"),
                        "third-party prompt datasets: their tasks name example directories of a made-up user"),
}
FIX = ("write a path relative to the checkout (assets/smollm2-135m-instruct), the hub id where the text means the "
       "model (HuggingFaceTB/SmolLM2-135M-Instruct), or a placeholder (<target>, <drafter-dir>, $EYRIE_HOME)")


def machine_path(root: Path = ROOT) -> re.Pattern:
    """The rule above, for a checkout at `root`."""
    own = {p.as_posix() for p in (root, root.resolve())}
    own = {p for p in own if p != "/" and not p.startswith(CONTAINER_ROOTS)}
    checkout = [re.escape(p) + r"(?![\w.-])" for p in sorted(own, key=len, reverse=True)]
    return re.compile(START + "(" + "|".join([*checkout, MACHINE]) + ")")


PATTERN = machine_path()


def findings(name: str, text: str, pattern: re.Pattern = PATTERN) -> list[str]:
    """`name:line: path` for each machine path in `text` that the allow-list does not let through."""
    allowed = next((ok for prefix, (ok, _) in ALLOWED.items() if name.startswith(prefix)), None)
    return [f"{name}:{text.count(chr(10), 0, m.start()) + 1}: {m.group(0)}{REST.match(text, m.end()).group(0)}"
            for m in pattern.finditer(text) if not (allowed and allowed.match(m.group(0)))]


def shipped_files() -> list[str]:
    """The files git tracks that are here, from its index (read here: a unit test starts no process)."""
    git = ROOT / ".git"
    if git.is_file():  # a worktree: `gitdir: PATH`
        git = (ROOT / git.read_text().split(":", 1)[1].strip()).resolve()
    # CI and `make test` run in a clone: without its index nothing says which files ship, and the scan would pass
    assert (git / "index").is_file(), "not a git checkout: run the tests in a clone of the repository"
    return [n for n in dict.fromkeys(index_paths((git / "index").read_bytes())) if (ROOT / n).is_file()]


def index_paths(data: bytes) -> list[str]:
    """The paths of a git index (versions 2 to 4, git's index-format.txt): after each entry's 62 bytes of stat,
    sha and flags (and 2 more where the extended flag is set), its path, NUL-ended; v4 prefix-compresses it."""
    assert data[:4] == b"DIRC", "not a git index"
    version, count = int.from_bytes(data[4:8], "big"), int.from_bytes(data[8:12], "big")
    paths, at, previous = [], 12, b""
    for _ in range(count):
        start, flags = at, int.from_bytes(data[at + 60:at + 62], "big")
        at += 62 + (2 if version >= 3 and flags & 0x4000 else 0)
        if version == 4:
            strip, at = _varint(data, at)
            end = data.index(b"\0", at)
            previous = previous[:len(previous) - strip] + data[at:end]
            at = end + 1
        else:
            end = data.index(b"\0", at)
            previous = data[at:end]
            at = start + (end - start + 8) // 8 * 8  # NUL-padded to a multiple of 8
        paths.append(previous.decode("utf-8", errors="replace"))
    return paths


def _varint(data: bytes, at: int) -> tuple[int, int]:
    """git's offset varint (index v4's strip length)."""
    value = data[at] & 0x7F
    while data[at] & 0x80:
        at += 1
        value = ((value + 1) << 7) | (data[at] & 0x7F)
    return value, at + 1


def text_of(data: bytes) -> str | None:
    """A file's text, or None for a binary (a NUL in its first 8 KiB, as git decides)."""
    return None if b"\0" in data[:8192] else data.decode("utf-8", errors="replace")


def report(found: list[str], where: str) -> str:
    shown = "\n  ".join(found[:40]) + (f"\n  ... and {len(found) - 40} more" if len(found) > 40 else "")
    return f"machine paths in {where}:\n  {shown}\nFix: {FIX}. Allow-list (ALLOWED) only where the path is the point."


def test_no_shipped_file_names_a_machine_path():
    found = []
    for name in shipped_files():
        text = text_of((ROOT / name).read_bytes())
        if text is not None:
            found += findings(name, text)
    assert not found, report(found, "files the repository ships")


def test_no_answers_archive_member_names_a_machine_path():
    found = []
    for archive in sorted((ROOT / "bench" / "answers").glob("*.tar.xz")):
        with tarfile.open(archive, "r:xz") as tar:
            for member in tar:
                if member.isfile() and member.name.endswith(".json"):
                    text = tar.extractfile(member).read().decode("utf-8", errors="replace")
                    found += findings(f"{archive.relative_to(ROOT)}!{member.name}", text)
    assert not found, report(found, "the answers archives' JSON members (rewrite the archive)")


@pytest.mark.parametrize("text", ["/work/main/assets/x", '"file:///work/eyrie-home/store"', "/root/.cache/eyrie",
                                  "cd /home/alice/src", "/Users/bob/x", "/tmp/pytest-of-root/pytest-3/t0",
                                  "/tmp/tmpab_12cd9/x", "/srv/clone/eyrie/assets/x", "/srv/clone/eyrie"])
def test_the_rule_sees_machine_paths(text):
    assert machine_path(Path("/srv/clone/eyrie")).search(text), text


@pytest.mark.parametrize("text", ["eyrie/work/gpu.py", "/home/eyrie/.cache/huggingface", "/opt/eyrie/assets",
                                  "/opt/venv/bin", "./trainer-cache:/home/eyrie/.cache/eyrie", "a/root/b",
                                  "/srv/clone/eyrie2", "/tmp/b.yaml", "$EYRIE_HOME/results", "/data/store"])
def test_the_rule_lets_container_and_relative_paths_pass(text):
    assert not machine_path(Path("/srv/clone/eyrie")).search(text), text


def test_a_checkout_at_a_container_path_is_not_its_own_machine_path():
    assert not machine_path(Path("/opt/eyrie")).search("WORKDIR /opt/eyrie")


def test_the_allow_list_lets_through_only_what_it_names():
    assert findings("assets/prompts/x.jsonl", "ls /home/user/docs") == []
    assert findings("assets/prompts/x.jsonl", "ls\n/root/docs") == ["assets/prompts/x.jsonl:2: /root/docs"]
