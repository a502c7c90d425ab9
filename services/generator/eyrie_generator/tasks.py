"""The JSON payloads of generate tasks on the queue."""

from eyrie.tasks.executor import ShardTask


class GenerateTask(ShardTask):
    """One shard of prompts to answer: {"run": ..., "shard": ...}."""
