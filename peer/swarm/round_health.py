"""One trainer's averaging health: rounds joined and how each ended, where its time went, bytes on the wire.

The counters are totals since the peer started (a missed report loses nothing; readers take differences). The
averager (hivemind's background thread) reports rounds, matchmaking and all-reduce times and bytes; the training
loop reports compute, blocked wait and the optimizer's update. ``snapshot`` turns them into the ``RoundHealth``
that goes into the peer's signed metrics record, and ``HealthLine`` into the short line a volunteer sees in the log.
"""

from __future__ import annotations

import importlib.metadata
import threading
from dataclasses import dataclass, field
from typing import Dict, Optional

from peer.swarm.records import REACHABILITY, SYNC_MODES, RoundHealth

OUTCOMES = ("ok", "no_group", "timeout", "partial")
PHASES = ("compute", "wait", "matchmaking", "allreduce", "optimizer")


def leanhive_version() -> str:
    try:
        return importlib.metadata.version("leanhive")
    except importlib.metadata.PackageNotFoundError:  # a checkout that was never installed
        return "unknown"


@dataclass
class RoundHealthCounter:
    """Thread-safe totals; every method is cheap enough for the training loop and the averager's thread."""

    sync_mode: str
    reachability: str = "public"
    version: str = field(default_factory=leanhive_version)
    _rounds: Dict[str, int] = field(default_factory=lambda: dict.fromkeys(OUTCOMES, 0), repr=False)
    _joined: int = field(default=0, repr=False)
    _seconds: Dict[str, float] = field(default_factory=lambda: dict.fromkeys(PHASES, 0.0), repr=False)
    _sent: int = field(default=0, repr=False)
    _received: int = field(default=0, repr=False)
    _last_group_size: int = field(default=0, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def __post_init__(self):
        if self.sync_mode not in SYNC_MODES:
            raise ValueError(f"sync_mode must be one of {SYNC_MODES}, got {self.sync_mode!r}")
        if self.reachability not in REACHABILITY:
            raise ValueError(f"reachability must be one of {REACHABILITY}, got {self.reachability!r}")

    def round_joined(self) -> None:
        with self._lock:
            self._joined += 1

    def round_ended(self, outcome: str, group_size: int = 0) -> None:
        """``outcome``: ok, no_group (matchmaking found nobody), timeout or partial (some parts never arrived)."""
        if outcome not in OUTCOMES:
            raise ValueError(f"outcome must be one of {OUTCOMES}, got {outcome!r}")
        with self._lock:
            self._rounds[outcome] += 1
            self._last_group_size = max(0, int(group_size))

    def add_time(self, phase: str, seconds: float) -> None:
        if phase not in PHASES:
            raise ValueError(f"phase must be one of {PHASES}, got {phase!r}")
        with self._lock:
            self._seconds[phase] += max(0.0, float(seconds))

    def add_bytes(self, sent: int = 0, received: int = 0) -> None:
        with self._lock:
            self._sent += max(0, int(sent))
            self._received += max(0, int(received))

    def snapshot(self) -> RoundHealth:
        with self._lock:
            return RoundHealth(
                rounds_joined=max(self._joined, sum(self._rounds.values())),
                rounds_ok=self._rounds["ok"],
                failed_no_group=self._rounds["no_group"],
                failed_timeout=self._rounds["timeout"],
                failed_partial=self._rounds["partial"],
                last_group_size=self._last_group_size,
                compute_seconds=self._seconds["compute"],
                wait_seconds=self._seconds["wait"],
                matchmaking_seconds=self._seconds["matchmaking"],
                allreduce_seconds=self._seconds["allreduce"],
                optimizer_seconds=self._seconds["optimizer"],
                bytes_sent=self._sent,
                bytes_received=self._received,
                reachability=self.reachability,
                sync_mode=self.sync_mode,
                version=self.version,
            )


def compute_share(compute_seconds: float, wait_seconds: float) -> Optional[float]:
    """The fraction of the training loop's time spent computing rather than waiting on the swarm."""
    total = compute_seconds + wait_seconds
    return compute_seconds / total if total > 0 else None


@dataclass
class HealthLine:
    """The log line a trainer writes every few epochs: what happened since the previous line."""

    previous: Optional[RoundHealth] = None

    def format(self, health: RoundHealth) -> str:
        before = self.previous or health.copy(update={name: 0 for name in _COUNTED})
        self.previous = health
        ok = health.rounds_ok - before.rounds_ok
        failed = sum(getattr(health, name) - getattr(before, name) for name in _FAILURES)
        share = compute_share(
            health.compute_seconds - before.compute_seconds, health.wait_seconds - before.wait_seconds
        )
        return (
            f"swarm health: rounds {ok} ok / {failed} failed, compute share "
            + ("n/a" if share is None else f"{share:.2f}")
            + f", sent {(health.bytes_sent - before.bytes_sent) / 1e6:.1f} MB, "
            f"received {(health.bytes_received - before.bytes_received) / 1e6:.1f} MB"
        )


_FAILURES = ("failed_no_group", "failed_timeout", "failed_partial")
_COUNTED = (
    "rounds_joined",
    "rounds_ok",
    *_FAILURES,
    "compute_seconds",
    "wait_seconds",
    "matchmaking_seconds",
    "allreduce_seconds",
    "optimizer_seconds",
    "bytes_sent",
    "bytes_received",
)
