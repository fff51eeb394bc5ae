"""The trainer peer: joins the swarm, runs the local training loop, publishes metrics, leaves cleanly.

Lifecycle: ``TrainerPeer(config)`` does nothing on construction; ``start()`` joins the network and
builds the model, optimizer and data; ``run()`` trains until ``max_epochs``, a stop request (SIGINT/
SIGTERM) or an error; ``shutdown()`` writes a backup and leaves the swarm. Entry points call them in
that order, with ``shutdown()`` in ``finally``.
"""

from __future__ import annotations

import hashlib
import logging
import math
import threading
import time
from dataclasses import dataclass, field
from typing import Iterator, Optional

import hivemind
import torch
from hivemind.utils import get_dht_time

from peer import backup
from peer.grad_scaling import BlockScalePolicy, PerBlockGradScaler
from peer.model_setup import Placement, build_model, choose_placement
from peer.swarm import events
from peer.swarm.agreement import RoundAgreement, tolerance_for
from peer.swarm.config import CollaborationArguments, OptimizerArguments, TrainingArguments
from peer.swarm.data import (
    DataArguments,
    SequenceLengthSchedule,
    build_train_dataset,
    check_tokenizer_fits,
    load_tokenizer,
    make_batches,
)
from peer.swarm.events import EventArguments
from peer.swarm.hivemind_seam import LeanHiveGradientAverager, LeanHiveOptimizer, PseudoGradientAverager
from peer.swarm.joining import (
    check_sync_mode,
    count_other_state_sharing_peers,
    download_state,
    final_barrier,
    join_swarm,
    resync_with_swarm,
    wait_for_swarm,
)
from peer.swarm.network import NetworkArguments, connect
from peer.swarm.optimizer import build_optimizer, make_inner_optimizer, set_inner_learning_rate
from peer.swarm.records import LocalMetrics, publish_metrics
from peer.swarm.tensors import all_finite
from peer.swarm.watchdog import DHTWatchdog

logger = logging.getLogger(__name__)
ROUND_START_MARGIN = 2.0
"""--sync_mode local: a local step (and hivemind's matchmaking lead) may start the next round this much earlier than
the tracker's estimate; the round agreement's check is made before it (``_check_agreement_in_time``)."""


@dataclass
class TrainerConfig:
    """Everything a trainer peer is configured with (one dataclass per concern)."""

    network: NetworkArguments
    collaboration: CollaborationArguments
    optimizer: OptimizerArguments
    training: TrainingArguments
    data: DataArguments
    events: EventArguments = field(default_factory=EventArguments)


@dataclass
class EpochStats:
    """What this peer did during one global epoch (published as metrics when the epoch ends)."""

    epoch: int
    started: float = field(default_factory=time.perf_counter)
    loss_sum: float = 0.0
    mini_steps: int = 0
    samples: int = 0
    steps: int = 0
    skipped_steps: int = 0

    def samples_per_second(self) -> float:
        return self.samples / max(time.perf_counter() - self.started, 1e-9)

    def mean_loss(self) -> float:
        return self.loss_sum / self.mini_steps if self.mini_steps else float("nan")


def _peer_seed(dht: hivemind.DHT) -> int:
    """A per-peer data seed derived from the peer ID, so peers read the data in different orders."""
    return int.from_bytes(hashlib.sha256(dht.peer_id.to_bytes()).digest()[:4], "little")


