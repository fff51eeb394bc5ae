"""Home volunteers behind NAT, trained for real: the scenarios of issue 27 on the emulated home network.

    sudo .venv/bin/python -m benchmarks.testbed.home_swarm --scenario a --duration 180
    sudo .venv/bin/python -m benchmarks.testbed.home_swarm --scenario baseline b --duration 150
    sudo .venv/bin/python -m benchmarks.testbed.home_swarm --list

Each scenario builds a ``HomeNetwork`` (benchmarks/testbed/home/network.py: public hosts on an "internet" segment,
every volunteer behind its own home router doing source NAT with no port forwarded, home lines 10 Mbit/s up and
50 down), starts the peers as the README says and trains for ``--duration`` seconds once every trainer is up:

- the aux peer: the README's ``run_aux_peer.py --config tiny_home --run_id R --host_maddrs /ip4/0.0.0.0/tcp/31337
  --identity_path ... --metrics_port 9100 --checkpoint_dir ... --checkpoint_every 10`` on a public host;
- a volunteer: the README's join command ``run_trainer.py --config tiny_home --run_id R --initial_peers <aux>``, with
  no NAT flag (no ``--client_mode``, no ``--reachability``);
- a public trainer: the same, listening on a public address (``--host_maddrs /ip4/0.0.0.0/tcp/31337``).

What the testbed adds to those commands only observes: ``--output_dir``/``--identity_path`` in the run's folder,
``--events_file`` (lifecycle events), ``--log_health_every_epochs 1`` (the health line with rounds ok/failed and
bytes after every epoch) and, through the test entry point ``benchmarks.testbed.fault_trainer`` (``run_trainer.py``
plus per-epoch parameter dumps), the parameters after each global epoch, compared across trainers at the newest
epoch they all dumped.

Per peer it reports: the global epoch it joined at, the rounds it took part in (averaging rounds ok, from its health
lines) against the swarm's rounds after it joined, missed rounds whose result it took from peers that took them
(``repaired_rounds`` of its last ``epoch_done`` event), global epochs it went through, catch-up state downloads, local
steps and samples/s, bytes it sent and received in averaging, and the lines that matter ("no reachable peer in this
swarm", "could not find a group", state downloads that failed). The aux host's interface counters give the bytes
through the aux peer. Results go to ``--out`` (benchmarks/measured/home_net.json by default: the scenario's entry is
replaced, the others kept; each scenario's full result in benchmarks/measured/home_net/<scenario>.json) with the
tables ``python -m benchmarks.docs`` puts into docs/benchmarks.md.

Needs root, iproute2 and iptables (``bash scripts/setup_env.sh --test`` installs them).
"""

from __future__ import annotations

import argparse
import datetime
import json
import re
import shlex
import shutil
import signal
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence

import torch

from benchmarks.testbed.faults.injection import PARAMS_DIR_ENV
from benchmarks.testbed.faults.swarm import SwarmPeer, _line_time, param_distance
from benchmarks.testbed.home.network import HomeLink, HomeNetwork, home_network_unavailable_reason
from benchmarks.testbed.netem.hosts import _sh
from benchmarks.testbed.processes import kill_all
from benchmarks.testbed.trainers import FAULT_TRAINER_MODULE

ROOT = Path(__file__).resolve().parents[2]
DEFAULT_OUT = ROOT / "benchmarks" / "measured" / "home_net.json"
PORT = 31337  # the README's port, on every host (each host is its own machine)
METRICS_PORT = 9100
STARTUP = 180.0  # seconds for a peer to import torch and hivemind and join on a loaded 2-core machine
MESSAGE_BOUND = 60.0  # requirement 2: "no reachable peer" within a minute
NO_REACHABLE_RE = re.compile(r"no reachable peer in this swarm[^\n]*")
HEALTH_RE = re.compile(
    r"swarm health: rounds (\d+) ok / (\d+) failed, compute share \S+, sent ([\d.]+) MB, received ([\d.]+) MB"
)
DOWNLOADED_RE = re.compile(r"Downloaded the state \(")  # every applied download, hivemind's catch-ups included
STEP_RE = re.compile(r"step (\d+) \| loss [\d.naif]+ \| [\d.]+ samples/s")
NOTABLE = {
    "no_reachable_peer": NO_REACHABLE_RE,
    "could_not_find_group": re.compile(r"could not find a group"),
    "state_download_failed": re.compile(r"(?i)(failed to load state|could not (download|load) the (swarm's )?state)"),
    "routing_not_found": re.compile(r"routing: not found"),
    "beyond_consensus": re.compile(r"beyond the swarm's consensus"),
    "shape_invalid": re.compile(r"shape '\[[\d, ]+\]' is invalid"),
    "cannot_be_dialled": re.compile(r"cannot be dialled by other peers"),
}


