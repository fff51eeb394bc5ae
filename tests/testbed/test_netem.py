"""The emulated-link harness (benchmarks/testbed/netem): hosts, cleanup, tbf bandwidth, the delay/loss/partition proxy,
and real hivemind DHT peers talking through the proxies.

Needs root and iproute2 (network namespaces); skipped otherwise. The bandwidth and RTT bounds are
sanity checks of the harness itself (the links must do what scenario tests will assume).
"""

import os
import signal
import statistics
import subprocess
import sys
import uuid

import pytest

from benchmarks.testbed.netem.dht_agent import DHTAgent, close_agents
from benchmarks.testbed.netem.hosts import REPO_ROOT, Testbed, cleanup_stale, list_namespaces
from benchmarks.testbed.netem.proxy import ProxySettings
from benchmarks.testbed.netem.tools import EchoClient, measure_throughput, start_echo_server

pytestmark = [pytest.mark.timeout(90), pytest.mark.netns]

ECHO_PORT = 40000


def _ours(prefix):
    return [name for name in list_namespaces() if name.startswith(prefix)]


def test_hosts_reach_each_other_but_nothing_else():
    with Testbed(2) as tb:
        a, b = tb.hosts
        assert a.ip != b.ip and a.ip.startswith("10.213.")
        assert len(_ours(tb.prefix)) == 3  # two hosts and the switch
        assert "UP" in a.exec(["ip", "-o", "link", "show", "lo"]).stdout
        # no default route: anything outside the test subnet is unreachable
        assert a.exec(["ip", "route", "get", "1.1.1.1"]).returncode != 0
        start_echo_server(b, ECHO_PORT)
        client = EchoClient(a, f"{b.ip}:{ECHO_PORT}")
        assert client.ping()["ok"]
        client.close()
    assert _ours(tb.prefix) == []


def test_cleanup_after_exception_and_killed_children():
    with pytest.raises(RuntimeError, match="test body failed"):
        with Testbed(2) as tb:
            killed = tb.hosts[0].run(["sleep", "60"])
            survivor = tb.hosts[1].run(["sleep", "60"])
            killed.send_signal(signal.SIGKILL)
            killed.wait()
            raise RuntimeError("test body failed")
    assert _ours(tb.prefix) == []
    assert survivor.wait(timeout=5) is not None  # processes inside the namespaces are killed too


def test_cleanup_stale_removes_only_dead_runs():
    code = (
        "import time\nfrom benchmarks.testbed.netem.hosts import Testbed\n"
        "tb = Testbed(2).__enter__()\nprint(tb.prefix, flush=True)\ntime.sleep(60)\n"
    )
    orphan = subprocess.Popen(
        [sys.executable, "-c", code],
        cwd=REPO_ROOT,
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
    )
    prefix = orphan.stdout.readline().strip()
    assert prefix and len(_ours(prefix)) == 3
    with Testbed(1) as live:
        assert len(_ours(prefix)) == 3, "a live run's namespaces must not be touched"
        orphan.send_signal(signal.SIGKILL)  # no chance to clean up
        orphan.wait()
        assert len(_ours(prefix)) == 3
        removed = cleanup_stale()
        assert sorted(removed) == sorted(f"{prefix}-{suffix}" for suffix in ("sw", "h0", "h1"))
        assert _ours(prefix) == [] and len(_ours(live.prefix)) == 2


def test_bandwidth_limit_applies_both_ways():
    with Testbed(2) as tb:
        a, b = tb.hosts
        tb.set_bandwidth(a, 20)
        upload = measure_throughput(a, b, nbytes=3_000_000)
        download = measure_throughput(b, a, nbytes=3_000_000, port=45001)
        assert upload["bytes"] == download["bytes"] == 3_000_000
        assert 15 <= upload["mbit_s"] <= 25, upload
        assert 15 <= download["mbit_s"] <= 25, download
        tb.set_bandwidth(a, None)
        assert measure_throughput(a, b, nbytes=3_000_000, port=45002)["mbit_s"] > 40


