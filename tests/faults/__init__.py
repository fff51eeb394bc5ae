"""Fault and attack scenarios (issue 6): each scenario in ``scenarios`` returns a ``ScenarioResult`` and asserts
nothing; ``tests/test_faults_*.py`` assert the bounds and ``benchmarks/faults.py`` prints the table."""
