"""The shared swarm layer: everything a trainer and an auxiliary peer of one run both need, and nothing of either
application (it imports no trainer and no aux module).

- ``config``, ``data``, ``validate``, ``cli_args``: the run preset's typed settings, the data pipeline, the shared
  argument checks and the typed-argument parser;
- ``network``, ``identity``, ``auth``, ``keys``, ``records``: joining the DHT, signing keys, the allowlist, every
  DHT key of a run, the record schemas and validators, and one reader for hivemind's records;
- ``optimizer``, ``lamb``, ``robust``, ``joining``: the collaborative optimizer (8-bit LAMB, compression, robust
  averaging) and the swarm protocol around it (state download, re-sync, final barrier);
- ``watchdog``, ``process_guard``, ``lifecycle``, ``events``: staying in the swarm after network faults, no
  orphaned helper processes, the one start/run/shutdown helper, machine-readable lifecycle events;
- ``hivemind_seam``: every subclass, override and private use of hivemind, in one small package.
"""
