"""What the tests (and ``benchmarks/faults.py``) share; no tests in here.

- ``processes``: ``PeerProcess``, a peer (or any script) as a subprocess: its log, lifecycle events, process tree.
- ``events``: ``EventLog``, the lifecycle events a peer writes with ``--events_file`` (joined, epoch done, ...).
- ``trainers``: start a trainer on the tiny preset, its epochs and losses, final parameters.
- ``aux``: the aux peer in a swarm, HTTP and /metrics, headless Chromium, a real Prometheus.
- ``model``: small float64 models and reference comparisons for the model tests.
- ``docker``: a real Docker engine for the opt-in end-to-end test: local base images, the wheelhouse, image
  builds, containers and their cleanup.
- ``netem``: emulated internet links between test hosts (network namespaces, tbf, a delay/partition proxy).
- ``faults``: the fault matrix (``scenarios``), a swarm on emulated links (``swarm``), hostile DHT records and
  averaging probes, and ``injection``: the env-driven faults that only ``fault_trainer`` acts on.
- ``fault_trainer``: the test entry point, ``run_trainer.py`` plus the fault hooks
  (``python -m tests.support.fault_trainer``).

Imports are from the repository root (``from tests.support.trainers import start_trainer``): pytest puts it on
``sys.path`` (tests/ is a package) and peers started by ``PeerProcess`` get it on ``PYTHONPATH``.
"""
