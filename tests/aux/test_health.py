"""The swarm's averaging health on the aux peer: round-health totals from the trainers' records become per-peer and
swarm numbers (only growth the aux peer saw, and only growth the time allows; restarts rebase), marks for failing
and lagging peers, Prometheus series with bounded cardinality and cumulative histograms that `promtool check
metrics` accepts; the example alert rules pass `promtool check rules` and their own `promtool test rules`."""

import os
import shutil
import subprocess
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from aux_monitor.aggregation import MetricsAggregator, peer_label
from aux_monitor.exporter import MAX_PEER_SERIES, make_registry, render_metrics
from aux_monitor.health import HealthTotals
from aux_monitor.state import MonitorState
from peer.swarm.records import LocalMetrics, RoundHealth
from peer.swarm.round_health import HealthLine, RoundHealthCounter

DOCKER = Path(__file__).resolve().parents[2] / "docker"
promtool = pytest.mark.skipif(
    shutil.which("promtool") is None, reason="needs promtool (Debian package prometheus; scripts/setup_env.sh --test)"
)


def health(**values) -> RoundHealth:
    fields = dict(
        rounds_joined=0,
        rounds_ok=0,
        failed_no_group=0,
        failed_timeout=0,
        failed_partial=0,
        last_group_size=2,
        compute_seconds=0.0,
        wait_seconds=0.0,
        matchmaking_seconds=0.0,
        allreduce_seconds=0.0,
        optimizer_seconds=0.0,
        bytes_sent=0,
        bytes_received=0,
        reachability="public",
        sync_mode="sync",
        version="0.1.0",
    )
    fields.update(values)
    return RoundHealth(**fields)


def record(time: float, epoch: int = 1, samples_total: int = 0, **health_values) -> LocalMetrics:
    return LocalMetrics(
        epoch=epoch,
        samples_per_second=10.0,
        samples_accumulated=8,
        loss=3.0,
        mini_steps=2,
        samples_total=samples_total,
        time=float(time),
        health=health(**health_values),
    )


def rounds(ok: int, no_group: int = 0, timeout: int = 0, partial: int = 0) -> dict:
    return dict(
        rounds_joined=ok + no_group + timeout + partial,
        rounds_ok=ok,
        failed_no_group=no_group,
        failed_timeout=timeout,
        failed_partial=partial,
    )


def test_only_growth_the_aux_peer_saw_counts_and_failing_and_lagging_peers_are_marked():
    aggregator = MetricsAggregator(alive_window=120)
    good, bad = b"[owner:good]", b"[owner:bad]"
    # first records: claims about the time before the aux peer saw them set the baseline only
    aggregator.update({good: record(100, **rounds(50), bytes_sent=10**9), bad: record(100, **rounds(0))}, now=100)
    snapshot = aggregator.update(
        {
            good: record(
                160,
                epoch=5,
                samples_total=64,
                **rounds(56),
                compute_seconds=45.0,
                wait_seconds=15.0,
                bytes_sent=10**9 + 6400,
            ),
            bad: record(
                160,
                epoch=3,
                samples_total=64,
                **rounds(1, no_group=4, partial=1),
                compute_seconds=30.0,
                wait_seconds=30.0,
            ),
        },
        now=160,
    )
    peers = {p.peer: p for p in snapshot.peers}
    good_health, bad_health = peers[peer_label(good)].health, peers[peer_label(bad)].health
    assert good_health.totals.rounds_ok == 6 and good_health.totals.rounds_failed == 0
    assert good_health.totals.compute_share == pytest.approx(0.75)
    assert good_health.totals.bytes_sent == 6400 and good_health.totals.bytes_per_sample == pytest.approx(100.0)
    assert good_health.mark is None
    assert bad_health.totals.rounds_failed == 5 and bad_health.totals.failed_partial == 1
    assert bad_health.mark == "failing"
    assert snapshot.health.rounds_ok == 7 and snapshot.health.rounds_failed == 5
    assert snapshot.health.compute_share == pytest.approx(75 / 120)
    # a peer two epochs behind the newest is lagging (once it has no failing rounds to show first)
    snapshot = aggregator.update({bad: record(220, epoch=3, samples_total=64, **rounds(1, 4, 0, 1))}, now=220)
    assert {p.peer: p.health.mark for p in snapshot.peers}[peer_label(bad)] == "failing"
    lagger = b"[owner:lagging]"
    aggregator.update({lagger: record(200, epoch=2, **rounds(1))}, now=221)
    snapshot = aggregator.update({lagger: record(221, epoch=3, **rounds(2))}, now=222)
    assert {p.peer: p.health.mark for p in snapshot.peers}[peer_label(lagger)] == "lagging"


