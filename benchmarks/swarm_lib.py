"""The parts of ``benchmarks/swarm.py``: run one swarm of real trainers on emulated links, and measure it.

One *run* is N trainer processes (``benchmarks.swarm_peer``: ``run_trainer.py`` with timers), each on its own
test host (a network namespace from ``benchmarks.testbed.netem``) behind a tbf bandwidth limit and a delay proxy, all
training the same model on the same data with the same per-step batch for the same number of global epochs.
While they train, a thread samples each host's interface counters; afterwards their lifecycle events
(``epoch_done``), their timers and the final parameters give the row: throughput, efficiency, bytes on the wire
per sample, a per-epoch time breakdown and the validation loss.

The ``solo`` mode runs N independent single-peer swarms at the same time (one per host, separate run ids): each
peer trains alone, and the N of them load the 2-core machine as the N peers of a real swarm do, so the
compute reference is measured under the same CPU contention.

Every row trains the same number of samples (``RunSettings.total_samples``): a mode whose rounds are larger
(``--sync_mode local`` with ``LOCAL_ROUNDS``) runs proportionally fewer global epochs, with its learning-rate
schedule scaled to the same samples, and every row is measured over the same samples: from the end of the largest
round of the matrix (startup, joining and the first round of every mode left out) to the end.
"""

from __future__ import annotations

import json
import logging
import math
import subprocess
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from benchmarks.testbed.faults.swarm import LinkProfile
from benchmarks.testbed.netem.hosts import Host, Testbed
from benchmarks.testbed.processes import PeerProcess, kill_all
from peer.backup import FINAL_PARAMS_NAME

logger = logging.getLogger(__name__)

PORT = 40000  # every trainer listens here on its own host; the others reach it through its proxy
PEER_MODULE = "benchmarks.swarm_peer"
TIMINGS_ENV = "LEANHIVE_BENCH_TIMINGS"
PARAMS_DIR_ENV = "LEANHIVE_BENCH_PARAMS_DIR"  # the first peer saves its parameters here for the validation curve
PARAMS_EVERY_ENV = "LEANHIVE_BENCH_PARAMS_EVERY"  # ... every this many global epochs
CURVE_POINTS = 4
"""Validation points per largest round (each row's points fall on the same sample counts where its rounds allow)."""
STARTUP = 180.0  # seconds for a peer to import, start its DHT and join on a loaded 2-core machine

LINKS: Dict[str, LinkProfile] = {
    "home": LinkProfile(mbit=20.0, rtt_ms=100.0),
    "broadband": LinkProfile(mbit=100.0, rtt_ms=20.0),
    "lan": LinkProfile(mbit=1000.0, rtt_ms=1.0),
    # a common home line: the upload is the bottleneck (tbf per direction)
    "home_asym": LinkProfile(mbit=10.0, down_mbit=50.0, rtt_ms=100.0),
}

MODES: Dict[str, List[str]] = {
    "solo": [],
    # today's defaults: hivemind.Optimizer as CALM and hivemind's ALBERT example use it
    "sync": [],
    # communication hidden behind the next accumulation (one step of staleness)
    "sync+overlap": ["--delay_optimizer_step", "--delay_grad_averaging"],
    # parameters averaged every 8 epochs instead of every epoch (peers step identically in between)
    "sync+rare_state": ["--average_state_every", "8"],
    "sync+overlap+rare_state": ["--delay_optimizer_step", "--delay_grad_averaging", "--average_state_every", "8"],
}
"""Mode -> trainer flags added to the common ones."""

LOCAL_ROUNDS: Dict[str, int] = {
    "local_x1": 1,
    "local_x2": 2,
    "local_x4": 4,
    "local_x8": 8,
    "local_x12": 12,
    "local_x16": 16,
}
"""--sync_mode local (DiLoCo-style) modes -> round size in sync epochs (``target_batch_size``): local_x12 averages
once per 12 epochs' worth of samples, so its bytes per sample are about 12 x 2 / 1.125 lower than sync's. H = local
steps per peer per round = round / (peers x samples per local step); the inner 8-bit LAMB steps after every local
step (about 40 ns per parameter on one CPU core), so local steps of many samples (``--gradient_accumulation_steps``,
the same for every row) keep it a small share, as a GPU does."""
for _name in LOCAL_ROUNDS:
    # the shared parameters are averaged every 8 rounds only: the pseudo-gradient all-reduce keeps peers together
    MODES[_name] = ["--sync_mode", "local", "--average_state_every", "8"]
