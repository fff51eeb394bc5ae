"""The trainer peer: joins the swarm, runs the local training loop, publishes metrics, leaves cleanly.

Lifecycle: ``TrainerPeer.build(config, control, parts)`` joins the network, builds the model, data, optimizer and
the training strategy of its ``--sync_mode`` (``peer.strategies``), and joins the swarm's state; ``run()`` trains
until ``max_epochs``, a stop request (SIGINT/SIGTERM) or an error; closing ``parts`` writes a backup and leaves the
swarm. Entry points hand ``build`` to ``peer.swarm.lifecycle.run_peer``, which does all three.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import math
import time
from dataclasses import dataclass, field
from typing import Callable, Iterator, Optional

import hivemind
import torch
from hivemind.utils import get_dht_time

from peer import backup
from peer.grad_scaling import BlockScalePolicy, PerBlockGradScaler
from peer.model_setup import Placement, build_model, choose_placement
from peer.strategies import LocalTraining, SyncTraining, TrainingStrategy
from peer.swarm import events
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
from peer.swarm.hivemind_seam import LeanHiveOptimizer
from peer.swarm.joining import (
    RejoinWhenApart,
    check_sync_mode,
    count_other_state_sharing_peers,
    final_barrier,
    join_swarm,
    resync_with_swarm,
    wait_for_swarm,
)
from peer.swarm.lifecycle import PeerControl
from peer.swarm.network import NetworkArguments, connect
from peer.swarm.optimizer import build_optimizer
from peer.swarm.reachability import ReducerWatch
from peer.swarm.records import LocalMetrics, publish_metrics
from peer.swarm.round_health import HealthLine, RoundHealthCounter
from peer.swarm.tensors import all_finite
from peer.swarm.watchdog import DHTWatchdog

logger = logging.getLogger(__name__)


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


def _build_batches(
    config: TrainerConfig, model: torch.nn.Module, dht: hivemind.DHT, epoch: Callable[[], int]
) -> Iterator[dict]:
    """The training batches; their sequence length follows the warm-up schedule at the global ``epoch()``."""
    data = config.data
    tokenizer = load_tokenizer(data)
    check_tokenizer_fits(tokenizer, model.config.vocab_size)  # parse_config checked it already
    stream = build_train_dataset(data, tokenizer, peer_seed=_peer_seed(dht))
    schedule = SequenceLengthSchedule(data)
    return make_batches(stream, config.training.per_device_batch_size, lambda: schedule.length_at(epoch()))


def batch_size_per_step(training: TrainingArguments) -> int:
    """Samples per local step: the model trains on the one device of its placement, however many GPUs the host has
    (counting them all would close epochs with 1/N of the target and weigh this peer N times)."""
    return training.per_device_batch_size * training.gradient_accumulation_steps


@dataclass
class LoopCounters:
    """What the training loop counted over the peer's life (logged when it shuts down)."""

    local_step: int = 0
    samples_total: int = 0
    skipped_steps_total: int = 0

    def log_shutdown(self) -> None:
        logger.info("Shut down cleanly (%d local steps, %d skipped)", self.local_step, self.skipped_steps_total)


def _write_final_state(training: TrainingArguments, model: torch.nn.Module, optimizer: LeanHiveOptimizer) -> None:
    """At shutdown, before leaving the swarm: a backup and the final parameters (failures are logged)."""
    try:
        if training.backup_every_epochs:
            backup.save_backup(training.output_dir, model, optimizer)
        if all_finite(model.parameters()):
            backup.save_final_params(training.output_dir, model, optimizer.local_epoch)
    except Exception:
        logger.exception("Could not write the backup or final parameters")


def _leave_swarm(optimizer: LeanHiveOptimizer) -> None:
    logger.info("Leaving the swarm")
    optimizer.shutdown()