def test_growth_the_time_does_not_allow_is_refused_and_a_restart_rebases(caplog):
    aggregator = MetricsAggregator(alive_window=120)
    peer = b"[owner:liar]"
    aggregator.update({peer: record(100, **rounds(1))}, now=100)
    # a year of compute, 10 TB and a million rounds in one minute: refused, logged, the baseline stays
    for claim in (
        dict(compute_seconds=3e7),
        dict(bytes_sent=10**13),
        dict(**rounds(10**6)),
        dict(allreduce_seconds=1e6),
    ):
        snapshot = aggregator.update({peer: record(160, **{**rounds(1), **claim})}, now=160)
        assert snapshot.health == HealthTotals(), claim
    assert "Ignoring the round health" in caplog.text
    # honest growth from the same baseline is still counted
    snapshot = aggregator.update({peer: record(170, **rounds(3), compute_seconds=50.0)}, now=170)
    assert snapshot.health.rounds_ok == 2 and snapshot.health.compute_seconds == 50.0
    # a restart (totals went down) only sets a new baseline: nothing is subtracted or double counted
    snapshot = aggregator.update({peer: record(230, **rounds(1))}, now=230)
    assert snapshot.health.rounds_ok == 2
    snapshot = aggregator.update({peer: record(290, **rounds(4), compute_seconds=10.0)}, now=290)
    assert snapshot.health.rounds_ok == 5 and snapshot.health.compute_seconds == 60.0


def test_a_hostile_record_is_refused_by_the_schema():
    """Counters out of bounds or outcomes that exceed the rounds joined never reach the aggregator."""
    for bad in (
        dict(rounds_joined=2, rounds_ok=3),
        dict(bytes_sent=10**18),
        dict(compute_seconds=float("inf")),
        dict(compute_seconds=float("nan")),
        dict(reachability="everywhere"),
        dict(version="x" * 100),
        dict(last_group_size=10**6),
    ):
        with pytest.raises(ValueError):
            LocalMetrics.parse_obj({**record(1).dict(), "health": {**health().dict(), **bad}})


def test_the_trainer_side_counter_and_its_log_line():
    counter = RoundHealthCounter(sync_mode="local")
    counter.round_joined()
    counter.round_ended("ok", group_size=3)
    counter.round_joined()
    counter.round_ended("no_group")
    counter.add_time("compute", 3.0)
    counter.add_time("wait", 1.0)
    counter.add_bytes(sent=2_000_000, received=4_000_000)
    snapshot = counter.snapshot()
    assert (snapshot.rounds_joined, snapshot.rounds_ok, snapshot.failed_no_group) == (2, 1, 1)
    assert snapshot.last_group_size == 0 and snapshot.sync_mode == "local" and snapshot.version
    line = HealthLine()
    assert line.format(snapshot) == (
        "swarm health: rounds 1 ok / 1 failed, compute share 0.75, sent 2.0 MB, received 4.0 MB"
    )
    counter.round_joined()
    counter.round_ended("ok", group_size=2)
    assert line.format(counter.snapshot()).startswith("swarm health: rounds 1 ok / 0 failed, compute share n/a")
    # what a forked averager process adds is seen by the trainer's process
    pid = os.fork()
    if pid == 0:
        counter.add_time("allreduce", 2.5)
        counter.round_ended("partial", group_size=4)
        os._exit(0)
    os.waitpid(pid, 0)
    snapshot = counter.snapshot()
    assert snapshot.allreduce_seconds == 2.5 and snapshot.failed_partial == 1 and snapshot.last_group_size == 4
    with pytest.raises(ValueError, match="outcome"):
        counter.round_ended("lost")
    with pytest.raises(ValueError, match="sync_mode"):
        RoundHealthCounter(sync_mode="async")