SPARSE_ROUNDS: Dict[str, int] = {f"local_sparse_x{k}": k for k in (1, 2, 4, 8, 16, 32)}
"""--sync_mode local --outer_compression sparse (top-k at the trainer's --sparse_density, 2-bit values, error feedback;
peer/swarm/sparse.py),
the same round sizes. Every peer applies the same all-gathered average, so the shared parameters are never averaged
(--average_state_every beyond the run: it would send 8-bit parameters, more than all sparse rounds together)."""
LOCAL_ROUNDS.update(SPARSE_ROUNDS)
for _name in SPARSE_ROUNDS:
    MODES[_name] = ["--sync_mode", "local", "--outer_compression", "sparse", "--average_state_every", "1000000"]
    # SparseLoCo's outer step: no momentum (the decaying error-feedback buffer takes its part), learning rate 1
    MODES[_name] += ["--outer_momentum", "0", "--outer_learning_rate", "1"]

BREAKDOWN = (
    "compute",
    "blocked",
    "matchmaking",
    "grad_allreduce",
    "state_allreduce",
    "optimizer_step",
    "state_download",
)
"""Per-epoch time breakdown columns (seconds per global epoch per peer); ``matchmaking`` is the part of the wait for
the gradient all-reduce that the all-reduce itself does not explain."""


@dataclass
class RunSettings:
    """What every run of one benchmark invocation shares (rows differ only by link and mode)."""

    model_config: str = "bench"
    peers: int = 2
    per_device_batch_size: int = 4
    gradient_accumulation_steps: int = 1
    # an epoch is 16 local steps of about a second per peer: long enough for a broadband all-reduce to matter
    # little, short enough for the whole matrix to run in 30 minutes
    target_batch_size: int = 128
    epochs: int = 4
    """Global epochs of ``target_batch_size`` samples: every row trains ``epochs x target_batch_size`` samples."""
    max_sequence_length: int = 128
    learning_rate: float = 0.01
    min_learning_rate: float = 0.0001
    warmup_epochs: int = 2
    total_epochs: int = 100
    """The schedule, in epochs of ``target_batch_size`` samples (scaled to each mode's round size)."""
    matchmaking_time: float = 5.0
    averaging_timeout: float = 60.0
    compression_threshold: int = 65536
    extra: List[str] = field(default_factory=list)

    @property
    def total_samples(self) -> int:
        return self.epochs * self.target_batch_size

    def round_size(self, mode: str) -> int:
        """Samples per global epoch (a round, in local mode) of ``mode``."""
        return self.target_batch_size * LOCAL_ROUNDS.get(mode, 1)

    def epochs_of(self, mode: str) -> int:
        """Global epochs ``mode`` runs so that it trains ``total_samples``."""
        return self.total_samples // self.round_size(mode)

    def local_steps(self, mode: str) -> float:
        """H: local optimizer steps per peer per all-reduce (local modes only; NaN otherwise)."""
        if mode not in LOCAL_ROUNDS:
            return math.nan
        return self.round_size(mode) / (self.peers * self.per_device_batch_size * self.gradient_accumulation_steps)

    def check(self, modes: Sequence[str]) -> Optional[str]:
        """Why ``modes`` cannot train equal samples with these settings (None if they can)."""
        largest = max(LOCAL_ROUNDS.get(mode, 1) for mode in modes)
        uneven = [mode for mode in modes if largest % LOCAL_ROUNDS.get(mode, 1)]
        if uneven:
            return f"{', '.join(uneven)} cannot start the measured window at the end of the largest round ({largest} x)"
        if self.epochs % largest or self.epochs < 2 * largest:
            return (
                f"every row trains --epochs x --target_batch_size samples and is measured after the largest round "
                f"({largest} epochs): --epochs must be a multiple of {largest} and at least {2 * largest} "
                f"(got {self.epochs}; e.g. --epochs {max(2, self.epochs // largest + 1) * largest})"
            )
        return None

    def schedule(self, round_samples: int) -> Tuple[int, int]:
        """(warmup_steps, total_steps) for rounds of ``round_samples``: schedules count rounds, so the epochs of
        ``target_batch_size`` samples are scaled to keep them in samples."""
        scale = self.target_batch_size / round_samples
        warmup = max(1, round(self.warmup_epochs * scale)) if self.warmup_epochs else 0
        return warmup, max(warmup + 1, round(self.total_epochs * scale))

    def flags(self, mode: str = "sync") -> List[str]:
        warmup, total = self.schedule(self.round_size(mode))
        return [
            "--model_config",
            self.model_config,
            "--per_device_batch_size",
            str(self.per_device_batch_size),
            "--gradient_accumulation_steps",
            str(self.gradient_accumulation_steps),
            "--target_batch_size",
            str(self.round_size(mode)),
            "--max_epochs",
            str(self.epochs_of(mode)),
            "--max_sequence_length",
            str(self.max_sequence_length),
            "--seq_warmup_start_length",
            "0",
            "--learning_rate",
            str(self.learning_rate),
            "--min_learning_rate",
            str(self.min_learning_rate),
            "--warmup_steps",
            str(warmup),
            "--total_steps",
            str(total),
            "--matchmaking_time",
            str(self.matchmaking_time),
            "--averaging_timeout",
            str(self.averaging_timeout),
            "--compression_threshold",
            str(self.compression_threshold),
            "--load_state_timeout",
            "120",
            # no final barrier: the peers end the same all-reduce together, and its download would only add minutes
            "--final_sync_timeout",
            "0",
            "--startup_wait",
            str(STARTUP),
            "--backup_every_epochs",
            "0",
            "--device",
            "cpu",
            "--torch_threads",
            "1",
            "--rejoin_period",
            "2",
            *self.extra,
        ]


