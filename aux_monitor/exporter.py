"""Prometheus exposition of the monitor's state (prometheus-client custom collector).

The collector reads the latest ``MonitorState`` at scrape time, so every scrape is one consistent
refresh and peers that left simply stop being exported (no stale labelled children to clean up).
"""

from __future__ import annotations

from typing import Callable, Iterator

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from aux_monitor.state import MonitorState

PREFIX = "leanhive_"


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


def _gauge(name: str, documentation: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(PREFIX + name, documentation, value=value)


def make_registry(get_state: Callable[[], MonitorState]) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(SwarmCollector(get_state))
    return registry


def render_metrics(registry: CollectorRegistry) -> bytes:
    """The Prometheus text format (version 0.0.4) of everything in ``registry``."""
    return generate_latest(registry)
