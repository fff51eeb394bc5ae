"""hivemind's averaging side: the policy-applying averagers, the bounded all-reduce, the optimizer.
See the package docstring for why each exists."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import FrozenSet, List, Optional, Sequence

import hivemind
import torch
from hivemind.averaging.allreduce import AllReduceRunner, AveragingMode
from hivemind.averaging.partition import TensorPartReducer
from hivemind.optim.grad_averager import GradientAverager
from hivemind.optim.progress_tracker import ProgressTracker
from hivemind.optim.state_averager import TrainingStateAverager
from hivemind.utils import get_dht_time
from hivemind.utils.asyncio import as_aiter, azip

from peer.swarm.hivemind_seam.progress import LeanHiveProgressTracker
from peer.swarm.keys import state_averager_prefix
from peer.swarm.robust import DEFAULT_CLIP_FACTOR, bounded_mean, keep_local_where_not_finite
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
            self.accumulator = _PartCollector(self.clip_factor)


class _PartCollector:
    """Takes the place of TensorPartReducer's running sum: keeps every sender's part, aggregates in ``div_``."""

    def __init__(self, clip_factor: float):
        self.clip_factor = clip_factor
        self.parts: List[torch.Tensor] = []
        self.weights: List[float] = []

    def add_(self, tensor: torch.Tensor, alpha: float = 1.0) -> "_PartCollector":
        self.parts.append(tensor.detach().to(torch.float32, copy=True))
        self.weights.append(float(alpha))
        return self

    def div_(self, _denominator: float) -> torch.Tensor:
        return bounded_mean(self.parts, self.weights, self.clip_factor)


class BoundedAllReduceRunner(AllReduceRunner):
    def __init__(self, *, clip_factor: float, **kwargs):
        super().__init__(**kwargs)
        unused = self.tensor_part_reducer
        unused.finished.set()  # it never ran: no "received 0% of input tensors" warning when it is collected
        self.tensor_part_reducer = BoundedPartReducer(unused.part_shapes, unused.num_senders, clip_factor=clip_factor)


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


class _PolicyAveraging:
    """What both averager classes share: they are built with an ``AveragingPolicy`` and apply it to their RPCs and
    all-reduce rounds. The first base of each (one level; nothing is injected below hivemind's classes)."""

    def __init__(self, *args, policy: AveragingPolicy = AveragingPolicy(), **kwargs):
        self.policy = policy  # before hivemind's __init__, which forks the averager process
        super().__init__(*args, **kwargs)

    def __del__(self):
        try:  # hivemind's __del__ assumes a finished constructor (see the module docstring)
            super().__del__()
        except AttributeError:
            pass

    async def add_p2p_handlers(self, p2p, wrapper=None, *, namespace=None, balanced=False):
        allowed = self.policy.authorized_peers
        if allowed is not None and wrapper is None:
            wrapper = _AllowlistServicer(self, allowed)
        return await super().add_p2p_handlers(p2p, wrapper, namespace=namespace, balanced=balanced)

    async def _run_allreduce_inplace_(
        self, tensors: Sequence[torch.Tensor], group_info, group_id: Optional[bytes] = None, **kwargs
    ):
        """hivemind's DecentralizedAverager._run_allreduce_inplace_ with the bounded runner and a finiteness check."""
        group_id = group_info.group_id if group_id is None else group_id
        runner = BoundedAllReduceRunner(
            clip_factor=self.policy.contribution_clip,
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

        if runner.modes[group_info.peer_ids.index(self.peer_id)] != AveragingMode.AUX:
            received = refused = 0
            async for tensor, update in azip(as_aiter(*tensors), runner):
                received += 1
                self._on_averaged_tensor(received)
                refused += keep_local_where_not_finite(update)
                tensor.add_(update, alpha=self._averaging_alpha)
                self.last_updated = get_dht_time()
                self._state_updated.set()
            if refused:
                logger.warning("Averaging: received %d NaN/inf averaged values; kept the local values there", refused)
        else:
            async for _ in runner:
                raise ValueError("aux peers should not receive averaged tensors")

    def _on_averaged_tensor(self, received: int) -> None:
        """Called in the averager process for each averaged tensor received (counted from 1 in each round); an
        extension point for the tests' fault entry point, nothing to do here."""


def _finite_floats(tensors) -> bool:
    return all_finite(t for t in tensors if t.is_floating_point())  # 8-bit codes are always finite


class _Outcome:
    """Stands in for the MPFuture hivemind's download loop reports to, so the result can be checked first."""

    def __init__(self):
        self.result = None
        self._done = False

    def set_result(self, result) -> None:
        self.result, self._done = result, True

    def done(self) -> bool:
        return self._done


class LeanHiveStateAverager(_PolicyAveraging, TrainingStateAverager):
    """TrainingStateAverager that can tell whether a state download was applied (hivemind returns quietly when
    nobody answers), serves consistent and finite snapshots, and applies ``policy`` (allowlist for its RPCs,
    bounded contributions, finite downloads only)."""

    _loading = False
    applied_epoch: Optional[int] = None
    # The epoch the parameters really are at, while local_epoch runs ahead of them: hivemind bumps local_epoch
    # before the optimizer step that produces that epoch's parameters, and hivemind.Optimizer bumps it after a
    # download to catch up with the swarm. None: the parameters are at local_epoch.
    _params_epoch: Optional[int] = None

    async def _load_state_from_peers(self, future, timeout: Optional[float] = None):
        outcome = _Outcome()
        try:
            await super()._load_state_from_peers(outcome, timeout=timeout)
        finally:
            loaded = outcome.result
            if loaded is not None and self.policy.finite_downloads_only and not _finite_floats(loaded[1]):
                logger.warning("A peer sent a state with NaN/inf values: not applying it")
                loaded = None
            future.set_result(loaded)

    def get_current_state(self):
        """The state served to a joining peer (or an aux peer's checkpoint): one consistent snapshot, labelled
        with the epoch its parameters are really at.

        hivemind copies it under lock_averaged_tensors, which the optimizer step does not take, and on CPU its
        ``.cpu()`` returns the very tensors the step updates in place while they are being serialized. So the
        snapshot is taken under lock_optimizer (which the step holds until it has updated the epoch) and cloned.
        """
        with self.lock_optimizer:
            metadata, tensors, infos = super().get_current_state()
            tensors = [tensor.clone() for tensor in tensors]
            if self._params_epoch is not None:
                metadata["epoch"] = min(self._params_epoch, self.local_epoch)  # min: a restore may go back
        if not _finite_floats(tensors):
            # a peer whose parameters just went bad is recovering; hivemind turns this error into a failed
            # download for the asking peer, which then asks another peer
            raise ValueError("not sharing this peer's state: it has NaN/inf values (the peer is recovering)")
        return metadata, tensors, infos

    def step(self, *args, increment_epoch: bool = False, optimizer_step: bool = False, **kwargs):
        if increment_epoch and optimizer_step and self._params_epoch is None:
            self._params_epoch = self.local_epoch  # until _update_scheduler, after the step, under lock_optimizer
        return super().step(*args, increment_epoch=increment_epoch, optimizer_step=optimizer_step, **kwargs)

    def parameters_replaced(self, epoch: int) -> None:
        """The parameters and statistics were just replaced by a state of ``epoch`` (a checkpoint, a backup)."""
        self.local_epoch = epoch
        self._params_epoch = None

    def load_state_from_peers(self, **kwargs):
        self.applied_epoch, self._loading = None, True
        try:
            return super().load_state_from_peers(**kwargs)
        finally:
            self._loading = False

    def _update_scheduler(self):
        # TrainingStateAverager calls this right after applying a downloaded state (the one exact sign that the
        # download was applied, not refused as stale or malformed), and after each optimizer step
        if self._loading:
            self.applied_epoch = self.local_epoch
            self._params_epoch = self.local_epoch  # hivemind.Optimizer may bump local_epoch right after
        else:
            self._params_epoch = None
        super()._update_scheduler()

    def state_arrived(self) -> bool:
        """True if the last download delivered a state and it was applied (hivemind.Optimizer may then
        advance local_epoch by one more to catch up with the swarm; that still counts)."""
        return self.applied_epoch is not None


class LeanHiveGradientAverager(_PolicyAveraging, GradientAverager):
    """GradientAverager that applies ``policy`` (allowlist for its RPCs, bounded contributions)."""


class LeanHiveOptimizer(hivemind.Optimizer):
    """hivemind.Optimizer with a state averager that can tell whether a state download succeeded."""

    def __init__(self, *args, policy: AveragingPolicy = AveragingPolicy(), **kwargs):
        self.policy = policy  # read by _make_state_averager, which hivemind.Optimizer.__init__ calls
        super().__init__(*args, **kwargs)

    def __del__(self):
        try:  # see _PolicyAveraging.__del__
            super().__del__()
        except AttributeError:
            pass

    def _make_progress_tracker(self, target_batch_size: int, **kwargs) -> ProgressTracker:
        return LeanHiveProgressTracker(
            dht=self.dht,
            prefix=self.run_id,
            target_batch_size=target_batch_size,
            client_mode=self.client_mode,
            status_loglevel=self.status_loglevel,
            start=True,
            **kwargs,
        )

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
            **kwargs,
        )

    def load_state_dict(self, state_dict: dict):
        super().load_state_dict(state_dict)
        self.state_averager.parameters_replaced(self.local_epoch)

    def load_state_checked(self) -> bool:
        """Download the swarm's state; True only if a peer answered and the state was applied."""
        self.load_state_from_peers()
        return self.state_averager.state_arrived()


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