@dataclass
class Row:
    """One line of the table (and of ``--json``)."""

    link: str
    mode: str
    peers: int
    round_samples: int = 0
    """Samples per global epoch (a round of local mode)."""
    local_steps: float = math.nan
    """H: local optimizer steps per peer per round (local modes)."""
    epochs_measured: int = 0
    samples_measured: int = 0
    seconds_measured: float = math.nan
    samples_per_second: float = math.nan
    """Useful samples per second of the whole swarm (solo: of one peer)."""
    efficiency: float = math.nan
    """samples_per_second / (peers x solo samples per second)."""
    bytes_per_sample: float = math.nan
    """Bytes sent + received per peer, per sample that peer trained (interface counters, all protocols)."""
    bound_bytes_per_sample: float = math.nan
    """Butterfly all-reduce of the gradients at the wire format, same denominator."""
    seconds_per_epoch: float = math.nan
    mean_upload_mbit: float = math.nan
    """A peer's upload over the window, Mbit/s (the mean of the peers')."""
    peak_upload_mbit: float = math.nan
    """The highest upload of any peer over one sampling interval (about a second) in the window, Mbit/s: a round
    sent at once runs at the link's rate, what fragments streamed through the round (issue 28) would spread."""
    compute_share: float = math.nan
    """Share of a peer's wall time spent in forward/backward: what carries over to a GPU, where peers do not share
    cores (on this 2-core machine solo peers slow each other down more than swarm peers, who wait together)."""
    breakdown: Dict[str, float] = field(default_factory=dict)
    """Seconds per global epoch per peer, see BREAKDOWN."""
    validation_loss: float = math.nan
    final_epoch: int = 0
    wall_seconds: float = math.nan
    exit_codes: List[Optional[int]] = field(default_factory=list)
    curve: List[Dict[str, float]] = field(default_factory=list)
    """Per global epoch: swarm samples so far, seconds since the run started, mean training loss."""
    val_curve: List[Dict[str, float]] = field(default_factory=list)
    """Validation loss of the first peer's parameters at the end of some global epochs: samples so far, loss."""
    epochs_alone: int = 0
    """Epochs of the window that some peer ended counting fewer peers than the swarm has (it did not average)."""
    clients: int = 0
    """Peers that ran as clients of the swarm (their ``reachability`` event): every row compares full peers."""
    sparse_density: float = math.nan
    """A local sparse row's top-k density: the trainer's default when it ran (the mode names no density, and the
    default has changed, 2 % to 5 %), so a recorded row's is given with ``--from_record PATH@DENSITY``."""
    error: Optional[str] = None

    @property
    def bytes_over_bound(self) -> float:
        return self.bytes_per_sample / self.bound_bytes_per_sample if self.bound_bytes_per_sample else math.nan

    @property
    def samples_trained(self) -> float:
        """Samples the whole run trained (solo: per peer), from the epochs' events. hivemind ends an epoch once the
        swarm has reported its target, so the steps the peers have in flight overshoot it (by up to a local step
        per peer: much of a short epoch of large local steps)."""
        return float(self.curve[-1]["samples"]) if self.curve else math.nan

    def validation_points(self) -> List[Tuple[float, float]]:
        """(samples trained by then, validation loss) for each point of ``val_curve``."""
        trained = {int(c["epoch"]): float(c["samples"]) for c in self.curve}
        return [(trained.get(int(p["epoch"]), float(p["samples"])), p["loss"]) for p in self.val_curve]

    def as_dict(self) -> dict:
        return {**asdict(self), "bytes_over_bound": self.bytes_over_bound, "samples_trained": self.samples_trained}


