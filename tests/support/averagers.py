"""Real hivemind averagers on loopback for the seam's averaging tests: each in its own averager process with its own
p2pd, grouped three at a time (test_same_result.py, test_round_result.py)."""

from __future__ import annotations

import gc
from concurrent.futures import wait
from typing import List, Optional, Sequence, Tuple

import hivemind
import torch


def start_averagers(
    kinds: Sequence[type], inputs: Sequence[torch.Tensor], modes: Sequence[str], *, prefix: str, compression
) -> Tuple[List[hivemind.DHT], list]:
    """One DHT and one averager per peer (``modes``: node; client, a home trainer that sends only; aux, an assisting
    aux peer without data), the first DHT public and the others bootstrapped from it; started, not averaging yet."""
    # hivemind forks each averager's process from this one and shares tensors through files (its file_system
    # strategy): the last test's averagers, garbage not yet collected here, were collected in a child as well, which
    # could not unlink their files again and aborted (its round then found no group)
    gc.collect()
    first = hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    dhts = [first] + [
        hivemind.DHT(start=True, initial_peers=first.get_visible_maddrs(), client_mode=mode == "client")
        for mode in modes[1:]
    ]
    averagers = [
        kind(
            [tensor.clone()],
            dht,
            prefix=prefix,
            target_group_size=3,
            min_group_size=3,
            min_matchmaking_time=2.0,
            request_timeout=1.0,
            compression=compression,
            client_mode=mode == "client",
            auxiliary=mode == "aux",
            start=True,
        )
        for kind, mode, dht, tensor in zip(kinds, modes, dhts, inputs)
    ]
    return dhts, averagers


def average_once(averagers: Sequence, gathers: Optional[Sequence] = None) -> None:
    """One all-reduce of these averagers together (each gathering its item of ``gathers`` in matchmaking); raises if
    any of them failed it."""
    gathers = [None] * len(averagers) if gathers is None else gathers
    steps = [averager.step(wait=False, timeout=30, gather=gather) for averager, gather in zip(averagers, gathers)]
    wait(steps, timeout=60)
    for step in steps:
        step.result(0)


def tensor_of(averager) -> torch.Tensor:
    """A copy of the averager's (only) averaged tensor."""
    with averager.get_tensors() as tensors:
        return tensors[0].clone()


def shut_down(items: Sequence) -> None:
    for item in items:
        item.shutdown()
