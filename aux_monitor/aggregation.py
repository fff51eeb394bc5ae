"""Turn the trainers' per-peer metrics records into swarm-wide numbers, per global epoch.

Each refresh the aux peer reads ``<run_id>_metrics``: one record per trainer, holding that trainer's
numbers for the last epoch it finished. Records are merged into a per-epoch table, so an epoch's
numbers get completed as slower peers publish theirs, and into a per-peer table (the leaderboard).
Pure bookkeeping: no DHT, no clock (the caller passes ``now``), so it is unit-tested on plain lists.

Records are signed, but the peer that signs them may be broken or hostile: a record whose ``time`` is ahead of
``now`` by more than the clock skew, or whose epoch is ahead of the swarm's (the caller's ``max_epoch``, else the
lower median of the records' epochs), is ignored with a log line, so one peer can neither stay "alive" forever
nor move the dashboard's epoch and loss. Peers not seen for ``forget_after`` seconds leave the leaderboard (their
samples stay in the total).
"""

from __future__ import annotations

import copy
import hashlib
import logging
import math
import statistics
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Deque, Dict, Iterable, Mapping, Optional, Tuple

from aux_monitor.health import HealthTotals, Histogram, PeerHealthTrack, new_histograms, track_health
from peer.swarm.hivemind_seam import MAX_CLOCK_SKEW
from peer.swarm.records import LocalMetrics

logger = logging.getLogger(__name__)

MAX_EPOCH_LEAD = 3  # a record may be this many epochs ahead of the swarm's consensus (a median: fast honest
# peers run a few epochs ahead of it between two refreshes)
FAILING_SHARE = 0.5  # a peer whose rounds fail more often than this is marked on the dashboard
FAILING_MIN_ROUNDS = 3  # ... once it ended at least this many rounds while the aux peer watched
LAGGING_EPOCHS = 2  # an alive peer this many epochs behind the swarm's newest is marked as lagging
SUCCESS_WINDOW = 600.0  # seconds of refreshes the round success ratio is taken over


def peer_label(subkey: bytes) -> str:
    """A short stable name for a trainer: a fingerprint of the public key that signs its records."""
    return "peer-" + hashlib.sha256(subkey).hexdigest()[:12]


@dataclass(frozen=True)
class EpochStats:
    """Swarm-wide numbers of one global epoch."""

    epoch: int
    loss: float  # mean micro-step loss over the peers, weighted by their micro-steps (nan if no steps)
    peers: int  # peers that reported this epoch
    samples: int  # samples the swarm accumulated in this epoch
    samples_per_second: float  # sum of the reporting peers' throughput
    time: float  # DHT time of the latest report for this epoch


@dataclass(frozen=True)
class PeerHealth:
    """One trainer's averaging health while the aux peer watched it (``aux_monitor.health``)."""

    totals: HealthTotals
    last_group_size: int
    reachability: str
    sync_mode: str
    version: str
    mark: Optional[str]  # "failing" (most rounds fail), "lagging" (behind the swarm's epoch) or None


@dataclass(frozen=True)
class PeerStats:
    """One trainer's standing (a row of the contributor leaderboard)."""

    peer: str
    epoch: int  # last epoch it reported
    samples_total: int  # samples it contributed since we first saw it (survives its restarts)
    samples_per_second: float
    loss: Optional[float]  # its mean micro-step loss in the last epoch it reported (None if no steps)
    last_seen: float  # DHT time of its latest record
    alive: bool
    health: Optional[PeerHealth] = None  # None for trainers of LeanHive versions that do not report it


@dataclass(frozen=True)
class TimePoint:
    """One refresh of the monitor, for the "over time" charts."""

    time: float
    alive_peers: int
    samples_per_second: float
    global_epoch: Optional[int]
    rounds_ok: int = 0  # the swarm's rounds while the aux peer watched, up to this refresh
    rounds_failed: int = 0


@dataclass(frozen=True)
class SwarmSnapshot:
    """Everything the exporter and the dashboard show, as of one refresh."""

    time: float  # DHT time of the refresh
    global_epoch: Optional[int]  # newest epoch any peer reported; None before the first report
    alive_peers: int
    loss: Optional[float]  # loss of the newest epoch with micro-steps
    samples_per_second: float  # sum over alive peers of their latest throughput
    samples_total: int  # samples contributed by every peer ever seen
    peers: Tuple[PeerStats, ...]  # leaderboard, most samples first
    epochs: Tuple[EpochStats, ...]  # loss curve, oldest epoch first
    timeline: Tuple[TimePoint, ...]  # one point per refresh, oldest first
    health: HealthTotals = field(default_factory=HealthTotals)  # every trainer's, while the aux peer watched
    histograms: Dict[str, Histogram] = field(default_factory=new_histograms)  # see aux_monitor.health
    round_success_ratio: Optional[float] = None  # rounds that succeeded over the last SUCCESS_WINDOW seconds

    @classmethod
    def empty(cls, now: float = 0.0) -> "SwarmSnapshot":
        return cls(
            time=now,
            global_epoch=None,
            alive_peers=0,
            loss=None,
            samples_per_second=0.0,
            samples_total=0,
            peers=(),
            epochs=(),
            timeline=(),
        )