def loss_at(points: Sequence[Tuple[float, float]], samples: float) -> float:
    """The validation loss at ``samples``, interpolated linearly between the points around it (NaN outside)."""
    points = sorted(points)
    for (x0, y0), (x1, y1) in zip(points, points[1:]):
        if x0 <= samples <= x1:
            return y0 if x1 == x0 else y0 + (y1 - y0) * (samples - x0) / (x1 - x0)
    return points[0][1] if len(points) == 1 and points[0][0] == samples else math.nan


# ------------------------------------------------------------------------------------ bytes on the wire


def wire_bytes_of(tensor_sizes: Sequence[int], threshold: int) -> int:
    """Bytes of one copy of the gradients in the adaptive wire format: 8-bit blockwise for tensors of at least
    ``threshold`` elements (one byte per value plus an fp32 scale per 4096-value block), fp16 below."""
    total = 0
    for size in tensor_sizes:
        total += size + 4 * math.ceil(size / 4096) if size >= threshold else 2 * size
    return total


def allreduce_bound_per_epoch(wire_bytes: int, peers: int) -> float:
    """Bytes a peer sends plus receives in one butterfly all-reduce: it sends (N-1)/N of its vector and receives
    the same in the reduce-scatter, and again in the all-gather."""
    return 4.0 * (peers - 1) / peers * wire_bytes if peers > 1 else 0.0


def interface_counters(host: Host) -> Tuple[int, int]:
    """(tx, rx) bytes of the host's link so far (every protocol: TCP/IP headers, DHT, averaging)."""
    out = subprocess.run(
        ["ip", "-n", host.name, "-s", "-j", "link", "show", "eth0"], capture_output=True, text=True, timeout=10
    )
    stats = json.loads(out.stdout)[0]["stats64"]
    return int(stats["tx"]["bytes"]), int(stats["rx"]["bytes"])


class CounterSampler(threading.Thread):
    """Samples every host's interface counters about once a second, so that bytes can be read for any window:
    ``samples`` holds tx + rx, ``uploads`` tx alone (the uplink a home peer is limited by)."""

    def __init__(self, hosts: Sequence[Host], period: float = 1.0):
        super().__init__(daemon=True, name="counter-sampler")
        self.hosts, self.period = list(hosts), period
        self.samples: List[Tuple[float, List[int]]] = []
        self.uploads: List[Tuple[float, List[int]]] = []
        self._stop_event = threading.Event()

    def sample(self) -> None:
        try:
            moment, counters = time.time(), [interface_counters(host) for host in self.hosts]
        except (OSError, subprocess.SubprocessError, ValueError, KeyError, IndexError) as e:
            logger.warning("Could not read interface counters: %s", e)
            return
        self.samples.append((moment, [tx + rx for tx, rx in counters]))
        self.uploads.append((moment, [tx for tx, _ in counters]))

    def run(self) -> None:
        while not self._stop_event.wait(self.period):
            self.sample()

    def stop(self) -> None:
        self._stop_event.set()
        self.join(timeout=10)
        self.sample()

    def upload_rates(self, index: int, start: float, end: float) -> List[float]:
        """Host ``index``'s upload in bytes per second over each sampling interval that lies inside [start, end]."""
        inside = [(moment, sent[index]) for moment, sent in self.uploads if start <= moment <= end]
        return [(b - a) / (t1 - t0) for (t0, a), (t1, b) in zip(inside, inside[1:]) if t1 > t0]

    def at(self, moment: float) -> List[float]:
        """Counters (tx + rx) of every host at ``moment``, interpolated linearly between the samples around it."""
        return _interpolated(self.samples, moment, len(self.hosts))

    def uploaded(self, moment: float) -> List[float]:
        """tx counters of every host at ``moment``, interpolated the same way."""
        return _interpolated(self.uploads, moment, len(self.hosts))


