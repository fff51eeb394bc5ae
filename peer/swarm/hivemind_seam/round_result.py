"""A trainer that missed a gradient round takes that round's result from peers that took it (sync mode).

With ``same_result`` every peer of a gradient round ends with the very same averaged gradients, and hivemind keeps
them in the gradient averager's averaged tensors until that peer's next round loads its own gradients
(``load_accumulators_into_averager_``). A trainer whose round failed while others' succeeded (it joined no group in
time, or its group went on without it) used to step with hivemind's fallback: its accumulators, which hivemind has
already reset by then, so a zero gradient. Its parameters and LAMB statistics then left the swarm's for many epochs
(0.01 to 0.1 on the home testbed, against a tolerance of 0.01). Instead it now asks the peers that took the round
for that round's result and takes the same optimizer step as they did, in the same epoch: no state download, no
extra epoch, and about a sixth of the state's bytes: the result's own 8-bit codes (``exact_blockwise``; hivemind's
codecs do not give back the same bits when a decoded result is quantized again) or float16 where the wire format
was float16, float32 only where neither decodes to the exact bits.

A mixin of ``LeanHiveGradientAverager`` (its RPC and its fetch run in the averager process hivemind forks):

- ``round_epoch`` (set by the host when it begins a round) and ``result_epoch`` (set in the averager process when
  a ``same_result`` round's whole result was copied in, ``_took_whole_result``; cleared by the host whenever the
  averaged tensors are overwritten, ``load_accumulators_into_averager_``): the averaged tensors hold the result of
  round ``result_epoch`` (of group ``result_group``). Before they are overwritten, that result is copied to a
  second buffer in shared memory and served on as round ``previous_epoch`` (``retire_result``): a peer whose round
  failed asks a second or two after the others' round ended, and a quick server has often begun its next round by
  then (a late home volunteer found nothing and stepped apart). This costs each sync trainer one more buffer the
  size of its gradients in host memory. A trainer that hivemind stepped with its own gradients because it saw no
  other peer (``own_round``, set by the optimizer) holds those as its round's result: they are the swarm's step of
  that epoch (a volunteer that joined a second before the round, alone in its group or without one, takes the step
  the lone public trainer took instead of its own).
- ``formed_epoch`` / ``formed_group`` (set in the averager process when an all-reduce begins, ``_allreduce_began``):
  the ``round_epoch`` of the last round whose group formed, and that group's ID (its SHA-256, ``group_digest``).
  A round is named by its group when the asker was in one: every member of a group knows its ID, while epoch labels
  can differ by one between peers (a client's label lagged one behind the round it was in, on a busy loopback
  swarm). A round whose group never formed for this peer ("could not find a group") is named by its epoch.
- ``round_label`` (set by the host before each round's matchmaking, gathered by ``schedule_step``): every member
  tells the group the epoch it names the round by. An assisting aux holds a round it took under the label most of
  its data senders gave (``group_label``, within ``MAX_LABEL_GAP`` of its own), since its own label can lag the
  trainers' by one, and it answers by-epoch asks like any peer: in a round it took with client trainers alone it is
  the only peer that can be dialled, and a public trainer that missed that round asks it where no serving trainer
  holds the round (its signed reachability record says ``assist``; ``LeanHiveOptimizer._assisting_peers``).
- ``rpc_round_result`` (a new RPC, hivemind's ``DownloadData`` message both ways, ``metadata`` a small msgpack
  request/answer): ``{"epoch": E}`` or ``{"epoch": E, "group": digest}``. The answer is ``ok`` and then every tensor
  (in the wire compression where decoding it gives back the exact bits, else uncompressed), ``later`` while this
  peer's own round of E (of that group) still runs, ``pending`` (asked by epoch) while E is the round this peer has
  not begun yet (its last round ended, and E is the next: an asker whose own round failed at once asked before the
  others' epoch ended; the asker waits for it as for ``later``, but a round of the next label that was pending when
  asked is not taken; an assisting aux, whose own label can lag, answers ``none``), ``busy`` above ``SERVE_MAX``
  answers at once, ``refused`` to an asker that already took that round, or ``none``. After ``none`` to a group, the
  asker asks for epoch E (the others may have retried the epoch in a new group without it). An asker whose group had
  no other data sender, or no member that serves its state (``unconfirmed``: it asks outside its group, below), asks
  for E + 1 after ``none`` and takes it only if that round was still running when it asked (its epoch label lagged one
  behind: it holds the result as round E + 1, ``result_epoch``, and the optimizer moves its epoch on by one); one that
  found no group does not (the others' next round is not the round it missed: a home volunteer that came late for
  round 0 took round 1's result that way). ``{"epoch": E, "probe": True}`` is answered with a status only
  (``_probe_status``: ``ok``, ``later``, ``pending`` or ``none``): a trainer still looking for a group when its
  epoch ended learns whether the others already hold the round's result.
- ``fetch_round_result`` (host) / ``_fetch_round_result`` (averager process): asks up to ``ASK`` of the given
  peers at once until ``timeout``. Each answer is untrusted: its tensors must have this peer's shapes and dtypes, be
  finite and come in at most the uncompressed size. Two or more answers must agree bit for bit (the largest group
  of equal answers wins if it has two or more and no other group is as large; a lone answer only if it is the only
  one), and the result must stay within ``max_norm`` (a multiple of this peer's own gradient norm), so a hostile
  peer cannot steer a trainer further than a reducer of its round could. Only then are the averaged tensors
  overwritten; the host steps with them as with its own round's result.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import multiprocessing as mp
import random
import time
from collections import Counter
from typing import AsyncIterator, Dict, List, NamedTuple, Optional, Sequence, Tuple

import numpy as np
import torch
from hivemind.averaging.allreduce import AveragingMode
from hivemind.compression import (
    BlockwiseQuantization,
    CompressionInfo,
    deserialize_torch_tensor,
    serialize_torch_tensor,
)
from hivemind.p2p import P2PContext, PeerID
from hivemind.proto import averaging_pb2, runtime_pb2
from hivemind.utils import MPFuture
from hivemind.utils.streaming import combine_from_streaming, split_for_streaming

from peer.swarm.hivemind_seam.state_transfer import close_stream

logger = logging.getLogger("peer.swarm.hivemind_seam.averaging")

ASK = 3
"""Peers asked at once: two answers that agree end the fetch, a third outvotes one hostile answer."""
SERVE_MAX = 2
"""Answers a peer streams at once (a home uplink is small)."""
LATER_POLL = 0.25
"""Seconds between asks to a peer whose own round of that epoch is still running."""
LOCK_WAIT = 2.0
"""Seconds a server waits for its averaged tensors' lock before it answers ``none`` (its next round holds it)."""
GROUP_DIGEST = 32
"""Bytes of a round's name on the wire (``group_digest``)."""
NO_GROUP = bytes(GROUP_DIGEST)
"""The group of a result held by its epoch only (never a ``group_digest``: that is a SHA-256)."""
CHUNK = 1 << 20
"""Bytes per streamed message."""
MIN_RATE = 2_500_000.0
"""Bytes/s the fetch's time allows for the uncompressed result (a 20 Mbit/s downlink): ``fetch_seconds``."""
MAX_LABEL_GAP = 1
"""An assisting aux holds a round under its members' label only within this many epochs of its own (it lagged one
behind); a group that claims another keeps the aux's own (``RoundResultSharing._allreduce_began``)."""
MAX_LABEL = 1 << 62
"""Labels at or above this are refused: the held epoch is a signed 64-bit shared value."""
NORM_FACTOR = 4.0
"""The result taken may have at most this times the norm of this peer's own averaged gradients (peer.swarm.robust's
clip factor), agreed answers included: two colluding peers are held to the bound one is."""


