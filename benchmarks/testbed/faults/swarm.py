"""A LeanHive swarm on emulated internet links: each peer runs on its own test host (network namespace)
behind a delay/partition proxy, with a tbf bandwidth limit on the host's link (see benchmarks/testbed/netem).

Every connection *to* a peer crosses that peer's proxy, so with ``LinkProfile(rtt_ms=100)`` each
connection sees 100 ms of round trip; ``mbit`` limits each host's link in both directions.
Peers are the real entry points (``run_aux_peer.py``; trainers through the test entry point
``benchmarks/testbed/fault_trainer.py``, which is ``run_trainer.py`` plus the env-driven faults and the per-epoch
parameter dumps) started through ``benchmarks.testbed.processes.PeerProcess`` inside the host; tests wait on their
lifecycle events (``--events_file``) and read their logs.
"""

from __future__ import annotations

import datetime
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Sequence

import torch

from benchmarks.testbed.faults.injection import PARAMS_DIR_ENV
from benchmarks.testbed.netem.hosts import Host, Testbed
from benchmarks.testbed.netem.proxy import ProxyHandle, ProxySettings
from benchmarks.testbed.processes import PeerProcess, kill_all
from benchmarks.testbed.trainers import events_path, tiny_model_config, trainer_entry_point

PORT = 40000  # every peer listens here on its own host; others reach it through its proxy
METRICS_PORT = 9500
LOG_TIME_RE = re.compile(r"(\w{3} +\d+ \d\d:\d\d:\d\d\.\d{3}) ")  # hivemind's handler: "Nov 21 21:00:51.193 "
STARTUP = 150  # seconds for a peer to import, start its DHT and log its join line on a loaded 2-core machine


@dataclass
class LinkProfile:
    """What every host's link looks like."""

    mbit: Optional[float] = 20.0
    """Bandwidth of each host's link, each direction (None: unlimited); the upload only when down_mbit is set."""
    rtt_ms: float = 100.0
    """Round trip time of every connection (half of it added by the proxy in each direction)."""
    jitter_ms: float = 0.0
    loss: float = 0.0
    down_mbit: Optional[float] = None
    """Download bandwidth of an asymmetric link (home lines: the upload is the slow side); None: the same as mbit."""

    def proxy_settings(self) -> ProxySettings:
        return ProxySettings(delay_ms=self.rtt_ms / 2, jitter_ms=self.jitter_ms, loss=self.loss)

    def describe(self) -> str:
        speed = "unlimited" if self.mbit is None else f"{self.mbit:g} Mbit/s"
        if self.down_mbit is not None:
            speed = f"{speed} up / {self.down_mbit:g} Mbit/s down"
        return f"{speed}, {self.rtt_ms:g} ms RTT"


INTERNET = LinkProfile(mbit=20.0, rtt_ms=100.0)
BROADBAND = LinkProfile(mbit=100.0, rtt_ms=20.0)


@dataclass
class SwarmSettings:
    """Settings every peer of the run shares (trainers and aux peers must agree on them)."""

    run_id: str = "faults"
    target_batch_size: int = 256
    """Samples per global epoch: 8 steps of 32. Epochs must last well longer than a state download over the
    emulated link (2-4 s), or a peer that falls behind keeps downloading a state that is already stale."""
    matchmaking_time: float = 2.0
    averaging_timeout: float = 8.0
    load_state_timeout: float = 30.0
    compression: str = "adaptive"
    extra: List[str] = field(default_factory=list)

    def flags(self, folder: Path) -> List[str]:
        return [
            "--run_id",
            self.run_id,
            "--model_config",
            str(tiny_model_config(folder)),
            "--target_batch_size",
            str(self.target_batch_size),
            "--matchmaking_time",
            str(self.matchmaking_time),
            "--averaging_timeout",
            str(self.averaging_timeout),
            "--load_state_timeout",
            str(self.load_state_timeout),
            "--compression",
            self.compression,
            "--compression_threshold",
            "4096",
            "--learning_rate",
            "0.03",
            "--min_learning_rate",
            "0.001",
            "--warmup_steps",
            "3",
            "--total_steps",
            "200",
            "--max_sequence_length",
            "64",
            "--seq_warmup_start_length",
            "0",
            "--rejoin_period",
            "2",
            *self.extra,
        ]


class SwarmPeer(PeerProcess):
    """A peer process inside a test host; ``folder`` holds its output, identity and (trainers) parameters; its log
    and lifecycle events (``self.events``) are next to that folder."""

    def __init__(
        self,
        args: Sequence[str],
        *,
        name: str,
        folder: Path,
        host: Host,
        role: str,
        env: Optional[Dict[str, str]] = None,
        **entry_point,
    ):
        super().__init__(
            args,
            name=name,
            log_path=folder.parent / f"{name}.log",
            env=env,
            events_path=events_path(folder.parent, name),
            **entry_point,
        )
        self.folder, self.host, self.role = folder, host, role
        self.command = host.command(self.command)  # `ip netns exec` execs: the pid is python's

    # ---- what trainers report
    def epochs_done(self) -> Dict[int, float]:
        """Global epochs this trainer finished -> the time (unix seconds) of its ``epoch_done`` event."""
        return {int(e["epoch"]): float(e["time"]) for e in self.events.all("epoch_done")}

    def last_epoch(self) -> int:
        done = self.epochs_done()
        return max(done) + 1 if done else 0

    def params_at(self, epoch: int) -> Optional[Dict[str, torch.Tensor]]:
        path = self.folder / "params" / f"epoch_{epoch:06d}.pt"
        return torch.load(path, map_location="cpu", weights_only=True) if path.exists() else None


