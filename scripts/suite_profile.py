"""The suite's profile from pytest's JUnit report (`make test` writes .eyrie/pytest.xml): seconds per
tier, per module and for the slowest tests (call, setup and teardown together), as markdown for
docs/testing.md.

  .venv/bin/python scripts/suite_profile.py .eyrie/pytest.xml [--top 30]
A report written before tests carried their tier is given it from a collection of the tree."""

from __future__ import annotations

import argparse
import subprocess
import sys
import xml.etree.ElementTree as ET
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TIERS = ("unit", "integration", "e2e")


def tests_of(report: Path) -> list[dict]:
    rows = []
    for case in ET.parse(report).getroot().iter("testcase"):
        props = {p.get("name"): p.get("value") for p in case.iter("property")}
        outcome = next((child.tag for child in case if child.tag in ("failure", "error", "skipped")), "passed")
        module = case.get("classname", "").rsplit(".", 1)[-1]
        rows.append({"id": f"{module}::{case.get('name')}", "module": module, "seconds": float(case.get("time", 0)),
                     "tier": props.get("tier"), "outcome": outcome})
    return rows


def collected_tiers() -> dict[str, str]:
    """test id -> tier, from `pytest --collect-only -m TIER` of this tree (for reports without tiers)."""
    tiers = {}
    for tier in TIERS:
        out = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-m", tier, "tests"],
                             cwd=ROOT, capture_output=True, text=True).stdout
        for line in out.splitlines():
            if "::" in line:
                path, name = line.split("::", 1)
                tiers[f"{Path(path).stem}::{name}"] = tier
    return tiers


def render(rows: list[dict], top: int) -> list[str]:
    total = sum(r["seconds"] for r in rows)
    lines = [f"{len(rows)} tests, {total / 60:.1f} min of test time (setup, call and teardown)", "",
             "| tier | tests | minutes | share |", "|---|---:|---:|---:|"]
    for tier in (*TIERS, None):
        mine = [r for r in rows if r["tier"] == tier]
        if mine:
            spent = sum(r["seconds"] for r in mine)
            lines.append(f"| {tier or 'unknown'} | {len(mine)} | {spent / 60:.1f} | {spent / total:.0%} |")
    modules = defaultdict(list)
    for r in rows:
        modules[r["module"]].append(r)
    lines += ["", "| module | tests | minutes |", "|---|---:|---:|"]
    for name, mine in sorted(modules.items(), key=lambda kv: -sum(r["seconds"] for r in kv[1]))[:top]:
        lines.append(f"| {name} | {len(mine)} | {sum(r['seconds'] for r in mine) / 60:.1f} |")
    lines += ["", f"| slowest {top} tests | tier | seconds |", "|---|---|---:|"]
    for r in sorted(rows, key=lambda r: -r["seconds"])[:top]:
        lines.append(f"| `{r['id']}`{'' if r['outcome'] == 'passed' else ' (' + r['outcome'] + ')'} | {r['tier']} | "
                     f"{r['seconds']:.0f} |")
    return lines


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("report", type=Path)
    p.add_argument("--top", type=int, default=30)
    args = p.parse_args()
    rows = tests_of(args.report)
    if any(r["tier"] is None for r in rows):
        tiers = collected_tiers()
        for r in rows:
            r["tier"] = r["tier"] or tiers.get(r["id"])
    print("\n".join(render(rows, args.top)))


if __name__ == "__main__":
    main()
