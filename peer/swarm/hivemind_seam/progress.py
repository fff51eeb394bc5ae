"""hivemind's progress tracker, with bounds on what one peer's record may claim and a clean exit of its event loop.
See the package docstring."""

from __future__ import annotations

import asyncio
import logging
import math
import statistics
import threading
import time
from typing import Dict, FrozenSet, List, Optional, Tuple

from hivemind.optim.progress_tracker import GlobalTrainingProgress, LocalTrainingProgress, ProgressTracker
from hivemind.utils import get_dht_time

from peer.swarm.hivemind_seam.dht import MAX_CLOCK_SKEW

logger = logging.getLogger(__name__)

MAX_EPOCH_LEAD = 1  # a peer may be this many epochs ahead of the consensus (it just finished the epoch)
THROUGHPUT_FACTOR = 1.0  # another peer's throughput counts at most as the swarm's median throughput...
MAX_SAMPLES_PER_SECOND = 1e6  # ...and never more than this
MIN_MEASURED_RATE = 1e-6  # below this, a peer has not measured its own throughput yet (hivemind starts at eps)
IMPLAUSIBLE_FACTOR = 10.0  # a throughput this many times the median is logged as implausible
# samples another peer is assumed to have added since its last report, at most (honest peers report every step, in
# local mode every REPORT_SHARE of the target)
MAX_EXTRAPOLATED_SHARE = 0.125
MAX_PEER_SHARE = 0.5  # of target_batch_size, what one other peer's record may account for
REFUTED_SECONDS = 60.0  # how long a peer whose epoch claim a state download refuted has its lead ignored...
MAX_REFUTED_SECONDS = 3600.0  # ...doubling with each refutation, up to this
DOWNLOAD_EPOCH_LEAD = 4
"""A downloaded state may be at most this many epochs beyond the swarm's consensus (the larger of the local and the
progress tracker's epoch): a label of 10**12 would hang the scheduler loop (it replays every epoch) or end the run
at max_epochs. A trainer further than this beyond the consensus is apart from the swarm (``apart_from_swarm``): no
other peer would ever take its state."""
LIVE_RECORD_SECONDS = 20.0
"""A trainer's record renewed within this many seconds is a live trainer's (it reports after every local step; in
local mode after every ``REPORT_SHARE`` of a round): only those put a peer apart from the swarm."""
REPORT_SHARE = 1 / 16
"""--sync_mode local: a trainer publishes its progress record once it has added this share of the round's target
since its last record, not after every local step (``report_share``). Below MAX_EXTRAPOLATED_SHARE, so the others'
extrapolation still covers the samples between two records."""


class _ReportGate(threading.Event):
    """hivemind's ``should_report_progress`` event (it wakes the thread that stores this peer's record), which
    ``report_local_progress`` may hold shut for one local step: cleared after the fact, the thread had often woken
    already."""

    def __init__(self):
        super().__init__()
        self.holding = False

    def set(self) -> None:
        if not self.holding:
            super().set()


