"""Keep a peer in the swarm after network faults: hivemind 1.1.12's DHT does not recover by itself.

A DHT node drops a peer from its routing table after one failed request, bans it from lookups for
5 s (doubling per failure) and never contacts its initial peers again, so after a partition or a
flaky link both sides can stay apart for good. The watchdog checks the routing table every few
seconds from a background thread and, while the table is not full, pings the peers it has known
(initial peers and peers seen in the table during the last ``forget_after`` seconds) that are
missing from it; the ones that answer go back into the table (hivemind adds a peer that answers a
ping) and off the lookup blacklist. Peers that left for good are forgotten after ``forget_after``.

A trainer that lost every peer should not run ahead alone: hivemind takes the largest epoch any
peer reports as the swarm's epoch, so a peer that trained on its own for a while would, once
reconnected, make everyone else download its state and lose their progress. ``wait_while_isolated``
pauses the caller while no peer is reachable, for at most ``isolation_grace`` seconds per episode,
after which the peer trains on alone (the others may simply have left).

The watchdog also notices when the DHT process or its ``p2pd`` daemon dies (killed by the OOM killer, crashed):
hivemind does not, and the peer would train alone forever while looking healthy. It then sets ``failure`` (a
message), logs it, emits ``swarm_lost`` and calls the ``on_failure`` callbacks; ``peer.swarm.lifecycle.run_peer``
uses them to stop the peer and exit with status 1 so that a supervisor (Docker's restart policy) restarts it.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import hivemind
import psutil
from hivemind.utils.multiaddr import Multiaddr

from peer.swarm import events
from peer.swarm.hivemind_seam import ping_peers, routing_table_peers

logger = logging.getLogger(__name__)


def peer_ids_of(maddrs: Sequence[str]) -> List[str]:
    """The /p2p/<peer id> parts of multiaddrs (addresses without one are skipped)."""
    found = []
    for maddr in maddrs:
        try:
            found.append(Multiaddr(maddr)["p2p"])
        except Exception:
            logger.debug("No peer ID in %s", maddr)
    return found


class DHTWatchdog:
    """Re-contacts lost peers of a ``hivemind.DHT`` and tells whether this peer is cut off from all of them."""

    def __init__(
        self,
        dht: hivemind.DHT,
        initial_peers: Sequence[str] = (),
        *,
        period: float = 5.0,
        forget_after: float = 600.0,
        isolation_grace: float = 60.0,
        max_pings: int = 8,
        table_capacity: int = 20,
    ):
        """
        :param initial_peers: multiaddrs the peer joined with; always worth re-contacting
        :param period: seconds between two checks of the routing table
        :param forget_after: stop re-contacting a peer this many seconds after it was last in the table
        :param isolation_grace: the longest ``wait_while_isolated`` blocks in one isolation episode
        :param max_pings: at most this many peers are pinged per check (the most recently seen first)
        :param table_capacity: re-contact only while the table holds fewer peers than this (hivemind's
            bucket size); a bigger swarm keeps finding peers through its own lookups
        """
        if period <= 0 or forget_after <= 0 or isolation_grace < 0 or max_pings < 1:
            raise ValueError("period and forget_after must be positive, isolation_grace >= 0, max_pings >= 1")
        self.dht = dht
        self.period, self.forget_after, self.isolation_grace = period, forget_after, isolation_grace
        self.max_pings, self.table_capacity = max_pings, table_capacity
        self.initial_peer_ids = [p for p in peer_ids_of(initial_peers) if p != dht.peer_id.to_base58()]
        self.last_seen: Dict[str, float] = {}  # peer ID -> monotonic time it was last in the routing table
        self.rejoins = 0  # how many times peers came back after the table had been empty
        self._isolated_since: Optional[float] = None
        self.failure: Optional[str] = None  # why this peer lost the swarm for good (DHT or p2pd died)
        self._on_failure: List[Callable[[str], None]] = []
        self._daemons = _p2p_daemons(dht)  # found now, while they surely run: a dead one is not listed later
        self._connected = threading.Event()
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    # ------------------------------------------------------------------------------------ lifecycle

    def start(self) -> "DHTWatchdog":
        self._thread = threading.Thread(target=self._loop, name="dht-watchdog", daemon=True)
        self._thread.start()
        return self

    def shutdown(self) -> None:
        self._stop.set()
        self._connected.set()  # release a caller blocked in wait_while_isolated
        if self._thread is not None:
            self._thread.join(timeout=self.period + 15)

    # ---------------------------------------------------------------------------------------- state

    @property
    def isolated(self) -> bool:
        """True while no known peer is in the routing table (a peer that never had one is not isolated)."""
        return self._isolated_since is not None

    def wait_while_isolated(self, stop: threading.Event) -> bool:
        """Block while cut off from every peer, at most ``isolation_grace`` s after the isolation began.

        Returns True if it paused and the peer is connected again (time to catch up with the swarm)."""
        since = self._isolated_since
        if since is None or self.isolation_grace == 0:
            return False
        remaining = since + self.isolation_grace - time.monotonic()
        if remaining <= 0:
            return False  # this episode's grace is used up: train on alone
        logger.warning(
            "Cut off from every peer: pausing training for up to %.0f s so that this peer does not "
            "run ahead of the swarm alone",
            remaining,
        )
        deadline = time.monotonic() + remaining
        while not stop.is_set() and not self._stop.is_set() and self.isolated and time.monotonic() < deadline:
            self._connected.wait(timeout=min(1.0, max(deadline - time.monotonic(), 0.0)))
        if self.isolated and not stop.is_set():
            logger.warning(
                "Still cut off after %.0f s: training on alone (the other peers may have left)", self.isolation_grace
            )
        return not self.isolated and not stop.is_set()

    def add_failure_callback(self, callback: Callable[[str], None]) -> None:
        """Call ``callback(message)`` once the DHT or p2pd has died (at once if it already has)."""
        self._on_failure.append(callback)
        if self.failure is not None:
            callback(self.failure)

    # ----------------------------------------------------------------------------------------- loop

    def _loop(self) -> None:
        while not self._stop.wait(self.period):
            failure = self._find_failure()
            if failure is not None:
                if not self._stop.is_set():  # not a DHT that our own shutdown stopped
                    self._fail(failure)
                return
            try:
                self.check()
            except Exception as e:  # a DHT that is shutting down, a slow DHT process: try again next period
                logger.debug("DHT watchdog check failed: %r", e)

    def _find_failure(self) -> Optional[str]:
        if not self.dht.is_alive():
            return (
                f"the DHT process (pid {self.dht.pid}) has died, so this peer can no longer reach the swarm; "
                "exiting so that it can be restarted (check the log above and the system log for an out-of-memory "
                "kill)"
            )
        dead = [proc.pid for proc in self._daemons if not _running(proc)]
        if dead and len(dead) == len(self._daemons):
            return (
                f"the p2pd daemon (pid {', '.join(map(str, dead))}) has died, so this peer can no longer reach the "
                "swarm; exiting so that it can be restarted (check the system log for an out-of-memory kill)"
            )
        return None

    def _fail(self, failure: str) -> None:
        self.failure = failure
        logger.error("Lost the swarm: %s", failure)
        events.emit("swarm_lost", reason=failure)
        self._connected.set()  # release a caller blocked in wait_while_isolated
        for callback in self._on_failure:
            try:
                callback(failure)
            except Exception:
                logger.exception("A callback for the lost swarm failed")

    def check(self) -> Tuple[int, List[str]]:
        """One round: look at the routing table, ping missing peers; returns (table size, peers that answered)."""
        timeout = self.period + 10
        table = set(self.dht.run_coroutine(routing_table_peers, return_future=True).result(timeout))
        now = time.monotonic()
        for peer_id in table:
            self.last_seen[peer_id] = now
        for peer_id, seen in list(self.last_seen.items()):
            if now - seen > self.forget_after and peer_id not in table:
                del self.last_seen[peer_id]
        answered: List[str] = []
        missing = self._missing(table)
        if missing and len(table) < self.table_capacity:
            ping = functools.partial(ping_peers, peer_ids=missing)  # a partial pickles, a lambda does not
            answered = self.dht.run_coroutine(ping, return_future=True).result(timeout)
            for peer_id in answered:
                self.last_seen[peer_id] = time.monotonic()
        self._update_isolation(bool(table) or bool(answered), answered)
        return len(table) + len(set(answered) - table), answered

    def _missing(self, table: set) -> List[str]:
        recent = sorted(self.last_seen, key=self.last_seen.get, reverse=True)
        candidates = [p for p in [*recent, *self.initial_peer_ids] if p not in table]
        return list(dict.fromkeys(candidates))[: self.max_pings]

    def _update_isolation(self, connected: bool, answered: List[str]) -> None:
        knows_someone = bool(self.last_seen) or bool(self.initial_peer_ids)
        if connected:
            if self._isolated_since is not None:
                self.rejoins += 1
                cut_off = time.monotonic() - self._isolated_since
                logger.info("Reconnected to the swarm after %.0f s cut off (%d peers answered)", cut_off, len(answered))
                events.emit("reconnected", after_seconds=round(cut_off, 3))
            self._isolated_since = None
            self._connected.set()
        elif knows_someone and self._isolated_since is None:
            self._isolated_since = time.monotonic()
            self._connected.clear()
            logger.warning(
                "No peer of the swarm is reachable; re-contacting %d known peers every %.0f s",
                len(set(self.last_seen) | set(self.initial_peer_ids)),
                self.period,
            )


def _p2p_daemons(dht: hivemind.DHT) -> List[psutil.Process]:
    """The p2pd processes the DHT process started (hivemind runs its daemon as a child of the DHT process)."""
    try:
        children = psutil.Process(dht.pid).children(recursive=True)
    except (
        psutil.Error,
        AttributeError,
        TypeError,
        ValueError,
    ):  # no DHT process (a stand-in in unit tests) or already gone
        return []
    found = []
    for child in children:
        try:
            if child.name() == "p2pd":
                found.append(child)
        except psutil.Error:
            continue
    if not found:
        logger.debug("No p2pd process found under the DHT process %s", dht.pid)
    return found


def _running(proc: psutil.Process) -> bool:
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def start_watchdog(dht: hivemind.DHT, args) -> Optional[DHTWatchdog]:
    """The watchdog for a peer started with ``peer.swarm.network.NetworkArguments`` (None if rejoin_period is 0)."""
    if not args.rejoin_period:
        return None
    return DHTWatchdog(dht, args.initial_peers, period=args.rejoin_period, isolation_grace=args.isolation_grace).start()
