"""Joining a swarm that trains, over home uplinks: the state from 1, 2 and 3 *training* donors (issue 30).

    sudo .venv/bin/python -m benchmarks.testbed.join_swarm [--duration 170] [--up_mbit 10] [--folder DIR]

``benchmarks.multi_donor`` measures the download against donors that only serve. Here the donors train: the home
test-bed (``benchmarks.testbed.home_swarm``) runs the aux peer and three volunteers whose routers forward a port
(full peers, scenario c's setup) on home lines (``--up_mbit`` up, ``--down_mbit`` down), in sync mode with the
``tiny_home`` preset, as the README starts them. While they train, three NAT'd volunteers join with the README's join
command plus ``--max_donors`` 1, 2 and 3, one every ``--join_every`` seconds. Each joiner downloads the state at its
join from the peers that serve it, and leaves once it holds it (home_swarm's scenarios measure volunteers that train;
seven training processes on two cores starve the donors' rounds of CPU).

Per joiner it reports the seconds of that download (its log's "Downloaded the state" line: request to verified
state), the donors and their parts, and how many candidates it did not use because their state differed (only donors
that hold the same state bit for bit share a download). Per download it reports the averaging rounds each training
peer lost around it: its failed rounds whose epoch ended between the download's start and one epoch after its end.
The targets (issue 30): 3 donors take <= 0.4x the single-donor time; no donor loses more than one averaging round
while it serves.

The tiny model's state is 5.6 MB: a download takes seconds, about one epoch, where ``small``'s takes minutes. This
measures whether training donors share downloads and keep their rounds, not the ``small`` preset's times
(``benchmarks.multi_donor --preset small`` does, with donors that only serve: three training ``small`` trainers and a
joiner do not fit this machine).

Needs root, iproute2 and iptables (``bash scripts/setup_env.sh --test`` installs them).
"""

from __future__ import annotations

import argparse
import re
import shlex
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List, Optional

from benchmarks.docs import parse_markdown_tables, run_json
from benchmarks.report import markdown_table
from benchmarks.testbed.faults.swarm import _line_time
from benchmarks.testbed.home.network import HomeLink, home_network_unavailable_reason
from benchmarks.testbed.home_swarm import HEALTH_RE, HomeSwarm, Scenario
from benchmarks.testbed.state_donor import download_shares

MEASURED = Path(__file__).resolve().parents[1] / "measured" / "join_swarm.json"
DOWNLOAD_RE = re.compile(
    r"Downloaded the state \(([\d.]+) MB, epoch (\d+)\) in (\d+) parts from (\d+) donor\(s\) in ([\d.]+) s: ([^\n]*)"
)
DIFFERS_RE = re.compile(r"Not using the state from \S+: (it differs|its digest)")
MAX_LOST_ROUNDS = 1
TARGET_RATIO = 0.4


def scenario(join_every: float) -> Scenario:
    return Scenario(
        "join",
        "aux + 3 volunteers with a forwarded port (full peers, home lines) training; NAT'd volunteers join with "
        "--max_donors 1, 2, 3",
        volunteers=3,
        forwarded=3,
        joiners=(1, 2, 3),
        join_every=join_every,
    )


DONOR_ROLES = ("public", "forwarded")


class JoinSwarm(HomeSwarm):
    """The home test-bed with the joins measured: ``run()``'s result gains ``joins``, one entry per joiner."""

    def run(self) -> dict:
        result = super().run()
        names = {}
        for peer in self.peers:
            started = peer.process.events.last("dht_started")
            if started:
                names[started["peer_id"]] = peer.name
        epoch = self._epoch_seconds()
        result["joins"] = [self._join(peer, names, epoch) for peer in self.peers if peer.role == "joiner"]
        return result

    def _tick(self, began: float) -> None:
        super()._tick(began)
        for peer in self.peers:
            # a joiner leaves once it holds the state (home_swarm's scenarios measure volunteers that train): with
            # every joiner training, seven processes on two cores broke the donors' rounds for want of CPU alone
            if peer.role == "joiner" and peer.process.poll() is None and DOWNLOAD_RE.search(peer.process.log()):
                peer.process.send_signal(signal.SIGTERM)

    def _failed_rounds(self, peer, since: float, until: float) -> int:
        log = peer.process.log()
        return sum(int(m.group(2)) for m in HEALTH_RE.finditer(log) if since <= _line_time(log, m.start()) <= until)

    def _epoch_seconds(self) -> float:
        gaps = []
        for peer in self.peers:
            if peer.role in DONOR_ROLES:
                times = sorted(float(e["time"]) for e in peer.process.events.all("epoch_done"))
                gaps += [b - a for a, b in zip(times, times[1:])]
        return statistics.median(gaps) if gaps else 10.0

    def _join(self, joiner, names: Dict[str, str], epoch: float) -> dict:
        log = joiner.process.log()
        found = DOWNLOAD_RE.search(log)
        entry: dict = {"joiner": joiner.name, "max_donors": joiner.info.get("max_donors"), "downloaded": bool(found)}
        if not found:
            return entry
        ended = _line_time(log, found.start())
        seconds = float(found.group(5))
        began = ended - seconds
        donors = {names.get(peer, peer[:12]): share for peer, share in download_shares(found.group(0)).items()}
        entry.update(
            megabytes=float(found.group(1)),
            epoch=int(found.group(2)),
            parts=int(found.group(3)),
            donors=donors,
            seconds=seconds,
            differing_donors=len(DIFFERS_RE.findall(log[: found.start()])),
            epoch_seconds=round(epoch, 1),
            # a training peer's rounds whose epoch ended while it served, or within one epoch after
            rounds_lost={
                p.name: self._failed_rounds(p, began, ended + epoch) for p in self.peers if p.role in DONOR_ROLES
            },
        )
        return entry


