"""Stages are known by name only where they are declared (eyrie/stages/: the pipeline list and its
stage classes) and in their task classes (services/*: each task names its own kind): everything
else loops over eyrie.stages.PIPELINE or asks a stage object. Read from the source (ast)."""

from __future__ import annotations

import ast
from pathlib import Path

from eyrie.stages import PIPELINE, task_kinds
from tests.support.harness import ROOT

NAMES = {s.name for s in PIPELINE} | {s.queue for s in PIPELINE} | set(task_kinds())
# The same words meaning something else, each with its reason.
NOT_A_STAGE = {
    ("eyrie/data/dataset.py", "train"): "a dataset split's name",
    ("eyrie/core/stage_settings.py", "train"): "a dataset split's name",
    ("eyrie/data/manifest.py", "train"): "a dataset split's name",
    ("eyrie/data/charts.py", "train"): "speculators' metrics log: its training record's key",
    ("services/trainer/eyrie_trainer/runner.py", "train"): "speculators' metrics log key; the training split's folder",
    ("services/trainer/eyrie_trainer/engine.py", "train"): "speculators' own subcommand (`speculators train`)",
    ("services/trainer/eyrie_trainer/runner.py", "generate"): "speculators' on_missing value: make states on demand",
    ("services/inference/eyrie_inference/extract_server.py", "extract"): "the extraction server's endpoint name",
    ("eyrie/runs/from_answers.py", "generate"): "a published answers set's provenance key: the run manifest's "
                                                "generate section, as eyrie-answers.json holds it",
    ("services/trainer/eyrie_trainer/answers.py", "generate"): "eyrie-answers.json's key for the manifest's "
                                                               "generate section (the published format)",
    ("services/trainer/eyrie_trainer/answers.py", "train"): "a hub dataset split's name",
}


def string_constants(path: Path) -> set[str]:
    """String literals of a module, its docstrings left out."""
    tree = ast.parse(path.read_text(), filename=str(path))
    docstrings = {id(node.body[0].value) for node in ast.walk(tree)
                  if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
                  and node.body and isinstance(node.body[0], ast.Expr)
                  and isinstance(node.body[0].value, ast.Constant)}
    return {node.value for node in ast.walk(tree) if isinstance(node, ast.Constant)
            and isinstance(node.value, str) and id(node) not in docstrings}


def test_stage_names_are_written_only_where_the_stages_are_declared():
    found = []
    for path in sorted([*(ROOT / "eyrie").rglob("*.py"), *(ROOT / "services").rglob("*.py")]):
        rel = str(path.relative_to(ROOT))
        if rel.startswith("eyrie/stages/"):
            continue
        for name in string_constants(path) & NAMES:
            if (rel, name) not in NOT_A_STAGE:
                found.append(f"{rel}: {name!r}")
    assert not found, f"stage names written outside eyrie/stages/ (loop over PIPELINE instead): {found}"


def test_every_known_other_meaning_is_still_there():
    """The list above stays true: an entry whose word is gone is removed from it."""
    stale = [key for key in NOT_A_STAGE if key[1] not in string_constants(ROOT / key[0])]
    assert not stale, stale
