"""Fault and attack scenarios (issue 6): each scenario in ``scenarios`` returns a ``ScenarioResult`` and asserts
nothing; ``tests/test_faults_*.py`` assert the bounds and ``python -m benchmarks.faults`` prints the table.
``injection`` holds the env-driven faults a peer started through ``benchmarks/testbed/fault_trainer.py`` injects."""
