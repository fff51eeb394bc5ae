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
import math
import threading
from typing import Optional

import hivemind
import torch

from aux_monitor.checkpoints import TrainingState

logger = logging.getLogger(__name__)


class SwarmReplica:
    def __init__(self, *, model: torch.nn.Module, optimizer: hivemind.Optimizer, load_state_timeout: float):
        self.model = model
        self.optimizer = optimizer
        self.load_state_timeout = load_state_timeout
        self.held_epoch: Optional[int] = None  # epoch of the parameters we hold; None: nothing loaded yet
        self._lock = threading.RLock()  # downloads, restores, captures and assist steps never overlap
        self._set_sharing(False)

    @property
    def swarm_epoch(self) -> int:
        """The swarm's global epoch as hivemind's progress tracker sees it."""
        return self.optimizer.tracker.global_epoch

    def download(self, attempts: int = 3) -> Optional[int]:
        """Load the newest state a trainer offers; returns its epoch, or None if no consistent state arrived.

        A state is accepted when two consecutive downloads carry the same epoch and the same parameters:
        hivemind streams a peer's live tensors and bumps its epoch label before the optimizer step runs,
        so one download can be torn, or labelled one epoch ahead of its parameters. Two downloads may come
        from different trainers, whose parameters differ by float rounding of the all-reduce, hence the
        tolerance (far below the change one optimizer step makes).
        """
        with self._lock:
            epoch = self._download_once()
            for _ in range(attempts):
                if epoch is None:
                    return None
                reference = self._parameters()
                again = self._download_once()
                difference = _relative_difference(reference, self._parameters())
                if again == epoch and difference <= SAME_STATE_RTOL:
                    self._adopt_epoch(epoch)
                    return epoch
                logger.info("The state changed between two downloads (epoch %s, then %s; parameters differ by %.1e "
                            "relative): the swarm moved on or a trainer was mid-step; downloading again",
                            epoch, again, difference)
                epoch = again
            logger.warning("The swarm's state kept changing during %d downloads; trying again later", attempts)
            return None

    def _download_once(self) -> Optional[int]:
        averager = self.optimizer.state_averager
        averager.load_state_from_peers(timeout=self.load_state_timeout)
        return averager.local_epoch if averager.state_arrived() else None

    def _parameters(self) -> list:
        return [p.detach().clone() for p in self.model.parameters()]

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


SAME_STATE_RTOL = 1e-5  # all-reduce rounding between trainers: ~1e-7; one optimizer step: ~learning rate


def _relative_difference(first: list, second: list) -> float:
    """Largest |a - b| / |a| over the tensors (inf if the second download has NaN/inf values)."""
    worst = 0.0
    for a, b in zip(first, second):
        if not torch.isfinite(b).all():
            return math.inf
        worst = max(worst, float((a - b).norm()) / max(float(a.norm()), 1e-12))
    return worst
