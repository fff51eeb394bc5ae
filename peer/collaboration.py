"""hivemind.Optimizer wiring: parameter groups, LR schedule, compression, averagers, joining the swarm."""
from __future__ import annotations

import logging
import math
import threading
import time
from functools import partial
from typing import List, Optional

import hivemind
import torch
from hivemind.averaging import DecentralizedAverager
from hivemind.compression import (
    BlockwiseQuantization,
    CompressionBase,
    Float16Compression,
    NoCompression,
    SizeAdaptiveCompression,
)
from hivemind.optim.grad_averager import GradientAverager
from hivemind.optim.state_averager import TrainingStateAverager
from hivemind.utils import get_dht_time
from hivemind.utils.crypto import RSAPrivateKey

from peer import backup, faults
from peer.arguments import CollaborationArguments, OptimizerArguments
from peer.auth import AuthorizedAveragerMixin, authorized_peer_ids
from peer.lamb import CPULamb8Bit
from peer.robust import RobustAveragingMixin

logger = logging.getLogger(__name__)

_NO_DECAY_MARKERS = ("bias", "norm", "ln_")


# ---------------------------------------------------------------------------------------------- groups


def parameter_groups(model: torch.nn.Module, weight_decay: float) -> List[dict]:
    """Two groups: matrices decay, biases and normalization weights (any 1-d tensor) do not."""
    decay, no_decay = [], []
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        lowered = name.lower()
        if param.ndim <= 1 or any(marker in lowered for marker in _NO_DECAY_MARKERS):
            no_decay.append(param)
        else:
            decay.append(param)
    return [dict(params=decay, weight_decay=weight_decay), dict(params=no_decay, weight_decay=0.0)]


# --------------------------------------------------------------------------------------- lr schedule


def learning_rate_at(step: int, args: OptimizerArguments) -> float:
    """Absolute learning rate at a global step: linear warmup, then decay to min_learning_rate."""
    if args.warmup_steps and step < args.warmup_steps:
        return args.learning_rate * (step + 1) / args.warmup_steps
    if args.lr_schedule == "constant":
        return args.learning_rate
    progress = min(1.0, (step - args.warmup_steps) / max(1, args.total_steps - args.warmup_steps))
    if args.lr_schedule == "linear":
        decay = 1.0 - progress
    else:
        decay = 0.5 * (1.0 + math.cos(math.pi * progress))
    return args.min_learning_rate + (args.learning_rate - args.min_learning_rate) * decay


def make_scheduler(optimizer: torch.optim.Optimizer, args: OptimizerArguments):
    """hivemind steps the scheduler once per global epoch, so steps here are global steps."""
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: learning_rate_at(step, args) / args.learning_rate)


def make_lamb(param_groups: List[dict], args: OptimizerArguments) -> CPULamb8Bit:
    return CPULamb8Bit(param_groups, lr=args.learning_rate, betas=(args.adam_beta1, args.adam_beta2),
                       eps=args.adam_epsilon, weight_decay=args.weight_decay, clamp_value=args.clamp_value,
                       bias_correction=args.bias_correction, max_grad_norm=args.max_grad_norm or None,
                       min_8bit_size=args.min_8bit_size)


# --------------------------------------------------------------------------------------- compression


def make_compression(args: CollaborationArguments) -> CompressionBase:
    """fp16 for small tensors (biases, norms), 8-bit blockwise for large ones, as in hivemind's ALBERT example."""
    if args.compression == "none":
        return NoCompression()
    if args.compression == "fp16":
        return Float16Compression()
    return SizeAdaptiveCompression(threshold=args.compression_threshold, less=Float16Compression(),
                                   greater_equal=BlockwiseQuantization())


# -------------------------------------------------------------------------------- state download check


class QuietWhenHalfBuilt:
    """hivemind's __del__ methods assume a finished constructor. A stop signal that interrupts one while joining
    leaves a half-built object whose __del__ raises AttributeError on a field never set, printed at exit as a
    scary traceback. hivemind's cleanup still runs as far as the object was built; only that error is dropped."""

    def __del__(self):
        try:
            super().__del__()
        except AttributeError:
            pass


def _finite_floats(tensors) -> bool:
    return backup.all_finite(t for t in tensors if t.is_floating_point())  # 8-bit codes are always finite


