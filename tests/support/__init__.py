"""Helpers for tests and benchmarks that are not part of the package (oracles, generators)."""