class LeanHiveProgressTracker(ProgressTracker):
    """ProgressTracker that bounds what a (signed, schema-valid) record may claim, and whose thread cancels the
    helper tasks hivemind leaves pending when it shuts down.

    hivemind takes the swarm's epoch as the maximum of all records and its throughput as their sum, so one record
    with ``epoch=10**12`` makes every peer re-download the state before every step, and one with
    ``samples_per_second=1e300`` ends every epoch after one local step. Here, before hivemind's own arithmetic:

    - a record whose ``time`` is ahead of our clock by more than ``MAX_CLOCK_SKEW`` or older than its lifetime
      (``metadata_expiration`` + skew), or whose throughput is not finite, is ignored;
    - the epoch consensus (``consensus_epoch``) is the (lower) median of the non-client peers' epochs (of those that
      report a throughput, if any do: an anchoring aux peer's record counts only without a serving trainer), this
      peer's own included once it is in sync with the swarm (``mark_in_sync`` after joining, or a fetch that found
      another peer's record within ``MAX_EPOCH_LEAD`` of its own; a joiner that has not loaded the state yet does not
      vote). It bounds the epoch a downloaded state may carry. A record more than ``MAX_EPOCH_LEAD`` epochs ahead of
      it is a *claim*: an honest peer of a fast swarm is often a few epochs ahead of a slower one, so it is followed
      (the slower peer downloads the state, as in hivemind) until a download refutes it: a state download that ends
      more than ``MAX_EPOCH_LEAD`` below the claim (``refute_claims_above``) makes this peer ignore that peer's
      lead for ``REFUTED_SECONDS`` (doubling with each refutation). So a record with ``epoch=10**12`` costs one
      download, not one per step;
    - another peer's throughput counts at most as the median throughput or this peer's own, if higher
      (``THROUGHPUT_FACTOR``); the samples it is assumed to have added since its last report at most
      ``MAX_EXTRAPOLATED_SHARE`` of the target, and its samples at most ``MAX_PEER_SHARE`` of the target: a peer
      that did more ends the epoch itself and the others follow its next-epoch record, but one record cannot end
      an epoch for everyone. A client's record one epoch ahead counts as that share (hivemind's epoch is the
      serving peers', so without it two clients an epoch apart never end an epoch);
    - after a state download, the records of serving peers more than ``MAX_EPOCH_LEAD`` beyond its epoch count
      only once their peers renew them (``refute_claims_above``): a crashed peer's record outlives it by a minute;
    - a client's or an aux's fetch that finds peers come or gone fetches again within ``default_refresh_period``
      (a starting peer's ETA, from a step's worth of throughput, can exceed ``max_refresh_period``, and only the
      others' records end their epochs).

    Given ``report_share`` (``--sync_mode local``), this peer stores its own record only once it has added that share
    of the target since its last one, at a new epoch or a reset, and at every step once the epoch's estimated end is
    less than two shares or ``report_every_step_within`` seconds away. hivemind stores a signed record at every local
    step: on home_asym links that was about half of sparse local mode's bytes (per trained sample 0.9 -> 0.5 KB at
    H = 32, 0.6 -> 0.3 KB at H = 64, docs/benchmarks.md).

    Each ignored record is logged once per peer and reason (a warning), then at DEBUG.
    """

    consensus_epoch: Optional[int] = None
    """The lower median of the peers' epochs at the last fetch (None: no peer reports progress)."""
    votes_own_epoch = True
    """False for an auxiliary peer: it observes the trainers, its own (downloaded, often older) epoch is no vote."""
    rounds_follow_trainers_epoch = False
    """True for an auxiliary peer in sync mode: behind the trainers' epoch, it is ready when their epoch ends
    (``_swarm_epoch_ending``), not at once."""

    def __init__(self, *args, report_share: Optional[float] = None, report_every_step_within: float = 0.0, **kwargs):
        if report_share is not None and not 0 < report_share <= MAX_EXTRAPOLATED_SHARE:
            raise ValueError(f"report_share must be in (0, {MAX_EXTRAPOLATED_SHARE}], got {report_share}")
        self.report_share = report_share
        self.report_every_step_within = report_every_step_within
        self._published = (-1, 0)  # (epoch, samples) of the last local progress let through to the DHT
        self.records_held = 0  # local steps whose record waited for the next share (report_share)
        # set before hivemind's __init__, which starts the thread that parses records
        self._in_sync = False  # this peer's epoch reached the swarm's: from then on it votes
        self._refuted: Dict[bytes, float] = {}  # subkey -> monotonic time until which its lead is ignored
        self._strikes: Dict[bytes, int] = {}  # subkey -> number of refuted claims
        self._claims: Dict[bytes, int] = {}  # subkey -> epoch it claims beyond the consensus, at the last fetch
        self._last_metadata: Optional[dict] = None
        self._records: Dict[bytes, LocalTrainingProgress] = {}  # the plausible records at the last fetch
        self._unserved: Dict[bytes, float] = {}  # subkey -> time of its record that no served state backed
        self._seen_peers: frozenset = frozenset()  # the records' subkeys at the last fetch
        self._logged_outliers: set = set()
        super().__init__(*args, **kwargs)

    def run(self):
        # hivemind's progress fetcher returns on shutdown without cancelling its shutdown-checker and DHT-getter
        # tasks; they would be destroyed with the loop ("Task was destroyed but it is pending!" at exit)
        loop = asyncio.new_event_loop()
        asyncio.set_event_loop(loop)
        loop.run_until_complete(asyncio.gather(self._progress_reporter(), self._progress_fetcher()))
        self.shutdown_complete.set()
        leftovers = asyncio.all_tasks(loop)
        for task in leftovers:
            task.cancel()
        loop.run_until_complete(asyncio.gather(*leftovers, return_exceptions=True))
        loop.close()

    @property
    def should_report_progress(self) -> _ReportGate:
        return self._report_gate

    @should_report_progress.setter
    def should_report_progress(self, _event: threading.Event) -> None:
        self._report_gate = _ReportGate()  # hivemind's __init__ assigns a plain Event here, before its thread starts

    def report_local_progress(self, local_epoch: int, samples_accumulated: int, update_global_samples: bool = True):
        hold = self._may_hold_record(local_epoch, samples_accumulated)
        self._report_gate.holding = hold
        try:
            super().report_local_progress(local_epoch, samples_accumulated, update_global_samples)
        finally:
            self._report_gate.holding = False
        if hold:
            self.records_held += 1
        else:
            self._published = (local_epoch, samples_accumulated)

    def _may_hold_record(self, local_epoch: int, samples_accumulated: int) -> bool:
        if self.report_share is None:
            return False
        epoch, samples = self._published
        if local_epoch != epoch or samples_accumulated <= samples:  # a new epoch, or a reset
            return False
        share = self.report_share * self.target_batch_size
        if samples_accumulated - samples >= share:
            return False
        # near the epoch's end every step counts: the others schedule their matchmaking and end the epoch on these
        # records (with a record per share only, a quick local-mode swarm waited 0.5 s more per round to match)
        rate = self.performance_ema.samples_per_second * max(1, self.global_progress.num_peers)
        near_end = max(self.report_every_step_within, 2 * share / max(rate, MIN_MEASURED_RATE))
        return self.global_progress.eta_next_epoch - get_dht_time() > near_end

    @property
    def ready_to_update_epoch(self) -> bool:
        # a client-mode peer alone (no serving trainer reports progress) would end epochs nobody can ever join: no
        # peer can download its state. A client joiner could otherwise train whole local-mode rounds before the only
        # serving trainer starts (hivemind publishes a trainer's progress only after its first step); that trainer
        # would begin from the older state, and the two would never agree again
        if self.client_mode and self.consensus_epoch is None:
            return False
        if self.rounds_follow_trainers_epoch and self.global_epoch > self.local_progress.epoch:
            return self._swarm_epoch_ending()
        return super().ready_to_update_epoch

    def _swarm_epoch_ending(self) -> bool:
        """An aux peer whose epoch is behind the trainers' is ready when their current epoch ends, not at once.

        An aux's epoch moves by one per round it takes, and its round's label lags the trainers' by one once it began
        with the swarm a round late (its first round was their second): it takes their round k + 1 as its round k
        (the result is held under their label, round_result.py). hivemind's tracker calls a peer behind the swarm
        ready at once, so the aux began each round as soon as its last one ended, about an epoch early, and its
        matchmaking window (averaging_timeout) often ran out just as the trainers came: it assembled with the first
        of them, and the home volunteers behind NAT, a moment later, found no leader (home testbed b: 4 of 53 rounds
        each). Its round is the swarm's current one: due when the trainers' samples reach the target or their
        epoch's estimated end passes, the progress fetched after the aux's last round (the progress it held then
        described the epoch that round ended). Each serving trainer's samples count in full there
        (``_bounded_progress``): a lone trainer ends its epoch on its own samples."""
        if not self.fetched_global_progress_this_epoch.is_set():
            return False
        progress = self.global_progress
        return progress.samples_accumulated >= self.target_batch_size or get_dht_time() >= progress.eta_next_epoch

    # ------------------------------------------------------------------------------------- bounded records

    def mark_in_sync(self) -> None:
        """This peer now holds the swarm's state (it started a new collaboration, loaded the swarm's state or
        resumed a backup the others will load): from now on its own epoch votes in the consensus."""
        self._in_sync = True

    def _parse_swarm_progress_data(self, metadata) -> GlobalTrainingProgress:
        if not isinstance(metadata, dict) or not metadata:
            return super()._parse_swarm_progress_data(metadata)
        now = get_dht_time()
        records = self._plausible_records(metadata, now)
        progress = self._bounded_progress(records, now)
        # in sync only against other peers' records: a peer that found nobody at its first fetch (still waiting
        # for min_peers, say) would otherwise vote its fresh epoch 0 and, in a pair, refuse the other's state
        others = any(key != self._local_public_key and not r.client_mode for key, r in records.items())
        if others and self.local_progress.epoch >= progress.epoch - MAX_EPOCH_LEAD:
            self._in_sync = True  # from now on this peer's own epoch votes in the consensus
        return progress

    def _plausible_records(self, metadata: dict, now: float) -> Dict[bytes, LocalTrainingProgress]:
        own_key = self._local_public_key
        parsed: Dict[bytes, LocalTrainingProgress] = {}
        for subkey, entry in metadata.items():
            if entry.value is None:
                continue
            try:
                record = LocalTrainingProgress.parse_obj(entry.value)
            except Exception as e:  # noqa: BLE001 - a malformed record is one peer's problem, not ours
                self._ignore(subkey, "malformed", f"does not parse ({e})")
                continue
            if record.time > now + MAX_CLOCK_SKEW:
                self._ignore(subkey, "future", f"its time is {record.time - now:.0f} s ahead of this peer's clock")
            elif record.time < now - self.metadata_expiration - MAX_CLOCK_SKEW:
                self._ignore(subkey, "stale", f"it was written {now - record.time:.0f} s ago but has not expired")
            elif not math.isfinite(record.samples_per_second):
                self._ignore(subkey, "throughput", f"throughput {record.samples_per_second} is not finite")
            elif self._unserved.get(subkey) != record.time:
                parsed[subkey] = record
        # a record counts again once its peer renews it (alive after all: it was busy, not gone)
        self._unserved = {key: t for key, t in self._unserved.items() if key in metadata and key not in parsed}
        self._records = dict(parsed)

        serving = [r for key, r in parsed.items() if not r.client_mode and key != own_key]
        # a state holder's record (an anchoring aux peer: no throughput) votes only while no serving trainer
        # reports: it lives up to a minute after a trainer came, and in a pair the lower vote is the consensus, so
        # its older epoch held a catching-up client's download bound below the trainer's state
        trainers = [r for r in serving if r.samples_per_second > 0]
        votes = [r.epoch for r in (trainers or serving)]
        if self._in_sync and not self.client_mode and self.votes_own_epoch:
            votes.append(self.local_progress.epoch)
        consensus = statistics.median_low(votes) if votes else None
        self.consensus_epoch = consensus
        claims = {}
        if consensus is not None:
            for key in [key for key, r in parsed.items() if r.epoch > consensus + MAX_EPOCH_LEAD]:
                if self._refuted.get(key, -math.inf) > time.monotonic():
                    self._ignore(
                        key,
                        "epoch",
                        f"its epoch {parsed[key].epoch} is more than {MAX_EPOCH_LEAD} ahead of the swarm's "
                        f"consensus {consensus}, and a state download refuted its last claim",
                    )
                    del parsed[key]
                else:
                    claims[key] = parsed[key].epoch
        self._claims = claims
        self._last_metadata = metadata
        return parsed

    def apart_from_swarm(self) -> Optional[Tuple[int, FrozenSet[bytes]]]:
        """(the consensus epoch, the peer IDs of the serving trainers at it) when this trainer is more than
        ``DOWNLOAD_EPOCH_LEAD`` epochs beyond the swarm's consensus, else None; at the last fetch, no DHT access.

        Trainers that started at the same moment each ran alone until they found one another's records: on a busy
        machine one of three reached epoch 16 while the other two were at 1, and the two refused its state as
        "beyond the swarm's consensus" (the lower median, 1) for good, so the swarm stayed split (CI: the health test
        ran to its timeout). No peer of the consensus ever takes such a state, so the one apart takes theirs: every
        peer reads the same median, and the swarm converges on it.

        Only a strict majority of the votes, this peer's own included, puts it apart (the upper median is that far
        behind): a hostile record is one vote, so beside a lone honest trainer (a pair, where the lower median is
        the hostile vote) it cannot make that trainer take its state. Two honest peers far apart stay so; with a
        third, they meet. Only live trainers vote here (a record renewed within ``LIVE_RECORD_SECONDS``): a crashed
        trainer's record outlives it by a minute, and new trainers that continued from an aux checkpoint took
        their dead predecessors for the swarm (fault scenario e). What a donor serves is checked like any state."""
        if not self.votes_own_epoch:
            return None
        own = self.local_progress.epoch
        live = [record for record in self._live_other_trainers() if not record.client_mode]
        votes = [record.epoch for record in live] + [own]
        if not live or statistics.median_high(votes) + DOWNLOAD_EPOCH_LEAD >= own:
            return None
        consensus = statistics.median_low(votes)
        donors = frozenset(record.peer_id for record in live if abs(record.epoch - consensus) <= MAX_EPOCH_LEAD)
        return (consensus, donors) if donors else None

    def other_live_trainers(self) -> int:
        """How many other peers train now (``_live_other_trainers``)."""
        return len(self._live_other_trainers())

    def _live_other_trainers(self) -> List[LocalTrainingProgress]:
        """The other peers' last fetched records of trainers that are alive: client-mode peers, and serving peers
        that report a throughput (an aux peer reports none), renewed within ``LIVE_RECORD_SECONDS`` (a crashed
        trainer's record outlives it by a minute)."""
        own_key, now = self._local_public_key, get_dht_time()
        return [
            record
            for key, record in self._records.items()
            if key != own_key
            and (record.client_mode or record.samples_per_second > 0)
            and now - record.time <= LIVE_RECORD_SECONDS
        ]

    def reestimate(self) -> None:
        """Estimate the swarm's progress again from the last fetched records (after this peer's epoch changed
        outside a round: its own record there may be stale)."""
        if self._last_metadata:
            self.global_progress = self._parse_swarm_progress_data(self._last_metadata)

    def refute_claims_above(self, epoch: int) -> None:
        """A state download just ended at ``epoch``: the peers that claimed more than ``MAX_EPOCH_LEAD`` beyond it
        are not followed for ``REFUTED_SECONDS``, the records of serving peers that far ahead count no more until
        their peers renew them, and the swarm's progress is re-estimated without them. Call it with the tracker
        paused (``pause_updates``), as hivemind's own download does.

        A crashed peer's record lives on until it expires (a minute): when every trainer crashed, a newcomer that
        loaded an aux's older checkpoint saw the dead trainers' epoch two ahead and downloaded the same state again
        before each of its steps, 166 times in 41 s (tests/aux/test_swarm.py). A live peer renews its record with
        every step, so one that was only busy counts again at the next fetch."""
        unserved = {
            key: record.time
            for key, record in self._records.items()
            if key != self._local_public_key and not record.client_mode and record.epoch > epoch + MAX_EPOCH_LEAD
        }
        if unserved:
            logger.info(
                "No peer served a state beyond epoch %d: %d record(s) of later epochs count again only once renewed "
                "(peers that left)",
                epoch,
                len(unserved),
            )
        self._unserved.update(unserved)
        own_key = self._local_public_key  # its own old record, after rejoining the consensus, is no claim
        liars = [key for key, claim in self._claims.items() if claim > epoch + MAX_EPOCH_LEAD and key != own_key]
        for key in liars:
            self._strikes[key] = self._strikes.get(key, 0) + 1
            # doubling: a peer that keeps claiming what no state has costs one download per hour at most
            seconds = min(REFUTED_SECONDS * 2 ** (self._strikes[key] - 1), MAX_REFUTED_SECONDS)
            self._refuted[key] = time.monotonic() + seconds
            logger.warning(
                "Peer %s claimed epoch %d, but the swarm's state is at epoch %d: ignoring its lead for %.0f s (a "
                "broken or hostile peer)",
                _short(key),
                self._claims[key],
                epoch,
                seconds,
            )
        if liars or unserved:
            self.reestimate()
        if unserved:
            # look again soon: a peer that was only busy renews its record with its next step, and until then
            # this one must not take an epoch the others are past for its own
            soon = get_dht_time() + self.default_refresh_period
            self.global_progress.next_fetch_time = min(self.global_progress.next_fetch_time, soon)
            self.global_state_updated.set()  # the fetcher waits for the time it computed before

    def _bounded_progress(self, records: Dict[bytes, LocalTrainingProgress], now: float) -> GlobalTrainingProgress:
        """hivemind's estimate (ProgressTracker._parse_swarm_progress_data, 1.1.12) over plausible records, with
        each other peer's throughput capped at the median throughput and its share of the epoch bounded."""
        if not records:
            return super()._parse_swarm_progress_data({})
        own_key = self._local_public_key
        num_peers = len(records)
        num_clients = sum(r.client_mode for r in records.values())
        # this peer's epoch is its local progress, not its record in the DHT: after rejoining the swarm's consensus
        # (``apart_from_swarm``) that record names the later epoch it left, until its next report replaces it
        others = [r.epoch for key, r in records.items() if not r.client_mode and key != own_key]
        global_epoch = max([self.local_progress.epoch] + others)

        own_rate = self.performance_ema.samples_per_second
        # peers that report no throughput (aux peers, peers between epochs, this peer before its first step) do not
        # pull the median down: with them, an aux peer would cap every trainer at its own ~0 samples/s
        rates = [r.samples_per_second for r in records.values() if r.samples_per_second > 0]
        if own_rate > MIN_MEASURED_RATE:
            rates.append(own_rate)
        median_rate = max(statistics.median_low(rates), own_rate) if rates else MAX_SAMPLES_PER_SECOND
        rate_cap = min(MAX_SAMPLES_PER_SECOND, THROUGHPUT_FACTOR * median_rate)
        share_cap = self.target_batch_size * MAX_PEER_SHARE  # what one other peer may account for
        extrapolation_cap = self.target_batch_size * MAX_EXTRAPOLATED_SHARE

        # an aux behind the trainers times its round by their epoch's end, which a lone serving trainer reaches on its
        # own samples: capped, one trainer never ended an epoch in the aux's view and the aux joined no round of it
        # (home testbed c: 1 of 44). A record that overstates its samples only makes the aux's round begin early
        trainers_end_epochs = self.rounds_follow_trainers_epoch and global_epoch > self.local_progress.epoch
        total_samples_accumulated = estimated_current_samples = 0.0
        total_samples_per_second = self.performance_ema.eps
        for key, record in records.items():
            rate, samples = record.samples_per_second, float(record.samples_accumulated)
            extrapolated = max(0.0, now - record.time) * rate
            if key != own_key:
                if rate > IMPLAUSIBLE_FACTOR * rate_cap:  # honest peers above the median are capped silently
                    self._ignore(key, "capped", f"throughput {rate:g} capped at {rate_cap:g} samples/s")
                rate = min(rate, rate_cap)
                extrapolated = min(max(0.0, now - record.time) * rate, extrapolation_cap)
            # a client's own samples count as the others count them: nobody can download a state from a client, so
            # its epochs must end when the serving peers' do, not earlier on its own samples
            uncapped = (key == own_key and not self.client_mode) or (trainers_end_epochs and not record.client_mode)
            if not uncapped:
                samples = min(samples, share_cap)
            total_samples_per_second += rate
            if record.client_mode and record.epoch == global_epoch + 1:
                # a client one epoch on went through this one (its round failed, it stepped alone): it did its
                # share. Uncounted, two clients an epoch apart each counted only their own capped half and neither
                # epoch ever ended (home testbed a: no epoch in 100 s). A hostile record gets no more this way
                # than by claiming the samples
                total_samples_accumulated += share_cap
                estimated_current_samples += share_cap
            elif record.epoch == global_epoch:
                total_samples_accumulated += samples
                estimated_current_samples += (
                    (samples + extrapolated) if uncapped else min(samples + extrapolated, share_cap)
                )

        estimated_samples_remaining = self.target_batch_size - estimated_current_samples
        estimated_time_to_next_epoch = max(0.0, estimated_samples_remaining) / total_samples_per_second
        expected_max_peers = max(num_peers + self.expected_drift_peers, num_peers * (1 + self.expected_drift_rate))
        time_to_next_fetch = min(
            self.max_refresh_period,
            max(self.min_refresh_period, estimated_time_to_next_epoch * num_peers / expected_max_peers),
        )
        peers = frozenset(records)
        if self._ends_no_epoch_alone and peers != self._seen_peers:
            # peers came or went: their first throughputs are a step's worth, and an ETA from them ran to 68 s, so
            # a starting client or aux fetched again only after max_refresh_period and missed the epoch's end (home
            # testbed a). Not for serving trainers: with it, fault scenario y (a local-mode joiner) failed 2 of 2
            time_to_next_fetch = min(time_to_next_fetch, self.default_refresh_period)
        self._seen_peers = peers
        logger.log(
            self.status_loglevel,
            f"{self.prefix} accumulated {total_samples_accumulated} samples for epoch #{global_epoch} from "
            f"{num_peers} peers. ETA {estimated_time_to_next_epoch:.2f} sec (refresh in {time_to_next_fetch:.2f} sec)",
        )
        return GlobalTrainingProgress(
            global_epoch,
            int(total_samples_accumulated),
            target_batch_size=self.target_batch_size,
            num_peers=num_peers,
            num_clients=num_clients,
            eta_next_epoch=now + estimated_time_to_next_epoch,
            next_fetch_time=now + time_to_next_fetch,
        )

    @property
    def _ends_no_epoch_alone(self) -> bool:
        """A client (its own samples count at most ``MAX_PEER_SHARE``) or an aux (none of its own): only the others'
        records end its epochs."""
        return self.client_mode or not self.votes_own_epoch

    def _ignore(self, subkey: bytes, reason: str, detail: str) -> None:
        level = logging.DEBUG if (subkey, reason) in self._logged_outliers else logging.WARNING
        self._logged_outliers.add((subkey, reason))
        action = "Capped" if reason == "capped" else "Ignoring"
        logger.log(
            level,
            "%s the progress record of peer %s: %s (a broken or hostile peer; if it is yours, check its clock "
            "and that it runs the same LeanHive version and run_id)",
            action,
            _short(subkey),
            detail,
        )


def read_consensus_epoch(dht, key: str) -> Optional[int]:
    """The lower median of the epochs the non-client peers report under the progress ``key`` now, read fresh from
    the DHT (None if nobody reports); records dated beyond the clock skew do not vote. Blocking.

    The tracker's ``consensus_epoch`` is as old as its last fetch: during a long download (minutes over a slow
    link, or a hostile peer that trickles) the swarm moves on, and the honest state must not be refused as being
    beyond a consensus of minutes ago."""
    found = dht.get(key, latest=True)
    entries = found.value if found is not None and isinstance(found.value, dict) else {}
    now = get_dht_time()
    epochs = []
    for entry in entries.values():
        value = getattr(entry, "value", None)
        if not isinstance(value, dict):
            continue
        epoch, when = value.get("epoch"), value.get("time")
        if isinstance(epoch, int) and not isinstance(epoch, bool) and isinstance(when, (int, float)):
            if not value.get("client_mode") and when <= now + MAX_CLOCK_SKEW:
                epochs.append(epoch)
    return statistics.median_low(epochs) if epochs else None


def _short(subkey: Optional[bytes]) -> str:
    return subkey[-12:].hex() if isinstance(subkey, bytes) else repr(subkey)
