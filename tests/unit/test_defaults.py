"""Every default, in one checked-in file: the run config's (RunConfig and its sections, as the fields
make them), the host's (Settings: EYRIE_*) and the chart's values that repeat one of them, in
tests/golden/defaults.json. A changed default shows as that file's diff: review it, then
EYRIE_UPDATE_GOLDEN=1 rewrites it (`make helm-check GOLDEN=1`, as tests/golden/helm/). A default
written elsewhere (the chart's values, Compose's `${EYRIE_X:-default}`, README's table of EYRIE_*)
is compared to the field's here, so none drifts. No process, no server."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

import pytest
import yaml
from pydantic import BaseModel, TypeAdapter
from pydantic.fields import FieldInfo
from pydantic_core import to_jsonable_python

from eyrie.core.config import Settings
from eyrie.stages.run_config import RunConfig
from eyrie.core.stage_settings import GenerateSettings
from tests.support.harness import ROOT

GOLDEN = ROOT / "tests" / "golden" / "defaults.json"
VALUES = ROOT / "deploy" / "helm" / "eyrie" / "values.yaml"
REQUIRED = "(required)"
# The chart's values that are a default of the code (the one that applies on Kubernetes: the chart
# sets it on the workers), by their path in values.yaml -> the default's path in the golden.
CHART_REPEATS = {
    "generator.concurrency": "run_config.generate.concurrency",
    "generator.requestTimeoutSeconds": "run_config.generate.request_timeout_s",
    "api.openReads": "settings.EYRIE_API_OPEN_READS",
    "gpuJobs.serve.deadlineSeconds": "settings.EYRIE_SERVE_DEADLINE_S",
}
# Compose's `${EYRIE_X:-value}` of a setting that is the stack's own, not the code's default, with why.
STACK_OWN = {"EYRIE_DATA_DIR": "the bucket's directory on the host (MinIO's volume); the code cannot know one"}
COMPOSE_FILES = ("docker-compose.yml", "compose.gpu.yml", "compose.ci.yml")
UNSET = object()  # an empty value, None or []: EYRIE_X="" is not set (Settings: env_ignore_empty)


def default_of(field: FieldInfo) -> Any:
    if field.is_required():
        return REQUIRED
    return to_jsonable_python(field.get_default(call_default_factory=True))


def model_defaults(model: type[BaseModel]) -> dict:
    """Each field's default; a section's fields nested under its name."""
    return {name: model_defaults(field.annotation)
            if isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel) else default_of(field)
            for name, field in model.model_fields.items()}


def at(tree: dict, path: str) -> Any:
    for key in path.split("."):
        tree = tree[key]
    return tree


def chart_values() -> dict:
    return yaml.safe_load(VALUES.read_text())


def defaults() -> dict:
    return {"run_config": model_defaults(RunConfig),
            "settings": {f"EYRIE_{name.upper()}": default_of(field) for name, field in Settings.model_fields.items()},
            "chart": {path: at(chart_values(), path) for path in CHART_REPEATS}}


def test_the_golden_holds_every_default():
    text = json.dumps(defaults(), indent=1) + "\n"
    if os.environ.get("EYRIE_UPDATE_GOLDEN") == "1":
        GOLDEN.write_text(text)
    assert GOLDEN.exists(), f"no {GOLDEN}: run with EYRIE_UPDATE_GOLDEN=1"
    assert json.loads(GOLDEN.read_text()) == defaults(), \
        f"a default differs from {GOLDEN.relative_to(ROOT)}: review the diff, then rerun with EYRIE_UPDATE_GOLDEN=1"


@pytest.mark.parametrize("path", CHART_REPEATS)
def test_the_charts_value_is_the_codes_default_it_repeats(path):
    code = at(defaults(), CHART_REPEATS[path])
    assert at(chart_values(), path) == code, f"values.yaml's {path} is not the code's default {code}"


def setting(name: str) -> FieldInfo | None:
    return Settings.model_fields.get(name.removeprefix("EYRIE_").lower()) if name.startswith("EYRIE_") else None


def meaning(text: str, field: FieldInfo) -> Any:
    """A default as a file writes it (`x`, –, unset, "– (what it comes to)"), in the field's type."""
    text = text.strip().strip("`")
    if text in ("", "unset") or text.startswith("–"):
        return UNSET
    return TypeAdapter(field.annotation).validate_python(text)


def same(written: Any, field: FieldInfo) -> bool:
    default = field.get_default(call_default_factory=True)
    return default in (None, "", []) if written is UNSET else written == default


def compose_defaults() -> list[tuple[str, str, str]]:
    """(file, EYRIE_X, default) of each `${EYRIE_X:-default}` of a setting in the Compose files."""
    return [(name, m[1], m[2]) for name in COMPOSE_FILES
            for m in re.finditer(r"\$\{(EYRIE_[A-Z0-9_]+):?-([^}]*)\}", (ROOT / name).read_text()) if setting(m[1])]


def test_composes_defaults_are_the_codes():
    found = compose_defaults()
    assert {name for _, name, _ in found} >= {"EYRIE_SERVE_DEADLINE_S", "EYRIE_API_OPEN_READS"}  # the check sees them
    wrong = [f"{file}: ${{{name}:-{text}}}" for file, name, text in found
             if name not in STACK_OWN and not same(meaning(text, setting(name)), setting(name))]
    assert not wrong, f"not the code's default (eyrie/core/config.py), or list it in STACK_OWN with why: {wrong}"
    assert {name for _, name, _ in found} >= set(STACK_OWN), "STACK_OWN lists a variable Compose no longer defaults"


def readme_defaults() -> dict[str, str]:
    """EYRIE_X -> its default as README's table of settings writes it (one for several names: each's;
    a generate setting's: the field's, listed in parentheses)."""
    found = {}
    for line in (ROOT / "README.md").read_text().splitlines():
        if line.startswith("| `EYRIE_"):
            names_cell, written = line.split(" | ")[:2]
            names = re.findall(r"`(EYRIE_[A-Z0-9_]+)`", names_cell)
            listed = re.fullmatch(r"the field's \((.*)\)", written)
            values = (listed[1] if listed else written).split(", ")
            values = values * len(names) if len(values) == 1 else values
            assert len(values) == len(names), f"README: {len(names)} names, {len(values)} defaults: {line[:80]}"
            found.update(zip(names, values))
    return found


def test_the_readmes_defaults_are_the_codes():
    written = readme_defaults()
    assert len(written) > 30, written  # the table is read
    wrong = [f"{name}: {text}" for name, text in written.items()
             if (field := readme_field(name)) is None or not same(meaning(text, field), field)]
    assert not wrong, f"README's table of settings: not a setting, or not the code's default: {wrong}"


def readme_field(name: str) -> FieldInfo | None:
    """A host setting, or a generate setting's host default (EYRIE_<FIELD>: Settings.generate_defaults)."""
    return setting(name) or GenerateSettings.model_fields.get(name.removeprefix("EYRIE_").lower())
