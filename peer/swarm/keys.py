"""Every DHT key of a run, derived from its run_id in one place (hivemind.Optimizer derives its own the same way).

- ``<run_id>_metrics``: per-epoch training metrics (peer.swarm.records.LocalMetrics), one subkey per peer;
- ``<run_id>_progress``: hivemind's ProgressTracker records (the tracker's prefix is the run_id);
- ``<run_id>_state_averager``: the state averager's prefix; its ``.all_averagers`` key holds the state-sharing
  declarations (subkey: peer ID bytes, value: the priority downloaders sort by, None while not sharing);
- ``<run_id>_grad_averager``: the gradient averager's prefix (hivemind.Optimizer derives it; matchmaking keys
  below it).
- ``<run_id>_outer_averager``: the pseudo-gradient averager's prefix in ``--sync_mode local`` (in place of the
  gradient averager's: peers of the two modes never meet in one all-reduce, and a joiner of the other mode sees
  their state-sharing declarations under ``.all_averagers`` and stops with an error).
- ``<run_id>_round_fingerprints``: ``--sync_mode local``: a sample of each trainer's shared parameters after its last
  few rounds (peer.swarm.records.RoundFingerprints), one signed subkey per peer; peers compare them to find and
  repair a disagreement (peer.swarm.agreement).
- ``<run_id>_reachable``: peers that others can dial (peer.swarm.reachability.ReachablePeer: trainers, aux peers and
  whether an aux assists in averaging), one signed subkey per peer; joiners ask them to dial back, client-mode
  trainers look there for a reducer.
- ``<prefix>.0b<bits>`` for all averagers' prefixes: hivemind's matchmaking keys (subkey: peer ID bytes, value:
  whether the peer is looking for a group); LeanHive never sets group bits, so ``<prefix>.0b`` is the one in use.
"""

MAX_GROUP_BITS = 4  # matchmaking keys are covered up to this many group bits (LeanHive uses none)


def metrics_key(run_id: str) -> str:
    return f"{run_id}_metrics"


def progress_key(run_id: str) -> str:
    return f"{run_id}_progress"


def fingerprints_key(run_id: str) -> str:
    return f"{run_id}_round_fingerprints"


def reachable_key(run_id: str) -> str:
    return f"{run_id}_reachable"


def state_averager_prefix(run_id: str) -> str:
    return f"{run_id}_state_averager"


def state_sharing_key(run_id: str) -> str:
    return f"{state_averager_prefix(run_id)}.all_averagers"


def grad_averager_prefix(run_id: str) -> str:
    return f"{run_id}_grad_averager"


def outer_averager_prefix(run_id: str) -> str:
    return f"{run_id}_outer_averager"


def gradient_prefix_of_mode(run_id: str, sync_mode: str) -> str:
    """The prefix of the averager that all-reduces what peers of ``sync_mode`` send every round."""
    return outer_averager_prefix(run_id) if sync_mode == "local" else grad_averager_prefix(run_id)


def averager_prefixes(run_id: str) -> tuple[str, str, str]:
    return state_averager_prefix(run_id), grad_averager_prefix(run_id), outer_averager_prefix(run_id)


def matchmaking_keys(prefix: str, max_bits: int = MAX_GROUP_BITS) -> list[str]:
    """``<prefix>.0b`` followed by every group-bit string up to ``max_bits`` long (hivemind's GroupKeyManager)."""
    keys = [f"{prefix}.0b"]
    for length in range(1, max_bits + 1):
        keys += [f"{prefix}.0b{index:0{length}b}" for index in range(2**length)]
    return keys
