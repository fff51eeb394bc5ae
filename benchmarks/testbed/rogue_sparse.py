"""A rogue peer of ``--outer_compression sparse``: a real separate process that joins an honest peer's sparse
all-gather and sends it malformed payloads (tests/swarm/test_sparse_wire.py starts it).

    python -m benchmarks.testbed.rogue_sparse SPEC_JSON

SPEC_JSON: {"maddrs": [...honest peer's multiaddrs], "peer_id": base58, "group_id": hex, "total": N, "density": d,
"bits": b, "chunk": c, "variants": [names of ``malformed`` below]}. For each variant it dials the honest peer's
runner served under the namespace ``rogue_sparse_<index>`` and prints one JSON line: the variant, and how many
bytes came back (the honest peer still answers with its own payload; refusing is the receiver's job); the variants
``honest`` and ``honest_late_end`` (``LateEndAllGather``) are well-formed. Its first
line is its own peer ID; it dials once a line arrives on stdin (the honest peer's group is formed then).

    python -m benchmarks.testbed.rogue_sparse --relay SPEC_JSON

The rogue is the aux peer that relays two honest client peers' payloads (``spoil_relay``): SPEC_JSON has "total",
"density", "bits", "chunk", "group_id" and "variants" (``RELAY_VARIANTS``). Its first line is JSON with its peer ID
and multiaddrs; it then reads the two clients' peer IDs (one line, space-separated), serves one relay per variant
under the namespace ``rogue_relay_<index>``, prints "ready" and serves until stdin closes.
"""

from __future__ import annotations

import asyncio
import json
import struct
import sys

import torch
from hivemind.averaging.allreduce import AveragingMode
from hivemind.p2p import P2P, PeerID
from hivemind.proto import averaging_pb2

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


RELAY_VARIANTS = ["honest", "foreign_origin", "oversized", "wrong_code", "spoiled", "withheld"]


def spoil_relay(runner: StandaloneAllGather, variant: str, codec: SparseCodec) -> None:
    """Make ``runner`` (the group's aux) relay what it should not: each message it would relay is passed on changed
    as ``variant`` says (``honest``: unchanged, the control). The instance's ``_relay`` is wrapped, not subclassed:
    hivemind names a servicer's RPCs after its class, and the clients call StandaloneAllGather's."""
    relay = runner._relay

    async def spoiled(stream, peer):
        async for message in relay(stream, peer):
            if variant == "foreign_origin":  # a payload said to be the relay's own, not another client's
                message.peer_id = runner.peer_id.to_bytes()
            elif variant == "wrong_code":
                message.code = averaging_pb2.PROTOCOL_VIOLATION
            elif variant == "spoiled":  # the right size and origin, a NaN scale: only the check can tell
                message.tensor_part.buffer = malformed(codec, "nan_scale")
            elif variant == "withheld":  # passes nothing on, as if the other client never sent its payload
                continue
            yield message
            if variant == "oversized":
                yield message
                yield message

    runner._relay = spoiled


def malformed(codec: SparseCodec, name: str) -> bytes:
    """A payload of this run with one thing wrong (or several valid-looking bytes too many)."""
    good = bytearray(codec.encode(torch.randn(codec.total)))
    scales, positions, values = codec.split(bytes(good))
    first = codec.parts[0]
    if name == "position_out_of_range":  # the first chunk's last position: the largest its code can hold
        highest = first.largest_codable
        if highest < first.length:  # a chunk of a multiple of 2^l values (e.g. 4096) cannot be sent one
            raise ValueError(f"a chunk of {first.length} values keeping {first.k} cannot hold an out-of-range position")
        positions[codec.k - 1] = highest
        return codec.assemble(scales, positions, values)
    if name == "repeated_positions":
        positions[0] = positions[1]
        return codec.assemble(scales, positions, values)
    if name == "miscounted_positions":  # one bit of the first chunk's position code flipped: k - 1 or k + 1 set
        good[_HEADER + 4 * codec.chunks] ^= 0x80
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


async def relay_main(spec: dict) -> None:
    p2p = await P2P.create()
    codec = SparseCodec(total=spec["total"], density=spec["density"], bits=spec["bits"], chunk=spec["chunk"])
    maddrs = [str(m) for m in await p2p.get_visible_maddrs()]
    print(json.dumps({"peer_id": p2p.peer_id.to_base58(), "maddrs": maddrs}), flush=True)
    loop = asyncio.get_event_loop()
    clients = [PeerID.from_base58(word) for word in (await loop.run_in_executor(None, sys.stdin.readline)).split()]
    try:
        for index, variant in enumerate(spec["variants"]):
            runner = StandaloneAllGather(
                p2p=p2p,
                servicer_type=StandaloneAllGather,
                prefix=f"rogue_relay_{index}",
                group_id=bytes.fromhex(spec["group_id"]),
                ordered_peer_ids=[*clients, p2p.peer_id],
                modes=[AveragingMode.CLIENT, AveragingMode.CLIENT, AveragingMode.AUX],
                weight=0.0,
                payload=b"",
                payload_bytes=codec.payload_bytes,
                sender_timeout=10.0,
            )
            spoil_relay(runner, variant, codec)
            await runner.add_p2p_handlers(p2p, namespace=f"rogue_relay_{index}")
        print("ready", flush=True)
        await loop.run_in_executor(None, sys.stdin.read)  # serve until the test closes stdin
    finally:
        await p2p.shutdown()


if __name__ == "__main__":
    if sys.argv[1] == "--relay":
        asyncio.run(relay_main(json.loads(sys.argv[2])))
    else:
        asyncio.run(main(json.loads(sys.argv[1])))
