"""The shape of the code, read from its source (ast; nothing is imported): the shared package depends
on no service, a service on no other service, project imports stand at the top of their module, the
imports of eyrie/ form no circle and go only down through its rooms, no module but
eyrie/core/config.py reads an EYRIE_* variable, no source file is over 400 lines, and every function
eyrie/ names as text (the stage registry, the CLI's `entry` calls) exists."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from eyrie.stages import CALLBACKS, PIPELINE, task_kinds
from tests.support.harness import ROOT, rel

SERVICES = {"eyrie_generator": "generator", "eyrie_extractor": "extractor", "eyrie_trainer": "trainer",
            "eyrie_inference": "inference"}
MAX_LINES = 400
# Edges not cut yet, each with its reason. The inference image serves the vLLM extraction server,
# whose command line and CPU connector are the extractor's (vllm_backend, vllm_cpu_connector; the
# Helm chart runs `python3 -m eyrie_extractor.vllm_backend` in that image): moving them changes the
# chart and its goldens.
KNOWN_SERVICE_EDGES = {("services/inference/eyrie_inference/extract_server.py", "eyrie_extractor")}
# The CLI's command bodies import what they use, so that `eyrie --help` and its errors stay fast.
LAZY_BY_DESIGN = {"eyrie/commands/cli_app.py", "eyrie/commands/cli_serve.py", "eyrie/commands/cli_stages.py",
                  "eyrie/commands/cli_drafter.py", "eyrie/commands/cli_pipeline.py", "eyrie/commands/cli_control.py"}
# Project imports kept inside a function, each with its reason.
KNOWN_IMPORTS_IN_FUNCTIONS: set[tuple[str, str]] = set()


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


def images() -> dict[str, tuple[set[str], set[str]]]:
    """Each service image (services/*/Dockerfile) -> (the service packages it copies, the queues its
    workers work: its CMD's `worker QUEUE`, or a Compose service's command run on it)."""
    import yaml

    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"]
    found = {}
    for dockerfile in sorted((ROOT / "services").glob("*/Dockerfile")):
        text = dockerfile.read_text()
        ships = {pkg for pkg in SERVICES if f"COPY services/{SERVICES[pkg]}/{pkg}/" in text}
        commands = [m.group(1).replace('"', "").split(", ") for m in re.finditer(r"^CMD \[(.*)\]$", text, re.M)]
        commands += [[*(s.get("entrypoint") or []), *(s.get("command") or [])] for s in compose.values()
                     if isinstance(s.get("build"), dict) and s["build"].get("dockerfile") == rel(dockerfile)]
        queues = {c[c.index("worker") + 1] for c in commands if "worker" in c}
        found[SERVICES.get(f"eyrie_{dockerfile.parent.name}", dockerfile.parent.name)] = (ships, queues)
    return found


def test_each_image_ships_what_its_workers_call_and_nothing_else():
    """The edges from the stage declarations to the services, per image: every task function of a
    queue an image's workers work is in a package the image copies, and every service package it
    copies is one its workers or its own packages reach (tests/e2e/test_compose_e2e.py checks the
    built images hold exactly that)."""
    found = images()
    assert found["api"] == (set(), set()), found["api"]  # the control plane runs no service code
    for image, (ships, queues) in found.items():
        called = {kind.func.split(".")[0] for kind in task_kinds().values() if kind.queue in queues}
        reached = called | {other for pkg in ships for path in modules(f"services/{SERVICES[pkg]}")
                            for other in imported_packages(path) & SERVICES.keys() if other != pkg}
        if image == "inference":  # `eyrie serve`, `eyrie serve-extract`: the CLI names its package
            reached.add("eyrie_inference")
        assert called <= ships, f"{image}: its workers call {sorted(called - ships)}, which it does not copy"
        assert ships <= reached, f"{image}: copies {sorted(ships - reached)}, which nothing in it calls"


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


@pytest.mark.parametrize("dotted", sorted({k.func for k in task_kinds().values()}
                                          | CALLBACKS
                                          | named_entries()))
def test_every_name_eyrie_uses_for_a_service_function_is_defined(dotted):
    assert _defined(dotted), f"{dotted} is named in eyrie/ but not defined"


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph(under: str = "eyrie") -> dict[str, set[str]]:
    """Module -> the project modules it imports, at its top or in a function (relative imports
    resolved; `from P import m` is P.m where m is a module; a package a module outside it imports
    through is an edge too: Python runs its __init__ first)."""
    paths = {module_name(p): p for p in modules(under)}

    def resolve(name: str) -> str | None:
        while name and name not in paths:
            name = name.rpartition(".")[0]
        return name or None

    graph = {}
    for name, path in paths.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        targets = set()
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                targets.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(parts + ([base] if base else []))
                targets.add(base)
                targets.update(f"{base}.{alias.name}" for alias in node.names)
        edges = set()
        for target in filter(None, map(resolve, targets)):
            parts = target.split(".")
            edges.update(".".join(parts[:i]) for i in range(1, len(parts) + 1)
                         if not (name + ".").startswith(".".join(parts[:i]) + "."))
        graph[name] = {e for e in edges if e in paths and e != name}
    return graph


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One shortest circle through each group of modules that import each other (Tarjan's strongly
    connected components), as [a, b, ..., a]."""
    index, low, stack, on_stack, groups = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = set()
            while v not in group:
                group.add(stack.pop())
            on_stack.difference_update(group)
            if len(group) > 1:
                groups.append(group)

    for v in sorted(graph):
        if v not in index:
            visit(v)
    cycles = []
    for group in groups:  # breadth first from its first module back to it
        start = min(group)
        parent, frontier = {start: start}, [start]
        while not (last := [v for v in frontier if start in graph[v]]):
            step = []
            for v in frontier:
                for w in sorted((graph[v] & group) - parent.keys()):
                    parent[w] = v
                    step.append(w)
            frontier = step
        path = [last[0]]
        while path[-1] != start:
            path.append(parent[path[-1]])
        cycles.append(path[::-1] + [start])
    return sorted(cycles)


def test_the_import_graph_check_sees_a_circle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set(), "e": {"e2"}, "e2": {"e"}}
    assert import_cycles(graph) == [["a", "b", "c", "a"], ["e", "e2", "e"]]


def test_eyrie_imports_form_no_circle():
    """Imports point one way, in functions too: a circle is cut by moving code where it belongs
    (or a lower module taking what it needs as a parameter), never by importing late."""
    graph = import_graph("eyrie")
    assert "eyrie.work.queue" in graph and graph["eyrie.commands.cli"]  # the graph is read
    cycles = import_cycles(graph)
    assert not cycles, "import circles in eyrie/: " + "; ".join(" -> ".join(c) for c in cycles)


# eyrie/'s rooms, lowest first (docs/architecture.md, "Rooms"): a module imports only from its own
# room and the rooms before it, in functions too (the CLI's lazy imports count); eyrie/__init__.py
# (the version) stands below them all and imports none. Every other module stands in a room.
ROOMS = ["core", "data", "work", "stages", "tasks", "runs", "api", "commands"]


def room_of(module: str) -> str | None:
    """eyrie.<room>.<module...> -> room; eyrie itself -> None."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else None


def upward_imports(graph: dict[str, set[str]], rooms: list[str]) -> list[tuple[str, str]]:
    """(importer, imported) where the imported module's room comes after the importer's."""
    rank = {room: i for i, room in enumerate(rooms)}

    def level(module: str) -> int | None:
        return -1 if room_of(module) is None else rank.get(room_of(module))

    return sorted((m, t) for m, targets in graph.items() for t in targets
                  if level(m) is not None and level(t) is not None and level(t) > level(m))


def test_the_room_check_sees_an_upward_import():
    graph = {"eyrie": {"eyrie.work"}, "eyrie.core": set(), "eyrie.core.a": {"eyrie", "eyrie.core"},
             "eyrie.work": set(), "eyrie.work.b": {"eyrie.core.a", "eyrie.core", "eyrie.work"},
             "eyrie.core.c": {"eyrie.work.b", "eyrie.work", "eyrie.core"}}
    assert upward_imports(graph, ["core", "work"]) == [("eyrie", "eyrie.work"), ("eyrie.core.c", "eyrie.work"),
                                                       ("eyrie.core.c", "eyrie.work.b")]


def test_every_module_of_eyrie_stands_in_a_room():
    graph = import_graph("eyrie")
    stray = sorted(m for m in graph if m != "eyrie" and room_of(m) not in ROOMS)
    assert not stray, f"put each in a room (eyrie/<room>/, one of ROOMS): {stray}"
    empty = [room for room in ROOMS if f"eyrie.{room}" not in graph]
    assert not empty, f"rooms in ROOMS with no package (eyrie/<room>/__init__.py): {empty}"


def test_rooms_import_only_the_rooms_below_them():
    """Lower rooms never import higher ones: a module that needs one higher up moves up, or the
    code it needs moves down (or comes in as a parameter); never an import in a function."""
    graph = import_graph("eyrie")
    assert graph["eyrie.commands.cli"] and graph["eyrie.work.queue"]  # the graph is read
    up = upward_imports(graph, ROOMS)
    assert not up, "imports against the room order " + " < ".join(ROOMS) + ": " + \
        "; ".join(f"{m} ({room_of(m)}) -> {t} ({room_of(t)})" for m, t in up)


# Rooms side by side on one floor (docs/architecture.md, "Rooms"): neither imports the other, whatever
# their order in ROOMS. tasks/ is the services' side of a stage, runs/ the control side of a run.
WINGS = [("tasks", "runs")]


def wing_crossings(graph: dict[str, set[str]], wings: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """(importer, imported) where the two stand in the two rooms of one pair of wings."""
    return sorted((m, t) for m, targets in graph.items() for t in targets
                  for pair in wings if {room_of(m), room_of(t)} == set(pair))


def test_the_wing_check_sees_an_import_across():
    graph = {"eyrie.a.x": {"eyrie.b.y", "eyrie.c.z"}, "eyrie.b.y": {"eyrie.c.z"}, "eyrie.c.z": set()}
    assert wing_crossings(graph, [("a", "b")]) == [("eyrie.a.x", "eyrie.b.y")]
    assert wing_crossings(graph, [("c", "b")]) == [("eyrie.b.y", "eyrie.c.z")]


def test_the_wings_import_neither_the_other():
    """What both wings need stands below them (the run config: eyrie.core.run_config, read from the
    store by eyrie.data.manifest.stored_config; a shard manifest's outcomes beside it)."""
    graph = import_graph("eyrie")
    assert all(f"eyrie.{room}" in graph for pair in WINGS for room in pair)
    across = wing_crossings(graph, WINGS)
    assert not across, "imports between wings: " + "; ".join(f"{m} -> {t}" for m, t in across)


ENVIRON_CALLS = {"get", "getenv"}


def eyrie_variables_read(source: str) -> list[tuple[int, str]]:
    """(line, name) of each EYRIE_* variable the source reads from the environment: os.environ[NAME],
    os.environ.get(NAME), os.getenv(NAME), NAME in os.environ; NAME a literal, an f-string or a
    concatenation that starts with it, or a module constant. A dict of its own (a child's env) is not
    the environment."""
    tree = ast.parse(source)
    constants = {target.id: node.value.value for node in tree.body if isinstance(node, ast.Assign)
                 and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)
                 for target in node.targets if isinstance(target, ast.Name)}

    def text(expr) -> str:
        if isinstance(expr, ast.Constant) and isinstance(expr.value, str):
            return expr.value
        if isinstance(expr, ast.JoinedStr) and expr.values:
            return text(expr.values[0])
        if isinstance(expr, ast.BinOp) and isinstance(expr.op, ast.Add):
            return text(expr.left)
        return constants.get(expr.id, "") if isinstance(expr, ast.Name) else ""

    def environ(expr) -> bool:
        return getattr(expr, "attr", None) == "environ" or getattr(expr, "id", None) == "environ"

    found = []
    for node in ast.walk(tree):
        names = []
        if isinstance(node, ast.Subscript) and environ(node.value):
            names = [node.slice]
        elif isinstance(node, ast.Call) and node.args:
            func = node.func
            if (getattr(func, "attr", None) == "get" and environ(func.value)) or \
                    getattr(func, "attr", getattr(func, "id", None)) == "getenv":
                names = [node.args[0]]
        elif isinstance(node, ast.Compare) and any(environ(c) for c in node.comparators):
            names = [node.left]
        found += [(node.lineno, text(n)) for n in names if text(n).startswith("EYRIE_")]
    return found


def test_the_environment_check_sees_every_way_of_reading():
    source = ("import os\nfrom os import environ, getenv\nNAME = 'EYRIE_C'\n"
              "os.environ['EYRIE_A']\nos.environ.get(f'EYRIE_{x}')\nos.getenv('EYRIE_' + x)\ngetenv(NAME)\n"
              "'EYRIE_B' in os.environ\nenviron.get('EYRIE_D', '')\n"
              "env = {**os.environ, 'EYRIE_E': '1'}\nenv.get('EYRIE_E')\nos.environ.get('HOME')\n")
    assert eyrie_variables_read(source) == [(4, "EYRIE_A"), (5, "EYRIE_"), (6, "EYRIE_"), (7, "EYRIE_C"),
                                            (8, "EYRIE_B"), (9, "EYRIE_D")]


def test_only_the_settings_read_eyrie_variables():
    """Every EYRIE_* variable is a field of eyrie.core.config.Settings (or, for the generate settings'
    host defaults, Settings.generate_defaults): typed, documented, validated in one place. Passing
    an environment to a child process is not reading it."""
    reads = {f"{rel(p)}:{line}": name for d in ("eyrie", "services") for p in modules(d)
             if rel(p) != "eyrie/core/config.py" for line, name in eyrie_variables_read(p.read_text())}
    assert not reads, f"read EYRIE_* through eyrie.core.config.Settings, not the environment: {reads}"
