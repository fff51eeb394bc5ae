"""hivemind's averaging side: the policy-applying averagers, the bounded all-reduce, the optimizer.
See the package docstring for why each exists."""

from __future__ import annotations

import asyncio
import logging
import math
import multiprocessing as mp
import random
import time
from dataclasses import dataclass
from itertools import chain
from typing import AsyncIterator, Callable, Dict, FrozenSet, List, Optional, Sequence, Tuple

import hivemind
import torch
from hivemind.averaging.allreduce import AllReduceRunner, AveragingMode
from hivemind.averaging.control import AveragingStage, StepControl
from hivemind.averaging.partition import AllreduceException, BannedException, TensorPartReducer
from hivemind.compression import deserialize_torch_tensor, serialize_torch_tensor
from hivemind.optim.grad_averager import GradientAverager
from hivemind.optim.progress_tracker import ProgressTracker
from hivemind.optim.state_averager import TrainingStateAverager, dump_optimizer_state
from hivemind.p2p import PeerID
from hivemind.proto import averaging_pb2, runtime_pb2
from hivemind.utils import MPFuture, get_dht_time
from hivemind.utils.asyncio import amap_in_executor, anext, as_aiter, attach_event_on_finished, azip
from hivemind.utils.nested import nested_flatten, nested_pack
from hivemind.utils.streaming import combine_from_streaming
from hivemind.utils.timed_storage import ValueWithExpiration

import peer.swarm.hivemind_seam.matchmaking as leader_margin
from peer.swarm.hivemind_seam.progress import (
    DOWNLOAD_EPOCH_LEAD,
    MAX_EPOCH_LEAD,
    LeanHiveProgressTracker,
    read_consensus_epoch,
)
from peer.swarm.hivemind_seam.round_result import NORM_FACTOR, RoundResultSharing, fetch_seconds
from peer.swarm.hivemind_seam.state_transfer import NoPartDonors, PartedStateTransfer, StateWithheld, close_stream
from peer.swarm.hivemind_seam.timing import report_round, round_outcome, timed_allreduce, timed_phase
from peer.swarm.keys import outer_averager_prefix, state_averager_prefix
from peer.swarm.robust import (
    DEFAULT_CLIP_FACTOR,
    bound_two_peer_update,
    bounded_mean,
    keep_local_where_not_finite,
)
from peer.swarm.round_wait import RoundWait
from peer.swarm.tensors import all_finite

logger = logging.getLogger(__name__)


# ------------------------------------------------------------------------------------------------ averaging


@dataclass(frozen=True)
class AveragingPolicy:
    """What an averager accepts from other peers (both averagers of one peer get the same policy)."""

    authorized_peers: Optional[FrozenSet[str]] = None
    """Peer IDs (base58) that may call this averager's RPCs; None: everyone (authorization off)."""
    contribution_clip: float = DEFAULT_CLIP_FACTOR
    """The clip factor of ``bounded_mean``; 0 keeps hivemind's plain mean (NaN/inf parts are still dropped)."""
    finite_downloads_only: bool = True
    """A downloaded state with NaN/inf values is not applied (a faulty peer must not spread them to a joiner)."""


class BoundedPartReducer(TensorPartReducer):
    """TensorPartReducer whose result for each part is ``bounded_mean`` of the senders' parts."""

    def __init__(self, part_shapes, num_senders: int, *, clip_factor: float):
        self.clip_factor = clip_factor  # before super().__init__: it already calls reset_accumulators
        super().__init__(part_shapes, num_senders)

    def reset_accumulators(self):
        super().reset_accumulators()
        if not self.finished.is_set():
            self.accumulator = _PartCollector(self.clip_factor, self.part_shapes[self.current_part_index])


class _PartCollector:
    """Takes the place of TensorPartReducer's running sum: keeps every sender's part, aggregates in ``div_``."""

    def __init__(self, clip_factor: float, shape: torch.Size):
        self.clip_factor, self.shape = clip_factor, torch.Size(shape)
        self.parts: List[torch.Tensor] = []
        self.weights: List[float] = []

    def add_(self, tensor: torch.Tensor, alpha: float = 1.0) -> "_PartCollector":
        if tensor.shape != self.shape:
            # dropped here, still counted by the reducer as received: the round goes on for everyone else (only
            # the sender's own result fails to apply, so only it can be banned)
            logger.warning(
                "Averaging: dropped a part of shape %s (this shard's part has shape %s): a broken or hostile peer",
                tuple(tensor.shape),
                tuple(self.shape),
            )
            return self
        self.parts.append(tensor.detach().to(torch.float32, copy=True))
        self.weights.append(float(alpha))
        return self

    def div_(self, _denominator: float) -> torch.Tensor:
        if not self.parts:  # nothing usable: NaN, which receivers refuse (they keep their local values)
            return torch.full(self.shape, float("nan"))
        return bounded_mean(self.parts, self.weights, self.clip_factor)


SAME_RESULT_MARK = b"leanhive/same-result/1"
"""Set in the ``peer_id`` field of a sender's first part and of a reducer's answers (hivemind 1.1.12 leaves that field
unused in all-reduce streams): the sender asks for, and the reducer answers with, the part's average itself, encoded
once for the whole group (``BoundedAllReduceRunner``). Peers without it exchange hivemind's deltas."""


CLIENT_START_TIMEOUTS = 2
"""sender_timeouts a client-mode sender gets to start (``BoundedAllReduceRunner._handle_missing_senders``)."""


