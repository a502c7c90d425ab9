"""The fingerprint a run's states are found by (eyrie.runs.reuse.settings_fingerprint), read from
the fields' markers: a field of the sections that make the states (dataset, generate, extract)
marked PACING (eyrie.core.stage_settings) changes nothing, every other one changes it, but the
dataset's path (its content is keyed apart); the generate settings count as used, a host's default
included. No process, no store: the end-to-end reuse is tests/integration/test_reuse_states.py."""

from __future__ import annotations

import copy

import pytest
from pydantic import BaseModel, ValidationError

from eyrie.stages.run_config import RunConfig
from eyrie.core.provenance import RUN_CONFIG, as_used
from eyrie.core.stage_settings import GenerateSettings, pacing_fields
from eyrie.runs.reuse import settings_fingerprint, states_sections

BASE = {"run": "a", "target": {"model": "m"}, "dataset": {"source": "prompts.jsonl"}}
# values tried in turn for a field, after its own choices: the first valid one unlike the default is taken
CANDIDATES = (2, 3, 16, 0.5, "other", "1GB", [2, 4, 5])


def config(section: str | None = None, field: str | None = None, value=None) -> RunConfig:
    raw = copy.deepcopy(BASE)
    if section:
        raw.setdefault(section, {})[field] = value
    return RunConfig.model_validate(raw)


def fingerprint(config: RunConfig, host: GenerateSettings | None = None) -> str:
    return settings_fingerprint(config, as_used(config.generate, RUN_CONFIG, host))


def choices(schema: dict) -> list:
    """The enum values anywhere in a field's JSON schema (a Literal, an optional Literal)."""
    found = list(schema.get("enum", []))
    for sub in schema.get("anyOf", []) + schema.get("allOf", []):
        found += choices(sub)
    return found


def another_value(section: str, model: type[BaseModel], field: str):
    """A valid value of the field other than its default."""
    default = getattr(getattr(config(), section), field)
    for value in (*choices(model.model_json_schema()["properties"][field]), *CANDIDATES):
        try:
            changed = getattr(getattr(config(section, field, value), section), field)
        except ValidationError:
            continue
        if changed != default:
            return value
    pytest.fail(f"{section}.{field}: no value of CANDIDATES is valid and unlike its default; add one")


def states_fields() -> list[tuple[str, type[BaseModel], str]]:
    return [(name, type(getattr(config(), name)), field) for name in states_sections()
            for field in type(getattr(config(), name)).model_fields]


@pytest.mark.parametrize("section, model, field", states_fields(), ids=[f"{s}.{f}" for s, _, f in states_fields()])
def test_a_pacing_field_leaves_the_fingerprint_and_any_other_changes_it(section, model, field):
    changed = fingerprint(config(section, field, another_value(section, model, field)))
    if field in pacing_fields(model) or (section, field) == ("dataset", "source"):
        assert changed == fingerprint(config()), f"{section}.{field} is marked PACING (or a path)"
    else:
        assert changed != fingerprint(config()), f"{section}.{field} is not marked PACING"


def test_a_host_default_reaches_the_fingerprint():
    """Run A leaves max_tokens out on a generator host with EYRIE_MAX_TOKENS=512; run B asks 8192, the
    code's default: not the same answers (at 40c2bde both fingerprinted the code's 8192)."""
    a = fingerprint(config(), host=GenerateSettings(max_tokens=512))
    b = fingerprint(config("generate", "max_tokens", 8192))
    assert a != b and b == fingerprint(config())
    assert a == fingerprint(config("generate", "max_tokens", 512))  # the same value used: the same answers


def test_some_field_is_marked_pacing():
    """The test above checks both sides: how fast the answers are fetched (generate's requests in
    flight among them) is marked."""
    marked = {field for section, model, field in states_fields() if field in pacing_fields(model)}
    assert "concurrency" in marked and len(marked) < len(states_fields())
