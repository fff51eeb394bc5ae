"""Whether other peers can dial this one, found out by itself, and what a peer nobody can dial does about it.

A volunteer at home sits behind its router's NAT: nobody can open a connection to it. Run as a full peer, it
would be listed in the others' routing tables, chosen as a donor of state and as a reducer in all-reduce rounds,
and every attempt would fail or hang (the swarm loses rounds for it). So each peer decides at start
(``decide``; ``--reachability {auto,public,private}``, ``--client_mode`` = private):

- forced (public / private / --client_mode): as told;
- the first peer of a swarm (no --initial_peers): public (someone must be, and the others joined it by dialling);
- a joiner: starts its DHT in client mode (nobody is told to dial it yet; p2pd listens all the same), finds the
  reachable peers in their signed ``<run_id>_reachable`` records and asks a few of them to dial it back
  (``peer.swarm.hivemind_seam.reachability``: a fresh connection to the addresses it announces). If one of them
  could, it restarts its DHT as a full peer on the same port; if none could, or nobody answered, it stays a client
  to be safe and logs one line with why and how to become a full peer.

Every peer that can be dialled then serves the dial-back probe and announces itself (``ReachabilityService``):
role ``trainer``, ``aux`` or ``assist`` (an aux peer that joins the averaging of client trainers). A client trainer
needs one reachable trainer or assisting aux in its all-reduce rounds (hivemind's client-mode averagers only join
groups that have one); ``ReducerWatch`` says so within a minute when there is none, repeats it, and the trainer
pauses instead of computing gradients that can never be applied.

When the network changes (``ReachabilityService`` compares the machine's interface addresses every
``check_period`` seconds: cheap, and what changes when a laptop moves or a lease renews) the peer probes again. A
peer that was dialled before and no longer can be stops announcing itself (so nobody waits on it) and says so; a
client that now could be a full peer says to restart it. The mode itself changes only at a restart: the averagers
are built for one mode, and rebuilding them mid-training would cost the state.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from dataclasses import dataclass
from typing import Callable, List, Optional, Tuple

import hivemind
import psutil
from hivemind.p2p import PeerID
from hivemind.utils import get_dht_time

from peer.swarm import events
from peer.swarm.hivemind_seam.reachability import (
    DialBackLimits,
    DialBackRequest,
    DialBackServer,
    own_dialable_maddrs,
)
from peer.swarm.records import REACHABLE_EXPIRATION, ReachablePeer, fetch_reachable, publish_reachable

__all__ = [
    "HOW_TO_BE_REACHABLE",
    "assisting_aux_peers",
    "Reachability",
    "ReachabilityService",
    "ReducerWatch",
    "decide_without_probe",
    "probe",
]

logger = logging.getLogger(__name__)

HOW_TO_BE_REACHABLE = (
    "to run as a full peer, forward a TCP port of your router to this machine and pass --host_maddrs "
    "/ip4/0.0.0.0/tcp/<port> --announce_maddrs /ip4/<your public ip>/tcp/<port> (or pass --reachability public "
    "if other peers can dial this machine)"
)
REDUCER_ROLES = ("trainer", "assist")


@dataclass(frozen=True)
class Reachability:
    """What a peer decided about itself at start."""

    client_mode: bool
    """The mode its DHT and averagers run in: a client dials out only, serves nothing, never reduces."""
    reachable: bool
    """Other peers can dial it: it serves dial-back probes and announces itself."""
    source: str
    """How it was decided: forced (a flag), first (no initial peers), probe (a dial-back)."""
    reason: str

    @property
    def label(self) -> str:
        """What its metrics record says (peer.swarm.records.RoundHealth.reachability)."""
        return "client" if self.client_mode else "public"


def decide_without_probe(
    *, client_mode: bool, reachability: str, has_initial_peers: bool, can_be_client: bool
) -> Optional[Reachability]:
    """The decision when no probe is needed (forced, or the first peer), else None (probe)."""
    if client_mode or reachability == "private":
        if not can_be_client:
            raise ValueError(
                "an aux peer cannot run in client mode: it must accept connections to serve its state and join "
                "averaging; drop --client_mode / --reachability private (or run it where its port is reachable)"
            )
        flag = "--client_mode" if client_mode else "--reachability private"
        return Reachability(True, False, "forced", f"{flag} was given")
    if reachability == "public":
        return Reachability(False, True, "forced", "--reachability public was given")
    if not has_initial_peers:
        return Reachability(False, True, "first", "the first peer of a swarm is dialled by all the others")
    return None


def assisting_aux_peers(dht: hivemind.DHT, run_id: str, timeout: float = 5.0) -> List[PeerID]:
    """The aux peers that announce they assist in averaging (role ``assist``); none where the DHT does not answer.
    A sync trainer that missed a round asks them for its result as well (they take client trainers' rounds)."""
    try:
        records = fetch_reachable(dht, run_id, timeout=timeout)
    except Exception:  # noqa: BLE001 - the DHT may not answer for a moment: the trainer asks the others
        logger.debug("Could not read the reachable peers", exc_info=True)
        return []
    return [PeerID(record.peer_id) for record in records if record.role == "assist"]


def probe(
    dht: hivemind.DHT,
    run_id: str,
    *,
    find_timeout: float = 20.0,
    attempts: int = 3,
    request_timeout: float = 15.0,
) -> Tuple[bool, str]:
    """Ask up to ``attempts`` reachable peers to dial this one back: (reachable, why). Waits up to ``find_timeout``
    seconds for their records (a swarm that just started may not have announced yet)."""
    own = dht.peer_id.to_bytes()
    deadline = time.monotonic() + find_timeout
    servers: List[ReachablePeer] = []
    while True:
        try:
            servers = [r for r in fetch_reachable(dht, run_id, timeout=5.0) if r.peer_id != own]
        except Exception as e:  # noqa: BLE001 - the DHT may not answer at once: try again until the deadline
            logger.debug("Could not read the reachable peers: %r", e)
        if servers or time.monotonic() >= deadline:
            break
        time.sleep(1.0)
    if not servers:
        return False, "no reachable peer of this swarm announced itself to check this one"
    maddrs = dht.run_coroutine(own_dialable_maddrs)
    random.shuffle(servers)  # spread the probes of many joiners over the servers
    answers = []
    for server in servers[:attempts]:
        server_id = PeerID(server.peer_id).to_base58()
        answer = dht.run_coroutine(DialBackRequest(server_id, maddrs, timeout=request_timeout))
        logger.debug("Dial-back probe by %s: %s", server_id, answer)
        if answer.reachable:
            return True, f"peer {server_id} dialled it back at {answer.dialled}"
        answers.append(answer)
    dialled = [a for a in answers if a.refused is None]
    if dialled:
        return False, f"{len(dialled)} reachable peer(s) could not open a connection to {', '.join(maddrs) or '-'}"
    return False, "no reachable peer could check it (" + "; ".join(str(a.refused) for a in answers) + ")"


def local_addresses() -> frozenset:
    """The machine's interface addresses: what changes when its network does."""
    try:
        return frozenset(
            addr.address
            for addrs in psutil.net_if_addrs().values()
            for addr in addrs
            if addr.family.name != "AF_PACKET"
        )
    except Exception:  # noqa: BLE001 - no interface list: no change detection
        return frozenset()


class ReachabilityService:
    """For a peer that others can dial: serves the dial-back probe and announces itself every
    ``REACHABLE_EXPIRATION / 3`` s; for every auto peer: probes again when the machine's addresses change."""

    def __init__(
        self,
        dht: hivemind.DHT,
        run_id: str,
        public_key: bytes,
        decision: Reachability,
        role: Callable[[], str],
        *,
        reprobe: bool,
        check_period: float = 30.0,
        limits: Optional[DialBackLimits] = None,
    ):
        self.dht, self.run_id, self.public_key, self.decision, self.role = dht, run_id, public_key, decision, role
        self.reprobe, self.check_period = reprobe, check_period
        self.announcing = decision.reachable
        self._limits = limits or DialBackLimits()
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._addresses = local_addresses()

    def start(self) -> "ReachabilityService":
        if not self.decision.client_mode:  # a client's DHT cannot accept the probe's stream anyway
            self.dht.run_coroutine(DialBackServer(self._limits).register)
        self._thread = threading.Thread(target=self._loop, name="reachability", daemon=True)
        self._thread.start()
        return self

    def shutdown(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)

    def _announce(self) -> None:
        record = ReachablePeer(peer_id=self.dht.peer_id.to_bytes(), role=self.role(), time=get_dht_time())
        publish_reachable(self.dht, self.run_id, self.public_key, record)

    def _loop(self) -> None:
        announce_every = REACHABLE_EXPIRATION / 3
        next_announce = next_check = time.monotonic()
        while not self._stop.is_set():
            now = time.monotonic()
            try:
                if self.announcing and now >= next_announce:
                    self._announce()
                    next_announce = now + announce_every
                if self.reprobe and now >= next_check:
                    next_check = now + self.check_period
                    self._check_network()
            except Exception:  # noqa: BLE001 - a failed announcement or probe is retried at the next turn
                logger.debug("Reachability check failed", exc_info=True)
            self._stop.wait(1.0)

    def _check_network(self) -> None:
        addresses = local_addresses()
        if addresses == self._addresses:
            return
        self._addresses = addresses
        reachable, why = probe(self.dht, self.run_id, find_timeout=5.0)
        events.emit("reachability_changed", reachable=reachable, reason=why)
        if reachable == self.announcing or (reachable and self.decision.client_mode):
            if reachable and self.decision.client_mode:
                logger.info(
                    "The network changed and this peer can now be dialled (%s): restart it to run as a full peer", why
                )
            return
        self.announcing = reachable
        if reachable:
            logger.info("The network changed and this peer can be dialled again (%s)", why)
        else:
            logger.warning(
                "The network changed and this peer can no longer be dialled (%s): it stops offering itself as a "
                "reducer; restart it to run as a client of the swarm, or %s",
                why,
                HOW_TO_BE_REACHABLE,
            )


NO_REDUCER_MESSAGE = (
    "no reachable peer in this swarm: this peer runs as a client (nobody can dial it), and client peers can only "
    "average through a trainer or an assisting aux peer that others can dial; none is online, so training is "
    "paused (gradients computed now could never be applied). Fix: run the aux peer (run_aux_peer.py, it assists by "
    "default) or one trainer on a machine with a public address, or {how}"
)


class ReducerWatch:
    """For a client-mode trainer: is there a peer that can reduce its all-reduce rounds (a reachable trainer or an
    assisting aux)? Checked every ``check_period`` s; while there is none it logs NO_REDUCER_MESSAGE at once and
    then every ``repeat_every`` s, and ``wait_while_missing`` pauses the training loop."""

    def __init__(
        self,
        dht: hivemind.DHT,
        run_id: str,
        *,
        check_period: float = 10.0,
        repeat_every: float = 60.0,
    ):
        if check_period <= 0 or repeat_every <= 0:
            raise ValueError("check_period and repeat_every must be positive seconds")
        self.dht, self.run_id = dht, run_id
        self.check_period, self.repeat_every = check_period, repeat_every
        self._present = threading.Event()
        self._checked = threading.Event()
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._missing_since: Optional[float] = None
        self._last_message = float("-inf")

    def start(self) -> "ReducerWatch":
        self._thread = threading.Thread(target=self._loop, name="reducer-watch", daemon=True)
        self._thread.start()
        return self

    def shutdown(self) -> None:
        self._stop.set()
        self._present.set()  # release a caller blocked in wait_while_missing
        if self._thread is not None:
            self._thread.join(timeout=self.check_period + 10)

    @property
    def missing(self) -> bool:
        return self._checked.is_set() and not self._present.is_set()

    def reducers(self) -> List[ReachablePeer]:
        own = self.dht.peer_id.to_bytes()
        return [
            r
            for r in fetch_reachable(self.dht, self.run_id, timeout=5.0)
            if r.role in REDUCER_ROLES and r.peer_id != own
        ]

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                self._check()
            except Exception:  # noqa: BLE001 - the DHT may not answer for a moment: check again later
                logger.debug("Could not read the reachable peers", exc_info=True)
            self._stop.wait(self.check_period)

    def _check(self) -> None:
        found = self.reducers()
        now = time.monotonic()
        if found:
            if self._missing_since is not None:
                logger.info(
                    "A reachable peer joined (%s): training resumes",
                    ", ".join(f"{r.role} {PeerID(r.peer_id).to_base58()}" for r in found),
                )
                events.emit("reducer_found", after_seconds=round(now - self._missing_since, 1))
            self._missing_since = None
            self._present.set()
        else:
            self._present.clear()
            if self._missing_since is None:
                self._missing_since = now
                events.emit("reducer_missing")
            if now - self._last_message >= self.repeat_every:
                self._last_message = now
                logger.warning(NO_REDUCER_MESSAGE.format(how=HOW_TO_BE_REACHABLE))
        self._checked.set()

    def wait_while_missing(self, stop: threading.Event) -> bool:
        """Block while no reducer is known (after the first check); True if it paused."""
        if not self.missing:
            return False
        while not stop.is_set() and not self._stop.is_set() and not self._present.is_set():
            self._present.wait(timeout=1.0)
        return True