PRESET = "tiny_home"
"""Every peer's ``--config``: the tiny model with an epoch of many local steps, as in home runs (its YAML says why)."""

DURATION = 180.0
"""Seconds of training once every peer is up (start-up and shutdown add about a minute), as in the issue's trials.
A volunteer can lose one to three start-up rounds (it loads the state a moment before round 1 ends), which weigh up
to 10 % of the 24 to 31 rounds of a 120 s run and a few percent of 180 s (docs/benchmarks.md)."""


@dataclass(frozen=True)
class Scenario:
    key: str
    title: str
    public_trainers: int = 0
    volunteers: int = 2
    forwarded: int = 0
    """How many volunteers (the first ones) have a port forwarded by their router and pass ``--announce_maddrs``."""
    aux_extra: tuple = ()
    trains: bool = True
    """Whether the swarm is expected to train (d is not: nobody can reduce)."""
    joiners: tuple = ()
    """NAT'd volunteers that join while the swarm trains, one every ``join_every`` s from ``join_every`` s in: each
    entry is that joiner's ``--max_donors`` (how many donors it takes its state from at once)."""
    join_every: float = 40.0


SCENARIOS: Dict[str, Scenario] = {
    s.key: s
    for s in (
        Scenario("a", "public aux + 2 NAT'd volunteers, README join command"),
        Scenario("b", "(a) + a public trainer", public_trainers=1),
        Scenario("baseline", "aux + the public trainer, no NAT'd peer (b's base)", public_trainers=1, volunteers=0),
        Scenario(
            "pair",
            "aux + two public trainers, no NAT (reference for the parameter check)",
            public_trainers=2,
            volunteers=0,
        ),
        Scenario("c", "aux + a volunteer with a forwarded port and --announce_maddrs + a NAT'd one", forwarded=1),
        Scenario(
            "d",
            "NAT'd volunteers only, the aux does not assist (--assist_in_averaging false)",
            aux_extra=("--assist_in_averaging", "false"),
            trains=False,
        ),
    )
}


def _code_version() -> str:
    """The commit the peers ran (``git describe``), so results from before and after a peer-side change differ;
    "-dirty" where tracked files differ from it, except the results this benchmark writes (benchmarks/measured): a
    run of several scenarios marked every scenario after its first as dirty."""
    import subprocess

    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True).stdout.strip()

    commit = git("describe", "--always")
    if not commit:
        return "unknown"
    changed = git("status", "--porcelain", "--untracked-files=no", "--", ".", ":(exclude)benchmarks/measured")
    return commit + ("-dirty" if changed else "")


def tolerance() -> float:
    """The parameter agreement sync mode meets with the tiny preset's compression (peer.swarm.agreement)."""
    from peer.swarm.agreement import tolerance_for
    from peer.swarm.config import CollaborationArguments

    return tolerance_for(CollaborationArguments.compression)


@dataclass
class Peer:
    name: str
    role: str  # aux, public, volunteer, forwarded, joiner
    process: SwarmPeer
    started: float
    params: Optional[Path] = None
    info: dict = field(default_factory=dict)


