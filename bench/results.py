"""bench/RESULTS.md: each benchmark replaces its own section in place, leaving the others."""

from __future__ import annotations

from pathlib import Path


def write_section(path: Path, lines: list[str]) -> None:
    """`lines[0]` is the section's `# ` heading; it runs to the next top-level heading."""
    text, marker = path.read_text() if path.exists() else "", "\n" + lines[0] + "\n"
    if marker not in text:
        path.write_text(text.rstrip("\n") + "\n\n" + "\n".join(lines) + "\n")
        return
    start, end = text.index(marker), text.find("\n# ", text.index(marker) + 1)
    path.write_text(text[:start] + "\n" + "\n".join(lines) + "\n" + (text[end:] if end != -1 else ""))
