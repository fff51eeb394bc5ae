"""Test hosts as network namespaces on a private bridge, with tbf bandwidth limits.

Layout of one :class:`Testbed` (``P`` is the per-run prefix, e.g. ``lhnet4242r1a2b``)::

    netns P-h0: lo, eth0 10.213.k.1/24 --veth-- p0 ┐
    netns P-h1: lo, eth0 10.213.k.2/24 --veth-- p1 ┼ br0 in netns P-sw (the "switch")
    ...                                            ┘

Nothing is created in the root namespace, so the machine's real interfaces are never touched, and
the hosts have no default route: their traffic can only reach loopback or the other test hosts.
"""

from __future__ import annotations

import atexit
import logging
import os
import re
import secrets
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Union

import psutil

from benchmarks.testbed.netem.proxy import ProxyHandle, ProxySettings

logger = logging.getLogger(__name__)

NAME_ROOT = "lhnet"
# netns names look like lhnet<pid>r<hex>-h0 / -sw; the pid lets cleanup_stale() tell dead runs apart
_NAME_RE = re.compile(rf"^{NAME_ROOT}(\d+)r[0-9a-f]+-")
REPO_ROOT = Path(__file__).resolve().parents[3]
HOST_IFACE = "eth0"
BRIDGE = "br0"

Command = Union[str, Sequence[str]]


class NetemError(RuntimeError):
    """An `ip`/`tc` command that builds the testbed failed."""


def _sh(*args: str, check: bool = True, timeout: float = 10.0) -> subprocess.CompletedProcess:
    result = subprocess.run(list(args), capture_output=True, text=True, timeout=timeout)
    if check and result.returncode != 0:
        raise NetemError(f"`{' '.join(args)}` failed (rc={result.returncode}): {result.stderr.strip()}")
    return result


def list_namespaces() -> List[str]:
    """Names of all named network namespaces (``ip netns list``), without the ``(id: N)`` suffix."""
    out = _sh("ip", "netns", "list").stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def _kill_namespace(name: str) -> None:
    """SIGKILL every process inside a namespace, then delete it (its veth ends vanish with it)."""
    pids = _sh("ip", "netns", "pids", name, check=False).stdout.split()
    procs = []
    for pid in pids:
        try:
            proc = psutil.Process(int(pid))
            proc.kill()
            procs.append(proc)
        except (psutil.NoSuchProcess, ValueError):
            pass
    psutil.wait_procs(procs, timeout=5)
    _sh("ip", "netns", "del", name, check=False)


def cleanup_stale(name_re: "re.Pattern[str]" = _NAME_RE, what: str = "netem") -> List[str]:
    """Remove namespaces left by testbeds whose creating process is dead (e.g. SIGKILLed pytest).

    ``name_re``'s first group is the creating process's pid. Returns the names removed. Namespaces of live runs
    (parallel test sessions) are left alone.
    """
    removed = []
    for name in list_namespaces():
        match = name_re.match(name)
        if match and not psutil.pid_exists(int(match.group(1))):
            _kill_namespace(name)
            removed.append(name)
    if removed:
        logger.info("removed %d stale %s namespaces: %s", len(removed), what, removed)
    return removed


def netns_unavailable_reason() -> Optional[str]:
    """Why a Testbed cannot be built here (a pytest skip reason), or None if it can."""
    import shutil

    if os.geteuid() != 0:
        return "network namespaces need root (run the tests as root, e.g. in the CI container)"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"`{tool}` not found: install iproute2"
    probe = f"lhnetprobe{os.getpid()}"
    result = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if result.returncode != 0:
        return f"cannot create network namespaces here: {result.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def tbf_args(mbit: float) -> List[str]:
    """tbf parameters for a rate: ~5 ms of burst (at least a few MTUs), ~50 ms of queue."""
    rate_bytes = mbit * 1e6 / 8
    burst = max(int(rate_bytes * 0.005), 16 * 1024)
    limit = burst + int(rate_bytes * 0.05)
    return ["tbf", "rate", f"{mbit}mbit", "burst", str(burst), "limit", str(limit)]


