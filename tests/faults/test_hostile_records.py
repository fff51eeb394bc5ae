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