def _interpolated(series: Sequence[Tuple[float, List[int]]], moment: float, width: int) -> List[float]:
    if not series:
        return [math.nan] * width
    before = [s for s in series if s[0] <= moment]
    after = [s for s in series if s[0] >= moment]
    if not before:
        return [float(v) for v in after[0][1]]
    if not after:
        return [float(v) for v in before[-1][1]]
    (t0, v0), (t1, v1) = before[-1], after[0]
    weight = 0.0 if t1 == t0 else (moment - t0) / (t1 - t0)
    return [a + (b - a) * weight for a, b in zip(v0, v1)]


# ------------------------------------------------------------------------------------------ one run


class BenchPeer(PeerProcess):
    """A timed trainer inside a test host."""

    def __init__(self, args: Sequence[str], *, name: str, folder: Path, host: Host, params_every: int = 0):
        self.folder = folder / name
        self.timings_path = folder / f"{name}.timings.jsonl"
        self.params_dir = folder / f"{name}.params"
        env = {TIMINGS_ENV: str(self.timings_path)}
        if params_every:
            env.update({PARAMS_DIR_ENV: str(self.params_dir), PARAMS_EVERY_ENV: str(params_every)})
        super().__init__(
            args,
            name=name,
            log_path=folder / f"{name}.log",
            module=PEER_MODULE,
            env=env,
            events_path=folder / f"{name}.events.jsonl",
        )
        self.host = host
        self.command = host.command(self.command)  # `ip netns exec` execs: the pid is python's

    def start(self) -> "BenchPeer":
        self.folder.mkdir(parents=True, exist_ok=True)
        self.timings_path.write_bytes(b"")
        super().start()
        return self

    def timings(self) -> List[dict]:
        if not self.timings_path.exists():
            return []
        return [json.loads(line) for line in self.timings_path.read_text().splitlines() if line.strip()]


def run_swarm(
    folder: Path, *, link_name: str, mode: str, settings: RunSettings, timeout: float, params_every: int = 0
) -> Tuple[List[BenchPeer], CounterSampler, float]:
    """Start N trainers on emulated links, wait for them to finish ``settings.epochs_of(mode)`` global epochs;
    returns the (exited) peers, the counter samples and the start time. Hosts and processes are gone when it
    returns. With ``params_every``, the first peer saves its parameters every that many global epochs."""
    link = LINKS[link_name]
    folder.mkdir(parents=True, exist_ok=True)
    peers: List[BenchPeer] = []
    started = time.time()
    with Testbed(settings.peers) as testbed:
        proxies = []
        for host in testbed.hosts:
            testbed.set_bandwidth(host, link.mbit, down_mbit=link.down_mbit)
            proxies.append(testbed.start_proxy(host, PORT, settings=link.proxy_settings()))
        sampler = CounterSampler(testbed.hosts)
        sampler.sample()
        sampler.start()
        try:
            solo = mode == "solo"
            initial: List[str] = []
            for index, host in enumerate(testbed.hosts):
                name = f"peer{index}"
                args = [
                    "--run_id",
                    f"bench_{mode.replace('+', '_')}_{index}" if solo else f"bench_{mode.replace('+', '_')}",
                    *settings.flags(mode),
                    *MODES[mode],
                    "--min_peers",
                    "1" if solo else str(settings.peers),
                    *proxies[index].peer_flags(PORT),
                    "--identity_path",
                    str(folder / name / "identity.key"),
                    "--output_dir",
                    str(folder / name),
                ]
                if initial and not solo:
                    args += ["--initial_peers", *initial]
                peer = BenchPeer(args, name=name, folder=folder, host=host, params_every=params_every * (index == 0))
                peers.append(peer.start())
                if index == 0 and not solo:
                    initial = peer.initial_peers(STARTUP)
            deadline = time.monotonic() + timeout
            for peer in peers:
                try:
                    peer.wait(max(1.0, deadline - time.monotonic()))
                except TimeoutError as e:
                    logger.warning("%s", str(e).splitlines()[0])
        finally:
            sampler.stop()
            kill_all(peers)
    return peers, sampler, started


