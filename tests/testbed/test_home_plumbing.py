"""The home-network testbed itself (benchmarks/testbed/home/network.py): a home router's NAT lets the volunteer dial
out and nothing dial in, a forwarded port lets one port in, the home line is 10 up / 50 down Mbit/s, and everything
is removed afterwards. Needs root, iproute2 and iptables (skipped otherwise); the peers' scenarios are the opt-in
``home_net`` suite (test_home_network.py)."""

import pytest

from benchmarks.testbed.home.network import HomeNetwork, home_network_unavailable_reason
from benchmarks.testbed.netem.hosts import list_namespaces
from benchmarks.testbed.netem.tools import EchoClient, measure_throughput, start_echo_server

_REASON = home_network_unavailable_reason()
pytestmark = [
    pytest.mark.netns,
    pytest.mark.timeout(120),
    pytest.mark.skipif(_REASON is not None, reason=_REASON or ""),
]

PORT = 40000


def _ours(prefix):
    return [name for name in list_namespaces() if name.startswith(prefix)]


def test_nat_lets_volunteers_dial_out_and_nobody_dial_in():
    with HomeNetwork(public=1, homes=2) as net:
        public, (home, other) = net.public[0], net.homes
        assert len(_ours(net.prefix)) == 1 + 1 + 2 * 2  # internet, one public host, a router and a home per home
        assert "-A POSTROUTING -o wan0 -j MASQUERADE" in net.nat_rules(home)
        assert "DNAT" not in net.nat_rules(home), "no port is forwarded unless asked"

        start_echo_server(public, PORT)
        out = EchoClient(home, f"{public.ip}:{PORT}", timeout=2.0)
        assert out.ping()["ok"], "a volunteer must reach the internet through its router"
        # the public side sees the router's address, not the volunteer's (source NAT)
        seen = public.exec(["ss", "-tn"]).stdout
        assert home.wan_ip in seen and home.ip not in seen, seen
        out.close()

        start_echo_server(home, PORT)
        for dialer, address in (
            (public, f"{home.wan_ip}:{PORT}"),  # the router's public address: nothing forwarded
            (public, f"{home.ip}:{PORT}"),  # the private address: no route from the internet
            (other, f"{home.wan_ip}:{PORT}"),  # another NAT'd volunteer
        ):
            client = EchoClient(dialer, address, timeout=1.0)
            assert not client.ping()["ok"], f"{dialer.name} dialled {address} behind a NAT"
            client.close()

        net.forward_port(home, PORT)
        assert "DNAT" in net.nat_rules(home)
        forwarded = EchoClient(public, f"{home.wan_ip}:{PORT}", timeout=2.0)
        assert forwarded.ping()["ok"], "a forwarded port must let the internet in"
        forwarded.close()
        closed = EchoClient(public, f"{home.wan_ip}:{PORT + 1}", timeout=1.0)
        assert not closed.ping()["ok"], "only the forwarded port is open"
        closed.close()
    assert _ours(net.prefix) == []


def test_home_line_is_ten_up_and_fifty_down():
    with HomeNetwork(public=1, homes=1) as net:
        public, home = net.public[0], net.homes[0]
        qdiscs = net.qdiscs(home)
        assert "rate 10Mbit" in qdiscs and "rate 50Mbit" in qdiscs, qdiscs
        upload = measure_throughput(home, public, nbytes=2_500_000)
        assert 7 <= upload["mbit_s"] <= 12, upload
        # the download crosses the router from the internet: through a forwarded port
        net.forward_port(home, 45001)
        download = measure_throughput(public, home, nbytes=8_000_000, port=45001, connect_to=f"{home.wan_ip}:45001")
        assert 35 <= download["mbit_s"] <= 60, download
        before = HomeNetwork.interface_bytes(public)
        assert before["rx_bytes"] >= 2_500_000 and before["tx_bytes"] >= 8_000_000, before


def test_cleanup_after_an_exception():
    with pytest.raises(RuntimeError, match="body failed"):
        with HomeNetwork(public=1, homes=1) as net:
            net.homes[0].run(["sleep", "60"])
            raise RuntimeError("body failed")
    assert _ours(net.prefix) == []


def test_the_internet_prefix_is_checked_before_anything_is_built():
    """``internet_prefix`` (benchmarks/relay_limits.py passes 11.214 so that go-libp2p sees public addresses) must
    be two octets that clash with neither loopback nor the homes' 192.168.i.0/24 LANs."""
    for bad in ("192.168", "127.0", "10", "10.214.1", "10.x", "10.300"):
        with pytest.raises(ValueError, match="internet_prefix must be two octets"):
            HomeNetwork(public=1, homes=1, internet_prefix=bad)
    assert HomeNetwork(public=1, homes=1, internet_prefix="11.214", subnet_index=7).subnet == "11.214.7.0/24"