class BoundedAllReduceRunner(AllReduceRunner):
    """hivemind's runner with ``bounded_mean`` for the average, a client path that reads answers while it sends, a
    longer start for client senders and, with ``same_result``, one result for the whole group.

    ``same_result``: hivemind's reducer answers each sender ``Q(average - Q(its part))`` (Q: the wire compression)
    and the sender adds that to its own part, so every peer ends with the average plus its own rounding errors (and
    the reducer, which keeps its own shard uncompressed, with none). A lossy compression therefore leaves the peers
    of a synchronous swarm apart after every round, and LAMB's normalized step turns the rounding of a near-zero
    gradient into up to a whole step of difference. On the home testbed the three trainers of a busy run were up to
    0.018 apart after rounds that all succeeded. With ``same_result`` the reducer encodes each averaged part once
    and sends those bytes to every sender that asks for them (``SAME_RESULT_MARK``); each peer, the reducer
    included, takes the decoded part as its result. Every peer of a round then holds the same bits. The rounding is
    that of the encoded average rather than of a delta: on 8-bit codes, peers whose parts are close (noise 0.3 of
    the signal) end 0.7 % of a standard deviation from the mean instead of 0.3 to 0.5 %
    (tests/swarm/test_same_result.py); gradients of different batches differ more than that, and the delta's range
    is then no narrower. An older reducer's delta is turned into a result here (own part + delta)."""

    def __init__(self, *, clip_factor: float, same_result: bool = False, own_part_as_sent: bool = False, **kwargs):
        super().__init__(**kwargs)
        if same_result and self.sender_timeout is not None:
            # a reducer answers a part once every sender's part arrived or its sender was banned, which for a client
            # takes up to CLIENT_START_TIMEOUTS sender_timeouts (_handle_missing_senders); hivemind's reducer_timeout
            # (2 x sender_timeout) equalled that, so when a client of the group died the full peers gave up on each
            # other as reducers at the very moment the client was banned, and all of them lost the round. Sync-mode
            # gradients only, where it was measured: local mode's sender_timeout is a third of its all-reduce time,
            # so the floor would be that whole time
            floor = (CLIENT_START_TIMEOUTS + 1) * self.sender_timeout
            self.reducer_timeout = max(self.reducer_timeout or 0.0, floor)
        unused = self.tensor_part_reducer
        unused.finished.set()  # it never ran: no "received 0% of input tensors" warning when it is collected
        self.tensor_part_reducer = BoundedPartReducer(unused.part_shapes, unused.num_senders, clip_factor=clip_factor)
        self.same_result = same_result
        self.own_part_as_sent = own_part_as_sent and not same_result  # see _average_own_shard
        self.tensor_part_container.return_deltas = not same_result  # a failed reducer's parts: our own values
        # (part, compression info) for each peer's shard, kept here: the container drops them when it is finalized
        self._parts_by_peer = [list(parts) for parts in self.tensor_part_container._input_parts_by_peer]
        self._encoded_averages: Dict[int, asyncio.Future] = {}

    def heard_from(self, peers: Sequence[PeerID]) -> bool:
        """Whether data of any of ``peers`` (other members of the group) reached this peer's result: a part of theirs
        that this peer's reducer averaged, or an answer of theirs as a reducer. Read once the round's results are in;
        every part a failed reducer left is counted in the container's ``failed_size``."""
        container, reducer = self.tensor_part_container, self.tensor_part_reducer
        own_index = self.ordered_peer_ids.index(self.peer_id)
        own_shard = sum(part.numel() for part, _ in self._parts_by_peer[own_index])
        if container.failed_size < container.total_size - own_shard:
            return True  # some other reducer answered
        for peer_id in peers:
            if peer_id in self.sender_peer_ids:
                index = self.sender_peer_ids.index(peer_id)
                if min(reducer.num_parts_received[index], reducer.sender_failed_after[index]) > 0:
                    return True
        return False

    async def _handle_missing_senders(self):
        """hivemind's, except that a client-mode sender gets twice ``sender_timeout`` to start.

        A sender counts as started once its first part arrived (hivemind's averager reads it before the runner sees
        the stream), and a home client's first part crosses a 10 Mbit/s uplink it shares with its other reducers: on
        the home testbed a public trainer (sender_timeout 1 s) averaged without a volunteer that had begun 70 ms
        after it, 1.06 s after its own start, and the volunteer took that reducer's parts as its own."""
        if self.sender_timeout is None:
            return await super()._handle_missing_senders()
        for round_index in range(CLIENT_START_TIMEOUTS):
            try:
                await asyncio.wait_for(self.all_senders_started.wait(), self.sender_timeout)
                return
            except asyncio.TimeoutError:
                for peer_id in self.sender_peer_ids:
                    late = peer_id not in self.active_senders and peer_id not in self.banned_senders
                    if late and (round_index > 0 or not self.should_delay_results(peer_id)):
                        await self._ban_sender(peer_id)

    async def _communicate_with_peer(self, peer_id: PeerID):
        """hivemind's, except for a client-mode peer sending to a reducer, and for answers that are results
        (``same_result``, see the class docstring; this peer's own shard: ``_average_own_shard``).

        A client reads the reducer's answer while it sends, so a refusal ends its round at once.

        hivemind's client reads only once every part was sent (the reducer holds a client's results until then).
        A reducer that refuses the client answers at once and closes the stream: the client began after the
        reducer's sender_timeout (it was finishing its local step; the reducer then goes on without it), or the
        reducer's round was over, or the reducer died. The client's next write fails, its input never finishes
        (hivemind's writer task dies without closing it), and it waited for the answer until its all-reduce timeout:
        15 s of a stalled training loop on the home testbed, then late for the next rounds (a missed round, a state
        download, the next round missed again). The reducer's parts are then this peer's own (hivemind's
        ``register_failed_reducer``), as after any failed reducer. ``reducer_timeout`` runs from the last part sent,
        as in hivemind."""
        if peer_id == self.peer_id:
            return await self._average_own_shard()
        client = self.should_delay_results(self.peer_id)
        if not client and not self.same_result:
            return await super()._communicate_with_peer(peer_id)
        peer_index = self.ordered_peer_ids.index(peer_id)
        answers = first = None
        try:
            done_sending = asyncio.Event()
            inputs = attach_event_on_finished(self._generate_input_for_peer(peer_index), done_sending)
            answers = (await self._get_peer_stub(peer_id).rpc_aggregate_part(inputs)).__aiter__()
            expected = self.tensor_part_container.num_parts_by_peer[peer_index]
            first = asyncio.ensure_future(answers.__anext__())
            if client:
                sent = asyncio.ensure_future(done_sending.wait())
                try:
                    await asyncio.wait({first, sent}, return_when=asyncio.FIRST_COMPLETED)
                finally:
                    sent.cancel()
            for part_index in range(expected):
                try:
                    message = await asyncio.wait_for(
                        first if part_index == 0 else answers.__anext__(), self.reducer_timeout
                    )
                except StopAsyncIteration:
                    raise AllreduceException(f"peer {peer_id} sent {part_index} parts, but we expected {expected}")
                if message.code != averaging_pb2.AVERAGED_PART:
                    raise AllreduceException(f"{peer_id} sent {averaging_pb2.MessageCode.Name(message.code)}")
                result = await asyncio.get_event_loop().run_in_executor(
                    None, self._result_of, peer_index, part_index, message
                )
                self.tensor_part_container.register_processed_part(peer_index, part_index, result)
        except BaseException as e:
            if isinstance(e, Exception):
                logger.debug("Caught %r when communicating to %s", e, peer_id, exc_info=True)
            if not self.tensor_part_container.finished.is_set():  # a finalized container has dropped its parts
                self.tensor_part_container.register_failed_reducer(peer_index)
            raise
        finally:
            if first is not None and not first.done():
                first.cancel()
                await asyncio.gather(first, return_exceptions=True)
            if answers is not None:
                await answers.aclose()  # closes the stream and stops hivemind's writer task

    def _result_of(self, peer_index: int, part_index: int, message: averaging_pb2.AveragingData) -> torch.Tensor:
        """What the container gets for a reducer's answer: hivemind's delta, or with ``same_result`` the result."""
        value = deserialize_torch_tensor(message.tensor_part)
        if not self.same_result or message.peer_id == SAME_RESULT_MARK:
            return value
        own, _ = self._parts_by_peer[peer_index][part_index]
        return own + value  # an older reducer's delta

    async def _average_own_shard(self):
        """hivemind's local branch of ``_communicate_with_peer``; with ``same_result`` this peer's result for its
        own shard is the encoded average every sender gets, not the exact one.

        ``own_part_as_sent`` (deltas only): this reducer averages its own part as every other reducer receives it
        (encoded, then decoded), and its result is the exact delta from that part. hivemind averages the exact own
        part with the others' decoded ones, so peers that hold the very same tensors still end a round apart by the
        wire compression's rounding of the values themselves: on the home testbed the public trainer and two
        volunteers that took every gradient round bit for bit ended each state averaging round 0.0014 apart, and
        trainers never held the same state that a joiner could take in parts from several of them. As sent,
        identical parts average to themselves (``bounded_mean``: their median plus no deviation; with
        --contribution_clip 0 a plain mean, within float rounding), every delta is zero and identical peers stay
        identical. The delta stays exact (not encoded, as a sender's is): a reducer whose state differs
        from the others' (it stepped a round alone) takes the average plus its own rounding of the values in one
        round. Encoded, the delta's 8-bit range is set by its largest differences, and a public trainer of the home
        testbed stayed 0.024 apart from the volunteers for the 20 epochs after such a round."""
        peer_index = self.ordered_peer_ids.index(self.peer_id)
        sender_index = self.sender_peer_ids.index(self.peer_id)
        loop = asyncio.get_event_loop()
        for part_index, tensor_part in enumerate(self.parts_for_local_averaging):
            if self.own_part_as_sent:
                _, info = self._parts_by_peer[peer_index][part_index]
                compress = self.tensor_part_container.compression.compress
                encoding = await loop.run_in_executor(None, compress, tensor_part, info)
                tensor_part = await loop.run_in_executor(None, deserialize_torch_tensor, encoding)
            averaged_part = await self.tensor_part_reducer.accumulate_part(
                sender_index, part_index, tensor_part, weight=self.weight
            )
            if self.same_result:
                encoded = await self._encoded_average(part_index, averaged_part)
                result = await loop.run_in_executor(None, deserialize_torch_tensor, encoded)
            else:
                result = averaged_part - tensor_part
            self.tensor_part_container.register_processed_part(peer_index, part_index, result)

    async def _encoded_average(self, part_index: int, averaged_part: torch.Tensor) -> runtime_pb2.Tensor:
        """The averaged part of this reducer's shard, encoded once (as this peer sends that part) for every
        sender that asks for the result itself and for this peer's own result."""
        future = self._encoded_averages.get(part_index)
        if future is None:
            _, info = self._parts_by_peer[self.ordered_peer_ids.index(self.peer_id)][part_index]
            compress = self.tensor_part_container.compression.compress
            future = asyncio.get_event_loop().run_in_executor(None, compress, averaged_part, info)
            self._encoded_averages[part_index] = future
        return await asyncio.shield(future)  # one cancelled sender must not cancel the others' answer

    async def _generate_input_for_peer(self, peer_index: int) -> AsyncIterator[averaging_pb2.AveragingData]:
        """hivemind's, with ``SAME_RESULT_MARK`` in the first part when this runner wants the result itself."""
        parts = self.tensor_part_container.iterate_input_parts_for(peer_index)
        first_part = await anext(parts)
        yield averaging_pb2.AveragingData(
            code=averaging_pb2.PART_FOR_AVERAGING,
            group_id=self.group_id,
            tensor_part=first_part,
            weight=self.weight,
            peer_id=SAME_RESULT_MARK if self.same_result else b"",
        )
        async for part in parts:
            yield averaging_pb2.AveragingData(tensor_part=part, weight=self.weight)

    async def _accumulate_parts_streaming(self, stream: AsyncIterator[averaging_pb2.AveragingData], sender_index: int):
        """hivemind's, except that a sender whose first part carries ``SAME_RESULT_MARK`` is answered with the
        encoded average (``_encoded_average``), marked, instead of its delta."""
        part_index = 0
        wants_result = None
        try:
            loop = asyncio.get_event_loop()
            async for tensor_part, weight, part_compression, mark in amap_in_executor(
                lambda msg: (
                    deserialize_torch_tensor(msg.tensor_part),
                    msg.weight,
                    msg.tensor_part.compression,
                    msg.peer_id,
                ),
                stream,
                max_prefetch=self.tensor_part_container.prefetch,
            ):
                if wants_result is None:
                    wants_result = mark == SAME_RESULT_MARK
                try:
                    averaged_part = await self.tensor_part_reducer.accumulate_part(
                        sender_index, part_index, tensor_part, weight=weight
                    )
                    part_index += 1
                except BannedException:
                    logger.debug("Sender %d is already banned", sender_index)
                    break  # sender was banned, we no longer need to aggregate it

                if wants_result:
                    encoded = await self._encoded_average(part_index - 1, averaged_part)
                    yield averaging_pb2.AveragingData(
                        code=averaging_pb2.AVERAGED_PART, tensor_part=encoded, peer_id=SAME_RESULT_MARK
                    )
                else:
                    serialized_delta = await loop.run_in_executor(
                        None, lambda: serialize_torch_tensor(averaged_part - tensor_part, part_compression)
                    )
                    yield averaging_pb2.AveragingData(code=averaging_pb2.AVERAGED_PART, tensor_part=serialized_delta)
        finally:
            if part_index != self.tensor_part_reducer.num_parts:
                await self._ban_sender(self.sender_peer_ids[sender_index])


class _AllowlistServicer:
    """Registered by ``add_p2p_handlers`` instead of the averager: each rpc_* first checks the caller's peer ID."""

    def __init__(self, servicer, allowed: FrozenSet[str]):
        self._servicer, self._allowed = servicer, allowed
        servicer._collect_rpc_handlers()
        self._streaming = {handler.method_name: handler.stream_output for handler in servicer._rpc_handlers}

    def __getattr__(self, name: str):
        method = getattr(self._servicer, name)
        if not name.startswith("rpc_"):
            return method
        allowed = self._allowed

        def refuse(context) -> bool:
            if context.remote_id.to_base58() in allowed:
                return False
            logger.warning("Refused %s from %s: not in --authorized_keys", name, context.remote_id)
            return True

        if self._streaming.get(name, False):

            async def checked_stream(request, context):
                if refuse(context):
                    raise PermissionError(f"{context.remote_id} is not authorized to call {name}")
                async for item in method(request, context):
                    yield item

            return checked_stream

        async def checked(request, context):
            if refuse(context):
                raise PermissionError(f"{context.remote_id} is not authorized to call {name}")
            return await method(request, context)

        return checked


CLIENT_JOIN_MARGIN = 0.25
"""Seconds (at most) between a client's join expiration and its deadline: hivemind needs the first before the
second, and the step's deadline is read a moment after the expiration is."""


def client_join_expiration(now: float, timeout: float) -> float:
    """When a client-mode peer's round is scheduled (the expiration it sends leaders): as late as its matchmaking
    ``timeout`` allows. A client never leads, so a late expiration cannot deadlock leaders (hivemind's reason for
    the check); it only lets any leader that begins before this client gives up take it in."""
    return now + timeout - min(CLIENT_JOIN_MARGIN, timeout / 10)