# ------------------------------------------------------------------------------------------ measures


def _epochs(peer: BenchPeer) -> Dict[int, dict]:
    return {int(e["epoch"]): e for e in peer.events.all("epoch_done")}


def measure(
    row: Row,
    peers: Sequence[BenchPeer],
    sampler: CounterSampler,
    started: float,
    *,
    wire_bytes: int,
    solo_rate: Optional[float],
    window_start: int = 0,
) -> Row:
    """Fill ``row`` from what the peers wrote. The window runs from the end of the global epoch at which the swarm
    had trained ``window_start`` samples (at least the first epoch every peer finished: startup and joining left
    out) to the end of the last one."""
    solo = row.mode == "solo"
    done = [_epochs(peer) for peer in peers]
    row.exit_codes = [peer.poll() for peer in peers]
    row.final_epoch = min((max(d) + 1 if d else 0) for d in done)
    wanted = window_start // row.round_samples - 1 if row.round_samples else 0
    common = sorted(e for e in set.intersection(*(set(d) for d in done)) if e >= wanted) if done else []
    if len(common) < 2:
        row.error = (
            f"fewer than 2 global epochs from epoch {wanted} on finished by every peer (exit codes {row.exit_codes})"
        )
        return row
    first, last = common[0], common[-1]
    if solo:  # independent peers: each one's own window, rates averaged
        rates, spans, samples = [], [], 0
        for d in done:
            span = d[last]["time"] - d[first]["time"]
            measured = sum(int(d[e]["samples"]) for e in d if first < e <= last)
            rates.append(measured / span)
            spans.append(span)
            samples += measured
        row.samples_per_second = sum(rates) / len(rates)
        row.seconds_measured = sum(spans) / len(spans)
        windows = [(d[first]["time"], d[last]["time"]) for d in done]
    else:
        start = max(d[first]["time"] for d in done)
        end = max(d[last]["time"] for d in done)
        samples = sum(int(d[e]["samples"]) for d in done for e in d if first < e <= last)
        row.seconds_measured = end - start
        row.samples_per_second = samples / (end - start)
        windows = [(start, end)] * len(peers)
    row.epochs_measured = last - first
    if not solo:  # a peer that ended an epoch on a view of fewer peers skipped that epoch's averaging
        row.epochs_alone = sum(
            1 for d in done for e in range(first + 1, last + 1) if e in d and d[e].get("peers", len(peers)) < len(peers)
        )
        if row.epochs_alone:
            logger.warning("%s/%s: %d peer-epochs ended without the whole swarm", row.link, row.mode, row.epochs_alone)
    row.clients = sum(1 for peer in peers if (peer.events.last("reachability") or {}).get("client_mode"))
    if row.clients:
        logger.warning("%s/%s: %d of %d peers ran as clients of the swarm", row.link, row.mode, row.clients, len(peers))
    row.samples_measured = samples
    row.seconds_per_epoch = row.seconds_measured / row.epochs_measured
    if solo_rate:
        row.efficiency = row.samples_per_second / ((1 if solo else row.peers) * solo_rate)

    # bytes: each peer's interface over its window, per sample trained in it
    moved = 0.0
    for index, (start, end) in enumerate(windows):
        moved += sampler.at(end)[index] - sampler.at(start)[index]
    row.bytes_per_sample = moved / samples
    rates = [sampler.upload_rates(index, start, end) for index, (start, end) in enumerate(windows)]
    means = [
        8e-6 * (sampler.uploaded(end)[index] - sampler.uploaded(start)[index]) / (end - start)
        for index, (start, end) in enumerate(windows)
        if end > start
    ]
    row.mean_upload_mbit = sum(means) / len(means) if means else math.nan
    row.peak_upload_mbit = 8e-6 * max((r for peer_rates in rates for r in peer_rates), default=math.nan)
    epochs_of_all_peers = row.epochs_measured * (1 if solo else len(peers))
    row.bound_bytes_per_sample = (
        allreduce_bound_per_epoch(wire_bytes, 1 if solo else row.peers) * epochs_of_all_peers / samples
    )

    # time breakdown: intervals that start inside the window, per epoch per peer
    totals = {kind: 0.0 for kind in BREAKDOWN}
    for peer, (start, end) in zip(peers, windows):
        for item in peer.timings():
            if start <= item["start"] < end and item["kind"] in totals:
                totals[item["kind"]] += item["end"] - item["start"]
    per = {kind: value / (row.epochs_measured * len(peers)) for kind, value in totals.items()}
    per["grad_wait"] = 0.0
    for peer, (start, end) in zip(peers, windows):
        per["grad_wait"] += sum(
            i["end"] - i["start"] for i in peer.timings() if i["kind"] == "grad_wait" and start <= i["start"] < end
        )
    per["grad_wait"] /= row.epochs_measured * len(peers)
    per["matchmaking"] = max(0.0, per["grad_wait"] - per["grad_allreduce"]) if not _overlaps(row.mode) else math.nan
    row.breakdown = per
    row.compute_share = per["compute"] / row.seconds_per_epoch

    # curve for the plot: swarm samples so far and the mean training loss, per global epoch (peer 0's clock)
    swarm_samples = 0
    for epoch in sorted(set().union(*(set(d) for d in done))):
        events = [d[epoch] for d in done if epoch in d]
        swarm_samples += sum(int(e["samples"]) for e in events) // (len(peers) if solo else 1)
        losses = [e["loss"] for e in events if e.get("loss") is not None]
        row.curve.append(
            dict(
                epoch=epoch,
                samples=swarm_samples,
                seconds=max(e["time"] for e in events) - started,
                loss=sum(losses) / len(losses) if losses else math.nan,
            )
        )
    return row


