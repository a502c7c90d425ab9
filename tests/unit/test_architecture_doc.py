"""What docs/architecture.md says of the code and no other test checks, each read from the source
(ast) or the declared objects: no process, no server. tests/unit/test_architecture.py checks the import
graph, the rooms' order, the images and the line counts; tests/unit/test_stage_names.py the stage names."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from eyrie.core.run_config import VerifySection
from eyrie.stages.run_config import RunConfig
from eyrie.core.stage_settings import StageSettings
from eyrie.stages import PIPELINE, PipelineStage, startable, task_kinds
from eyrie.stages.sharded import ShardedStage
from eyrie.tasks import executor
from eyrie.work import task_kinds as declared
from tests.support.harness import ROOT
from tests.unit.test_architecture import ROOMS, SERVICES, modules, rel

DOC = (ROOT / "docs/architecture.md").read_text()
# Task functions that are not the one line `return execute(Class, payload)`, each with its reason.
NOT_ONE_LINE: dict[str, str] = {}


def source_of(dotted: str) -> Path:
    """The file of a module named by its dotted name (eyrie.* or a service's package)."""
    top, *rest = dotted.split(".")
    base = ROOT / "eyrie" if top == "eyrie" else ROOT / "services" / SERVICES[top] / top
    return base.joinpath(*rest).with_suffix(".py")


def top_level(path: Path) -> dict[str, ast.AST]:
    return {node.name: node for node in ast.parse(path.read_text()).body
            if isinstance(node, (ast.FunctionDef, ast.ClassDef))}


def executed_class(statements: list[ast.stmt]) -> str | None:
    """X where the statements (a docstring aside) are `return execute(X, payload)`."""
    body = [n for n in statements if not (isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant))]
    if len(body) != 1 or not isinstance(body[0], ast.Return) or not isinstance(body[0].value, ast.Call):
        return None
    call = body[0].value
    args = [getattr(a, "id", None) for a in call.args]
    return args[0] if getattr(call.func, "id", None) == "execute" and len(args) == 2 and args[1] == "payload" else None


def wrapped_class(func: ast.FunctionDef) -> str | None:
    """X where the function's one statement is a `try` whose body is `return execute(X, payload)`."""
    body = [n for n in func.body if not (isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant))]
    return executed_class(body[0].body) if len(body) == 1 and isinstance(body[0], ast.Try) else None


def task_class(kind) -> tuple[str, ast.ClassDef]:
    """The stage class a task kind's function executes, found in the function's own module."""
    module, _, name = kind.func.rpartition(".")
    defined = top_level(source_of(module))
    func = defined[name]
    class_name = executed_class(func.body) or wrapped_class(func)
    assert class_name in defined, f"{kind.func} executes {class_name}, not a class of {module}"
    return module, defined[class_name]


def doc_paragraph(starts: str) -> str:
    start = DOC.index(starts)
    return DOC[start:DOC.index("\n\n", start)]


def rooms_table() -> dict[str, list[str]]:
    """docs/architecture.md's Rooms table: room -> the modules it lists, in the table's order."""
    table = DOC[DOC.index("<!-- rooms: begin"):DOC.index("<!-- rooms: end -->")]
    rows = [line.split("|")[1:-1] for line in table.splitlines() if line.startswith("| `eyrie/")]
    return {re.fullmatch(r"\s*`eyrie/(\w+)/`\s*", room)[1]: re.findall(r"`([\w.]+)`", listed)
            for room, _, listed in rows}


def test_the_rooms_table_lists_every_module_of_each_room_in_order():
    """Its rooms are ROOMS, in order, and each row names every file of eyrie/<room>/ (but
    __init__.py; a module by its name, another file by its file name) and nothing else."""
    table = rooms_table()
    assert list(table) == ROOMS
    for room, listed in table.items():
        files = {p.stem if p.suffix == ".py" else p.name for p in (ROOT / "eyrie" / room).iterdir()
                 if p.is_file() and p.name != "__init__.py"}
        assert sorted(listed) == sorted(files), f"eyrie/{room}/: the table lists {sorted(set(listed) - files)} " \
                                                f"that are not there and leaves out {sorted(files - set(listed))}"


def test_the_stages_paragraph_names_every_module_of_eyrie_stages():
    named = set(re.findall(r"`(\w+\.py)`", doc_paragraph("`eyrie/stages/` holds")))
    assert named == {p.name for p in (ROOT / "eyrie/stages").glob("*.py")}


