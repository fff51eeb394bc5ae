"""The aux peer's replica of the swarm's state with a real trainer and a real auxiliary hivemind.Optimizer in process
(127.0.0.1)."""

from __future__ import annotations

import time

import pytest
import torch

from aux_monitor.replica import SwarmReplica
from benchmarks.testbed.processes import share_tensors_by_file_descriptor
from tests.support.optimizers import peer_on

RUN_ID = "replica"


def _train_alone(model: torch.nn.Module, opt, epochs: int) -> None:
    """Steps a lone trainer to ``epochs`` (one batch of 4 per epoch; with nobody to average with, it steps alone)."""
    while opt.local_epoch < epochs:
        model(torch.randn(4, 8)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()


def _wait(condition, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


@pytest.mark.timeout(180)
def test_an_aux_behind_the_swarms_epoch_moves_its_label_without_beginning_a_round():
    """An aux whose label is behind the swarm's epoch (a state downloaded while its donor's round ran) would have
    hivemind begin its round at once, before the trainers' epoch ends, and as their reducer ban them. Its label is
    moved to the swarm's epoch before hivemind's step, and its state is no longer offered (its parameters are not
    that epoch's). An anchoring aux (it holds the swarm's state itself) keeps hivemind's catch-up."""
    share_tensors_by_file_descriptor()
    dht, model, trainer = peer_on(RUN_ID)
    peers = [(dht, trainer)]
    try:
        _train_alone(model, trainer, epochs=3)
        aux_dht, aux_model, aux_opt = peer_on(RUN_ID, dht.get_visible_maddrs(), auxiliary=True)
        peers.append((aux_dht, aux_opt))
        replica = SwarmReplica(model=aux_model, optimizer=aux_opt)
        _wait(lambda: aux_opt.tracker.global_epoch == 3, 60, "the aux to see the trainer's epoch")
        labels = []  # the aux's label when hivemind's step (which begins a round if the label is behind) runs
        step = aux_opt.step
        aux_opt.step = lambda *args, **kwargs: labels.append(aux_opt.local_epoch) or step(*args, **kwargs)

        replica.assist_step()
        assert labels == [3] and aux_opt.local_epoch == 3
        assert not aux_opt.state_averager.allow_state_sharing

        _train_alone(model, trainer, epochs=5)
        _wait(lambda: aux_opt.tracker.global_epoch == 5, 60, "the aux to see the trainer's next epochs")
        replica.assist_step(anchoring=True)
        assert labels == [3, 3]  # hivemind's step saw the label behind: it catches up by itself
    finally:
        for peer_dht, opt in reversed(peers):
            opt.shutdown()
            peer_dht.shutdown()
