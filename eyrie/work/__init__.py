"""Queues and live state in Redis: keys, RQ, task kinds, leases, progress, cancel, status models."""