class _PolicyAveraging:
    """What both averager classes share: they are built with an ``AveragingPolicy`` and apply it to their RPCs and
    all-reduce rounds. The first base of each (one level; nothing is injected below hivemind's classes)."""

    def __init__(self, *args, policy: AveragingPolicy = AveragingPolicy(), **kwargs):
        self.policy = policy  # before hivemind's __init__, which forks the averager process
        self.whole_results = mp.Value("q", 0)
        """Rounds (``same_result`` ones: gradients in sync mode) whose result this averager copied into every one of
        its averaged tensors, with no part kept local (a failed reducer, NaN/inf values, the two-peer bound), or in
        which no other member sent data (its own gradients are then the result, kept parts included); shared with the
        averager process. An auxiliary peer takes the optimizer step of such a round
        (``LeanHiveOptimizer._round_was_whole``)."""
        super().__init__(*args, **kwargs)

    def __del__(self):
        try:  # hivemind's __del__ assumes a finished constructor (see the module docstring)
            super().__del__()
        except AttributeError:
            pass

    @property
    def _matchmaking(self):
        try:
            return self.__dict__["_leanhive_matchmaking"]
        except KeyError:
            raise AttributeError("_matchmaking") from None

    @_matchmaking.setter
    def _matchmaking(self, matchmaking) -> None:
        # hivemind builds it in the averager process (_run_internal): our leaders assemble before the deadline
        self.__dict__["_leanhive_matchmaking"] = leader_margin.install(matchmaking, self.key_epoch)

    key_epoch = None
    """A ``multiprocessing.Value``: the epoch of the round this peer averages next, named in its group key
    (``PseudoGradientAverager``, matchmaking.py); None: hivemind's keys."""

    def schedule_step(self, scheduled_time: Optional[float] = None, **kwargs):
        """A client-mode peer asks to join with the latest expiration its round allows (``client_join_expiration``):
        hivemind asks with the time it scheduled, and a leader that scheduled later refuses it (BAD_EXPIRATION_TIME),
        so a client whose only reducer (an assisting aux) scheduled a moment later missed the round."""
        if scheduled_time is None:
            scheduled_time = self._client_scheduled_time(kwargs.get("timeout"))
        return super().schedule_step(scheduled_time=scheduled_time, **kwargs)

    def _client_scheduled_time(self, timeout: Optional[float]) -> Optional[float]:
        """``client_join_expiration`` for a client-mode peer's round of ``timeout``; None (hivemind's choice) else."""
        if not self.client_mode or timeout is None:
            return None
        return client_join_expiration(get_dht_time(), timeout)

    async def add_p2p_handlers(self, p2p, wrapper=None, *, namespace=None, balanced=False):
        allowed = self.policy.authorized_peers
        if allowed is not None and wrapper is None:
            wrapper = _AllowlistServicer(self, allowed)
        return await super().add_p2p_handlers(p2p, wrapper, namespace=namespace, balanced=balanced)

    @timed_allreduce
    async def _run_allreduce_inplace_(
        self, tensors: Sequence[torch.Tensor], group_info, group_id: Optional[bytes] = None, **kwargs
    ):
        """hivemind's DecentralizedAverager._run_allreduce_inplace_ with the bounded runner and a finiteness check."""
        group_id = group_info.group_id if group_id is None else group_id
        runner = BoundedAllReduceRunner(
            clip_factor=self.policy.contribution_clip,
            same_result=self._same_result,
            own_part_as_sent=self._own_part_as_sent,
            p2p=self._p2p,
            servicer_type=type(self),
            prefix=self.prefix,
            tensors=tensors,
            group_id=group_id,
            ordered_peer_ids=group_info.peer_ids,
            **kwargs,
        )
        assert group_id in self._running_groups, f"Group id {group_id} was not registered in _register_allreduce_group"
        self._running_groups[group_id].set_result(runner)
        self._allreduce_began(group_id, group_info)
        try:
            await self._run_bounded(runner, tensors, group_info)
        finally:
            self._allreduce_ended()

    async def _run_bounded(self, runner: "BoundedAllReduceRunner", tensors: Sequence[torch.Tensor], group_info):
        if runner.modes[group_info.peer_ids.index(self.peer_id)] != AveragingMode.AUX:
            received = refused = bounded = 0
            # two contributors: the median cannot tell the faulty one, so bound what the other can do to us
            two_peers = self._bound_two_peer_rounds and self.policy.contribution_clip > 0
            two_peers = two_peers and len(runner.sender_peer_ids) == 2 and runner.weight > 0
            modes = declared_modes(self.serializer, group_info)
            others = [p for p, m in zip(group_info.peer_ids, modes) if p != self.peer_id and m != AveragingMode.AUX]
            # local mode: a group of this trainer and aux peers only averages its own pseudo-gradient; while other
            # trainers train, that is an outer step alone (the averaged tensors are put back for a retry)
            alone = self._others_data_needed and not others and self.other_trainers.value > 0
            kept = [tensor.clone() for tensor in tensors] if alone else None
            async for tensor, output in azip(as_aiter(*tensors), runner):
                received += 1
                # the checks below work on the update (average - own); with same_result the output is the result
                update = output - tensor if runner.same_result else output
                not_finite = keep_local_where_not_finite(update)
                refused += not_finite
                was_bounded = two_peers and bound_two_peer_update(update, tensor)
                bounded += was_bounded
                if runner.same_result and not (not_finite or was_bounded) and self._averaging_alpha == 1:
                    tensor.copy_(output)  # the group's very bits: own + (result - own) may round differently
                else:
                    tensor.add_(update, alpha=self._averaging_alpha)
                self.last_updated = get_dht_time()
                self._state_updated.set()
            container = runner.tensor_part_container
            if container.total_size and container.failed_size >= container.total_size:
                # a client whose reducers all refused it (BoundedAllReduceRunner._communicate_with_peer) kept its own
                # values: hivemind calls that a round, and it would be counted as one taken part in
                raise AllreduceException("no reducer of the group averaged this peer's parts")
            if kept is not None:
                for tensor, before in zip(tensors, kept):
                    tensor.copy_(before)
                raise AllreduceException(
                    f"the group had no other trainer (only aux peers) while {self.other_trainers.value} other "
                    "trainer(s) train: its result is this peer's own"
                )
            if self._others_data_needed and others and not runner.heard_from(others):
                raise AllreduceException("no other member of the group sent data: this peer's result is its own")
            whole = received == len(tensors) and not (refused or bounded or container.failed_size)
            if runner.same_result:  # the group's very bits (not own + delta, as in local mode)
                # no other member sent data: every part, averaged or kept, is this peer's own gradient, and that is
                # its round's result even where a reducer failed (an assisting aux's own part came late, "received
                # 56.9% results"; a client that found no group then had no result to take and stepped apart)
                if whole or not others:
                    with self.whole_results.get_lock():
                        self.whole_results.value += 1
                    # a group where nobody serves its state (clients and an aux) is the swarm's round only if no
                    # serving trainer took that round elsewhere: volunteers that downloaded the state a second
                    # before their donor's round ended ran that round among themselves with the aux, while the
                    # donor, which did not see them yet, stepped alone (home testbed b: 0.04 apart from round 1 on)
                    serving = any(m == AveragingMode.NODE for m in modes)
                    self._took_whole_result(group_info.peer_ids, unconfirmed=not others or not serving)
            if refused:
                logger.warning("Averaging: received %d NaN/inf averaged values; kept the local values there", refused)
            if bounded:
                logger.warning(
                    "Averaging: bounded the update of %d of %d tensors by this peer's own part (two-peer round)",
                    bounded,
                    received,
                )
        else:
            async for _ in runner:
                raise ValueError("aux peers should not receive averaged tensors")

    def _took_whole_result(self, group: Sequence[PeerID], unconfirmed: bool) -> None:
        """(averager process) A ``same_result`` round's whole result was just copied in (round_result.py);
        ``unconfirmed``: no other member of the ``group`` sent data (this peer's own gradients, or an aux's zeros), or
        no member serves its state (a group of clients and an aux): the serving trainers outside it may hold the
        swarm's round."""

    def _allreduce_began(self, group_id: bytes, group_info) -> None:
        """(averager process) An all-reduce of this averager's group ``group_id`` (``group_info``) begins: its group
        formed."""

    def _allreduce_ended(self) -> None:
        """(averager process) An all-reduce of this averager ended, with or without a result."""

    _bound_two_peer_rounds = False
    """Bound each tensor's update in a two-contributor round (``bound_two_peer_update``): gradients only (a
    parameter or statistic tensor may legitimately be all zeros, which would freeze it)."""
    _same_result = False
    """Every peer takes the group's encoded average itself (``BoundedAllReduceRunner``): for gradients. The state
    averager keeps hivemind's deltas: an encoded absolute parameter would lose the precision a delta keeps."""
    _own_part_as_sent = False
    """A reducer averages its own part as the others receive it (``BoundedAllReduceRunner._average_own_shard``): for
    the state, whose peers hold the same tensors whenever they took the same rounds."""
    _others_data_needed = False
    """A round in which no data of another (non-aux) member reached this peer fails (``BoundedAllReduceRunner.
    heard_from``): hivemind calls it a round when the others' parts time out, and this peer's result is then its own
    contribution alone. For local mode's pseudo-gradients, where a failed round is dropped: two local-mode peers
    whose group formed, one of which never began the all-reduce (its matchmaking stream broke) dropped the round
    while the other, whose reducer and sender timed out on it, took its own pseudo-gradient as the round's and
    stepped alone; their shared parameters stayed 0.51 apart until the round agreement downloaded, two rounds on.
    A group of this peer and aux peers only fails the same way while other trainers train (``other_trainers``): a
    client and an assisting aux took a round that way while the full trainer found no group and dropped it, and the
    client's shared parameters stayed 1.04 apart from the trainer's for the round."""


def declared_modes(serializer, group_info) -> Tuple[AveragingMode, ...]:
    """Each group member's mode as it declared it in matchmaking (``[bandwidth, mode, user data]``, what
    hivemind's ``DecentralizedAverager.step`` gathers). hivemind's ``_aggregate_with_group`` reads the same but hands
    the runner only the peers' fractions, from which an aux peer looks like a node: it would never relay, and two
    client peers of a group would miss each other's payloads. A member may lie about its mode: claiming aux makes it
    the relay of the group's clients, which lets it do no more than a sender can (drop or spoil payloads, which the
    receivers check, and a disagreement the round vote repairs)."""
    return tuple(AveragingMode(serializer.loads(data)[1]) for data in group_info.gathered)


def declared_priorities(dht, key: str) -> Dict[PeerID, float]:
    """The peers that declared themselves under hivemind's ``<prefix>.all_averagers`` key (averagers that share their
    state), with the priority each claims; entries that are not a peer ID with a number are left out."""
    declared, _ = dht.get(key, latest=True) or ({}, None)
    priorities = {}
    for raw_id, info in (declared or {}).items():
        if not isinstance(info, ValueWithExpiration) or not isinstance(info.value, (int, float)):
            continue
        if isinstance(info.value, bool) or math.isnan(info.value):
            continue
        try:
            priorities[PeerID(raw_id)] = float(info.value)
        except Exception:
            continue
    return priorities


def _finite_floats(tensors) -> bool:
    return all_finite(t for t in tensors if t.is_floating_point())  # 8-bit codes are always finite


BOUND_REFRESH_SECONDS = 5.0
"""A download that took longer than this re-reads the swarm's consensus before the epoch check (the swarm moved on)."""
STATE_CHUNK_TIMEOUT = 20.0
"""Once a peer started sending its state, the longest wait for each next chunk (hivemind used request_timeout,
3 s at most, for every chunk including the first: the server's snapshot alone can take longer)."""
MIN_STATE_RATE = 250_000.0
"""Bytes/s below which a download is given up: a 20 Mbit/s link (2.5 MB/s) at a tenth of its speed. With the
state's size it bounds a download that trickles forever (``state_download_seconds``)."""
MAX_RETRY_PAUSE = 5.0
"""The longest pause before the peers that declared their state are asked again (``StateDownloadSettings``)."""
PROBE_EVERY = 0.25
"""Seconds between a late trainer's probes of whether the others took its round without it."""
PROBE_TIMEOUT = 1.0
"""The longest a probe waits for the peers' answers (a status each, no tensors)."""
MIN_FETCH_SECONDS = 0.5
"""Seconds below which a missed round's result is not asked for (``LeanHiveOptimizer._fetch_round_result``)."""
ASSISTING_REFRESH = 30.0
"""Seconds a trainer keeps the list of assisting aux peers it read (``LeanHiveOptimizer._assisting_peers``)."""


