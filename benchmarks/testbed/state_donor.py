"""A state donor for the download tests: a real hivemind peer with LeanHive's real optimizer (8-bit LAMB, the real
``LeanHiveStateAverager``) over a small model built from ``--seed``, that only serves its state.

    python -m benchmarks.testbed.state_donor --run_id RUN --ready FILE [--initial_peers ...] [--mode MODE]

Donors built from the same seed hold bit-identical states (the same model, the same freshly initialized optimizer
statistics), as the peers of a healthy synchronous swarm do after an epoch. ``--ready`` gets a JSON object
(peer_id, initial_peers) once the state is declared; ``--state_out`` gets the served tensors (torch.save) so that
a test can compare what a joiner ends with.

Modes (how it serves):
- ``honest``: as every trainer does.
- ``cut``: the whole-state stream ends cleanly after ``--cut_bytes`` bytes, as a relayed libp2p circuit does at its
  128 KiB data limit (the joiner used to reshape what it had and fail with a shape error).
- ``wrong_part``: part ``--wrong_part`` of the partitioned state (-1: the first part a joiner asks it for) is served
  with every byte of it flipped: well formed (the right size; the digest is what must catch it), while the manifest
  it announces is the honest one.
- ``wrong_manifest``: the same wrong part, and a manifest that matches it (this donor's digest is then outvoted).
- ``cut_part``: the first request for part ``--wrong_part`` ends after its answer header with none of the part's
  bytes (a connection cut mid-download, as a home donor's was at its epoch's end); later requests are served.

``--serve_rate`` bounds the bytes per second it sends parts at (0: unbounded), so that a test can kill it
mid-download; ``--part_bytes`` sets its partition; ``--no_parts`` removes the part RPC (a peer that serves only
hivemind's whole-state stream).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import re
import sys
import threading
import time
from pathlib import Path
from typing import AsyncIterator, Dict, List, Optional, Tuple

import hivemind
import torch
from hivemind.p2p import P2PContext
from hivemind.proto import averaging_pb2
from hivemind.utils.crypto import RSAPrivateKey

from benchmarks.testbed.processes import (
    PeerProcess,
    share_tensors_by_file_descriptor,
    wait_for_file,
    write_ready_file,
)
from model import LeanGPTForCausalLM, load_config
from peer.swarm.config import CollaborationArguments, OptimizerArguments
from peer.swarm.hivemind_seam import LeanHiveStateAverager
from peer.swarm.network import make_validators
from peer.swarm.optimizer import build_optimizer
from peer.swarm.state_parts import DEFAULT_PART_BYTES

logger = logging.getLogger("state_donor")

MODES = ("honest", "cut", "wrong_part", "wrong_manifest", "cut_part")


def make_model(seed: int, width: int = 4096, inner: int = 128, preset: Optional[str] = None) -> torch.nn.Module:
    """The model of donors and joiners: its first weight is [4096, 128], the shape of the relay-cut report.

    With ``preset`` (a model preset name, e.g. ``small``) it is LeanHive's own model of that preset instead, so that
    the state served is the one a swarm of that preset holds (its tensors, sizes and 8-bit statistics).
    """
    torch.manual_seed(seed)
    if preset is not None:
        return LeanGPTForCausalLM(load_config(preset))
    return torch.nn.Sequential(torch.nn.Linear(inner, width), torch.nn.ReLU(), torch.nn.Linear(width, inner))


def make_optimizer(model, dht, run_id: str, key, **collab_kwargs):
    collab = CollaborationArguments(target_batch_size=4, matchmaking_time=1.0, **collab_kwargs)
    return build_optimizer(
        model=model,
        dht=dht,
        run_id=run_id,
        signing_key=key,
        batch_size_per_step=4,
        collab=collab,
        optim=OptimizerArguments(),
        client_mode=False,
    )


async def _cut(stream, limit: int):
    sent = 0
    async for message in stream:
        sent += message.ByteSize()
        if sent > limit:
            logger.info("Cut the state stream after %d bytes", sent - message.ByteSize())
            return
        yield message


def _cut_streams(limit: int) -> None:
    """Both state RPCs end cleanly after ``limit`` bytes per stream (a relay circuit's data limit)."""
    whole, part = LeanHiveStateAverager.rpc_download_state, LeanHiveStateAverager.rpc_download_state_part

    async def rpc_download_state(
        self, request: averaging_pb2.DownloadRequest, context: P2PContext
    ) -> AsyncIterator[averaging_pb2.DownloadData]:
        async for message in _cut(whole(self, request, context), limit):
            yield message

    async def rpc_download_state_part(
        self, request: averaging_pb2.DownloadData, context: P2PContext
    ) -> AsyncIterator[averaging_pb2.DownloadData]:
        async for message in _cut(part(self, request, context), limit):
            yield message

    LeanHiveStateAverager.rpc_download_state = rpc_download_state
    LeanHiveStateAverager.rpc_download_state_part = rpc_download_state_part


def _serve_wrong_part(wrong: int, announce_it: bool) -> None:
    """Part ``wrong`` is served with every byte flipped: well formed (the right size), wrong. With ``announce_it``
    the manifest is built over the wrong state too (its root then differs from the honest donors')."""
    honest_bytes = LeanHiveStateAverager._part_bytes

    served_wrong = []

    def _part_bytes(self, snapshot, part, start, end):
        data = honest_bytes(self, snapshot, part, start, end)
        if part == wrong or (wrong < 0 and not served_wrong):  # -1: the first part it is asked for
            served_wrong.append(part)
            logger.info("Serving a wrong part %d", part)
            return bytes(b ^ 0xFF for b in data)
        return data

    LeanHiveStateAverager._part_bytes = _part_bytes
    if announce_it:
        import peer.swarm.hivemind_seam.state_transfer as transfer

        honest_flatten = transfer.flatten

        def wrong_flatten(tensors):
            buffer = honest_flatten(tensors)
            start = wrong * LeanHiveStateAverager.serve_part_bytes
            buffer[start : start + LeanHiveStateAverager.serve_part_bytes] ^= 0xFF
            return buffer

        transfer.flatten = wrong_flatten


def _cut_part_once(part_index: int) -> None:
    honest_bytes = LeanHiveStateAverager._part_bytes
    cut = []

    def _part_bytes(self, snapshot, part, start, end):
        if part == part_index and not cut:
            cut.append(part)
            logger.info("Cut part %d: none of its bytes sent", part)
            return b""
        return honest_bytes(self, snapshot, part, start, end)

    LeanHiveStateAverager._part_bytes = _part_bytes


def _round_after(parts: int, seconds: float) -> None:
    """A round of this donor starts after it served ``parts`` parts and runs ``seconds`` (the flag the host sets
    around a real gradient round, set here in the averager process): serving must pause meanwhile."""
    honest_bytes = LeanHiveStateAverager._part_bytes
    served = []

    def _part_bytes(self, snapshot, part, start, end):
        served.append(part)
        if len(served) == parts:
            self.round_running.set()
            logger.info("Round started after %d parts", parts)

            async def end_round():
                await asyncio.sleep(seconds)
                self.round_running.clear()
                await asyncio.sleep(1.0)  # the paused sender wakes up and counts its pause
                logger.info("Round ended; serving went on after %.1f s paused for it", self.yielded_seconds)

            asyncio.get_event_loop().create_task(end_round())
        return honest_bytes(self, snapshot, part, start, end)

    LeanHiveStateAverager._part_bytes = _part_bytes


_SERVING = threading.Event()
"""Set once the donor is ready: the states asked for from then on are served to joiners (not --state_out's)."""


def _lag_epoch(seconds: float) -> None:
    """The state announces its epoch minus 1 until ``seconds`` after the first joiner asked for it (the host
    process answers the averager's every snapshot through ``get_current_state``)."""
    original = LeanHiveStateAverager.get_current_state
    until: List[float] = []

    def get_current_state(self):
        metadata, tensors, infos = original(self)
        if _SERVING.is_set():
            if not until:
                until.append(time.monotonic() + seconds)
            if time.monotonic() < until[0]:
                metadata = dict(metadata, epoch=metadata["epoch"] - 1)
        return metadata, tensors, infos

    LeanHiveStateAverager.get_current_state = get_current_state


def _pace(rate: float) -> None:
    async def pace(self, nbytes: int) -> None:
        await asyncio.sleep(nbytes / rate)

    LeanHiveStateAverager._pace = pace


def main(argv) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--initial_peers", nargs="*", default=[])
    parser.add_argument("--run_id", required=True)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--mode", choices=MODES, default="honest")
    parser.add_argument("--cut_bytes", type=int, default=128 * 1024)
    parser.add_argument("--wrong_part", type=int, default=0)
    parser.add_argument("--serve_rate", type=float, default=0.0)
    parser.add_argument("--part_bytes", type=int, default=DEFAULT_PART_BYTES)
    parser.add_argument("--no_parts", action="store_true")
    parser.add_argument("--width", type=int, default=4096, help="the model's hidden width (the state's size)")
    parser.add_argument("--preset", default=None, help="serve the state of this model preset's LeanHive model instead")
    parser.add_argument("--host", default="127.0.0.1", help="the address it listens on")
    parser.add_argument(
        "--round_after_parts",
        type=int,
        default=0,
        help="after serving this many parts, hold its averaging-round flag set for --round_seconds (0: never)",
    )
    parser.add_argument("--round_seconds", type=float, default=3.0)
    parser.add_argument("--max_joiners", type=int, default=None)
    parser.add_argument("--epoch", type=int, default=0, help="the epoch its state announces")
    parser.add_argument(
        "--lag_seconds",
        type=float,
        default=0.0,
        help="announce --epoch minus 1 until this long after the first joiner asked, then --epoch (the same bits): "
        "a donor that ends its round a moment after the others",
    )
    parser.add_argument("--ready", required=True)
    parser.add_argument("--state_out", default=None)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")

    # class attributes, set before the averager process is forked (it inherits them)
    LeanHiveStateAverager.serve_part_bytes = args.part_bytes
    if args.no_parts:  # an older peer: hivemind's whole-state stream only
        LeanHiveStateAverager.rpc_download_state_part = None
    if args.mode == "cut":
        _cut_streams(args.cut_bytes)
    if args.mode in ("wrong_part", "wrong_manifest"):
        _serve_wrong_part(args.wrong_part, args.mode == "wrong_manifest")
    if args.mode == "cut_part":
        _cut_part_once(args.wrong_part)
    if args.serve_rate > 0:
        _pace(args.serve_rate)
    if args.round_after_parts > 0:
        _round_after(args.round_after_parts, args.round_seconds)
    if args.lag_seconds > 0:
        _lag_epoch(args.lag_seconds)
    share_tensors_by_file_descriptor()
    key = RSAPrivateKey()
    dht = hivemind.DHT(
        start=True,
        initial_peers=args.initial_peers,
        host_maddrs=[f"/ip4/{args.host}/tcp/0"],
        record_validators=make_validators(args.run_id, key)[0],
    )
    extra = {} if args.max_joiners is None else {"serve_max_joiners": args.max_joiners}
    optimizer = make_optimizer(
        make_model(args.seed, width=args.width, preset=args.preset), dht, args.run_id, key, **extra
    )
    optimizer.state_averager.parameters_replaced(args.epoch)
    if args.state_out:
        _, tensors, _ = optimizer.state_averager.get_current_state()
        torch.save([t.clone() for t in tensors], args.state_out)
    time.sleep(2.0)  # the state declaration reaches the DHT
    maddrs = [str(m) for m in dht.get_visible_maddrs()]
    _SERVING.set()
    write_ready_file(args.ready, json.dumps({"peer_id": dht.peer_id.to_base58(), "initial_peers": maddrs}))
    logger.info("Serving the state (%s) as %s", args.mode, dht.peer_id)
    try:
        while True:
            time.sleep(1.0)
    finally:
        optimizer.shutdown()
        dht.shutdown()


# ------------------------------------------------------------------------------- for tests and fault scenarios

seam_logger = logging.getLogger("peer.swarm.hivemind_seam.averaging")


def start_donor(folder: Path, name: str, run_id: str, *args, initial_peers=()) -> PeerProcess:
    ready = folder / f"{name}.ready"
    extra = ["--initial_peers", *initial_peers] if initial_peers else []
    peer = PeerProcess(
        ["--run_id", run_id, "--ready", ready, "--state_out", folder / f"{name}.pt", *extra, *args],
        name=name,
        log_path=folder / f"{name}.log",
        module="benchmarks.testbed.state_donor",
    ).start()
    peer.ready_path = ready
    return peer


def wait_ready(peer: PeerProcess, timeout: float = 120.0) -> dict:
    return json.loads(wait_for_file(peer.ready_path, peer, timeout))


class Joiner:
    """A joining peer in this process: the same model from another seed, LeanHive's real optimizer."""

    def __init__(self, run_id: str, initial_peers: List[str], log_path: Path, **collab):
        share_tensors_by_file_descriptor()
        # the download runs in the averager process (forked below): it inherits this handler
        self.log_path = log_path
        self.handler = logging.FileHandler(log_path)
        self.handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s"))
        seam_logger.addHandler(self.handler)
        seam_logger.setLevel(logging.INFO)  # the download's summary line (parts per donor) is INFO
        key = RSAPrivateKey()
        self.dht = hivemind.DHT(
            start=True,
            initial_peers=initial_peers,
            host_maddrs=["/ip4/127.0.0.1/tcp/0"],
            record_validators=make_validators(run_id, key)[0],
        )
        self.optimizer = make_optimizer(make_model(seed=2), self.dht, run_id, key, **collab)
        seam_logger.removeHandler(self.handler)  # the forked averager process keeps its copy; other joiners log apart
        self.optimizer.state_averager.allow_state_sharing = False  # its own fresh state is no one's to take

    def state(self) -> list:
        _, tensors, _ = self.optimizer.state_averager.get_current_state()
        return tensors

    def log(self) -> str:
        return self.log_path.read_text()

    def close(self):
        self.optimizer.shutdown()
        self.dht.shutdown()
        self.handler.close()


def start_donors(folder: Path, run_id: str, specs, part_bytes: int = 256 << 10) -> List[PeerProcess]:
    """Donors from ``specs`` (name, extra args), the first one the others' initial peer; all ready."""
    peers, join = [], []
    for name, args in specs:
        peers.append(start_donor(folder, name, run_id, "--part_bytes", str(part_bytes), *args, initial_peers=join))
        info = wait_ready(peers[-1])
        peers[-1].peer_id = info["peer_id"]
        join = join or info["initial_peers"]
    peers[0].join = join
    return peers


def same_state(joiner: Joiner, donor_file: Path) -> bool:
    served = torch.load(donor_file, weights_only=True)
    got = joiner.state()
    return len(served) == len(got) and all(a.dtype == b.dtype and torch.equal(a, b) for a, b in zip(served, got))


DONOR_SHARE_RE = re.compile(r"(\w{40,}): (\d+) parts, ([\d.]+) MB")
"""A donor's share in a joiner's 'Downloaded the state ... in N parts from K donor(s) ...' line (peer IDs of both key
types: RSA's Qm..., Ed25519's 12D3...)."""


def download_shares(text: str) -> Dict[str, Tuple[int, float]]:
    """peer ID -> (parts, MB) it delivered, from the last 'Downloaded the state ... in N parts' line of ``text``
    (empty if there is none)."""
    lines = [row for row in text.splitlines() if "Downloaded the state" in row]
    if not lines:
        return {}
    return {m.group(1): (int(m.group(2)), float(m.group(3))) for m in DONOR_SHARE_RE.finditer(lines[-1])}


def parts_from(text: str) -> dict:
    """peer ID -> parts it delivered, from the joiner's last 'Downloaded the state ... in N parts' line."""
    return {peer: parts for peer, (parts, _) in download_shares(text).items()}


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