FLAT = " ".join(DOC.split())  # the page with its line breaks as spaces: a list may span lines


def listed(pattern: str) -> list[str]:
    """The comma-separated names the page lists where `pattern`'s group stands."""
    found = re.search(pattern, FLAT)
    assert found, f"docs/architecture.md no longer says {pattern!r}: update this test with the page"
    return [name.strip() for name in found[1].split(",")]


@pytest.mark.parametrize("where, pattern", [("Words", r"\*\*stage\*\*: one step of the pipeline \(([^)]*)\)"),
                                            ("The pipeline as data", r"the list, `PIPELINE`: ([^.]*)\.")])
def test_the_pages_pipeline_is_PIPELINE_each_task_kind_on_its_stages_queue(where, pattern):
    assert listed(pattern) == [s.name for s in PIPELINE], f"docs/architecture.md ({where}) lists another pipeline"
    for s in PIPELINE:
        assert {k.queue for k in s.task_kinds()} == {s.queue}, s.name


def test_the_pages_planners_are_the_stages_planners_and_those_stages_start_alone():
    """The page names each stage's planner (and the stages with none: nothing to plan, its `start`
    enqueues it or records the skip); the stages with a planner are planned by a task on their own
    queue, and a user may start each of them on its own (`eyrie generate|extract|train`)."""
    said = FLAT[FLAT.index("has a planner task kind ("):]
    said = said[:said.index(")")]
    assert dict(re.findall(r"(\w+)'s `([\w-]+)`", said)) == {s.name: s.planner.name for s in PIPELINE if s.planner}
    assert re.findall(r"(\w+) has none", said) == [s.name for s in PIPELINE if s.planner is None]
    assert list(startable()) == [s.name for s in PIPELINE if s.planner is not None]
    commands = re.findall(r"`eyrie ((?:[\w-]+\|)+[\w-]+)`", FLAT)
    assert commands and all(c.split("|") == list(startable()) for c in commands), commands


def test_a_stage_has_one_start_method_the_bases_and_the_page_says_so():
    """How a stage is started, in the page's one sentence, made true by the code: `start(view)` is
    defined once, in the stage base (no stage redefines it), the base has no other method whose name
    starts with "start", and `advance` and a user's start reach a stage through it (start_stage keeps a
    config naming the stage: a pipeline of length one)."""
    assert "**How a stage is started: every start keeps the run's config and `advance` calls the stage's " \
           "`start(view)`, its one start method.**" in FLAT
    for s in PIPELINE:
        owners = [c.__name__ for c in type(s).__mro__ if "start" in vars(c)]
        assert owners == [PipelineStage.__name__], f"{s.name}: start defined in {owners}"
    starts = [name for name in vars(PipelineStage) if name.startswith("start") and callable(vars(PipelineStage)[name])]
    assert starts == ["start"], starts


@pytest.mark.parametrize("kind", sorted(task_kinds()))
def test_every_task_function_is_one_call_of_the_executor(kind):
    """A module-level function whose body is `return execute(X, payload)` (or, listed in
    NOT_ONE_LINE with its reason, that line in a `try`)."""
    module, _, name = task_kinds()[kind].func.rpartition(".")
    func = top_level(source_of(module)).get(name)
    assert isinstance(func, ast.FunctionDef), f"{module}.{name} is not a module-level function"
    if f"{module}.{name}" in NOT_ONE_LINE:
        assert executed_class(func.body) is None and wrapped_class(func), f"{module}.{name}: update NOT_ONE_LINE"
    else:
        assert executed_class(func.body), f"{module}.{name}: its body is not `return execute(Class, payload)`"


WRITE = re.compile(r"put|delete|enqueue|set$|hset|sadd|srem|incr|expire|write")  # a store's or Redis' writes


def names_from(module: str, source: str) -> set[str]:
    """The names `module` imports at its top from `source`."""
    return {a.name for node in ast.parse(source_of(module).read_text()).body
            if isinstance(node, ast.ImportFrom) and node.module == source for a in node.names}


