"""Prometheus exposition of the monitor's state (prometheus-client custom collector).

The collector reads the latest ``MonitorState`` at scrape time, so every scrape is one consistent
refresh and peers that left simply stop being exported (no stale labelled children to clean up).
"""

from __future__ import annotations

from typing import Callable, Iterator

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from aux_monitor.aggregation import SUCCESS_WINDOW, SwarmSnapshot
from aux_monitor.health import OUTCOME_FIELDS
from aux_monitor.state import MonitorState

PREFIX = "leanhive_"
# Per-peer health series: peers seen in the last PEER_SERIES_WINDOW seconds, at most MAX_PEER_SERIES of them (the
# most recently seen), so that a swarm with churn (or a peer minting keys) cannot grow Prometheus without bound
PEER_SERIES_WINDOW = 600.0
MAX_PEER_SERIES = 256


class SwarmCollector(Collector):
    def __init__(self, get_state: Callable[[], MonitorState]):
        self._get_state = get_state

    def collect(self) -> Iterator[Metric]:
        state = self._get_state()
        swarm = state.swarm

        yield _gauge("alive_peers", "Trainers whose latest metrics record is recent", swarm.alive_peers)
        if swarm.global_epoch is not None:
            yield _gauge("global_epoch", "Newest global epoch reported by any trainer", swarm.global_epoch)
        if swarm.loss is not None:
            yield _gauge("loss", "Mean training loss per micro-step in the newest reported epoch", swarm.loss)
        yield _gauge(
            "samples_per_second", "Swarm training throughput (sum over alive trainers)", swarm.samples_per_second
        )
        yield CounterMetricFamily(PREFIX + "samples", "Samples processed by the whole swarm", swarm.samples_total)

        per_peer = CounterMetricFamily(PREFIX + "peer_samples", "Samples contributed by each trainer", labels=["peer"])
        per_peer_rate = GaugeMetricFamily(
            PREFIX + "peer_samples_per_second", "Throughput of each alive trainer", labels=["peer"]
        )
        for peer in swarm.peers:
            per_peer.add_metric([peer.peer], peer.samples_total)
            if peer.alive:
                per_peer_rate.add_metric([peer.peer], peer.samples_per_second)
        yield per_peer
        yield per_peer_rate
        yield from _health_metrics(swarm)

        yield CounterMetricFamily(
            PREFIX + "monitor_updates",
            "Updates of the monitor's state (refreshes, checkpoints, evaluations); the dashboard shows the same count",
            state.generation,
        )
        yield _gauge(
            "last_refresh_timestamp_seconds", "When the monitor last read the swarm's metrics (unix time)", swarm.time
        )
        if state.checkpoint is not None:
            yield _gauge(
                "last_checkpoint_epoch", "Global epoch of the newest checkpoint on disk", state.checkpoint.epoch
            )
            yield _gauge(
                "last_checkpoint_timestamp_seconds",
                "When the newest checkpoint was taken (unix time)",
                state.checkpoint.time,
            )
        if state.evaluation is not None:
            yield _gauge("eval_epoch", "Global epoch of the last evaluated state", state.evaluation.epoch)
            yield _gauge("eval_loss", "Validation loss of the last evaluated state", state.evaluation.loss)
            yield _gauge(
                "eval_perplexity", "Validation perplexity of the last evaluated state", state.evaluation.perplexity
            )


def health_series_peers(swarm: SwarmSnapshot) -> list:
    """The peers that get per-peer health series (see PEER_SERIES_WINDOW)."""
    recent = [p for p in swarm.peers if p.health is not None and swarm.time - p.last_seen <= PEER_SERIES_WINDOW]
    return sorted(recent, key=lambda p: -p.last_seen)[:MAX_PEER_SERIES]


