"""Call a trainer's averaging RPCs directly, as a peer that found its address would: ask for its state, ask to
join its averaging group. Runs in the calling DHT's process (``dht.run_coroutine``) on that DHT's libp2p
connection, so the trainer sees the caller's authenticated peer ID."""

from __future__ import annotations

import functools
from typing import Dict

import hivemind


async def _probe(_dht, node, peer: str, run_id: str, timeout: float) -> Dict[str, str]:
    import asyncio

    from hivemind.p2p import PeerID
    from hivemind.proto import averaging_pb2
    from hivemind.utils import get_dht_time

    from peer.swarm.hivemind_seam import LeanHiveGradientAverager, LeanHiveStateAverager

    peer_id = PeerID.from_base58(peer)
    answers = {}

    async def first_message(stream_coroutine) -> str:
        try:
            stream = await stream_coroutine
            message = await asyncio.wait_for(stream.__anext__(), timeout)
            return f"answered ({type(message).__name__}, {message.ByteSize()} bytes)"
        except StopAsyncIteration:
            return "answered (empty stream)"
        except Exception as e:
            return f"refused ({type(e).__name__}: {str(e)[:120]})"

    # handler names as the trainer registers them: "<namespace>::<averager class>.<rpc>"
    download = f"{run_id}_state_averager::{LeanHiveStateAverager.__name__}.rpc_download_state"
    answers["rpc_download_state"] = await first_message(
        node.p2p.iterate_protobuf_handler(
            peer_id, download, averaging_pb2.DownloadRequest(), averaging_pb2.DownloadData
        )
    )
    join = averaging_pb2.JoinRequest(
        schema_hash=b"probe", expiration=get_dht_time() + 5, gather=b"", group_key=f"{run_id}_grad_averager.0b"
    )
    join_name = f"{run_id}_grad_averager::{LeanHiveGradientAverager.__name__}.rpc_join_group"
    answers["rpc_join_group"] = await first_message(
        node.p2p.iterate_protobuf_handler(peer_id, join_name, join, averaging_pb2.MessageFromLeader)
    )
    return answers


def probe_averaging(caller: hivemind.DHT, trainer_peer_id: str, run_id: str, timeout: float = 15.0) -> Dict[str, str]:
    """{rpc name: 'answered (...)' or 'refused (...)'} for the trainer's state download and join RPCs."""
    call = functools.partial(_probe, peer=trainer_peer_id, run_id=run_id, timeout=timeout)
    return caller.run_coroutine(call, return_future=True).result(2 * timeout + 10)