def fetch_seconds(averaging_timeout: float, result_bytes: int) -> float:
    """How long a trainer spends fetching a round's result: the peers that took the round may still be finishing it
    (``averaging_timeout``), then the transfer at ``MIN_RATE``."""
    return averaging_timeout + result_bytes / MIN_RATE


class FetchFailed(Exception):
    """A peer's answer was refused or could not be used."""


class NotHeld(FetchFailed):
    """A peer holds no result of the round asked for."""


class RoundResultSharing:
    """See the module docstring. Mixed into ``LeanHiveGradientAverager`` before hivemind's classes."""

    def __init__(self, *args, **kwargs):
        # before hivemind's __init__ forks the averager process (which serves and fetches)
        self.round_epoch = mp.Value("q", -1)
        self.ended_epoch = mp.Value("q", -1)  # the round_epoch of the last round that ended, well or not
        self.result_epoch = mp.Value("q", -1)
        self.unconfirmed = mp.Value("b", 0)
        """The last whole result may not be the swarm's: no other member sent data, or none serves its state."""
        self.formed_epoch = mp.Value("q", -1)  # the round_epoch of the last all-reduce whose group formed
        self.formed_group = mp.Array("c", GROUP_DIGEST)  # that group's group_digest
        self._running_group: Optional[bytes] = None  # (averager process) the digest of the group averaging now
        self._running_label = -1
        """(averager process) The epoch the round averaging now is held as: ``round_epoch``, or for an assisting aux
        the label its group's data senders gathered (``group_label``)."""
        self.round_label: Optional[int] = None
        """(host) The epoch this peer names its next round by in matchmaking (``schedule_step``; set by the
        optimizer): an assisting aux holds a round it took under its members' label, since its own can lag by one."""
        self.result_group = mp.Array("c", GROUP_DIGEST)
        """The held result's group digest; NO_GROUP for a result held by its epoch only (fetched, or an own step)."""
        self.previous_epoch = mp.Value("q", -1)
        self.previous_group = mp.Array("c", GROUP_DIGEST)
        self._previous: Optional[Tuple[torch.Tensor, ...]] = None
        """The result held before this peer's next round loaded its gradients over it (round ``previous_epoch`` of
        ``previous_group``): a peer that comes late for a round still finds it here (``retire_result``)."""
        self._previous_lock = mp.Lock()
        """Guards ``_previous``. Not ``lock_averaged_tensors``: hivemind holds that for a whole all-reduce, and the
        previous result is asked for exactly while this peer's next round runs."""
        self.own_round = False
        """(host) The next gradients loaded are this peer's own step for the swarm: it saw no other peer."""
        self._last_group: frozenset = frozenset()  # (averager process) the members of the last whole-result round
        self.local_norm: Optional[float] = None
        """Norm of this peer's own averaged gradients as last loaded for a round (host process)."""
        self._served: Dict[PeerID, int] = {}  # (averager process) the held epoch each asker last took
        self._serving = 0
        super().__init__(*args, **kwargs)

    @property
    def shares_round_results(self) -> bool:
        return bool(getattr(self, "_same_result", False))

    # --------------------------------------------------------------------------------------- bookkeeping

    def run_in_background(self, await_ready: bool = True, timeout: Optional[float] = None) -> None:
        if self.shares_round_results and self._previous is None:
            # in shared memory before hivemind forks the averager process: the host fills it, that process serves it
            self._previous = tuple(torch.zeros_like(t, device="cpu").share_memory_() for t in self._averaged_tensors)
        super().run_in_background(await_ready=await_ready, timeout=timeout)

    @torch.no_grad()
    def retire_result(self) -> None:
        """(host) This peer's next round is about to overwrite its averaged tensors: the result they hold is kept as
        the previous one. A volunteer whose round failed asks a second or two after the others' round ended, and a
        quick server has begun its next round by then; without this it found nothing and either stepped apart or
        took the next round's result in place of the one it missed."""
        held = self.result_epoch.value
        if self._previous is None or held < 0:
            return
        with self.lock_averaged_tensors, self._previous_lock:
            self.previous_epoch.value = -1
            for target, value in zip(self._previous, self._averaged_tensors):
                target.copy_(value)
            self.previous_group.raw = self.result_group.raw
            self.previous_epoch.value = held

    @torch.no_grad()
    def load_accumulators_into_averager_(self):
        self.retire_result()
        # before the lock hivemind's method takes (not reentrant): an asker's copy is taken under it, and one taken
        # after this line sees the result gone
        self.result_epoch.value = -1
        super().load_accumulators_into_averager_()
        if getattr(self, "local_times_accumulated", 0):
            with self.get_tensors() as averaged:
                self.local_norm = float(torch.linalg.vector_norm(torch.stack([t.float().norm() for t in averaged])))
        if self.own_round:
            self.own_round = False
            if self.shares_round_results:
                self.result_group.raw = NO_GROUP
                self.result_epoch.value = self.round_epoch.value

    def _took_whole_result(self, group, unconfirmed: bool) -> None:
        """(averager process) A ``same_result`` round's whole result was just copied in. It is served even when
        nobody else of the group sent data (a public trainer whose clients all missed the round took the swarm's
        only round)."""
        self._last_group, self.unconfirmed.value = frozenset(group), unconfirmed
        self.result_group.raw = self._running_group or NO_GROUP
        self.result_epoch.value = self._running_label

    def _allreduce_began(self, group_id: bytes, group_info) -> None:
        """(averager process) This peer's group of ``round_epoch`` formed: the round is now named by it. An assisting
        aux holds it under the label its data senders gathered: a public trainer that missed a round the aux took
        with client trainers (who cannot be dialled) asks the aux for it by the trainers' epoch, and the aux's own
        label lagged one behind theirs on the home testbed (it would then have answered ``none``)."""
        digest = group_digest(group_id)
        self._running_group = digest
        self.formed_group.raw = digest
        self.formed_epoch.value = self.round_epoch.value
        label = group_label(self.serializer, group_info) if self.mode == AveragingMode.AUX else None
        near = label is not None and abs(label - self.round_epoch.value) <= MAX_LABEL_GAP
        self._running_label = label if near else self.round_epoch.value
        if self._running_label != self.round_epoch.value:
            logger.debug("Round %d (this aux's label %d): held as its members named it", label, self.round_epoch.value)

    def schedule_step(self, scheduled_time: Optional[float] = None, **kwargs):
        """The round's label goes to the group's members in matchmaking (hivemind's ``gather``; ``group_label``)."""
        if self.shares_round_results and self.round_label is not None:
            kwargs.setdefault("gather", {"epoch": self.round_label})
        return super().schedule_step(scheduled_time, **kwargs)

    def stepping_alone(self) -> None:
        """(host process) hivemind steps this trainer with its own gradients (it saw no other peer): the gradients
        loaded next are the swarm's step of ``round_epoch`` (``own_round``)."""
        self.own_round = True

    def round_failed(self) -> None:
        """(host process) This peer's round of ``round_epoch`` ended without a result, its group never formed
        included: askers stop waiting for it (``later``)."""
        self.ended_epoch.value = self.round_epoch.value

    def _allreduce_ended(self) -> None:
        """(averager process) This peer's all-reduce of ``round_epoch`` ended, with or without a result."""
        self.ended_epoch.value = self.round_epoch.value
        self._running_group = None

    # ------------------------------------------------------------------------------------------- serving

    def _answer(self, **fields) -> averaging_pb2.DownloadData:
        return averaging_pb2.DownloadData(metadata=self.serializer.dumps(fields))

    def _held(self) -> List["_Held"]:
        """The results this peer can serve now: the averaged tensors' (``result_epoch``), then the previous one."""
        return [
            _Held(slot, epoch.value, bytes(group.raw))
            for slot, epoch, group in (
                ("current", self.result_epoch, self.result_group),
                ("previous", self.previous_epoch, self.previous_group),
            )
            if epoch.value >= 0  # previous_epoch is set only where the buffer exists (retire_result)
        ]

    def _status_for(self, asker: PeerID, epoch: int, group: Optional[bytes], held: Sequence["_Held"]):
        """The answer to ``asker``'s ask for round ``epoch`` (of ``group`` if given) while this peer holds the
        results ``held``, and the one that answers it (None unless ``ok``)."""
        if not self.shares_round_results:
            return "none", None
        if group is not None:
            match = next((h for h in held if h.group != NO_GROUP and h.group == group), None)
            if match is None:
                return ("later" if group == self._running_group else "none"), None
        else:
            match = next((h for h in held if h.epoch == epoch), None)
            if match is None:
                return self._unheld_status(epoch), None
        if self._served.get(asker) == match.epoch:
            return "refused", None
        if self._serving >= SERVE_MAX:
            return "busy", None
        return "ok", match

    def _unheld_status(self, epoch: int) -> str:
        """The answer for round ``epoch`` where this peer holds no result of it: ``later`` while it began that round,
        ``pending`` where that is the round it begins next, else ``none``."""
        begun, ended = self.round_epoch.value, self.ended_epoch.value
        if epoch == begun and epoch != ended:
            return "later"
        # a client whose round failed as it began asked before this peer's epoch ended (a CI run: 60 ms after its
        # fault, while both full peers still accumulated); "none" made it step apart. An assisting aux's own label
        # can lag one behind the round it takes next: it would keep the asker waiting for another round
        pending = epoch == begun + 1 and ended == begun and self.mode != AveragingMode.AUX
        return "pending" if pending else "none"

    def _probe_status(self, epoch: int) -> str:
        """The answer to a probe of round ``epoch`` (``round_ended_without_this_peer``): ``ok`` if this peer holds its
        result, ``later`` while it began the round and has no result of it yet (its all-reduce may still run, or
        break off and look for a group again), ``pending`` where that is the round it begins next, else ``none``.
        No tensor moves. An assisting aux answers ``none``: its own epoch label may lag the trainers' by one (it is
        asked for a result it holds like any peer, but does not decide alone that a trainer leaves its round)."""
        if not self.shares_round_results or self.mode == AveragingMode.AUX:
            return "none"
        if any(held.epoch == epoch for held in self._held()):
            return "ok"
        return self._unheld_status(epoch)

    async def rpc_round_result(
        self, request: averaging_pb2.DownloadData, context: P2PContext
    ) -> AsyncIterator[averaging_pb2.DownloadData]:
        try:
            ask = self.serializer.loads(request.metadata)
            epoch, group = ask["epoch"], ask.get("group")
            if not isinstance(epoch, int) or isinstance(epoch, bool):
                raise TypeError(type(epoch))
            if group is not None and not (isinstance(group, bytes) and len(group) == GROUP_DIGEST):
                raise ValueError("group")
        except Exception:
            yield self._answer(status="malformed")
            return
        if ask.get("probe") is True:
            yield self._answer(status=self._probe_status(epoch))
            return
        status, held = self._status_for(context.remote_id, epoch, group, self._held())
        if held is None:
            yield self._answer(status=status)
            return
        self._serving += 1
        try:
            encoded = await asyncio.get_event_loop().run_in_executor(None, self._encoded_result, held)
            if encoded is None:
                yield self._answer(status="none")
                return
            self._served = {peer: taken for peer, taken in self._served.items() if taken >= held.epoch - 2}
            self._served[context.remote_id] = held.epoch
            yield self._answer(status="ok", epoch=epoch, tensors=len(encoded))
            for serialized in encoded:
                for chunk in split_for_streaming(serialized, CHUNK):
                    yield averaging_pb2.DownloadData(tensor_part=chunk)
            logger.info("Sent round %d's averaged gradients (%s) to %s", held.epoch, held.slot, context.remote_id)
        finally:
            self._serving -= 1

    def _encoded_result(self, held: "_Held"):
        """(an executor thread) The result ``held`` as served (None once it was overwritten, or while its tensors
        stay locked: the current result's while an all-reduce runs); copied under its lock, encoded outside it, so
        this peer's next round never waits for an asker."""
        lock = self.lock_averaged_tensors if held.slot == "current" else self._previous_lock
        if not lock.acquire(timeout=LOCK_WAIT):
            return None
        try:
            if held not in self._held():
                return None
            source = self._averaged_tensors if held.slot == "current" else self._previous
            result = [t.detach().clone() for t in source]
        finally:
            lock.release()
        return [self._encode(i, t) for i, t in enumerate(result)]

    def _write_result(self, epoch: int, tensors: Sequence[torch.Tensor], timeout: float) -> bool:
        """(an executor thread) Overwrite the averaged tensors with a fetched result, unless they stay locked
        (this peer's own all-reduce still runs: hivemind holds the lock for its whole length) beyond ``timeout``."""
        if not self.lock_averaged_tensors.acquire(timeout=max(timeout, 0.0)):
            return False
        try:
            for target, value in zip(self._averaged_tensors, tensors):
                target.copy_(value)
            self.result_group.raw = NO_GROUP  # served on by its epoch (answers may have come by group or by epoch)
            self.result_epoch.value = epoch
            return True
        finally:
            self.lock_averaged_tensors.release()

    def _encode(self, index: int, tensor: torch.Tensor):
        """The first encoding that decodes to the exact bits: the wire compression (exact for float16 parts), the
        8-bit blockwise codes that gave these values (``exact_blockwise``), else uncompressed."""
        compression = self.allreduce_kwargs["compression"]
        infos = self.tensor_infos
        info = infos[index] if infos is not None else CompressionInfo.from_tensor(tensor, key=index)
        for encode in (lambda: compression.compress(tensor, info), lambda: exact_blockwise(tensor)):
            try:
                serialized = encode()
                if serialized is not None and torch.equal(deserialize_torch_tensor(serialized), tensor):
                    return serialized
            except Exception:  # e.g. no bitsandbytes: uncompressed
                pass
        return serialize_torch_tensor(tensor)

    # ------------------------------------------------------------------------------------------ fetching

    def fetch_round_result(
        self, *, epoch: int, candidates: Sequence[PeerID], max_norm: float, timeout: float, outside_group: bool = False
    ) -> Optional[List[PeerID]]:
        """(host) Ask ``candidates`` for round ``epoch``'s result; on success it is in the averaged tensors and the
        peers whose answers were used are returned, else None (nothing changed). ``outside_group``: not the members
        of this peer's last round (it was alone in its group, or no member serves its state: the serving trainers
        may have taken the swarm's round elsewhere)."""
        future = MPFuture()
        ask = dict(future=future, epoch=epoch, candidates=list(candidates), max_norm=max_norm, timeout=timeout)
        ask["outside_group"] = outside_group
        self._outer_pipe.send(("_fetch_round_result", [], ask))
        try:
            return future.result(timeout=timeout + 10)
        except Exception as e:
            logger.warning("Fetching round %d's result failed: %r", epoch, e)
            return None

    async def _fetch_round_result(
        self, future, epoch: int, candidates, max_norm: float, timeout: float, outside_group: bool
    ):
        used = None
        try:
            excluded = self._last_group if outside_group else frozenset()
            candidates = [peer for peer in candidates if peer not in excluded]
            # a round whose group formed is named by it; alone in its group, the round asked for is the others'
            group = bytes(self.formed_group.raw) if self.formed_epoch.value == epoch and not outside_group else None
            round_ = _Round(epoch, group, next_if_running=outside_group)
            used = await self._fetch_agreed(round_, candidates, max_norm, time.monotonic() + timeout)
        except Exception as e:
            logger.warning("Fetching round %d's result failed: %r", epoch, e)
        finally:
            if not future.done():
                future.set_result(used)

    def round_ended_without_this_peer(self, *, epoch: int, candidates: Sequence[PeerID], timeout: float) -> bool:
        """(host) Whether round ``epoch`` already ended among the others while this peer still looks for a group:
        some of up to ``ASK`` of ``candidates`` hold its result (``_probe_status``), and none says it begins that
        round next. One answer can claim it falsely; the cost to this peer is then the round, which the result fetch
        that follows does not replace (its answers must agree and stay within the norm bound)."""
        future = MPFuture()
        probe = dict(future=future, epoch=epoch, candidates=list(candidates), timeout=timeout)
        self._outer_pipe.send(("_probe_round", [], probe))
        try:
            return bool(future.result(timeout=timeout + 10))
        except Exception as e:
            logger.warning("Probing round %d failed: %r", epoch, e)
            return False

    async def _probe_round(self, future, epoch: int, candidates, timeout: float):
        ended = False
        try:
            peers = [peer for peer in candidates if peer != self.peer_id]
            random.shuffle(peers)
            deadline = time.monotonic() + timeout
            answers = await asyncio.gather(
                *(self._probe_peer(peer, epoch, deadline) for peer in peers[:ASK]), return_exceptions=True
            )
            statuses = [answer for answer in answers if isinstance(answer, str)]
            # a formed group is not enough: its all-reduce can break off, and hivemind's matchmaking then goes on
            # until the round's deadline, where this peer may still join (a CI run beside a trainer whose all-reduce
            # failed every round: the healthy ones left 16 rounds that then had no result)
            ended = "pending" not in statuses and "ok" in statuses
        except Exception as e:
            logger.debug("Probing round %d failed: %r", epoch, e)
        finally:
            if not future.done():
                future.set_result(ended)

    async def _probe_peer(self, peer: PeerID, epoch: int, deadline: float) -> str:
        stub = self.get_stub(self._p2p, peer, namespace=self.prefix)
        request = averaging_pb2.DownloadData(metadata=self.serializer.dumps({"epoch": epoch, "probe": True}))
        stream = await asyncio.wait_for(stub.rpc_round_result(request), timeout=max(0.0, deadline - time.monotonic()))
        iterator = stream.__aiter__()
        try:  # a peer without probes may answer ``ok`` and stream the result: only the head is read
            head = await asyncio.wait_for(iterator.__anext__(), timeout=max(0.0, deadline - time.monotonic()))
        finally:
            await close_stream(iterator)
        answer = self.serializer.loads(head.metadata)
        status = answer.get("status") if isinstance(answer, dict) else None
        return status if isinstance(status, str) else "malformed"

    def _layout(self) -> List[Tuple[torch.Size, torch.dtype]]:
        # no lock: shapes and dtypes never change, and the averager process must never block its event loop on the
        # lock (its own all-reduce, which holds it, needs that loop to finish)
        return [(t.shape, t.dtype) for t in self._averaged_tensors]

    async def _fetch_agreed(self, round_: "_Round", candidates: List[PeerID], max_norm: float, deadline: float):
        epoch = round_.epoch
        layout = self._layout()
        peers = [peer for peer in candidates if peer != self.peer_id]
        random.shuffle(peers)  # askers spread over the peers that took the round
        ahead: set = set()  # peers whose answer was the next epoch's round (``_ask_result``)
        tasks = {
            asyncio.create_task(self._ask_result(peer, round_, layout, deadline, ahead)): peer for peer in peers[:ASK]
        }
        answers: List[Tuple[PeerID, List[torch.Tensor]]] = []
        refusals = []
        try:
            pending = set(tasks)
            while pending and not _agreed(answers):
                done, pending = await asyncio.wait(
                    pending, timeout=max(0.0, deadline - time.monotonic()), return_when=asyncio.FIRST_COMPLETED
                )
                if not done:
                    break
                for task in done:
                    try:
                        answers.append((tasks[task], task.result()))
                    except Exception as e:
                        refusals.append(f"{tasks[task]}: {e!r}")
        finally:
            for task in tasks:
                task.cancel()
        chosen = _choose(answers, max_norm)
        if chosen is None:
            logger.info(
                "No usable result of round %d from %d peers (%d answers; %s)",
                epoch,
                len(tasks),
                len(answers),
                "; ".join(refusals) or "no refusal",
            )
            return None
        used, tensors = chosen
        remaining = deadline - time.monotonic()
        held = epoch + 1 if used[0] in ahead else epoch  # served on as the round it is
        written = await asyncio.get_event_loop().run_in_executor(None, self._write_result, held, tensors, remaining)
        if not written:
            logger.info("Round %d's result arrived, but this peer's own all-reduce still holds its tensors", epoch)
            return None
        return used

    async def _ask_result(
        self, peer: PeerID, round_: "_Round", layout, deadline: float, ahead: set
    ) -> List[torch.Tensor]:
        stub = self.get_stub(self._p2p, peer, namespace=self.prefix)
        try:
            return await self._ask_epoch(stub, round_, layout, deadline, only_running=False)
        except NotHeld:
            if round_.group is not None:
                # the others may have retried the epoch in a new group without this peer (hivemind retries a
                # failed all-reduce until the step's deadline): that round's result is the epoch's
                by_epoch = _Round(round_.epoch, None, next_if_running=False)
                return await self._ask_epoch(stub, by_epoch, layout, deadline, only_running=False)
            if not round_.next_if_running:
                raise
            # alone in its group: the others' round of the next epoch, if it runs right now, is the one this peer's
            # round ran beside (its label lagged one behind theirs). One already over, or not begun, is not taken.
            following = _Round(round_.epoch + 1, None, next_if_running=False)
            tensors = await self._ask_epoch(stub, following, layout, deadline, only_running=True)
            ahead.add(peer)
            return tensors

    async def _ask_epoch(
        self, stub, round_: "_Round", layout, deadline: float, only_running: bool
    ) -> List[torch.Tensor]:
        epoch = round_.epoch
        ask = {"epoch": epoch} if round_.group is None else {"epoch": epoch, "group": round_.group}
        request = averaging_pb2.DownloadData(metadata=self.serializer.dumps(ask))
        running = False
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise FetchFailed("no answer in time")
            stream = await asyncio.wait_for(stub.rpc_round_result(request), timeout=remaining)
            iterator = stream.__aiter__()
            try:
                head = await asyncio.wait_for(iterator.__anext__(), timeout=max(0.0, deadline - time.monotonic()))
                answer = self.serializer.loads(head.metadata)
                status = answer.get("status") if isinstance(answer, dict) else None
                if status == "ok" and (running or not only_running):
                    if answer.get("epoch") != epoch or answer.get("tensors") != len(layout):
                        raise FetchFailed(f"it announced {answer!r} for round {epoch} of {len(layout)} tensors")
                    return await self._read_result(iterator, layout, deadline)
            finally:
                await close_stream(iterator)
            if status == "none" and not only_running:
                raise NotHeld(f"it answered {status!r}")
            if status == "pending" and not only_running:
                await asyncio.sleep(LATER_POLL)  # its round of this epoch has not begun yet
                continue
            if status != "later":
                raise FetchFailed(f"it answered {status!r} (round {epoch})")
            running = True
            await asyncio.sleep(LATER_POLL)

    async def _read_result(self, iterator, layout, deadline: float) -> List[torch.Tensor]:
        limit = sum(shape.numel() * torch.empty((), dtype=dtype).element_size() for shape, dtype in layout)
        limit += 1024 * (len(layout) + 1)  # message headers
        tensors, parts, received = [], [], 0
        while True:
            try:
                message = await asyncio.wait_for(iterator.__anext__(), timeout=max(0.0, deadline - time.monotonic()))
            except StopAsyncIteration:
                break
            received += message.ByteSize()
            if received > limit:
                raise FetchFailed(f"it sent more than {limit} bytes, the uncompressed result")
            if message.tensor_part.dtype and parts:
                tensors.append(_checked(combine_from_streaming(parts), len(tensors), layout))
                parts = []
            parts.append(message.tensor_part)
        if parts:
            tensors.append(_checked(combine_from_streaming(parts), len(tensors), layout))
        if len(tensors) != len(layout):
            raise FetchFailed(f"it sent {len(tensors)} of the result's {len(layout)} tensors")
        return tensors


