"""A client-mode peer's all-reduce round with a reducer that went on without it (real hivemind averagers, each in its
own averager process with its own p2pd, on loopback).

A home volunteer triggers its gradient round when its own local step ends, so it may begin after the reducer's
sender_timeout; the reducer then averages without it and closes its stream. hivemind's client read the reducer's
answer only after sending every part: its writes failed on the closed stream and its training loop stalled until the
all-reduce timeout (15 s on the home testbed), after which it was late for the next rounds too."""

from __future__ import annotations

import time

import hivemind
import pytest
import torch
from hivemind.averaging import DecentralizedAverager
from hivemind.utils import get_dht_time

from peer.swarm.hivemind_seam.averaging import _PolicyAveraging

SIZE = 1_000_000  # 4 MB: more than the streams buffer, so the refused client's writes really fail
SENDER_TIMEOUT = 1.0
ALLREDUCE_TIMEOUT = 15.0


class _Averager(_PolicyAveraging, DecentralizedAverager):
    """The seam's averaging (bounded runner, client reads) over hivemind's plain averager."""


@pytest.fixture
def pair():
    server = hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    client_dht = hivemind.DHT(start=True, initial_peers=server.get_visible_maddrs(), client_mode=True)
    opts = dict(
        prefix="client_rounds",
        target_group_size=2,
        min_matchmaking_time=1.0,
        request_timeout=0.5,
        next_chunk_timeout=SENDER_TIMEOUT,
        allreduce_timeout=ALLREDUCE_TIMEOUT,
        start=True,
    )
    reducer = _Averager([torch.ones(SIZE)], server, **opts)
    client = _Averager([torch.zeros(SIZE)], client_dht, client_mode=True, **opts)
    yield reducer, client
    for item in (reducer, client, client_dht, server):
        item.shutdown()


def _round(reducer, client, client_late_by: float):
    """One round of the two; the client is triggered ``client_late_by`` s after the group formed (negative: before).
    Returns the client's outcome, the seconds it took once triggered, and both averaged means."""
    begin = get_dht_time() + 1.5
    # as a client schedules its rounds in LeanHive: the deadline just after the join expiration
    client_step = client.step(
        scheduled_time=begin, timeout=begin + 0.3 - get_dht_time(), wait=False, require_trigger=True
    )
    reducer_step = reducer.step(scheduled_time=begin, timeout=20, wait=False, require_trigger=True)
    reducer_step.allow_allreduce()
    if client_late_by >= 0:
        time.sleep(max(0.0, begin - get_dht_time()) + client_late_by)
    triggered = time.monotonic()
    client_step.allow_allreduce()
    try:
        client_step.result(ALLREDUCE_TIMEOUT + 10)
        outcome = "averaged"
    except BaseException as e:
        outcome = repr(e)
    took = time.monotonic() - triggered
    reducer_step.result(30)
    with reducer.get_tensors() as tensors:
        reducer_mean = tensors[0].mean().item()
    with client.get_tensors() as tensors:
        client_mean = tensors[0].mean().item()
    return outcome, took, reducer_mean, client_mean


@pytest.mark.timeout(120)
def test_a_client_on_time_is_averaged(pair):
    """The control: triggered before the group forms, the client's round averages both peers."""
    outcome, _, reducer_mean, client_mean = _round(*pair, client_late_by=-1)
    assert outcome == "averaged"
    assert reducer_mean == pytest.approx(0.5) and client_mean == pytest.approx(0.5)


@pytest.mark.timeout(120)
def test_a_client_the_reducer_went_on_without_fails_its_round_at_once(pair):
    """Triggered three times the reducer's sender_timeout after the group formed (a client may take two to start),
    the client is refused: its round fails within seconds (not at the 15 s all-reduce timeout), says why, and both
    peers keep their own values."""
    outcome, took, reducer_mean, client_mean = _round(*pair, client_late_by=3 * SENDER_TIMEOUT)
    assert "no reducer of the group averaged this peer's parts" in outcome
    assert took < ALLREDUCE_TIMEOUT / 3, f"the refused client waited {took:.1f} s"
    assert reducer_mean == pytest.approx(1.0) and client_mean == pytest.approx(0.0)