def checks(result: dict) -> Dict[str, bool]:
    joins = {j["max_donors"]: j for j in result["joins"]}
    out = {f"joiner with --max_donors {k} downloaded the state": j["downloaded"] for k, j in joins.items()}
    for k, j in joins.items():
        if j["downloaded"]:
            out[f"--max_donors {k}: {min(k, 3)} donors served"] = len(j["donors"]) == min(k, 3)
            worst = max(lost for name, lost in j["rounds_lost"].items() if name in j["donors"]) if j["donors"] else 0
            out[f"--max_donors {k}: no donor lost more than {MAX_LOST_ROUNDS} round while serving"] = (
                worst <= MAX_LOST_ROUNDS
            )
    if joins.get(1, {}).get("downloaded") and joins.get(3, {}).get("downloaded"):
        ratio = joins[3]["seconds"] / max(joins[1]["seconds"], 1e-9)
        out[f"3 donors <= {TARGET_RATIO}x the single-donor time"] = ratio <= TARGET_RATIO
    return out


COLUMNS = [
    "--max_donors",
    "join s",
    "x 1 donor",
    "MB",
    "parts per donor",
    "donors whose state differed",
    "rounds lost per training peer (donors *)",
]


def table(result: dict) -> str:
    rows = []
    single = next((j["seconds"] for j in result["joins"] if j["max_donors"] == 1 and j["downloaded"]), None)
    for j in result["joins"]:
        if not j["downloaded"]:
            rows.append([str(j["max_donors"]), "no download", "", "", "", "", ""])
            continue
        lost = ", ".join(
            f"{name}{'*' if name in j['donors'] else ''} {n}" for name, n in sorted(j["rounds_lost"].items())
        )
        rows.append(
            [
                str(j["max_donors"]),
                f"{j['seconds']:.1f}",
                f"{j['seconds'] / single:.2f}" if single else "",
                f"{j['megabytes']:.1f}",
                " / ".join(f"{name} {n}" for name, (n, _) in sorted(j["donors"].items())),
                str(j["differing_donors"]),
                lost,
            ]
        )
    return markdown_table(COLUMNS, rows)


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--duration", type=float, default=200.0, help="seconds of training once the trainers are up")
    parser.add_argument("--up_mbit", type=float, default=10.0, help="home upload (the donors' uplink), Mbit/s")
    parser.add_argument("--down_mbit", type=float, default=50.0, help="home download, Mbit/s")
    parser.add_argument("--join_every", type=float, default=40.0, help="seconds between the joiners' starts")
    parser.add_argument("--folder", type=Path, default=None, help="keep the peers' logs here (default: a temp dir)")
    parser.add_argument("--json", type=Path, default=MEASURED, help="where the run is recorded")
    parser.add_argument(
        "--peer_flags", default="", help='extra flags for every peer, one string (e.g. "--average_state_every 4")'
    )
    args = parser.parse_args(argv)
    for name in ("duration", "up_mbit", "down_mbit", "join_every"):
        if not getattr(args, name) > 0:
            parser.error(f"--{name} must be positive, got {getattr(args, name)}")
    if args.duration < 3 * args.join_every + 30:
        parser.error(f"--duration must leave the last joiner 30 s: at least {3 * args.join_every + 30:g} s")
    reason = home_network_unavailable_reason()
    if reason:
        print(f"cannot build the home network here: {reason}", file=sys.stderr)
        return 2
    folder = args.folder or Path(tempfile.mkdtemp(prefix="join_swarm_"))
    link = HomeLink(args.up_mbit, args.down_mbit)
    swarm = JoinSwarm(scenario(args.join_every), folder, args.duration, link, peer_flags=shlex.split(args.peer_flags))
    result = swarm.run()
    verdict = checks(result)
    printed = table(result)
    print(printed)
    for name, ok in verdict.items():
        print(f"  {'PASS' if ok else 'FAIL'}  {name}")
    print(f"  logs in {folder}")
    command = "sudo .venv/bin/python -m benchmarks.testbed.join_swarm " + shlex.join(
        sys.argv[1:] if argv is None else argv
    )
    record = {
        "command": command.strip(),
        "date": time.strftime("%Y-%m-%d"),
        "machine": "2 shared CPU cores, network namespaces, tbf",
        "setup": dict(
            up_mbit=args.up_mbit, down_mbit=args.down_mbit, join_every=args.join_every, code=result.get("code")
        ),
        "tables": {"main": parse_markdown_tables(printed)[0]},
        "joins": result["joins"],
        "checks": verdict,
        "params": result.get("params"),
    }
    args.json.write_text(run_json(record))
    return 0 if all(verdict.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