class HomeSwarm:
    """One scenario's peers on one HomeNetwork; ``run()`` returns its result dict."""

    def __init__(
        self,
        scenario: Scenario,
        folder: Path,
        duration: float,
        link: HomeLink = HomeLink(),
        progress: Callable[[str], None] = print,
        peer_flags: Sequence[str] = (),
        preset: str = PRESET,
    ):
        self.preset = preset
        self.peer_flags = list(peer_flags)  # appended to every peer's command (experiments; the README's have none)
        self.scenario, self.folder, self.duration, self.link, self.say = (
            scenario,
            Path(folder),
            duration,
            link,
            progress,
        )
        self.run_id = f"home-{scenario.key}"
        self.peers: List[Peer] = []
        self.net: Optional[HomeNetwork] = None
        self.join: List[str] = []  # the aux peer's public address: what every trainer passes to --initial_peers

    # ---- starting peers

    def _start(self, name: str, role: str, host, args: List[str], *, aux: bool = False) -> Peer:
        folder = self.folder / name
        folder.mkdir(parents=True, exist_ok=True)
        env, entry = {}, dict(script="run_aux_peer.py")
        params = None
        if not aux:
            params = folder / "params"
            env = {PARAMS_DIR_ENV: str(params)}
            entry = dict(module=FAULT_TRAINER_MODULE)
            args = [
                *args,
                "--output_dir",
                str(folder),
                "--identity_path",
                str(folder / "identity.key"),
                "--log_health_every_epochs",
                "1",
            ]
        process = SwarmPeer(args, name=name, folder=folder, host=host, role=role, env=env, **entry)
        process.start()
        peer = Peer(name, role, process, time.time(), params)
        self.peers.append(peer)
        return peer

    def _start_aux(self) -> List[str]:
        host = self.net.public[0]
        args = [
            "--config", self.preset, "--run_id", self.run_id, "--host_maddrs", f"/ip4/0.0.0.0/tcp/{PORT}",
            "--identity_path", str(self.folder / "aux" / "aux.key"), "--metrics_port", str(METRICS_PORT),
            "--checkpoint_dir", str(self.folder / "aux" / "checkpoints"), "--checkpoint_every", "10",
            *self.scenario.aux_extra, *self.peer_flags,
        ]  # fmt: skip
        aux = self._start("aux", "aux", host, args, aux=True)
        maddrs = aux.process.initial_peers(STARTUP)
        # what a user copies: the aux peer's public address (it also lists loopback, useless to anyone else)
        public = [m for m in maddrs if f"/ip4/{host.ip}/" in m]
        if not public:
            raise RuntimeError(f"the aux peer announced no address on its public IP {host.ip}: {maddrs}")
        self.say(f"  aux peer up on {host.ip}: --initial_peers {' '.join(public)}")
        return public

    def _trainer_args(self, join: List[str]) -> List[str]:
        # the README's join command
        return ["--config", self.preset, "--run_id", self.run_id, "--initial_peers", *join, *self.peer_flags]

    # ---- the run

    def run(self) -> dict:
        s = self.scenario
        result: dict = {
            "scenario": s.key,
            "title": s.title,
            "link": self.link.describe(),
            "duration_s": self.duration,
            "date": datetime.date.today().isoformat(),
            "code": _code_version(),
            "peers": {},
        }
        homes = s.volunteers + len(s.joiners)
        with HomeNetwork(public=1 + s.public_trainers, homes=homes, link=self.link) as net:
            self.net = net
            try:
                self.say(f"[{s.key}] {s.title}: {net.prefix}, home lines {self.link.describe()}")
                join = self._start_aux()
                aux_before = HomeNetwork.interface_bytes(net.public[0])
                for index, host in enumerate(net.public[1:]):
                    args = [*self._trainer_args(join), "--host_maddrs", f"/ip4/0.0.0.0/tcp/{PORT}"]
                    self._start(f"public{index}", "public", host, args)
                self.join = join
                for index, home in enumerate(net.homes[: s.volunteers]):
                    args = self._trainer_args(join)
                    role = "volunteer"
                    if index < s.forwarded:
                        announce = net.forward_port(home, PORT)
                        args += ["--host_maddrs", f"/ip4/0.0.0.0/tcp/{PORT}", "--announce_maddrs", announce]
                        role = "forwarded"
                    self._start(f"volunteer{index}", role, home, args)
                self._wait_started()
                began = time.time()
                self._train(began)
                ended = time.time()
                aux_after = HomeNetwork.interface_bytes(net.public[0])
                result["aux"] = {
                    "bytes_in": aux_after["rx_bytes"] - aux_before["rx_bytes"],
                    "bytes_out": aux_after["tx_bytes"] - aux_before["tx_bytes"],
                    "state": self._aux_state(),
                }
                result["dnat_packets"] = {
                    peer.name: self._dnat_packets(net.homes[int(peer.name[len("volunteer") :])])
                    for peer in self.peers
                    if peer.role == "forwarded"
                }
                self._stop()
                result["window"] = [began, ended]
                result["peers"] = {p.name: self._summarize(p, began, ended) for p in self.peers if p.role != "aux"}
                result["aux"]["notable"] = self._notable(self.peers[0])
                result["end_epoch"] = max([p.get("last_epoch") or 0 for p in result["peers"].values()] + [0])
                self._rounds_after_join(result)
                result["params"] = self._compare_params()
            finally:
                kill_all([p.process for p in self.peers])
        return result

    def _wait_started(self) -> None:
        """Until every trainer is past its DHT start (its join or the message about why it cannot train)."""
        deadline = time.monotonic() + STARTUP
        for peer in self.peers[1:]:
            try:
                peer.process.events.wait("dht_started", max(1.0, deadline - time.monotonic()))
            except Exception as e:  # reported, not fatal: its log says why
                self.say(f"  {peer.name} did not start its DHT: {str(e).splitlines()[0]}")
        self.say(f"  trainers up: {', '.join(p.name for p in self.peers[1:])}; training {self.duration:.0f} s")

    def _start_joiner(self, index: int) -> None:
        max_donors = self.scenario.joiners[index]
        home = self.net.homes[self.scenario.volunteers + index]
        peer = self._start(
            f"joiner{index}", "joiner", home, [*self._trainer_args(self.join), "--max_donors", str(max_donors)]
        )
        peer.info["max_donors"] = max_donors
        self.say(f"  joiner{index} started (--max_donors {max_donors})")

    def _tick(self, began: float) -> None:
        """Every 2 s while the swarm trains: start the joiners that are due."""
        started = sum(1 for p in self.peers if p.role == "joiner")
        if started < len(self.scenario.joiners) and time.time() >= began + (started + 1) * self.scenario.join_every:
            self._start_joiner(started)

    def _train(self, began: float) -> None:
        next_report = began + 15
        while time.time() < began + self.duration:
            time.sleep(2)
            self._tick(began)
            self._prune_params()
            if time.time() >= next_report:
                next_report += 15
                parts = []
                for p in self.peers[1:]:
                    log = p.process.log()
                    steps = STEP_RE.findall(log)
                    done = p.process.events.all("epoch_done")
                    ok = sum(int(m.group(1)) for m in HEALTH_RE.finditer(log))
                    flag = " NO-REACHABLE" if NO_REACHABLE_RE.search(log) else ""
                    dead = "" if p.process.poll() is None else f" EXITED({p.process.poll()})"
                    epoch = done[-1]["now_at"] if done else "-"
                    parts.append(f"{p.name}: step {steps[-1] if steps else 0} ep {epoch} ok {ok}{flag}{dead}")
                self.say(f"  t={time.time() - began:4.0f}s  " + " | ".join(parts))

    def _prune_params(self, keep: int = 6) -> None:
        """Keep the newest few per-epoch dumps: the comparison needs only the newest epoch all trainers share."""
        for peer in self.peers:
            if peer.params is None or not peer.params.exists():
                continue
            dumps = sorted(peer.params.glob("epoch_*.pt"))
            for path in dumps[:-keep]:
                path.unlink(missing_ok=True)

    def _stop(self) -> None:
        trainers = [p for p in self.peers if p.role != "aux"]
        for p in trainers:
            # the same graceful stop as Ctrl-C (finish the step, leave); SIGINT is ignored by processes started from a
            # non-interactive shell's background job, as this runner often is
            p.process.send_signal(signal.SIGTERM)
        for p in trainers:
            try:
                p.process.wait(45)
            except TimeoutError:
                self.say(f"  {p.name} did not exit within 45 s of SIGTERM: killed")
        try:
            self.peers[0].process.stop(signal.SIGTERM, timeout=30)
        except TimeoutError:  # the aux peer's exit is not what is measured; it is killed with the namespaces
            self.say("  the aux peer did not exit within 30 s of SIGTERM: killed")

    def _aux_state(self) -> Optional[dict]:
        code = (
            "import json, urllib.request\n"
            f"print(urllib.request.urlopen('http://127.0.0.1:{METRICS_PORT}/api/state', timeout=10).read().decode())"
        )
        result = self.net.public[0].exec([sys.executable, "-c", code], timeout=30)
        if result.returncode != 0:
            return {"error": result.stderr.strip()[-300:]}
        state = json.loads(result.stdout)
        swarm = state.get("swarm", {})
        return {
            "global_epoch": swarm.get("global_epoch"),
            "alive_peers": swarm.get("alive_peers"),
            "health": swarm.get("health"),
            "round_success_ratio": swarm.get("round_success_ratio"),
            "peers": [
                {
                    "peer": p.get("peer"),
                    "epoch": p.get("epoch"),
                    "samples_per_second": p.get("samples_per_second"),
                    "reachability": (p.get("health") or {}).get("reachability"),
                    "rounds_ok": ((p.get("health") or {}).get("totals") or {}).get("rounds_ok"),
                }
                for p in swarm.get("peers", [])
            ],
        }

    def _dnat_packets(self, home) -> int:
        """Packets the router's port forward let in: proof that peers dialled the volunteer."""
        table = _sh("ip", "netns", "exec", home.router, "iptables", "-w", "5", "-t", "nat", "-L", "PREROUTING",
                    "-v", "-n", "-x").stdout  # fmt: skip
        return sum(int(line.split()[0]) for line in table.splitlines() if "DNAT" in line)

    # ---- results

    @staticmethod
    def _notable(peer: Peer) -> dict:
        log = peer.process.log()
        return {key: len(regex.findall(log)) for key, regex in NOTABLE.items()}

    def _summarize(self, peer: Peer, began: float, ended: float) -> dict:
        log = peer.process.log()
        events = peer.process.events
        joined = events.last("joined")
        done = events.all("epoch_done")
        health = [tuple(float(x) for x in m.groups()) for m in HEALTH_RE.finditer(log)]
        steps = [int(n) for n in STEP_RE.findall(log)]
        step_times = [_line_time(log, m.start()) for m in STEP_RE.finditer(log)]
        samples = sum(int(e["samples"]) for e in done if began <= float(e["time"]) <= ended + 60)
        message = NO_REACHABLE_RE.search(log)
        message_at = _line_time(log, message.start()) if message else None
        dht = events.last("dht_started")
        up_at = float(dht["time"]) if dht else peer.started
        summary = {
            "role": peer.role,
            "exit_code": peer.process.poll(),
            "reachability": self._reachability(events.last("reachability")),
            "join_epoch": int(joined["epoch"]) if joined else None,
            "joined_after_s": round(float(joined["time"]) - peer.started, 1) if joined else None,
            "epochs_done": len(done),
            "last_epoch": int(done[-1]["now_at"]) if done else None,
            "epochs_with_others": sum(1 for e in done if int(e.get("peers") or 0) >= 2),
            "rounds_ok": int(sum(h[0] for h in health)),
            "rounds_failed": int(sum(h[1] for h in health)),
            # missed rounds whose result it took from peers that took them (not counted as taken part in)
            "rounds_repaired": int(done[-1].get("repaired_rounds") or 0) if done else 0,
            "mb_sent": round(sum(h[2] for h in health), 1),
            "mb_received": round(sum(h[3] for h in health), 1),
            # catch-ups after joining (hivemind's, inside its step, emit no event; they are logged)
            "state_downloads": sum(
                1 for m in DOWNLOADED_RE.finditer(log) if joined and _line_time(log, m.start()) > float(joined["time"])
            ),
            "local_steps": max(steps, default=0),
            "samples": samples,
            "samples_per_second": round(samples / max(1.0, ended - began), 2),
            "no_reachable_message": message.group(0)[:200] if message else None,
            # from the moment it is on the network (its DHT started): importing torch on a loaded machine comes first
            "message_after_s": round(message_at - up_at, 1) if message_at else None,
            "message_after_launch_s": round(message_at - peer.started, 1) if message_at else None,
            "steps_after_message": sum(1 for t in step_times if message_at and t > message_at + 1.0),
            "steps_last_30s": sum(1 for t in step_times if t > ended - 30),
            "notable": self._notable(peer),
        }
        return summary

    @staticmethod
    def _reachability(event: Optional[dict]) -> Optional[str]:
        """What the peer decided at start (its ``reachability`` event): "full peer" or "client", and why."""
        if event is None:
            return None
        return f"{'client' if event.get('client_mode') else 'full peer'} ({event.get('source')}: {event.get('reason')})"

    @staticmethod
    def _rounds_after_join(result: dict) -> None:
        """Sync mode has one averaging round per global epoch: the swarm's rounds after a peer joined are the epochs
        the swarm advanced from its join epoch to the newest epoch any trainer finished."""
        end = result["end_epoch"]
        for summary in result["peers"].values():
            join = summary["join_epoch"]
            rounds = max(0, end - join) if join is not None else 0
            summary["swarm_rounds_after_join"] = rounds
            # a peer that never had anyone to average with (the baseline's lone trainer) has no share to show
            alone = summary["epochs_with_others"] == 0 and summary["rounds_ok"] == 0 and summary["epochs_done"] > 0
            summary["took_part"] = round(summary["rounds_ok"] / rounds, 3) if rounds and not alone else None
            summary["epochs_fraction"] = round(summary["epochs_done"] / rounds, 3) if rounds else None

    def _compare_params(self) -> dict:
        """The largest parameter difference between trainers at the newest global epoch they all dumped."""
        dumps = {
            p.name: {int(path.stem.split("_")[1]): path for path in p.params.glob("epoch_*.pt")}
            for p in self.peers
            if p.params is not None and p.params.exists()
        }
        dumps = {name: found for name, found in dumps.items() if found}
        out = {"tolerance": tolerance(), "epoch": None, "max_difference": None, "trainers": sorted(dumps)}
        if len(dumps) < 2:
            return out
        common = set.intersection(*(set(found) for found in dumps.values()))
        if not common:
            return out
        epoch = max(common)
        tensors = [torch.load(found[epoch], map_location="cpu", weights_only=True) for found in dumps.values()]
        out["epoch"] = epoch
        out["max_difference"] = max(param_distance(tensors[0], other) for other in tensors[1:])
        return out


