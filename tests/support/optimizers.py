"""Real hivemind optimizers in process, built by the trainers' own factory (``peer.swarm.optimizer.build_optimizer``)
on a DHT of 127.0.0.1 (test_optimizer_state.py, the fault tests)."""

from __future__ import annotations

import contextlib
import threading
import time
from typing import Iterator, List, Optional, Sequence

import torch

from peer.swarm.config import CollaborationArguments, OptimizerArguments


def peer_on(
    run_id: str,
    initial_peers=(),
    model: Optional[torch.nn.Module] = None,
    *,
    collab: Optional[CollaborationArguments] = None,
    auxiliary: bool = False,
):
    """A DHT and a real model (a small default one) + hivemind optimizer, for in-process tests with one peer
    or several; ``collab`` defaults to a sync-mode swarm of 4-sample epochs, ``auxiliary`` builds an aux peer's."""
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
        batch_size_per_step=None if auxiliary else 4,
        collab=collab if collab is not None else CollaborationArguments(target_batch_size=4, matchmaking_time=1.0),
        optim=OptimizerArguments(),
        client_mode=False,
        auxiliary=auxiliary,
    )
    return dht, model, opt


@contextlib.contextmanager
def loopback_optimizers(
    models: Sequence[torch.nn.Module],
    *,
    collab: CollaborationArguments,
    optim: OptimizerArguments,
    run_id: str,
    batch_size_per_step: int,
    auxiliary: int = 0,
) -> Iterator[List]:
    """One real optimizer per model, each with its own DHT (and hivemind's averager processes) on 127.0.0.1, the
    first DHT the others' initial peer; the last ``auxiliary`` are an aux peer's optimizers; shut down on exit."""
    import hivemind

    from benchmarks.testbed.processes import share_tensors_by_file_descriptor
    from peer.swarm.optimizer import build_optimizer

    share_tensors_by_file_descriptor()
    first = hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    dhts = [first] + [
        hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"], initial_peers=first.get_visible_maddrs())
        for _ in models[1:]
    ]
    optimizers = []
    try:
        for index, (model, dht) in enumerate(zip(models, dhts)):
            aux = index >= len(models) - auxiliary
            optimizers.append(
                build_optimizer(
                    model=model,
                    dht=dht,
                    run_id=run_id,
                    signing_key=hivemind.utils.crypto.RSAPrivateKey(),
                    batch_size_per_step=None if aux else batch_size_per_step,
                    collab=collab,
                    optim=optim,
                    client_mode=False,
                    auxiliary=aux,
                )
            )
        yield optimizers
    finally:
        for optimizer in optimizers:
            optimizer.shutdown()
        for dht in reversed(dhts):
            dht.shutdown()


def seeded_mlp() -> torch.nn.Module:
    """A small model (16 inputs, 4 outputs) with the same initial parameters at every call, as --init_seed gives."""
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.LayerNorm(32), torch.nn.Linear(32, 4))


def backward_on(model: torch.nn.Module, seed: int, batch: int) -> None:
    """One backward pass of ``seeded_mlp`` on ``batch`` random samples drawn from ``seed``."""
    generator = torch.Generator().manual_seed(seed)
    inputs, targets = torch.randn(batch, 16, generator=generator), torch.randn(batch, 4, generator=generator)
    torch.nn.functional.mse_loss(model(inputs), targets).backward()


def end_epoch(model: torch.nn.Module, optimizer, seed: int, batch: int) -> None:
    """A trainer's last step of its epoch (``batch`` samples), then empty steps until the swarm's round moved its
    epoch on (at most 60 s)."""
    backward_on(model, seed, batch)
    epoch = optimizer.local_epoch
    optimizer.step(batch_size=batch)
    deadline = time.monotonic() + 60
    while optimizer.local_epoch == epoch and time.monotonic() < deadline:
        time.sleep(0.1)
        optimizer.step(batch_size=0)
    optimizer.zero_grad()


def end_epoch_together(trainers: Sequence, batch: int) -> None:
    """Every ``(model, optimizer)`` of ``trainers`` ends its epoch at once (seeds 0, 1, ...), each in its thread."""
    threads = [
        threading.Thread(target=end_epoch, args=(model, optimizer, seed, batch))
        for seed, (model, optimizer) in enumerate(trainers)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=90)