def test_what_a_start_refuses_at_once_is_start_checks_and_its_planner_runs_it_again():
    """Each stage's own check_start calls eyrie.stages.start_checks, whose checks its planner's module
    imports too; no `checker` dotted name is left in eyrie/ or services/."""
    checking = [s for s in PIPELINE if "check_start" in vars(type(s))]
    assert [s.name for s in checking] == list(startable())
    for s in checking:
        module = type(s).__module__
        stage_class = top_level(source_of(module))[type(s).__name__]
        method = next(n for n in stage_class.body if isinstance(n, ast.FunctionDef) and n.name == "check_start")
        called = {getattr(n.func, "id", None) for n in ast.walk(method) if isinstance(n, ast.Call)}
        assert called & names_from(module, "eyrie.stages.start_checks"), f"{s.name}: check_start calls {called}"
        assert names_from(s.planner.func.rpartition(".")[0], "eyrie.stages.start_checks"), s.planner.name
    writes = [n.func.attr for n in ast.walk(ast.parse(source_of("eyrie.stages.start_checks").read_text()))
              if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and WRITE.match(n.func.attr)]
    assert not writes, f"start_checks only reads: {writes}"
    checkers = [f"{rel(p)}:{line}" for d in ("eyrie", "services") for p in modules(d)
                for line, text in literal_texts(p) if "checker" in text]
    assert not checkers, checkers


def bases_of(node: ast.ClassDef) -> set[str]:
    return {getattr(b, "id", getattr(b, "attr", None)) for b in node.bases}


def imports_from(module: str, name: str) -> str | None:
    """The module `name` is imported from at the top of `module`."""
    for node in ast.parse(source_of(module).read_text()).body:
        if isinstance(node, ast.ImportFrom) and any(a.name == name and a.asname is None for a in node.names):
            return node.module
    return None


def test_sharded_tasks_and_planners_subclass_the_shared_skeletons():
    """The work of a sharded stage (generate, extract) runs a subclass of
    eyrie.tasks.sharded.ShardedStageTask; every planner, one of eyrie.tasks.planner.PlannerTask."""
    sharded = [s.name for s in PIPELINE if isinstance(s, ShardedStage)]
    assert sharded == listed(r"A stage with one task per shard \(([^)]*)\)"), "the page names other sharded stages"
    for s in PIPELINE:
        pairs = [(s.planner, "PlannerTask", "eyrie.tasks.planner")] if s.planner else []
        if isinstance(s, ShardedStage):
            pairs.append((s.work, "ShardedStageTask", "eyrie.tasks.sharded"))
        for kind, base, skeleton in pairs:
            module, cls = task_class(kind)
            assert base in bases_of(cls) and imports_from(module, base) == skeleton, \
                f"{kind.name}: {module}.{cls.name} does not subclass {skeleton}.{base}"


def literal_texts(path: Path):
    """(line, text) of each string literal (docstrings left out) and f-string (its values as {})."""
    tree = ast.parse(path.read_text(), filename=str(path))
    docstrings = {id(node.body[0].value) for node in ast.walk(tree)
                  if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
                  and node.body and isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant)}
    in_fstrings = {id(v) for node in ast.walk(tree) if isinstance(node, ast.JoinedStr) for v in node.values}
    for node in ast.walk(tree):
        if isinstance(node, ast.JoinedStr):
            yield node.lineno, "".join(v.value if isinstance(v, ast.Constant) else "{}" for v in node.values)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings | in_fstrings:
            yield node.lineno, node.value


REDIS_KEY = re.compile(r"eyrie:(?!\s)")  # "eyrie: error" is a message, "eyrie:runs" a key


