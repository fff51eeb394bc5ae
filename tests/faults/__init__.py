"""Faults and attacks: the fault scenarios (benchmarks/testbed/faults), hostile peers, an honest peer's failures."""
