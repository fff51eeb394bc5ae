"""The test-bed: what the tests and the benchmarks (``benchmarks/faults.py``, ``benchmarks/swarm.py``) share to run
real peers; no tests in here (they are in ``tests/``, which the benchmarks never import).

- ``processes``: ``PeerProcess``, a peer (or any script) as a subprocess: its log, lifecycle events, process tree.
- ``events``: ``EventLog``, the lifecycle events a peer writes with ``--events_file`` (joined, epoch done, ...).
- ``trainers``: start a trainer on the tiny preset, its epochs and losses, final parameters.
- ``aux``: the aux peer in a swarm, HTTP and /metrics, headless Chromium, a real Prometheus.
- ``netem``: emulated internet links between test hosts (network namespaces, tbf, a delay/partition proxy).
- ``faults``: the fault matrix (``scenarios``), a swarm on emulated links (``swarm``), hostile DHT records and
  averaging probes, and ``injection``: the env-driven faults that only ``fault_trainer`` acts on.
- ``fault_trainer``: the fault-injecting entry point, ``run_trainer.py`` plus the fault hooks
  (``python -m benchmarks.testbed.fault_trainer``); ``hostile_state_server`` and ``rogue_records``: hostile peers.

Imports are from the repository root (``from benchmarks.testbed.trainers import start_trainer``): pytest puts it on
``sys.path`` (tests/ is a package at the root) and peers started by ``PeerProcess`` get it on ``PYTHONPATH``.
"""
