"""A stage task's run (the services' side): the executor, the sharded skeleton, GPU admission."""
