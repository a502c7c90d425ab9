"""Install eyrie into an image that already has a stack (vLLM's) without moving any of it.

    python3 image_constraints.py REQUIREMENTS OUT_REQUIREMENTS OUT_CONSTRAINTS

Every distribution installed in the image becomes a constraint (name==version); our requirement
lines for those lose their own pins (the image's version wins; nothing of vLLM's is replaced),
the others keep them. Nested `-r` files are followed."""

from __future__ import annotations

import re
import sys
from importlib.metadata import distributions
from pathlib import Path

NAME = re.compile(r"^\s*([A-Za-z0-9][A-Za-z0-9._-]*)(\[[^\]]*\])?")


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def requirement_lines(path: Path) -> list[str]:
    lines = []
    for raw in path.read_text().splitlines():
        line = raw.split("#", 1)[0].strip()
        if line.startswith("-r "):
            lines += requirement_lines((path.parent / line[3:].strip()).resolve())
        elif line:
            lines.append(line)
    return lines


def installed() -> dict[str, str]:
    return {canonical(d.metadata["Name"]): d.version for d in distributions() if d.metadata["Name"]}


def split(lines: list[str], present: dict[str, str]) -> list[str]:
    """Our lines, unpinned where the image already has the package."""
    out = []
    for line in lines:
        match = NAME.match(line)
        if match and canonical(match[1]) in present:
            out.append(match[1] + (match[2] or ""))
        else:
            out.append(line)
    return out


def main(requirements: str, out_requirements: str, out_constraints: str) -> None:
    present = installed()
    Path(out_requirements).write_text("\n".join(split(requirement_lines(Path(requirements)), present)) + "\n")
    Path(out_constraints).write_text("\n".join(f"{n}=={v}" for n, v in sorted(present.items())) + "\n")


if __name__ == "__main__":
    main(*sys.argv[1:4])
