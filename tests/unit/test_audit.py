"""`eyrie audit`'s train figure says what it rests on (issue 41, item 12): counted from the trainer's
record of what it read (train/samples.json), or, without that record, from the plan, saying so in
what it returns (`note`: `--json`, the API) and in the table it prints."""

from eyrie.runs.audit import _train, render
from tests.support.builders import make_manifest


def _trained(run: str):
    return make_manifest(run, 4, extract={}, train={}, drafter={"path": "drafter"})


def test_without_the_trainers_record_the_train_figure_says_it_is_counted_from_the_plan():
    figure = _train(_trained("r"), ["s0", "s1", "s2", "s3"], None)
    assert figure.done == 4 and figure.failed == 0  # the plan's 3 + 1 held out: left-out samples unknown
    assert figure.note and "counted from the plan" in figure.note and "r/train/samples.json" in figure.note
    assert "counted from the plan" in figure.model_dump()["note"]  # what --json and the API return
    table = render([figure])
    assert table[-1] == f"train: {figure.note}" and len(table) == 3  # header, the figure, its note


def test_with_the_trainers_record_the_train_figure_has_no_note():
    read = {"read_rows": [0, 1, 2], "heldout_samples": 1, "dropped": {}}
    figure = _train(_trained("r"), ["s0", "s1", "s2", "s3"], read)
    assert figure.done == 4 and figure.note is None
    assert len(render([figure])) == 2