# ---- acceptance (issue 27) and the table


def checks(result: dict, baseline: Optional[dict] = None) -> Dict[str, bool]:
    """The acceptance checks of a scenario's result (each a name and whether it holds)."""
    key, peers = result["scenario"], result["peers"]
    volunteers = {n: p for n, p in peers.items() if p["role"] in ("volunteer", "forwarded")}
    out: Dict[str, bool] = {}
    # issue 27 bounds the NAT'd volunteers' rounds and parameters in a and b; in c it asks for a full peer (the
    # rounds and the parameter distance of c are measured in the result and its table, not bounded)
    if key in ("a", "b"):
        for name, p in volunteers.items():
            out[f"{name} took part in >= 90% of the rounds after it joined"] = (p["took_part"] or 0) >= 0.9
    if key in ("a", "b", "pair"):
        params = result.get("params") or {}
        out["parameters equal within the sync-mode tolerance"] = (
            params.get("max_difference") is not None and params["max_difference"] <= params["tolerance"]
        )
    if key == "b" and baseline is not None:
        for name, p in peers.items():
            if p["role"] == "public" and name in baseline["peers"]:
                ref = baseline["peers"][name]["epochs_fraction"] or 0
                out[f"{name} lost <= 10% of rounds against the baseline"] = (p["epochs_fraction"] or 0) >= 0.9 * ref
    if key == "c":
        for name, count in (result.get("dnat_packets") or {}).items():
            out[f"{name} was dialled through its forwarded port (a full peer)"] = count > 0
            out[f"{name} runs as a full peer"] = (peers[name]["reachability"] or "").startswith("full peer")
    if key == "d":
        for name, p in volunteers.items():
            out[f"{name} said 'no reachable peer' within {MESSAGE_BOUND:.0f} s"] = (
                p["message_after_s"] is not None and p["message_after_s"] <= MESSAGE_BOUND
            )
            out[f"{name} stopped computing (no local step in the last 30 s)"] = p["steps_last_30s"] == 0
    return out


