"""A peer whose records are properly signed but hostile (progress, metrics, squatted keys), with real processes.

An aux peer and two trainers train on the tiny preset; then a rogue process (benchmarks/testbed/rogue_records.py) keeps
writing signed progress records with ``epoch=10**12``, ``samples_per_second=1e300`` and a ``time`` a week ahead,
metrics records with a huge epoch or a future time, and squats the state-sharing and matchmaking keys with plain
values that expire in ten years; a third trainer joins. The swarm must not notice: the trainers reach max_epochs
without re-downloading the state, every poisoned epoch still gathers about target_batch_size samples, the joiner
downloads the state, and the aux peer's dashboard shows the honest epoch and only the honest trainers. The run is
fault scenarios p and q (benchmarks/testbed/faults/hostile_records.py).
"""

from __future__ import annotations

import pytest

from benchmarks.testbed.faults.hostile_records import POISONING_CHECKS, SQUATTING_CHECKS, hostile_records

pytestmark = pytest.mark.slow


@pytest.mark.timeout(420)
def test_signed_hostile_records_and_squatted_keys_change_nothing(tmp_path):
    poisoning, squatting = hostile_records(tmp_path)
    for result, names in ((poisoning, POISONING_CHECKS), (squatting, SQUATTING_CHECKS)):
        for name in names:
            assert result.details["checks"][name], f"{result.scenario}: {name}: {result.details}"
        assert result.survived and not result.data_lost, result.details


@pytest.mark.timeout(300)
def test_a_record_far_behind_does_not_hand_a_lone_trainer_its_state(tmp_path):
    """A rogue's progress record at epoch 0 beside a lone honest trainer is half the votes (the lower median is the
    rogue's): the trainer does not take itself for apart from the swarm, and trains on from its own epoch."""
    from benchmarks.testbed.aux import RUN_ID, swarm_processes
    from benchmarks.testbed.faults.hostile_records import start_rogue
    from benchmarks.testbed.trainers import start_trainer, wait_for_epoch

    with swarm_processes() as procs:
        trainer = start_trainer(tmp_path, "lone", RUN_ID)
        procs.append(trainer)
        addrs = trainer.initial_peers(timeout=120)
        before = wait_for_epoch(trainer, 8, timeout=180)
        rogue = start_rogue(tmp_path, addrs, "--behind", "--period", "1")
        procs.append(rogue)
        assert rogue.events.wait("rogue_ready", timeout=60)["accepted"] > 0
        wait_for_epoch(trainer, before + 2 * 8, timeout=120)  # many of its fetches saw the rogue's record
        assert "trained apart" not in trainer.log()
        assert not trainer.events.all("state_loaded", where=lambda e: e["reason"] == "rejoin")
        epochs = [int(e["epoch"]) for e in trainer.events.all("epoch_done")]
        assert epochs == sorted(epochs)  # never went back
