"""The fault scenarios that run on loopback: bad DHT records (g), authorization (h), damaged checkpoint and
backup files (i). Real hivemind peers on 127.0.0.1; no root needed; about 1-2 minutes in all.

The scenarios live in benchmarks/testbed/faults/scenarios.py; ``python -m benchmarks.faults`` prints them as a table.
"""

from __future__ import annotations

import pytest

from benchmarks.testbed.faults import scenarios


def _explain(result) -> str:
    return f"{result.scenario}: {result.details}"


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_g_bad_dht_records_are_refused(tmp_path):
    result = scenarios.bad_dht_records(tmp_path)
    checks = result.details["checks"]
    assert checks["every bad record was refused by both honest peers"], _explain(result)
    assert checks["a valid signed record sent the same way is accepted"], _explain(result)
    assert checks["honest peers see only the genuine metrics"], _explain(result)
    assert checks["the swarm's epoch was not inflated"], _explain(result)
    assert result.survived and not result.data_lost


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_h_peer_without_credentials_can_neither_store_metrics_nor_join_averaging(tmp_path):
    result = scenarios.authorization(tmp_path)
    checks = result.details["checks"]
    assert checks["the stranger's metrics were stored nowhere"], _explain(result)
    assert checks["the stranger's store request got no answer"], _explain(result)
    assert checks["the stranger may not"], _explain(result)  # download state, join averaging
    assert checks["a listed peer may download the state and ask to join averaging"], _explain(result)
    assert checks["a trainer without credentials cannot join (clear error)"], _explain(result)
    assert checks["an unlisted trainer is told to get listed"], _explain(result)
    assert result.survived, _explain(result)


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_i_damaged_checkpoints_and_backups_are_reported_and_the_last_good_one_used(tmp_path):
    result = scenarios.corrupt_files(tmp_path)
    assert result.survived and not result.data_lost, _explain(result)
    for case, outcome in result.details["backups"].items():
        if case != "both damaged":
            assert outcome["restored"] and outcome["epoch"] == 1, (case, outcome)
    assert not result.details["backups"]["both damaged"]["restored"]
    for case, outcome in result.details["checkpoints"].items():
        if case != "after three more checkpoints":
            assert outcome["loaded_epoch"] == 4, (case, outcome)
    assert "epoch_000006" in result.details["checkpoints"]["after three more checkpoints"]
