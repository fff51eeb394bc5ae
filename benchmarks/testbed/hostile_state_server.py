"""A hostile state server: a real hivemind peer that joins a run, downloads the swarm's state from an honest
trainer, corrupts it and offers it to joining peers with a huge state-sharing priority.

    python -m benchmarks.testbed.hostile_state_server --initial_peers ... --run_id RUN --mode huge_epoch --ready FILE

Modes (the broken states):
- ``huge_epoch``: the state claims epoch 10**12.
- ``wrong_shape``: the first parameter is a 1-element tensor (hivemind's copy_ broadcast it into a constant).
- ``foreign_hparams``: every float hyper-parameter of the optimizer is multiplied by 100 (lr, betas, eps...).
- ``bad_absmax``: the smallest float32 optimizer tensor (an 8-bit block absmax) loses its last element.
- ``trickle``: the state is sent one tiny message per second, forever.

It writes ``--ready`` (its peer ID) once it serves the bad state, then runs until killed.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
import time
from typing import AsyncIterator

import hivemind
import torch
from hivemind.averaging import DecentralizedAverager
from hivemind.p2p import P2PContext
from hivemind.proto import averaging_pb2
from hivemind.utils.crypto import RSAPrivateKey

from benchmarks.testbed.processes import write_ready_file
from peer.swarm.keys import state_averager_prefix
from peer.swarm.records import make_validators

logger = logging.getLogger("hostile_state_server")

MODES = ("huge_epoch", "wrong_shape", "foreign_hparams", "bad_absmax", "trickle")
HOSTILE_PRIORITY = 1e9


def corrupt(mode: str, metadata: dict, tensors: list) -> tuple:
    tensors = [t.clone() for t in tensors]
    if mode == "huge_epoch":
        metadata["epoch"] = 10**12
    elif mode == "wrong_shape":
        tensors[0] = tensors[0].flatten()[:1].clone()
    elif mode == "foreign_hparams":
        for entry in metadata["optimizer_metadata"]:
            if entry.get("type") == "value" and isinstance(entry.get("value"), float) and entry["value"] > 0:
                entry["value"] *= 100.0
    elif mode == "bad_absmax":
        small = [i for i, t in enumerate(tensors) if t.dtype == torch.float32 and 1 < t.numel() < 64]
        index = min(small, key=lambda i: tensors[i].numel()) if small else len(tensors) - 1
        tensors[index] = tensors[index].flatten()[:-1].clone()
    return metadata, tensors


class LeanHiveStateAverager(DecentralizedAverager):
    """Named like the trainers' state averager: hivemind names RPC handlers after the class."""

    crafted = None
    trickle = False

    def get_current_state(self):
        metadata, tensors = self.crafted
        return metadata, tensors, None

    async def rpc_download_state(
        self, request: averaging_pb2.DownloadRequest, context: P2PContext
    ) -> AsyncIterator[averaging_pb2.DownloadData]:
        if not self.trickle:
            async for message in super().rpc_download_state(request, context):
                yield message
            return
        metadata = self.serializer.dumps({"epoch": 1})
        while True:  # never finishes: a tiny message per second keeps any per-chunk timeout happy
            yield averaging_pb2.DownloadData(metadata=metadata)
            await asyncio.sleep(1.0)


def main(argv) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--initial_peers", nargs="+", required=True)
    parser.add_argument("--run_id", required=True)
    parser.add_argument("--mode", choices=MODES, required=True)
    parser.add_argument("--ready", required=True)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")

    LeanHiveStateAverager.trickle = args.mode == "trickle"  # before the averager process is forked
    validators, _ = make_validators(args.run_id, RSAPrivateKey())
    dht = hivemind.DHT(
        start=True, initial_peers=args.initial_peers, host_maddrs=["/ip4/127.0.0.1/tcp/0"], record_validators=validators
    )
    averager = LeanHiveStateAverager(
        averaged_tensors=[torch.zeros(1)], dht=dht, prefix=state_averager_prefix(args.run_id), start=True
    )
    averager.allow_state_sharing = False
    state = None
    while state is None:  # the honest state first: its structure is what the corrupted one imitates
        state = averager.load_state_from_peers(timeout=60)
        if state is None:
            time.sleep(1.0)
    metadata, tensors = state
    logger.info("Downloaded the honest state of epoch %s (%d tensors)", metadata.get("epoch"), len(tensors))
    averager.crafted = corrupt(args.mode, metadata, tensors)
    averager.state_sharing_priority = HOSTILE_PRIORITY
    averager.allow_state_sharing = True
    time.sleep(3.0)  # the declaration reaches the DHT
    write_ready_file(args.ready, dht.peer_id.to_base58())
    logger.info("Serving a %s state with priority %g", args.mode, HOSTILE_PRIORITY)
    while True:
        time.sleep(1.0)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