def summarize_epoch(epoch: int, records: Iterable[LocalMetrics]) -> EpochStats:
    """Aggregate the records of one epoch: loss is a micro-step-weighted mean (each record holds its peer's mean
    micro-step loss), the rest are sums."""
    records = list(records)
    steps = sum(r.mini_steps for r in records)
    return EpochStats(
        epoch=epoch,
        loss=sum(r.loss * r.mini_steps for r in records) / steps if steps else math.nan,
        peers=len(records),
        samples=sum(r.samples_accumulated for r in records),
        samples_per_second=sum(r.samples_per_second for r in records),
        time=max((r.time for r in records), default=0.0),
    )


@dataclass
class _PeerTrack:
    latest: LocalMetrics
    samples_before_restarts: int = 0  # samples_total reported before the peer's counter went back to 0


@dataclass
class MetricsAggregator:
    """Accumulates records across refreshes; ``update`` returns the current ``SwarmSnapshot``."""

    alive_window: float = 120.0
    """A peer counts as alive if its latest record is at most this many seconds old."""
    max_epochs: int = 100_000
    """Epochs kept for the loss curve (oldest dropped first)."""
    max_timeline: int = 2_000
    """Refreshes kept for the over-time charts (oldest dropped first)."""
    forget_after: float = 86_400.0
    """A peer not seen for this many seconds leaves the leaderboard (its samples stay in samples_total)."""
    _by_epoch: "OrderedDict[int, Dict[str, LocalMetrics]]" = field(default_factory=OrderedDict, repr=False)
    _peers: Dict[str, _PeerTrack] = field(default_factory=dict, repr=False)
    _timeline: Deque[TimePoint] = field(default_factory=deque, repr=False)
    _forgotten_samples: int = field(default=0, repr=False)
    _health: Dict[str, PeerHealthTrack] = field(default_factory=dict, repr=False)
    _forgotten_health: HealthTotals = field(default_factory=HealthTotals, repr=False)
    _histograms: Dict[str, Histogram] = field(default_factory=new_histograms, repr=False)
    _logged: set = field(default_factory=set, repr=False)

    def __post_init__(self):
        if not self.alive_window > 0:
            raise ValueError(f"alive_window must be positive seconds, got {self.alive_window}")
        if self.max_epochs < 1 or self.max_timeline < 1:
            raise ValueError("max_epochs and max_timeline must be at least 1")
        if not self.forget_after >= self.alive_window:
            raise ValueError(f"forget_after must be at least alive_window, got {self.forget_after}")

    def update(
        self, records: Mapping[bytes, LocalMetrics], now: float, swarm_epoch: Optional[int] = None
    ) -> SwarmSnapshot:
        """Merge this refresh's records. ``swarm_epoch``: the swarm's epoch as the caller knows it (the progress
        tracker's consensus); records more than MAX_EPOCH_LEAD epochs ahead of it are ignored. Without it, the
        lower median of the records' epochs is the reference."""
        records = {peer_label(subkey): record for subkey, record in records.items()}
        timely = {}
        for peer, record in records.items():
            if record.time > now + MAX_CLOCK_SKEW:
                self._ignore(peer, "future", f"its time is {record.time - now:.0f} s ahead of this peer's clock")
            else:
                timely[peer] = record
        if swarm_epoch is None and timely:
            swarm_epoch = statistics.median_low(r.epoch for r in timely.values())
        for peer, record in timely.items():
            if swarm_epoch is not None and record.epoch > swarm_epoch + MAX_EPOCH_LEAD:
                self._ignore(peer, "epoch", f"epoch {record.epoch} is ahead of the swarm's epoch {swarm_epoch}")
            else:
                self._merge(peer, record)
        self._forget(now)
        return self._snapshot(now)

    def _ignore(self, peer: str, reason: str, detail: str) -> None:
        level = logging.DEBUG if (peer, reason) in self._logged else logging.WARNING
        self._logged.add((peer, reason))
        logger.log(
            level,
            "Ignoring the metrics record of %s: %s (a broken or hostile peer; if it is yours, check its clock and "
            "that it runs the same LeanHive version and run_id)",
            peer,
            detail,
        )

    def _forget(self, now: float) -> None:
        for peer in [p for p, track in self._peers.items() if now - track.latest.time > self.forget_after]:
            track = self._peers.pop(peer)
            self._forgotten_samples += track.samples_before_restarts + track.latest.samples_total
            health = self._health.pop(peer, None)
            if health is not None:
                self._forgotten_health.add(health.totals)

    def _merge(self, peer: str, record: LocalMetrics) -> None:
        epoch_table = self._by_epoch.get(record.epoch)
        if epoch_table is None:
            epoch_table = self._by_epoch[record.epoch] = {}
            self._by_epoch = OrderedDict(sorted(self._by_epoch.items()))
            while len(self._by_epoch) > self.max_epochs:
                self._by_epoch.popitem(last=False)
        if record.epoch in self._by_epoch:
            epoch_table[peer] = record

        track = self._peers.get(peer)
        if track is None or record.time >= track.latest.time:
            track_health(self._health, self._histograms, peer, record, record.time)
        if track is None:
            self._peers[peer] = _PeerTrack(latest=record)
        elif record.time >= track.latest.time:
            if record.samples_total < track.latest.samples_total:  # the trainer restarted its counter
                track.samples_before_restarts += track.latest.samples_total
            track.latest = record

    def _peer_health(self, name: str, epoch: int, alive: bool, newest: Optional[int]) -> Optional[PeerHealth]:
        track = self._health.get(name)
        if track is None:
            return None
        totals = track.totals
        mark = None
        ended = totals.rounds_ok + totals.rounds_failed
        if ended >= FAILING_MIN_ROUNDS and totals.rounds_failed > FAILING_SHARE * ended:
            mark = "failing"
        elif alive and newest is not None and epoch <= newest - LAGGING_EPOCHS:
            mark = "lagging"
        latest = track.latest
        return PeerHealth(
            totals=totals,
            last_group_size=latest.last_group_size,
            reachability=latest.reachability,
            sync_mode=latest.sync_mode,
            version=latest.version,
            mark=mark,
        )

    def _snapshot(self, now: float) -> SwarmSnapshot:
        peers = []
        newest = max(self._by_epoch) if self._by_epoch else None
        for name, track in self._peers.items():
            r = track.latest
            alive = now - r.time <= self.alive_window
            peers.append(
                PeerStats(
                    peer=name,
                    epoch=r.epoch,
                    samples_total=track.samples_before_restarts + r.samples_total,
                    samples_per_second=r.samples_per_second if alive else 0.0,
                    loss=r.loss if r.mini_steps else None,
                    last_seen=r.time,
                    alive=alive,
                    health=self._peer_health(name, r.epoch, alive, newest),
                )
            )
        peers.sort(key=lambda p: (-p.samples_total, p.peer))
        epochs = tuple(summarize_epoch(e, table.values()) for e, table in self._by_epoch.items())
        with_steps = [e for e in epochs if not math.isnan(e.loss)]
        global_epoch = newest
        alive_peers = sum(p.alive for p in peers)
        throughput = sum(p.samples_per_second for p in peers)
        health = HealthTotals()
        health.add(self._forgotten_health)
        for track in self._health.values():
            health.add(track.totals)
        self._timeline.append(
            TimePoint(
                time=now,
                alive_peers=alive_peers,
                samples_per_second=throughput,
                global_epoch=global_epoch,
                rounds_ok=health.rounds_ok,
                rounds_failed=health.rounds_failed,
            )
        )
        while len(self._timeline) > self.max_timeline:
            self._timeline.popleft()
        return SwarmSnapshot(
            time=now,
            global_epoch=global_epoch,
            alive_peers=alive_peers,
            loss=with_steps[-1].loss if with_steps else None,
            samples_per_second=throughput,
            samples_total=self._forgotten_samples + sum(p.samples_total for p in peers),
            peers=tuple(peers),
            epochs=epochs,
            timeline=tuple(self._timeline),
            health=health,
            histograms=copy.deepcopy(self._histograms),
            round_success_ratio=recent_success_ratio(self._timeline, now),
        )


def recent_success_ratio(timeline, now: float, window: float = SUCCESS_WINDOW) -> Optional[float]:
    """The share of the swarm's averaging rounds that succeeded over the last ``window`` seconds of refreshes (None:
    none ended)."""
    recent = [point for point in timeline if point.time >= now - window]
    if not recent:
        return None
    first, last = recent[0], recent[-1]
    ok, failed = last.rounds_ok - first.rounds_ok, last.rounds_failed - first.rounds_failed
    if len(recent) == 1 or ok + failed == 0:  # one refresh: the totals so far are all there is to go by
        ok, failed = last.rounds_ok, last.rounds_failed
    return ok / (ok + failed) if ok + failed else None
