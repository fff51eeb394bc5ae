"""Home volunteers behind NAT, in network namespaces: the testbed of issue 27.

Layout of one :class:`HomeNetwork` (``P`` is the per-run prefix, e.g. ``lhhome4242r1a2b``; k comes from the pid)::

                         netns P-inet: bridge br0, the "internet" segment 10.214.k.0/24
      netns P-pub0  eth0 10.214.k.1 ──┤ (public hosts: the aux peer, a public trainer; reachable by everyone)
      netns P-pub1  eth0 10.214.k.2 ──┤
      netns P-rtr0  wan0 10.214.k.101 ┤ lan0 192.168.1.1 ── eth0 192.168.1.2  netns P-home0 (volunteer 0)
      netns P-rtr1  wan0 10.214.k.102 ┘ lan0 192.168.2.1 ── eth0 192.168.2.2  netns P-home1 (volunteer 1)

- A home router forwards between its LAN and WAN and masquerades what leaves by the WAN
  (``iptables -t nat -A POSTROUTING -o wan0 -j MASQUERADE``); its FORWARD chain drops everything else that comes in
  from the WAN unless it belongs to a connection the volunteer opened, so nothing on the internet can dial a
  volunteer, as behind a home router with no port forwarded. ``forward_port`` adds a port forward (DNAT).
- A volunteer's only route out is its router (default route); public hosts have no route to any home LAN.
- The internet segment is ``internet_prefix``.k.0/24, 10.214 by default. go-libp2p counts 10.x as a private address
  and starts DCUtR hole punching only on a public one: ``internet_prefix="11.214"`` makes the hosts look public (the
  namespaces still have no route to anything outside them; benchmarks/relay_limits.py).
- Home links are asymmetric (``HomeLink``): tbf on the router's WAN (the volunteer's upload) and on its LAN side
  (the volunteer's download), 10 and 50 Mbit/s by default. Public hosts' links are unlimited unless ``public_mbit``.

Nothing is created in the root namespace, and nothing here has a route outside the test addresses. ``close()`` (the
context manager's exit, or atexit) kills every process in the namespaces and deletes them; ``cleanup_stale()``
removes what a killed run left behind.
"""

from __future__ import annotations

import atexit
import logging
import os
import re
import secrets
import shutil
import subprocess
from dataclasses import dataclass, field
from typing import List, Optional

from benchmarks.testbed.netem.hosts import Host, NamespaceLifecycle, _kill_namespace, _sh, tbf_args
from benchmarks.testbed.netem.hosts import cleanup_stale as hosts_cleanup_stale

logger = logging.getLogger(__name__)

NAME_ROOT = "lhhome"
# netns names look like lhhome<pid>r<hex>-inet / -pub0 / -rtr0 / -home0; the pid tells dead runs apart
_NAME_RE = re.compile(rf"^{NAME_ROOT}(\d+)r[0-9a-f]+-")
BRIDGE = "br0"
WAN, LAN, ETH = "wan0", "lan0", "eth0"