def test_an_asymmetric_link_limits_each_direction_on_its_own():
    """A home line (benchmarks' home_asym): 10 Mbit/s up, 50 down (tbf on each side of the host's veth)."""
    with Testbed(2) as tb:
        a, b = tb.hosts
        tb.set_bandwidth(a, 10, down_mbit=50)
        upload = measure_throughput(a, b, nbytes=2_000_000, port=45003)
        download = measure_throughput(b, a, nbytes=6_000_000, port=45004)
        assert 7 <= upload["mbit_s"] <= 12.5, upload
        assert 35 <= download["mbit_s"] <= 62, download


def test_proxy_adds_delay_keeps_order_and_stalls_lost_chunks():
    with Testbed(2) as tb:
        a, b = tb.hosts
        start_echo_server(b, ECHO_PORT)
        proxy = tb.start_proxy(b, ECHO_PORT, settings=ProxySettings(delay_ms=50))
        client = EchoClient(a, proxy.address, timeout=3.0)
        assert client.ping()["ok"]  # connect first: the RTT samples below are round trips only
        rtts = [client.ping()["rtt_ms"] for _ in range(7)]
        assert 90 <= statistics.median(rtts) <= 150, rtts

        proxy.set(delay_ms=20, jitter_ms=20)
        assert client.stream(200), "jittered chunks must come back in order"

        proxy.set(delay_ms=0, jitter_ms=0, loss=1.0, loss_penalty_ms=200)
        lossy = client.ping()["rtt_ms"]
        assert lossy >= 380, f"each direction should stall ~200 ms, got an RTT of {lossy:.0f} ms"
        with pytest.raises(ValueError, match="loss must be a probability"):
            proxy.set(loss=2)
        client.close()


def test_partition_cuts_connections_and_heal_restores():
    with Testbed(3) as tb:
        a, server, c = tb.hosts
        start_echo_server(server, ECHO_PORT)
        proxy = tb.start_proxy(server, ECHO_PORT)
        client_a = EchoClient(a, proxy.address, timeout=1.5)
        client_c = EchoClient(c, proxy.address, timeout=1.5)
        assert client_a.ping()["ok"] and client_c.ping()["ok"]

        tb.partition(a)
        cut = client_a.ping()
        assert not cut["ok"] and "Reset" in cut["error"], cut  # the open connection is dropped
        redial = client_a.ping()
        assert not redial["ok"] and redial["connected"], redial  # accepted, then blackholed
        assert client_c.ping()["ok"], "only the partitioned host is cut off"
        tb.heal(a)
        assert client_a.ping()["ok"]

        tb.partition(server)  # the proxied host itself: everyone is cut off
        assert not client_a.ping()["ok"] and not client_c.ping()["ok"]
        tb.heal(server)
        assert client_a.ping()["ok"] and client_c.ping()["ok"]

        tb.set_link_up(a, False)  # cable pulled: packets vanish, the round trip times out
        assert "timed out" in client_a.ping()["error"]
        tb.set_link_up(a, True)
        assert client_a.ping()["ok"]
        client_a.close()
        client_c.close()


@pytest.mark.slow
def test_hivemind_dht_through_proxies_partition_and_heal():
    with Testbed(2) as tb:
        a, b = tb.hosts
        proxy_a, proxy_b = tb.start_proxy(a, ECHO_PORT), tb.start_proxy(b, ECHO_PORT)
        dht_a = DHTAgent(a, ECHO_PORT, announce_port=proxy_a.port)
        assert dht_a.maddrs[0].startswith(proxy_a.maddr + "/p2p/"), "peers must dial the proxy"
        dht_b = DHTAgent(b, ECHO_PORT, announce_port=proxy_b.port, initial_peers=dht_a.maddrs)
        key = f"netem-{uuid.uuid4().hex[:8]}"

        assert dht_a.store(key, "before", timeout=10)
        assert dht_b.get(key, timeout=10) == "before"

        tb.partition(a)
        assert dht_b.store(key + "-during", "during", timeout=10)  # stored on b itself
        assert dht_a.get(key + "-during", timeout=8) is None, "a partitioned peer must not see new records"

        tb.heal(a)
        # hivemind 1.1.12 evicted and blacklisted the unreachable peer on both sides; re-join as a peer must
        assert dht_a.rejoin(dht_b.maddrs, timeout=10) == 1
        assert dht_a.get(key + "-during", timeout=10) == "during"
        close_agents([dht_a, dht_b])
