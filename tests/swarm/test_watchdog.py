"""peer.swarm.watchdog.DHTWatchdog: real hivemind DHT peers in network namespaces re-join after a partition on their
own (without it they stay apart for good: see tests/testbed/test_netem.py, which re-joins by hand).

Needs root and iproute2; skipped otherwise. About 30 s.
"""

from __future__ import annotations

import time
import uuid

import pytest

from benchmarks.testbed.netem.dht_agent import DHTAgent, close_agents
from benchmarks.testbed.netem.hosts import Testbed

pytestmark = [pytest.mark.timeout(120), pytest.mark.netns, pytest.mark.slow]

PORT = 40000


def _poll(condition, timeout: float, interval: float = 0.5):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(interval)
    return condition()


def test_partitioned_dht_peers_rejoin_by_themselves():
    with Testbed(2) as tb:
        a, b = tb.hosts
        proxy_a, proxy_b = tb.start_proxy(a, PORT), tb.start_proxy(b, PORT)
        dht_a = DHTAgent(a, PORT, announce_port=proxy_a.port, watchdog_period=1.0)
        dht_b = DHTAgent(b, PORT, announce_port=proxy_b.port, initial_peers=dht_a.maddrs, watchdog_period=1.0)
        key = f"watchdog-{uuid.uuid4().hex[:8]}"
        assert dht_a.store(key, "before", timeout=10)
        assert dht_b.get(key, timeout=10) == "before"

        tb.partition(a)
        # failed requests on both sides empty both routing tables (hivemind evicts and bans the other peer)
        dht_b.store(key + "-during", "during", timeout=5)
        assert dht_a.get(key + "-during", timeout=5) is None
        assert _poll(lambda: dht_a.watchdog()["isolated"] and dht_b.watchdog()["isolated"], timeout=30), (
            "both peers should notice they are cut off"
        )

        tb.heal(a)
        # no manual re-join: the watchdogs ping the lost peers until they answer
        assert _poll(lambda: dht_a.get(key + "-during", timeout=5) == "during", timeout=45), (
            "the partitioned peer did not re-join after the partition healed"
        )
        for agent in (dht_a, dht_b):  # a watchdog notices at its next check (1 s)
            assert _poll(lambda: (lambda s: not s["isolated"] and s["rejoins"] >= 1)(agent.watchdog()), timeout=10), (
                agent.watchdog()
            )
        assert dht_b.store(key + "-after", "after", timeout=10)
        assert dht_a.get(key + "-after", timeout=10) == "after"
        close_agents([dht_a, dht_b])
