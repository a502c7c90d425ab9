"""eyrie: raise EAGLE-3 drafters. Shared package, in rooms lowest first:
core, benchmarks, data, work, stages, tasks, runs, api, commands (docs/architecture.md)."""

__version__ = "0.1.0"