class TrainerPeer:
    """A trainer built whole by ``build`` (entry points run it with ``peer.swarm.lifecycle.run_peer``); the
    constructor takes finished parts, so a test can assemble one from its own."""

    def __init__(
        self,
        *,
        config: TrainerConfig,
        control: PeerControl,
        dht: hivemind.DHT,
        public_key: bytes,
        watchdog: Optional[DHTWatchdog],
        model: torch.nn.Module,
        placement: Placement,
        optimizer: LeanHiveOptimizer,
        strategy: TrainingStrategy,
        batches: Iterator[dict],
        grad_scaler: Optional[hivemind.GradScaler] = None,
        block_scaler: Optional[PerBlockGradScaler] = None,
        counters: Optional[LoopCounters] = None,
        health: Optional[RoundHealthCounter] = None,
        reducer_watch: Optional[ReducerWatch] = None,
    ):
        self.config, self.control = config, control
        self.dht, self.public_key, self.watchdog = dht, public_key, watchdog  # watchdog: None with --rejoin_period 0
        self.model, self.placement, self.optimizer, self.strategy = model, placement, optimizer, strategy
        self.batches = batches
        self.grad_scaler = grad_scaler  # fp16 with one loss scale (hivemind's)
        self.block_scaler = block_scaler  # fp16 with --per_block_grad_scaling
        self.counters = counters if counters is not None else LoopCounters()
        # what hivemind's averaging reports goes in only when build attached it; a test's peer counts its loop alone
        self.health = health if health is not None else RoundHealthCounter(sync_mode=config.collaboration.sync_mode)
        self.health_line = HealthLine()
        self.reducer_watch = reducer_watch  # a client-mode trainer's: pauses training while nobody can reduce
        self.rejoin_when_apart = RejoinWhenApart()
        self.batch_size_per_step = batch_size_per_step(config.training)
        self._backup_failed = False

    # ------------------------------------------------------------------------------------ build

    @classmethod
    def build(cls, config: TrainerConfig, control: PeerControl, parts: contextlib.ExitStack) -> "TrainerPeer":
        """Join the network, build the model, data, optimizer and training strategy, join the swarm's state.

        Each part's shutdown goes on ``parts`` as soon as the part exists, so closing it (``run_peer`` always does)
        writes the backup and final parameters, leaves the swarm, then stops the watchdog and the DHT."""
        net, train, collab = config.network, config.training, config.collaboration
        counters = LoopCounters()
        parts.callback(counters.log_shutdown)
        if train.torch_threads is not None:
            torch.set_num_threads(train.torch_threads)
        placement = choose_placement(train)  # fail on bad device/precision before touching the network
        swarm = connect(net)
        parts.callback(swarm.dht.shutdown)
        if swarm.watchdog is not None:
            parts.callback(swarm.watchdog.shutdown)
        parts.callback(swarm.shutdown_service)
        control.watchdog = swarm.watchdog
        check_sync_mode(swarm.dht, net.run_id, collab.sync_mode)  # before it declares its own
        client_mode = swarm.client_mode  # --client_mode, --reachability, or found out (peer.swarm.reachability)
        reducer_watch = None
        if client_mode:  # a client averages only through a reachable peer: say so and pause while there is none
            reducer_watch = ReducerWatch(swarm.dht, net.run_id).start()
            parts.callback(reducer_watch.shutdown)

        model = build_model(train, placement)
        # data before the optimizer: building it declares this peer's state to the swarm, and a peer waiting for
        # min_peers starts when it sees that declaration; declared before the tokenizer was ready, this peer would
        # let the other end its first epochs alone
        batches = _build_batches(config, model, swarm.dht, epoch=lambda: optimizer.local_epoch)
        # before the optimizer: its averager processes, forked while it is built, report into the same counter
        health = RoundHealthCounter(sync_mode=collab.sync_mode, reachability=swarm.reachability.label)
        parts.callback(health.attach())
        grad_scaler, block_scaler = None, None
        if placement.uses_grad_scaler and train.per_block_grad_scaling:
            # unscales every block itself, so hivemind gets unscaled gradients as with fp32
            policy = BlockScalePolicy(growth_interval=train.grad_scale_growth_interval)
            block_scaler = PerBlockGradScaler(model, policy)
        elif placement.uses_grad_scaler:
            grad_scaler = hivemind.GradScaler()
        optimizer = build_optimizer(
            model=model,
            dht=swarm.dht,
            run_id=net.run_id,
            signing_key=swarm.signing_key,
            batch_size_per_step=batch_size_per_step(train),
            collab=collab,
            optim=config.optimizer,
            client_mode=client_mode,
            # hivemind's GradScaler unscales the accumulated gradients only when they live in .grad
            reuse_grad_buffers=grad_scaler is not None,
        )
        parts.callback(_leave_swarm, optimizer)
        parts.callback(_write_final_state, train, model, optimizer)
        if collab.sync_mode == "local":  # fp16 was refused by parse_config
            strategy = LocalTraining.build(
                optimizer=optimizer,
                model=model,
                dht=swarm.dht,
                run_id=net.run_id,
                public_key=swarm.public_key,
                client_mode=client_mode,
                collab=collab,
                optimizer_args=config.optimizer,
                batch_size_per_step=batch_size_per_step(train),
                stop_requested=control.stop_requested,
            )
        else:
            strategy = SyncTraining(
                optimizer,
                batch_size_per_step(train),
                resync_max_mb=collab.missed_round_resync_mb,
                watchdog=swarm.watchdog,
            )
        peer = cls(
            config=config,
            control=control,
            dht=swarm.dht,
            public_key=swarm.public_key,
            watchdog=swarm.watchdog,
            model=model,
            placement=placement,
            optimizer=optimizer,
            strategy=strategy,
            batches=batches,
            grad_scaler=grad_scaler,
            block_scaler=block_scaler,
            counters=counters,
            health=health,
            reducer_watch=reducer_watch,
        )
        peer._join()
        return peer

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

    def run(self) -> None:
        max_epochs = self.config.training.max_epochs
        stop = self.control.stop_requested
        stats = EpochStats(epoch=self.optimizer.local_epoch)
        while not stop.is_set():
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
                    stop=stop,
                )
                break
            if self.watchdog is not None and self.watchdog.wait_while_isolated(stop):
                resync_with_swarm(self.optimizer)
            self.rejoin_when_apart(self.optimizer)
            if self.reducer_watch is not None and self.reducer_watch.wait_while_missing(stop):
                continue  # paused: check max_epochs and the stop request again before computing
            self.strategy.before_step()
            epoch_before = self.optimizer.local_epoch
            self._train_step(stats)
            if self.optimizer.local_epoch != epoch_before:
                self._end_epoch(stats)
                stats = EpochStats(epoch=self.optimizer.local_epoch)
        self._finish_pending_updates()

    def _train_step(self, stats: EpochStats) -> None:
        """One local step: accumulate micro-batches, then hand the gradients to the strategy."""
        train, counters = self.config.training, self.counters
        counters.local_step += 1
        started = time.perf_counter()
        loss_sum = self._accumulate_gradients()
        self.health.add_time("compute", time.perf_counter() - started)
        blocks_ok = self._unscale_blocks(loss_sum)
        finite = (
            blocks_ok
            and math.isfinite(loss_sum)
            and all_finite(p.grad for p in self.model.parameters() if p.grad is not None)
        )
        if self.grad_scaler is not None:
            self._timed_step(self.grad_scaler)  # fp16: always handed over; the scaler drops an overflow
            if not finite:
                self._count_skipped(stats)
                return
        elif not finite:
            self.strategy.discard_step()
            self._count_skipped(stats)
            return
        else:
            self._timed_step()

        stats.loss_sum += loss_sum
        stats.mini_steps += train.gradient_accumulation_steps
        stats.samples += self.batch_size_per_step
        stats.steps += 1
        counters.samples_total += self.batch_size_per_step
        if counters.local_step % train.log_every_steps == 0:
            self._log_progress(loss_sum / train.gradient_accumulation_steps, stats)

    def _timed_step(self, *args) -> None:
        """The strategy's step; its time not spent waiting for an averaging round is the optimizer's."""
        started, waited = time.perf_counter(), self.health.seconds("wait")
        self.strategy.step(*args)
        waited = self.health.seconds("wait") - waited
        self.health.add_time("optimizer", max(0.0, time.perf_counter() - started - waited))

    def _accumulate_gradients(self) -> float:
        """Forward and backward over this local step's micro-batches; returns the summed loss."""
        train = self.config.training
        loss_sum = 0.0
        for _ in range(train.gradient_accumulation_steps):
            input_ids = next(self.batches)["input_ids"].to(self.placement.device)
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
        self.counters.skipped_steps_total += 1
        logger.warning(
            "Skipping local step %d: NaN/inf loss or gradients (%d skipped so far)",
            self.counters.local_step,
            self.counters.skipped_steps_total,
        )

    def _log_progress(self, loss: float, stats: EpochStats) -> None:
        tracker = self.optimizer.tracker
        logger.info(
            "step %d | loss %.4f | %.1f samples/s | local epoch %d | global epoch %d | peers online %d",
            self.counters.local_step,
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
            self.strategy.learning_rate(),
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
            repaired_rounds=self.optimizer.repaired_rounds,
        )
        self._publish(stats)
        self.strategy.end_epoch()
        self._after_update(new_epoch)

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
            samples_total=self.counters.samples_total,
            time=float(get_dht_time()),
            health=self.health.snapshot(),
        )
        every = self.config.training.log_health_every_epochs
        if every and stats.epoch % every == 0:
            logger.info("%s", self.health_line.format(metrics.health))
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
            if self.optimizer.load_state_checked() and all_finite(self.model.parameters()):
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
