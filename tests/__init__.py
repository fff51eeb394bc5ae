"""LeanHive's test suite (a package, so tests and benchmarks import ``tests.support`` from the repository root)."""