def test_the_redis_key_check_tells_a_key_from_a_message(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text('"""eyrie:doc"""\nA = "eyrie:runs"\nB = f"eyrie:lease:{x}"\nprint(f"eyrie: {e}")\n')
    assert [line for line, text in literal_texts(probe) if REDIS_KEY.match(text)] == [2, 3]


def test_only_the_keys_module_writes_a_redis_key():
    """Every Redis key eyrie writes starts `eyrie:` and stands in eyrie/work/keys.py."""
    found = [f"{rel(p)}:{line}: {text!r}" for d in ("eyrie", "services") for p in modules(d)
             if rel(p) != "eyrie/work/keys.py" for line, text in literal_texts(p) if REDIS_KEY.match(text)]
    assert not found, f"build Redis keys in eyrie/work/keys.py: {found}"


# a run's store keys (eyrie.data.manifest.Layout) and the reuse index's (states_index)
STORE_KEY = re.compile(r"^(runs|states)/|/(generate|extract|train)/|/(used-by|checkpoints|tensorboard)\b")


def test_only_the_manifest_module_builds_a_store_key():
    """An f-string that joins a store key's parts (`f"{layout.root}/extract/shards/"`) stands
    only in eyrie/data/manifest.py: the others ask Layout or states_index."""
    built = [f"{rel(p)}:{line}: {text!r}" for d in ("eyrie", "services") for p in modules(d)
             if rel(p) != "eyrie/data/manifest.py" for line, text in literal_texts(p)
             if "{}" in text and STORE_KEY.search(text)]
    assert not built, f"add the key to eyrie.data.manifest.Layout (or states_index): {built}"
    assert any(STORE_KEY.search(t) for _, t in literal_texts(ROOT / "eyrie/data/manifest.py"))  # the check sees keys


def test_the_allow_list_gpu_queues_and_kueue_read_every_task_kind_built():
    """eyrie.work.task_kinds' readers see a TaskKind no stage of PIPELINE declares (a test's own stage)."""
    probe = declared.TaskKind("doc-probe", "doc-probe-queue", "doc_probe.run", gpu=True, jobs=("doc-probe",))
    try:
        assert probe.name not in task_kinds()  # not the pipeline's
        assert probe.func in declared.task_funcs() and probe.queue in declared.gpu_queues()
        assert declared.jobs_for_queue(probe.queue) == ("doc-probe",)
    finally:
        del declared._DECLARED[probe.name]


def test_verify_settings_are_a_plain_section_beside_the_run_config():
    """A stage with a planner has StageSettings of eyrie/core/stage_settings.py as its section;
    verify's, which nothing plans, is VerifySection of eyrie/core/run_config.py."""
    for s in PIPELINE:
        section = RunConfig.model_fields[s.own_section()].annotation
        if s.planner is None:
            assert section is VerifySection and section.__module__ == "eyrie.core.run_config", s.name
        else:
            assert issubclass(section, StageSettings) and section.__module__ == "eyrie.core.stage_settings", s.name


# the run config's sections no stage owns: the run's name, its stages, its target, how it is served, --plan's figures
RUNS_OWN = ("run", "stages", "target", "serve", "plan")


def test_the_run_configs_sections_are_the_stages_sections_and_the_runs_own():
    """RunConfig is built from the stages: each stage's `sections` are fields of it, of the stage's
    settings classes, in the pipeline's order, and it has no other field but the run's own."""
    assert [name for name in RunConfig.model_fields if name not in RUNS_OWN] == \
        [name for s in PIPELINE for name in s.sections]
    for s in PIPELINE:
        for name, cls in s.sections.items():
            assert RunConfig.model_fields[name].annotation is cls, (s.name, name)


def test_the_executor_command_takes_a_task_kind_name(monkeypatch, capsys):
    """`python -m eyrie.tasks.executor <task kind> '<json>'` runs that kind's function, and only a kind's."""
    called = []
    monkeypatch.setattr(executor, "entry", lambda dotted: lambda payload: called.append((dotted, payload)) or {})
    for name, kind in task_kinds().items():
        assert executor.main([name, '{"run": "r"}']) == 0
        assert called.pop() == (kind.func, {"run": "r"})
    with pytest.raises(SystemExit):
        executor.main(["not-a-task-kind", "{}"])
    capsys.readouterr()


def callers_of(name: str) -> set[tuple[str, str]]:
    """(module, function) of each eyrie/ function that calls `name`."""
    return {(rel(p), func.name) for p in modules("eyrie") for func in ast.walk(ast.parse(p.read_text()))
            if isinstance(func, ast.FunctionDef) for n in ast.walk(func)
            if isinstance(n, ast.Call) and getattr(n.func, "id", None) == name}


def test_plans_refusals_run_on_a_pipelines_start_only():
    """`--plan`'s refusals before anything is written: `eyrie run`, POST /runs without ?stage=."""
    assert callers_of("refuse_before_start") == {("eyrie/runs/control.py", "start_pipeline")}


def test_the_apis_stage_and_queue_parameters_are_the_stages_startable_and_queues():
    """The table: the API's `stage` and `queue` parameters ask the stages `startable()` and `queues()`."""
    from typing import get_args

    from eyrie.api import app
    from eyrie.stages import queues

    assert get_args(app.Stage) == startable() and get_args(app.QueueName) == queues()
