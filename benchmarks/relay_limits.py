"""What a libp2p circuit relay carries with hivemind 1.1.12's p2pd, measured on 127.0.0.1.

Three daemons: a relay R (a public peer: hivemind's defaults, which serve relay-v2), a "home" peer H that listens on no
address at all (``no_listen``, as a peer behind a NAT without a forwarded port can be reached only through a relay) and
reserves a slot on R (``use_auto_relay`` with R as trusted relay, reachability forced private), and a caller C that
knows H only by its ``/p2p-circuit`` address through R. C opens one stream per payload size to H, writes the payload
and reads back how many bytes H received; a reset stream is reported as such.

    python -m benchmarks.relay_limits [--sizes 16 65536 131072 1048576 8388608] [--json out.json]

It prints one row per payload: sent, received by H, seconds, outcome. See docs/joining.md ("Behind a NAT"). On
127.0.0.1 go-libp2p granted H no reservation within 420 s (R had only loopback addresses): run it where R has a
routable address, e.g. inside the namespace test-bed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time

from hivemind.p2p import P2P

from peer.swarm.hivemind_seam.reachability import connect_to

HANDLER = "leanhive.relay_limits.Count"


async def wait_for_circuit(caller: P2P, home: P2P, relay_maddrs: list, timeout: float) -> str:
    """The first circuit address through the relay that reaches ``home`` (its reservation may take go-libp2p's
    autorelay boot delay, about 3 minutes, with a single relay candidate). The address is built from the relay's
    (go-libp2p does not advertise circuit addresses through a relay that has only loopback addresses)."""
    circuit = f"{relay_maddrs[0]}/p2p-circuit/p2p/{home.peer_id}"
    deadline = time.monotonic() + timeout
    while True:
        try:
            await connect_to(caller, home.peer_id, [circuit])
            return circuit
        except Exception:  # noqa: BLE001 - no reservation yet: try again
            if time.monotonic() > deadline:
                raise TimeoutError(f"could not reach the home peer through {circuit} in {timeout} s") from None
            await asyncio.sleep(5.0)


async def count_handler(_info, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    expected = int.from_bytes(await reader.readexactly(8), "big")
    received = 0
    try:
        while received < expected:
            chunk = await reader.read(65536)
            if not chunk:
                break
            received += len(chunk)
    except (ConnectionError, asyncio.IncompleteReadError):
        pass
    writer.write(received.to_bytes(8, "big"))
    await writer.drain()
    writer.close()


async def send(caller: P2P, peer_id, size: int, timeout: float) -> dict:
    started = time.perf_counter()
    row = {"bytes": size, "received": None, "seconds": None, "outcome": "ok"}
    try:
        _info, reader, writer = await asyncio.wait_for(caller.call_binary_stream_handler(peer_id, HANDLER), timeout)
        writer.write(size.to_bytes(8, "big"))
        payload = b"\x01" * 65536
        left = size
        while left > 0:
            writer.write(payload[: min(left, len(payload))])
            left -= min(left, len(payload))
            await asyncio.wait_for(writer.drain(), timeout)
        row["received"] = int.from_bytes(await asyncio.wait_for(reader.readexactly(8), timeout), "big")
        writer.close()
        if row["received"] != size:
            row["outcome"] = "truncated"
    except Exception as e:  # noqa: BLE001 - the outcome is the measurement
        row["outcome"] = f"failed: {type(e).__name__} {e}"[:120]
    row["seconds"] = round(time.perf_counter() - started, 3)
    return row


async def measure(sizes, circuit_timeout: float, timeout: float) -> dict:
    # go-libp2p runs the relay service only while AutoNAT deems the host public: forced, as on a public server
    relay = await P2P.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"], force_reachability="public")
    relay_maddrs = [str(m) for m in await relay.get_visible_maddrs()]  # each ends with /p2p/<relay id>
    home = await P2P.create(
        initial_peers=relay_maddrs,
        no_listen=True,
        use_auto_relay=True,
        trusted_relays=relay_maddrs,
        force_reachability="private",
    )
    caller = await P2P.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"], initial_peers=relay_maddrs)
    try:
        await home.add_binary_stream_handler(HANDLER, count_handler)
        started = time.perf_counter()
        circuit = await wait_for_circuit(caller, home, relay_maddrs, circuit_timeout)
        reservation_seconds = round(time.perf_counter() - started, 1)
        peers = {str(info.peer_id): [str(a) for a in info.addrs] for info in await caller.list_peers()}
        rows = [await send(caller, home.peer_id, size, timeout) for size in sizes]
        return {
            "circuit": circuit,
            "reservation_seconds": reservation_seconds,
            "caller_sees_home_at": peers.get(str(home.peer_id)),
            "rows": rows,
        }
    finally:
        for peer in (caller, home, relay):
            await peer.shutdown()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[16, 65536, 131072, 262144, 1048576, 8388608])
    parser.add_argument("--circuit_timeout", type=float, default=120.0)
    parser.add_argument("--timeout", type=float, default=30.0)
    parser.add_argument("--json", help="also write the result here")
    args = parser.parse_args(argv)
    result = asyncio.run(measure(args.sizes, args.circuit_timeout, args.timeout))
    print(f"relayed address: {result['circuit']} (reachable after {result['reservation_seconds']} s)")
    print(f"the caller's connection to the home peer: {result['caller_sees_home_at']}")
    print(f"{'payload bytes':>14} {'received':>10} {'seconds':>8}  outcome")
    for row in result["rows"]:
        print(f"{row['bytes']:>14} {str(row['received']):>10} {row['seconds']:>8}  {row['outcome']}")
    if args.json:
        with open(args.json, "w") as out:
            json.dump(result, out, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
