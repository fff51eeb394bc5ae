"""Joining the swarm's DHT: network arguments, DHT creation with the run's record validators, the join line.

Trainers and auxiliary peers both use this module, so every peer validates records the same way.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable, List, Literal, Optional, Sequence

import hivemind
from hivemind.dht.validation import RecordValidatorBase
from hivemind.utils.crypto import RSAPrivateKey
from hivemind.utils.multiaddr import Multiaddr

from peer.swarm import events
from peer.swarm.auth import AuthorizationError, check_own_peer_id, make_authorizer
from peer.swarm.errors import NetworkSetupError
from peer.swarm.identity import load_or_create_signing_key, signing_key_path
from peer.swarm.reachability import (
    HOW_TO_BE_REACHABLE,
    Reachability,
    ReachabilityService,
    decide_without_probe,
    probe,
)
from peer.swarm.records import make_validators
from peer.swarm.watchdog import DHTWatchdog, start_watchdog

__all__ = ["NetworkArguments", "NetworkSetupError", "SwarmConnection", "connect", "create_dht", "joinable_maddrs"]

logger = logging.getLogger(__name__)

RESTART_ATTEMPTS = 5  # tries to listen on the probed port again when a joiner restarts as a full peer


@dataclass
class NetworkArguments:
    """How a peer finds and talks to the swarm (shared by trainers and auxiliary peers)."""

    run_id: str = "leanhive"
    """Name of the collaboration; every peer of one training run uses the same run_id."""
    initial_peers: List[str] = field(default_factory=list)
    """Multiaddrs of peers already in the swarm, e.g. /ip4/1.2.3.4/tcp/31337/p2p/12D3Koo...
    Leave empty to start a new collaboration."""
    host_maddrs: List[str] = field(default_factory=lambda: ["/ip4/0.0.0.0/tcp/0"])
    """Multiaddrs to listen on; use a fixed port (e.g. /ip4/0.0.0.0/tcp/31337) behind a firewall."""
    announce_maddrs: List[str] = field(default_factory=list)
    """Public multiaddrs other peers should dial (e.g. behind NAT with port forwarding); need explicit ports."""
    identity_path: Optional[str] = None
    """Private key file for a stable peer ID (created if missing); a signing key is kept beside it."""
    client_mode: bool = False
    """Do not accept incoming connections; the same as --reachability private (auto finds it out by itself)."""
    reachability: Literal["auto", "public", "private"] = "auto"
    """Whether other peers can dial this one. auto: the first peer of a swarm is public; a joiner asks reachable
    peers to dial it back and, if none can, runs as a client of the swarm (it averages through reachable peers and
    serves nothing). public: skip the check (e.g. a server with an open port). private: always a client, like
    --client_mode. To be a full peer behind a home router, forward a port and pass --host_maddrs
    /ip4/0.0.0.0/tcp/<port> --announce_maddrs /ip4/<public ip>/tcp/<port>."""
    use_ipfs: bool = False
    """Use the public IPFS DHT to find peers (cannot be combined with initial_peers)."""
    dht_startup_timeout: float = 60.0
    """Seconds to wait for the DHT to start and reach the initial peers."""
    rejoin_period: float = 5.0
    """Seconds between checks that re-contact lost peers (hivemind does not re-join the swarm by itself after
    a network fault); 0 disables them."""
    isolation_grace: float = 60.0
    """A trainer cut off from every peer pauses up to this many seconds before training on alone, so that it
    does not run ahead of the swarm; 0 never pauses."""
    authorized_keys: Optional[str] = None
    """Allowlist file: only the peers listed there may use this swarm's DHT and averaging. One line per peer,
    '<peer ID> ssh-rsa <key> [name]'; each peer logs its line at start, or run `python -m peer.swarm.auth
    --identity_path PATH`. Needs --identity_path (a stable identity)."""

    def __post_init__(self):
        if isinstance(self.initial_peers, str):
            self.initial_peers = self.initial_peers.split()
        if not self.run_id or any(ch.isspace() for ch in self.run_id) or len(self.run_id) > 128:
            raise ValueError(
                f"run_id must be a non-empty name without spaces (at most 128 characters), "
                f"got {self.run_id!r}; e.g. --run_id my_gpt_run"
            )
        for name in ("initial_peers", "host_maddrs", "announce_maddrs"):
            for addr in getattr(self, name):
                _check_maddr(name, addr, need_peer_id=name == "initial_peers")
        for addr in self.announce_maddrs:
            if addr.rstrip("/").endswith("/tcp/0") or addr.rstrip("/").endswith("/udp/0"):
                raise ValueError(
                    f"announce_maddrs need an explicit port, got {addr!r}; e.g. /ip4/203.0.113.7/tcp/31337"
                )
        if self.use_ipfs and self.initial_peers:
            raise ValueError("use_ipfs and initial_peers cannot be combined: pass one of them")
        if self.dht_startup_timeout <= 0:
            raise ValueError(f"dht_startup_timeout must be positive, got {self.dht_startup_timeout}")
        if self.authorized_keys is not None and self.identity_path is None:
            raise ValueError(
                "authorized_keys needs a stable identity: add --identity_path (e.g. "
                "--identity_path keys/peer.key); its line in the allowlist stays valid across restarts"
            )
        if self.reachability not in ("auto", "public", "private"):
            raise ValueError(f"reachability must be auto, public or private, got {self.reachability!r}")
        if self.client_mode and self.reachability == "public":
            raise ValueError(
                "--client_mode and --reachability public contradict each other: drop --client_mode to run as a full "
                "peer, or use --reachability private (the same as --client_mode)"
            )
        if not (self.rejoin_period >= 0 and self.isolation_grace >= 0):
            raise ValueError(
                f"rejoin_period and isolation_grace must be zero or positive seconds, got "
                f"{self.rejoin_period} and {self.isolation_grace}"
            )


def _check_maddr(name: str, addr: str, need_peer_id: bool) -> None:
    example = "/ip4/127.0.0.1/tcp/31337/p2p/12D3KooW..." if need_peer_id else "/ip4/0.0.0.0/tcp/31337"
    try:
        parsed = Multiaddr(addr)
    except Exception as e:
        raise ValueError(f"{name}: {addr!r} is not a valid multiaddr ({e}); expected e.g. {example}") from None
    if need_peer_id and "/p2p/" not in str(parsed):
        raise ValueError(
            f"{name}: {addr!r} has no /p2p/<peer id> part; copy the full line that the first peer logs, e.g. {example}"
        )


def create_dht(
    args: NetworkArguments,
    record_validators: Sequence[RecordValidatorBase],
    *,
    client_mode: Optional[bool] = None,
    **kwargs,
) -> hivemind.DHT:
    """Start a DHT peer, or raise NetworkSetupError that names unreachable peers and suggests fixes.

    ``client_mode``: the mode decided by ``peer.swarm.reachability`` (default: ``args.client_mode``)."""
    if args.identity_path is not None:
        Path(args.identity_path).parent.mkdir(parents=True, exist_ok=True)
    authorizer = None
    if args.authorized_keys is not None:
        try:
            authorizer = kwargs["authorizer"] = make_authorizer(args.authorized_keys, args.identity_path)
        except AuthorizationError as e:
            raise NetworkSetupError(str(e)) from None
    try:
        dht = hivemind.DHT(
            start=True,
            initial_peers=args.initial_peers,
            host_maddrs=args.host_maddrs,
            announce_maddrs=args.announce_maddrs or None,
            identity_path=args.identity_path,
            client_mode=args.client_mode if client_mode is None else client_mode,
            use_ipfs=args.use_ipfs,
            record_validators=list(record_validators),
            startup_timeout=args.dht_startup_timeout,
            **kwargs,
        )
    except Exception as e:
        text = str(e)
        if args.initial_peers and ("bootstrap" in text or "initial_peers" in text or "connect" in text.lower()):
            peers = "\n  ".join(args.initial_peers)
            raise NetworkSetupError(
                f"could not reach any of the initial peers:\n  {peers}\n"
                "Check that the address is copied exactly from the line the first peer logs "
                "('--initial_peers ...'), that the peer is still running, and that its port is open "
                "(firewall/NAT). To start a new collaboration instead, omit --initial_peers."
                + " If the swarm is private (--authorized_keys), this peer must be in its allowlist."
            ) from None
        if "already taken" in text:
            raise NetworkSetupError(
                f"identity {args.identity_path} is already used by a running peer; "
                "give each peer its own --identity_path"
            ) from None
        raise NetworkSetupError(f"could not start the DHT peer: {text}") from e
    if authorizer is not None:
        try:
            check_own_peer_id(dht, authorizer, args.authorized_keys)
        except AuthorizationError as e:
            dht.shutdown()
            raise NetworkSetupError(str(e)) from None
    return dht


@dataclass
class SwarmConnection:
    """What joining the swarm's DHT gives a peer (trainer or aux)."""

    dht: hivemind.DHT
    watchdog: Optional[DHTWatchdog]
    signing_key: RSAPrivateKey
    public_key: bytes  # the subkey this peer signs its records with
    join_line: str  # what other peers paste to join: --initial_peers ... --run_id ...
    reachability: Reachability = field(
        default_factory=lambda: Reachability(False, True, "forced", "assumed public")
    )  # whether others can dial it, hence the mode of its DHT and averagers
    service: Optional[ReachabilityService] = None  # serves dial-back probes, announces it, watches the network

    @property
    def client_mode(self) -> bool:
        return self.reachability.client_mode

    def shutdown_service(self) -> None:
        if self.service is not None:
            self.service.shutdown()


