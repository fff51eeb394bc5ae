"""Tests of the aux peer (aux_monitor/): aggregation, checkpoints, HTTP, dashboard, export, with real trainers."""