class IncompleteStateError(ValueError):
    """A downloaded state (or part of it) is shorter or longer than the shapes and dtypes it declares: refused before
    anything is reshaped or applied."""


def checked_tensor(serialized, index: int, layout: Sequence[Tuple[torch.Size, torch.dtype]]) -> torch.Tensor:
    """Tensor ``index`` of a downloaded state, deserialized only once its declaration (shape, dtype, no compression)
    equals this peer's layout and its buffer holds exactly that many bytes.

    A stream cut short (a libp2p relay circuit ends at 128 KiB) used to reach hivemind's reshape with part of a
    tensor: ``RuntimeError: shape '[4096, 128]' is invalid for input of size 32768``. States are served without
    compression (``load_state_compression=NoCompression()``), so the size is exact."""
    if index >= len(layout):
        raise IncompleteStateError(f"it sent more than the state's {len(layout)} tensors")
    shape, dtype = layout[index]
    declared = (tuple(serialized.size), serialized.dtype)
    expected = (tuple(shape), str(dtype).replace("torch.", ""))
    if serialized.compression != runtime_pb2.CompressionType.NONE:
        raise IncompleteStateError(f"its tensor {index} is compressed; states are served uncompressed")
    if declared != expected:
        raise IncompleteStateError(f"its tensor {index} declares {declared}, this peer's state has {expected}")
    size = shape.numel() * torch.empty((), dtype=dtype).element_size()
    if len(serialized.buffer) != size:
        raise IncompleteStateError(
            f"its tensor {index} {expected} arrived with {len(serialized.buffer)} of its {size} bytes (a cut "
            f"connection, e.g. a relayed circuit's data limit); nothing of it was applied"
        )
    return deserialize_torch_tensor(serialized)


def state_download_seconds(state_bytes: int, first_chunk_timeout: float) -> float:
    """The longest one peer may take to send a state of ``state_bytes``: its first chunk within
    ``first_chunk_timeout`` (load_state_timeout), the rest at ``MIN_STATE_RATE`` or faster."""
    return first_chunk_timeout + state_bytes / MIN_STATE_RATE


@dataclass(frozen=True)
class StateDownloadSettings:
    """How a peer downloads the swarm's state (parameters and optimizer statistics), whoever asks for it: joining,
    recovering from NaN/inf parameters, a missed round or a lost vote of --sync_mode local, the final barrier,
    hivemind's own catch-up, an aux peer's checkpoint.

    The retry policy, the only one: one request makes **at most ``attempts`` peer downloads**, each from the best
    peer (highest capped priority) not yet asked in this request. A download fails when the peer does not answer in
    time or sends a state that is refused (wrong shapes or settings, NaN/inf, an epoch beyond the swarm's consensus or
    behind this peer's). Once every peer that declared its state was asked, or when none did, the declarations are
    read again after a pause of ``retry_pause`` x (the pauses so far + 1), at most ``MAX_RETRY_PAUSE`` s: a peer a
    moment behind (still applying the epoch this peer just finished) may be ready then."""

    attempts: int = 3
    """At most this many peer downloads per request (--load_state_attempts)."""
    first_chunk_timeout: float = 120.0
    """Seconds a peer may take to start sending its state (--load_state_timeout); the rest of one download is
    bounded by the state's size (``state_download_seconds``)."""
    retry_pause: float = 2.0
    """Seconds before the peers are asked again, times the number of such pauses in the request so far."""
    max_donors: int = 3
    """At most this many donors send disjoint parts of the state at once (--max_donors; state_transfer.py)."""
    serve_max_joiners: int = 2
    """This peer serves its state to at most this many joiners at a time; others are told it is busy
    (--serve_max_joiners)."""

    def __post_init__(self):
        if not (isinstance(self.attempts, int) and self.attempts >= 1):
            raise ValueError(f"attempts must be an integer >= 1, got {self.attempts!r}")
        for name in ("max_donors", "serve_max_joiners"):
            value = getattr(self, name)
            if not (isinstance(value, int) and not isinstance(value, bool) and value >= 1):
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")

    def pause(self, pauses_before: int) -> float:
        """The pause before the peers are asked again, when ``pauses_before`` pauses were made in this request."""
        return min(self.retry_pause * (pauses_before + 1), MAX_RETRY_PAUSE)

    def request_seconds(self, state_bytes: int) -> float:
        """The longest one request may take: every attempt a whole download, every pause taken."""
        pauses = sum(self.pause(k) for k in range(self.attempts - 1))
        return self.attempts * state_download_seconds(state_bytes, self.first_chunk_timeout) + pauses


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _same_kind(local, remote) -> bool:
    if isinstance(local, bool) or isinstance(remote, bool):
        return type(local) is type(remote)
    if isinstance(local, (int, float)):
        return _is_number(remote) and isinstance(remote, int) == isinstance(local, int)
    return type(local) is type(remote)


def _check_optimizer_metadata(local_state: dict, remote_flat) -> Optional[str]:
    """Why the downloaded optimizer metadata (hivemind's flat form) does not fit the local optimizer, or None.

    Hyper-parameters must equal the local configuration (the scheduled ``lr`` may differ but not exceed the
    group's initial lr); per-parameter values (``step``) must be of the local type, finite and non-negative."""
    local_flat = list(nested_flatten(local_state))
    if not isinstance(remote_flat, (list, tuple)) or len(remote_flat) != len(local_flat):
        return "its optimizer state has a different structure"
    values = []
    for local, remote in zip(local_flat, remote_flat):
        if not isinstance(remote, dict) or remote.get("type") not in ("tensor", "value"):
            return "its optimizer state has a malformed entry"
        if isinstance(local, torch.Tensor) != (remote["type"] == "tensor"):
            return "its optimizer state has a different structure"
        values.append(local if isinstance(local, torch.Tensor) else remote.get("value"))
    remote_state = nested_pack(values, structure=local_state)
    for local_group, remote_group in zip(local_state["param_groups"], remote_state["param_groups"]):
        for key, local in local_group.items():
            remote = remote_group.get(key)
            if key == "lr":
                ceiling = local_group.get("initial_lr", local)
                if not (_is_number(remote) and 0 <= remote <= ceiling * (1 + 1e-6)):
                    return f"its learning rate {remote!r} is outside this run's schedule (0 ... {ceiling})"
            elif key != "params" and remote != local:
                return f"its optimizer setting {key}={remote!r} differs from this peer's {local!r}"
    for param_key, local_param_state in local_state["state"].items():
        remote_param_state = remote_state["state"][param_key]
        for key, local in local_param_state.items():
            if isinstance(local, torch.Tensor):
                continue
            remote = remote_param_state.get(key)
            if not _same_kind(local, remote) or (_is_number(remote) and remote < 0):
                return f"its optimizer state {key}={remote!r} is not a valid {type(local).__name__}"
    return None


