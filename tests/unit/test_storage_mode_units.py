"""extract.storage hybrid and online without processes (tests/e2e/test_storage_modes.py runs them end to
end): the shard's split, its bound on a states file, the planner's refusals, and a materialized directory
with samples stored as ids alone."""

import pytest
import torch
from safetensors.torch import save, save_file

from eyrie.core.errors import EyrieError
from eyrie.core.stage_settings import ExtractSettings
from eyrie.data.manifest import Counts, ExtractParams, Layout, RunManifest, ShardManifest
from eyrie.data.store import FileStore
from eyrie.stages.start_checks import same_extract
from eyrie_extractor.plan import check_storage_mode
from eyrie_extractor.shard import ExtractRunner, ids_tensors, sample_tensors
from eyrie_extractor.storage_split import ids_object_bound, split, states_file_bound
from eyrie_trainer.data import materialize
from tests.support.builders import make_manifest

LAYERS = [2, 4, 5]


# --- the shard's split, without processes -------------------------------------------------------

def _params(storage: str = "hybrid", allowance: int | None = None, dtype: str = "bf16") -> ExtractParams:
    return ExtractParams(backend="vllm", aux_layers=LAYERS, dtype=dtype, max_length=200, num_layers=8,
                         hidden_size=64, samples=10, tokens=100, truncated=0, projected_bytes=1, budget_bytes=None,
                         storage=storage, shard_allowance_bytes=allowance)


def _todo(lengths: list[int]) -> list[dict]:
    return [{"sample_id": f"s{row}", "row": row, "input_ids": list(range(n))} for row, n in enumerate(lengths)]


def _ids(samples: list[dict]) -> list[str]:
    return [s["sample_id"] for s in samples]


def _bound(lengths: list[int], kept: int) -> int:
    """The bytes a shard counts against its allowance: the first `kept` samples' states files, the rest's ids."""
    return (sum(states_file_bound(n, _params()) for n in lengths[:kept])
            + sum(ids_object_bound(n) for n in lengths[kept:]))


def test_hybrid_keeps_states_in_shard_order_while_the_allowance_holds_them():
    lengths = [30, 20, 40, 30, 50, 5, 10]
    params = _params(allowance=_bound(lengths, 4) + 3000)  # s5's states file would take 2,816 B more than its ids
    kept, ids_only = split(params, [], _todo(lengths))
    assert _ids(kept) == ["s0", "s1", "s2", "s3"]
    assert _ids(ids_only) == ["s4", "s5", "s6"]  # s5 alone would fit: the states stop at the first that does not
    assert split(_params("offline"), [], _todo(lengths)) == (_todo(lengths), [])
    assert split(_params("online"), [], _todo(lengths)) == ([], _todo(lengths))


def test_a_retry_decides_the_rest_as_the_first_attempt_did():
    lengths = [30, 20, 40, 30, 50, 5, 10]
    params = _params(allowance=_bound(lengths, 4) + 3000)
    todo = _todo(lengths)
    kept, _ = split(params, [], todo)
    # the first attempt stored s1 (states), s5 (ids alone) and a skipped sample, then died
    stored = [{"sample_id": "s1", "row": 1, "seq_len": 20, "status": "done"},
              {"sample_id": "s5", "row": 5, "seq_len": 5, "status": "done", "states": False},
              {"sample_id": "x", "row": 7, "status": "skipped"}]
    rest = [s for s in todo if s["sample_id"] not in ("s1", "s5")]
    kept_again, ids_only_again = split(params, stored, rest)
    assert _ids(kept_again) == [s for s in _ids(kept) if s != "s1"] and _ids(ids_only_again) == ["s4", "s6"]


@pytest.mark.parametrize("dtype", ["bf16", "fp8"])
@pytest.mark.parametrize("seq_len", [1, 37, 3000])
def test_a_states_file_never_passes_its_bound(dtype, seq_len):
    """The split's bound of a sample's states file is above the bytes the shard stores for it."""
    params = _params(dtype=dtype)
    data = save(sample_tensors(torch.randn(seq_len, len(LAYERS) + 1, 64), list(range(seq_len)), dtype))
    assert len(data) <= states_file_bound(seq_len, params)
    assert len(save(ids_tensors(list(range(seq_len))))) <= ids_object_bound(seq_len)


def test_a_hybrid_shard_stores_its_ids_only_objects_within_the_allowance_too():
    """The allowance holds everything the shard stores: 4 states files nearly fill it, and the 12
    samples after them store their ids in what the 4th would have taken."""
    lengths = [30, 20, 40, 30] + [50] * 12
    allowance = sum(states_file_bound(n, _params()) for n in lengths[:4]) + 100
    kept, ids_only = split(_params(allowance=allowance), [], _todo(lengths))
    assert _ids(kept) == ["s0", "s1", "s2"] and len(ids_only) == 13
    assert _bound(lengths, 3) <= allowance < _bound(lengths, 4)
    stored = [save(sample_tensors(torch.randn(len(s["input_ids"]), len(LAYERS) + 1, 64), s["input_ids"], "bf16"))
              for s in kept] + [save(ids_tensors(s["input_ids"])) for s in ids_only]
    assert sum(len(data) for data in stored) <= allowance


def test_an_extract_result_names_each_count_once():
    """The task's result is its counts and these fields together: a repeated name would fail the task at its end."""
    assert not ExtractRunner.result_fields(None, Counts(tokens=10, on_demand=3), 2.0).keys() & Counts.model_fields


