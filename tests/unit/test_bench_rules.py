"""bench/ under the product's rules, read from its source (ast; nothing is imported): no file over 400 lines,
no function over 60, no private name of eyrie or a service imported, the product's modules imported at the top
of a module (or in a function for a reason, listed); and neither bench/ nor tests/ edits
sys.path (tests get bench/ and tests.support from pyproject's pytest `pythonpath`, a bench script has bench/
on its path as it runs and tests.support through the editable install)."""

from __future__ import annotations

import ast
from pathlib import Path

from tests.support.harness import ROOT, rel

MAX_LINES = 400
MAX_FUNCTION_LINES = 60
PRODUCT = ("eyrie", "eyrie_generator", "eyrie_extractor", "eyrie_trainer", "eyrie_inference")
# Modules of bench/ that import the product inside a function, each with its reason.
IMPORTS_IN_FUNCTIONS = {
    "bench/generate_clients.py": "the check and the profile import eyrie once main has set HF_HUB_OFFLINE "
                                 "(huggingface_hub reads it as it is imported)",
    "bench/gpu_checks.py": "--dry-run runs anywhere: torch and the GPU lease only in the process that holds it",
    "bench/real_model.py": "eyrie imported once main has set HF_HUB_OFFLINE and the home's EYRIE_* variables",
    "bench/train_step_profile.py": "the parent only builds and times; each child imports the trainer (torch, "
                                   "speculators) in the environment the parent gave it",
    "bench/train_throughput.py": "the trainer (torch, speculators) imported once main has set HF_HUB_OFFLINE and "
                                 "the run's EYRIE_* variables; a child imports it in its own",
}


def sources(*folders: str) -> list[Path]:
    return sorted(p for d in folders for p in (ROOT / d).rglob("*.py"))


def sys_path_edits(source: str) -> list[int]:
    """Lines that reach sys.path (insert, append, a slice assigned, +=): a read is an edit waiting to happen."""
    return sorted(node.lineno for node in ast.walk(ast.parse(source)) if isinstance(node, ast.Attribute)
                  and node.attr == "path" and isinstance(node.value, ast.Name) and node.value.id == "sys")


def long_functions(source: str) -> list[tuple[str, int]]:
    return [(node.name, node.end_lineno - node.lineno + 1) for node in ast.walk(ast.parse(source))
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
            and node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES]


def private_imports(source: str) -> list[str]:
    return [f"{node.module}.{alias.name}" for node in ast.walk(ast.parse(source))
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module
            and node.module.split(".")[0] in PRODUCT for alias in node.names
            if alias.name.startswith("_")]


def product_imports_in_functions(source: str) -> set[str]:
    found = set()
    for func in ast.walk(ast.parse(source)):
        if isinstance(func, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for node in ast.walk(func):
                if isinstance(node, ast.Import):
                    found.update(alias.name for alias in node.names)
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    found.add(node.module)
    return {m for m in found if m.split(".")[0] in PRODUCT}


def test_the_checks_see_what_they_look_for():
    assert sys_path_edits("import sys\nsys.path.insert(0, 'x')\nsys.path[:0] = ['y']\n") == [2, 3]
    assert long_functions("def f():\n" + "    x = 1\n" * 60) == [("f", 61)]
    assert product_imports_in_functions("def f():\n    import eyrie.core\n    from os import path\n") == {"eyrie.core"}
    assert private_imports("from eyrie_trainer.export import _x, y\nfrom other import _z\n") == \
        ["eyrie_trainer.export._x"]


def test_no_sys_path_edit_in_bench_or_tests():
    edits = {rel(p): lines for p in sources("bench", "tests") if (lines := sys_path_edits(p.read_text()))}
    assert not edits, f"sys.path edited (pyproject's pytest pythonpath and tests.support instead): {edits}"


def test_no_bench_file_is_over_400_lines():
    long = {rel(p): n for p in (ROOT / "bench").rglob("*") if p.is_file() and p.suffix in (".py", ".sh")
            and (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, f"over {MAX_LINES} lines: {long}"


def test_no_bench_function_is_over_60_lines():
    long = {rel(p): found for p in sources("bench") if (found := long_functions(p.read_text()))}
    assert not long, f"over {MAX_FUNCTION_LINES} lines: {long}"


def test_bench_imports_no_private_name_of_the_product():
    found = {rel(p): names for p in sources("bench") if (names := private_imports(p.read_text()))}
    assert not found, f"make them public where they are defined: {found}"


def test_bench_imports_the_product_at_the_top_of_its_modules():
    found = {rel(p) for p in sources("bench") if product_imports_in_functions(p.read_text())}
    assert found == set(IMPORTS_IN_FUNCTIONS), \
        f"new (import them at the top): {sorted(found - set(IMPORTS_IN_FUNCTIONS))}; " \
        f"gone (drop them from IMPORTS_IN_FUNCTIONS): {sorted(set(IMPORTS_IN_FUNCTIONS) - found)}"
