"""The store and what it records: the artifact store, manifests, a task's parts, datasets, charts."""