@dataclass(eq=False)  # identity semantics: hosts are used as set members and compared with `is`
class Host:
    """One emulated machine: a network namespace with loopback and one address on the test bridge."""

    name: str
    """Network namespace name."""
    ip: str
    """IPv4 address of this host on the test bridge."""
    index: int
    """Position in the testbed (0-based)."""
    bridge_port: str = field(repr=False, default="")
    """Name of the bridge-side veth end inside the switch namespace."""
    started: List[subprocess.Popen] = field(repr=False, default_factory=list)
    """Processes ``run`` started: killed at close even if `ip netns exec` had not entered the namespace yet (on a
    busy machine ``ip netns pids`` may not list them)."""

    def command(self, cmd: Command) -> List[str]:
        """Argument vector that runs ``cmd`` inside this namespace (a str runs through ``sh -c``)."""
        argv = ["sh", "-c", cmd] if isinstance(cmd, str) else list(cmd)
        return ["ip", "netns", "exec", self.name, *argv]

    def run(self, cmd: Command, **popen_kwargs) -> subprocess.Popen:
        """Start ``cmd`` inside this host; `ip netns exec` execs, so the Popen pid is the process itself."""
        popen_kwargs.setdefault("cwd", str(REPO_ROOT))
        popen_kwargs.setdefault("env", _child_env())
        proc = subprocess.Popen(self.command(cmd), **popen_kwargs)
        self.started.append(proc)
        return proc

    def exec(self, cmd: Command, timeout: float = 30.0, check: bool = False) -> subprocess.CompletedProcess:
        """Run ``cmd`` inside this host to completion and capture its output as text."""
        return subprocess.run(
            self.command(cmd),
            capture_output=True,
            text=True,
            timeout=timeout,
            check=check,
            cwd=str(REPO_ROOT),
            env=_child_env(),
        )

    def python(self, *args: str, **popen_kwargs) -> subprocess.Popen:
        """Start the venv's python inside this host: ``host.python("-m", "pkg.mod", "--flag")``,
        ``host.python("-c", code)``. The repository root is on PYTHONPATH, so ``-m benchmarks.testbed.netem...``
        works."""
        return self.run([sys.executable, *args], **popen_kwargs)


def _child_env() -> Dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    env.setdefault("OMP_NUM_THREADS", "1")  # several peers share a 2-core machine
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


class NamespaceLifecycle:
    """Entering sweeps up dead runs' namespaces (``_sweep``), then builds (``_build``); a failed build, exiting, or an
    interpreter exit without ``__exit__`` closes (``close``)."""

    def __enter__(self):
        self._sweep()
        atexit.register(self.close)  # an interpreter exit without __exit__ still cleans up
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()


