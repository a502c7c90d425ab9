"""The shape of the code, read from its source (ast; nothing is imported): the shared package
depends on no service, a service on no other service, project imports stand at the top of their
module, no source file is over 400 lines, and every function eyrie/ names as text (the stage
registry, the CLI's `entry` calls) exists."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from eyrie.stages import CALLBACKS, STAGES

ROOT = Path(__file__).resolve().parent.parent
SERVICES = {"eyrie_generator": "generator", "eyrie_extractor": "extractor", "eyrie_trainer": "trainer",
            "eyrie_inference": "inference"}
MAX_LINES = 400
# Edges not cut yet, each with its reason. The inference image serves the vLLM extraction server,
# whose command line and CPU connector are the extractor's (vllm_backend, vllm_cpu_connector; the
# Helm chart runs `python3 -m eyrie_extractor.vllm_backend` in that image): moving them changes the
# chart and its goldens.
KNOWN_SERVICE_EDGES = {("services/inference/eyrie_inference/extract_server.py", "eyrie_extractor")}
# The CLI's command bodies import what they use, so that `eyrie --help` and its errors stay fast.
LAZY_BY_DESIGN = {"eyrie/cli.py", "eyrie/cli_control.py"}
# Project imports kept inside a function, each with its reason.
KNOWN_IMPORTS_IN_FUNCTIONS = {
    # gpu_admission imports eyrie.queue at its top (it drains the queues); every enqueue calls its dispatch
    ("eyrie/queue.py", "eyrie.gpu_admission"),
}


def modules(under: str) -> list[Path]:
    return sorted((ROOT / under).rglob("*.py"))


def imported_packages(path: Path) -> set[str]:
    """Top-level packages a module imports, wherever the import stands (in functions too)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module.split(".")[0])
    return found


def rel(path: Path) -> str:
    return str(path.relative_to(ROOT))


def project_imports_in_functions(path: Path) -> set[str]:
    """The project modules (eyrie.*, eyrie_*; relative imports too) a module imports inside a function."""
    found = set()
    for func in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if not isinstance(func, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        for node in ast.walk(func):
            if isinstance(node, ast.Import):
                found.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                found.add("." * node.level + (node.module or ""))
    return {m for m in found if m.startswith(".") or m.split(".")[0] in ("eyrie", *SERVICES)}


def test_the_shared_package_imports_no_service():
    edges = sorted((rel(p), pkg) for p in modules("eyrie") for pkg in imported_packages(p) & SERVICES.keys())
    assert not edges, f"eyrie/ must reach a service only by name (eyrie.stages.entry): {edges}"


def test_no_service_imports_another():
    edges = set()
    for package, service in SERVICES.items():
        for path in modules(f"services/{service}"):
            edges |= {(rel(path), other) for other in imported_packages(path) & SERVICES.keys() if other != package}
    assert edges == KNOWN_SERVICE_EDGES, f"new: {sorted(edges - KNOWN_SERVICE_EDGES)}; " \
                                         f"cut (drop them from KNOWN_SERVICE_EDGES): {sorted(KNOWN_SERVICE_EDGES - edges)}"


def test_project_imports_stand_at_the_top_of_their_module():
    """A reader sees a module's dependencies in its first lines; an import cycle is cut by moving
    a function where it belongs, not hidden in a function."""
    found = {(rel(p), module) for d in ("eyrie", "services") for p in modules(d) if rel(p) not in LAZY_BY_DESIGN
             for module in project_imports_in_functions(p)}
    assert found == KNOWN_IMPORTS_IN_FUNCTIONS, \
        f"new (import them at the top): {sorted(found - KNOWN_IMPORTS_IN_FUNCTIONS)}; " \
        f"gone (drop them from KNOWN_IMPORTS_IN_FUNCTIONS): {sorted(KNOWN_IMPORTS_IN_FUNCTIONS - found)}"


def test_no_source_file_is_over_400_lines():
    sources = [p for d in ("eyrie", "services") for p in (ROOT / d).rglob("*")
               if p.is_file() and (p.suffix in (".py", ".sh") or p.name.endswith("Dockerfile"))]
    long = {rel(p): n for p in sources if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert sources and not long, f"over {MAX_LINES} lines: {long}"


def _defined(dotted: str) -> bool:
    module, _, name = dotted.rpartition(".")
    top, _, rest = module.partition(".")
    base = ROOT / "eyrie" if top == "eyrie" else ROOT / "services" / SERVICES[top] / top
    path = base.joinpath(*rest.split(".")).with_suffix(".py") if rest else base / "__init__.py"
    tree = ast.parse(path.read_text())
    return any(isinstance(n, (ast.FunctionDef, ast.ClassDef)) and n.name == name for n in tree.body)


def named_entries() -> set[str]:
    """The dotted names eyrie/ passes to eyrie.stages.entry as text."""
    return {node.args[0].value for p in modules("eyrie") for node in ast.walk(ast.parse(p.read_text()))
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "entry"
            and node.args and isinstance(node.args[0], ast.Constant)}


@pytest.mark.parametrize("dotted", sorted({s.func for s in STAGES.values()} | {s.start for s in STAGES.values()
                                                                               if s.start} | CALLBACKS
                                          | named_entries()))
def test_every_name_eyrie_uses_for_a_service_function_is_defined(dotted):
    assert _defined(dotted), f"{dotted} is named in eyrie/ but not defined"
