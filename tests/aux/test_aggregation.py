"""Aggregation of trainers' LocalMetrics records into per-epoch swarm numbers and a leaderboard."""

import math

import pytest

from aux_monitor.aggregation import MetricsAggregator, peer_label, summarize_epoch
from peer.swarm.records import LocalMetrics

A, B, C = b"[owner:key-a]", b"[owner:key-b]", b"[owner:key-c]"


def rec(epoch, loss, steps, samples, sps, total, t):
    """``loss``: the epoch's sum of micro-step losses (the numbers below); the record carries their mean."""
    return LocalMetrics(
        epoch=epoch,
        loss=float(loss) / steps if steps else float(loss),
        mini_steps=steps,
        samples_accumulated=samples,
        samples_per_second=float(sps),
        samples_total=total,
        time=float(t),
    )


def test_summarize_epoch_weights_loss_by_micro_steps():
    stats = summarize_epoch(3, [rec(3, 10.0, 4, 32, 5.0, 100, 10), rec(3, 2.0, 1, 8, 1.5, 50, 12)])
    assert stats.loss == pytest.approx(12.0 / 5)  # not the mean of 2.5 and 2.0
    assert (stats.peers, stats.samples, stats.samples_per_second, stats.time) == (2, 40, 6.5, 12.0)


def test_summarize_epoch_without_steps_has_nan_loss():
    assert math.isnan(summarize_epoch(0, [rec(0, 0.0, 0, 0, 0.0, 0, 1)]).loss)


def test_snapshot_aggregates_newest_epoch_and_completes_it_across_refreshes():
    agg = MetricsAggregator(alive_window=60)
    snap = agg.update({A: rec(5, 8.0, 2, 16, 4.0, 160, 100), B: rec(4, 9.0, 2, 16, 3.0, 90, 99)}, now=101)
    assert snap.global_epoch == 5 and snap.alive_peers == 2
    assert snap.loss == pytest.approx(4.0)  # only A has reported epoch 5 so far
    assert snap.samples_per_second == pytest.approx(7.0)
    assert snap.samples_total == 250
    assert [e.epoch for e in snap.epochs] == [4, 5]

    # B finishes epoch 5 later: its record joins epoch 5, epoch 4 keeps B's old numbers
    snap = agg.update({A: rec(5, 8.0, 2, 16, 4.0, 160, 100), B: rec(5, 4.0, 2, 16, 3.0, 106, 103)}, now=104)
    by_epoch = {e.epoch: e for e in snap.epochs}
    assert by_epoch[5].loss == pytest.approx(12.0 / 4) and by_epoch[5].peers == 2 and by_epoch[5].samples == 32
    assert by_epoch[4].loss == pytest.approx(4.5)
    assert snap.loss == pytest.approx(3.0)
    assert [p.peer for p in snap.peers] == [peer_label(A), peer_label(B)]  # leaderboard: most samples first
    assert [p.samples_total for p in snap.peers] == [160, 106]
    assert [p.loss for p in snap.peers] == [pytest.approx(4.0), pytest.approx(2.0)]
    assert [t.alive_peers for t in snap.timeline] == [2, 2]


def test_dead_peers_leave_the_alive_count_but_keep_their_contribution():
    agg = MetricsAggregator(alive_window=30)
    agg.update({A: rec(1, 3.0, 1, 8, 2.0, 8, 0), B: rec(1, 3.0, 1, 8, 2.0, 8, 0)}, now=1)
    snap = agg.update({A: rec(2, 2.0, 1, 8, 2.0, 16, 40)}, now=41)  # B's record expired from the DHT
    assert snap.alive_peers == 1
    assert snap.samples_per_second == pytest.approx(2.0)
    assert snap.samples_total == 24
    dead = next(p for p in snap.peers if p.peer == peer_label(B))
    assert not dead.alive and dead.samples_per_second == 0.0 and dead.samples_total == 8


def test_restarted_peer_keeps_samples_from_before_the_restart():
    agg = MetricsAggregator()
    agg.update({C: rec(7, 1.0, 1, 8, 1.0, 500, 10)}, now=10)
    snap = agg.update({C: rec(8, 1.0, 1, 8, 1.0, 8, 20)}, now=20)  # counter started again from 0
    assert snap.peers[0].samples_total == 508


def test_out_of_order_record_does_not_replace_a_newer_one():
    agg = MetricsAggregator()
    agg.update({A: rec(3, 1.0, 1, 8, 1.0, 30, 30)}, now=30)
    snap = agg.update({A: rec(2, 1.0, 1, 8, 1.0, 20, 20)}, now=31)
    assert snap.peers[0].epoch == 3 and snap.peers[0].samples_total == 30


def test_empty_swarm():
    snap = MetricsAggregator().update({}, now=5)
    assert snap.global_epoch is None and snap.loss is None and snap.alive_peers == 0 and snap.peers == ()


def test_old_epochs_and_timeline_are_bounded():
    agg = MetricsAggregator(max_epochs=3, max_timeline=2)
    for epoch in range(6):
        snap = agg.update({A: rec(epoch, 1.0, 1, 8, 1.0, 8 * epoch, epoch)}, now=epoch)
    assert [e.epoch for e in snap.epochs] == [3, 4, 5]
    assert len(snap.timeline) == 2


@pytest.mark.parametrize("kwargs", [dict(alive_window=0), dict(max_epochs=0)])
def test_invalid_settings_are_rejected(kwargs):
    with pytest.raises(ValueError):
        MetricsAggregator(**kwargs)