# --- the planner's refusals ---------------------------------------------------------------------

def test_hybrid_and_online_need_the_vllm_backend_and_its_layer_order():
    with pytest.raises(EyrieError, match="extract.storage online .*extract.backend is hf.*set extract.backend: vllm"):
        check_storage_mode("online", ExtractSettings(storage="online"), LAYERS, 8, 10**6, None)
    with pytest.raises(EyrieError, match=r"auto chose it: the hidden states need 1.00 MB, extract.budget is 1.00 kB"):
        check_storage_mode("hybrid", ExtractSettings(storage="auto", budget="1kB"), LAYERS, 8, 10**6, 1000)
    with pytest.raises(EyrieError, match=r"extract.layers \[5, 2, 4\] are in another order.*e.g. \[2, 4, 5\]"):
        check_storage_mode("online", ExtractSettings(storage="online", backend="vllm"), [5, 2, 4], 8, 1, None)
    with pytest.raises(EyrieError, match=r"below 8, e.g. \[2, 4\]"):
        check_storage_mode("hybrid", ExtractSettings(storage="hybrid", backend="vllm"), [2, 4, 8], 8, 1, 10)
    check_storage_mode("offline", ExtractSettings(), [5, 2, 4], 8, 1, None)  # stored in eyrie's order: any order


def test_a_rerun_asking_another_mode_is_refused():
    planned = _params("hybrid", 500).model_copy(update={"projected_bytes": 2000, "budget_bytes": 1000})
    with pytest.raises(EyrieError, match="planned with other settings: storage online vs hybrid"):
        same_extract(planned, ExtractSettings(storage="online"))
    same_extract(planned, ExtractSettings(storage="auto"))  # auto chooses hybrid again: the same plan
    same_extract(planned, ExtractSettings())  # not asked: the plan's


# --- a materialized directory with samples stored as ids alone, without processes ---------------

def _stored_run(store: FileStore, samples: list[tuple[list[int], bool]]) -> None:
    """A run whose one extract shard holds `samples` (token ids, with states or not) as eyrie stores them."""
    layout, records = Layout("m"), []
    for row, (ids, states) in enumerate(samples):
        data = save(sample_tensors(torch.randn(len(ids), 4, 64), ids, "bf16")) if states else save(ids_tensors(ids))
        info = store.put_bytes(layout.extract_sample(0, f"s{row}"), data)
        records.append({"sample_id": f"s{row}", "row": row, "status": "done", "key": info.key, "sha256": info.sha256,
                        "bytes": info.size, "seq_len": len(ids), "prompt_len": 2, **({} if states else {"states": False})})
    store.put_json(layout.manifest, _manifest("m").model_dump())
    store.put_json(layout.extract_shard_manifest(0), ShardManifest(
        run="m", stage="extract", shard=0, bytes=0, counts=Counts(), skip_reasons={}, failure_errors={},
        started_at="now", finished_at="now", worker="test", samples=records).model_dump())


def _manifest(run: str) -> RunManifest:
    return make_manifest(run, 4, extract=_params("online").model_dump())


def test_samples_stored_as_ids_alone_are_rows_without_a_states_file(tmp_path):
    from speculators.train.data import ArrowDataset

    store, dest = FileStore(tmp_path / "store"), tmp_path / "data"
    samples = [([5, 6, 7, 8], True), ([9, 10, 11], False), ([12, 13, 14, 15, 16], True), ([17, 18, 19], False)]
    _stored_run(store, samples)
    assert materialize(store, "m", dest) == 4
    assert sorted(p.name for p in (dest / "hidden_states").iterdir()) == ["hs_0.safetensors", "hs_2.safetensors"]
    freq = torch.load(dest / "token_freq.pt")
    assert set(freq) == {7, 8, 11, 14, 15, 16, 19}  # the answers of all four (prompt_len 2), ids-only included
    dataset = ArrowDataset(512, str(dest), on_missing="raise")
    assert dataset[0]["input_ids"].tolist() == [5, 6, 7, 8]
    assert dataset.data[1]["input_ids"].tolist() == [9, 10, 11] and dataset.data[1]["loss_mask"].tolist() == [0, 0, 1]
    with pytest.raises(RuntimeError, match="Failed to load hidden states for sample 1"):
        dataset[1]  # no file: speculators' on_missing decides (training: ask the extraction service)

    # a file at an ids-only row is kept only where it holds states for that row's ids (the held-out
    # set's, fetched from the service once); anything else there would be read instead of asking
    save_file({"hidden_states": torch.zeros(3, 4, 64), "token_ids": torch.tensor([1, 2, 3])},
              str(dest / "hidden_states" / "hs_1.safetensors"))
    save_file({"hidden_states": torch.zeros(3, 4, 64), "token_ids": torch.tensor([17, 18, 19])},
              str(dest / "hidden_states" / "hs_3.safetensors"))
    assert materialize(store, "m", dest) == 4  # the marker's samples: nothing touched
    assert (dest / "hidden_states" / "hs_1.safetensors").exists()
    (dest / "eyrie-samples.json").unlink()  # anything but the marked directory: every file checked
    assert materialize(store, "m", dest) == 4
    assert sorted(p.name for p in (dest / "hidden_states").iterdir()) == [
        "hs_0.safetensors", "hs_2.safetensors", "hs_3.safetensors"]
