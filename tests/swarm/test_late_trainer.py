"""A sync trainer that comes to its epoch's end after the others took its round without it leaves its matchmaking at
once and takes the round's result from them (``LeanHiveOptimizer._leave_round_taken_without_this_peer``,
round_result.py's probe): real hivemind optimizers, each with its own DHT and averager processes, on loopback."""

from __future__ import annotations

import contextlib
import time
from typing import Iterator

import pytest
import torch

from peer.swarm.config import CollaborationArguments, OptimizerArguments
from tests.support.optimizers import backward_on, end_epoch_together, loopback_optimizers, seeded_mlp


@contextlib.contextmanager
def _sync_trainers(collab: CollaborationArguments, run_id: str, count: int) -> Iterator[list]:
    """``count`` real sync-mode optimizers on 127.0.0.1 with the same initial parameters, as --init_seed gives:
    ``[(model, optimizer), ...]``."""
    models = [seeded_mlp() for _ in range(count)]
    optim = OptimizerArguments(learning_rate=1e-2, warmup_steps=0, total_steps=100, lr_schedule="constant")
    with loopback_optimizers(
        models, collab=collab, optim=optim, run_id=run_id, batch_size_per_step=LATE_BATCH
    ) as optimizers:
        yield list(zip(models, optimizers))


LATE_BATCH = 8


def _two_end_epoch_zero_without(late, *two) -> None:
    """Both trainers of ``two`` (``(model, optimizer)``) end epoch 0 and average it; ``late`` then sees the swarm at
    epoch 1 while it is still at epoch 0."""
    end_epoch_together(two, LATE_BATCH)
    assert [o.local_epoch for _, o in two] == [1, 1] and not two[0][1].missed_round
    deadline = time.monotonic() + 30
    while late.tracker.global_epoch < 1 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert late.tracker.global_epoch == 1 and late.local_epoch == 0


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_trainer_that_comes_after_the_others_took_its_round_takes_its_result_without_waiting_out_matchmaking():
    """Sync mode, three trainers: two end the epoch and average it while the third has not reached its epoch's end.
    When it does, that round began (and ended) without it. It leaves its own matchmaking at once (it asks the others
    whether they hold the round's result: ``LeanHiveOptimizer._leave_round_taken_without_this_peer``) and steps with
    the result the two took, in the same epoch. It used to wait out its matchmaking window (``averaging_timeout``)
    first: on the home testbed that made a late volunteer late for every later round too."""
    collab = CollaborationArguments(
        target_batch_size=2 * LATE_BATCH,
        matchmaking_time=1.0,
        averaging_timeout=20.0,
        compression="none",
        average_state_every=1000,  # no state averaging round: the time below is the gradient round's alone
    )
    with _sync_trainers(collab, "late_trainer", 3) as trainers:
        (first_model, first), (second_model, second), (late_model, late) = trainers
        for _, optimizer in trainers:
            assert optimizer.tracker.fetched_global_progress_this_epoch.wait(timeout=30)
        # its first step while the swarm is at its epoch: hivemind's once-per-epoch strict check passes (a trainer
        # on another epoch than the swarm's downloads the state instead)
        backward_on(late_model, seed=2, batch=LATE_BATCH)
        late.step(batch_size=1)

        _two_end_epoch_zero_without(late, (first_model, first), (second_model, second))

        began = time.monotonic()
        late.step(batch_size=0)  # its epoch's end: the others' round is over
        took = time.monotonic() - began
        assert late.local_epoch == 1 and late.repaired_rounds == 1 and not late.missed_round
        assert took < collab.averaging_timeout / 2, took  # it did not wait out its matchmaking window
        for got, want in zip(late_model.parameters(), first_model.parameters()):
            torch.testing.assert_close(got.detach(), want.detach(), rtol=0, atol=0)


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_trainer_whose_download_ended_after_the_round_of_its_epoch_takes_that_round_instead_of_downloading_again():
    """Sync mode, three trainers: the third downloads the state of epoch 0, and the other two then take round 0. Its
    state is one epoch behind theirs. It takes round 0's result from them, the same step, instead of downloading the
    whole state again (``LeanHiveOptimizer._takes_round_of_downloaded_epoch``): hivemind's once-per-epoch strict
    check downloaded again, and a home joiner whose downloads took about an epoch each downloaded five times in a
    row."""
    collab = CollaborationArguments(
        target_batch_size=2 * LATE_BATCH,
        matchmaking_time=1.0,
        averaging_timeout=20.0,
        compression="none",
        average_state_every=1000,
    )
    with _sync_trainers(collab, "downloaded_late", 3) as trainers:
        (first_model, first), (second_model, second), (late_model, late) = trainers
        for _, optimizer in trainers:
            assert optimizer.tracker.fetched_global_progress_this_epoch.wait(timeout=30)
        assert late.load_state_checked() and late.local_epoch == 0
        loads = late.state_loads

        _two_end_epoch_zero_without(late, (first_model, first), (second_model, second))

        backward_on(late_model, seed=2, batch=LATE_BATCH)
        late.step(batch_size=1)
        assert late.state_loads == loads, "it downloaded the whole state again"
        assert late.local_epoch == 1 and late.repaired_rounds == 1 and not late.missed_round
        for got, want in zip(late_model.parameters(), first_model.parameters()):
            torch.testing.assert_close(got.detach(), want.detach(), rtol=0, atol=0)