COLUMNS = [
    {"name": "scenario"},
    {"name": "peer"},
    {"name": "role"},
    {"name": "rounds taken part in"},
    {"name": "share", "format": ".0%"},
    {"name": "epochs", "format": "d"},
    {"name": "local steps", "format": "d"},
    {"name": "state downloads", "format": "d"},
    {"name": "samples/s", "format": ".1f"},
    {"name": "averaging MB sent/recv"},
    {"name": "through the aux, MB in/out"},
    {"name": "checks"},
]


def table_rows(results: Dict[str, dict]) -> List[list]:
    rows = []
    for key in [k for k in SCENARIOS if k in results]:
        result = results[key]
        aux = result.get("aux") or {}
        through = f"{aux.get('bytes_in', 0) / 1e6:.1f} / {aux.get('bytes_out', 0) / 1e6:.1f}"
        verdict = result.get("checks") or {}
        passed = f"{sum(verdict.values())}/{len(verdict)} pass" if verdict else "—"
        for index, (name, p) in enumerate(sorted(result["peers"].items())):
            rounds = f"{p['rounds_ok']} of {p['swarm_rounds_after_join']}"
            if p.get("no_reachable_message"):
                rounds += f" (message at {p['message_after_s']:.0f} s)"
            rows.append(
                [
                    key if index == 0 else "",
                    name,
                    p["role"],
                    rounds,
                    p["took_part"],
                    p["epochs_done"],
                    p["local_steps"],
                    p["state_downloads"],
                    p["samples_per_second"],
                    f"{p['mb_sent']:.1f} / {p['mb_received']:.1f}",
                    through if index == 0 else "",
                    passed if index == 0 else "",
                ]
            )
    return rows


