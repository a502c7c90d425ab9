"""A run's family: the runs that train on the same generated answers and hidden states (the run
that owns them and every run on them, eyrie.runs.reuse), each with its train settings and its
acceptance (eyrie's τ, vLLM's per benchmark), and the settings that vary among them: a recipe
sweep read at a glance."""

from __future__ import annotations

from pydantic import BaseModel

from eyrie.core.errors import UnknownRun
from eyrie.data.manifest import RunManifest, load_run_manifest
from eyrie.data.shared_states import users_of


class Member(BaseModel):
    run: str
    settings: dict  # its train settings (TrainParams.settings)
    eyrie_tau: float | None = None  # the exported drafter's, on held-out samples
    vllm: dict[str, float | None] = {}  # vLLM's acceptance length per verified prompt set, at the trained K


class Family(BaseModel):
    owner: str
    varied: list[str]  # the train settings whose values differ among the members
    members: list[Member]


def family(store, run: str) -> Family:
    """Every run on the states `run` trains on (itself included), those with a train plan."""
    manifest = load_run_manifest(store, run)
    owner = manifest.states_from or run
    members = [m for name in [owner, *sorted(users_of(store, owner))] if (m := _member(store, name))]
    settings = [m.settings for m in members]
    varied = [key for key in (settings[0] if settings else {}) if len({repr(s.get(key)) for s in settings}) > 1]
    return Family(owner=owner, varied=varied, members=members)


def _member(store, run: str) -> Member | None:
    try:
        manifest = load_run_manifest(store, run)
    except UnknownRun:  # deleted since
        return None
    if manifest.train is None:
        return None
    return Member(run=run, settings=manifest.train.settings(), vllm=_vllm(manifest),
                  eyrie_tau=(manifest.drafter or {}).get("tau"))


def _vllm(manifest: RunManifest) -> dict[str, float | None]:
    verify = manifest.verify or {}
    k = str(verify.get("k") or (manifest.drafter or {}).get("k"))
    return {name: bench["k"].get(k, {}).get("vllm_acceptance_length")
            for name, bench in (verify.get("benchmarks") or {}).items()}
