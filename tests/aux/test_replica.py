"""The aux peer's replica of the swarm's state (aux_monitor/replica.py) with real hivemind optimizers in process:
two sync trainers and an aux, each with its own DHT and averager processes on 127.0.0.1."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from aux_monitor.replica import SwarmReplica
from peer.swarm.config import CollaborationArguments, OptimizerArguments
from tests.support.optimizers import end_epoch_together, loopback_optimizers, seeded_mlp

BATCH = 8


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_an_aux_whose_download_missed_the_trainers_round_does_not_offer_the_state_it_stepped():
    """The aux downloads the state of epoch 0, and the trainers then take round 0 without it. Its next assist step
    joins their round 1 and steps with that round's result: a state without round 0's step, which it used to offer
    to joiners (labelled epoch 1) and checkpoint. It no longer offers it (``SwarmReplica.assist_step``)."""
    # a 3 s matchmaking window: the aux joins the trainers' round 1 only once its tracker read their progress from the
    # DHT, and a CI run with five busy processes beside the suite failed this test once with a 1 s window
    collab = CollaborationArguments(
        target_batch_size=2 * BATCH, matchmaking_time=3.0, averaging_timeout=20.0, compression="none"
    )
    optim = OptimizerArguments(learning_rate=1e-2, warmup_steps=0, total_steps=100, lr_schedule="constant")
    models = [seeded_mlp() for _ in range(3)]
    with loopback_optimizers(
        models, collab=collab, optim=optim, run_id="replica_late", batch_size_per_step=BATCH, auxiliary=1
    ) as optimizers:
        trainers = list(zip(models[:2], optimizers[:2]))
        replica = SwarmReplica(model=models[2], optimizer=optimizers[2])
        for optimizer in optimizers:
            assert optimizer.tracker.fetched_global_progress_this_epoch.wait(timeout=30)
        assert replica.download() == 0 and replica.fresh

        end_epoch_together(trainers, BATCH)  # round 0, without the aux
        assert [o.local_epoch for _, o in trainers] == [1, 1]

        assisting = threading.Event()

        def assist():
            deadline = time.monotonic() + 90
            while replica.optimizer.local_epoch < 1 and time.monotonic() < deadline:
                assisting.set()
                replica.assist_step()
                time.sleep(0.05)

        aux_thread = threading.Thread(target=assist)
        aux_thread.start()
        assert assisting.wait(timeout=10)
        end_epoch_together(trainers, BATCH)  # round 1, with the aux
        aux_thread.join(timeout=90)
        assert [o.local_epoch for _, o in trainers] == [2, 2]
        assert replica.optimizer.local_epoch == 1
        assert replica.optimizer.state_averager.auxiliary_steps == 1, "the aux did not take the trainers' round 1"
        differs = any(not torch.equal(a, b) for a, b in zip(models[2].parameters(), models[0].parameters()))
        assert differs, "the aux's state after round 1 is the trainers' (round 0's step is in it)"
        assert not replica.fresh and not replica.optimizer.state_averager.allow_state_sharing
