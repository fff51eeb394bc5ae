"""The aux peer's copy of the swarm's training state, held in an auxiliary hivemind.Optimizer.

The optimizer is built by the trainers' own factory (``peer.collaboration.build_optimizer``), so the
run_id, parameter groups and shapes, target_batch_size and compression are the trainers' by
construction. The replica never trains: it downloads the newest state from the trainers, hands it to
the checkpoint writer, restores a checkpoint on ``--resume``, and offers the state it holds to
joining trainers only while that state is labelled with its true epoch.
"""
from __future__ import annotations

import copy
import logging
import threading
import time
from typing import Optional

import hivemind
import torch

from aux_monitor.checkpoints import TrainingState

logger = logging.getLogger(__name__)


class SwarmReplica:
    def __init__(self, *, model: torch.nn.Module, optimizer: hivemind.Optimizer, load_state_timeout: float,
                 settle_time: float):
        self.model = model
        self.optimizer = optimizer
        self.load_state_timeout = load_state_timeout
        self.settle_time = settle_time  # seconds after a download in which no trainer may change epoch
        self.held_epoch: Optional[int] = None  # epoch of the parameters we hold; None: nothing loaded yet
        self._lock = threading.RLock()  # downloads, restores, captures and assist steps never overlap
        self._set_sharing(False)

    @property
    def swarm_epoch(self) -> int:
        """The swarm's global epoch as hivemind's progress tracker sees it."""
        return self.optimizer.tracker.global_epoch

    def download(self, attempts: int = 3) -> Optional[int]:
        """Load the newest state a trainer offers; returns its epoch, or None if no consistent state arrived.

        hivemind streams a trainer's live tensors and bumps its epoch label before the optimizer step runs,
        so a download that overlaps a trainer's epoch transition can be torn, or labelled one epoch ahead of
        its parameters. A download is therefore accepted only if the epoch the trainers report was the
        state's epoch just before it and still is ``settle_time`` seconds after it.
        """
        with self._lock:
            for _ in range(attempts):
                before = self._reported_epoch()
                epoch = self._download_once()
                if epoch is None:
                    return None
                time.sleep(self.settle_time)
                after = self._reported_epoch()
                if before == epoch == after:
                    self._adopt_epoch(epoch)
                    return epoch
                logger.info("The swarm changed epoch around the download (trainers reported epoch %s before, "
                            "%s after; the state says %s); downloading again", before, after, epoch)
            logger.warning("The swarm kept changing epoch during %d downloads; trying again later", attempts)
            return None

    def _download_once(self) -> Optional[int]:
        averager = self.optimizer.state_averager
        averager.load_state_from_peers(timeout=self.load_state_timeout)
        return averager.local_epoch if averager.state_arrived() else None

    def _reported_epoch(self) -> Optional[int]:
        """The newest epoch in the trainers' hivemind progress records, read from the DHT now."""
        tracker = self.optimizer.tracker
        found = self.optimizer.dht.get(tracker.training_progress_key, latest=True)
        if found is None or not isinstance(found.value, dict):
            return None
        epochs = [entry.value.get("epoch") for entry in found.value.values() if isinstance(entry.value, dict)]
        return max((e for e in epochs if isinstance(e, int)), default=None)

    def restore(self, state: TrainingState) -> None:
        """Put a checkpoint's state into the optimizer (parameters, statistics, schedule, epoch)."""
        from peer.backup import sync_offloaded_parameters

        with self._lock, torch.no_grad():
            self.model.load_state_dict(state.model.state_dict())
            averager = self.optimizer.state_averager
            averager.optimizer.load_state_dict(state.optimizer_state)
            if averager.scheduler is not None and state.scheduler_state is not None:
                averager.scheduler.load_state_dict(state.scheduler_state)
            averager.local_epoch = state.epoch
            sync_offloaded_parameters(self.optimizer)
            self._adopt_epoch(state.epoch)
        logger.info("Restored the swarm state of epoch %d; offering it to joining trainers", state.epoch)

    def capture(self, loss: Optional[float], taken_at: float) -> TrainingState:
        """A detached copy of the held state, safe to write while downloads go on."""
        with self._lock:
            if self.held_epoch is None:
                raise RuntimeError("no swarm state has been loaded yet")
            averager = self.optimizer.state_averager
            scheduler = averager.scheduler
            return TrainingState(
                model=copy.deepcopy(self.model),
                optimizer_state=copy.deepcopy(averager.optimizer.state_dict()),
                scheduler_state=copy.deepcopy(scheduler.state_dict()) if scheduler is not None else None,
                epoch=self.held_epoch, loss=loss, time=taken_at)

    def assist_step(self) -> None:
        """One auxiliary step: join the all-reduce round that is due, contributing bandwidth but no data."""
        with self._lock:
            self.optimizer.step()
            self._update_sharing()  # hivemind advances our epoch label without touching our parameters

    def exclusive(self) -> threading.RLock:
        """Hold this while using a downloaded state: no download, restore or assist step runs meanwhile."""
        return self._lock

    def _adopt_epoch(self, epoch: int) -> None:
        self.held_epoch = epoch
        tracker = self.optimizer.tracker
        with tracker.pause_updates():  # as hivemind's own load_state_from_peers does
            tracker.report_local_progress(local_epoch=epoch, samples_accumulated=0)
        self._update_sharing()

    def _update_sharing(self) -> None:
        fresh = self.held_epoch is not None and self.held_epoch == self.optimizer.local_epoch
        self._set_sharing(fresh)

    def _set_sharing(self, allowed: bool) -> None:
        averager = self.optimizer.state_averager
        if allowed:
            averager.state_sharing_priority = self.held_epoch
        if averager.allow_state_sharing != allowed:
            averager.allow_state_sharing = allowed
            logger.debug("Offering our state to joining peers: %s", allowed)

