"""The swarm's averaging health, from the round-health totals in the trainers' metrics records.

A trainer reports totals since it started (``peer.swarm.round_health``). The aux peer counts only what grew
between two records it read of the same peer, and only growth the time between them allows: a record may be
signed and still claim a billion rounds, a year of compute in a minute or terabytes sent. Such growth is refused
with a log line (the peer's previous record stays the baseline), and a peer's first record only sets its baseline,
so no claim about the time before the aux peer saw it is counted. A total that went down means the trainer
restarted: its new record is the new baseline. Pure bookkeeping: no DHT, no clock.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field, fields
from typing import Dict, Optional, Tuple

from peer.swarm.records import RoundHealth
from peer.swarm.round_health import TOTALS, compute_share

logger = logging.getLogger(__name__)

OUTCOME_FIELDS = {
    "ok": "rounds_ok",
    "no_group": "failed_no_group",
    "timeout": "failed_timeout",
    "partial": "failed_partial",
}
# What growth between two records the time between them allows, with a margin for clock jitter and for work
# that ended just before a record and started before the previous one
TIME_SLACK = 1.5
SLACK_SECONDS = 60.0
MAX_BYTES_PER_SECOND = 1.25e9  # 10 Gbit/s
SLACK_BYTES = 1e8
MAX_ROUNDS_PER_SECOND = 10.0
SLACK_ROUNDS = 100


@dataclass
class HealthTotals:
    """What one peer (or the swarm) did while the aux peer watched: sums of accepted growth."""

    rounds_joined: int = 0
    rounds_ok: int = 0
    failed_no_group: int = 0
    failed_timeout: int = 0
    failed_partial: int = 0
    compute_seconds: float = 0.0
    wait_seconds: float = 0.0
    matchmaking_seconds: float = 0.0
    allreduce_seconds: float = 0.0
    optimizer_seconds: float = 0.0
    bytes_sent: int = 0
    bytes_received: int = 0
    samples: int = 0  # samples the peer(s) contributed over the same intervals

    @property
    def rounds_failed(self) -> int:
        return self.failed_no_group + self.failed_timeout + self.failed_partial

    @property
    def compute_share(self) -> Optional[float]:
        return compute_share(self.compute_seconds, self.wait_seconds)

    @property
    def success_rate(self) -> Optional[float]:
        ended = self.rounds_ok + self.rounds_failed
        return self.rounds_ok / ended if ended else None

    @property
    def bytes_per_sample(self) -> Optional[float]:
        return self.bytes_sent / self.samples if self.samples else None

    def add(self, other: "HealthTotals") -> None:
        for f in fields(self):
            setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))


def growth_refusal(before: RoundHealth, after: RoundHealth, elapsed: float) -> Optional[str]:
    """Why the growth from ``before`` to ``after`` in ``elapsed`` seconds cannot be honest, or None."""
    allowed_seconds = max(elapsed, 0.0) * TIME_SLACK + SLACK_SECONDS
    training = (after.compute_seconds - before.compute_seconds) + (after.wait_seconds - before.wait_seconds)
    if training > allowed_seconds:
        return f"{training:.0f} s of training in {elapsed:.0f} s"
    for name in ("matchmaking_seconds", "allreduce_seconds", "optimizer_seconds"):
        if getattr(after, name) - getattr(before, name) > allowed_seconds:
            return f"{getattr(after, name) - getattr(before, name):.0f} {name.replace('_', ' ')} in {elapsed:.0f} s"
    allowed_bytes = max(elapsed, 0.0) * MAX_BYTES_PER_SECOND + SLACK_BYTES
    for name in ("bytes_sent", "bytes_received"):
        if getattr(after, name) - getattr(before, name) > allowed_bytes:
            return f"{getattr(after, name) - getattr(before, name):.3g} {name.replace('_', ' ')} in {elapsed:.0f} s"
    if after.rounds_joined - before.rounds_joined > max(elapsed, 0.0) * MAX_ROUNDS_PER_SECOND + SLACK_ROUNDS:
        return f"{after.rounds_joined - before.rounds_joined} rounds in {elapsed:.0f} s"
    return None


@dataclass
class Histogram:
    """A cumulative histogram (Prometheus' kind: counts only grow) of values observed at accepted intervals."""

    bounds: Tuple[float, ...]
    counts: list = field(default_factory=list)  # observations <= each bound, then the +Inf total
    total: float = 0.0

    def __post_init__(self):
        self.counts = self.counts or [0] * (len(self.bounds) + 1)

    def observe(self, value: float, weight: int = 1) -> None:
        for index, bound in enumerate(self.bounds):
            if value <= bound:
                self.counts[index] += weight
        self.counts[-1] += weight
        self.total += value * weight


def new_histograms() -> Dict[str, Histogram]:
    """compute_share: each peer's share per accepted interval; allreduce_seconds: the mean all-reduce time of the
    rounds in an interval, once per round; group_size: a peer's last group size per interval with rounds."""
    return {
        "compute_share": Histogram((0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 1.0)),
        "allreduce_seconds": Histogram((0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)),
        "group_size": Histogram((1, 2, 3, 4, 8, 16, 32, 64)),
    }


def observe_interval(histograms: Dict[str, Histogram], interval: HealthTotals, group_size: int) -> None:
    if interval.compute_share is not None:
        histograms["compute_share"].observe(interval.compute_share)
    ended = interval.rounds_ok + interval.rounds_failed
    if ended:
        histograms["allreduce_seconds"].observe(interval.allreduce_seconds / ended, weight=ended)
        histograms["group_size"].observe(group_size)


@dataclass
class PeerHealthTrack:
    """One peer's accepted growth, and the record it is measured from."""

    baseline: RoundHealth
    baseline_time: float
    baseline_samples: int
    latest: RoundHealth
    totals: HealthTotals = field(default_factory=HealthTotals)
    refused: int = 0  # records whose growth was refused

    def update(self, health: RoundHealth, time: float, samples: int, peer: str) -> Optional[HealthTotals]:
        """Returns the growth accepted from this record, or None."""
        if time <= self.baseline_time:
            return None  # the same record again, or an older one
        if samples < self.baseline_samples or any(getattr(health, n) < getattr(self.baseline, n) for n in TOTALS):
            logger.info("%s restarted (its round-health totals went down); counting from its new record", peer)
            self._rebase(health, time, samples)
            return None
        refusal = growth_refusal(self.baseline, health, time - self.baseline_time)
        if refusal is not None:
            self.refused += 1
            logger.log(
                logging.WARNING if self.refused == 1 else logging.DEBUG,
                "Ignoring the round health in a metrics record of %s: it claims %s (a broken or hostile peer)",
                peer,
                refusal,
            )
            return None
        interval = HealthTotals(
            **{name: getattr(health, name) - getattr(self.baseline, name) for name in TOTALS},
            samples=samples - self.baseline_samples,
        )
        self.totals.add(interval)
        self._rebase(health, time, samples)
        return interval

    def _rebase(self, health: RoundHealth, time: float, samples: int) -> None:
        self.baseline, self.baseline_time, self.baseline_samples, self.latest = health, time, samples, health


def track_health(
    tracks: Dict[str, PeerHealthTrack], histograms: Dict[str, Histogram], peer: str, record, time: float
) -> None:
    """Fold one metrics record's round health into ``tracks`` and ``histograms`` (a first record only sets the
    peer's baseline)."""
    if record.health is None:
        return
    track = tracks.get(peer)
    if track is None:
        tracks[peer] = PeerHealthTrack(
            baseline=record.health, baseline_time=time, baseline_samples=record.samples_total, latest=record.health
        )
        return
    interval = track.update(record.health, time, record.samples_total, peer)
    if interval is not None:
        observe_interval(histograms, interval, record.health.last_group_size)
