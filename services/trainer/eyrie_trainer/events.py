"""speculators' TensorBoard event files (train.loggers: [tensorboard]) from the trainer's log
directory to the run's store prefix, train/tensorboard/ (one subdirectory per attempt, as
speculators names them), so that TensorBoard can show them while the run trains and after:
`tensorboard --logdir <store>/<prefix>/runs/RUN/train/tensorboard` (README)."""

from __future__ import annotations

from pathlib import Path


class EventUploads:
    def __init__(self, store, layout, logs: Path):
        self.store, self.layout, self.logs, self.sent = store, layout, logs, {}

    def push(self) -> int:
        """Every event file that grew since the last push, to the store. Returns how many."""
        pushed = 0
        for path in sorted(self.logs.rglob("events.out.tfevents.*")) if self.logs.exists() else []:
            size = path.stat().st_size
            if self.sent.get(path) != size:
                self.store.put_file(self.layout.tensorboard_file(path.relative_to(self.logs).as_posix()), path)
                self.sent[path], pushed = size, pushed + 1
        return pushed
