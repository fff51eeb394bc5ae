"""A hostile peer as its own process: it floods a reachable peer with dial-back probes
(peer.swarm.hivemind_seam.reachability) and asks it to dial addresses that are not its own.

Run with ``python -m benchmarks.testbed.rogue_probe --initial_peers ... --server <peer id> --count 30
--target /ip4/127.0.0.2/tcp/8080``. It sends ``--count`` probes as fast as the server answers, each naming the
``--target`` addresses (third-party ones, another peer's, a relayed one) together with, for every second probe, its
own real address; then it prints one JSON line: how many probes were answered, dialled, refused and why.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter

import hivemind

from peer.swarm.hivemind_seam.reachability import DialBackRequest, own_dialable_maddrs


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--initial_peers", nargs="+", required=True)
    parser.add_argument("--server", required=True, help="base58 peer ID of the peer to flood")
    parser.add_argument("--count", type=int, default=30)
    parser.add_argument("--target", nargs="*", default=[], help="addresses that are not this peer's")
    args = parser.parse_args(argv)

    dht = hivemind.DHT(initial_peers=args.initial_peers, host_maddrs=["/ip4/127.0.0.1/tcp/0"], start=True)
    try:
        own = dht.run_coroutine(own_dialable_maddrs)
        outcomes: Counter = Counter()
        for index in range(args.count):
            maddrs = list(args.target) + (own if index % 2 else [])
            answer = dht.run_coroutine(DialBackRequest(args.server, maddrs, timeout=10.0))
            if answer.reachable:
                outcomes["reachable"] += 1
            elif answer.refused is None:
                outcomes["unreachable"] += 1
            else:
                outcomes["refused: " + answer.refused.split(":")[0]] += 1
        print(json.dumps({"probes": args.count, "own": own, "outcomes": dict(outcomes)}), flush=True)
    finally:
        dht.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