class LeanHiveStateAverager(_PolicyAveraging, PartedStateTransfer, TrainingStateAverager):
    """TrainingStateAverager that can tell whether a state download was applied (hivemind returns quietly when
    nobody answers), serves consistent and finite snapshots, applies ``policy`` (allowlist for its RPCs, bounded
    contributions, finite downloads only) and downloads by ``download_settings`` (one retry policy)."""

    _own_part_as_sent = True

    def __init__(self, *args, download_settings: StateDownloadSettings = StateDownloadSettings(), **kwargs):
        # all set before hivemind's __init__, which forks the averager process (it inherits them)
        self.download_settings = download_settings
        self.serve_max_joiners = download_settings.serve_max_joiners
        self.applied_epoch: Optional[int] = None  # the epoch of the last download, if it was applied
        self._loading = False  # a download is being applied (host process)
        self._rejoining = False  # host process: downloading a state older than its own (load_state_from_peers)
        # The epoch the parameters really are at, while local_epoch runs ahead of them: hivemind bumps local_epoch
        # before the optimizer step that produces that epoch's parameters, and hivemind.Optimizer bumps it after a
        # download to catch up with the swarm. None: the parameters are at local_epoch.
        self._params_epoch: Optional[int] = None
        self._local_layout: Optional[Tuple[list, dict]] = None  # see _layout
        self.step_with_next_epoch = False  # host process: see LeanHiveOptimizer._round_was_whole
        self.drop_next_round = False  # host process: see step
        self._withheld: Optional[str] = None  # host process: why this peer's state is not served now (withhold_state)
        self.auxiliary_steps = 0  # host process: optimizer steps an auxiliary peer took that way
        # set in the averager process before each download (``_set_download_bound``): the epochs a downloaded state
        # may carry (None: no bound), the progress key that re-reads the consensus, the peers it may come from
        self._max_download_epoch: Optional[int] = None
        self._min_download_epoch: Optional[int] = None
        self._progress_key: Optional[str] = None
        self._only_from: Optional[FrozenSet[bytes]] = None  # peer IDs (bytes); None: any
        super().__init__(*args, **kwargs)

    def state_bytes(self) -> int:
        """The size of this peer's state as served (what a download of the same state transfers, uncompressed)."""
        layout, _ = self._layout()
        return sum(shape.numel() * torch.empty((), dtype=dtype).element_size() for shape, dtype in layout)

    def _layout(self) -> Tuple[list, dict]:
        """(shape, dtype) of every tensor of the served state, in order, and the optimizer's state_dict (structure
        and local hyper-parameters); computed once (shapes never change)."""
        if self._local_layout is None:
            params = [p for group in self.optimizer.param_groups for p in group["params"]]
            _, opt_tensors = dump_optimizer_state(self.optimizer)
            layout = [(t.shape, t.dtype) for t in chain(params, self.extra_tensors, opt_tensors)]
            self._local_layout = (layout, self.optimizer.state_dict())
        return self._local_layout

    def _check_epoch(self, metadata) -> Optional[str]:
        if not isinstance(metadata, dict):
            return "its metadata is not a dictionary"
        epoch = metadata.get("epoch")
        if not isinstance(epoch, int) or isinstance(epoch, bool) or epoch < 0:
            return f"its epoch {epoch!r} is not a non-negative integer"
        if self._max_download_epoch is not None and epoch > self._max_download_epoch:
            return f"its epoch {epoch} is beyond the swarm's consensus (at most {self._max_download_epoch})"
        if self._behind(metadata):
            return f"its epoch {epoch} is behind this peer's ({self._min_download_epoch}); it may catch up"
        return None

    def _behind(self, metadata) -> bool:
        """The state is older than this peer's: its donor is honest but a moment behind, worth asking again."""
        epoch = metadata.get("epoch") if isinstance(metadata, dict) else None
        return isinstance(epoch, int) and self._min_download_epoch is not None and epoch < self._min_download_epoch

    def check_downloaded_metadata(self, metadata) -> Optional[str]:
        """Why a state announced with ``metadata`` must not be downloaded (epoch bounds, hyper-parameters), or None:
        checked before any part of it is fetched."""
        reason = self._check_epoch(metadata)
        if reason is None:
            reason = _check_optimizer_metadata(self._layout()[1], metadata.get("optimizer_metadata"))
        return reason

    def check_downloaded_state(self, metadata, tensors) -> Optional[str]:
        """Why a downloaded state must not be applied, or None: it is checked completely before any of it is."""
        reason = self._check_epoch(metadata)
        if reason is not None:
            return reason
        layout, local_state = self._layout()
        if not isinstance(tensors, (list, tuple)) or len(tensors) != len(layout):
            return f"it has {len(tensors)} tensors, this peer's state has {len(layout)}"
        for index, (tensor, (shape, dtype)) in enumerate(zip(tensors, layout)):
            if not isinstance(tensor, torch.Tensor) or tensor.shape != shape or tensor.dtype != dtype:
                got = (tuple(tensor.shape), tensor.dtype) if isinstance(tensor, torch.Tensor) else type(tensor)
                return f"its tensor {index} is {got}, expected {(tuple(shape), dtype)}"
        if self.policy.finite_downloads_only and not _finite_floats(tensors):
            return "it has NaN/inf values"
        return _check_optimizer_metadata(local_state, metadata.get("optimizer_metadata"))

    async def _set_download_bound(
        self,
        max_epoch: Optional[int],
        min_epoch: Optional[int],
        progress_key: Optional[str],
        future: MPFuture,
        only_from: Optional[FrozenSet[bytes]] = None,
    ):
        self._max_download_epoch, self._min_download_epoch = max_epoch, min_epoch
        self._progress_key, self._only_from = progress_key, only_from
        future.set_result(None)

    def _raise_bound_to_fresh_consensus(self) -> None:
        """The swarm moved on during a long download: lift the bound to today's consensus (never lower it)."""
        if self._max_download_epoch is None or self._progress_key is None:
            return
        try:
            fresh = read_consensus_epoch(self.dht, self._progress_key)
        except Exception as e:  # the old bound stays; the state is refused and the next attempt reads again
            logger.debug("Could not read the swarm's progress: %r", e)
            return
        if fresh is not None:
            self._max_download_epoch = max(self._max_download_epoch, fresh + DOWNLOAD_EPOCH_LEAD)

    async def _load_state_from_peers(self, future, timeout: Optional[float] = None):
        """Replaces hivemind's: downloads by ``download_settings`` (each peer within a bounded time and size) and
        hands over only a state that passed ``check_downloaded_state``; None when none did."""
        loaded = None
        try:
            loaded = await self._download_checked_state()
        except Exception as e:
            logger.warning("State download failed: %r", e)
        finally:
            if not future.done():
                future.set_result(loaded)

    def _state_candidates(self) -> List[PeerID]:
        """Peers that declared their state, best first: the priority they claim is capped at the epoch bound + 1
        (above it every claim is equal: a peer cannot buy the first place with a huge or infinite priority)."""
        declared = declared_priorities(self.dht, f"{self._matchmaking.group_key_manager.prefix}.all_averagers")
        cap = math.inf if self._max_download_epoch is None else self._max_download_epoch + 1
        ranked = {}
        for peer_id, priority in declared.items():
            if self._only_from is not None and peer_id.to_bytes() not in self._only_from:
                continue
            if peer_id != self.peer_id:
                ranked[peer_id] = (min(priority, cap), random.random())  # random: the tie breaker
        return sorted(ranked, key=ranked.get, reverse=True)

    async def _download_checked_state(self):
        """The retry policy of ``StateDownloadSettings``: at most ``attempts`` peer downloads, each from the best
        peer not yet asked, the declarations read again after a pause once every peer was asked (or none was)."""
        settings = self.download_settings
        expected = self.state_bytes()
        per_peer = state_download_seconds(expected, settings.first_chunk_timeout)
        began = time.monotonic()
        deadline = began + settings.request_seconds(expected)
        asked, pauses = set(), 0
        excluded = set()  # donors that served a wrong part or state in this request: not asked again
        for attempt in range(1, settings.attempts + 1):
            candidates = [peer for peer in self._state_candidates() if peer not in asked and peer not in excluded]
            if not candidates and attempt > 1:
                await asyncio.sleep(settings.pause(pauses))
                pauses += 1
                asked.clear()
                candidates = [peer for peer in self._state_candidates() if peer not in excluded]
            if not candidates:
                logger.info("No peer declared its state for download (attempt %d of %d)", attempt, settings.attempts)
                continue
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            try:  # several donors at once, part by part (state_transfer.py)
                loaded = await self._download_in_parts(candidates, excluded, deadline)
                if loaded is not None:
                    return loaded
                logger.warning("No complete state from the donors (attempt %d of %d)", attempt, settings.attempts)
                if attempt < settings.attempts:  # busy donors may be free then; a resumed download keeps its parts
                    await asyncio.sleep(settings.pause(pauses))
                    pauses += 1
                continue
            except NoPartDonors:
                pass  # peers that serve only the whole state (hivemind's stream): one of them, as before
            except Exception as e:
                logger.warning("The download in parts failed (attempt %d of %d): %r", attempt, settings.attempts, e)
                continue
            peer = candidates[0]
            asked.add(peer)
            started = time.monotonic()
            try:
                metadata, tensors = await asyncio.wait_for(
                    self._download_from(peer, expected, settings.first_chunk_timeout),
                    timeout=min(per_peer, remaining),
                )
            except Exception as e:
                logger.warning(
                    "Could not download the state from %s (attempt %d of %d): %r", peer, attempt, settings.attempts, e
                )
                continue
            if time.monotonic() - began > BOUND_REFRESH_SECONDS:  # since the bound was set
                self._raise_bound_to_fresh_consensus()
            reason = self.check_downloaded_state(metadata, tensors)
            if reason is not None:
                logger.warning(
                    "Not applying the state from %s (attempt %d of %d): %s", peer, attempt, settings.attempts, reason
                )
                continue
            logger.info(
                "Downloaded the state (%.1f MB) from %s in %.1f s", expected / 1e6, peer, time.monotonic() - started
            )
            return metadata, tensors
        logger.warning("No peer sent a usable state in %d attempts", settings.attempts)
        return None

    async def _download_from(self, peer: PeerID, expected_bytes: int, first_chunk_timeout: float):
        """One peer's state: the first chunk within ``first_chunk_timeout``, every next one within
        ``STATE_CHUNK_TIMEOUT``, no more than the expected size (plus slack) in all."""
        layout, _ = self._layout()
        stub = self.get_stub(self._p2p, peer, namespace=self.prefix)
        stream = await asyncio.wait_for(
            stub.rpc_download_state(averaging_pb2.DownloadRequest()), timeout=first_chunk_timeout
        )
        chunk_timeout = max(STATE_CHUNK_TIMEOUT, self.next_chunk_timeout or 0.0)
        limit = int(expected_bytes * 1.25) + (1 << 20)
        metadata, parts, tensors, received = None, [], [], 0
        iterator = stream.__aiter__()
        wait = first_chunk_timeout
        try:
            while True:
                try:
                    message = await asyncio.wait_for(iterator.__anext__(), timeout=wait)
                except StopAsyncIteration:
                    break
                wait = chunk_timeout
                received += message.ByteSize()
                if received > limit:
                    raise ValueError(f"it sent more than {limit} bytes, this peer's state has {expected_bytes}")
                if message.metadata:
                    metadata = self.serializer.loads(message.metadata)
                if message.tensor_part.dtype and parts:
                    tensors.append(checked_tensor(combine_from_streaming(parts), len(tensors), layout))
                    parts = []
                parts.append(message.tensor_part)
        finally:  # an abandoned download must not keep the server sending
            await close_stream(iterator)
        if parts:
            tensors.append(checked_tensor(combine_from_streaming(parts), len(tensors), layout))
        if not metadata:
            raise ValueError("it sent no state (it does not share its state now)")
        if len(tensors) != len(layout):
            raise IncompleteStateError(
                f"the stream ended after {received} bytes with {len(tensors)} of the state's {len(layout)} tensors "
                f"(a cut connection, e.g. a relayed circuit's data limit); nothing of it was applied"
            )
        return metadata, tensors

    async def _run_allreduce_inplace_(self, *args, **kwargs):
        self.round_running.set()  # serving pauses between chunks (state_transfer.py)
        try:
            return await super()._run_allreduce_inplace_(*args, **kwargs)
        finally:
            self.round_running.clear()

    def get_current_state(self):
        """The state served to a joining peer (or an aux peer's checkpoint): one consistent snapshot, labelled
        with the epoch its parameters are really at.

        hivemind copies it under lock_averaged_tensors, which the optimizer step does not take, and on CPU its
        ``.cpu()`` returns the very tensors the step updates in place while they are being serialized. So the
        snapshot is taken under lock_optimizer (which the step holds until it has updated the epoch) and cloned.
        """
        if self._rejoining:
            raise StateWithheld("not sharing this peer's state: it is taking the swarm's (it trained apart from it)")
        withheld = self._withheld
        if withheld is not None:
            raise StateWithheld(f"not sharing this peer's state: {withheld}")
        with self.lock_optimizer:
            metadata, tensors, infos = super().get_current_state()
            tensors = [tensor.clone() for tensor in tensors]
            if self._params_epoch is not None:
                metadata["epoch"] = min(self._params_epoch, self.local_epoch)  # min: a restore may go back
        if not _finite_floats(tensors):
            # a peer whose parameters just went bad is recovering; hivemind turns this error into a failed
            # download for the asking peer, which then asks another peer
            raise StateWithheld("not sharing this peer's state: it has NaN/inf values (the peer is recovering)")
        return metadata, tensors, infos

    def step(self, *args, increment_epoch: bool = False, optimizer_step: bool = False, **kwargs):
        opts = kwargs.get("averaging_opts")
        if kwargs.get("averaging_round") and kwargs.get("averaging_control") is None and opts:
            # a round not scheduled beforehand: hivemind starts it itself, past schedule_step (see there)
            scheduled_time = self._client_scheduled_time(opts.get("timeout"))
            if scheduled_time is not None and "scheduled_time" not in opts:
                kwargs["averaging_opts"] = dict(opts, scheduled_time=scheduled_time)
        if increment_epoch and self.step_with_next_epoch:
            # an auxiliary peer that holds the round's result (LeanHiveOptimizer._round_was_whole)
            optimizer_step, self.step_with_next_epoch = True, False
            self.auxiliary_steps += 1
        if increment_epoch and self.drop_next_round:
            # --sync_mode local, a round this trainer missed (LeanHiveOptimizer._missed): no outer step,
            # and the model goes back to the shared parameters the round started from
            self.drop_next_round, optimizer_step = False, False
            with self.lock_optimizer:  # trainers always offload (peer.swarm.optimizer); hivemind asserts it here
                self._apply_optimizer_parameters_()
                # the shared parameters are the next epoch's too (no outer step will make others): a state served
                # kept the label of the last download, and a joiner refuted this peer's epoch as a lie, ignored it
                # for 60 s and stepped alone (the local pair test on a busy machine, 0.7 to 11.5 apart)
                self._params_epoch = None
                # ...unless the others made the round: then these are the round's start, one outer step behind the
                # others' state of the same epoch, and a joiner that counted this peer among its donors found their
                # states different and took one donor's (the home test-bed, issue 30). The round agreement tells;
                # the trainer serves again once it has followed it (peer.strategies.LocalTraining.end_epoch).
                self.withhold_state("it dropped its last round; its round agreement tells whether the others made it")
            kwargs = self._without_state_round(kwargs)
        if increment_epoch and optimizer_step and self._params_epoch is None:
            self._params_epoch = self.local_epoch  # until _update_scheduler, after the step, under lock_optimizer
        return super().step(*args, increment_epoch=increment_epoch, optimizer_step=optimizer_step, **kwargs)

    def withhold_state(self, reason: str) -> None:
        """Serve no state (joiners, aux checkpoints) until ``serve_state_again``: this peer's state may not be the
        swarm's of its epoch (``reason`` says why; joiners are told ``withheld`` and ask again or ask others)."""
        self._withheld = reason

    def serve_state_again(self) -> None:
        self._withheld = None

    @staticmethod
    def _without_state_round(kwargs: dict) -> dict:
        """hivemind's step arguments without the state averaging round after a dropped round: the peers this one
        found no group with would not be in it either, and it waited out a second window for them. Two peers whose
        rounds began half an epoch apart (one downloaded the state while the other ended a round) so searched,
        each, for its gradient round while the other searched for its state round, both windows as long, and kept
        that offset for the whole run (the aux checkpoint test, trainer variant, at 39f204a: no round averaged in 2 of 2
        runs)."""
        cancel_if_pending(kwargs.get("averaging_control"))  # pre-scheduled: its group would wait for this peer's data
        return dict(kwargs, averaging_round=False, averaging_control=None, averaging_opts=None)

    def parameters_replaced(self, epoch: int) -> None:
        """The parameters and statistics were just replaced by a state of ``epoch`` (a checkpoint, a backup)."""
        self.local_epoch = epoch
        self._params_epoch = None
        self._withheld = None

    def load_state_from_peers(
        self,
        *,
        max_epoch: Optional[int] = None,
        min_epoch: Optional[int] = None,
        progress_key: Optional[str] = None,
        only_from: Optional[FrozenSet[bytes]] = None,
        **kwargs,
    ):
        """hivemind's download and apply, by ``download_settings``, with ``max_epoch`` (the swarm's consensus allows
        no later state) and ``min_epoch`` (default: this peer's epoch), only from the peers ``only_from`` if given,
        and a wait as long as the request may take (hivemind waited load_state_timeout and left the transfer
        running)."""
        self.applied_epoch, self._loading = None, True
        bound = MPFuture()
        self._outer_pipe.send(
            (
                "_set_download_bound",
                [],
                dict(
                    max_epoch=max_epoch,
                    # hivemind refuses an older state: the next peer is asked instead
                    min_epoch=self.local_epoch if min_epoch is None else min_epoch,
                    progress_key=progress_key,
                    future=bound,
                    only_from=only_from,
                ),
            )
        )
        bound.result(timeout=30)
        kwargs["timeout"] = self.download_settings.request_seconds(self.state_bytes()) + 30
        own_epoch = self.local_epoch
        if min_epoch is not None and min_epoch < own_epoch:
            # hivemind refuses a state older than local_epoch; meanwhile this peer's state, labelled with the older
            # epoch, must reach nobody (get_current_state)
            self._rejoining, self.local_epoch = True, min_epoch
        try:
            return super().load_state_from_peers(**kwargs)
        finally:
            self._loading = False
            if self._rejoining:
                self._rejoining = False
                if self.applied_epoch is None:
                    self.local_epoch = own_epoch

    def _update_scheduler(self):
        # TrainingStateAverager calls this right after applying a downloaded state (the one exact sign that the
        # download was applied, not refused as stale or malformed), and after each optimizer step
        if self._loading:
            self.applied_epoch = self.local_epoch
            self._params_epoch = self.local_epoch  # hivemind.Optimizer may bump local_epoch right after
            self._withheld = None  # the state is now the one the swarm served
        else:
            self._params_epoch = None
        if self.scheduler is not None and self.scheduler._step_count > self.local_epoch + 1:
            # a trainer apart from the swarm took the consensus state, of an earlier epoch (hivemind's loop below only
            # steps forward): the schedule goes back with it, as a LambdaLR at that epoch would be
            self.scheduler.last_epoch, self.scheduler._step_count = self.local_epoch - 1, self.local_epoch
            self.scheduler.step()
        super()._update_scheduler()

    def state_arrived(self) -> bool:
        """True if the last download delivered a state and it was applied (hivemind.Optimizer may then
        advance local_epoch by one more to catch up with the swarm; that still counts)."""
        return self.applied_epoch is not None