class _Held(NamedTuple):
    """A result a server holds: where (``current``: the averaged tensors; ``previous``: ``_previous``), its round's
    epoch and its group's digest (``NO_GROUP``: held by its epoch only)."""

    slot: str
    epoch: int
    group: bytes


class _Round(NamedTuple):
    """The round an asker missed: its epoch label, its group's digest if its group formed, and whether the others'
    round of the next epoch counts when it runs at the time of asking (see ``_ask_result``)."""

    epoch: int
    group: Optional[bytes]
    next_if_running: bool


def group_label(serializer, group_info) -> Optional[int]:
    """The epoch most of a group's data senders named the round by (``{"epoch": E}``, gathered in matchmaking by
    ``RoundResultSharing.schedule_step``); None where no label is named more often than every other, or none is
    named. Untrusted: a member's data is hivemind's ``[bandwidth, mode, user data]``, any of it malformed; an
    auxiliary member's label does not count (its own is what this replaces)."""
    labels = []
    for data in group_info.gathered:
        try:
            _, mode, user = serializer.loads(data)
            label = serializer.loads(user)["epoch"]
        except Exception:
            continue
        if mode == AveragingMode.AUX.value or isinstance(label, bool) or not isinstance(label, int):
            continue
        if 0 <= label < MAX_LABEL:
            labels.append(label)
    counts = Counter(labels).most_common(2)
    if not counts or (len(counts) == 2 and counts[0][1] == counts[1][1]):
        return None
    return counts[0][0]


