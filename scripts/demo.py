"""A local LeanHive swarm on one machine: one aux peer and two trainers on 127.0.0.1 (tiny preset, shipped corpus).

    python scripts/demo.py                 # about 3 minutes
    python scripts/demo.py --duration 60   # shorter

Prints the dashboard URL, one line per global epoch (loss, peers online, throughput) and a summary at the
end; then stops every peer cleanly (SIGTERM: trainers write a backup and leave) and leaves no process behind.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[1]
JOIN_RE = re.compile(r"--initial_peers (/\S+(?: /\S+)*)")
logger = logging.getLogger("leanhive.demo")


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="demo", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--duration", type=float, default=180.0, help="seconds to train before stopping (default: 180)")
    parser.add_argument("--trainers", type=int, default=2, help="number of trainer peers (default: 2)")
    parser.add_argument("--run_id", default="leanhive_demo", help="collaboration name (default: leanhive_demo)")
    parser.add_argument("--config", default="tiny", help="run preset for every peer (default: tiny)")
    parser.add_argument(
        "--workdir", default="outputs/demo", help="logs, backups and checkpoints go here (default: outputs/demo)"
    )
    parser.add_argument("--metrics_port", type=int, default=0, help="dashboard/metrics port (default: a free one)")
    parser.add_argument("--checkpoint_every", type=int, default=2, help="aux checkpoint period in epochs (default: 2)")
    args = parser.parse_args(argv)
    if args.duration <= 0:
        parser.error(f"--duration must be positive, got {args.duration}")
    if not 1 <= args.trainers <= 8:
        parser.error(f"--trainers must be between 1 and 8 on one machine, got {args.trainers}")
    if not 0 <= args.metrics_port < 65536:
        parser.error(f"--metrics_port must be a TCP port (0 = pick a free one), got {args.metrics_port}")
    return args


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Peer:
    """One peer subprocess whose output goes to a log file."""

    def __init__(self, name: str, script: str, args: list, log_path: Path):
        self.name, self.log_path = name, log_path
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false"}
        with open(log_path, "wb") as log:
            self.process = subprocess.Popen(
                [sys.executable, str(ROOT / script), *map(str, args)],
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                cwd=ROOT,
            )

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_for(self, pattern: re.Pattern, timeout: float) -> re.Match:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            match = pattern.search(self.log_text())
            if match:
                return match
            if self.process.poll() is not None:
                break
            time.sleep(0.5)
        tail = "\n".join(self.log_text().splitlines()[-15:])
        raise RuntimeError(
            f"{self.name} did not get ready (exit code {self.process.poll()}); last lines of {self.log_path}:\n{tail}"
        )


def fetch_state(url: str):
    try:
        with urllib.request.urlopen(url + "api/state", timeout=5) as response:
            return json.load(response)
    except (OSError, ValueError):
        return None


def stop(peers: list, timeout: float = 40.0) -> None:
    """SIGTERM (clean leave + backup), then SIGKILL whatever is left of each peer's process tree."""
    trees = {}
    for peer in peers:
        try:
            trees[peer.name] = psutil.Process(peer.process.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            trees[peer.name] = []
        if peer.process.poll() is None:
            peer.process.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + timeout
    for peer in peers:
        try:
            code = peer.process.wait(timeout=max(0.1, deadline - time.monotonic()))
            logger.info("%s exited with code %s", peer.name, code)
        except subprocess.TimeoutExpired:
            logger.warning("%s did not stop within %.0f s: killing it", peer.name, timeout)
            peer.process.kill()
            peer.process.wait()
        for child in trees[peer.name]:
            try:
                child.kill()
            except psutil.NoSuchProcess:
                pass


def run(args: argparse.Namespace) -> int:
    workdir = (ROOT / args.workdir).resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    port = args.metrics_port or free_port()
    url = f"http://127.0.0.1:{port}/"
    common = ["--config", args.config, "--run_id", args.run_id, "--host_maddrs", "/ip4/127.0.0.1/tcp/0"]
    peers = []
    epochs_seen = {}
    state = None
    try:
        aux = Peer(
            "aux",
            "run_aux_peer.py",
            [
                *common,
                "--metrics_host",
                "127.0.0.1",
                "--metrics_port",
                port,
                "--checkpoint_dir",
                workdir / "checkpoints",
                "--checkpoint_every",
                args.checkpoint_every,
                "--refresh_period",
                2,
            ],
            workdir / "aux.log",
        )
        peers.append(aux)
        join = aux.wait_for(JOIN_RE, timeout=120).group(1).split()
        logger.info("Aux peer is up. Dashboard: %s  (Prometheus metrics: %smetrics)", url, url)
        logger.info("Others can join with: --run_id %s --initial_peers %s", args.run_id, " ".join(join))
        for i in range(1, args.trainers + 1):
            peers.append(
                Peer(
                    f"trainer{i}",
                    "run_trainer.py",
                    [*common, "--initial_peers", *join, "--output_dir", workdir / f"trainer{i}", "--torch_threads", 1],
                    workdir / f"trainer{i}.log",
                )
            )
        logger.info("Started %d trainers; training for %.0f s (logs in %s)", args.trainers, args.duration, workdir)
        deadline = time.monotonic() + args.duration
        while time.monotonic() < deadline:
            for peer in peers:
                if peer.process.poll() is not None:
                    raise RuntimeError(
                        f"{peer.name} exited early with code {peer.process.returncode}; see {peer.log_path}"
                    )
            state = fetch_state(url) or state
            for epoch in (state or {}).get("swarm", {}).get("epochs", []):
                if epoch["epoch"] not in epochs_seen and epoch.get("loss") is not None and math.isfinite(epoch["loss"]):
                    epochs_seen[epoch["epoch"]] = epoch["loss"]
                    swarm = state["swarm"]
                    logger.info(
                        "epoch %3d | loss %.4f | peers online %d | swarm %.1f samples/s",
                        epoch["epoch"],
                        epoch["loss"],
                        swarm["alive_peers"],
                        swarm["samples_per_second"],
                    )
            time.sleep(2.0)
        state = fetch_state(url) or state
    finally:
        logger.info("Stopping the swarm...")
        stop([p for p in peers if p.name != "aux"])
        stop([p for p in peers if p.name == "aux"])
    if not epochs_seen:
        logger.error("No global epoch finished in %.0f s; see the logs in %s", args.duration, workdir)
        return 1
    first, last = min(epochs_seen), max(epochs_seen)
    checkpoint = (state or {}).get("checkpoint") or {}
    logger.info(
        "Summary: %d global epochs (%d..%d), loss %.4f -> %.4f, last checkpoint: %s",
        len(epochs_seen),
        first,
        last,
        epochs_seen[first],
        epochs_seen[last],
        f"epoch {checkpoint['epoch']} at {checkpoint['path']}" if checkpoint else "none yet",
    )
    return 0


def main(argv=None) -> int:
    logging.basicConfig(
        level=os.environ.get("LEANHIVE_LOGLEVEL", "INFO"),
        format="%(asctime)s %(levelname)s %(message)s",
        datefmt="%H:%M:%S",
    )
    args = parse_args(argv)
    try:
        return run(args)
    except KeyboardInterrupt:
        logger.info("Interrupted")
        return 130
    except RuntimeError as e:
        logger.error("%s", e)
        return 1


if __name__ == "__main__":
    sys.exit(main())