class LeanHiveGradientAverager(RoundResultSharing, _PolicyAveraging, GradientAverager):
    """GradientAverager that applies ``policy`` (allowlist for its RPCs, bounded contributions, bounded two-peer
    rounds); every peer of a round takes the same averaged gradients (``BoundedAllReduceRunner``'s ``same_result``),
    so peers that hold the same state take the same step, and a trainer that missed a round takes its result from
    peers that took it (``RoundResultSharing``, round_result.py)."""

    _bound_two_peer_rounds = True
    _same_result = True


class PseudoGradientAverager(LeanHiveGradientAverager):
    """The all-reduce of ``--sync_mode local`` (DiLoCo): averages pseudo-gradients instead of accumulated gradients.

    hivemind.Optimizer drives it exactly like a gradient averager: each local step only counts its samples (the
    trainer has already stepped its own inner optimizer on the model's parameters); when the round begins, the
    pseudo-gradient ``shared - local`` (the offloaded parameters the outer optimizer owns, i.e. the shared
    parameters at the start of the round, minus the model's parameters after the local steps) is written into the
    averaged tensors, all-reduced with the same policy as gradients (allowlist, robust aggregation, weight = the
    samples of the round) and, through the buffers hivemind links to the outer optimizer's ``.grad``, stepped.
    Its prefix is ``<run_id>_outer_averager``, so peers of the two modes never meet in one all-reduce, and its group
    key names the round's epoch (``key_epoch``, matchmaking.py), so peers of two rounds never meet either."""

    _bound_two_peer_rounds = False
    _same_result = False  # not measured in local mode yet; its round agreement (peer.swarm.agreement) repairs drift
    _others_data_needed = True
    # The two-peer bound of gradients (``bound_two_peer_update``) bounds each receiver by its own contribution, so
    # the two peers of a round apply different results: harmless for one gradient step, but here it leaves their
    # shared parameters apart (the mode's invariant is that every peer holds the same ones), even after honest
    # two-peer rounds. With two contributors no rule can tell the faulty one; with three or more the
    # reducer's bounded_mean applies, and it gives every receiver the same result.

    def __init__(self, parameters, *, run_id: str, prefix: Optional[str] = None, **kwargs):
        del prefix  # hivemind's gradient prefix: this averager has its own
        kwargs["reuse_grad_buffers"] = True  # nothing is accumulated: no second copy of the gradients
        self.key_epoch = mp.Value("q", -1)  # before hivemind's __init__ forks the averager process
        self.other_trainers = mp.Value("q", 0)
        """How many other trainers train now (``LeanHiveProgressTracker.other_live_trainers``), set by the host
        before each round: a group without any of them fails (``_others_data_needed``)."""
        super().__init__(parameters, prefix=outer_averager_prefix(run_id), **kwargs)
        self.shared_parameters: Optional[Tuple[torch.Tensor, ...]] = None  # set by LeanHiveOptimizer

    @torch.no_grad()
    def load_accumulators_into_averager_(self):
        assert self.shared_parameters is not None, "the optimizer links the shared parameters after construction"
        with self.get_tensors() as averaged:
            for shared, local, out in zip(self.shared_parameters, self.parameters, averaged):
                torch.sub(shared, local.detach().to(shared.device, shared.dtype), out=out)


