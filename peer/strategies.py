"""The two ways a trainer's local steps reach the swarm (``--sync_mode``): two objects with one interface,
``TrainingStrategy``, whose docstring is the contract the trainer loop relies on.

``SyncTraining`` (``--sync_mode sync``): hivemind accumulates the gradients, all-reduces them when the swarm has
``target_batch_size`` samples, and every peer takes the same 8-bit LAMB step.

``LocalTraining`` (``--sync_mode local``, DiLoCo): this peer steps its own inner LAMB after every local step;
hivemind only counts the samples, and at the round's end all-reduces the pseudo-gradients and steps the outer
optimizer on the shared parameters (``peer.swarm.hivemind_seam.PseudoGradientAverager``). Around that it keeps the
shared parameters in agreement: a peer that missed the round's all-reduce loads the swarm's state, and the round
agreement's check (``peer.swarm.agreement``) makes a peer whose shared parameters lost the vote download a winner's.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import List, Optional, Protocol

import hivemind
import torch
from hivemind.utils import get_dht_time

from peer.swarm import events
from peer.swarm.agreement import RoundAgreement, tolerance_for
from peer.swarm.config import CollaborationArguments, OptimizerArguments
from peer.swarm.hivemind_seam import LeanHiveOptimizer
from peer.swarm.optimizer import make_inner_optimizer, set_inner_learning_rate
from peer.swarm.watchdog import DHTWatchdog

logger = logging.getLogger(__name__)

ROUND_START_MARGIN = 2.0
"""--sync_mode local: a local step (and hivemind's matchmaking lead) may start the next round this much earlier than
the tracker's estimate; the round agreement's check is made before it (``LocalTraining.before_step``)."""


class TrainingStrategy(Protocol):
    """What the trainer loop (``peer.trainer.TrainerPeer.run``) calls; it never asks which mode it runs in.

    For each local step, in this order:

    - ``before_step()``: at the top of every loop iteration, before the step's forward and backward passes (after
      the loop's own checks: max_epochs, a pause while cut off from the swarm).
    - then exactly one of ``step(grad_scaler)``: hand the step's accumulated gradients over (finite ones; with
      fp16's ``hivemind.GradScaler`` every step is handed over and the scaler drops an overflowing one); hivemind
      may end a global epoch inside this call (all-reduce and optimizer step); or ``discard_step()``: the step's
      gradients are NaN/inf, drop them (nothing is stepped, no sample counts).
    - ``end_epoch()``: only when a global epoch ended during ``step``; called after the epoch's metrics were
      published and before the loop's own after-update work (the NaN/inf check of the parameters with its
      recovery, and the periodic backup: the same in both modes).

    ``learning_rate()`` may be called at any time: the rate the local steps use now (for the log). A wait of the
    strategy's own (``LocalTraining.before_step``) ends early on a stop request.
    """

    def before_step(self) -> None: ...
    def step(self, grad_scaler: Optional[hivemind.GradScaler] = None) -> None: ...
    def discard_step(self) -> None: ...
    def end_epoch(self) -> None: ...
    def learning_rate(self) -> float: ...


def resync_after_missed_round(optimizer: LeanHiveOptimizer, watchdog: Optional[DHTWatchdog]) -> None:
    """This peer's contribution missed the last all-reduce (``LeanHiveOptimizer.missed_round``), so hivemind stepped
    with it alone; take the state of a peer that made the round (else train on: the next state averaging round pulls
    this peer's parameters back)."""
    optimizer.missed_round = False
    if watchdog is not None and watchdog.isolated:
        # cut off from every peer: nobody can send a state now; the run loop pauses, then re-syncs on reconnect
        logger.warning("Missed the all-reduce before round %d while cut off from every peer", optimizer.local_epoch)
        return
    logger.warning("Missed the all-reduce before round %d: loading the swarm's state", optimizer.local_epoch)
    if optimizer.load_state_checked():
        events.emit("state_loaded", epoch=optimizer.local_epoch, source="swarm", reason="missed_round", path=None)
    else:
        logger.warning("No peer gave its state after the missed round %d: training on", optimizer.local_epoch)


RESYNC_EVERY_EPOCHS = 3
"""Sync mode: at most one re-sync download per this many epochs (a round missed sooner after the last download waits
for the next one)."""
RESYNC_EPOCH_SHARE = 0.25
"""Sync mode: re-sync only while this peer's last state download took at most this share of an epoch. A longer one
makes the peer late for the next round as well: on the home testbed (epochs of 4 s, downloads of 1 to 4 s with the
donor's snapshot and the catch-up to the swarm's epoch) every download cost the next round, the volunteers took
part in 54 % of the rounds instead of 90 % or more, and the public trainer lost rounds too."""


class SyncTraining:
    """``--sync_mode sync``: the swarm averages gradients and takes one optimizer step per global epoch.

    After a gradient round this peer missed, it downloads the swarm's state when that is at most
    ``resync_max_mb`` (``--missed_round_resync_mb``): hivemind's own-gradient step leaves a gap in the parameters and
    LAMB statistics that lasts many epochs; a larger state is not worth one step's gap. Not when a download takes
    more than ``RESYNC_EPOCH_SHARE`` of an epoch (measured: this peer's last download, the mean epoch), and at most
    once per ``RESYNC_EVERY_EPOCHS`` epochs."""

    def __init__(
        self,
        optimizer: LeanHiveOptimizer,
        batch_size_per_step: int,
        *,
        resync_max_mb: float = 0.0,
        watchdog: Optional[DHTWatchdog] = None,
    ):
        self.optimizer, self.batch_size_per_step = optimizer, batch_size_per_step
        self.resync_max_mb, self.watchdog = resync_max_mb, watchdog
        self._last_resync: Optional[int] = None  # the epoch of the last re-sync download
        self._epoch_ended: Optional[float] = None  # monotonic time the last epoch ended
        self._epoch_seconds: Optional[float] = None  # mean seconds per epoch (exponential, recent epochs weigh more)

    def before_step(self) -> None:
        pass

    def step(self, grad_scaler: Optional[hivemind.GradScaler] = None) -> None:
        if grad_scaler is not None:
            # fp16: the gradients accumulate in .grad; on overflow hivemind's GradScaler drops them and lowers the
            # scale
            self.optimizer.step(batch_size=self.batch_size_per_step, grad_scaler=grad_scaler)
            grad_scaler.update()
            return
        self.optimizer.step(batch_size=self.batch_size_per_step)
        self.optimizer.zero_grad(set_to_none=False)

    def discard_step(self) -> None:
        self.optimizer.zero_grad(set_to_none=False)

    def end_epoch(self) -> None:
        epoch = self.optimizer.local_epoch
        self._time_epoch()
        if self.optimizer.missed_round:
            state_mb = self.optimizer.state_averager.state_bytes() / 1e6
            if state_mb > self.resync_max_mb:
                self.optimizer.missed_round = False
                logger.info(
                    "Missed the all-reduce before round %d: stepped with this peer's own gradients (the state, %.0f "
                    "MB, is above --missed_round_resync_mb %g)",
                    epoch,
                    state_mb,
                    self.resync_max_mb,
                )
                return
        # a round missed within RESYNC_EVERY_EPOCHS of the last re-sync keeps the flag until the next one
        if not self.optimizer.missed_round:
            return
        if self._last_resync is not None and epoch - self._last_resync < RESYNC_EVERY_EPOCHS:
            return
        download = self.optimizer.last_download_seconds
        if download is not None and self._epoch_seconds is not None:
            if download > RESYNC_EPOCH_SHARE * self._epoch_seconds:
                self.optimizer.missed_round = False
                logger.info(
                    "Missed the all-reduce before round %d: stepped with this peer's own gradients (a state download "
                    "took %.1f s, more than %.0f%% of an epoch of %.1f s: it would miss the next round as well)",
                    epoch,
                    download,
                    100 * RESYNC_EPOCH_SHARE,
                    self._epoch_seconds,
                )
                return
            logger.info(
                "The last state download took %.1f s, an epoch %.1f s: re-syncing", download, self._epoch_seconds
            )
        self._last_resync = epoch
        resync_after_missed_round(self.optimizer, self.watchdog)

    def _time_epoch(self) -> None:
        now = time.monotonic()
        if self._epoch_ended is not None:
            seconds = now - self._epoch_ended
            mean = self._epoch_seconds
            self._epoch_seconds = seconds if mean is None else 0.7 * mean + 0.3 * seconds
        self._epoch_ended = now

    def learning_rate(self) -> float:
        return self.optimizer.opt.param_groups[0]["lr"]


def outer_momentum(optimizer: LeanHiveOptimizer) -> List[torch.Tensor]:
    """--sync_mode local: the outer optimizer's momentum buffers (none before its first step, or without momentum),
    in parameter order."""
    outer = optimizer.state_averager.optimizer
    buffers = [outer.state.get(p, {}).get("momentum_buffer") for g in outer.param_groups for p in g["params"]]
    return [buffer for buffer in buffers if buffer is not None]


class LocalTraining:
    """``--sync_mode local``: this peer's own inner LAMB after every local step, the swarm's outer step per round."""

    def __init__(
        self,
        *,
        optimizer: LeanHiveOptimizer,
        model: torch.nn.Module,
        inner_optimizer: torch.optim.Optimizer,
        agreement: RoundAgreement,
        optimizer_args: OptimizerArguments,
        batch_size_per_step: int,
        stop_requested: threading.Event,
    ):
        self.optimizer, self.model, self.inner_optimizer = optimizer, model, inner_optimizer
        self.agreement, self.optimizer_args = agreement, optimizer_args
        self.batch_size_per_step, self.stop_requested = batch_size_per_step, stop_requested
        self._state_loads_seen = optimizer.state_loads  # a state loaded while joining: the first round follows
        self._partial_rounds_seen = self._partial_rounds()

    @classmethod
    def build(
        cls,
        *,
        optimizer: LeanHiveOptimizer,
        model: torch.nn.Module,
        dht: hivemind.DHT,
        run_id: str,
        public_key: bytes,
        client_mode: bool,
        collab: CollaborationArguments,
        optimizer_args: OptimizerArguments,
        batch_size_per_step: int,
        stop_requested: threading.Event,
    ) -> "LocalTraining":
        agreement = RoundAgreement(
            dht,
            run_id,
            public_key,
            optimizer.grad_averager.shared_parameters,
            outer_state=lambda: outer_momentum(optimizer),
            votes=not client_mode,  # a client cannot serve its state: it follows the vote
            tolerance=tolerance_for(collab.compression),
            # a failed attempt ends when its wait does, up to this long after the others' all-reduce ended
            missed_round_seconds=collab.matchmaking_time + 2 * collab.averaging_timeout,
        )
        return cls(
            optimizer=optimizer,
            model=model,
            inner_optimizer=make_inner_optimizer(model, optimizer_args),
            agreement=agreement,
            optimizer_args=optimizer_args,
            batch_size_per_step=batch_size_per_step,
            stop_requested=stop_requested,
        )

    def before_step(self) -> None:
        """The last round's agreement check runs ``SETTLE_SECONDS`` after it (the others' fingerprints must arrive
        first), and at the latest before the next round's all-reduce, whose pseudo-gradient must start from the
        agreed state: with rounds of seconds (tests, tiny models) the next round would otherwise begin inside
        hivemind's step, and every repair would come one round late. With rounds of minutes this never waits."""
        if not self.agreement.pending():
            return
        wait = self.agreement.seconds_until_due()
        if wait > 0:
            next_round = self.optimizer.tracker.estimated_next_update_time - get_dht_time()
            if next_round > wait + ROUND_START_MARGIN:
                return  # due well before the next round: checked at a later step
            self.stop_requested.wait(wait)
        self._follow_agreement()

    def step(self, grad_scaler: Optional[hivemind.GradScaler] = None) -> None:
        if grad_scaler is not None:
            raise ValueError("--sync_mode local does not support fp16 yet: use --precision bf16 or fp32")
        # this peer's own step now; hivemind only counts the samples toward the round
        set_inner_learning_rate(self.inner_optimizer, self.optimizer.local_epoch, self.optimizer_args)
        self.inner_optimizer.step()
        self.discard_step()
        self.optimizer.step(batch_size=self.batch_size_per_step)

    def discard_step(self) -> None:
        self.model.zero_grad(set_to_none=False)  # hivemind refuses zero_grad with the averager's reuse_grad_buffers

    def end_epoch(self) -> None:
        # a missed round was dropped (LeanHiveOptimizer._missed): this peer downloads the state of the peers whose
        # round fingerprints differ from its own (they made the round), or the swarm's where it finds none
        missed, self.optimizer.missed_round = self.optimizer.missed_round, False
        if missed:
            events.emit("round_missed", epoch=self.optimizer.local_epoch)
            logger.warning(
                "Missed the all-reduce before round %d: dropped this round's local steps (no outer step alone)",
                self.optimizer.local_epoch,
            )
        if self.agreement.pending():  # the previous round's check, when this round was shorter than its wait
            self._follow_agreement()
        loads = self.optimizer.state_loads
        self.agreement.round_ended(
            self.optimizer.local_epoch, state_replaced=loads != self._state_loads_seen, missed=missed
        )
        self._state_loads_seen = loads
        partial_rounds = self._partial_rounds()
        partial, self._partial_rounds_seen = partial_rounds != self._partial_rounds_seen, partial_rounds
        if missed or partial:
            # its shared parameters may not be the swarm's of this epoch: one outer step behind the peers that made
            # the round, or apart from them by a groupmate's contribution it lacks. A joiner that counted it among
            # its donors found their states different and took one donor's, perhaps this one (issue 30). The round
            # agreement tells; its state is served again once that was followed (_follow_agreement).
            why = "it dropped its last round" if missed else "its last round lacked a groupmate's contribution"
            self.optimizer.state_averager.withhold_state(
                f"{why}; its round agreement tells whether it holds the swarm's"
            )
        if missed:
            # at once, not SETTLE_SECONDS later: the peers that made the round ended it before this peer's attempt
            # gave up, so their fingerprints are there. With none, nobody that serves its state made the round and
            # nothing is loaded: clients publish no records, but none takes a round with aux peers alone while
            # others train (``_PolicyAveraging._others_data_needed``), and clients that made it together hold a
            # state nobody can serve (they follow this peer's record of the next round). Taking the swarm's state
            # here (an aux's, which applies no round in this mode) cost each peer a download of seconds, after
            # which a trainer and a client met in no group for the rest of a run
            self._follow_agreement()

    def learning_rate(self) -> float:
        return self.inner_optimizer.param_groups[0]["lr"]

    def _partial_rounds(self) -> int:
        """Rounds the averager took without every groupmate's contribution (sparse rounds count them)."""
        counter = getattr(self.optimizer.grad_averager, "partial_results", None)
        return 0 if counter is None else counter.value

    def _follow_agreement(self) -> None:
        """Read the last round's fingerprints; if this peer's shared parameters lost the vote, download the state
        of a peer that won it (once; peer.swarm.agreement). Its state is served again after: the winners' or its
        own, which agreed (or, the download failed, which the next round pulls toward the others')."""
        state_averager = self.optimizer.state_averager
        try:
            epoch, sources = self.agreement.check()
            if not sources:
                return
            state_averager.withhold_state(
                f"its shared parameters lost the round vote of epoch {epoch}; it takes the winners'"
            )
            loaded = self.optimizer.load_state_checked(only_from=frozenset(sources))
        finally:
            state_averager.serve_state_again()
        if loaded:
            events.emit(
                "state_loaded", epoch=self.optimizer.local_epoch, source="swarm", reason="disagreement", path=None
            )
        else:
            logger.warning("Could not download the state that won the vote of epoch %d: training on", epoch)
