"""``--outer_compression sparse`` over hivemind: an all-gather of compressed pseudo-gradients in hivemind's groups.

Why an all-gather and not hivemind's butterfly all-reduce: the butterfly sends each reducer a slice of every peer's
vector and sends the slice's average back. A sparse contribution stays small on the way in, but the average of n
sparse vectors is up to n times denser and no longer on a low-bit grid, so the way back costs more than the way in
(a position and a 16-bit value per non-zero instead of about 6 + 2 bits) and its own compression would lose values
no error-feedback buffer owns. The all-gather sends each peer's payload (about 0.42 bits per parameter at the defaults)
to each other peer once and nothing back: per peer (n - 1) x payload up and down, less than the butterfly's for the
groups of 2 to ~8 peers this mode forms (hivemind's group size is bounded by matchmaking), exact on receipt, one
round trip. Every peer decodes the same contributions in the group's order and aggregates them with the same
``bounded_mean``, so all apply the same average (the mode's invariant).

What is overridden and why (pinned in ``__init__``'s lists like the rest of the seam):
- ``SparsePseudoGradientAverager._run_allreduce_inplace_`` (override of the private ``DecentralizedAverager``
  method): compresses this peer's pseudo-gradient with its error feedback (``peer.swarm.sparse``), runs
  ``SparseAllGather`` in the group hivemind's matchmaking formed, refuses every payload that fails
  ``SparseCodec.check`` before decoding it, aggregates with ``bounded_mean`` (robust averaging, bounded sample
  weights) and commits the error feedback only when the round succeeded. Uses the private ``_p2p``,
  ``_running_groups``, ``_averaging_alpha``, ``_state_updated``.
- ``SparseAllGather.rpc_aggregate_part``: registered through the averager's own ``rpc_aggregate_part`` (which
  hands a stream to the running group's runner), so no new RPC name exists; the messages are hivemind's
  ``AveragingData`` with the payload's bytes in ``tensor_part.buffer``. Incoming bytes are bounded by the exact
  payload size of the run: a longer stream is cut off and refused.

The error-feedback buffer after a state download (joining, a repaired disagreement) is reset to
zero, not taken from the donor: the donor still owes its own residual and sends it in its next rounds (taking it
would apply it twice), and this peer's old residual was computed against shared parameters the download replaced.
What is lost is at most the left-out part of one peer's recent rounds, a bounded perturbation that error feedback
was delaying anyway. Backups keep the buffer (peer/backup.py), so a restart from one resumes exactly.

Pairs: of two node peers the one earlier in the group's order dials; a client-mode peer dials every node. Two client
peers cannot reach each other (volunteers behind NAT): when the group has an aux peer (an aux assists only where
others can dial it), the first one relays, each client sends it its payload and reads back the other clients'. It
relays bytes it does not check (each receiver checks them as any other) and contributes nothing. Without an aux in
the group two clients miss each other's contribution (the round agreement, peer.swarm.agreement, repairs the
difference).
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing as mp
from typing import AsyncIterator, Dict, List, Optional, Sequence, Tuple

import torch
from hivemind.averaging.allreduce import AveragingMode
from hivemind.p2p import P2P, P2PContext, PeerID, ServicerBase
from hivemind.proto import averaging_pb2, runtime_pb2
from hivemind.utils import get_dht_time
from hivemind.utils.asyncio import aiter_with_timeout

from peer.swarm.hivemind_seam.averaging import PseudoGradientAverager, declared_modes
from peer.swarm.hivemind_seam.timing import timed_allreduce
from peer.swarm.robust import bounded_mean, keep_local_where_not_finite
from peer.swarm.sparse import ErrorFeedback, SparseCodec, flatten

logger = logging.getLogger(__name__)

PIECE_BYTES = 2**19
"""A payload travels in messages of at most this many bytes (hivemind's butterfly uses the same part size)."""


class SparseAllGather(ServicerBase):
    """One round's exchange of payloads in a group: every sender's payload reaches every other sender once.

    A ServicerBase, as hivemind's AllReduceRunner is, so a test can serve it directly without an averager."""

    def __init__(
        self,
        *,
        p2p: P2P,
        servicer_type: type,
        prefix: Optional[str],
        group_id: bytes,
        ordered_peer_ids: Sequence[PeerID],
        modes: Sequence[AveragingMode],
        weight: float,
        payload: bytes,
        payload_bytes: int,
        sender_timeout: float,
    ):
        self._p2p, self.peer_id = p2p, p2p.peer_id
        self._servicer_type, self._prefix = servicer_type, prefix
        self.group_id, self.ordered_peer_ids, self.modes = group_id, list(ordered_peer_ids), list(modes)
        self.weight, self.payload, self.payload_bytes = float(weight), payload, payload_bytes
        self.sender_timeout = sender_timeout
        self.senders = [peer for peer, mode in zip(self.ordered_peer_ids, self.modes) if mode != AveragingMode.AUX]
        self.my_mode = self.modes[self.ordered_peer_ids.index(self.peer_id)]
        self.dials: List[PeerID] = []
        self.serves: List[PeerID] = []
        if self.my_mode != AveragingMode.AUX:
            for peer in self.senders:
                if peer != self.peer_id:
                    dialer = self._dialer(peer)
                    if dialer == self.peer_id:
                        self.dials.append(peer)
                    elif dialer == peer:
                        self.serves.append(peer)
        # two client peers cannot dial each other: the group's first aux peer (an aux assists only when others can
        # dial it) relays their payloads, each client's to every other client
        auxes = [peer for peer, mode in zip(self.ordered_peer_ids, self.modes) if mode == AveragingMode.AUX]
        clients = [peer for peer, mode in zip(self.ordered_peer_ids, self.modes) if mode == AveragingMode.CLIENT]
        self.relay: Optional[PeerID] = auxes[0] if auxes and len(clients) >= 2 else None
        self.relays_for: List[PeerID] = clients if self.relay == self.peer_id else []
        self.via_relay: List[PeerID] = []
        if self.relay is not None and self.my_mode == AveragingMode.CLIENT:
            self.via_relay = [peer for peer in clients if peer != self.peer_id]
        self.received: Dict[PeerID, Tuple[bytes, float]] = {}
        served = self.serves + self.relays_for
        self._started: Dict[PeerID, asyncio.Event] = {peer: asyncio.Event() for peer in served}
        self._finished: Dict[PeerID, asyncio.Event] = {peer: asyncio.Event() for peer in served}
        self._relayed_in: set = set()  # relayed clients whose stream was read (or failed)
        self._all_relayed_in = asyncio.Event()

    def _dialer(self, other: PeerID) -> Optional[PeerID]:
        """Who opens the stream between this peer and ``other`` (None: two clients, nobody can)."""
        mine = self.my_mode == AveragingMode.CLIENT
        theirs = self.modes[self.ordered_peer_ids.index(other)] == AveragingMode.CLIENT
        if mine and theirs:
            return None
        if mine != theirs:
            return self.peer_id if mine else other
        return min(self.peer_id, other, key=self.ordered_peer_ids.index)

    # ------------------------------------------------------------------------------------------- messages

    def _messages(self, code: int) -> List[averaging_pb2.AveragingData]:
        return self._pieces(self.payload, code, self.weight)

    def _pieces(
        self, payload: bytes, code: int, weight: float, origin: Optional[PeerID] = None
    ) -> List[averaging_pb2.AveragingData]:
        """``payload`` in messages of at most PIECE_BYTES; ``origin``: the peer it came from (a relayed payload)."""
        pieces = [payload[i : i + PIECE_BYTES] for i in range(0, len(payload), PIECE_BYTES)] or [b""]
        return [
            averaging_pb2.AveragingData(
                code=code,
                group_id=self.group_id if index == 0 else b"",
                peer_id=origin.to_bytes() if origin is not None else b"",
                tensor_part=runtime_pb2.Tensor(buffer=piece),
                weight=weight,
            )
            for index, piece in enumerate(pieces)
        ]

    async def _read_payload(
        self, stream: AsyncIterator[averaging_pb2.AveragingData], peer: PeerID, code: int, *, to_the_end: bool
    ):
        """Collect a peer's payload: at most ``payload_bytes`` bytes (more is refused), its first weight.

        ``to_the_end``: the serving side reads until the dialer's end-of-stream. If it returned (and so closed the
        stream) as soon as the bytes were in, the dialer's end-of-stream write could hit the closed stream; asyncio
        then fails the dialer's reader with BrokenPipeError even though this peer's payload sits in its buffer, and
        the two peers of the pair would average different contributions."""
        received, weight, size = [], None, 0
        async for message in aiter_with_timeout(stream, self.sender_timeout):
            if weight is None:
                if message.code != code:
                    raise ValueError(f"{peer} sent {averaging_pb2.MessageCode.Name(message.code)}")
                weight = float(message.weight)
            size += len(message.tensor_part.buffer)
            if size > self.payload_bytes:
                raise ValueError(f"{peer} sent more than the {self.payload_bytes} bytes of this run's payloads")
            received.append(message.tensor_part.buffer)
            if size == self.payload_bytes and not to_the_end:
                break
        if weight is None:
            raise ValueError(f"{peer} sent nothing")
        self.received[peer] = (b"".join(received), weight)

    # ------------------------------------------------------------------------------------------- run

    async def _requests(self) -> AsyncIterator[averaging_pb2.AveragingData]:
        """What a dialer sends; hivemind writes its end-of-stream once this iterator ends."""
        for message in self._messages(averaging_pb2.PART_FOR_AVERAGING):
            yield message

    async def _dial(self, peer: PeerID) -> None:
        stub = self._servicer_type.get_stub(self._p2p, peer, namespace=self._prefix)
        stream = await stub.rpc_aggregate_part(self._requests())
        await self._read_payload(stream, peer, averaging_pb2.AVERAGED_PART, to_the_end=False)

    async def _dial_relay(self) -> None:
        """Send this client's payload to the relay; read back the other clients' (each at most ``payload_bytes``,
        only peers this one cannot reach itself). The relay answers once every client's payload is in or its
        sender_timeout passed, hence the longer wait for the first message."""
        stub = self._servicer_type.get_stub(self._p2p, self.relay, namespace=self._prefix)
        stream = await stub.rpc_aggregate_part(self._requests())
        pieces: Dict[PeerID, List[bytes]] = {}
        weights: Dict[PeerID, float] = {}
        async for message in aiter_with_timeout(stream, 2 * self.sender_timeout):
            if message.code != averaging_pb2.AVERAGED_PART:
                raise ValueError(f"the relay {self.relay} sent {averaging_pb2.MessageCode.Name(message.code)}")
            origin = PeerID(message.peer_id)
            if origin not in self.via_relay:
                raise ValueError(f"the relay {self.relay} sent a payload of {origin}, not another client of the group")
            pieces.setdefault(origin, []).append(message.tensor_part.buffer)
            weights.setdefault(origin, float(message.weight))
            if sum(len(piece) for piece in pieces[origin]) > self.payload_bytes:
                raise ValueError(f"the relay {self.relay} sent more than {self.payload_bytes} bytes for {origin}")
        for origin, parts in pieces.items():
            self.received[origin] = (b"".join(parts), weights[origin])
        for origin in self.via_relay:
            if origin not in pieces:  # it never reached the relay in time, or the relay kept it back
                logger.warning("Sparse averaging: the relay %s passed on nothing from %s", self.relay, origin)

    async def _await_served(self, peer: PeerID) -> None:
        await asyncio.wait_for(self._started[peer].wait(), self.sender_timeout)
        await self._finished[peer].wait()

    async def run(self) -> List[Tuple[PeerID, bytes, float]]:
        """(peer, payload, weight) of this peer and of every sender heard from, in the group's order; payloads
        other than this peer's own are unchecked (``SparseCodec.check`` them)."""
        if self.my_mode == AveragingMode.AUX:
            if self.relays_for:  # the group's clients reach each other through this peer
                served = [asyncio.create_task(self._await_served(peer)) for peer in self.relays_for]
                await asyncio.wait(served)
                for peer, task in zip(self.relays_for, served):
                    if task.cancelled() or task.exception() is not None:
                        logger.warning("Sparse averaging: client %s never sent its payload to relay", peer)
            return []
        tasks = {peer: asyncio.create_task(self._dial(peer)) for peer in self.dials}
        tasks.update({peer: asyncio.create_task(self._await_served(peer)) for peer in self.serves})
        relayed = asyncio.create_task(self._dial_relay()) if self.via_relay else None
        running = [*tasks.values(), *([relayed] if relayed else [])]
        try:
            if running:  # none: a client alone with an aux peer, whose round averages its own contribution only
                await asyncio.wait(running)
        finally:
            for task in running:
                task.cancel()
        if relayed is not None and (relayed.cancelled() or relayed.exception() is not None):
            reason = "no reply in time" if relayed.cancelled() else repr(relayed.exception())
            logger.warning("Sparse averaging: nothing through the relay %s (%s)", self.relay, reason)
        for peer, task in tasks.items():
            if task.cancelled() or task.exception() is not None or peer not in self.received:
                reason = "no reply in time" if task.cancelled() else repr(task.exception())
                logger.warning("Sparse averaging: no contribution from %s (%s)", peer, reason)
        self.received[self.peer_id] = (self.payload, self.weight)
        return [(peer, *self.received[peer]) for peer in self.senders if peer in self.received]

    async def rpc_aggregate_part(
        self, stream: AsyncIterator[averaging_pb2.AveragingData], context: P2PContext
    ) -> AsyncIterator[averaging_pb2.AveragingData]:
        """A groupmate that dials this peer: its payload in, this peer's payload out (concurrently); on the relay,
        the other clients' payloads out."""
        peer = context.remote_id
        if self.relays_for:
            async for message in self._relay(stream, peer):
                yield message
            return
        if peer not in self._started or self._started[peer].is_set():
            logger.warning("Sparse averaging: refused a stream from %s (not a peer that dials this one)", peer)
            yield averaging_pb2.AveragingData(code=averaging_pb2.PROTOCOL_VIOLATION)
            return
        self._started[peer].set()
        reading = asyncio.create_task(
            self._read_payload(stream, peer, averaging_pb2.PART_FOR_AVERAGING, to_the_end=True)
        )
        try:
            for message in self._messages(averaging_pb2.AVERAGED_PART):
                yield message
            await reading
        except Exception as e:
            logger.warning("Sparse averaging: the stream from %s failed: %r", peer, e)
        finally:
            reading.cancel()
            self._finished[peer].set()

    async def _relay(self, stream: AsyncIterator[averaging_pb2.AveragingData], peer: PeerID):
        """On the relay: read this client's payload (to its end), wait until every client's is in (or
        sender_timeout), then send it the others'. Relayed bytes are not checked here: each receiver checks them."""
        if peer not in self.relays_for or self._started[peer].is_set():
            logger.warning("Sparse averaging: refused to relay for %s (not a client of this group)", peer)
            yield averaging_pb2.AveragingData(code=averaging_pb2.PROTOCOL_VIOLATION)
            return
        self._started[peer].set()
        try:
            try:
                await self._read_payload(stream, peer, averaging_pb2.PART_FOR_AVERAGING, to_the_end=True)
            except Exception as e:
                logger.warning("Sparse averaging: relaying nothing from %s: %r", peer, e)
            finally:
                self._relayed_in.add(peer)
                if len(self._relayed_in) == len(self.relays_for):
                    self._all_relayed_in.set()
            try:
                await asyncio.wait_for(self._all_relayed_in.wait(), self.sender_timeout)
            except asyncio.TimeoutError:
                pass
            for other in self.relays_for:
                if other != peer and other in self.received:
                    payload, weight = self.received[other]
                    for message in self._pieces(payload, averaging_pb2.AVERAGED_PART, weight, other):
                        yield message
        finally:
            self._finished[peer].set()


class SparsePseudoGradientAverager(PseudoGradientAverager):
    """``PseudoGradientAverager`` whose round is ``SparseAllGather`` of payloads compressed with error feedback.

    ``feedback`` (its buffer in shared memory, so the training process can save it in backups and reset it after a
    state download) holds what this peer still owes the swarm. Its class name names its RPCs: dense and sparse peers
    of one run never average with each other."""

    def __init__(self, parameters, *, density: float, bits: int, chunk: int, feedback_decay: float = 1.0, **kwargs):
        parameters = tuple(parameters)
        self.codec = SparseCodec(total=sum(p.numel() for p in parameters), density=density, bits=bits, chunk=chunk)
        # in shared memory before hivemind forks the averager process
        self.feedback = ErrorFeedback(self.codec, decay=feedback_decay).share_memory()
        self.partial_results = mp.Value("q", 0)
        """Rounds this peer took without every groupmate's contribution (one not heard from or refused) or with
        NaN/inf averaged values: its result may differ from the others' (shared with the host process, whose
        trainer withholds its state until the round agreement was followed, ``peer.strategies.LocalTraining``)."""
        super().__init__(parameters, **kwargs)

    @timed_allreduce
    async def _run_allreduce_inplace_(
        self, tensors: Sequence[torch.Tensor], group_info, group_id: Optional[bytes] = None, **kwargs
    ):
        group_id = group_info.group_id if group_id is None else group_id
        modes = kwargs.get("modes") or declared_modes(self.serializer, group_info)
        aux = modes[group_info.peer_ids.index(self.peer_id)] == AveragingMode.AUX
        weight = kwargs.get("weight")
        weight = float(not aux) if weight is None else weight
        loop = asyncio.get_event_loop()
        payload, own, residual = b"", None, None
        if not aux:
            payload, own, residual = await loop.run_in_executor(None, self.feedback.compress, flatten(tensors))
        runner = SparseAllGather(
            p2p=self._p2p,
            servicer_type=type(self),
            prefix=self.prefix,
            group_id=group_id,
            ordered_peer_ids=group_info.peer_ids,
            modes=modes,
            weight=weight,
            payload=payload,
            payload_bytes=self.codec.payload_bytes,
            sender_timeout=kwargs.get("sender_timeout") or self.next_chunk_timeout or 30.0,
        )
        assert group_id in self._running_groups, f"Group id {group_id} was not registered in _register_allreduce_group"
        self._running_groups[group_id].set_result(runner)
        gathered = await runner.run()
        if aux:
            return
        averaged, refused_peers = await loop.run_in_executor(None, self._aggregate, gathered, own)
        # lossless (density 1, 32 bits): today's dense local mode, own + (average - own), bit for bit (the proof)
        refused = take_average(tensors, averaged, self._averaging_alpha, exact=not self.codec.lossless)
        if refused:
            logger.warning("Sparse averaging: %d NaN/inf averaged values; kept the local values there", refused)
        if refused or refused_peers or len(gathered) < len(runner.senders):
            with self.partial_results.get_lock():
                self.partial_results.value += 1
        self.feedback.commit(residual)  # the round succeeded: what was sent is no longer owed
        self.last_updated = get_dht_time()
        self._state_updated.set()

    def _aggregate(self, gathered, own: torch.Tensor) -> Tuple[torch.Tensor, List[PeerID]]:
        sizes = [parameter.numel() for parameter in self.parameters]
        return aggregate_contributions(self.codec, gathered, self.peer_id, own, sizes, self.policy.contribution_clip)


def take_average(
    tensors: Sequence[torch.Tensor], averaged: torch.Tensor, alpha: float = 1.0, *, exact: bool = True
) -> int:
    """Put the group's ``averaged`` (flat) into ``tensors`` (this peer's contribution), keeping the local values where
    it is not finite; returns how many were kept.

    ``exact`` (with ``alpha`` 1): every tensor becomes the group's very bits. hivemind's own + (average - own), which
    dense local mode applies, rounds differently on each peer: the training peers of the home test-bed were about
    5e-7 apart after rounds that all succeeded, so no two of them served the same state and a joiner could take it
    from one donor only (issue 30). Without ``exact`` the update is applied as dense local mode applies it, which the
    lossless setting (density 1, 32 bits) must equal bit for bit."""
    offset, refused = 0, 0
    for tensor in tensors:
        size = tensor.numel()
        result = averaged[offset : offset + size].view_as(tensor).to(tensor.dtype)
        offset += size
        if exact and alpha == 1:
            bad = ~torch.isfinite(result)
            refused += int(bad.sum())
            tensor.copy_(torch.where(bad, tensor, result))
        else:
            update = result - tensor
            refused += keep_local_where_not_finite(update)
            tensor.add_(update, alpha=alpha)
    return refused


def aggregate_contributions(
    codec: SparseCodec,
    gathered: Sequence[Tuple[PeerID, bytes, float]],
    own_peer: PeerID,
    own: torch.Tensor,
    sizes: Sequence[int],
    clip_factor: float,
) -> Tuple[torch.Tensor, List[PeerID]]:
    """(``bounded_mean`` of the contributions that pass ``codec.check``, tensor by tensor; the peers refused).

    Every peer of a group calls it with the same contributions in the same order, so all get the same average."""
    parts, weights, refused = [], [], []
    for peer, payload, weight in gathered:
        if peer == own_peer:
            parts.append(own)
        else:
            reason = codec.check(payload)
            if reason is not None:
                logger.warning("Sparse averaging: refused the contribution of %s: %s", peer, reason)
                refused.append(peer)
                continue
            parts.append(codec.decode(payload))
        weights.append(weight)
    pieces, offset = [], 0
    for size in sizes:
        pieces.append(bounded_mean([part[offset : offset + size] for part in parts], weights, clip_factor))
        offset += size
    return torch.cat(pieces), refused
