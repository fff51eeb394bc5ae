"""hivemind's P2P side of reachability: a small dial-back RPC, served and called through the DHT's own p2pd.

A peer that wants to know whether others can dial it asks a reachable peer (found in the signed ``reachable``
records, ``peer.swarm.reachability``) to dial it back. The server opens a *fresh* TCP connection to the requester's
announced addresses and reports only whether a libp2p daemon answered there (it sends the multistream-select
header ``/multistream/1.0.0`` first, as go-libp2p's listener does). The existing libp2p connection between the two
is not reused, so a peer behind a NAT that it dialled out of is reported unreachable, as it is.

What a requester can make a server do is bounded (hostile peers are expected):
- requests are read with a byte limit and a deadline; the requester's peer ID is the one libp2p authenticated on
  the stream (Noise/TLS handshake: the peer ID is the hash of the requester's key), not a claim in the message;
- at most ``probes_per_minute`` probes per peer ID per minute and ``max_concurrent`` probes at a time, others are
  refused without dialling;
- only the requester's own addresses are dialled: an address must carry the IP the request came from (the
  observed address of the stream; a relayed ``/p2p-circuit`` stream is refused) and, if it names a peer ID, the
  requester's; at most ``max_addrs`` addresses, each with a ``connect_timeout``.
So a rogue can at most make a server knock on its own IP a few times a minute.

Runs in the DHT's process (``DHT.run_coroutine``), where ``DHTNode.p2p`` lives; the objects passed there are
pickled, so the server's limits and counters live in that process.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import re
import secrets
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Deque, Dict, List, Optional, Sequence

from hivemind.p2p import P2P, PeerID
from hivemind.p2p.p2p_daemon_bindings.datastructures import StreamInfo
from hivemind.utils.multiaddr import Multiaddr
from hivemind.utils.serializer import MSGPackSerializer

logger = logging.getLogger(__name__)

# The hivemind API this module calls (public, but the P2P handler API is young): (class, name, its signature in the
# pinned version), checked by tests/swarm/test_hivemind_seam.py; ``DHTNode.p2p`` is listed in PRIVATE_ATTRIBUTES.
USED_METHODS = [
    (
        P2P,
        "add_binary_stream_handler",
        "(self, name: str, handler: Callable[[hivemind.p2p.p2p_daemon_bindings.datastructures.StreamInfo, "
        "asyncio.streams.StreamReader, asyncio.streams.StreamWriter], Awaitable[NoneType]], balanced: bool = False) "
        "-> None",
    ),
    (
        P2P,
        "call_binary_stream_handler",
        "(self, peer_id: hivemind.p2p.p2p_daemon_bindings.datastructures.PeerID, handler_name: str) -> "
        "Tuple[hivemind.p2p.p2p_daemon_bindings.datastructures.StreamInfo, asyncio.streams.StreamReader, "
        "asyncio.streams.StreamWriter]",
    ),
    (P2P, "get_visible_maddrs", "(self, latest: bool = False) -> List[hivemind.utils.multiaddr.multiaddr.Multiaddr]"),
    (
        StreamInfo,
        "__init__",
        "(self, peer_id: hivemind.p2p.p2p_daemon_bindings.datastructures.PeerID, addr: "
        "hivemind.utils.multiaddr.multiaddr.Multiaddr, proto: str) -> None",
    ),
]

DIAL_BACK_HANDLER = "leanhive.reachability.DialBack"
MULTISTREAM_HEADER = b"\x13/multistream/1.0.0\n"  # what a libp2p listener sends first on a fresh connection
MAX_MESSAGE_BYTES = 2048  # a request is a nonce and a few addresses; an answer a few words
NONCE_BYTES = 16


def _frame(payload: dict) -> bytes:
    body = MSGPackSerializer.dumps(payload)
    return len(body).to_bytes(2, "big") + body


async def _read_frame(reader: asyncio.StreamReader, timeout: float) -> dict:
    """One length-prefixed msgpack dict, at most MAX_MESSAGE_BYTES, within ``timeout`` seconds."""

    async def read() -> dict:
        size = int.from_bytes(await reader.readexactly(2), "big")
        if not 0 < size <= MAX_MESSAGE_BYTES:
            raise ValueError(f"message of {size} bytes (limit {MAX_MESSAGE_BYTES})")
        value = MSGPackSerializer.loads(await reader.readexactly(size))
        if not isinstance(value, dict):
            raise ValueError("message is not a mapping")
        return value

    return await asyncio.wait_for(read(), timeout)


def _tcp_target(maddr: str, observed_ip: str, requester: PeerID) -> Optional[tuple]:
    """(host, port) of ``maddr`` if the server may dial it for ``requester``, else None."""
    try:
        parsed = Multiaddr(maddr)
        protocols = [proto.name for proto in parsed.protocols()]
    except Exception:  # noqa: BLE001 - any unparsable address is simply not dialled
        return None
    if "p2p-circuit" in protocols or "tcp" not in protocols or not protocols or protocols[0] not in ("ip4", "ip6"):
        return None
    if "p2p" in protocols and parsed.value_for_protocol("p2p") != requester.to_base58():
        return None  # someone else's address
    host = parsed.value_for_protocol(protocols[0])
    try:
        port = int(parsed.value_for_protocol("tcp"))
        same_ip = ipaddress.ip_address(host) == ipaddress.ip_address(observed_ip)
    except ValueError:
        return None
    return (host, port) if same_ip and 0 < port < 65536 else None


def _observed_ip(addr: Multiaddr) -> Optional[str]:
    """The IP a stream came from, or None for a relayed (``/p2p-circuit``) or non-IP stream."""
    try:
        protocols = [proto.name for proto in addr.protocols()]
    except Exception:  # noqa: BLE001
        return None
    if "p2p-circuit" in protocols or not protocols or protocols[0] not in ("ip4", "ip6"):
        return None
    return addr.value_for_protocol(protocols[0])


async def dial_libp2p(host: str, port: int, timeout: float) -> bool:
    """A fresh TCP connection to host:port, and a libp2p listener's first bytes on it, within ``timeout``."""
    writer = None
    try:
        reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port), timeout)
        header = await asyncio.wait_for(reader.readexactly(len(MULTISTREAM_HEADER)), timeout)
        return header == MULTISTREAM_HEADER
    except (OSError, asyncio.TimeoutError, asyncio.IncompleteReadError):
        return False
    finally:
        if writer is not None:
            writer.close()