class Testbed(NamespaceLifecycle):
    """N hosts on one bridge; a context manager that removes everything it built on exit.

    >>> with Testbed(2) as tb:
    ...     a, b = tb.hosts
    ...     tb.set_bandwidth(a, 20)                 # 20 Mbit/s both ways on a's link
    ...     proxy = tb.start_proxy(b, target_port=40000)
    ...     proxy.set(delay_ms=25)                  # +50 ms RTT on connections to b:proxy.port
    ...     tb.partition(a); tb.heal(a)
    """

    __test__ = False  # not a pytest test class despite the name

    def __init__(self, num_hosts: int, *, subnet_index: Optional[int] = None):
        """
        :param num_hosts: how many hosts to create (1..250).
        :param subnet_index: k in 10.213.k.0/24; derived from the pid when None, so parallel runs differ.
        """
        if not 1 <= num_hosts <= 250:
            raise ValueError(f"num_hosts must be between 1 and 250, got {num_hosts}")
        if subnet_index is None:
            subnet_index = os.getpid() % 250 + 1
        if not 0 <= subnet_index <= 255:
            raise ValueError(f"subnet_index must be in 0..255 (10.213.k.0/24), got {subnet_index}")
        self.num_hosts = num_hosts
        self.subnet = f"10.213.{subnet_index}.0/24"
        self.prefix = f"{NAME_ROOT}{os.getpid()}r{secrets.token_hex(2)}"
        self.switch = f"{self.prefix}-sw"
        self.hosts: List[Host] = []
        self.proxies: List[ProxyHandle] = []
        self._subnet_index = subnet_index
        self._created: List[str] = []
        self._partitioned: set = set()

    # ---- lifecycle ----

    def _sweep(self) -> None:
        cleanup_stale()

    def _add_namespace(self, name: str) -> None:
        _sh("ip", "netns", "add", name)
        self._created.append(name)
        _sh("ip", "-n", name, "link", "set", "lo", "up")
        # no IPv6 chatter (router solicitations, DAD) eating into the bandwidth budget
        _sh("ip", "netns", "exec", name, "sh", "-c", "echo 1 > /proc/sys/net/ipv6/conf/all/disable_ipv6", check=False)

    def _build(self) -> None:
        self._add_namespace(self.switch)
        _sh("ip", "-n", self.switch, "link", "add", BRIDGE, "type", "bridge")
        _sh("ip", "-n", self.switch, "link", "set", BRIDGE, "up")
        for index in range(self.num_hosts):
            host = Host(
                name=f"{self.prefix}-h{index}",
                ip=f"10.213.{self._subnet_index}.{index + 1}",
                index=index,
                bridge_port=f"p{index}",
            )
            self._add_namespace(host.name)
            # created inside the switch namespace, the other end moved straight into the host: never in root ns
            _sh(
                "ip",
                "-n",
                self.switch,
                "link",
                "add",
                host.bridge_port,
                "type",
                "veth",
                "peer",
                "name",
                HOST_IFACE,
                "netns",
                host.name,
            )
            _sh("ip", "-n", self.switch, "link", "set", host.bridge_port, "master", BRIDGE)
            _sh("ip", "-n", self.switch, "link", "set", host.bridge_port, "up")
            _sh("ip", "-n", host.name, "addr", "add", f"{host.ip}/24", "dev", HOST_IFACE)
            _sh("ip", "-n", host.name, "link", "set", HOST_IFACE, "up")
            self.hosts.append(host)
        logger.info("testbed %s: %d hosts on %s", self.prefix, self.num_hosts, self.subnet)

    def close(self) -> None:
        """Stop proxies, kill every process in the namespaces, delete the namespaces. Idempotent."""
        for proxy in self.proxies:
            proxy.stop()
        self.proxies.clear()
        for name in reversed(self._created):
            _kill_namespace(name)
        self._created.clear()
        for host in self.hosts:
            for proc in host.started:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait(timeout=5)
            host.started.clear()
        atexit.unregister(self.close)

    def __getitem__(self, index: int) -> Host:
        return self.hosts[index]

    # ---- link emulation ----

    def set_bandwidth(self, host: Host, mbit: Optional[float], *, down_mbit: Optional[float] = None) -> None:
        """Limit ``host``'s link to ``mbit`` Mbit/s in each direction (None removes the limit); with ``down_mbit``,
        ``mbit`` is the upload and ``down_mbit`` the download (an asymmetric home line).

        Egress: tbf on the host's eth0. Ingress: tbf on the bridge-side veth's egress, i.e. what the
        switch sends to the host.
        """
        down = mbit if down_mbit is None else down_mbit
        for rate in (mbit, down):
            if rate is not None and not rate > 0:
                raise ValueError(f"mbit must be a positive number of Mbit/s or None for unlimited, got {rate}")
        for netns, dev, rate in ((host.name, HOST_IFACE, mbit), (self.switch, host.bridge_port, down)):
            _sh("tc", "-n", netns, "qdisc", "del", "dev", dev, "root", check=False)
            if rate is not None:
                _sh("tc", "-n", netns, "qdisc", "add", "dev", dev, "root", *tbf_args(rate))

    def set_link_up(self, host: Host, up: bool) -> None:
        """Pull (or plug back) ``host``'s cable at the switch: packets are dropped, sockets stall."""
        _sh("ip", "-n", self.switch, "link", "set", host.bridge_port, "up" if up else "down")

    # ---- proxies and partitions ----

    def start_proxy(
        self,
        host: Host,
        target_port: int,
        *,
        listen_port: int = 0,
        settings: Optional[ProxySettings] = None,
        ready_timeout: float = 15.0,
    ) -> ProxyHandle:
        """Start a latency/loss/partition proxy on ``host`` forwarding ``host.ip:listen_port`` to
        ``host.ip:target_port`` (listen_port 0 picks a free port, see ``handle.port``)."""
        control = Path("/tmp") / f"{self.prefix}-h{host.index}-{target_port}-{len(self.proxies)}.sock"
        handle = ProxyHandle.launch(
            host,
            listen=f"{host.ip}:{listen_port}",
            target=f"{host.ip}:{target_port}",
            control_path=control,
            settings=settings,
            ready_timeout=ready_timeout,
        )
        self.proxies.append(handle)
        for partitioned in self._partitioned:  # hosts cut off now stay cut off from the new proxy too
            self._apply_partition(handle, partitioned, cut=True)
        return handle

    def partition(self, host: Host) -> None:
        """Cut ``host`` off: every other proxy resets/blackholes connections from host.ip, and host's own
        proxies reset/blackhole everything. Only traffic that goes through proxies is affected."""
        self._partitioned.add(host)
        for proxy in self.proxies:
            self._apply_partition(proxy, host, cut=True)

    def heal(self, host: Host) -> None:
        """Undo :meth:`partition` for ``host``."""
        self._partitioned.discard(host)
        for proxy in self.proxies:
            self._apply_partition(proxy, host, cut=False)

    @staticmethod
    def _apply_partition(proxy: ProxyHandle, host: Host, cut: bool) -> None:
        if proxy.host is host:
            proxy.set(partition=cut)
        elif cut:
            proxy.add_partitioned_source(host.ip)
        else:
            proxy.remove_partitioned_source(host.ip)
