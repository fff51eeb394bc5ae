"""The fault scenarios over emulated internet links (20 Mbit/s, 100 ms RTT; benchmarks/testbed/netem): trainers and
aux peers through a SIGKILL in an all-reduce, a partition, an aux restart, a swarm replaced, poisoned gradients, and
the --sync_mode local variants; each scenario with its bound.

Opt-in: ``python -m pytest -m faults`` (about 15 minutes on a 2-core machine, plus about 3 for the --sync_mode local
scenarios w, x, y; needs root and iproute2 for network namespaces). The default run leaves them out; the loopback
scenarios (test_scenarios_loopback.py), the watchdog and the robustness units always run.
``python -m benchmarks.faults`` runs the same scenarios and prints the results table.
"""

from __future__ import annotations

import pytest

from benchmarks.testbed.faults import scenarios

pytestmark = [pytest.mark.slow, pytest.mark.faults, pytest.mark.netns]


def _explain(result) -> str:
    return f"{result.scenario}: {result.details}"


@pytest.mark.timeout(480)
def test_a_three_trainers_and_aux_train_six_epochs_over_internet_links(tmp_path):
    result = scenarios.baseline_over_internet(tmp_path, epochs=6)
    assert min(result.details["final_epochs"]) >= 6, _explain(result)
    assert result.survived and not result.data_lost, _explain(result)


@pytest.mark.timeout(480)
def test_b_sigkill_during_allreduce_others_finish_next_epoch_in_time(tmp_path):
    result = scenarios.kill_during_allreduce(tmp_path)
    bound = result.details.get("bound_seconds")
    assert result.recover_seconds is not None and bound is not None, _explain(result)
    assert result.recover_seconds <= bound, f"next epoch after {result.recover_seconds:.1f} s > {bound:.1f} s"
    assert result.survived and result.epochs_lost == 0, _explain(result)


@pytest.mark.timeout(600)
def test_c_partitioned_trainer_rejoins_and_matches_within_three_epochs(tmp_path):
    result = scenarios.partition_and_heal(tmp_path, partition_seconds=30, match_within=3)
    matched = result.details.get("matched_at_epoch")
    assert matched is not None and matched <= result.details["epoch_at_heal"] + 3, _explain(result)
    assert result.survived and result.epochs_lost == 0, _explain(result)


@pytest.fixture(scope="module")
def aux_session(tmp_path_factory):
    """d and e share one swarm: the aux peer crashes and comes back, then every trainer dies."""
    return scenarios.aux_restart_and_trainer_replacement(tmp_path_factory.mktemp("aux_session"))


@pytest.mark.timeout(900)
def test_d_aux_peer_killed_and_restarted_loses_no_checkpoint(aux_session):
    result = aux_session[0]
    assert not result.data_lost, _explain(result)
    assert result.details["checks"]["metrics resumed past the crash epoch"], _explain(result)
    assert result.survived, _explain(result)


@pytest.mark.timeout(900)
def test_e_new_trainers_continue_from_the_aux_checkpoint(aux_session):
    result = aux_session[1]
    joined = result.details.get("joined_at_epochs")
    assert joined and min(joined) >= result.details["newest_checkpoint_epoch"], _explain(result)
    assert result.survived and not result.data_lost, _explain(result)


@pytest.mark.timeout(600)
def test_f_nan_and_huge_gradients_keep_parameters_finite_and_loss_falling(tmp_path):
    result = scenarios.poisoned_gradients(tmp_path, scale=1e6)
    assert result.details["checks"]["honest parameters stayed finite at every epoch"], _explain(result)
    assert result.details["checks"]["honest loss kept falling"], _explain(result)
    assert result.survived and not result.data_lost, _explain(result)


# --sync_mode local: b and c in that mode, and a third trainer joining in the middle of a round


@pytest.mark.timeout(600)
def test_w_local_mode_sigkill_during_pseudo_gradient_allreduce(tmp_path):
    result = scenarios.kill_during_allreduce(tmp_path, sync_mode="local")
    assert result.recover_seconds is not None, _explain(result)
    assert result.survived and result.epochs_lost == 0, _explain(result)


@pytest.mark.timeout(600)
def test_x_local_mode_partitioned_trainer_rejoins_and_matches(tmp_path):
    result = scenarios.partition_and_heal(tmp_path, partition_seconds=30, match_within=3, sync_mode="local")
    assert result.details.get("matched_at_epoch") is not None, _explain(result)
    assert result.survived and result.epochs_lost == 0, _explain(result)


@pytest.mark.timeout(600)
def test_y_local_mode_join_mid_round_three_peers_agree_every_round(tmp_path):
    result = scenarios.join_mid_round_local(tmp_path)
    assert result.survived, _explain(result)
