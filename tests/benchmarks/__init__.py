"""Tests of benchmarks/: what the benchmarks count, and smoke runs of their command lines."""