MATRIX_COLUMNS = [
    {"name": "scenario"},
    {"name": "NAT'd volunteers: rounds taken part in"},
    {"name": "public trainer: epochs gone through"},
    {"name": "'no reachable peer' after"},
    {"name": "through the aux, MB in/out"},
    {"name": "parameters apart (tolerance)"},
    {"name": "acceptance"},
    {"name": "peers' code"},
]


def matrix_rows(results: Dict[str, dict]) -> List[list]:
    """One row per scenario: the fault matrix's rows for issue 27."""
    rows = []
    for key in [k for k in SCENARIOS if k in results]:
        result = results[key]
        peers = result["peers"].values()
        nat = [
            f"{p['rounds_ok']} of {p['swarm_rounds_after_join']}"
            if p["epochs_done"]
            else f"no epoch in {p['local_steps']} local steps"
            for p in peers
            if p["role"] == "volunteer"
        ]
        nat += [
            f"{p['rounds_ok']} of {p['swarm_rounds_after_join']} (forwarded)" for p in peers if p["role"] == "forwarded"
        ]
        public = [f"{p['epochs_done']} of {p['swarm_rounds_after_join']}" for p in peers if p["role"] == "public"]
        said = [p["message_after_s"] for p in peers if p["role"] == "volunteer"]
        message = "never" if not said or any(t is None for t in said) else f"{max(said):.0f} s"
        aux = result.get("aux") or {}
        verdict = result.get("checks") or {}
        failed = [name for name, ok in verdict.items() if not ok]
        params = result.get("params") or {}
        apart = "—"
        if params.get("max_difference") is not None:
            apart = f"{params['max_difference']:.3g} at epoch {params['epoch']} ({params['tolerance']:g})"
        rows.append(
            [
                f"{key}. {result['title']}",
                ", ".join(nat) or "—",
                ", ".join(public) or "—",
                message if said else "—",
                f"{aux.get('bytes_in', 0) / 1e6:.1f} / {aux.get('bytes_out', 0) / 1e6:.1f}",
                apart,
                "pass" if verdict and not failed else ("fail: " + "; ".join(failed) if failed else "—"),
                result.get("code", "—"),
            ]
        )
    return rows


