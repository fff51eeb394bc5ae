"""The swarm protocol around hivemind.Optimizer: joining (waiting for peers, downloading the state), re-syncing
after an isolation, and the final barrier at max_epochs.

Every peer's view of the others comes from ``peer.swarm.records`` (one reader for hivemind's progress and
state-sharing records).
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Dict, List, Optional, Tuple

import hivemind
from hivemind.utils import get_dht_time

from peer.swarm import events
from peer.swarm.config import SYNC_MODES, CollaborationArguments
from peer.swarm.errors import NetworkSetupError
from peer.swarm.hivemind_seam import DOWNLOAD_EPOCH_LEAD, LeanHiveOptimizer, read_consensus_epoch
from peer.swarm.keys import gradient_prefix_of_mode, progress_key
from peer.swarm.records import PeerProgress, read_averager_declarations, read_progress, read_state_sharing

logger = logging.getLogger(__name__)


def count_other_state_sharing_peers(dht: hivemind.DHT, run_id: str) -> int:
    """Other peers that currently offer their state (trainers not in client mode, auxiliary peers)."""
    own_id = dht.peer_id.to_bytes()
    return sum(1 for peer_id in read_state_sharing(dht, run_id) if peer_id != own_id)


def count_other_peers_online(dht: hivemind.DHT, run_id: str) -> int:
    """Other peers online for --min_peers: those that offer their state, plus client-mode trainers (behind NAT they
    offer none, but report progress as they train)."""
    own_id = dht.peer_id.to_bytes()
    clients = {record.peer_id for record in read_progress(dht, run_id) if record.client_mode}
    return count_other_state_sharing_peers(dht, run_id) + len(clients - {own_id})


def check_sync_mode(dht: hivemind.DHT, run_id: str, sync_mode: str) -> None:
    """Before this peer builds its averagers: stop with an error when the run's peers declare averagers of the
    other ``--sync_mode`` only (a peer of another mode would average other quantities and diverge). Declarations
    of both modes (a refused peer's stay up to 30 s) are only logged. Client-mode peers declare nothing: they are
    checked against the others."""
    own_id = dht.peer_id.to_bytes()
    declared = {}
    for mode in SYNC_MODES:
        peers = read_averager_declarations(dht, gradient_prefix_of_mode(run_id, mode))
        declared[mode] = [peer for peer in peers if peer != own_id]
    others = [mode for mode in SYNC_MODES if mode != sync_mode and declared[mode]]
    if others and not declared[sync_mode]:
        raise NetworkSetupError(
            f"the peers of run {run_id!r} train with --sync_mode {others[0]}, this peer with --sync_mode "
            f"{sync_mode}: every peer of a run must use the same mode; restart with --sync_mode {others[0]} (or "
            f"another --run_id)"
        )
    if others:
        logger.warning("Peers of run %r declared averagers of both sync modes; this peer uses %s", run_id, sync_mode)


def wait_for_swarm(
    optimizer: LeanHiveOptimizer, dht: hivemind.DHT, run_id: str, collab: CollaborationArguments
) -> None:
    """Wait (at most startup_wait s) for the swarm's progress and for min_peers peers to be online."""
    deadline = time.monotonic() + collab.startup_wait
    optimizer.tracker.fetched_global_progress_this_epoch.wait(timeout=collab.startup_wait)
    if collab.min_peers > 1:
        online = 1 + count_other_peers_online(dht, run_id)
        while online < collab.min_peers and time.monotonic() < deadline:
            time.sleep(0.5)
            online = 1 + count_other_peers_online(dht, run_id)
        if online < collab.min_peers:
            logger.warning(
                "Only %d of min_peers=%d peers are online after %.0f s; starting anyway",
                online,
                collab.min_peers,
                collab.startup_wait,
            )
        else:
            logger.info("%d peers online; starting", online)


def join_swarm(optimizer: LeanHiveOptimizer, dht: hivemind.DHT, run_id: str, collab: CollaborationArguments) -> bool:
    """Load the swarm's state if anyone else is training; True if a state arrived.

    hivemind's load_state_from_peers returns quietly when nobody answers, so the arrival is checked; the download
    makes up to ``load_state_attempts`` peer downloads (``StateDownloadSettings``) before training on with the local
    state (logged as a warning).
    """
    progress = optimizer.tracker.global_progress
    if progress.num_peers > 0 and optimizer.local_epoch > progress.epoch:
        logger.info(
            "The local backup (epoch %d) is ahead of the swarm (epoch %d): the others will load it",
            optimizer.local_epoch,
            progress.epoch,
        )
        optimizer.tracker.mark_in_sync()
        return False
    others = (
        progress.num_peers > 0
        or progress.epoch > optimizer.local_epoch
        or count_other_state_sharing_peers(dht, run_id) > 0
    )
    if not others:
        logger.info("No other peers reported progress: starting a new collaboration at epoch %d", optimizer.local_epoch)
        optimizer.tracker.mark_in_sync()
        return False
    if optimizer.load_state_checked():
        logger.info("Loaded the swarm's state: now at global epoch %d", optimizer.local_epoch)
        optimizer.tracker.mark_in_sync()
        events.emit("state_loaded", epoch=optimizer.local_epoch, source="swarm", reason="join", path=None)
        return True
    logger.warning(
        "Could not download the swarm's state; training on from the local state at epoch %d "
        "(hivemind retries when it notices this peer is behind)",
        optimizer.local_epoch,
    )
    return False


# ---------------------------------------------------------------------------------------- final barrier


def _fresh_progress(records: List[PeerProgress], stale_after: float) -> Dict[bytes, Tuple[int, bool]]:
    """peer_id -> (epoch, client_mode) of peers whose training progress was reported recently."""
    now = get_dht_time()
    return {
        record.peer_id: (record.epoch, record.client_mode) for record in records if now - record.time <= stale_after
    }


_ARRIVAL_SPAN = 2.0**33
"""Seconds of DHT time (to the year 2242) mapped onto the final priority's fraction, without wrapping: ``% 1e5``
wrapped every 28 hours, and a peer arriving just after a wrap outranked the earlier ones."""


def _final_priority(epoch: int, arrival: float) -> float:
    """State-sharing priority of a peer at the final barrier: above any training priority (= epoch), and
    higher for earlier arrival (a peer that finished late may have missed the last all-reduce). Strictly
    decreasing in ``arrival`` up to float resolution (0.3 ms at epoch 100, 0.3 s at epoch 1e5); ties are broken
    by peer ID (``_elected``)."""
    return epoch + 0.5 + 0.4 * (1.0 - min(max(arrival, 0.0), _ARRIVAL_SPAN) / _ARRIVAL_SPAN)


def _elected(candidates: Dict[bytes, float]) -> bytes:
    """The peer every peer elects from the same priorities: the highest priority, then the highest peer ID."""
    return max(candidates, key=lambda peer_id: (candidates[peer_id], peer_id))


def final_barrier(
    optimizer: LeanHiveOptimizer,
    dht: hivemind.DHT,
    run_id: str,
    epoch: int,
    collab: CollaborationArguments,
    stop: Optional[threading.Event] = None,
) -> bool:
    """At max_epochs: wait for the peers still training, then all take the parameters of one elected peer.

    A peer that finished its last epoch a moment after the others missed their last all-reduce and
    stepped with its own gradients; normally the next epoch's averaging would fix that, but there is no
    next epoch. The elected peer is the earliest to arrive: it gets the highest state-sharing priority,
    which is also whom hivemind's load_state_from_peers downloads from first. Returns True if this peer
    ends with the elected peer's parameters (or is that peer). Setting ``stop`` ends the wait early.
    """
    if collab.final_sync_timeout <= 0:
        return True
    stop = stop if stop is not None else threading.Event()
    deadline = time.monotonic() + collab.final_sync_timeout
    stale_after = max(15.0, 3 * collab.averaging_timeout)
    own_id = dht.peer_id.to_bytes()
    final_floor = epoch + 0.5
    if not optimizer.client_mode:
        optimizer.state_averager.state_sharing_priority = _final_priority(epoch, get_dht_time())

    def keep_reporting():  # the others must see that this peer is still here, waiting
        optimizer.tracker.report_local_progress(optimizer.local_epoch, samples_accumulated=0)

    def out_of_time() -> bool:
        return time.monotonic() > deadline or stop.is_set()

    def others_now():
        records = read_progress(dht, run_id)
        progress = {p: v for p, v in _fresh_progress(records, stale_after).items() if p != own_id}
        # an aux peer shares its state at the epoch it last downloaded, takes no final parameters and publishes no
        # progress (hivemind reports none for auxiliary peers): the barrier is among the peers that report progress
        trainers = {record.peer_id for record in records}
        priorities = {p: v for p, v in read_state_sharing(dht, run_id).items() if p != own_id and p in trainers}
        return progress, priorities

    # 1. everyone still training gets to the last epoch: training peers report progress after every step,
    # and (unless in client mode) declare their epoch as state-sharing priority; a peer that just reloaded
    # the state may miss its priority for a moment, so both are watched (a priority counts once its peer has
    # reported progress: a trainer before its first step is not waited for)
    while True:
        progress, priorities = others_now()
        if (
            all(e >= epoch for e, _ in progress.values()) and all(v >= epoch for v in priorities.values())
        ) or out_of_time():
            break
        keep_reporting()
        time.sleep(0.5)
    # 2. every state-sharing peer at the barrier has declared its final priority
    while True:
        progress, priorities = others_now()
        if all(v >= final_floor for v in priorities.values()) or out_of_time():
            break
        keep_reporting()
        time.sleep(0.5)
    candidates = {p: v for p, v in priorities.items() if v >= final_floor}
    if not optimizer.client_mode:
        candidates[own_id] = optimizer.state_averager.state_sharing_priority
    if not candidates:
        logger.warning("Final barrier: no peer could be elected; keeping this peer's parameters")
        return False
    if _elected(candidates) == own_id:
        logger.info("Final barrier: elected; %d other peer(s) take these parameters", len(candidates) - 1)
        while not out_of_time():  # 3a. serve the state until every other peer has it
            progress, priorities = others_now()
            followers_done = all(v == final_floor for v in priorities.values() if v >= epoch)
            clients_done = not any(client for _, client in progress.values())
            if followers_done and clients_done:
                return True
            keep_reporting()
            time.sleep(0.5)
        logger.warning("Final barrier: some peers did not take the final parameters within final_sync_timeout")
        return True
    while not out_of_time():  # 3b. take the elected peer's parameters
        if optimizer.load_state_checked() and optimizer.local_epoch == epoch:
            if not optimizer.client_mode:  # tells the elected peer that this one is done
                optimizer.state_averager.state_sharing_priority = final_floor
            logger.info("Final barrier: took the final parameters of the elected peer")
            return True
        keep_reporting()
        time.sleep(0.5)
    logger.warning("Final barrier: could not load the final state within final_sync_timeout")
    return False


# ----------------------------------------------------------------------------------------- re-syncing


def swarm_epoch(dht: hivemind.DHT, run_id: str) -> Optional[int]:
    """The epoch the (non-client) peers agree on now, read fresh from the DHT (None if nobody reports).

    The lower median, not the maximum: one signed record claiming epoch 10**12 (or a clock far ahead) must not
    make this peer wait for an epoch that never comes. Records dated beyond the clock skew are ignored."""
    return read_consensus_epoch(dht, progress_key(run_id))


def resync_with_swarm(optimizer: LeanHiveOptimizer, attempts: int = 3, epoch_timeout: float = 60.0) -> bool:
    """After an isolation: take the swarm's state at the start of one of its epochs; True once in sync.

    A state downloaded in the middle of an epoch is stale by the time this peer can join an averaging
    round (the round's group formed before), and hivemind lets a peer one epoch behind train on with
    stale parameters for good. So this waits until the swarm moves to its next epoch, then downloads.
    """
    for _ in range(attempts):
        epoch = _read_swarm_epoch(optimizer)
        if epoch is None or optimizer.local_epoch >= epoch:
            return epoch is not None
        logger.info(
            "Re-joined at epoch %d while the swarm is at %d: downloading its state when it starts its next epoch",
            optimizer.local_epoch,
            epoch,
        )
        deadline = time.monotonic() + epoch_timeout
        while time.monotonic() < deadline and (_read_swarm_epoch(optimizer) or 0) <= epoch:
            time.sleep(0.25)
        if optimizer.load_state_checked():
            events.emit("state_loaded", epoch=optimizer.local_epoch, source="swarm", reason="resync", path=None)
    return False


class RejoinWhenApart:
    """A trainer beyond the swarm's consensus by more than a download may carry takes the consensus state (see
    ``LeanHiveProgressTracker.apart_from_swarm``), confirmed on the records read fresh from the DHT (the tracker's
    may be an epoch's fetch old, and a fast peer is often a few epochs ahead of a slow one); tried at most once per
    ``pause`` seconds (a donor that does not answer is not asked before every step), and read fresh at most once per
    ``recheck`` seconds (a DHT read is not taken before every step while the tracker's view is stale)."""

    def __init__(self, pause: float = 30.0, recheck: float = 5.0):
        self.pause, self.recheck = pause, recheck
        self._next_try = 0.0

    def __call__(self, optimizer: LeanHiveOptimizer) -> bool:
        """True if this peer was apart and took the consensus state now."""
        if time.monotonic() < self._next_try:
            return False
        apart = getattr(optimizer.tracker, "apart_from_swarm", lambda: None)()
        if apart is None:
            return False
        consensus, donors = apart
        self._next_try = time.monotonic() + self.recheck
        fresh = _read_swarm_epoch(optimizer)
        if fresh is None or optimizer.local_epoch <= fresh + DOWNLOAD_EPOCH_LEAD:
            return False
        self._next_try = time.monotonic() + self.pause
        own = optimizer.local_epoch
        logger.warning(
            "This peer is at epoch %d, the swarm's consensus at %d (%d peers there): it trained apart from them, and "
            "none of them takes a state that far ahead; taking theirs",
            own,
            consensus,
            len(donors),
        )
        if not optimizer.load_state_checked(only_from=donors, rejoin_epoch=consensus):
            logger.warning("Could not download the consensus state; trying again in %.0f s", self.pause)
            return False
        logger.info("Rejoined the swarm at epoch %d (left epoch %d)", optimizer.local_epoch, own)
        events.emit("state_loaded", epoch=optimizer.local_epoch, source="swarm", reason="rejoin", path=None)
        return True


def _read_swarm_epoch(optimizer: LeanHiveOptimizer) -> Optional[int]:
    try:
        return swarm_epoch(optimizer.dht, optimizer.run_id)
    except Exception as e:
        logger.warning("Could not read the swarm's progress: %r", e)
        return None