class FiniteDownloadsOnly(DecentralizedAverager):
    """A downloaded state with NaN/inf values is not applied: a faulty peer must not spread them to a joiner.
    Sits below TrainingStateAverager in the MRO, so a refused download looks to it like a peer that did not
    answer."""

    def load_state_from_peers(self, **kwargs):
        loaded = super().load_state_from_peers(**kwargs)
        if isinstance(loaded, tuple) and not _finite_floats(loaded[1]):  # wait=False returns a future: unchecked
            logger.warning("A peer sent a state with NaN/inf values: not applying it")
            return None
        return loaded


class CheckedStateAverager(QuietWhenHalfBuilt, AuthorizedAveragerMixin, RobustAveragingMixin,
                           TrainingStateAverager, FiniteDownloadsOnly):
    """TrainingStateAverager that can tell whether a state download was applied (hivemind returns quietly when
    nobody answers), serves consistent and finite snapshots, and has an allowlist for its RPCs and bounded
    contributions (peer.auth, peer.robust)."""

    _loading = False
    applied_epoch: Optional[int] = None
    # The epoch the parameters really are at, while local_epoch runs ahead of them: hivemind bumps local_epoch
    # before the optimizer step that produces that epoch's parameters, and hivemind.Optimizer bumps it after a
    # download to catch up with the swarm. None: the parameters are at local_epoch.
    _params_epoch: Optional[int] = None

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


class LeanHiveGradientAverager(QuietWhenHalfBuilt, AuthorizedAveragerMixin, RobustAveragingMixin,
                               faults.GradientFaultsMixin, GradientAverager):
    """GradientAverager with an allowlist for its RPCs, bounded contributions and the tests' fault hooks."""


class LeanHiveOptimizer(QuietWhenHalfBuilt, hivemind.Optimizer):
    """hivemind.Optimizer with a state averager that can tell whether a state download succeeded."""

    def _make_state_averager(self, **kwargs) -> TrainingStateAverager:
        return CheckedStateAverager(
            dht=self.dht, prefix=f"{self.run_id}_state_averager", min_matchmaking_time=self.matchmaking_time,
            allreduce_timeout=self.allreduce_timeout, shutdown_timeout=self.shutdown_timeout,
            offload_optimizer=self.offload_optimizer, custom_gradients=self.offload_optimizer,
            status_loglevel=self.status_loglevel, next_chunk_timeout=self.next_chunk_timeout,
            client_mode=self.client_mode, auxiliary=self.auxiliary, start=True, **kwargs)

    @property
    def lamb(self) -> CPULamb8Bit:
        return self.state_averager.optimizer

    def load_state_dict(self, state_dict: dict):
        super().load_state_dict(state_dict)
        self.state_averager.parameters_replaced(self.local_epoch)

    def load_state_checked(self) -> bool:
        """Download the swarm's state; True only if a peer answered and the state was applied."""
        self.load_state_from_peers()
        return self.state_averager.state_arrived()


# ------------------------------------------------------------------------------------------ factory


def build_optimizer(*, model: torch.nn.Module, dht: hivemind.DHT, run_id: str, signing_key: RSAPrivateKey,
                    batch_size_per_step: Optional[int], collab: CollaborationArguments, optim: OptimizerArguments,
                    client_mode: bool, reuse_grad_buffers: bool = False, auxiliary: bool = False) -> LeanHiveOptimizer:
    """The collaborative optimizer: 8-bit LAMB offloaded to the CPU, averaged across the swarm.

    Auxiliary peers (aux_monitor) pass ``auxiliary=True`` and ``batch_size_per_step=None``: they build the
    same parameter groups and optimizer state (so states can be exchanged) but never accumulate gradients.
    """
    compression = make_compression(collab)
    allreduce_timeout = collab.allreduce_timeout or collab.averaging_timeout
    # averager_opts reach only the state averager; the gradient averager gets the same through its factory
    averager_opts = dict(request_timeout=collab.request_timeout, contribution_clip=collab.contribution_clip,
                         authorized_peers=authorized_peer_ids(dht))
    grad_averager_factory = partial(LeanHiveGradientAverager, **averager_opts)
    return LeanHiveOptimizer(
        dht=dht,
        run_id=run_id,
        target_batch_size=collab.target_batch_size,
        batch_size_per_step=batch_size_per_step,
        params=parameter_groups(model, optim.weight_decay),
        optimizer=partial(make_lamb, args=optim),
        scheduler=partial(make_scheduler, args=optim),
        matchmaking_time=collab.matchmaking_time,
        averaging_timeout=collab.averaging_timeout,
        allreduce_timeout=allreduce_timeout,
        load_state_timeout=collab.load_state_timeout,
        offload_optimizer=True,
        reuse_grad_buffers=reuse_grad_buffers,
        delay_optimizer_step=collab.delay_optimizer_step,
        delay_grad_averaging=collab.delay_grad_averaging,
        average_state_every=collab.average_state_every,
        client_mode=client_mode,
        auxiliary=auxiliary,
        grad_compression=compression,
        grad_averager_factory=grad_averager_factory,
        state_averaging_compression=compression,
        load_state_compression=NoCompression(),  # joiners get exact parameters and 8-bit codes
        averager_opts=averager_opts,
        # the progress tracker must sign with the same key as the DHT's signature validator
        tracker_opts=dict(private_key=signing_key, min_refresh_period=0.5, default_refresh_period=1.0),
        verbose=collab.verbose,
    )