def details_folder(path: Path) -> Path:
    """Where each scenario's full result lives (``home_net/<scenario>.json`` next to the tables' ``home_net.json``:
    benchmarks.docs reads only the tables, from the JSON files directly in benchmarks/measured)."""
    return path.parent / path.stem


def write_results(path: Path, result: Optional[dict] = None, command: str = "") -> dict:
    """Store this scenario's full result (replacing its previous one) and rebuild the tables of ``path`` from every
    scenario stored; with no result, only rebuild the tables."""
    from benchmarks import docs

    folder = details_folder(path)
    folder.mkdir(parents=True, exist_ok=True)
    if result is not None:
        result["command"] = command
        (folder / f"{result['scenario']}.json").write_text(json.dumps(result, indent=1) + "\n")
    scenarios = {p.stem: json.loads(p.read_text()) for p in sorted(folder.glob("*.json")) if p.stem in SCENARIOS}
    commands = [scenarios[k].get("command", "") for k in SCENARIOS if k in scenarios]

    def table(columns: list, rows: list) -> dict:
        # stored as benchmarks.docs reads it back from its markdown, so the page and the JSON cannot drift
        return docs.parse_markdown_tables(docs.table_markdown({"columns": columns, "rows": rows}))[0]

    run = {
        "command": "; ".join(c for c in commands if c),
        "date": max((s.get("date", "") for s in scenarios.values()), default=datetime.date.today().isoformat()),
        "machine": "2 CPU cores shared with other jobs, network namespaces, tbf home lines",
        "tables": {
            "matrix": table(MATRIX_COLUMNS, matrix_rows(scenarios)),
            "main": table(COLUMNS, table_rows(scenarios)),
        },
    }
    path.write_text(docs.run_json(run), encoding="utf-8")
    return run