def _line_time(log: str, offset: int) -> float:
    start = log.rfind("\n", 0, offset) + 1
    match = LOG_TIME_RE.match(log, start)
    if match is None:
        return float("nan")
    stamp = datetime.datetime.strptime(match.group(1), "%b %d %H:%M:%S.%f")
    return stamp.replace(year=datetime.date.today().year).timestamp()


def param_distance(first: Dict[str, torch.Tensor], second: Dict[str, torch.Tensor]) -> float:
    """Largest absolute difference of any parameter."""
    return max(float((first[name] - second[name]).abs().max()) for name in first)


class NetemSwarm:
    """``with NetemSwarm(folder, num_hosts, settings) as swarm:`` builds hosts and proxies, removes all on exit."""

    def __init__(self, folder: Path, num_hosts: int, settings: SwarmSettings, link: LinkProfile = INTERNET):
        self.folder, self.num_hosts, self.settings, self.link = Path(folder), num_hosts, settings, link
        self.testbed: Optional[Testbed] = None
        self.proxies: List[ProxyHandle] = []
        self.peers: List[SwarmPeer] = []

    def __enter__(self) -> "NetemSwarm":
        self.folder.mkdir(parents=True, exist_ok=True)
        self.testbed = Testbed(self.num_hosts).__enter__()
        try:
            for host in self.testbed.hosts:
                if self.link.mbit is not None:
                    self.testbed.set_bandwidth(host, self.link.mbit, down_mbit=self.link.down_mbit)
                self.proxies.append(self.testbed.start_proxy(host, PORT, settings=self.link.proxy_settings()))
        except BaseException:
            self.testbed.close()
            raise
        return self

    def __exit__(self, *exc_info) -> None:
        kill_all(self.peers)
        self.testbed.close()

    def host(self, index: int) -> Host:
        return self.testbed.hosts[index]

    def _network_flags(self, index: int, name: str) -> List[str]:
        folder = self.folder / name
        return [*self.proxies[index].peer_flags(PORT), "--identity_path", str(folder / "identity.key")]

    def start_trainer(
        self,
        index: int,
        name: str,
        *,
        initial_peers: Sequence[str] = (),
        extra: Sequence[str] = (),
        env: Optional[Dict[str, str]] = None,
    ) -> SwarmPeer:
        folder = self.folder / name
        args = [
            "--config",
            "tiny",
            *self.settings.flags(self.folder),
            *self._network_flags(index, name),
            "--output_dir",
            str(folder),
            "--per_device_batch_size",
            "32",
            "--startup_wait",
            "120",
        ]
        if initial_peers:
            args += ["--initial_peers", *initial_peers]
        env = {PARAMS_DIR_ENV: str(folder / "params"), **(env or {})}
        return self._start(
            SwarmPeer(
                [*args, *extra],
                name=name,
                folder=folder,
                host=self.host(index),
                role="trainer",
                env=env,
                **trainer_entry_point(env),
            )
        )

    def start_aux(
        self,
        index: int,
        name: str,
        *,
        initial_peers: Sequence[str] = (),
        checkpoint_dir: Path,
        extra: Sequence[str] = (),
    ) -> SwarmPeer:
        folder = self.folder / name
        args = [
            *self.settings.flags(self.folder),
            *self._network_flags(index, name),
            "--checkpoint_dir",
            str(checkpoint_dir),
            "--metrics_host",
            self.host(index).ip,
            "--metrics_port",
            str(METRICS_PORT),
            "--refresh_period",
            "1",
            "--alive_window",
            "30",
        ]
        if initial_peers:
            args += ["--initial_peers", *initial_peers]
        return self._start(
            SwarmPeer(
                [*args, *extra], name=name, folder=folder, host=self.host(index), role="aux", script="run_aux_peer.py"
            )
        )

    def _start(self, peer: SwarmPeer) -> SwarmPeer:
        peer.folder.mkdir(parents=True, exist_ok=True)
        self.peers.append(peer)
        return peer.start()

    def scrape_metrics(self, aux: SwarmPeer, timeout: float = 10.0) -> Optional[str]:
        """The aux peer's Prometheus page, fetched from inside its host (None if it does not answer)."""
        result = aux.host.exec(
            ["curl", "-s", "--max-time", str(timeout), f"http://{aux.host.ip}:{METRICS_PORT}/metrics"],
            timeout=timeout + 5,
        )
        return result.stdout if result.returncode == 0 and result.stdout else None

    def partition(self, index: int) -> None:
        """Cut the host off at its link (cable pulled at the switch: every packet to or from it is dropped, for
        every protocol), and in the proxies (connections through them are reset or blackholed)."""
        self.testbed.set_link_up(self.host(index), False)
        self.testbed.partition(self.host(index))

    def heal(self, index: int) -> None:
        self.testbed.heal(self.host(index))
        self.testbed.set_link_up(self.host(index), True)
