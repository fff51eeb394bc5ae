"""The aux peer's copy of the swarm's training state, held in an auxiliary hivemind.Optimizer.

The optimizer is built by the trainers' own factory (``peer.swarm.optimizer.build_optimizer``), so the
run_id, parameter groups and shapes, target_batch_size and compression are the trainers' by
construction. The replica never trains: it downloads the newest state from the trainers, hands it to
the checkpoint writer, restores a checkpoint on ``--resume``, and offers the state it holds to
joining trainers only while that state is labelled with its true epoch.
"""

from __future__ import annotations

import copy
import logging
import threading
from typing import Optional

import hivemind
import torch

from aux_monitor.checkpoints import TrainingState
from peer.swarm.hivemind_seam import LeanHiveProgressTracker, download_epoch_bound, sync_offloaded_parameters

logger = logging.getLogger(__name__)


class SwarmReplica:
    def __init__(self, *, model: torch.nn.Module, optimizer: hivemind.Optimizer):
        self.model = model
        self.optimizer = optimizer  # its state averager downloads by the run's StateDownloadSettings
        self.held_epoch: Optional[int] = None  # epoch of the parameters we hold; None: nothing loaded yet
        self._downloaded = False  # the held state came from a trainer, labelled with its true epoch
        self._lock = threading.RLock()  # downloads, restores, captures and assist steps never overlap
        self._set_sharing(False)

    @property
    def swarm_epoch(self) -> int:
        """The epoch the swarm's trainers agree on (the median of their progress records, which no single peer
        moves), or hivemind's global epoch while nobody reports. Not the maximum: states are served at the epoch
        most trainers are at, so a download for a checkpoint aimed at the fastest trainer's epoch would be
        repeated at every refresh."""
        tracker = self.optimizer.tracker
        consensus = getattr(tracker, "consensus_epoch", None)
        return tracker.global_epoch if consensus is None else consensus

    @property
    def fresh(self) -> bool:
        """The held state is the swarm's at the optimizer's epoch: an assisting aux took every round's step since it
        was loaded (``assist_step``); a round without the result moves the epoch on and leaves it behind."""
        return self.held_epoch is not None and self.held_epoch == self.optimizer.local_epoch

    def download(self) -> Optional[int]:
        """Load the newest state a trainer offers; returns its epoch, or None if no state arrived.

        Trainers serve one consistent snapshot labelled with the epoch its parameters are really at
        (peer.swarm.hivemind_seam.LeanHiveStateAverager), so a state that arrived and was applied can be used as is,
        however fast the swarm changes epoch.
        """
        with self._lock:
            averager = self.optimizer.state_averager
            # a state beyond the swarm's consensus (a hostile label of 10**12) is refused before it is applied
            bound = download_epoch_bound(self.optimizer.tracker, self.held_epoch or 0)
            averager.load_state_from_peers(max_epoch=bound, progress_key=self.optimizer.tracker.training_progress_key)
            if not averager.state_arrived():
                return None
            epoch = averager.local_epoch
            self._downloaded = True
            self._adopt_epoch(epoch)
            tracker = self.optimizer.tracker
            if isinstance(tracker, LeanHiveProgressTracker):
                with tracker.pause_updates():  # a peer that claimed far more than any served state is ignored
                    tracker.refute_claims_above(epoch)
            return epoch

    def restore(self, state: TrainingState) -> None:
        """Put a checkpoint's state into the optimizer (parameters, statistics, schedule, epoch)."""
        with self._lock, torch.no_grad():
            self.model.load_state_dict(state.model.state_dict())
            averager = self.optimizer.state_averager
            averager.optimizer.load_state_dict(state.optimizer_state)
            if averager.scheduler is not None and state.scheduler_state is not None:
                averager.scheduler.load_state_dict(state.scheduler_state)
            averager.parameters_replaced(state.epoch)
            sync_offloaded_parameters(self.optimizer)
            self._downloaded = False
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
                epoch=self.held_epoch,
                loss=loss,
                time=taken_at,
            )

    def assist_step(self) -> None:
        """One auxiliary step: join the all-reduce round that is due, contributing bandwidth but no data. When the
        round's result arrived, the optimizer took the trainers' step with it (``LeanHiveOptimizer``): a state that
        was the swarm's stays the swarm's at the new epoch. Otherwise hivemind advanced the epoch label without
        touching the parameters, and the state is no longer offered.

        A downloaded state that took the trainers' round of another epoch is not the swarm's either: the donor served
        the state of epoch E just before its round E, that round ran while this aux downloaded, and the aux then took
        round E + 1 with it (hivemind begins the round of a peer behind at once), a state without round E's step.
        On the home testbed (b) such an aux served that state, labelled one epoch behind, for the rest of the run,
        and every joiner found it different from the trainers' ("differs from the state of as many other donor(s)").
        It is no longer offered; the next refresh downloads the state again."""
        with self._lock:
            averager = self.optimizer.state_averager
            fresh, epoch = self.fresh, self.optimizer.local_epoch
            steps = getattr(averager, "auxiliary_steps", 0)
            self.optimizer.step()
            if fresh and getattr(averager, "auxiliary_steps", 0) != steps:
                label = self._round_label()
                if self._downloaded and label is not None and label != epoch:
                    logger.info(
                        "Took the trainers' round %d with the state of epoch %d (their round %d ran while this aux "
                        "downloaded): not offering it until the next download",
                        label,
                        epoch,
                        epoch,
                    )
                else:
                    self.held_epoch = self.optimizer.local_epoch
            self._update_sharing()

    def _round_label(self) -> Optional[int]:
        """The epoch the trainers named the round this aux just took by (``result_epoch``, round_result.py), or None
        where the gradient averager does not say."""
        held = getattr(getattr(self.optimizer, "grad_averager", None), "result_epoch", None)
        return held.value if held is not None and held.value >= 0 else None

    def anchor(self) -> bool:
        """A swarm of client-mode trainers only: nobody else can serve the state, so this aux offers its own at its
        current epoch (with each round's result it takes the trainers' optimizer step, and its parameters take part
        in every state averaging round it assists, so its state follows the swarm's) and reports that epoch as its
        progress, which the clients' epoch consensus needs. True if it (re)adopted an epoch."""
        with self._lock:
            epoch = self.optimizer.local_epoch
            self._downloaded = False  # its own state is the swarm's now, whatever epoch the clients name
            if self.held_epoch == epoch:
                return False
            self._adopt_epoch(epoch)
            return True

    def follow(self, epoch: int) -> bool:
        """An anchoring aux whose client trainers went on without it: their first rounds failed before it assisted,
        and a failed round still ends a client's epoch. Its tracker, at the older epoch, would never count their
        samples and it would never join their rounds again (seen on the home testbed: 0 of 24 rounds). It takes
        their epoch; its state stays the swarm's, as nobody else can serve one. True if it moved."""
        with self._lock:
            if epoch <= self.optimizer.local_epoch:
                return False
            self.optimizer.state_averager.parameters_replaced(epoch)
            sync_offloaded_parameters(self.optimizer)  # the schedule follows the epoch
            self._downloaded = False
            self._adopt_epoch(epoch)
            return True

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
        self._set_sharing(self.fresh)

    def _set_sharing(self, allowed: bool) -> None:
        averager = self.optimizer.state_averager
        if allowed:
            averager.state_sharing_priority = self.held_epoch
        if averager.allow_state_sharing != allowed:
            averager.allow_state_sharing = allowed
            logger.debug("Offering our state to joining peers: %s", allowed)
