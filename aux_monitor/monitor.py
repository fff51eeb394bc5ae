"""The aux peer's periodic work: read metrics, and when due, take the swarm's state to checkpoint/evaluate/upload.

Every part it drives (DHT, replica, checkpoint manager, uploader, validation set) is built and shut down
by the entry point; this class only decides what to do at each refresh.
"""

from __future__ import annotations

import logging
import math
import statistics
import threading
import time
from typing import Optional, Sequence

import hivemind
from hivemind.optim.progress_tracker import LocalTrainingProgress
from hivemind.utils import get_dht_time

from aux_monitor.aggregation import MetricsAggregator
from aux_monitor.arguments import AuxArguments
from aux_monitor.checkpoints import CheckpointError, CheckpointManager, TrainingState
from aux_monitor.evaluation import evaluate
from aux_monitor.hub import HubUploader
from aux_monitor.replica import SwarmReplica
from aux_monitor.sampler import CheckpointSampler
from aux_monitor.state import StateHolder
from peer.swarm import events
from peer.swarm.keys import progress_key
from peer.swarm.records import fetch_metrics, read_progress

logger = logging.getLogger(__name__)

ASSIST_MODES = ("always", "auto", "never")
CLIENT_PROGRESS_WINDOW = 60.0  # seconds: a client-mode trainer's progress record is refreshed more often
WATCH_PERIOD = 2.0
"""Seconds between looks for client-mode trainers while not assisting: they average from their first epoch (a few
seconds on the tiny preset), and refresh_period (10 s) let their first rounds fail for want of a reducer."""
FOLLOW_GAP = 2
"""An anchoring aux takes its client trainers' epoch when they are this many epochs ahead (``SwarmReplica.follow``)."""
ANCHOR_PROGRESS_EXPIRATION = 60.0  # hivemind's progress records live as long; an anchoring aux renews it each refresh


def is_due(epoch: int, last_done: Optional[int], every: int) -> bool:
    """True when ``epoch`` has crossed a multiple of ``every`` since ``last_done`` (or nothing was done yet)."""
    if every <= 0 or epoch <= 0:
        return False
    return last_done is None or epoch // every > last_done // every