def group_digest(group_id: bytes) -> bytes:
    """A round's name on the wire: the SHA-256 of its group ID (a leader picks the ID, so its length is not ours)."""
    return hashlib.sha256(group_id).digest()


_BLOCK: Optional[int] = None


def _block_size(codec: BlockwiseQuantization) -> int:
    """Values per 8-bit block of hivemind's blockwise codec, read from what it encodes (not its private constant)."""
    global _BLOCK
    if _BLOCK is None:
        probe = codec.compress(torch.zeros(1 << 16), CompressionInfo.from_tensor(torch.zeros(1 << 16), key=0))
        _BLOCK = (1 << 16) // int(np.frombuffer(probe.buffer, count=1, dtype=np.int64)[0])
    return _BLOCK


def exact_blockwise(tensor: torch.Tensor) -> Optional[runtime_pb2.Tensor]:
    """hivemind's blockwise 8-bit encoding of values that are themselves such a decoding (a ``same_result`` round's
    result of 8-bit parts: every value is ``code[c] * absmax`` of its block): recovers each block's ``absmax`` and
    codes instead of quantizing again, which moves some values by a code (hivemind's codecs are not idempotent).
    About 1 byte per value instead of 4; the caller checks that it decodes to the exact bits. None for non-float32."""
    if tensor.dtype != torch.float32 or tensor.numel() == 0:
        return None
    codec = BlockwiseQuantization()
    block = _block_size(codec)
    flat = tensor.detach().reshape(-1)
    blocks = torch.cat([flat, flat.new_zeros((-flat.numel()) % block)]).view(-1, block)
    _, (_, code) = codec.quantize(torch.zeros(block))
    code = torch.as_tensor(code)
    absmax, codes = _fit_blocks(blocks, code)
    codes = codes.reshape(-1)[: flat.numel()]
    buffer = b"".join(
        (
            np.int64(len(absmax)).tobytes(),
            np.int64(len(code)).tobytes(),
            absmax.numpy().tobytes(),
            code.numpy().tobytes(),
            codes.numpy().tobytes(),
        )
    )
    return runtime_pb2.Tensor(
        buffer=buffer, size=tensor.shape, dtype="float32", requires_grad=False, compression=codec.compression_type
    )


