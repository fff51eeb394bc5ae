"""Fault and attack scenarios: each scenario in ``scenarios`` returns a ``ScenarioResult`` and asserts nothing;
``tests/faults/`` asserts the bounds and ``python -m benchmarks.faults`` prints the table.
``injection`` holds the env-driven faults a peer started through ``benchmarks/testbed/fault_trainer.py`` injects."""
