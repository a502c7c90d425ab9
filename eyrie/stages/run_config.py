"""The run config built from the pipeline: the run's own sections (eyrie.core.run_config) and each stage's
sections, its settings classes, in PIPELINE's order; `load_config` reads a run.yaml into it and
`stored_config` is the one reader of a run's kept config (pipeline.json). A stage added to PIPELINE
adds its sections here: nothing else declares them."""

from __future__ import annotations

from pathlib import Path

from eyrie.core.run_config import RunConfigBase, build_run_config, read_config
from eyrie.data.manifest import config_key
from eyrie.stages import PIPELINE


def run_config_model() -> type[RunConfigBase]:
    """The model for the pipeline as it stands (built once per list of sections)."""
    return build_run_config(tuple((name, cls) for stage in PIPELINE for name, cls in stage.sections.items()))


def load_config(path: Path) -> RunConfigBase:
    return read_config(path, run_config_model())


def stored_config(store, run: str) -> RunConfigBase | None:
    """The run config its start kept, typed (None: none kept)."""
    key = config_key(run)
    return run_config_model().model_validate(store.get_json(key)) if store.exists(key) else None


def __getattr__(name: str):
    """`RunConfig`: the model for the pipeline as it stands, for those that name it (the API's body)."""
    if name == "RunConfig":
        return run_config_model()
    raise AttributeError(name)