def _overlaps(mode: str) -> bool:
    """In overlap mode the gradient wait runs beside the next accumulation: matchmaking cannot be told apart."""
    return "overlap" in mode


# ------------------------------------------------------------------------------------ validation loss


def validation_losses(
    params_paths: Sequence[Path], model_config: str, max_sequence_length: int, *, max_batches: int
) -> List[float]:
    """Mean next-token loss of each saved parameter set on the shipped corpus's validation split (NaN if absent)."""
    from aux_monitor.evaluation import evaluate
    from model import LeanGPTForCausalLM, load_config
    from peer.swarm.data import DataArguments, build_validation_dataset, load_tokenizer

    model = LeanGPTForCausalLM(load_config(model_config))
    data = DataArguments(max_sequence_length=max_sequence_length, seq_warmup_start_length=0)
    blocks = build_validation_dataset(data, load_tokenizer(data))
    losses = []
    for path in params_paths:
        if not path.exists():
            losses.append(math.nan)
            continue
        saved = torch.load(path, map_location="cpu", weights_only=True)
        model.load_state_dict(saved["params"])
        losses.append(evaluate(model, blocks, epoch=int(saved["epoch"]), batch_size=8, max_batches=max_batches).loss)
    return losses


def validation_loss(params_path: Path, model_config: str, max_sequence_length: int, *, max_batches: int) -> float:
    """Mean next-token loss of the final parameters on the shipped corpus's validation split."""
    return validation_losses([params_path], model_config, max_sequence_length, max_batches=max_batches)[0]


def params_every(window_start: int, round_samples: int) -> int:
    """Global epochs between the first peer's saved parameters: CURVE_POINTS per largest round of the matrix."""
    return max(1, window_start // CURVE_POINTS // round_samples)


def validation_curve(
    peer: BenchPeer, round_samples: int, model_config: str, max_sequence_length: int, *, max_batches: int
) -> List[Dict[str, float]]:
    """Validation loss of the parameters the first peer saved (``params_every``), by samples the swarm trained
    (nominal: epochs x round size). The files are removed once measured (4 bytes per parameter each)."""
    paths = sorted(peer.params_dir.glob("epoch_*.pt"))
    losses = validation_losses(paths, model_config, max_sequence_length, max_batches=max_batches)
    curve = []
    for path, loss in zip(paths, losses):
        epoch = int(path.stem.split("_")[1])
        curve.append(dict(epoch=epoch, samples=(epoch + 1) * round_samples, loss=loss))
        path.unlink()
    return curve


def final_params(peers: Sequence[BenchPeer]) -> Path:
    return peers[0].folder / FINAL_PARAMS_NAME
