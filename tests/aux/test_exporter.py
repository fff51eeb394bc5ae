"""Prometheus text exposition of the monitor's state."""

import pytest
from prometheus_client.parser import text_string_to_metric_families

from aux_monitor.aggregation import MetricsAggregator, SwarmSnapshot, peer_label
from aux_monitor.exporter import make_registry, render_metrics
from aux_monitor.state import CheckpointInfo, EvalResult, MonitorState
from peer.swarm.records import LocalMetrics


def parse(text: str) -> dict:
    samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return samples


def swarm_state(**extra) -> MonitorState:
    records = {
        b"[owner:a]": LocalMetrics(
            epoch=4,
            loss=2.0,  # records carry the mean micro-step loss
            mini_steps=3,
            samples_accumulated=24,
            samples_per_second=12.5,
            samples_total=96,
            time=100.0,
        ),
        b"[owner:b]": LocalMetrics(
            epoch=4, loss=2.0, mini_steps=1, samples_accumulated=8, samples_per_second=2.5, samples_total=40, time=99.0
        ),
    }
    snapshot = MetricsAggregator(alive_window=60).update(records, now=101.0)
    return MonitorState(run_id="r", initial_peers="--initial_peers /ip4/127.0.0.1/tcp/1/p2p/X", swarm=snapshot, **extra)


def test_metric_names_values_and_types():
    state = swarm_state(
        checkpoint=CheckpointInfo(epoch=3, time=90.0, path="/ckpt/epoch_000003"),
        evaluation=EvalResult(epoch=3, loss=2.0, perplexity=7.389, time=95.0),
    )
    text = render_metrics(make_registry(lambda: state)).decode()
    samples = parse(text)
    assert samples[("leanhive_alive_peers", ())] == 2
    assert samples[("leanhive_global_epoch", ())] == 4
    assert samples[("leanhive_loss", ())] == pytest.approx(8.0 / 4)
    assert samples[("leanhive_samples_per_second", ())] == pytest.approx(15.0)
    assert samples[("leanhive_samples_total", ())] == 136
    assert samples[("leanhive_peer_samples_total", (("peer", peer_label(b"[owner:a]")),))] == 96
    assert samples[("leanhive_peer_samples_total", (("peer", peer_label(b"[owner:b]")),))] == 40
    assert samples[("leanhive_peer_samples_per_second", (("peer", peer_label(b"[owner:a]")),))] == 12.5
    assert samples[("leanhive_last_checkpoint_epoch", ())] == 3
    assert samples[("leanhive_last_checkpoint_timestamp_seconds", ())] == 90.0
    assert samples[("leanhive_eval_loss", ())] == 2.0
    assert samples[("leanhive_eval_perplexity", ())] == pytest.approx(7.389)
    assert samples[("leanhive_last_refresh_timestamp_seconds", ())] == 101.0
    assert samples[("leanhive_monitor_updates_total", ())] == 0
    assert "# TYPE leanhive_samples_total counter" in text
    assert "# TYPE leanhive_peer_samples_total counter" in text
    assert "# TYPE leanhive_loss gauge" in text


def test_unknown_values_are_left_out_rather_than_faked():
    state = MonitorState(run_id="r", initial_peers="", swarm=SwarmSnapshot.empty(5.0))
    samples = parse(render_metrics(make_registry(lambda: state)).decode())
    names = {name for name, _ in samples}
    assert samples[("leanhive_alive_peers", ())] == 0
    assert not names & {
        "leanhive_loss",
        "leanhive_global_epoch",
        "leanhive_last_checkpoint_epoch",
        "leanhive_eval_loss",
    }


def test_peers_that_leave_are_no_longer_exported():
    states = [swarm_state(), MonitorState(run_id="r", initial_peers="", swarm=SwarmSnapshot.empty(200.0))]
    registry = make_registry(lambda: states[0])
    assert "leanhive_peer_samples_total{" in render_metrics(registry).decode()
    states.pop(0)
    assert "leanhive_peer_samples_total{" not in render_metrics(registry).decode()