@dataclass(frozen=True)
class HomeLink:
    """A home broadband line, as its owner buys it."""

    up_mbit: float = 10.0
    """The volunteer's upload (what leaves the router by its WAN)."""
    down_mbit: float = 50.0
    """The volunteer's download (what the router sends down the LAN to it)."""

    def __post_init__(self):
        for name in ("up_mbit", "down_mbit"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be a positive number of Mbit/s, got {getattr(self, name)!r}")

    def describe(self) -> str:
        return f"{self.up_mbit:g} up / {self.down_mbit:g} down Mbit/s"


@dataclass(eq=False)
class HomeHost(Host):
    """A volunteer's machine behind a home router: ``ip`` is its private LAN address, ``wan_ip`` the router's public
    address its connections appear to come from."""

    router: str = ""
    """The router's network namespace."""
    wan_ip: str = ""
    link: HomeLink = field(default_factory=HomeLink)
    forwarded_ports: List[int] = field(default_factory=list)


def cleanup_stale() -> List[str]:
    """Remove namespaces of home networks whose creating process is dead (a SIGKILLed run); returns their names."""
    return hosts_cleanup_stale(_NAME_RE, "home-network")


def home_network_unavailable_reason() -> Optional[str]:
    """Why a HomeNetwork cannot be built here (a pytest skip reason), or None if it can."""
    from benchmarks.testbed.netem.hosts import netns_unavailable_reason

    reason = netns_unavailable_reason()
    if reason:
        return reason
    if shutil.which("iptables") is None:
        return "`iptables` not found: install it (`bash scripts/setup_env.sh --test` does, as root)"
    probe = f"{NAME_ROOT}probe{os.getpid()}"
    try:
        _sh("ip", "netns", "add", probe)
        result = subprocess.run(
            ["ip", "netns", "exec", probe, "iptables", "-t", "nat", "-A", "POSTROUTING", "-j", "MASQUERADE"],
            capture_output=True,
            text=True,
            timeout=10,
        )
        if result.returncode != 0:
            return f"iptables cannot add a NAT rule in a network namespace here: {result.stderr.strip()}"
    finally:
        _sh("ip", "netns", "del", probe, check=False)
    return None


class HomeNetwork(NamespaceLifecycle):
    """Public hosts and NAT'd volunteers; a context manager that removes everything it built on exit.

    >>> with HomeNetwork(public=1, homes=2) as net:
    ...     aux = net.public[0]                       # listens on aux.ip, reachable by all
    ...     volunteer = net.homes[0]                  # dials out through its router, cannot be dialled
    ...     net.forward_port(volunteer, 40000)        # unless its router forwards a port: wan_ip:40000
    """

    __test__ = False

    def __init__(
        self,
        public: int,
        homes: int,
        *,
        link: HomeLink = HomeLink(),
        public_mbit: Optional[float] = None,
        subnet_index: Optional[int] = None,
        internet_prefix: str = "10.214",
    ):
        if not 0 <= public <= 50 or not 0 <= homes <= 50 or public + homes == 0:
            raise ValueError(f"need 0..50 public hosts and 0..50 homes, not both 0; got {public} and {homes}")
        if public_mbit is not None and not public_mbit > 0:
            raise ValueError(f"public_mbit must be a positive number of Mbit/s or None, got {public_mbit!r}")
        if subnet_index is None:
            subnet_index = os.getpid() % 250 + 1
        if not 0 <= subnet_index <= 255:
            raise ValueError(f"subnet_index must be in 0..255 ({internet_prefix}.k.0/24), got {subnet_index}")
        octets = internet_prefix.split(".")
        if (
            len(octets) != 2
            or not all(o.isdigit() and 0 <= int(o) <= 255 for o in octets)
            or octets[0] in ("127", "192")
        ):
            raise ValueError(
                f"internet_prefix must be two octets such as 10.214 (not 127.x or 192.x: the homes' LANs are "
                f"192.168.i.0/24), got {internet_prefix!r}"
            )
        self.num_public, self.num_homes, self.link, self.public_mbit = public, homes, link, public_mbit
        self._net = f"{internet_prefix}.{subnet_index}"
        self.subnet = f"{self._net}.0/24"
        self.prefix = f"{NAME_ROOT}{os.getpid()}r{secrets.token_hex(2)}"
        self.internet = f"{self.prefix}-inet"
        self.public: List[Host] = []
        self.homes: List[HomeHost] = []
        self._created: List[str] = []

    # ---- lifecycle

    def _sweep(self) -> None:
        cleanup_stale()

    def close(self) -> None:
        """Kill every process in the namespaces and delete them (their veths and rules go with them). Idempotent."""
        for name in reversed(self._created):
            _kill_namespace(name)
        self._created.clear()
        atexit.unregister(self.close)

    def namespaces(self) -> List[str]:
        return list(self._created)

    def _add_namespace(self, name: str) -> None:
        _sh("ip", "netns", "add", name)
        self._created.append(name)
        _sh("ip", "-n", name, "link", "set", "lo", "up")
        _sh("ip", "netns", "exec", name, "sh", "-c", "echo 1 > /proc/sys/net/ipv6/conf/all/disable_ipv6", check=False)

    def _plug(self, namespace: str, port: str, iface: str, address: str) -> None:
        """A veth from the internet bridge (``port``) into ``namespace`` (``iface`` with ``address``/24)."""
        _sh("ip", "-n", self.internet, "link", "add", port, "type", "veth", "peer", "name", iface, "netns", namespace)
        _sh("ip", "-n", self.internet, "link", "set", port, "master", BRIDGE)
        _sh("ip", "-n", self.internet, "link", "set", port, "up")
        _sh("ip", "-n", namespace, "addr", "add", f"{address}/24", "dev", iface)
        _sh("ip", "-n", namespace, "link", "set", iface, "up")

    def _iptables(self, namespace: str, *rule: str) -> None:
        _sh("ip", "netns", "exec", namespace, "iptables", "-w", "5", *rule)

    def _build(self) -> None:
        self._add_namespace(self.internet)
        _sh("ip", "-n", self.internet, "link", "add", BRIDGE, "type", "bridge")
        _sh("ip", "-n", self.internet, "link", "set", BRIDGE, "up")
        for index in range(self.num_public):
            host = Host(name=f"{self.prefix}-pub{index}", ip=f"{self._net}.{index + 1}", index=index)
            host.bridge_port = f"pub{index}"
            self._add_namespace(host.name)
            self._plug(host.name, host.bridge_port, ETH, host.ip)
            if self.public_mbit is not None:
                for namespace, dev in ((host.name, ETH), (self.internet, host.bridge_port)):
                    _sh("tc", "-n", namespace, "qdisc", "add", "dev", dev, "root", *tbf_args(self.public_mbit))
            self.public.append(host)
        for index in range(self.num_homes):
            self.homes.append(self._build_home(index))
        logger.info(
            "home network %s: %d public hosts, %d homes (%s) on %s",
            self.prefix,
            self.num_public,
            self.num_homes,
            self.link.describe(),
            self.subnet,
        )

    def _build_home(self, index: int) -> HomeHost:
        lan = f"192.168.{index + 1}"
        host = HomeHost(
            name=f"{self.prefix}-home{index}",
            ip=f"{lan}.2",
            index=index,
            bridge_port=f"rtr{index}",
            router=f"{self.prefix}-rtr{index}",
            wan_ip=f"{self._net}.{101 + index}",
            link=self.link,
        )
        self._add_namespace(host.router)
        self._add_namespace(host.name)
        self._plug(host.router, host.bridge_port, WAN, host.wan_ip)
        # the LAN cable: router lan0 <-> volunteer eth0, created in the router and moved straight into the home
        _sh("ip", "-n", host.router, "link", "add", LAN, "type", "veth", "peer", "name", ETH, "netns", host.name)
        _sh("ip", "-n", host.router, "addr", "add", f"{lan}.1/24", "dev", LAN)
        _sh("ip", "-n", host.router, "link", "set", LAN, "up")
        _sh("ip", "-n", host.name, "addr", "add", f"{host.ip}/24", "dev", ETH)
        _sh("ip", "-n", host.name, "link", "set", ETH, "up")
        _sh("ip", "-n", host.name, "route", "add", "default", "via", f"{lan}.1")
        _sh("ip", "netns", "exec", host.router, "sh", "-c", "echo 1 > /proc/sys/net/ipv4/ip_forward")
        # a home router: out by the WAN is masqueraded; in from the WAN only what answers the volunteer's own
        # connections (the NAT's state table); no port forwarded
        self._iptables(host.router, "-t", "nat", "-A", "POSTROUTING", "-o", WAN, "-j", "MASQUERADE")
        self._iptables(host.router, "-P", "FORWARD", "DROP")
        self._iptables(host.router, "-A", "FORWARD", "-i", LAN, "-o", WAN, "-j", "ACCEPT")
        self._iptables(
            host.router, "-A", "FORWARD", "-i", WAN, "-o", LAN, "-m", "conntrack", "--ctstate", "ESTABLISHED,RELATED",
            "-j", "ACCEPT",
        )  # fmt: skip
        # the asymmetric line: upload shaped where it leaves the router, download where the router hands it down
        _sh("tc", "-n", host.router, "qdisc", "add", "dev", WAN, "root", *tbf_args(self.link.up_mbit))
        _sh("tc", "-n", host.router, "qdisc", "add", "dev", LAN, "root", *tbf_args(self.link.down_mbit))
        return host

    # ---- port forwarding (scenario c)

    def forward_port(self, home: HomeHost, port: int) -> str:
        """Forward TCP ``port`` on the router's WAN address to the volunteer (DNAT), as a user does in the router's
        settings; returns the public multiaddr prefix ``/ip4/<wan_ip>/tcp/<port>`` the volunteer announces."""
        if not 1 <= port <= 65535:
            raise ValueError(f"port must be in 1..65535, got {port}")
        target = f"{home.ip}:{port}"
        self._iptables(
            home.router, "-t", "nat", "-A", "PREROUTING", "-i", WAN, "-p", "tcp", "--dport", str(port),
            "-j", "DNAT", "--to-destination", target,
        )  # fmt: skip
        self._iptables(
            home.router, "-A", "FORWARD", "-i", WAN, "-o", LAN, "-p", "tcp", "-d", home.ip, "--dport", str(port),
            "-m", "conntrack", "--ctstate", "NEW", "-j", "ACCEPT",
        )  # fmt: skip
        home.forwarded_ports.append(port)
        return f"/ip4/{home.wan_ip}/tcp/{port}"

    # ---- what the tests check

    def nat_rules(self, home: HomeHost) -> str:
        """The router's NAT table (``iptables -t nat -S``)."""
        return _sh("ip", "netns", "exec", home.router, "iptables", "-w", "5", "-t", "nat", "-S").stdout

    def qdiscs(self, home: HomeHost) -> str:
        """The router's qdiscs (``tc qdisc show``): the tbf rates of the home line."""
        return _sh("tc", "-n", home.router, "qdisc", "show").stdout

    @staticmethod
    def interface_bytes(host: Host, iface: str = ETH) -> dict:
        """Bytes received and sent by ``iface`` of ``host`` so far (kernel counters of its namespace)."""
        out = _sh("ip", "-n", host.name, "-s", "-j", "link", "show", "dev", iface).stdout
        import json

        stats = json.loads(out)[0]["stats64"]
        return {"rx_bytes": int(stats["rx"]["bytes"]), "tx_bytes": int(stats["tx"]["bytes"])}
