"""The JSON payloads of extract tasks on the queue."""

from eyrie.tasks.executor import ShardTask


class ExtractTask(ShardTask):
    """One generate shard's samples to extract: {"run": ..., "shard": ...}."""
