"""What the trainer actually read, kept in the store (train/samples.json) so that it outlives the
task: the training samples trained on (read at least once by speculators' loop), the ones it left
out with its reason (states missing, or holding other token ids) and never read since, and how
many it cut at the pack length. A retried or resumed task continues the same record; the export
copies its summary into the run manifest's drafter record, and `eyrie audit` counts from it."""

from __future__ import annotations

import hashlib

import orjson


class TrainedSamples:
    def __init__(self, store, key: str, sample_ids: list[str], record: dict):
        self.store, self.key, self.sample_ids, self.record = store, key, sample_ids, record

    @classmethod
    def start(cls, store, layout, train_samples: list[dict], heldout: int, seq_len: int) -> "TrainedSamples":
        """The run's record, continued where it is for these very training rows, else begun."""
        ids = [s["sample_id"] for s in train_samples]
        rows_of = hashlib.sha256(orjson.dumps(ids)).hexdigest()
        record = store.get_json(layout.train_samples) if store.exists(layout.train_samples) else {}
        if record.get("rows_of") != rows_of:
            record = {"rows_of": rows_of, "read_rows": [], "dropped": {}}
        record.update(train_samples=len(ids), heldout_samples=heldout, truncated_to=seq_len,
                      truncated=sum(1 for s in train_samples if s["seq_len"] > seq_len))
        return cls(store, layout.train_samples, ids, record)

    def update(self, read: set[int], dropped_rows: dict[int, str]) -> None:
        """This attempt's rows read and left out (eyrie_trainer.engine's hooks.state), merged in."""
        rows = set(self.record["read_rows"]) | {int(r) for r in read}
        row_of = {sid: row for row, sid in enumerate(self.sample_ids)}
        dropped = {sid: why for sid, why in self.record["dropped"].items() if row_of.get(sid) not in rows}
        dropped.update({self.sample_ids[r]: why for r, why in dropped_rows.items() if r not in rows})
        self.record.update(read_rows=sorted(rows), dropped=dropped)

    def save(self) -> None:
        self.store.put_json(self.key, self.record)

    def summary(self) -> dict:
        r = self.record
        return {"train_samples": r["train_samples"], "trained": len(r["read_rows"]), "dropped": r["dropped"],
                "heldout_samples": r["heldout_samples"], "truncated": r["truncated"], "truncated_to": r["truncated_to"]}
