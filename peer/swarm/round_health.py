"""One trainer's averaging health: rounds joined and how each ended, where its time went, bytes on the wire.

The counters are totals since the peer started (a missed report loses nothing; readers take differences). They
live in shared memory, created before hivemind forks its averager processes, so that what the averagers measure
(all-reduce times, bytes) and what the training loop measures (compute, blocked wait, the optimizer's
update, round outcomes) add up in one place. ``snapshot`` turns them into the ``RoundHealth`` that goes into the
peer's signed metrics record, and ``HealthLine`` into the short line a volunteer sees in the log.
"""

from __future__ import annotations

import importlib.metadata
import multiprocessing
from dataclasses import dataclass, field
from typing import Callable, Optional

from peer.swarm.hivemind_seam import observe_phases, observe_rounds, observe_traffic
from peer.swarm.records import REACHABILITY, SYNC_MODES, RoundHealth

OUTCOMES = ("ok", "no_group", "timeout", "partial")
# the RoundHealth fields that are totals (readers take their differences), and the failures among them
FAILURES = ("failed_no_group", "failed_timeout", "failed_partial")
SECONDS = ("compute_seconds", "wait_seconds", "matchmaking_seconds", "allreduce_seconds", "optimizer_seconds")
TOTALS = ("rounds_joined", "rounds_ok", *FAILURES, *SECONDS, "bytes_sent", "bytes_received")
PHASES = ("compute", "wait", "matchmaking", "allreduce", "optimizer")
# slots of the shared array: doubles hold every integer count exactly up to 2**53
_SLOTS = {
    name: index
    for index, name in enumerate(
        ("joined", *OUTCOMES, *PHASES, "sent", "received", "group", "grad_allreduce", "grad_mark")
    )
}


def leanhive_version() -> str:
    try:
        return importlib.metadata.version("leanhive")
    except importlib.metadata.PackageNotFoundError:  # a checkout that was never installed
        return "unknown"


@dataclass
class RoundHealthCounter:
    """Totals in shared memory: every method is cheap and safe from the training loop, hivemind's threads and the
    averager processes forked after the counter was created."""

    sync_mode: str
    reachability: str = "public"
    version: str = field(default_factory=leanhive_version)
    _values: "multiprocessing.Array" = field(
        default_factory=lambda: multiprocessing.get_context("fork").Array("d", len(_SLOTS)), repr=False
    )

    def __post_init__(self):
        if self.sync_mode not in SYNC_MODES:
            raise ValueError(f"sync_mode must be one of {SYNC_MODES}, got {self.sync_mode!r}")
        if self.reachability not in REACHABILITY:
            raise ValueError(f"reachability must be one of {REACHABILITY}, got {self.reachability!r}")

    def _add(self, slot: str, amount: float) -> None:
        with self._values.get_lock():
            self._values[_SLOTS[slot]] += amount

    def round_joined(self) -> None:
        self._add("joined", 1)

    def round_ended(self, outcome: str, group_size: int = 0) -> None:
        """``outcome``: ok, no_group (matchmaking found nobody), timeout or partial (broke off after the group
        formed, before this peer had every part)."""
        if outcome not in OUTCOMES:
            raise ValueError(f"outcome must be one of {OUTCOMES}, got {outcome!r}")
        with self._values.get_lock():
            self._values[_SLOTS[outcome]] += 1
            self._values[_SLOTS["group"]] = max(0, int(group_size))

    def seconds(self, phase: str) -> float:
        return self._values[_SLOTS[phase]]

    def attach(self) -> Callable[[], None]:
        """Count what hivemind's averaging reports (``observe_phases`` / ``observe_rounds``): call before building
        the optimizer, so that its averager processes report too. Returns the function that detaches it."""
        detach = [observe_phases(self._on_phase), observe_rounds(self._on_round), observe_traffic(self._on_traffic)]
        return lambda: [undo() for undo in detach] and None

    def _on_phase(self, phase: str, start: float, end: float) -> None:
        seconds = max(0.0, end - start)
        with self._values.get_lock():
            values = self._values
            if phase in ("grad_allreduce", "state_allreduce"):
                values[_SLOTS["allreduce"]] += seconds
                if phase == "grad_allreduce":
                    values[_SLOTS["grad_allreduce"]] += seconds
            elif phase == "grad_wait":
                # the training loop blocked on the round; what its all-reduce did not take went to matchmaking
                allreduce = values[_SLOTS["grad_allreduce"]] - values[_SLOTS["grad_mark"]]
                values[_SLOTS["grad_mark"]] = values[_SLOTS["grad_allreduce"]]
                values[_SLOTS["wait"]] += seconds
                values[_SLOTS["matchmaking"]] += max(0.0, seconds - allreduce)

    def _on_traffic(self, sent: int, received: int) -> None:
        self.add_bytes(sent=sent, received=received)

    def _on_round(self, event: str, group_size: int) -> None:
        # a round that broke off after its group formed ended before this peer had every part: "partial"
        self.round_joined()
        self.round_ended("partial" if event == "failed" else event, group_size)

    def add_time(self, phase: str, seconds: float) -> None:
        if phase not in PHASES:
            raise ValueError(f"phase must be one of {PHASES}, got {phase!r}")
        self._add(phase, max(0.0, float(seconds)))

    def add_bytes(self, sent: int = 0, received: int = 0) -> None:
        with self._values.get_lock():
            self._values[_SLOTS["sent"]] += max(0, int(sent))
            self._values[_SLOTS["received"]] += max(0, int(received))

    def snapshot(self) -> RoundHealth:
        with self._values.get_lock():
            values = {name: self._values[index] for name, index in _SLOTS.items()}
        count = {name: int(values[name]) for name in ("joined", *OUTCOMES, "sent", "received", "group")}
        return RoundHealth(
            rounds_joined=max(count["joined"], sum(count[outcome] for outcome in OUTCOMES)),
            rounds_ok=count["ok"],
            failed_no_group=count["no_group"],
            failed_timeout=count["timeout"],
            failed_partial=count["partial"],
            last_group_size=count["group"],
            compute_seconds=values["compute"],
            wait_seconds=values["wait"],
            matchmaking_seconds=values["matchmaking"],
            allreduce_seconds=values["allreduce"],
            optimizer_seconds=values["optimizer"],
            bytes_sent=count["sent"],
            bytes_received=count["received"],
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
        before = self.previous or health.copy(update={name: 0 for name in TOTALS})
        self.previous = health
        ok = health.rounds_ok - before.rounds_ok
        failed = sum(getattr(health, name) - getattr(before, name) for name in FAILURES)
        share = compute_share(
            health.compute_seconds - before.compute_seconds, health.wait_seconds - before.wait_seconds
        )
        return (
            f"swarm health: rounds {ok} ok / {failed} failed, compute share "
            + ("n/a" if share is None else f"{share:.2f}")
            + f", sent {(health.bytes_sent - before.bytes_sent) / 1e6:.1f} MB, "
            f"received {(health.bytes_received - before.bytes_received) / 1e6:.1f} MB"
        )
