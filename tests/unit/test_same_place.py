"""Where a host cannot read a run's input (the stack's API image holds no model or data), a relative path is the
kept absolute one named from the services' working directory (eyrie.runs.identity.same_place), and the stored
config keeps the absolute one (located); anything else this host cannot tell is not the same."""

from eyrie.runs.identity import located, same_place
from eyrie.stages.run_config import RunConfig


def config(model: str, source: str) -> RunConfig:
    return RunConfig.model_validate({"run": "r", "target": {"model": model}, "dataset": {"source": source}})


def test_a_relative_path_this_host_lacks_is_the_kept_absolute_one_it_ends():
    assert same_place("/opt/eyrie/models/m", "models/m") and same_place("/opt/eyrie/models/m", "m")
    assert not same_place("/opt/eyrie/models/m", "other/m") and not same_place("/opt/eyrie/models/m", "/srv/models/m")
    assert not same_place("models/m", "models/m")  # nothing absolute kept: nothing to tell it by
    kept, given = config("/opt/eyrie/models/m", "/opt/eyrie/data/p.jsonl"), config("models/m", "data/p.jsonl")
    assert located(kept, given).target.model == "/opt/eyrie/models/m"
    assert located(kept, given).dataset.source == "/opt/eyrie/data/p.jsonl"
    assert located(kept, config("other/m", "data/q.jsonl")) == config("other/m", "data/q.jsonl")
