"""The control API (FastAPI): runs, status, cancel/retry, /metrics and the dashboard."""