def run_scenario(
    key: str,
    folder: Path,
    duration: float,
    *,
    link: HomeLink = HomeLink(),
    baseline: Optional[dict] = None,
    progress: Callable[[str], None] = print,
    peer_flags: Sequence[str] = (),
    preset: str = PRESET,
) -> dict:
    """Run one scenario and attach its acceptance checks."""
    result = HomeSwarm(SCENARIOS[key], folder, duration, link, progress, peer_flags, preset).run()
    result["checks"] = checks(result, baseline)
    return result


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(
        description="Run issue 27's home-network scenarios (NAT'd volunteers, 10/50 Mbit/s lines) with real peers.",
        epilog="Scenarios: " + "; ".join(f"{s.key}: {s.title}" for s in SCENARIOS.values()),
    )
    parser.add_argument("--scenario", nargs="+", choices=list(SCENARIOS), default=["a"])
    parser.add_argument("--duration", type=float, default=DURATION, help="seconds of training once every peer is up")
    parser.add_argument("--up_mbit", type=float, default=10.0, help="home upload, Mbit/s")
    parser.add_argument("--down_mbit", type=float, default=50.0, help="home download, Mbit/s")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="results JSON (each scenario's entry replaced)")
    parser.add_argument("--folder", type=Path, default=None, help="keep the peers' logs here (default: a temp dir)")
    parser.add_argument("--list", action="store_true", help="list the scenarios and exit")
    parser.add_argument(
        "--peer_flags",
        default="",
        help='extra flags for every peer, one string (an experiment, e.g. "--target_batch_size 512"; use another '
        "--out: the measured table is of the README's commands)",
    )
    parser.add_argument(
        "--preset",
        default=PRESET,
        help=f"the run preset every peer gets with --config (default {PRESET}: configs/run/{PRESET}.yaml says why; "
        "tiny for comparison, with another --out)",
    )
    parser.add_argument("--rebuild", action="store_true", help="only rebuild the tables of --out from its scenarios")
    args = parser.parse_args(argv)
    if args.list:
        for s in SCENARIOS.values():
            print(f"{s.key:9s} {s.title}")
        return 0
    if args.rebuild:
        write_results(args.out)
        return 0
    if not args.duration > 0:
        parser.error(f"--duration must be positive seconds, got {args.duration}")
    reason = home_network_unavailable_reason()
    if reason:
        print(f"cannot build the home network here: {reason}", file=sys.stderr)
        return 2
    link = HomeLink(args.up_mbit, args.down_mbit)
    peer_flags = shlex.split(args.peer_flags)
    command = f"sudo .venv/bin/python -m benchmarks.testbed.home_swarm --scenario {{}} --duration {args.duration:g}"
    if args.preset != PRESET:
        command += f" --preset {shlex.quote(args.preset)}"
    if peer_flags:
        command += f" --peer_flags {shlex.quote(args.peer_flags)}"
    failed = 0
    for key in args.scenario:
        folder = args.folder / key if args.folder else Path(tempfile.mkdtemp(prefix=f"home-{key}-"))
        if folder.exists() and args.folder:
            shutil.rmtree(folder)
        baseline = None
        stored = details_folder(args.out) / "baseline.json"
        if key == "b" and stored.exists():
            baseline = json.loads(stored.read_text())
        result = run_scenario(
            key, folder, args.duration, link=link, baseline=baseline, peer_flags=peer_flags, preset=args.preset
        )
        result["logs"] = str(folder)
        write_results(args.out, result, command.format(key))
        for name, ok in result["checks"].items():
            print(f"  {'PASS' if ok else 'FAIL'}  {name}")
            failed += not ok
        print(json.dumps({n: {k: p[k] for k in ("rounds_ok", "rounds_repaired", "swarm_rounds_after_join", "took_part",
              "epochs_done", "samples_per_second", "state_downloads", "message_after_s")}
              for n, p in result["peers"].items()},
              indent=1))  # fmt: skip
        print(f"  aux bytes in/out: {result['aux']['bytes_in']} / {result['aux']['bytes_out']}; logs in {folder}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
