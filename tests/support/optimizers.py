"""Real hivemind optimizers in process, built by the trainers' own factory (``peer.swarm.optimizer.build_optimizer``)
on a DHT of 127.0.0.1 (test_optimizer_state.py, the fault tests)."""

from __future__ import annotations

from typing import Optional

import torch

from peer.swarm.config import CollaborationArguments, OptimizerArguments


def peer_on(run_id: str, initial_peers=(), model: Optional[torch.nn.Module] = None):
    """A DHT and a real model (a small default one) + hivemind optimizer, for in-process tests with one peer
    or several."""
    import hivemind

    from peer.swarm.network import make_validators
    from peer.swarm.optimizer import build_optimizer

    key = hivemind.utils.crypto.RSAPrivateKey()
    dht = hivemind.DHT(
        start=True,
        host_maddrs=["/ip4/127.0.0.1/tcp/0"],
        initial_peers=list(initial_peers),
        record_validators=make_validators(run_id, key)[0],
    )
    model = model if model is not None else torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.LayerNorm(8))
    opt = build_optimizer(
        model=model,
        dht=dht,
        run_id=run_id,
        signing_key=key,
        batch_size_per_step=4,
        collab=CollaborationArguments(target_batch_size=4, matchmaking_time=1.0),
        optim=OptimizerArguments(),
        client_mode=False,
    )
    return dht, model, opt