def _fit_blocks(blocks: torch.Tensor, code: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """Each block's scale and codes such that ``code[codes] * scale`` gives back the block exactly where such exist.
    The scale is the block's largest value (the codebook's 1.0), or a float32 number a few steps around the
    smallest value over the codebook's most negative code (several numbers give that one product: the one that
    gives back every value of the block is kept)."""
    top, low = blocks.amax(1), blocks.amin(1)
    order = torch.argsort(code)
    sorted_code = code[order]
    guess = (low.double() / sorted_code[0].double()).float()
    candidates = [top]
    up, down = guess.clone(), guess.clone()
    inf, zero = torch.full_like(guess, float("inf")), torch.zeros_like(guess)
    for _ in range(8):
        candidates += [up, down]
        up, down = torch.nextafter(up, inf), torch.nextafter(down, zero)
    best_scale, best_codes = top.clone(), torch.zeros(blocks.shape, dtype=torch.uint8)
    found = torch.zeros(len(blocks), dtype=torch.bool)
    for scale in candidates:
        divisor = torch.where(scale > 0, scale, torch.ones_like(scale))[:, None]
        index = torch.bucketize((blocks / divisor).contiguous(), sorted_code).clamp(1, len(code) - 1)
        below = index - 1
        pick = torch.where(sorted_code[below] * scale[:, None] == blocks, below, index)
        exact = (sorted_code[pick] * scale[:, None] == blocks).all(1) & ~found
        best_scale = torch.where(exact, scale, best_scale)
        best_codes[exact] = order[pick[exact]].to(torch.uint8)
        found |= exact
        if bool(found.all()):
            break
    return best_scale, best_codes


def _checked(serialized, index: int, layout) -> torch.Tensor:
    if index >= len(layout):
        raise FetchFailed(f"it sent more than the result's {len(layout)} tensors")
    try:
        tensor = deserialize_torch_tensor(serialized)
    except Exception as e:
        raise FetchFailed(f"its tensor {index} does not decode: {e!r}") from None
    shape, dtype = layout[index]
    if tensor.shape != shape or tensor.dtype != dtype:
        raise FetchFailed(f"its tensor {index} is {tuple(tensor.shape)} {tensor.dtype}, not {tuple(shape)} {dtype}")
    if not bool(torch.isfinite(tensor).all()):
        raise FetchFailed(f"its tensor {index} holds NaN/inf")
    return tensor


def _same(first: Sequence[torch.Tensor], second: Sequence[torch.Tensor]) -> bool:
    return all(torch.equal(a, b) for a, b in zip(first, second))


def _groups(answers):
    """Answers grouped by equal bits: [[(peer, tensors), ...], ...]."""
    groups: List[list] = []
    for peer, tensors in answers:
        for group in groups:
            if _same(group[0][1], tensors):
                group.append((peer, tensors))
                break
        else:
            groups.append([(peer, tensors)])
    return groups


def _agreed(answers) -> bool:
    return any(len(group) >= 2 for group in _groups(answers))


def _choose(answers, max_norm: float) -> Optional[Tuple[List[PeerID], List[torch.Tensor]]]:
    """The result to take (see the module docstring), or None."""
    groups = sorted(_groups(answers), key=len, reverse=True)
    if not groups or (len(groups) > 1 and len(groups[0]) == len(groups[1])):
        if len(groups) > 1:
            logger.warning("Peers sent different results of one round: %s", [[p for p, _ in g] for g in groups])
        return None
    best = groups[0]
    peers, tensors = [peer for peer, _ in best], best[0][1]
    if len(groups) > 1 and len(best) < 2:
        return None
    norm = float(torch.linalg.vector_norm(torch.stack([t.float().norm() for t in tensors])))
    if not norm <= max_norm:  # also for answers that agree: two colluding peers are held to the same bound
        logger.warning("Refused the result of %s: norm %.3g above the bound %.3g", peers, norm, max_norm)
        return None
    return peers, tensors
