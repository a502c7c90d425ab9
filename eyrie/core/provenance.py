"""Each stage setting as the run used it: its value and where the value came from (the run config, a
stage command's flag, the planning host's environment, or the code's default). A stage's planner
records them in the run manifest (`RunManifest.settings`), on the host where they apply (generate's
host defaults, EYRIE_<FIELD>, are the generator's); reuse, `eyrie show`, the manifest and the card
read these values, never the code's defaults again."""

from __future__ import annotations

from pydantic import BaseModel

RUN_CONFIG, STAGE_FLAG, DEFAULT = "run config", "stage flag", "default"


def host_source(name: str) -> str:
    return f"host environment (EYRIE_{name.upper()})"


def given_by(config, stage_name: str) -> str:
    """Who gave a stage's settings: a stage command's flags where the run is that stage alone, else
    the run config (`eyrie run`, POST /runs)."""
    return STAGE_FLAG if config is not None and config.stages == [stage_name] else RUN_CONFIG


def as_used(section: BaseModel, source: str, host: BaseModel | None = None) -> dict[str, dict]:
    """Every field of `section` (a stage's settings) with the value used and its source: given
    (`source`), else the host's default where `host` sets it, else the code's default."""
    given, host_given = section.given(), host.given() if host is not None else {}
    used = {}
    for name in type(section).model_fields:
        if name in given:
            value, where = given[name], source
        elif name in host_given:
            value, where = host_given[name], host_source(name)
        else:
            value, where = getattr(section, name), DEFAULT
        used[name] = {"value": value, "source": where}
    return used


def values(used: dict[str, dict]) -> dict:
    """The values alone of an as_used record."""
    return {name: entry["value"] for name, entry in used.items()}
