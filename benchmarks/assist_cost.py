"""What assisting client-mode trainers costs the aux peer's link, measured with real peers on 127.0.0.1.

An aux peer with its default ``--assist_in_averaging`` (it assists while client-mode trainers are online) and
``--clients`` trainers that nobody can dial (``--reachability private``) train the tiny preset for ``--seconds``. A
client-mode peer sends and receives everything through reachable peers, and here the aux is the only one, so the
bytes the trainers' own traffic counters publish (their round health: averaging parts and state, sent and
received) all cross the aux's link. The table gives, per client trainer, bytes/s through the aux, bytes per averaging
round and the rounds it averaged in.

    python -m benchmarks.assist_cost [--clients 2] [--seconds 150] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.testbed.aux import RUN_ID, api_state, free_port, start_aux, swarm_processes, wait_for
from benchmarks.testbed.trainers import start_trainer


def client_health(url: str) -> dict:
    """label -> the latest round health each trainer published (from the aux's /api/state)."""
    health = {}
    for peer in api_state(url)["swarm"]["peers"]:
        if peer.get("health"):
            health[peer["peer"]] = peer["health"]["totals"]
    return health


def measure(clients: int, seconds: float, folder: Path, aux_args=()) -> dict:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with swarm_processes() as procs:
        aux = start_aux("aux", folder, port, "--alive_window", 30, *aux_args)
        procs.append(aux)
        addrs = aux.initial_peers(timeout=120)
        for index in range(clients):
            trainer = start_trainer(
                folder, f"client{index}", RUN_ID, initial_peers=addrs, extra=["--reachability", "private"]
            )
            procs.append(trainer)
        aux.wait_for(r"Assisting in averaging", timeout=180)
        wait_for(lambda: len(client_health(url)) >= clients, timeout=240, what="every client's round health")
        first, started = client_health(url), time.monotonic()
        time.sleep(seconds)
        last, elapsed = client_health(url), time.monotonic() - started
    rows = []
    for label, after in last.items():
        before = first.get(label)
        if before is None:
            continue
        moved = (after["bytes_sent"] + after["bytes_received"]) - (before["bytes_sent"] + before["bytes_received"])
        rounds = after["rounds_ok"] - before["rounds_ok"]
        joined = after["rounds_joined"] - before["rounds_joined"]
        rows.append(
            {
                "client": label,
                "bytes_per_second": moved / elapsed,
                "bytes_per_round": moved / rounds if rounds else None,
                "rounds_ok": rounds,
                "rounds_joined": joined,
            }
        )
    return {"clients": clients, "seconds": round(elapsed, 1), "aux_args": [str(a) for a in aux_args], "rows": rows}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=2)
    parser.add_argument("--seconds", type=float, default=150.0)
    parser.add_argument("--json", help="also write the result here")
    parser.add_argument("--folder", help="keep the peers' logs here (default: a temporary folder, removed)")
    parser.add_argument("--assist_refresh", type=float, help="the aux's --assist_refresh (default: its own)")
    args = parser.parse_args(argv)
    aux_args = ["--assist_refresh", args.assist_refresh] if args.assist_refresh is not None else []
    if args.folder:
        Path(args.folder).mkdir(parents=True, exist_ok=True)
        result = measure(args.clients, args.seconds, Path(args.folder), aux_args)
    else:
        with tempfile.TemporaryDirectory(prefix="assist_cost_") as folder:
            result = measure(args.clients, args.seconds, Path(folder), aux_args)
    print(
        f"aux assisting {result['clients']} client-mode trainers, tiny preset, {result['seconds']} s on 127.0.0.1 "
        f"{' '.join(result['aux_args'])}"
    )
    print(f"{'client':<24} {'KB/s via aux':>12} {'KB/round':>9} {'rounds ok/joined':>17}")
    for row in result["rows"]:
        per_round = "-" if row["bytes_per_round"] is None else f"{row['bytes_per_round'] / 1e3:.0f}"
        print(
            f"{row['client'][:24]:<24} {row['bytes_per_second'] / 1e3:>12.1f} {per_round:>9} "
            f"{row['rounds_ok']:>8}/{row['rounds_joined']}"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
