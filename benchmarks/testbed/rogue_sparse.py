"""A rogue peer of ``--outer_compression sparse``: a real separate process that joins an honest peer's sparse
all-gather and sends it malformed payloads (tests/swarm/test_sparse_wire.py starts it).

    python -m benchmarks.testbed.rogue_sparse SPEC_JSON

SPEC_JSON: {"maddrs": [...honest peer's multiaddrs], "peer_id": base58, "group_id": hex, "total": N, "density": d,
"bits": b, "chunk": c, "variants": [names of ``malformed`` below]}. For each variant it dials the honest peer's
runner served under the namespace ``rogue_sparse_<index>`` and prints one JSON line: the variant, and how many
bytes came back (the honest peer still answers with its own payload; refusing is the receiver's job); the variants
``honest`` and ``honest_late_end`` (``LateEndAllGather``) are well-formed. Its first
line is its own peer ID; it dials once a line arrives on stdin (the honest peer's group is formed then).
"""

from __future__ import annotations

import asyncio
import json
import struct
import sys

import torch
from hivemind.averaging.allreduce import AveragingMode
from hivemind.p2p import P2P, PeerID

from peer.swarm.hivemind_seam import SparseAllGather
from peer.swarm.sparse import SparseCodec

_HEADER = struct.calcsize("<4sBBHIIQ")


class StandaloneAllGather(SparseAllGather):
    """``SparseAllGather`` served on its own (no averager), by the test's honest peer and by this rogue: hivemind
    caches a servicer's handlers and stub type on its class, so the production class is left untouched."""


class LateEndAllGather(StandaloneAllGather):
    """An honest dialer on a slow or busy machine: its end-of-stream goes out ``LATE_END`` seconds after its
    payload and it reads the answer later still. A server that closed the stream as soon as the payload was in made
    that end-of-stream write fail, and asyncio then failed the dialer's read with BrokenPipeError although the answer
    had arrived: the server averaged the dialer's part and the dialer did not average the server's."""

    LATE_END = 0.5

    async def _requests(self):
        async for message in super()._requests():
            yield message
        await asyncio.sleep(self.LATE_END)

    async def _read_payload(self, *args, **kwargs):
        await asyncio.sleep(2 * self.LATE_END)  # a busy dialer: reads the answer after its end-of-stream went out
        await super()._read_payload(*args, **kwargs)


def malformed(codec: SparseCodec, name: str) -> bytes:
    """A payload of this run with one thing wrong (or several valid-looking bytes too many)."""
    good = bytearray(codec.encode(torch.randn(codec.total)))
    positions = _HEADER + 4 * codec.chunks
    if name == "position_out_of_range":
        struct.pack_into("<H", good, positions + 2 * codec.k - 2, codec.chunk)
    elif name == "repeated_positions":
        good[positions : positions + 2] = good[positions + 2 : positions + 4]
    elif name == "nan_scale":
        struct.pack_into("<f", good, _HEADER, float("nan"))
    elif name == "inf_scale":
        struct.pack_into("<f", good, _HEADER, float("inf"))
    elif name == "other_settings":
        struct.pack_into("<I", good, 12, codec.k + 1)
    elif name == "truncated":
        return bytes(good[: len(good) // 2])
    elif name == "oversized":
        return bytes(good) * 3
    elif name not in ("honest", "honest_late_end"):
        raise ValueError(f"unknown variant {name!r}")
    return bytes(good)


async def main(spec: dict) -> None:
    p2p = await P2P.create(initial_peers=spec["maddrs"])
    codec = SparseCodec(total=spec["total"], density=spec["density"], bits=spec["bits"], chunk=spec["chunk"])
    honest = PeerID.from_base58(spec["peer_id"])
    print(p2p.peer_id.to_base58(), flush=True)
    await asyncio.get_event_loop().run_in_executor(None, sys.stdin.readline)
    try:
        for index, variant in enumerate(spec["variants"]):
            runner = (LateEndAllGather if variant == "honest_late_end" else StandaloneAllGather)(
                p2p=p2p,
                servicer_type=StandaloneAllGather,
                prefix=f"rogue_sparse_{index}",
                group_id=bytes.fromhex(spec["group_id"]),
                ordered_peer_ids=[p2p.peer_id, honest],  # first: this peer dials
                modes=[AveragingMode.NODE, AveragingMode.NODE],
                weight=1.0,
                payload=malformed(codec, variant),
                payload_bytes=codec.payload_bytes,
                sender_timeout=10.0,
            )
            gathered = await runner.run()
            back = sum(len(payload) for peer, payload, _ in gathered if peer == honest)
            print(json.dumps({"variant": variant, "bytes_back": back}), flush=True)
    finally:
        await p2p.shutdown()


if __name__ == "__main__":
    asyncio.run(main(json.loads(sys.argv[1])))