class LeanHiveOptimizer(hivemind.Optimizer):
    """hivemind.Optimizer with a state averager that can tell whether a state download succeeded (and, with a
    ``PseudoGradientAverager``, the outer loop of ``--sync_mode local``: the wrapped optimizer is then the outer
    optimizer of the shared parameters)."""

    def __init__(
        self,
        *args,
        policy: AveragingPolicy = AveragingPolicy(),
        download_settings: StateDownloadSettings = StateDownloadSettings(),
        assisting_peers: Callable[[], Sequence[PeerID]] = tuple,
        **kwargs,
    ):
        # read by _make_state_averager, which hivemind.Optimizer.__init__ calls
        self.policy, self.download_settings = policy, download_settings
        self.assisting_peers = assisting_peers
        """The aux peers that assist in averaging (their signed reachability records): asked for a missed round's
        result where none of the peers that declared their state holds it (``_assisting_peers``)."""
        self._assisting: Optional[Tuple[float, List[PeerID]]] = None
        self.missed_round = False
        """The last all-reduce of a trainer failed while other peers were online and no peer gave it the round's
        result (round_result.py), so hivemind stepped with its fallback: in sync mode the accumulators, which the
        round's start already reset (zero gradients), in local mode this peer's own pseudo-gradient. Its parameters
        and optimizer statistics left the swarm's. The trainer re-syncs (peer.strategies.resync_after_missed_round):
        in local mode a whole round's divergence; in sync mode one step's, whose gap LAMB's statistics keep for many
        epochs (0.02-0.1 on the home testbed with the tiny preset, against a tolerance of 0.01)."""
        self._whole_results_seen = 0  # the gradient averager's whole_results when this peer last looked
        self.repaired_rounds = 0
        """Rounds this trainer missed and took the result of from peers that took them (round_result.py)."""
        self._downloaded_at: Optional[int] = None  # the epoch of the last state downloaded from the swarm
        self.last_download_seconds: Optional[float] = None
        """Wall-clock seconds the last applied state download took, its wait for the donor's snapshot included."""
        self.state_loads = 0
        """How many times this peer's state was replaced (downloads applied, checkpoints or backups loaded): the
        round agreement of --sync_mode local lets a peer whose state was replaced during a round follow, not vote."""
        super().__init__(*args, load_state_timeout=download_settings.first_chunk_timeout, **kwargs)
        # sync mode only: local mode's group keys name the round's epoch, so an aux behind catches up by failing
        # rounds, one right after the other (LeanHiveProgressTracker._swarm_epoch_ending)
        self.tracker.rounds_follow_trainers_epoch = self.auxiliary and not self.local_updates
        self.round_wait = RoundWait(self.averaging_timeout)
        if isinstance(self.grad_averager, PseudoGradientAverager):
            self.grad_averager.shared_parameters = tuple(
                param for group in self.state_averager.optimizer.param_groups for param in group["params"]
            )

    @property
    def local_updates(self) -> bool:
        """True in ``--sync_mode local``: the trainer steps its inner optimizer, this one runs the outer loop."""
        return isinstance(self.grad_averager, PseudoGradientAverager)

    def _load_local_gradients_into_optimizer(self):
        if not self.auxiliary and (self.tracker.global_progress.num_peers > 1 or self._just_downloaded()):
            self._missed()
        super()._load_local_gradients_into_optimizer()

    def _missed(self) -> None:
        """This trainer's all-reduce failed while other peers were online (``missed_round``). In local mode the
        round is dropped (``state_averager.drop_next_round``): no outer step with this peer's pseudo-gradient alone,
        and the model goes back to the round's shared parameters. Peers that all missed a round (two peers that
        found no group) so keep equal shared parameters without a download: each used to step alone and download
        the other's state, and those downloads (seconds each, longer than a round of the tiny preset) made each one
        late for the other's next round, so two peers could miss every round of a run. A peer whose others made
        the round is one outer step behind them; its round agreement sees that and downloads (peer.swarm.agreement).
        The round's local steps are lost, as they were when the download replaced them."""
        self.missed_round = True
        if self.local_updates:
            self.state_averager.drop_next_round = True

    def _maybe_schedule_gradient_averaging(self) -> None:
        self._name_round()
        super()._maybe_schedule_gradient_averaging()

    def _name_round(self) -> None:
        """The epoch of the round this peer averages next goes into its group key (local mode, matchmaking.py) and
        into what it gathers in matchmaking (sync mode, ``RoundResultSharing.round_label``); set before hivemind
        pre-schedules the round's matchmaking and again when the round begins."""
        key_epoch = getattr(self.grad_averager, "key_epoch", None)
        if key_epoch is not None:
            key_epoch.value = self.local_epoch
        if hasattr(self.grad_averager, "round_label"):
            self.grad_averager.round_label = self.local_epoch

    def _begin_averaging_gradients(self, grad_scaler) -> bool:
        self._name_round()
        other_trainers = getattr(self.grad_averager, "other_trainers", None)
        if other_trainers is not None and not self.auxiliary:
            # right after a download a peer's tracker may not list the trainer that served it yet: a client's first
            # round with an assisting aux alone was taken that way while the trainer dropped it
            other_trainers.value = max(self.tracker.other_live_trainers(), int(self._just_downloaded()))
        if self.local_updates and not self.auxiliary and self.local_epoch < self.tracker.global_epoch:
            self._skip_round_already_over()
            return False
        averager = self.grad_averager
        round_epoch = getattr(averager, "round_epoch", None)
        if round_epoch is not None:  # the round this epoch's result belongs to (round_result.py)
            round_epoch.value = self.local_epoch
        if not self.auxiliary and self.tracker.global_progress.num_peers <= 1:
            # hivemind steps with this peer's own gradients: no other peer reports progress
            if cancel_if_pending(self.scheduled_grads):
                self.scheduled_grads = None
            stepping_alone = getattr(averager, "stepping_alone", None)
            if stepping_alone is not None and not self._just_downloaded():
                stepping_alone()  # the swarm's step of this epoch: served to peers that missed it
        began = super()._begin_averaging_gradients(grad_scaler)
        if not began and not self.auxiliary and self._just_downloaded():
            # hivemind saw no other peer and steps with this peer's gradients alone; right after a download the
            # tracker may not list the donors yet (a home joiner stepped its first epoch "alone" that way and stayed
            # 0.01 apart from the swarm for the rest of the run)
            self._missed()
        return began

    def _skip_round_already_over(self) -> None:
        """Local mode, a trainer one epoch behind: hivemind lets it end its round (in sync mode its gradients still
        count toward the next step), but the others ended this round already, and a pseudo-gradient of it averages
        with nobody now: it waited out a whole matchmaking window for nothing, or met the others' next round (both
        applied the same average to different rounds). It drops the round at once, as one it missed; its round
        agreement then downloads the state if the others stepped (peer.strategies.LocalTraining.end_epoch)."""
        cancel_if_pending(self.scheduled_grads)
        self.scheduled_grads = None
        logger.info(
            "The swarm ended the round of epoch %d without this peer (it is at epoch %d): dropping it",
            self.local_epoch,
            self.tracker.global_epoch,
        )
        self._missed()

    def _just_downloaded(self) -> bool:
        return self._downloaded_at is not None and self.local_epoch <= self._downloaded_at + 1

    def _should_load_state_from_peers(self) -> bool:
        if self._takes_round_of_downloaded_epoch():
            return False
        return super()._should_load_state_from_peers()

    def _takes_round_of_downloaded_epoch(self) -> bool:
        """Sync mode: a trainer whose state of epoch E arrived just as the others ended round E takes that round's
        result from them (it comes late for the round: ``_leave_round_taken_without_this_peer``), one optimizer step
        like theirs, instead of downloading the whole state again. hivemind asks for its exact epoch once per step
        and downloads again; a home joiner's download (a few seconds, with the wait for the donors' snapshots) took
        about as long as an epoch of the tiny preset, so it downloaded five times in a row, one local step each, and
        missed the first 8 rounds after it joined (home testbed b). If the round's result cannot be had, the round
        fails as a missed one and the trainer downloads then (peer.strategies). Not while its tracker lists no other
        peer (right after a download it may not list the donors yet): hivemind would begin no round and step with
        this peer's gradients alone, which set two home joiners 0.018 apart from the swarm for the rest of a run."""
        return (
            not self.auxiliary
            and not self.local_updates
            and getattr(self.grad_averager, "shares_round_results", False)
            and self._downloaded_at == self.local_epoch
            and self.local_epoch == self.tracker.global_epoch - 1
            and self.tracker.global_progress.num_peers > 1
        )

    def __del__(self):
        try:  # see _PolicyAveraging.__del__
            super().__del__()
        except AttributeError:
            pass

    def _average_gradients_and_load_into_optimizer(self, maybe_step_control):
        # this peer's serving of its state yields to the round (state_transfer.py)
        round_running = getattr(getattr(self, "state_averager", None), "round_running", None)
        if round_running is not None:
            round_running.set()
        try:
            with timed_phase("grad_wait"):  # for the phase observers (timing.py)
                self._wait_for_gradients(maybe_step_control)
        finally:
            if round_running is not None:
                round_running.clear()
        if maybe_step_control is not None:  # None: hivemind saw no other peer to average with
            report_round(*round_outcome(maybe_step_control))

    def _wait_for_gradients(self, maybe_step_control) -> None:
        """hivemind's ``_average_gradients_and_load_into_optimizer``, waiting ``round_wait.seconds()`` (what the
        link carries, peer.swarm.round_wait) instead of ``averaging_timeout``."""
        averaged_gradients = False
        try:
            if maybe_step_control is not None:
                self.round_wait.watch(maybe_step_control)
                self._leave_round_taken_without_this_peer(maybe_step_control)
                group_info = maybe_step_control.result(self.round_wait.seconds())
                logger.log(self.status_loglevel, f"Averaged gradients with {len(group_info)} peers")
                took_whole = self._round_was_whole()
                unconfirmed = took_whole and bool(
                    getattr(self.grad_averager, "unconfirmed", None) and self.grad_averager.unconfirmed.value
                )
                if (unconfirmed or not took_whole) and not self.auxiliary:
                    # some parts kept this peer's own values (a reducer failed), or its group had no other data (it
                    # came late, and an assisting aux led a second group) or no serving trainer: the serving
                    # trainers' round is the swarm's
                    self._repair_from_round_result(outside_group=unconfirmed)
                self._load_averaged_gradients_into_optimizer_()
                averaged_gradients = True
                if self.auxiliary and took_whole:
                    self.state_averager.step_with_next_epoch = True  # see _round_was_whole
            else:
                logger.log(self.status_loglevel, "Skipped averaging: there are no other peers")
        except BaseException as e:
            logger.log(self.status_loglevel, f"Averaging gradients failed with {repr(e)}")
        if averaged_gradients:
            return
        if maybe_step_control is not None:  # hivemind began a round, which ended without a result
            round_failed = getattr(self.grad_averager, "round_failed", None)
            if round_failed is not None:
                round_failed()
            if self._repair_from_round_result():
                self._load_averaged_gradients_into_optimizer_()
                return
        self._load_local_gradients_into_optimizer()

    def _leave_round_taken_without_this_peer(self, control: StepControl) -> None:
        """Sync mode: a trainer whose epoch ended while it still looked for a group asks the peers that may take the
        round whether they hold its result (``round_ended_without_this_peer``), every ``PROBE_EVERY`` s until its own
        group forms. If one does and none begins that round next, the round ended without this peer, which can no
        longer join it: it cancels its matchmaking at once and takes the round's result from them
        (``_repair_from_round_result``, as after a failed round) instead of waiting out its matchmaking window. A
        group that merely formed does not count: its all-reduce can break off and look for a group again, which this
        peer may then join. On the home testbed (b) a volunteer that came late once waited out that window (3 s) and
        its repair, reached its next epoch's end after the others had formed the next group, and so on: 11 of 25
        rounds, one local step per epoch."""
        averager = self.grad_averager
        if self.auxiliary or self.local_updates or not getattr(averager, "shares_round_results", False):
            return
        epoch = averager.round_epoch.value
        candidates = None
        while control.stage == AveragingStage.LOOKING_FOR_GROUP and not control.done():
            if get_dht_time() + PROBE_TIMEOUT >= control.deadline:
                return  # hivemind's own deadline comes first
            candidates = self._round_result_candidates(epoch) if candidates is None else candidates
            if not candidates:
                return
            if averager.round_ended_without_this_peer(epoch=epoch, candidates=candidates, timeout=PROBE_TIMEOUT):
                if control.stage == AveragingStage.LOOKING_FOR_GROUP and not control.done():
                    cancel_step(control)
                    logger.info(
                        "Came late for round %d: the others took it without this peer; taking its result from them",
                        epoch,
                    )
                return
            logger.debug("Round %d: no group yet for this peer, and no other peer holds its result", epoch)
            time.sleep(PROBE_EVERY)

    def _repair_from_round_result(self, outside_group: bool = False) -> bool:
        """A trainer whose round failed (or kept some of its own values) while other peers took the round's whole
        result takes that result from them (round_result.py); True if it did: the averaged tensors then hold it."""
        averager = self.grad_averager
        if self.auxiliary or not getattr(averager, "shares_round_results", False) or not averager.local_norm:
            return False
        epoch = averager.round_epoch.value
        result_bytes = sum(t.numel() * t.element_size() for t in averager.parameters)
        began = time.monotonic()
        deadline = began + fetch_seconds(self.averaging_timeout, result_bytes)
        # the serving trainers' round is the swarm's: the assisting aux only where none of them holds it. Asked
        # together, an aux that took the round with clients in one group and a trainer that took it in another gave
        # two answers that differ, and a volunteer that came late took neither (home testbed b)
        used = self._fetch_round_result(self._round_result_candidates(epoch), deadline, outside_group)
        if not used:
            used = self._fetch_round_result(self._assisting_peers(), deadline, outside_group)
        if not used:
            return False
        self.repaired_rounds += 1
        logger.info(
            "Missed round %d: took its averaged gradients from %d peer(s) that took it, in %.1f s: %s",
            epoch,
            len(used),
            time.monotonic() - began,
            ", ".join(map(str, used)),
        )
        if averager.result_epoch.value == epoch + 1 and self.tracker.global_epoch > self.local_epoch:
            # it holds the others' round of the next epoch (round_result.py): this peer took every round so far, one
            # label early. Left so, it came to each epoch's end after the others' round and waited the whole next
            # epoch for it, one local step per epoch (home testbed b: compute share 0.02 to 0.06 for 15 epochs on end).
            # Only where the serving trainers' progress records say so too: an answer alone moves no epoch
            with self.state_averager.lock_optimizer:
                self.state_averager.local_epoch += 1
            logger.info("It was the swarm's round %d: this peer's epoch is now the swarm's", epoch + 1)
        return True

    def _fetch_round_result(self, candidates: Sequence[PeerID], deadline: float, outside_group: bool):
        """The peers whose answers gave this round's result, now in the averaged tensors (round_result.py), or None
        (nobody to ask, no time left, or no usable answer)."""
        averager = self.grad_averager
        remaining = deadline - time.monotonic()
        if not candidates or remaining < MIN_FETCH_SECONDS:
            return None
        return averager.fetch_round_result(
            epoch=averager.round_epoch.value,
            candidates=candidates,
            max_norm=NORM_FACTOR * averager.local_norm,
            timeout=remaining,
            outside_group=outside_group,
        )

    def _round_result_candidates(self, epoch: int) -> List[PeerID]:
        """Reachable peers (they declared their state for download) at ``epoch - 1`` or later: the ones that may
        have taken round ``epoch`` (a declaration can lag the peer's epoch by one; a peer without the round answers
        at once)."""
        declared = declared_priorities(self.dht, f"{self.state_averager.prefix}.all_averagers")
        own = self.dht.peer_id
        return [peer for peer, priority in declared.items() if priority >= epoch - 1 and peer != own]

    def _assisting_peers(self) -> List[PeerID]:
        """The assisting aux peers (``assisting_peers()``, read again at most every ``ASSISTING_REFRESH`` s): asked for
        a missed round's result where no serving trainer holds it. They declare no state while a trainer serves one,
        but take every round of client trainers: a public trainer that missed a round the aux took with clients alone
        (who cannot be dialled) had nobody to ask, stepped apart and stayed 0.02 from them (home testbed b)."""
        now = time.monotonic()
        if self._assisting is None or now - self._assisting[0] >= ASSISTING_REFRESH:
            self._assisting = (now, list(self.assisting_peers()))
        return self._assisting[1]

    def _round_was_whole(self) -> bool:
        """Whether this round's whole result is in the averaged tensors (``whole_results`` moved).

        An auxiliary peer that took it then takes the optimizer step that ends this epoch, as every trainer of the
        round does: hivemind 1.1.12 runs an auxiliary averager in the all-reduce as a zero-weight sender, which
        receives the result like every other sender (with ``same_result``, the very bits the trainers take), but
        hivemind's auxiliary peers never step, so the state they serve kept its statistics from the last download
        (or from the start, for an aux that anchors a swarm of client trainers)."""
        whole = getattr(self.grad_averager, "whole_results", None)
        if whole is None or whole.value == self._whole_results_seen:
            return False
        self._whole_results_seen = whole.value
        return True

    def _make_progress_tracker(self, target_batch_size: int, **kwargs) -> ProgressTracker:
        tracker = LeanHiveProgressTracker(
            dht=self.dht,
            prefix=self.run_id,
            target_batch_size=target_batch_size,
            client_mode=self.client_mode,
            status_loglevel=self.status_loglevel,
            start=True,
            **kwargs,
        )
        tracker.votes_own_epoch = not self.auxiliary
        return tracker

    def _make_state_averager(self, **kwargs) -> TrainingStateAverager:
        return LeanHiveStateAverager(
            dht=self.dht,
            prefix=state_averager_prefix(self.run_id),
            min_matchmaking_time=self.matchmaking_time,
            allreduce_timeout=self.allreduce_timeout,
            shutdown_timeout=self.shutdown_timeout,
            offload_optimizer=self.offload_optimizer,
            custom_gradients=self.offload_optimizer,
            status_loglevel=self.status_loglevel,
            next_chunk_timeout=self.next_chunk_timeout,
            client_mode=self.client_mode,
            auxiliary=self.auxiliary,
            start=True,
            policy=self.policy,
            download_settings=self.download_settings,
            **kwargs,
        )

    def load_state_dict(self, state_dict: dict):
        super().load_state_dict(state_dict)
        self.state_averager.parameters_replaced(self.local_epoch)
        self.state_loads += 1

    def load_state_from_peers(
        self, only_from: Optional[FrozenSet[bytes]] = None, rejoin_epoch: Optional[int] = None, **kwargs
    ):
        """hivemind.Optimizer's, as one request by ``download_settings`` (hivemind retried ``while True``, so a peer
        that always failed kept this one downloading forever), with the epoch bound of the swarm's consensus;
        ``only_from``: download only from these peers (IDs as bytes); ``rejoin_epoch``: this trainer is apart from
        the swarm, beyond its consensus (``LeanHiveProgressTracker.apart_from_swarm``): take a state of about that
        epoch, older than its own."""
        if self.scheduled_grads is not None and not self.scheduled_grads.done():
            self._tag_along_with_zero_weight(self.scheduled_grads)
            self.scheduled_grads = None
        self.state_averager.step(wait_for_delayed_updates=True)

        began = time.monotonic()
        with self.tracker.pause_updates():
            # a state is labelled with its parameters' epoch: never far beyond the swarm's consensus (the tracker's
            # view may lag a few fast epochs behind a peer that serves its state)
            max_epoch, min_epoch = download_epoch_bound(self.tracker, self.local_epoch), None
            if rejoin_epoch is not None:
                max_epoch = rejoin_epoch + DOWNLOAD_EPOCH_LEAD
                min_epoch = max(0, rejoin_epoch - MAX_EPOCH_LEAD)
            try:
                self.state_averager.load_state_from_peers(
                    max_epoch=max_epoch,
                    min_epoch=min_epoch,
                    progress_key=self.tracker.training_progress_key,
                    only_from=only_from,
                    **kwargs,
                )
            except KeyboardInterrupt:
                raise
            except Exception as e:
                logger.warning("Failed to load the state from peers: %r", e)
            if self.state_averager.state_arrived():
                self.state_loads += 1
                self._downloaded_at = self.local_epoch
                self.last_download_seconds = time.monotonic() - began
                feedback = getattr(self.grad_averager, "feedback", None)
                if feedback is not None:  # --outer_compression sparse: reset, not the donor's (see sparse_wire)
                    feedback.reset()
                if isinstance(self.tracker, LeanHiveProgressTracker):
                    if rejoin_epoch is not None:  # the swarm's epoch is no longer this peer's old, later one
                        self.tracker.report_local_progress(local_epoch=self.local_epoch, samples_accumulated=0)
                        self.tracker.reestimate()
                    # a peer that claimed an epoch no served state has is not followed again (one download, not
                    # one per step)
                    self.tracker.refute_claims_above(self.local_epoch)

            if (
                self.tracker.global_epoch - 1 <= self.local_epoch < self.tracker.global_epoch
                and not self.local_updates
                and not (self.state_averager.state_arrived() and self._takes_round_of_downloaded_epoch())
            ):
                # (not in local mode: the label would name a round these parameters have not taken; its next round
                # is dropped at once instead, _skip_round_already_over, and the round agreement downloads the state
                # of the peers that took it. Nor where this peer takes that round's result instead:
                # _takes_round_of_downloaded_epoch)
                logger.log(self.status_loglevel, f"Catching up with collaboration step {self.tracker.global_epoch}")
                self.state_averager.local_epoch = self.tracker.global_epoch

            self.tracker.report_local_progress(local_epoch=self.local_epoch, samples_accumulated=0)

            if not self.client_mode:
                self.state_averager.state_sharing_priority = self.local_epoch

            if self.use_gradient_averaging:
                self.grad_averager.reset_accumulated_grads_()
                if not self.client_mode:
                    self.grad_averager.state_sharing_priority = self.local_epoch

    def load_state_checked(
        self, only_from: Optional[FrozenSet[bytes]] = None, rejoin_epoch: Optional[int] = None
    ) -> bool:
        """Download the swarm's state (only from ``only_from`` if given; ``rejoin_epoch``: see
        ``load_state_from_peers``); True only if a peer answered and the state was applied."""
        self.load_state_from_peers(only_from=only_from, rejoin_epoch=rejoin_epoch)
        return self.state_averager.state_arrived()


