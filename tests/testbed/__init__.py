"""Tests of the test-bed package benchmarks/testbed/ (processes, events, the emulated-link harness)."""