@dataclass
class DialBackLimits:
    """What one requester can make a dial-back server do."""

    probes_per_minute: int = 6
    """Probes answered per requester peer ID per minute; more are refused without dialling."""
    max_concurrent: int = 4
    """Probes dialled at once (all requesters together); more are refused."""
    max_addrs: int = 4
    """At most this many of the requester's addresses are dialled per probe."""
    connect_timeout: float = 3.0
    """Seconds for each fresh connection (TCP connect, then the listener's first bytes)."""
    read_timeout: float = 5.0
    """Seconds a requester has to send its request."""

    def __post_init__(self):
        if not (self.probes_per_minute >= 1 and self.max_concurrent >= 1 and self.max_addrs >= 1):
            raise ValueError("probes_per_minute, max_concurrent and max_addrs must be at least 1")
        if not (self.connect_timeout > 0 and self.read_timeout > 0):
            raise ValueError("connect_timeout and read_timeout must be positive seconds")


@dataclass
class DialBackServer:
    """Serves DIAL_BACK_HANDLER on a DHT's p2pd: ``dht.run_coroutine(server.register)``. Picklable; after
    ``register`` its counters live in the DHT's process."""

    limits: DialBackLimits = field(default_factory=DialBackLimits)
    _recent: Dict[str, Deque[float]] = field(default_factory=dict, repr=False)
    _active: int = 0

    async def register(self, _dht, node) -> None:
        await node.p2p.add_binary_stream_handler(DIAL_BACK_HANDLER, self._handle)

    def _admit(self, requester: str, now: float) -> Optional[str]:
        """None if this probe may run, else why it is refused."""
        recent = self._recent.setdefault(requester, deque())
        while recent and now - recent[0] > 60.0:
            recent.popleft()
        if len(recent) >= self.limits.probes_per_minute:
            return f"rate limit: at most {self.limits.probes_per_minute} probes per minute"
        if self._active >= self.limits.max_concurrent:
            return "busy: too many probes at once"
        if len(self._recent) > 10_000:  # bound the table itself: drop requesters idle for a minute
            for key in [key for key, times in self._recent.items() if not times or now - times[-1] > 60.0]:
                del self._recent[key]
        recent.append(now)
        return None

    async def _handle(self, stream_info, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        requester = stream_info.peer_id
        try:
            try:
                request = await _read_frame(reader, self.limits.read_timeout)
            except Exception as e:  # noqa: BLE001 - a malformed request is refused, never raised
                logger.debug("Refused a dial-back request from %s: %r", requester, e)
                return
            answer = await self._answer(request, requester, stream_info.addr)
            writer.write(_frame(answer))
            await writer.drain()
        except (ConnectionError, OSError):
            pass
        finally:
            writer.close()

    async def _answer(self, request: dict, requester: PeerID, addr: Multiaddr) -> dict:
        nonce = request.get("nonce")
        if not isinstance(nonce, bytes) or len(nonce) != NONCE_BYTES:
            return {"nonce": b"", "reachable": False, "refused": "malformed request"}
        refusal = self._admit(requester.to_base58(), time.monotonic())
        if refusal is not None:
            logger.debug("Refused a dial-back probe from %s: %s", requester, refusal)
            return {"nonce": nonce, "reachable": False, "refused": refusal}
        self._active += 1
        try:
            observed = _observed_ip(addr)
            if observed is None:
                return {"nonce": nonce, "reachable": False, "refused": "the request came through a relay"}
            maddrs = request.get("maddrs")
            maddrs = [m for m in maddrs if isinstance(m, str)] if isinstance(maddrs, list) else []
            targets = []
            for maddr in maddrs[: 4 * self.limits.max_addrs]:
                target = _tcp_target(maddr, observed, requester)
                if target is not None and target not in targets:
                    targets.append(target)
            targets = targets[: self.limits.max_addrs]
            if not targets:
                return {"nonce": nonce, "reachable": False, "refused": f"no address of yours at {observed} to dial"}
            for host, port in targets:
                if await dial_libp2p(host, port, self.limits.connect_timeout):
                    return {"nonce": nonce, "reachable": True, "dialled": f"{host}:{port}"}
            return {"nonce": nonce, "reachable": False}
        finally:
            self._active -= 1


@dataclass(frozen=True)
class DialBackAnswer:
    """A server's answer: reachable or not, or why it refused (``refused``: None when it dialled)."""

    server: str
    reachable: bool
    refused: Optional[str] = None
    dialled: Optional[str] = None


async def own_dialable_maddrs(_dht, node) -> List[str]:
    """This peer's announced addresses that could be dialled directly (never a relayed ``/p2p-circuit`` one)."""
    try:
        maddrs = await node.p2p.get_visible_maddrs(latest=True)
    except ValueError:  # hivemind raises when the daemon listens on no address: nothing to dial
        return []
    return [str(m) for m in maddrs if "p2p-circuit" not in str(m)][:16]


@dataclass(frozen=True)
class DialBackRequest:
    """Ask ``server`` (base58 peer ID) to dial back ``maddrs``: ``dht.run_coroutine(request)``; picklable."""

    server: str
    maddrs: Sequence[str]
    timeout: float = 15.0

    async def __call__(self, _dht, node) -> DialBackAnswer:
        nonce = secrets.token_bytes(NONCE_BYTES)
        writer = None
        try:

            async def ask() -> dict:
                nonlocal writer
                _info, reader, writer = await node.p2p.call_binary_stream_handler(
                    PeerID.from_base58(self.server), DIAL_BACK_HANDLER
                )
                writer.write(_frame({"nonce": nonce, "maddrs": list(self.maddrs)}))
                await writer.drain()
                return await _read_frame(reader, self.timeout)

            answer = await asyncio.wait_for(ask(), self.timeout)
        except Exception as e:  # noqa: BLE001 - no answer is an answer too: this server said nothing
            return DialBackAnswer(self.server, False, refused=f"no answer ({type(e).__name__}: {e})"[:200])
        finally:
            if writer is not None:
                writer.close()
        if answer.get("nonce") != nonce:
            return DialBackAnswer(self.server, False, refused="answer to another request")
        refused = answer.get("refused")
        dialled = answer.get("dialled")
        return DialBackAnswer(
            self.server,
            answer.get("reachable") is True and refused is None,
            refused=str(refused)[:200] if refused is not None else None,
            dialled=str(dialled)[:100] if dialled is not None else None,
        )


async def connect_to(p2p: P2P, peer_id: PeerID, maddrs: Sequence[str]) -> None:
    """Open a libp2p connection to ``peer_id`` at ``maddrs`` (hivemind's P2P has no public call for it; reads its
    private ``_client``). Used by the relay measurement (benchmarks/relay_limits.py) to dial a /p2p-circuit address.
    The addresses go to p2pd in the binary form go-libp2p reads (``go_multiaddr``)."""
    await p2p._client.connect(peer_id, [go_multiaddr(m) for m in maddrs])


_P2P_CODE = b"\xa5\x03"  # multicodec 421 (p2p) as a varint
_P2P_PART = re.compile(r"/(?:p2p|ipfs)/([1-9A-HJ-NP-Za-km-z]+)")


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        low, value = value & 0x7F, value >> 7
        out.append(low | (0x80 if value else 0))
        if not value:
            return bytes(out)


def go_multiaddr(maddr: str) -> Multiaddr:
    """``maddr`` with each ``/p2p/<peer id>`` encoded as go-libp2p reads it: the peer ID's multihash. The multiaddr
    library hivemind 1.1.12 uses writes a CIDv1 (``01 72`` + multihash), which p2pd refuses as "length greater than
    remaining number of bytes in buffer": every address with a peer ID inside, such as a relay circuit
    ``/ip4/R/tcp/P/p2p/<relay>/p2p-circuit/p2p/<peer>``, failed to dial (tests/swarm/test_reachability.py pins it)."""
    out, start = b"", 0
    for match in _P2P_PART.finditer(maddr):
        if match.start() > start:
            out += Multiaddr(maddr[start : match.start()]).to_bytes()
        peer = PeerID.from_base58(match.group(1)).to_bytes()
        out += _P2P_CODE + _varint(len(peer)) + peer
        start = match.end()
    if start < len(maddr):
        out += Multiaddr(maddr[start:]).to_bytes()
    return Multiaddr(out)


def relayed(maddr: str) -> bool:
    """Whether an address goes through a libp2p relay (a circuit relay-v2 carries 128 KiB per connection by
    default: never a state download or an averaging part)."""
    return "/p2p-circuit" in maddr
