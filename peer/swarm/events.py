"""A peer's lifecycle events as JSON lines (``--events_file``), for scripts and tests that watch peers.

Each line is one object: ``{"event": NAME, "time": <unix time>, "pid": <process id>, ...fields}``, appended and
flushed as it happens. The events and their fields:

- ``dht_started`` (both peers): ``peer_id``, ``initial_peers`` (what others pass to ``--initial_peers``), ``run_id``
- ``joined`` (trainer, training starts): ``epoch``, ``state`` ("swarm", "backup" or "local")
- ``serving`` (aux peer, HTTP server up): ``port``, ``epoch``
- ``state_loaded``: ``epoch``, ``source`` ("swarm", "backup", "checkpoint"), ``reason`` ("join", "recovery",
  "resync", "rejoin", "missed_round", "disagreement", "refresh", "resume"), ``path`` (the backup file or checkpoint
  folder, else null)
- ``epoch_done`` (trainer): ``epoch``, ``loss`` (mean, or null), ``mini_steps``, ``samples``, ``steps``, ``skipped``,
  ``now_at``, ``peers`` (the peers the progress tracker counted at the epoch's end, this one included),
  ``repaired_rounds`` (so far: rounds this trainer missed and took the result of from peers that took them)
- ``round_missed`` (trainer, ``--sync_mode local``): ``epoch``: this peer's all-reduce failed while other peers
  were online (no group formed in time, its group went on without it), so it dropped the round: at ``epoch`` its
  shared parameters are those the round started from; it then downloads the state of the peers whose round
  fingerprints differ from its own (a ``state_loaded`` with reason "disagreement"), or, finding none while
  client-mode trainers take part, the swarm's (reason "missed_round")
- ``backup_written`` (trainer) / ``checkpoint_saved`` (aux peer): ``epoch``, ``path``
- ``backup_failed`` (trainer, e.g. a full disk; retried at the next epoch): ``epoch``, ``path``, ``error``
- ``offering_checkpoint`` (aux peer, no trainer online): ``epoch``
- ``swarm_lost`` (the DHT process or its p2pd daemon died; the peer then exits with status 1): ``reason``
- ``reconnected`` (after being cut off from every peer): ``after_seconds``
- ``reachability`` (both peers, before ``dht_started``): ``client_mode``, ``reachable``, ``source`` ("forced",
  "first", "probe"), ``reason`` (peer.swarm.reachability)
- ``reachability_changed`` (the network changed and a new probe ran): ``reachable``, ``reason``
- ``reducer_missing`` / ``reducer_found`` (client-mode trainer: no reachable trainer or assisting aux is online, it
  pauses / one appeared): ``after_seconds`` (found only)
- ``assisting`` (aux peer, --assist_in_averaging default): ``clients`` (client-mode trainers online; 0: it stopped)
- ``anchoring`` (aux peer): ``on`` (true while only client-mode trainers are online and it holds the swarm's state)
- ``max_epochs_reached`` (trainer): ``epoch``
- ``exiting``: ``code``

The log says the same for humans; this file is the stable, machine-readable form. One sink per process, opened
by the entry point (``open_events``); without it ``emit`` does nothing.
"""

from __future__ import annotations

import json
import logging
import math
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, Optional

logger = logging.getLogger(__name__)


@dataclass
class EventArguments:
    """Machine-readable lifecycle events (for scripts and tests that watch the peer)."""

    events_file: Optional[str] = None
    """Append this peer's lifecycle events (joined, epoch done, state loaded, backup written, exiting...) to this
    file as JSON lines; see peer/swarm/events.py for the format."""


_lock = threading.Lock()
_sink: Optional[IO[str]] = None


def open_events(path: Optional[str]) -> None:
    """Send this process's events to ``path`` (appending); None keeps them off."""
    global _sink
    with _lock:
        if _sink is not None:
            _sink.close()
            _sink = None
        if path is not None:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            _sink = open(path, "a", encoding="utf-8")


def finite_or_none(value) -> Optional[float]:
    """``value`` as a float, or None when it is NaN/inf or not a number (JSON has no NaN/inf)."""
    return float(value) if isinstance(value, (int, float)) and math.isfinite(value) else None


def json_safe(value: Any) -> Any:
    """``value`` with every NaN/inf float, however deeply nested in dicts, lists and tuples, replaced by None."""
    if isinstance(value, float):
        return finite_or_none(value)
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    return value


def emit(event: str, **fields) -> None:
    """Write one event line (no-op without an events file); never raises into the caller."""
    if _sink is None:
        return
    record = {
        "event": event,
        "time": time.time(),
        "pid": os.getpid(),
        **json_safe(fields),
    }
    try:
        line = json.dumps(record, default=str)
        with _lock:
            if _sink is not None:
                _sink.write(line + "\n")
                _sink.flush()
    except (OSError, ValueError) as e:
        logger.warning("Could not write the %s event to the events file: %s", event, e)


def close_events() -> None:
    open_events(None)