def connect(args: NetworkArguments, role: Callable[[], str] = lambda: "trainer") -> SwarmConnection:
    """Signing key, record validators, DHT (NetworkSetupError if no initial peer answers), its reachability
    (peer.swarm.reachability: decided, or probed and the DHT restarted as a full peer) and its watchdog; logs the
    line others use to join. ``role()``: what this peer announces itself as when others can dial it (trainer, aux,
    assist); an aux peer never runs as a client."""
    signing_key = load_or_create_signing_key(signing_key_path(args.identity_path))
    validators, public_key = make_validators(args.run_id, signing_key)
    can_be_client = role() == "trainer"
    decision = decide_without_probe(
        client_mode=args.client_mode,
        reachability=args.reachability,
        has_initial_peers=bool(args.initial_peers) or args.use_ipfs,
        can_be_client=can_be_client,
    )
    if decision is not None:
        dht = create_dht(args, validators, client_mode=decision.client_mode)
    else:
        # a joiner starts as a client, so that nobody routes to it before it is known to be dialable (p2pd listens
        # all the same, which is what the probe dials)
        dht = create_dht(args, validators, client_mode=can_be_client)
        reachable, why = probe(dht, args.run_id)
        if reachable and can_be_client:
            dht = _restart_as_full_peer(dht, args, validators)
        decision = Reachability(can_be_client and not reachable, reachable, "probe", why)
        if not reachable:
            what = "runs as a client of the swarm" if can_be_client else "cannot serve its state or assist"
            logger.warning("This peer cannot be dialled by other peers (%s): it %s; %s", why, what, HOW_TO_BE_REACHABLE)
    logger.info(
        "Reachability: %s (%s: %s)", "client" if decision.client_mode else "full peer", decision.source, decision.reason
    )
    events.emit(
        "reachability",
        client_mode=decision.client_mode,
        reachable=decision.reachable,
        source=decision.source,
        reason=decision.reason,
    )
    watchdog = start_watchdog(dht, args)
    maddrs = joinable_maddrs(dht)
    join_line = f"--initial_peers {' '.join(maddrs)} --run_id {args.run_id}"  # the exact text others paste
    if not decision.client_mode:  # a client cannot be dialled: others join through the peers it joined
        logger.info("To join this collaboration, run peers with:\n%s", join_line)
    events.emit("dht_started", peer_id=dht.peer_id.to_base58(), initial_peers=maddrs, run_id=args.run_id)
    service = ReachabilityService(
        dht, args.run_id, public_key, decision, role, reprobe=args.reachability == "auto" and decision.source == "probe"
    ).start()
    return SwarmConnection(dht, watchdog, signing_key, public_key, join_line, decision, service)


