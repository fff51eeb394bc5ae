"""Every DHT key of a run, derived from its run_id in one place (hivemind.Optimizer derives its own the same way).

- ``<run_id>_metrics``: per-epoch training metrics (peer.swarm.records.LocalMetrics), one subkey per peer;
- ``<run_id>_progress``: hivemind's ProgressTracker records (the tracker's prefix is the run_id);
- ``<run_id>_state_averager``: the state averager's prefix; its ``.all_averagers`` key holds the state-sharing
  declarations (subkey: peer ID bytes, value: the priority downloaders sort by, None while not sharing);
- ``<run_id>_grad_averager``: the gradient averager's prefix (hivemind.Optimizer derives it; matchmaking keys
  below it).
"""


def metrics_key(run_id: str) -> str:
    return f"{run_id}_metrics"


def progress_key(run_id: str) -> str:
    return f"{run_id}_progress"


def state_averager_prefix(run_id: str) -> str:
    return f"{run_id}_state_averager"


def state_sharing_key(run_id: str) -> str:
    return f"{state_averager_prefix(run_id)}.all_averagers"