def _scrape(snapshot) -> str:
    state = MonitorState(run_id="r", initial_peers="", swarm=snapshot)
    return render_metrics(make_registry(lambda: state)).decode()


def _samples(text: str) -> dict:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def test_health_series_are_exported_with_bounded_cardinality():
    aggregator = MetricsAggregator(alive_window=120)
    peers = [f"[owner:{i}]".encode() for i in range(MAX_PEER_SERIES + 20)]
    aggregator.update({p: record(100, **rounds(0)) for p in peers}, now=100)
    snapshot = aggregator.update(
        {p: record(160, **rounds(2, timeout=1), compute_seconds=9.0, wait_seconds=1.0) for p in peers}, now=160
    )
    samples = _samples(_scrape(snapshot))
    assert samples[("leanhive_rounds_total", (("outcome", "ok"),))] == 2 * len(peers)
    assert samples[("leanhive_rounds_total", (("outcome", "timeout"),))] == len(peers)
    assert samples[("leanhive_round_success_ratio", ())] == pytest.approx(2 / 3)
    assert samples[("leanhive_compute_share", ())] == pytest.approx(0.9)
    per_peer = {labels for name, labels in samples if name == "leanhive_peer_info"}
    assert len(per_peer) == MAX_PEER_SERIES
    assert samples[("leanhive_round_compute_share_count", ())] == len(peers)
    assert samples[("leanhive_round_compute_share_bucket", (("le", "0.9"),))] == len(peers)
    assert samples[("leanhive_round_compute_share_bucket", (("le", "0.8"),))] == 0
    # peers unseen for PEER_SERIES_WINDOW seconds drop out of the per-peer series (not out of the totals)
    snapshot = aggregator.update({}, now=160 + 601)
    samples = _samples(_scrape(snapshot))
    assert not [name for name, _ in samples if name == "leanhive_peer_info"]
    assert samples[("leanhive_rounds_total", (("outcome", "ok"),))] == 2 * len(peers)


@promtool
def test_promtool_accepts_the_scrape(tmp_path):
    aggregator = MetricsAggregator(alive_window=120)
    aggregator.update({b"[owner:a]": record(100, **rounds(0))}, now=100)
    snapshot = aggregator.update({b"[owner:a]": record(160, **rounds(3, no_group=1), compute_seconds=40.0)}, now=160)
    result = subprocess.run(
        ["promtool", "check", "metrics"], input=_scrape(snapshot), capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stdout + result.stderr


@promtool
def test_the_example_alert_rules_check_and_pass_their_tests():
    for argv in (["check", "rules", "alerts.yml"], ["test", "rules", "alerts.test.yml"]):
        result = subprocess.run(["promtool", *argv], cwd=DOCKER, capture_output=True, text=True, timeout=120)
        assert result.returncode == 0, result.stdout + result.stderr


def test_the_alert_rules_use_only_exported_metrics():
    aggregator = MetricsAggregator(alive_window=120)
    aggregator.update({b"[owner:a]": record(100, **rounds(0))}, now=100)
    snapshot = aggregator.update({b"[owner:a]": record(160, **rounds(1))}, now=160)
    from aux_monitor.state import CheckpointInfo

    state = MonitorState(
        run_id="r", initial_peers="", swarm=snapshot, checkpoint=CheckpointInfo(epoch=1, time=150.0, path="/c")
    )
    exported = {name for name, _ in _samples(render_metrics(make_registry(lambda: state)).decode())}
    import re

    used = set(re.findall(r"leanhive_[a-z_]+", (DOCKER / "alerts.yml").read_text()))
    assert used and used <= exported, used - exported
