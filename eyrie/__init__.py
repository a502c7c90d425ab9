"""eyrie: raise EAGLE-3 drafters. Shared package: config, store, queue, manifests, status, CLI."""

__version__ = "0.1.0"
