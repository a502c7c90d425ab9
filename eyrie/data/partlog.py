"""A task's results while it runs: appended to the store in parts, read back after a crash.

Puts are atomic, so a part is either whole or absent. Part numbers are never reused."""

from __future__ import annotations

import orjson

from eyrie.data.store import Store


class PartLog:
    def __init__(self, store: Store, prefix: str):
        self.store, self.prefix = store, prefix.rstrip("/") + "/"
        self.next_part = 0

    def load(self) -> list[dict]:
        """Every entry written so far, in part order."""
        entries = []
        for key in self.store.list(self.prefix):
            entries += [orjson.loads(line) for line in self.store.get_bytes(key).splitlines()]
            number = int(key.rsplit("part-", 1)[1].split(".")[0])
            self.next_part = max(self.next_part, number + 1)
        return entries

    def take_key(self) -> str:
        """The key of the next part (reserved now, so parts written concurrently never collide)."""
        key = f"{self.prefix}part-{self.next_part:05d}.jsonl"
        self.next_part += 1
        return key

    @staticmethod
    def encode(entries: list[dict]) -> bytes:
        return b"".join(orjson.dumps(e) + b"\n" for e in entries)

    def clear(self) -> None:
        for key in self.store.list(self.prefix):
            self.store.delete(key)