def cancel_step(control: StepControl) -> None:
    """Cancel a pre-scheduled round that was not triggered, the step itself first. hivemind's ``StepControl.cancel``
    tells the averager process (cancels the trigger, sets the cancel notice) before it marks the step cancelled; an
    averager that read the step between the two went on with its matchmaking, and when a group formed it found the
    trigger done (cancelled) and ran the all-reduce with this peer's stale averaged tensors. On the home testbed a
    public trainer that saw no other peer yet stepped alone while its cancelled round ran with two volunteers who had
    just joined: one of them stepped with that mix and stayed 0.02 apart to the end of the run."""
    MPFuture.cancel(control)
    control.cancel()  # hivemind's: the trigger, then the averager's notice


def cancel_if_pending(control: Optional[StepControl]) -> bool:
    """``cancel_step`` for a pre-scheduled round that is still pending (not done, not triggered); True if cancelled."""
    if control is None or control.done() or control.triggered:
        return False
    cancel_step(control)
    return True


def download_epoch_bound(tracker: ProgressTracker, local_epoch: int) -> Optional[int]:
    """The highest epoch a downloaded state may carry: the swarm's consensus (a median, not the maximum) plus
    ``DOWNLOAD_EPOCH_LEAD`` (the tracker's view may lag a few fast epochs behind the peer that serves); this peer's
    own epoch counts when it is ahead (a state far beyond what this peer already had from the swarm is refused even
    when no other peer reports). None only for a fresh peer (epoch 0) that sees no progress at all: with nothing to
    compare with (e.g. an aux serving a resumed checkpoint), any epoch may be the swarm's."""
    consensus = getattr(tracker, "consensus_epoch", None)
    if consensus is None and local_epoch == 0:
        return None
    return max(local_epoch, consensus or 0) + DOWNLOAD_EPOCH_LEAD


@torch.no_grad()
def sync_offloaded_parameters(optimizer: LeanHiveOptimizer) -> None:
    """After changing the model's parameters in place, copy them into hivemind's offloaded copies."""
    averager = optimizer.state_averager
    offloaded = [param for group in averager.optimizer.param_groups for param in group["params"]]
    for main, copy in zip(averager.main_parameters, offloaded):
        if main is not copy:
            copy.copy_(main.detach().to(copy.device, copy.dtype))
    if not averager.reuse_tensors:
        averager._load_local_tensors_into_averager_()  # what hivemind itself does after loading a state
    averager._update_scheduler()