def _health_metrics(swarm: SwarmSnapshot) -> Iterator[Metric]:
    totals = swarm.health
    rounds = CounterMetricFamily(
        PREFIX + "rounds",
        "Averaging rounds of the swarm's trainers, by outcome, while this aux peer watched",
        labels=["outcome"],
    )
    for outcome, name in OUTCOME_FIELDS.items():
        rounds.add_metric([outcome], getattr(totals, name))
    yield rounds
    if swarm.round_success_ratio is not None:
        yield _gauge(
            "round_success_ratio",
            f"Share of rounds that succeeded over the last {SUCCESS_WINDOW:.0f} s",
            swarm.round_success_ratio,
        )
    if totals.compute_share is not None:
        yield _gauge(
            "compute_share",
            "Share of the trainers' time spent computing, not waiting on the swarm",
            totals.compute_share,
        )
    if totals.bytes_per_sample is not None:
        yield _gauge("bytes_per_sample", "Bytes the trainers sent per sample they contributed", totals.bytes_per_sample)
    yield CounterMetricFamily(PREFIX + "bytes_sent", "Bytes the trainers sent (averaging, state)", totals.bytes_sent)
    yield CounterMetricFamily(
        PREFIX + "bytes_received", "Bytes the trainers received (averaging, state)", totals.bytes_received
    )
    for name, help_text in (
        ("compute", "computing (forward and backward)"),
        ("wait", "blocked waiting on the swarm"),
        ("matchmaking", "in matchmaking"),
        ("allreduce", "in all-reduce"),
        ("optimizer", "in the optimizer step"),
    ):
        yield CounterMetricFamily(
            PREFIX + f"{name}_seconds", f"Seconds the trainers spent {help_text}", getattr(totals, f"{name}_seconds")
        )

    peers = health_series_peers(swarm)
    peer_rounds = CounterMetricFamily(
        PREFIX + "peer_rounds", "Averaging rounds of each trainer, by outcome", labels=["peer", "outcome"]
    )
    share = GaugeMetricFamily(PREFIX + "peer_compute_share", "Each trainer's compute share", labels=["peer"])
    sent = CounterMetricFamily(PREFIX + "peer_bytes_sent", "Bytes each trainer sent", labels=["peer"])
    received = CounterMetricFamily(PREFIX + "peer_bytes_received", "Bytes each trainer received", labels=["peer"])
    group = GaugeMetricFamily(PREFIX + "peer_group_size", "Peers in each trainer's last group", labels=["peer"])
    info = GaugeMetricFamily(
        PREFIX + "peer_info",
        "Each trainer's reachability, sync mode and LeanHive version (value 1)",
        labels=["peer", "reachability", "sync_mode", "version"],
    )
    marked = GaugeMetricFamily(
        PREFIX + "peer_marked",
        "Trainers marked on the dashboard: failing most rounds or lagging (value 1)",
        labels=["peer", "mark"],
    )
    for peer in peers:
        health = peer.health
        for outcome, name in OUTCOME_FIELDS.items():
            peer_rounds.add_metric([peer.peer, outcome], getattr(health.totals, name))
        if health.totals.compute_share is not None:
            share.add_metric([peer.peer], health.totals.compute_share)
        sent.add_metric([peer.peer], health.totals.bytes_sent)
        received.add_metric([peer.peer], health.totals.bytes_received)
        group.add_metric([peer.peer], health.last_group_size)
        info.add_metric([peer.peer, health.reachability, health.sync_mode, health.version], 1)
        if health.mark is not None:
            marked.add_metric([peer.peer, health.mark], 1)
    yield from (peer_rounds, share, sent, received, group, info, marked)

    for name, documentation in (
        ("compute_share", "Trainers' compute shares, one observation per trainer and report interval"),
        ("allreduce_seconds", "All-reduce time per averaging round (a trainer's mean over a report interval)"),
        ("group_size", "Sizes of the trainers' averaging groups, one observation per trainer and report interval"),
    ):
        histogram = swarm.histograms[name]
        buckets = [(str(float(b)), count) for b, count in zip(histogram.bounds, histogram.counts)]
        buckets.append(("+Inf", histogram.counts[-1]))
        yield HistogramMetricFamily(PREFIX + "round_" + name, documentation, buckets=buckets, sum_value=histogram.total)


def _gauge(name: str, documentation: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(PREFIX + name, documentation, value=value)


def make_registry(get_state: Callable[[], MonitorState]) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(SwarmCollector(get_state))
    return registry


def render_metrics(registry: CollectorRegistry) -> bytes:
    """The Prometheus text format (version 0.0.4) of everything in ``registry``."""
    return generate_latest(registry)