def _restart_as_full_peer(
    dht: hivemind.DHT, args: NetworkArguments, validators: Sequence[RecordValidatorBase]
) -> hivemind.DHT:
    """The same peer (identity, listening port) as a full DHT peer: the port the probe dialled stays the one
    others dial."""
    ports = {str(m).split("/tcp/")[1].split("/")[0] for m in dht.get_visible_maddrs() if "/tcp/" in str(m)}
    host_maddrs = list(args.host_maddrs)
    if len(ports) == 1:
        (port,) = ports
        host_maddrs = [
            m.replace("/tcp/0", f"/tcp/{port}") if m.rstrip("/").endswith("/tcp/0") else m for m in host_maddrs
        ]
    dht.shutdown()
    restarted = replace(args, host_maddrs=host_maddrs)
    for attempt in range(RESTART_ATTEMPTS):  # the old daemon may hold the port for a moment after its shutdown
        try:
            return create_dht(restarted, validators, client_mode=False, check_if_identity_free=False)
        except NetworkSetupError as e:
            if attempt == RESTART_ATTEMPTS - 1:
                if host_maddrs == list(args.host_maddrs):
                    raise
                logger.warning("Could not listen on %s again (%s); listening on %s", host_maddrs, e, args.host_maddrs)
            else:
                time.sleep(1.0)
    return create_dht(args, validators, client_mode=False, check_if_identity_free=False)


def joinable_maddrs(dht: hivemind.DHT) -> List[str]:
    """The addresses other peers should dial, preferring ones reachable from elsewhere."""
    maddrs = [str(m) for m in dht.get_visible_maddrs()]
    public = [m for m in maddrs if not m.startswith(("/ip4/127.", "/ip6/::1"))]
    return public or maddrs
