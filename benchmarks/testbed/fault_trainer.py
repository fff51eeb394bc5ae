"""The trainer with test fault hooks: ``run_trainer.py`` plus the env-driven faults of
``benchmarks.testbed.faults.injection`` (NaN gradients/parameters, scaled or non-finite gradients on the wire, death in
the middle of an all-reduce, per-epoch parameter dumps).

Tests start it instead of ``run_trainer.py`` (``benchmarks.testbed.trainers.start_trainer`` does so whenever the
environment it is given holds a fault variable), from the repository root::

    python -m benchmarks.testbed.fault_trainer --config tiny ...   # same flags as run_trainer.py

Production code has no fault hooks: this entry point subclasses the trainer and puts its faulty averagers in
``peer.swarm.optimizer.GRADIENT_AVERAGERS`` (which nothing else changes) before it builds the peer.
"""

from __future__ import annotations

import sys
from functools import partial
from typing import Optional, Sequence

import torch

import peer.cli
from benchmarks.testbed.faults import injection
from benchmarks.testbed.hivemind_faults import AllReduceFaults
from peer.swarm import optimizer, process_guard
from peer.swarm.hivemind_seam import LeanHiveGradientAverager, PseudoGradientAverager, SparsePseudoGradientAverager
from peer.swarm.lifecycle import configure_logging, run_peer
from peer.trainer import TrainerPeer


class _FaultHooks(AllReduceFaults):
    """What this peer sends for averaging may be scaled or non-finite; it may SIGKILL itself mid all-reduce (the
    first base of both faulty averagers below)."""

    @torch.no_grad()
    def load_accumulators_into_averager_(self):
        super().load_accumulators_into_averager_()
        injection.corrupt_sent_gradients(self)

    def schedule_step(self, *args, **kwargs):
        # a broken round is not retried: hivemind's retry (until the step's deadline) joins whatever group forms
        # next, which is the others' round of the next epoch, and the test of a missed round wants the round missed
        if injection.fails_allreduce_rounds():
            kwargs.setdefault("allow_retries", False)
        return super().schedule_step(*args, **kwargs)

    def sits_out_step(self) -> bool:
        return injection.sits_out_step()

    def before_allreduce(self, tensors, kwargs: dict) -> None:
        injection.maybe_die_in_allreduce_rounds(self)
        injection.maybe_fail_allreduce()
        if "weight" in kwargs:
            kwargs["weight"] = injection.weight_to_send(kwargs["weight"])
        injection.maybe_send_bad_shapes()
        self._sent = injection.snapshot_sent(tensors)

    def after_allreduce(self, tensors, error) -> None:
        injection.record_averaging(self._sent, tensors, error=error)


# hivemind names an averager's RPC handlers after its class ("<prefix>::<class name>.rpc_join_group", ...): with
# the production name a faulty peer averages with peers started from run_trainer.py, as it did when the fault
# hooks lived in the production class.
class FaultyGradientAverager(_FaultHooks, LeanHiveGradientAverager):
    pass


class FaultyPseudoGradientAverager(_FaultHooks, PseudoGradientAverager):
    """--sync_mode local: the pseudo-gradients sent may be corrupted the same way."""


class FaultySparsePseudoGradientAverager(_FaultHooks, SparsePseudoGradientAverager):
    """--outer_compression sparse: the pseudo-gradients are corrupted before they are compressed."""


FaultyGradientAverager.__name__ = LeanHiveGradientAverager.__name__
FaultyPseudoGradientAverager.__name__ = PseudoGradientAverager.__name__
FaultySparsePseudoGradientAverager.__name__ = SparsePseudoGradientAverager.__name__


FAULTY_AVERAGERS = {
    "sync": FaultyGradientAverager,
    "local": FaultyPseudoGradientAverager,
    "local_sparse": FaultySparsePseudoGradientAverager,
}
"""What ``main`` puts in ``peer.swarm.optimizer.GRADIENT_AVERAGERS``, per --sync_mode (and outer compression)."""


class FaultyTrainerPeer(TrainerPeer):
    def _accumulate_gradients(self) -> float:
        loss_sum = super()._accumulate_gradients()
        injection.maybe_corrupt_gradients(self.model, self.counters.local_step)  # before the trainer's finiteness check
        return loss_sum

    def _after_update(self, new_epoch: int) -> None:
        # labelled by the epoch the parameters are at now: a state loaded in end_epoch (a missed round's re-sync)
        # may carry a later epoch than the round's, and then this peer ends no round labelled with that epoch
        injection.maybe_save_parameters(self.model, self.optimizer.local_epoch)
        injection.maybe_corrupt_parameters(self.model, new_epoch)
        super()._after_update(new_epoch)  # NaN/inf check and recovery, periodic backup


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``peer.cli.main`` with the faulty averagers and ``FaultyTrainerPeer``."""
    config = peer.cli.parse_config(argv)
    optimizer.GRADIENT_AVERAGERS.update(FAULTY_AVERAGERS)  # before any averager process is forked
    configure_logging()
    process_guard.install()  # before any hivemind process exists
    return run_peer(partial(FaultyTrainerPeer.build, config), events_file=config.events.events_file)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