class AuxMonitor:
    def __init__(
        self,
        *,
        dht: hivemind.DHT,
        run_id: str,
        args: AuxArguments,
        holder: StateHolder,
        replica: SwarmReplica,
        checkpoints: Optional[CheckpointManager] = None,
        uploader: Optional[HubUploader] = None,
        validation: Optional[Sequence[dict]] = None,
        sampler: Optional[CheckpointSampler] = None,
        assist: Optional[str] = None,
        public_key: Optional[bytes] = None,
    ):
        self.dht, self.run_id, self.args, self.holder = dht, run_id, args, holder
        # always / auto (while client-mode trainers are online) / never; from --assist_in_averaging by default
        self.assist = assist or {True: "always", False: "never", None: "auto"}[args.assist_in_averaging]
        if self.assist not in ASSIST_MODES:
            raise ValueError(f"assist must be one of {', '.join(ASSIST_MODES)}, got {self.assist!r}")
        self.clients_online = threading.Event()  # client-mode trainers reported progress recently
        self.anchoring = False  # only client trainers are online: this aux's own state is the swarm's
        self._watching = threading.Lock()  # the refresh and the assist loop both look for trainers
        self.public_key = public_key  # the subkey of this aux's signed records (its progress record when anchoring)
        self.replica, self.checkpoints, self.uploader, self.validation = replica, checkpoints, uploader, validation
        self.sampler = sampler
        self.aggregator = MetricsAggregator(alive_window=args.alive_window)
        self.last_checkpoint_epoch: Optional[int] = None
        self.last_eval_epoch: Optional[int] = None
        self._last_logged_epoch: Optional[int] = None
        self.trainers_online = threading.Event()  # assisting only makes sense while trainers are averaging
        self._serving_checkpoint = False  # an assisting aux restored a checkpoint for an empty swarm
        if (args.eval_every > 0) != (validation is not None):
            raise ValueError("pass a validation set exactly when eval_every > 0")

    # ------------------------------------------------------------------ resume
    def resume(self) -> bool:
        """Load the newest valid checkpoint into the replica and offer it to joining trainers."""
        loaded = self.checkpoints.load_newest_valid()
        if loaded is None:
            logger.warning(
                "--resume: no valid checkpoint in %s; waiting for the trainers' state instead",
                self.checkpoints.directory,
            )
            return False
        self.replica.restore(loaded.state)
        self.last_checkpoint_epoch = loaded.state.epoch
        self.holder.update(checkpoint=loaded.info())
        if self.sampler is not None:
            self.sampler.submit(loaded.info())
        logger.info("Resumed from %s (epoch %d)", loaded.path, loaded.state.epoch)
        events.emit(
            "state_loaded", epoch=loaded.state.epoch, source="checkpoint", reason="resume", path=str(loaded.path)
        )
        return True

    # ------------------------------------------------------------------ one refresh
    def refresh(self) -> None:
        records = fetch_metrics(self.dht, self.run_id, timeout=max(5.0, self.args.refresh_period))
        tracked = self._tracked_epoch()
        snapshot = self.aggregator.update(records, now=get_dht_time(), swarm_epoch=tracked)
        self.holder.update(swarm=snapshot)
        if snapshot.global_epoch is not None:
            # one line per new epoch at INFO; every refresh at DEBUG
            level = logging.INFO if snapshot.global_epoch != self._last_logged_epoch else logging.DEBUG
            self._last_logged_epoch = snapshot.global_epoch
            logger.log(
                level,
                "Epoch %d: %d peers online, loss %s, %.1f samples/s",
                snapshot.global_epoch,
                snapshot.alive_peers,
                "n/a" if snapshot.loss is None else f"{snapshot.loss:.4f}",
                snapshot.samples_per_second,
            )

        if self.assist != "never":
            self._watch_trainers()
        if snapshot.alive_peers > 0 or self.clients_online.is_set():  # clients publish metrics after an epoch
            self.trainers_online.set()
            self._serving_checkpoint = False
        else:
            self.trainers_online.clear()
            self._serve_checkpoint_when_empty()

        # the epoch a state is served at, not the newest any metrics record names: a trainer an epoch ahead, or the
        # last epoch of trainers that crashed, is an epoch no donor serves, and aiming at it downloaded the same
        # state again at every refresh (tests/aux/test_swarm.py: each second for a minute)
        epoch = tracked if tracked is not None else (snapshot.global_epoch or 0)
        want_checkpoint = self.checkpoints is not None and is_due(
            epoch, self.last_checkpoint_epoch, self.args.checkpoint_every
        )
        want_eval = is_due(epoch, self.last_eval_epoch, self.args.eval_every)
        if not (want_checkpoint or want_eval):
            return
        with self.replica.exclusive():  # no assist step touches the state between its download and its copy
            held = self.replica.held_epoch
            # an assisting aux's parameters take part in averaging rounds: a failed round leaves them apart from the
            # swarm's, and only a download brings them back. One that took every round's step since its last
            # download holds the swarm's state (it offers it to joiners): downloading it again, while it led a
            # round's group, held the lock its assist step needs and the round was lost for every peer (home
            # testbed b). (An anchoring aux holds the swarm's state itself: nobody else could send it.)
            stale = held is None or held < epoch or (self.should_assist() and not self.replica.fresh)
            if not self.anchoring and stale:
                held = self.replica.download()
                if held is None:
                    logger.warning(
                        "No trainer sent the swarm's state (epoch %d); trying again at the next refresh", epoch
                    )
                    return
                logger.info("Downloaded the swarm's state of epoch %d", held)
                events.emit("state_loaded", epoch=held, source="swarm", reason="refresh", path=None)
            eval_due = want_eval and is_due(held, self.last_eval_epoch, self.args.eval_every)
            checkpoint_due = want_checkpoint and is_due(held, self.last_checkpoint_epoch, self.args.checkpoint_every)
            if not (eval_due or checkpoint_due):
                return
            # a copy: evaluating and writing it take long, and the assist steps go on meanwhile
            state = self.replica.capture(loss=snapshot.loss, taken_at=time.time())
        # evaluation first: the checkpoint then records this epoch's validation loss among the run's facts
        if eval_due:
            self._evaluate(state)
        if checkpoint_due:
            self._checkpoint(state)

    def _watch_trainers(self) -> None:
        """Who needs this aux: client-mode trainers need a reducer (``--assist_in_averaging`` default: assist while
        they are online), and a swarm of client trainers only needs a state holder too (``anchoring``)."""
        with self._watching:
            self._look_for_trainers()

    def _look_for_trainers(self) -> None:
        now, own = get_dht_time(), self.dht.peer_id.to_bytes()
        fresh = [
            r
            for r in read_progress(self.dht, self.run_id, timeout=5.0)
            if now - r.time <= CLIENT_PROGRESS_WINDOW and r.peer_id != own
        ]
        clients = [r for r in fresh if r.client_mode]
        if clients and not self.clients_online.is_set():
            logger.info("Assisting in averaging: %d client-mode trainer(s) online need a reachable peer", len(clients))
            events.emit("assisting", clients=len(clients))
        elif not clients and self.clients_online.is_set():
            logger.info("No client-mode trainer online: no longer assisting in averaging")
            events.emit("assisting", clients=0)
        (self.clients_online.set if clients else self.clients_online.clear)()
        anchoring = bool(clients) and not any(not r.client_mode for r in fresh)
        if anchoring != self.anchoring:
            if anchoring:
                logger.info(
                    "Only client-mode trainers are online: this aux peer holds and serves the swarm's state (epoch %d)",
                    self.replica.optimizer.local_epoch,
                )
            else:
                logger.info("A trainer that serves its state is online: this aux peer no longer holds the state")
            events.emit("anchoring", on=anchoring)
        self.anchoring = anchoring
        if anchoring:
            # the lower median: one client alone cannot move the swarm's state to an epoch the others never reached
            ahead = statistics.median_low([r.epoch for r in clients])
            held = self.replica.optimizer.local_epoch
            # one epoch ahead is a round this aux is finishing too (hivemind catches up by one itself)
            if ahead >= held + FOLLOW_GAP and self.replica.follow(ahead):
                logger.info(
                    "The client-mode trainers went on to epoch %d without this aux peer: it holds the state at that "
                    "epoch now (was %d)",
                    ahead,
                    held,
                )
                events.emit("anchoring", on=True, epoch=ahead)
            self.replica.anchor()
            self._report_progress()

    def _report_progress(self) -> None:
        """An anchoring aux's progress record: the epoch of the state it serves. Client trainers take their epoch
        consensus from serving peers' records, and hivemind never publishes one for an auxiliary peer (it reports
        only after accumulating samples)."""
        if self.public_key is None:
            return
        now = get_dht_time()
        record = LocalTrainingProgress(
            peer_id=self.dht.peer_id.to_bytes(),
            epoch=self.replica.optimizer.local_epoch,
            samples_accumulated=0,
            samples_per_second=0.0,
            time=now,
            client_mode=False,
        )
        self.dht.store(
            progress_key(self.run_id),
            record.dict(),
            expiration_time=now + ANCHOR_PROGRESS_EXPIRATION,
            subkey=self.public_key,
            return_future=True,
        )

    def should_assist(self) -> bool:
        if self.assist == "never" or not self.trainers_online.is_set():
            return False
        return self.assist == "always" or self.clients_online.is_set()

    def _tracked_epoch(self) -> Optional[int]:
        """The progress tracker's epoch, a consensus of the trainers' progress records that no single peer moves;
        None while no trainer reports progress (the metrics records' median is the reference then)."""
        tracker = self.replica.optimizer.tracker
        return self.replica.swarm_epoch if tracker.global_progress.num_peers > 0 else None

    def _serve_checkpoint_when_empty(self) -> None:
        """With no trainer online, an assisting aux offers its newest verified checkpoint to joining trainers.

        Its in-memory parameters cannot be offered: averaging rounds touch them, and a round cut short by
        trainers that died leaves them broken. (A non-assisting aux never steps, so it keeps offering the
        state it downloaded last.)
        """
        if self.assist == "never" or self.checkpoints is None or self._serving_checkpoint:
            return
        loaded = self.checkpoints.load_newest_valid()
        if loaded is None:
            return
        self.replica.restore(loaded.state)
        self._serving_checkpoint = True
        logger.info(
            "No trainer online: offering the checkpoint of epoch %d (%s) to joining trainers",
            loaded.state.epoch,
            loaded.path,
        )
        events.emit("offering_checkpoint", epoch=loaded.state.epoch)

    def _checkpoint(self, state: TrainingState) -> None:
        state.facts = self._run_facts()
        try:
            info = self.checkpoints.save(state)
        except CheckpointError as e:
            logger.error(
                "The checkpoint of epoch %d did not verify and was not promoted (%s); "
                "the previous checkpoints are untouched",
                state.epoch,
                e,
            )
            return
        self.last_checkpoint_epoch = state.epoch
        self.holder.update(checkpoint=info)
        if self.uploader is not None:
            self.uploader.submit(info)
        if self.sampler is not None:
            self.sampler.submit(info)

    def _run_facts(self) -> dict:
        """What a model card says about the run (see aux_monitor/export.py); JSON-safe."""
        current = self.holder.get()
        facts = dict(run_id=self.run_id, samples_seen=current.swarm.samples_total)
        evaluation = current.evaluation
        if evaluation is not None and math.isfinite(evaluation.loss):
            facts.update(validation_loss=evaluation.loss, validation_epoch=evaluation.epoch)
        return facts

    def _evaluate(self, state: TrainingState) -> None:
        epoch = state.epoch
        result = evaluate(
            state.model,
            self.validation,
            epoch=epoch,
            batch_size=self.args.eval_batch_size,
            max_batches=self.args.eval_max_batches,
        )
        self.last_eval_epoch = epoch
        self.holder.update(evaluation=result)

    # ------------------------------------------------------------------ loops
    def run(self, stop: threading.Event) -> None:
        """Refresh every refresh_period until ``stop`` is set; a failed refresh is logged and retried."""
        while True:
            try:
                self.refresh()
            except Exception:
                logger.exception("Refresh failed; retrying in %.1f s", self.args.refresh_period)
            if stop.wait(self.args.refresh_period):
                return

    def _watch_for_clients(self) -> None:
        """Between refreshes: client-mode trainers that just started are trainers online that need this aux now."""
        try:
            self._watch_trainers()
        except Exception:
            logger.warning("Looking for client-mode trainers failed; trying again", exc_info=True)
            return
        if self.clients_online.is_set():
            self.trainers_online.set()

    def run_assist(self, stop: threading.Event) -> None:
        """Join the trainers' averaging rounds (the auxiliary optimizer's step) until ``stop`` is set."""
        next_watch = 0.0
        while not stop.wait(self.args.assist_refresh):
            if not self.should_assist():
                if self.assist != "never" and time.monotonic() >= next_watch:
                    next_watch = time.monotonic() + WATCH_PERIOD
                    self._watch_for_clients()
                continue
            try:
                self.replica.assist_step()
                if self.anchoring and self.replica.anchor():  # the step moved its epoch: it serves the new one
                    self._report_progress()
            except Exception:
                logger.exception("Assisting in averaging failed; trying again")
