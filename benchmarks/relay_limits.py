"""What a libp2p circuit relay and DCUtR hole punching carry with hivemind 1.1.12's p2pd, measured on the home
network test-bed (benchmarks/testbed/home: network namespaces, NAT routers doing MASQUERADE, 10/50 Mbit/s lines).

Four daemons, each a process in its own host: a relay R on a public host (hivemind's defaults, which serve
relay-v2; reachability forced public, as a public server's AutoNAT would find), a home peer H behind a NAT with no
port forwarded (listening on its LAN address as ``run_trainer.py`` does, ``use_auto_relay`` with R as trusted relay,
reachability forced private), and two callers that know H only by its ``/p2p-circuit`` address through R: one on a
public host and one behind a second home NAT. Each caller opens one stream per payload size to H, writes the payload
and reads back how many bytes H received (a reset stream is reported as such), then looks at how it is connected to
H: still through R, or directly (DCUtR's hole punch, or H dialling a public caller back), and sends again after
``--punch_wait`` seconds.

    python -m benchmarks.relay_limits [--sizes 16 131072 1048576 8388608] [--json out.json]   (as root)

It prints one row per caller and payload: sent, received by H, seconds, outcome, and the connection. See
docs/joining.md ("Relays and hole punching").
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from pathlib import Path

HANDLER = "leanhive.relay_limits.Count"
ROLES = ("relay", "home", "caller")
PORT = 31337  # the relay's listening port on its public address


def _read_json(path: Path, timeout: float) -> dict:
    """What another role wrote, once it is there (roles start in any order; their logs lie beside it)."""
    from benchmarks.testbed.processes import wait_for_file

    return json.loads(wait_for_file(path, None, timeout))


def _write_json(path: Path, value: dict) -> None:
    from benchmarks.testbed.processes import write_ready_file

    write_ready_file(path, json.dumps(value, indent=1))


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


async def send(caller, peer_id, size: int, timeout: float) -> dict:
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
        row["outcome"] = f"failed: {type(e).__name__} {e}"[:400]
    row["seconds"] = round(time.perf_counter() - started, 3)
    return row


async def _addresses_of(p2p, peer_id) -> list:
    """The addresses of ``p2p``'s open connections to ``peer_id`` (a ``/p2p-circuit`` one goes through a relay)."""
    return [str(a) for info in await p2p.list_peers() if info.peer_id == peer_id for a in info.addrs]


async def _serve_forever() -> None:
    while True:
        await asyncio.sleep(3600)


async def run_relay(folder: Path, ip: str) -> None:
    from hivemind.p2p import P2P

    relay = await P2P.create(host_maddrs=[f"/ip4/{ip}/tcp/{PORT}"], force_reachability="public")
    _write_json(folder / "relay.json", {"maddrs": [str(m) for m in await relay.get_visible_maddrs()]})
    await _serve_forever()


async def run_home(folder: Path) -> None:
    from hivemind.p2p import P2P

    relay_maddrs = _read_json(folder / "relay.json", 60)["maddrs"]
    home = await P2P.create(
        host_maddrs=["/ip4/0.0.0.0/tcp/0"],
        initial_peers=relay_maddrs,
        use_auto_relay=True,
        trusted_relays=relay_maddrs,
        force_reachability="private",
    )
    await home.add_binary_stream_handler(HANDLER, count_handler)
    # the callers time their first connection from here (H's own addresses never list its /p2p-circuit one)
    _write_json(folder / "home.json", {"peer_id": str(home.peer_id), "started": time.time()})
    await _serve_forever()


async def run_caller(
    folder: Path, name: str, ip: str, sizes, circuit_timeout: float, timeout: float, punch_wait: float
) -> None:
    from hivemind.p2p import P2P, PeerID

    from peer.swarm.hivemind_seam.reachability import connect_to

    relay_maddrs = _read_json(folder / "relay.json", 60)["maddrs"]
    home_id = PeerID.from_base58(_read_json(folder / "home.json", 120)["peer_id"])
    caller = await P2P.create(host_maddrs=[f"/ip4/{ip}/tcp/0"], initial_peers=relay_maddrs)
    circuit = f"{relay_maddrs[0]}/p2p-circuit/p2p/{home_id}"
    started = time.monotonic()
    result = {"caller": name, "circuit": circuit, "reached_at": None, "rounds": []}
    try:
        while True:  # no reservation yet: the relay refuses the circuit
            try:
                await connect_to(caller, home_id, [circuit])
                break
            except Exception as e:  # noqa: BLE001
                if time.monotonic() - started > circuit_timeout:
                    result["error"] = f"no circuit to H in {circuit_timeout} s: {type(e).__name__} {e}"[:200]
                    return
                await asyncio.sleep(5.0)
        result["reached_at"] = time.time()
        for label, wait in (("at once", 0.0), (f"after {punch_wait:g} s", punch_wait)):
            await asyncio.sleep(wait)
            connected = await _addresses_of(caller, home_id)
            rows = [await send(caller, home_id, size, timeout) for size in sizes]
            result["rounds"].append({"when": label, "connected_via": connected, "rows": rows})
    finally:
        _write_json(folder / f"caller-{name}.json", result)
        await caller.shutdown()