class TrainerPeer:
    # the averager class of the gradients (a test entry point runs a subclass that injects faults)
    grad_averager_class = LeanHiveGradientAverager
    pseudo_grad_averager_class = PseudoGradientAverager  # the same, for --sync_mode local

    def __init__(self, config: TrainerConfig):
        self.config = config
        self.stop_requested = threading.Event()
        self.running = False  # set once start() is done: before that a stop request interrupts at once
        self.dht: Optional[hivemind.DHT] = None
        self.watchdog: Optional[DHTWatchdog] = None
        self.optimizer: Optional[LeanHiveOptimizer] = None
        self.inner_optimizer: Optional[torch.optim.Optimizer] = None  # --sync_mode local: this peer's own LAMB
        self.model: Optional[torch.nn.Module] = None
        self.placement: Optional[Placement] = None
        self.grad_scaler = None
        self.block_scaler: Optional[PerBlockGradScaler] = None
        self.public_key: Optional[bytes] = None
        self.samples_total = 0
        self.skipped_steps_total = 0
        self.local_step = 0
        self._backup_failed = False
        self._batches: Optional[Iterator[dict]] = None
        self.agreement: Optional[RoundAgreement] = None  # --sync_mode local: the round-end check of shared params
        self._state_loads_seen = 0  # optimizer.state_loads at the last round's end

    # ------------------------------------------------------------------------------------ start

    def start(self) -> None:
        net, train = self.config.network, self.config.training
        if train.torch_threads is not None:
            torch.set_num_threads(train.torch_threads)
        self.placement = choose_placement(train)  # fail on bad device/precision before touching the network
        swarm = connect(net)
        self.dht, self.watchdog, self.public_key = swarm.dht, swarm.watchdog, swarm.public_key
        check_sync_mode(self.dht, net.run_id, self.config.collaboration.sync_mode)  # before it declares its own

        local = self.config.collaboration.sync_mode == "local"  # fp16 was refused by parse_config
        self.model = build_model(train, self.placement)
        # data before the optimizer: building it declares this peer's state to the swarm, and a peer waiting for
        # min_peers starts when it sees that declaration; declared seconds before the tokenizer was ready, this peer
        # let the other end its first epochs alone
        self._build_data()
        if self.placement.uses_grad_scaler and train.per_block_grad_scaling:
            # unscales every block itself, so hivemind gets unscaled gradients as with fp32
            policy = BlockScalePolicy(growth_interval=train.grad_scale_growth_interval)
            self.block_scaler = PerBlockGradScaler(self.model, policy)
        elif self.placement.uses_grad_scaler:
            self.grad_scaler = hivemind.GradScaler()
        self.optimizer = build_optimizer(
            model=self.model,
            dht=self.dht,
            run_id=net.run_id,
            signing_key=swarm.signing_key,
            batch_size_per_step=self.batch_size_per_step,
            collab=self.config.collaboration,
            optim=self.config.optimizer,
            client_mode=net.client_mode,
            # hivemind's GradScaler unscales the accumulated gradients only when they live in .grad
            reuse_grad_buffers=self.grad_scaler is not None,
            grad_averager_class=self.grad_averager_class,
            pseudo_grad_averager_class=self.pseudo_grad_averager_class,
        )
        if local:
            self.inner_optimizer = make_inner_optimizer(self.model, self.config.optimizer)
            self.agreement = RoundAgreement(
                self.dht,
                net.run_id,
                self.public_key,
                self.optimizer.grad_averager.shared_parameters,
                outer_state=self._outer_momentum,
                votes=not net.client_mode,  # a client cannot serve its state: it follows the vote
                tolerance=tolerance_for(self.config.collaboration.compression),
            )
        self._state_loads_seen = self.optimizer.state_loads  # a state loaded while joining: the first round follows
        self._join()

    @property
    def batch_size_per_step(self) -> int:
        """Samples per local step: the model trains on the one device of its placement, however many GPUs the
        host has (counting them all would close epochs with 1/N of the target and weigh this peer N times)."""
        train = self.config.training
        return train.per_device_batch_size * train.gradient_accumulation_steps

    def _build_data(self) -> None:
        data = self.config.data
        tokenizer = load_tokenizer(data)
        check_tokenizer_fits(tokenizer, self.model.config.vocab_size)  # parse_config checked it already
        stream = build_train_dataset(data, tokenizer, peer_seed=_peer_seed(self.dht))
        schedule = SequenceLengthSchedule(data)
        self._batches = make_batches(
            stream, self.config.training.per_device_batch_size, lambda: schedule.length_at(self.optimizer.local_epoch)
        )

    def _join(self) -> None:
        train, collab = self.config.training, self.config.collaboration
        restored = backup.load_backup(train.output_dir, self.model, self.optimizer)
        if restored:
            events.emit(
                "state_loaded", epoch=self.optimizer.local_epoch, source="backup", reason="join", path=str(restored)
            )
        wait_for_swarm(self.optimizer, self.dht, self.config.network.run_id, collab)
        from_swarm = join_swarm(self.optimizer, self.dht, self.config.network.run_id, collab)
        if not restored and self.optimizer.local_epoch == 0:
            logger.info("Starting from freshly initialized parameters")
        state = "swarm" if from_swarm else "backup" if restored else "local"
        events.emit("joined", epoch=self.optimizer.local_epoch, state=state)

    # -------------------------------------------------------------------------------------- run

    def request_stop(self) -> None:
        """Finish the current step, then stop (signal handlers call this)."""
        self.stop_requested.set()

    def run(self) -> None:
        max_epochs = self.config.training.max_epochs
        self.running = True
        stats = EpochStats(epoch=self.optimizer.local_epoch)
        while not self.stop_requested.is_set():
            if max_epochs is not None and self.optimizer.local_epoch >= max_epochs:
                logger.info("Reached max_epochs=%d: stopping", max_epochs)
                events.emit("max_epochs_reached", epoch=self.optimizer.local_epoch)
                self._finish_pending_updates()
                final_barrier(
                    self.optimizer,
                    self.dht,
                    self.config.network.run_id,
                    max_epochs,
                    self.config.collaboration,
                    stop=self.stop_requested,
                )
                break
            if self.watchdog is not None and self.watchdog.wait_while_isolated(self.stop_requested):
                resync_with_swarm(self.optimizer)
            if self.agreement is not None and self.agreement.pending():
                self._check_agreement_in_time()
            epoch_before = self.optimizer.local_epoch
            self._train_step(stats)
            if self.optimizer.local_epoch != epoch_before:
                self._end_epoch(stats)
                stats = EpochStats(epoch=self.optimizer.local_epoch)
        self._finish_pending_updates()

    def _train_step(self, stats: EpochStats) -> None:
        """One local step: accumulate micro-batches, then hand the gradients to hivemind."""
        train = self.config.training
        self.local_step += 1
        loss_sum = self._accumulate_gradients()
        blocks_ok = self._unscale_blocks(loss_sum)
        finite = (
            blocks_ok
            and math.isfinite(loss_sum)
            and all_finite(p.grad for p in self.model.parameters() if p.grad is not None)
        )

        if self.grad_scaler is not None:
            # fp16: the gradients accumulate in .grad; on overflow hivemind's GradScaler drops them and
            # lowers the scale, so the step is always handed over
            self.optimizer.step(batch_size=self.batch_size_per_step, grad_scaler=self.grad_scaler)
            self.grad_scaler.update()
            if not finite:
                self._count_skipped(stats)
                return
        elif not finite:
            self._zero_grad()
            self._count_skipped(stats)
            return
        elif self.inner_optimizer is not None:
            # local mode: this peer's own step now; hivemind only counts the samples toward the round
            set_inner_learning_rate(self.inner_optimizer, self.optimizer.local_epoch, self.config.optimizer)
            self.inner_optimizer.step()
            self._zero_grad()
            self.optimizer.step(batch_size=self.batch_size_per_step)
        else:
            self.optimizer.step(batch_size=self.batch_size_per_step)
            self.optimizer.zero_grad(set_to_none=False)

        stats.loss_sum += loss_sum
        stats.mini_steps += train.gradient_accumulation_steps
        stats.samples += self.batch_size_per_step
        stats.steps += 1
        self.samples_total += self.batch_size_per_step
        if self.local_step % train.log_every_steps == 0:
            self._log_progress(loss_sum / train.gradient_accumulation_steps, stats)

    def _zero_grad(self) -> None:
        if self.inner_optimizer is not None:  # hivemind refuses zero_grad with the averager's reuse_grad_buffers
            self.model.zero_grad(set_to_none=False)
        else:
            self.optimizer.zero_grad(set_to_none=False)

    def _accumulate_gradients(self) -> float:
        """Forward and backward over this local step's micro-batches; returns the summed loss."""
        train = self.config.training
        loss_sum = 0.0
        for _ in range(train.gradient_accumulation_steps):
            input_ids = next(self._batches)["input_ids"].to(self.placement.device)
            with self.placement.autocast():
                loss = self.model(input_ids=input_ids, labels=input_ids).loss
            loss_sum += float(loss.detach())
            if not math.isfinite(loss_sum) and self.grad_scaler is None:
                break  # no point in a backward pass: the step is skipped anyway
            scaled = loss / train.gradient_accumulation_steps
            if self.grad_scaler is not None:
                scaled = self.grad_scaler.scale(scaled)
            elif self.block_scaler is not None:
                scaled = self.block_scaler.scale(scaled)
            scaled.backward()
        return loss_sum

    def _unscale_blocks(self, loss_sum: float) -> bool:
        """Per-block gradient scaling: unscale each block's gradients, zeroing those of the blocks that overflowed
        (only they skip the step); False when every block overflowed or the loss is NaN/inf (skip the step)."""
        if self.block_scaler is None:
            return True
        if not math.isfinite(loss_sum):
            self.block_scaler.discard_step()  # a NaN/inf loss is not a gradient-scale problem
            return False
        return len(self.block_scaler.unscale_().overflowed) < len(self.block_scaler.names)

    def _count_skipped(self, stats: EpochStats) -> None:
        stats.skipped_steps += 1
        self.skipped_steps_total += 1
        logger.warning(
            "Skipping local step %d: NaN/inf loss or gradients (%d skipped so far)",
            self.local_step,
            self.skipped_steps_total,
        )

    def _log_progress(self, loss: float, stats: EpochStats) -> None:
        tracker = self.optimizer.tracker
        logger.info(
            "step %d | loss %.4f | %.1f samples/s | local epoch %d | global epoch %d | peers online %d",
            self.local_step,
            loss,
            stats.samples_per_second(),
            self.optimizer.local_epoch,
            tracker.global_epoch,
            max(tracker.global_progress.num_peers, 1),
        )

    # ----------------------------------------------------------------------------- epoch boundary

    def _end_epoch(self, stats: EpochStats) -> None:
        new_epoch = self.optimizer.local_epoch
        logger.info(
            "Global epoch %d done: loss %.4f over %d micro-steps, %d samples at %.1f samples/s, "
            "%d steps, %d skipped -> now at epoch %d (lr %.3g)",
            stats.epoch,
            stats.mean_loss(),
            stats.mini_steps,
            stats.samples,
            stats.samples_per_second(),
            stats.steps,
            stats.skipped_steps,
            new_epoch,
            (self.inner_optimizer or self.optimizer.opt).param_groups[0]["lr"],
        )
        events.emit(
            "epoch_done",
            epoch=stats.epoch,
            loss=stats.mean_loss(),
            mini_steps=stats.mini_steps,
            samples=stats.samples,
            steps=stats.steps,
            skipped=stats.skipped_steps,
            now_at=new_epoch,
            peers=self.optimizer.tracker.global_progress.num_peers,
        )
        self._publish(stats)
        if self.optimizer.missed_round:
            self._resync_after_missed_round()
        if self.agreement is not None:
            if self.agreement.pending():  # the previous round's check, when this round was shorter than its wait
                self._follow_agreement()
            loads = self.optimizer.state_loads
            self.agreement.round_ended(self.optimizer.local_epoch, state_replaced=loads != self._state_loads_seen)
            self._state_loads_seen = loads
        self._after_update(new_epoch)

    def _outer_momentum(self) -> list:
        """--sync_mode local: the outer optimizer's momentum buffers (none before its first step, or without
        momentum), in parameter order."""
        outer = self.optimizer.state_averager.optimizer
        buffers = [outer.state.get(p, {}).get("momentum_buffer") for g in outer.param_groups for p in g["params"]]
        return [buffer for buffer in buffers if buffer is not None]

    def _check_agreement_in_time(self) -> None:
        """--sync_mode local: the last round's check runs ``SETTLE_SECONDS`` after it (the others' fingerprints must
        arrive first), and at the latest before the next round's all-reduce, whose pseudo-gradient must start from
        the agreed state. With rounds of seconds (tests, tiny models) the next round began first, inside hivemind's
        step, and every repair came one round late (measured); with rounds of minutes this never waits."""
        wait = self.agreement.seconds_until_due()
        if wait > 0:
            next_round = self.optimizer.tracker.estimated_next_update_time - get_dht_time()
            if next_round > wait + ROUND_START_MARGIN:
                return  # due well before the next round: checked at a later step
            self.stop_requested.wait(wait)
        self._follow_agreement()

    def _follow_agreement(self) -> None:
        """--sync_mode local: read the last round's fingerprints; if this peer's shared parameters lost the vote,
        download the state of a peer that won it (once; peer.swarm.agreement)."""
        epoch, sources = self.agreement.check()
        if not sources:
            return
        if self.optimizer.load_state_checked(only_from=frozenset(sources)):
            events.emit(
                "state_loaded", epoch=self.optimizer.local_epoch, source="swarm", reason="disagreement", path=None
            )
        else:
            logger.warning("Could not download the state that won the vote of epoch %d: training on", epoch)

    def _resync_after_missed_round(self) -> None:
        """--sync_mode local: this peer's pseudo-gradient missed the round's all-reduce; take the shared state of
        a peer that made it (else train on: the next state averaging round pulls this peer back)."""
        self.optimizer.missed_round = False
        if self.watchdog is not None and self.watchdog.isolated:
            # cut off from every peer: nobody can send a state now; the run loop pauses, then re-syncs on reconnect
            logger.warning(
                "Missed the all-reduce before round %d while cut off from every peer", self.optimizer.local_epoch
            )
            return
        logger.warning("Missed the all-reduce before round %d: loading the swarm's state", self.optimizer.local_epoch)
        if download_state(self.optimizer, self.config.collaboration.load_state_attempts):
            events.emit(
                "state_loaded", epoch=self.optimizer.local_epoch, source="swarm", reason="missed_round", path=None
            )

    def _after_update(self, new_epoch: int) -> None:
        """After an epoch's update: NaN/inf parameters are recovered, else the periodic backup is written."""
        if not self._parameters_ok():
            return
        every = self.config.training.backup_every_epochs
        if every and (new_epoch % every == 0 or self._backup_failed):
            # a backup that could not be written (full disk) is retried at the next epoch, not in every_epochs
            written = backup.save_backup(self.config.training.output_dir, self.model, self.optimizer)
            self._backup_failed = written is None

    def _publish(self, stats: EpochStats) -> None:
        if stats.mini_steps == 0 or not math.isfinite(stats.loss_sum):
            return
        metrics = LocalMetrics(
            epoch=stats.epoch,
            samples_per_second=float(stats.samples_per_second()),
            samples_accumulated=stats.samples,
            loss=float(stats.loss_sum) / stats.mini_steps,  # a mean: the schema bounds it, and a sum grows with steps
            mini_steps=stats.mini_steps,
            samples_total=self.samples_total,
            time=float(get_dht_time()),
        )
        publish_metrics(
            self.dht,
            self.config.network.run_id,
            self.public_key,
            metrics,
            expiration=self.config.collaboration.metrics_expiration,
        )

    def _parameters_ok(self) -> bool:
        """After an update: NaN/inf parameters are replaced from the swarm or the local backup (False then)."""
        if all_finite(self.model.parameters()):
            return True
        logger.error("Parameters became NaN/inf after the update at epoch %d; recovering", self.optimizer.local_epoch)
        # peers online are ahead of any local backup, so they are asked first
        if self.optimizer.tracker.global_progress.num_peers > 1 or count_other_state_sharing_peers(
            self.dht, self.config.network.run_id
        ):
            # the others may be a moment behind, still applying the epoch this peer just finished
            attempts = self.config.collaboration.load_state_attempts
            if download_state(self.optimizer, attempts) and all_finite(self.model.parameters()):
                logger.info("Recovered by loading the swarm's state (global epoch %d)", self.optimizer.local_epoch)
                events.emit(
                    "state_loaded", epoch=self.optimizer.local_epoch, source="swarm", reason="recovery", path=None
                )
                return False
        restored = backup.load_backup(self.config.training.output_dir, self.model, self.optimizer)
        if restored:
            logger.info("Recovered from the local backup (global epoch %d)", self.optimizer.local_epoch)
            events.emit(
                "state_loaded", epoch=self.optimizer.local_epoch, source="backup", reason="recovery", path=str(restored)
            )
            return False
        raise RuntimeError(
            "parameters are NaN/inf and neither the swarm's state nor a local backup could "
            "replace them; restart the peer with peers online or a healthy --output_dir backup"
        )

    # ---------------------------------------------------------------------------------- shutdown

    def _finish_pending_updates(self) -> None:
        """Apply background averaging/optimizer results, so the final parameters are the swarm's."""
        try:
            self.optimizer.state_averager.step(wait_for_delayed_updates=True, apply_delayed_updates=True)
        except Exception as e:
            logger.warning("A background update did not finish: %s", e)

    def shutdown(self) -> None:
        """Write a backup and the final parameters, leave the swarm; safe to call after a failed start."""
        output_dir = self.config.training.output_dir
        if self.optimizer is not None and self.model is not None:
            try:
                if self.config.training.backup_every_epochs:
                    backup.save_backup(output_dir, self.model, self.optimizer)
                if all_finite(self.model.parameters()):
                    backup.save_final_params(output_dir, self.model, self.optimizer.local_epoch)
            except Exception:
                logger.exception("Could not write the backup or final parameters")
        if self.optimizer is not None:
            logger.info("Leaving the swarm")
            self.optimizer.shutdown()
        if self.watchdog is not None:
            self.watchdog.shutdown()
        if self.dht is not None:
            self.dht.shutdown()
        logger.info("Shut down cleanly (%d local steps, %d skipped)", self.local_step, self.skipped_steps_total)
