"""The suite: tests/unit, tests/integration and tests/e2e by tier (tests/support/tiers.py), what they share in
tests/support. Packages, so a module is imported as tests.<tier>.<module> wherever it is collected from."""