# -------------------------------------------------------------------------------------------- joining


def count_other_state_sharing_peers(dht: hivemind.DHT, run_id: str) -> int:
    """Other peers that currently offer their state (trainers not in client mode, auxiliary peers)."""
    found = dht.get(f"{run_id}_state_averager.all_averagers", latest=True)
    if found is None or not isinstance(found.value, dict):
        return 0
    own_id = dht.peer_id.to_bytes()
    return sum(1 for subkey, entry in found.value.items() if entry.value is not None and subkey != own_id)


def wait_for_swarm(optimizer: LeanHiveOptimizer, dht: hivemind.DHT, run_id: str,
                   collab: CollaborationArguments) -> None:
    """Wait (at most startup_wait s) for the swarm's progress and for min_peers peers to be online."""
    deadline = time.monotonic() + collab.startup_wait
    optimizer.tracker.fetched_global_progress_this_epoch.wait(timeout=collab.startup_wait)
    if collab.min_peers > 1:
        online = 1 + count_other_state_sharing_peers(dht, run_id)
        while online < collab.min_peers and time.monotonic() < deadline:
            time.sleep(0.5)
            online = 1 + count_other_state_sharing_peers(dht, run_id)
        if online < collab.min_peers:
            logger.warning("Only %d of min_peers=%d peers are online after %.0f s; starting anyway",
                           online, collab.min_peers, collab.startup_wait)
        else:
            logger.info("%d peers online; starting", online)


def join_swarm(optimizer: LeanHiveOptimizer, dht: hivemind.DHT, run_id: str,
               collab: CollaborationArguments) -> bool:
    """Load the swarm's state if anyone else is training; True if a state arrived.

    hivemind's load_state_from_peers returns quietly when nobody answers, so the arrival is checked and
    the download retried a few times before training on with the local state (logged as a warning).
    """
    progress = optimizer.tracker.global_progress
    if progress.num_peers > 0 and optimizer.local_epoch > progress.epoch:
        logger.info("The local backup (epoch %d) is ahead of the swarm (epoch %d): the others will load it",
                    optimizer.local_epoch, progress.epoch)
        return False
    others = (progress.num_peers > 0 or progress.epoch > optimizer.local_epoch
              or count_other_state_sharing_peers(dht, run_id) > 0)
    if not others:
        logger.info("No other peers reported progress: starting a new collaboration at epoch %d",
                    optimizer.local_epoch)
        return False
    if download_state(optimizer, collab.load_state_attempts):
        logger.info("Loaded the swarm's state: now at global epoch %d", optimizer.local_epoch)
        return True
    logger.warning("Could not download the swarm's state; training on from the local state at epoch %d "
                   "(hivemind retries when it notices this peer is behind)", optimizer.local_epoch)
    return False


def download_state(optimizer: LeanHiveOptimizer, attempts: int, pause: float = 2.0) -> bool:
    """Download and apply the swarm's state, retrying: nobody may answer yet, or the peers that answer may be a
    moment behind (still applying the epoch this peer just finished; hivemind refuses such a state)."""
    for attempt in range(1, attempts + 1):
        if optimizer.load_state_checked():
            return True
        logger.warning("No peer sent a usable state (attempt %d of %d)", attempt, attempts)
        if attempt < attempts:
            time.sleep(min(pause * attempt, 5.0))
    return False


# ---------------------------------------------------------------------------------------- final barrier


def _fresh_progress(dht: hivemind.DHT, run_id: str, stale_after: float) -> dict:
    """peer_id -> (epoch, client_mode) of peers whose training progress was reported recently."""
    found = dht.get(f"{run_id}_progress", latest=True)
    if found is None or not isinstance(found.value, dict):
        return {}
    now, fresh = get_dht_time(), {}
    for entry in found.value.values():
        record = entry.value
        if isinstance(record, dict) and now - record.get("time", -math.inf) <= stale_after:
            fresh[record["peer_id"]] = (record["epoch"], record["client_mode"])
    return fresh


