"""eyrie: raise EAGLE-3 drafters. Shared package, in rooms lowest first:
core, data, work, stages, tasks, runs, api, commands (docs/architecture.md)."""

__version__ = "0.1.0"
