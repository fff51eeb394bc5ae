"""The auxiliary peer: metrics aggregation, Prometheus exporter, dashboard, checkpoints, evaluation, upload."""