def _sharing_priorities(dht: hivemind.DHT, run_id: str) -> dict:
    found = dht.get(f"{run_id}_state_averager.all_averagers", latest=True)
    if found is None or not isinstance(found.value, dict):
        return {}
    return {peer_id: float(entry.value) for peer_id, entry in found.value.items()
            if isinstance(entry.value, (int, float))}


def _final_priority(epoch: int, arrival: float) -> float:
    """State-sharing priority of a peer at the final barrier: above any training priority (= epoch), and
    higher for earlier arrival (a peer that finished late may have missed the last all-reduce)."""
    return epoch + 0.5 + 0.4 * (1.0 - (arrival % 1e5) / 1e5)


def final_barrier(optimizer: LeanHiveOptimizer, dht: hivemind.DHT, run_id: str, epoch: int,
                  collab: CollaborationArguments, stop: Optional[threading.Event] = None) -> bool:
    """At max_epochs: wait for the peers still training, then all take the parameters of one elected peer.

    A peer that finished its last epoch a moment after the others missed their last all-reduce and
    stepped with its own gradients; normally the next epoch's averaging would fix that, but there is no
    next epoch. The elected peer is the earliest to arrive: it gets the highest state-sharing priority,
    which is also whom hivemind's load_state_from_peers downloads from first. Returns True if this peer
    ends with the elected peer's parameters (or is that peer). Setting ``stop`` ends the wait early.
    """
    if collab.final_sync_timeout <= 0:
        return True
    stop = stop if stop is not None else threading.Event()
    deadline = time.monotonic() + collab.final_sync_timeout
    stale_after = max(15.0, 3 * collab.averaging_timeout)
    own_id = dht.peer_id.to_bytes()
    final_floor = epoch + 0.5
    if not optimizer.client_mode:
        optimizer.state_averager.state_sharing_priority = _final_priority(epoch, get_dht_time())

    def keep_reporting():  # the others must see that this peer is still here, waiting
        optimizer.tracker.report_local_progress(optimizer.local_epoch, samples_accumulated=0)

    def out_of_time() -> bool:
        return time.monotonic() > deadline or stop.is_set()

    def others_now():
        progress = {p: v for p, v in _fresh_progress(dht, run_id, stale_after).items() if p != own_id}
        priorities = {p: v for p, v in _sharing_priorities(dht, run_id).items() if p != own_id}
        return progress, priorities

    # 1. everyone still training gets to the last epoch: training peers report progress after every step,
    # and (unless in client mode) declare their epoch as state-sharing priority; a peer that just reloaded
    # the state may be missing from one of the two for a moment, so both are watched
    while True:
        progress, priorities = others_now()
        if (all(e >= epoch for e, _ in progress.values()) and all(v >= epoch for v in priorities.values())) \
                or out_of_time():
            break
        keep_reporting()
        time.sleep(0.5)
    # 2. every state-sharing peer at the barrier has declared its final priority
    while True:
        progress, priorities = others_now()
        if all(v >= final_floor for v in priorities.values()) or out_of_time():
            break
        keep_reporting()
        time.sleep(0.5)
    candidates = {p: v for p, v in priorities.items() if v >= final_floor}
    if not optimizer.client_mode:
        candidates[own_id] = optimizer.state_averager.state_sharing_priority
    if not candidates:
        logger.warning("Final barrier: no peer could be elected; keeping this peer's parameters")
        return False
    if max(candidates, key=candidates.get) == own_id:
        logger.info("Final barrier: elected; %d other peer(s) take these parameters", len(candidates) - 1)
        while not out_of_time():  # 3a. serve the state until every other peer has it
            progress, priorities = others_now()
            followers_done = all(v == final_floor for v in priorities.values() if v >= epoch)
            clients_done = not any(client for _, client in progress.values())
            if followers_done and clients_done:
                return True
            keep_reporting()
            time.sleep(0.5)
        logger.warning("Final barrier: some peers did not take the final parameters within final_sync_timeout")
        return True
    while not out_of_time():  # 3b. take the elected peer's parameters
        if optimizer.load_state_checked() and optimizer.local_epoch == epoch:
            if not optimizer.client_mode:  # tells the elected peer that this one is done
                optimizer.state_averager.state_sharing_priority = final_floor
            logger.info("Final barrier: took the final parameters of the elected peer")
            return True
        keep_reporting()
        time.sleep(0.5)
    logger.warning("Final barrier: could not load the final state within final_sync_timeout")
    return False
