"""A real hivemind DHT peer inside a test host, driven over stdin/stdout JSON lines.

``python -m benchmarks.testbed.netem.dht_agent --host-maddr /ip4/IP/tcp/PORT --announce-maddr /ip4/IP/tcp/PROXYPORT
[--initial-peer MADDR ...]`` replies ``{"ready": true, "maddrs": [...]}`` once the DHT runs, then
answers one request per stdin line:

- ``{"op": "store", "key": k, "value": v, "ttl": s}`` -> ``{"ok": bool}``
- ``{"op": "get", "key": k, "timeout": s}`` -> ``{"found": bool, "value": v}`` (latest=True; a timeout
  counts as not found)
- ``{"op": "rejoin", "maddrs": [...]}`` -> ``{"responded": n}``: ping these peers and put the ones that
  answer back into the routing table and off the search blacklist, as a peer must do to re-join after
  a partition (hivemind 1.1.12 does not re-bootstrap by itself)
- ``{"op": "routing_table"}`` -> ``{"peers": [peer ids]}``
- ``{"op": "watchdog"}`` -> ``{"isolated": bool, "rejoins": n}`` (agents started with ``--watchdog-period``
  run ``peer.swarm.watchdog.DHTWatchdog``, which re-joins on its own)

The test-side wrapper is :class:`DHTAgent`.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import functools
import json
import logging
import subprocess
import sys
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Sequence

from benchmarks.testbed.netem.channel import JsonLinesProcess, reply

if TYPE_CHECKING:
    from benchmarks.testbed.netem.hosts import Host

logger = logging.getLogger(__name__)
MODULE = "benchmarks.testbed.netem.dht_agent"


async def _rejoin(_dht, node, maddrs: List[str]) -> int:
    """Ping these peers; the ones that answer go back into the routing table and off the blacklist.

    hivemind 1.1.12 drops a peer from the routing table after one failed RPC and bans it from searches
    for 5 s (doubling per failure), and never re-bootstraps on its own."""
    from hivemind.p2p import PeerID
    from hivemind.utils.multiaddr import Multiaddr

    responded = 0
    for maddr in maddrs:
        peer_id = PeerID.from_base58(Multiaddr(maddr)["p2p"])
        if await node.protocol.call_ping(peer_id) is not None:
            if peer_id in node.blacklist:
                node.blacklist.register_success(peer_id)
            responded += 1
    return responded


async def _routing_table(_dht, node) -> List[str]:
    return [str(peer_id) for _, peer_id in node.protocol.routing_table.uid_to_peer_id.items()]


def _handle(dht, request: Dict[str, Any], watchdog=None) -> Dict[str, Any]:
    from hivemind.utils import get_dht_time

    op = request.get("op")
    timeout = float(request.get("timeout", 10))
    try:
        if op == "store":
            expiration = get_dht_time() + float(request.get("ttl", 60))
            ok = dht.store(request["key"], request["value"], expiration, return_future=True).result(timeout)
            return {"ok": bool(ok)}
        if op == "get":
            result = dht.get(request["key"], latest=True, return_future=True).result(timeout)
            return {"found": result is not None, "value": None if result is None else result.value}
        if op == "rejoin":
            rejoin = functools.partial(_rejoin, maddrs=request["maddrs"])  # picklable, unlike a lambda
            return {"responded": dht.run_coroutine(rejoin, return_future=True).result(timeout)}
        if op == "routing_table":
            return {"peers": dht.run_coroutine(_routing_table, return_future=True).result(timeout)}
        if op == "watchdog":
            if watchdog is None:
                return {"error": "this agent runs no watchdog; start it with --watchdog-period"}
            return {"isolated": watchdog.isolated, "rejoins": watchdog.rejoins}
        return {"error": f"unknown op {op!r}; valid: store, get, rejoin, routing_table, watchdog"}
    except concurrent.futures.TimeoutError:
        return {"timeout": True}
    except Exception as e:  # reported to the test instead of killing the agent
        logger.exception("request %s failed", request)
        return {"error": repr(e)}


def serve(host_maddr: str, announce_maddr: str, initial_peers: Sequence[str], watchdog_period: float = 0) -> None:
    import hivemind

    dht = hivemind.DHT(
        initial_peers=list(initial_peers),
        host_maddrs=[host_maddr],
        announce_maddrs=[announce_maddr],
        wait_timeout=2,
        start=True,
    )
    watchdog = None
    if watchdog_period:
        from peer.swarm.watchdog import DHTWatchdog

        watchdog = DHTWatchdog(dht, initial_peers, period=watchdog_period).start()
    try:
        reply({"ready": True, "maddrs": [str(m) for m in dht.get_visible_maddrs()]})
        for line in sys.stdin:
            if line.strip():
                reply(_handle(dht, json.loads(line), watchdog))
    finally:
        if watchdog is not None:
            watchdog.shutdown()
        dht.shutdown()


class DHTAgent:
    """Test side: a DHT peer on ``host`` listening on ``port``, announced as ``announce_port``
    (normally a proxy's port on the same host)."""

    def __init__(
        self,
        host: "Host",
        port: int,
        announce_port: int,
        initial_peers: Sequence[str] = (),
        start_timeout: float = 60.0,
        watchdog_period: float = 0,
    ):
        args = [
            "--host-maddr",
            f"/ip4/{host.ip}/tcp/{port}",
            "--announce-maddr",
            f"/ip4/{host.ip}/tcp/{announce_port}",
            "--watchdog-period",
            str(watchdog_period),
        ]
        for maddr in initial_peers:
            args += ["--initial-peer", maddr]
        proc = host.python("-m", MODULE, *args, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        self.channel = JsonLinesProcess(proc, name=f"DHT agent on {host.name}")
        self.maddrs: List[str] = self.channel.read(start_timeout)["maddrs"]

    def _call(self, op: str, timeout: float, **fields) -> Dict[str, Any]:
        """One request; {"timeout": True} if the DHT did not answer in time, RuntimeError on errors."""
        response = self.channel.request({"op": op, "timeout": timeout, **fields}, timeout + 5)
        if "error" in response:
            raise RuntimeError(f"{self.channel.name}: {op} failed: {response['error']}")
        return response

    def store(self, key: str, value: Any, ttl: float = 60, timeout: float = 10) -> bool:
        """True if at least one peer (possibly only this one) stored the value within ``timeout``."""
        return self._call("store", timeout, key=key, value=value, ttl=ttl).get("ok", False)

    def get(self, key: str, timeout: float = 10) -> Optional[Any]:
        """The latest value, or None if not found within ``timeout``."""
        response = self._call("get", timeout, key=key)
        return response["value"] if response.get("found") else None

    def rejoin(self, maddrs: Sequence[str], timeout: float = 10) -> int:
        """Ping these peers as a re-bootstrapping peer would; returns how many answered (those are back
        in the routing table and no longer blacklisted)."""
        return self._call("rejoin", timeout, maddrs=list(maddrs)).get("responded", 0)

    def routing_table(self, timeout: float = 10) -> List[str]:
        return self._call("routing_table", timeout)["peers"]

    def watchdog(self, timeout: float = 10) -> Dict[str, Any]:
        """``{"isolated": bool, "rejoins": n}`` of the agent's watchdog (needs ``watchdog_period``)."""
        return self._call("watchdog", timeout)

    def close(self) -> None:
        close_agents([self])


def close_agents(agents: Sequence[DHTAgent], timeout: float = 10.0) -> None:
    """Shut several agents down in parallel (each DHT takes seconds to stop cleanly)."""
    for agent in agents:
        try:
            agent.channel.process.stdin.close()  # the agent shuts its DHT down on EOF
        except OSError:
            pass
    for agent in agents:
        agent.channel.close(timeout=timeout)


def main() -> None:
    parser = argparse.ArgumentParser(description="hivemind DHT peer driven by JSON lines on stdin")
    parser.add_argument("--host-maddr", required=True, help="e.g. /ip4/10.213.5.1/tcp/40000")
    parser.add_argument("--announce-maddr", required=True, help="the proxy's address, e.g. /ip4/10.213.5.1/tcp/40001")
    parser.add_argument("--initial-peer", action="append", default=[], help="multiaddr with /p2p/<id>; repeatable")
    parser.add_argument(
        "--watchdog-period",
        type=float,
        default=0,
        help="run peer.swarm.watchdog.DHTWatchdog with this period in seconds (0: no watchdog)",
    )
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, stream=sys.stderr)
    serve(args.host_maddr, args.announce_maddr, args.initial_peer, args.watchdog_period)


if __name__ == "__main__":
    main()