def measure(
    sizes, circuit_timeout: float, timeout: float, punch_wait: float, folder: Path, internet_prefix: str
) -> dict:
    """Build the home network, run the four roles in it and gather what the callers wrote."""
    from benchmarks.testbed.home.network import HomeNetwork

    common = ["--folder", str(folder), "--circuit_timeout", str(circuit_timeout), "--timeout", str(timeout)]
    with HomeNetwork(public=2, homes=2, internet_prefix=internet_prefix) as net:
        relay_host, public_caller = net.public
        home, home_caller = net.homes
        logs = []

        def start(host, role: str, *extra: str):
            log = open(folder / f"{role}{'-' + extra[1] if extra else ''}.log", "w")
            logs.append(log)
            return host.python(
                "-m",
                "benchmarks.relay_limits",
                "--role",
                role,
                "--ip",
                host.ip,
                *common,
                *extra,
                stdout=log,
                stderr=log,
            )

        start(relay_host, "relay")
        start(home, "home")
        callers = [
            start(host, "caller", "--name", name, "--punch_wait", str(punch_wait), "--sizes", *map(str, sizes))
            for host, name in ((public_caller, "public"), (home_caller, "home"))
        ]
        print(f"started R, H and two callers; H's reservation on R takes about 3 minutes ({net.subnet})", flush=True)
        budget = circuit_timeout + 2 * punch_wait + 4 * len(sizes) * timeout + 120
        for proc in callers:
            proc.wait(timeout=budget)
        for log in logs:
            log.close()
        return {
            "home": _read_json(folder / "home.json", 1),
            "callers": [_read_json(folder / f"caller-{name}.json", 1) for name in ("public", "home")],
            # what crossed R's link: a payload that went through the circuit crossed it twice (in and out)
            "relay_link_bytes": net.interface_bytes(relay_host),
        }


def print_table(result: dict) -> None:
    started = result["home"]["started"]
    for caller in result["callers"]:
        if caller.get("reached_at"):
            how = _how(caller["rounds"][0]["connected_via"]) if caller["rounds"] else "?"
            print(
                f"{caller['caller']} caller: first connected to H {caller['reached_at'] - started:.1f} s after H "
                f"started ({how})"
            )
    link = result["relay_link_bytes"]
    print(f"R's link: {link['rx_bytes']:,} bytes in, {link['tx_bytes']:,} out (relayed payloads cross it twice)")
    print(f"{'caller':>7} {'when':>12} {'payload bytes':>14} {'received':>10} {'seconds':>8}  connection  outcome")
    for caller in result["callers"]:
        if caller.get("error"):
            print(f"{caller['caller']:>7}  {caller['error']}")
            continue
        for round_ in caller["rounds"]:
            how = _how(round_["connected_via"])
            for row in round_["rows"]:
                print(
                    f"{caller['caller']:>7} {round_['when']:>12} {row['bytes']:>14} {str(row['received']):>10} "
                    f"{row['seconds']:>8}  {how:<10}  {row['outcome']}"
                )


def _how(connected_via: list) -> str:
    """direct, relayed (every open connection is a /p2p-circuit one) or none (no connection open)."""
    if not connected_via:
        return "none"
    return "relayed" if all("/p2p-circuit" in a for a in connected_via) else "direct"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[16, 65536, 131072, 262144, 1048576, 8388608])
    parser.add_argument(
        "--circuit_timeout",
        type=float,
        default=420.0,
        help="how long H may take to get a reservation on R (go-libp2p's autorelay boot delay is about 3 minutes)",
    )
    parser.add_argument("--timeout", type=float, default=30.0, help="seconds per payload")
    parser.add_argument(
        "--punch_wait",
        type=float,
        default=30.0,
        help="seconds between the first round of payloads and the second (time for DCUtR)",
    )
    parser.add_argument(
        "--internet_prefix",
        default="10.214",
        help="first two octets of the emulated internet (go-libp2p starts DCUtR hole punching only on a public-looking "
        "address: 11.214 gives one; nothing leaves the namespaces either way)",
    )
    parser.add_argument("--json", help="also write the result here")
    parser.add_argument("--folder", help="where the roles write their logs and results (default: a new temp folder)")
    parser.add_argument("--role", choices=ROLES, help=argparse.SUPPRESS)
    parser.add_argument("--ip", help=argparse.SUPPRESS)
    parser.add_argument("--name", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    for name in ("circuit_timeout", "timeout"):
        if not getattr(args, name) > 0:
            parser.error(f"--{name} must be a positive number of seconds, got {getattr(args, name)}")
    if any(size <= 0 for size in args.sizes):
        parser.error(f"--sizes must be positive numbers of bytes, got {args.sizes}")
    if args.punch_wait < 0:
        parser.error(f"--punch_wait must be >= 0 seconds, got {args.punch_wait}")
    folder = Path(args.folder or tempfile.mkdtemp(prefix="relay_limits_"))
    folder.mkdir(parents=True, exist_ok=True)
    if args.role == "relay":
        asyncio.run(run_relay(folder, args.ip))
    elif args.role == "home":
        asyncio.run(run_home(folder))
    elif args.role == "caller":
        asyncio.run(
            run_caller(folder, args.name, args.ip, args.sizes, args.circuit_timeout, args.timeout, args.punch_wait)
        )
    else:
        from benchmarks.testbed.home.network import home_network_unavailable_reason

        reason = home_network_unavailable_reason()
        if reason:
            parser.error(f"the home network test-bed cannot be built here: {reason}")
        print(f"logs in {folder}", flush=True)
        result = measure(args.sizes, args.circuit_timeout, args.timeout, args.punch_wait, folder, args.internet_prefix)
        print_table(result)
        if args.json:
            Path(args.json).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
