"""Peers that hold the same state still hold the same state after a state averaging round with a lossy wire
compression (real hivemind averagers, each in its own averager process with its own p2pd, on loopback, 8-bit).

hivemind's reducer averages its own part exactly and the others' parts as it decodes them, so identical peers end a
round apart by the compression's rounding of the values themselves (the reducer of a shard keeps the average, every
sender gets the average plus its own rounding). ``BoundedAllReduceRunner``'s ``own_part_as_sent`` (the state
averager's) averages the reducer's own part as sent (encoded, then decoded) and takes the exact delta from it."""

from __future__ import annotations

import pytest
import torch
from hivemind.averaging import DecentralizedAverager
from hivemind.compression import Uniform8BitQuantization

from peer.swarm.hivemind_seam.averaging import LeanHiveStateAverager, _PolicyAveraging
from tests.support.averagers import average_once, shut_down, start_averagers, tensor_of

SIZE = 300_000  # several parts per reducer (hivemind cuts parts of 512 KiB after compression)


def _averager(own_part_as_sent: bool) -> type:
    """The seam's averaging over hivemind's plain averager, with or without ``own_part_as_sent``. One class name for
    both: hivemind names its RPCs after the class."""
    return type("_Averager", (_PolicyAveraging, DecentralizedAverager), {"_own_part_as_sent": own_part_as_sent})


_AsSent, _Exact = _averager(True), _averager(False)


def _parameters(generator: torch.Generator) -> torch.Tensor:
    return 0.05 * torch.randn(SIZE, generator=generator)  # the scale of a layer's weights


def _round(kind: type, inputs, modes=("node", "node", "node")):
    dhts, averagers = start_averagers(
        [kind] * 3, inputs, modes, prefix="state_round", compression=Uniform8BitQuantization()
    )
    try:
        average_once(averagers)
        return [tensor_of(averager) for averager in averagers]
    finally:
        shut_down(averagers + dhts)


def test_the_state_averager_averages_its_own_part_as_sent():
    assert LeanHiveStateAverager._own_part_as_sent and not _PolicyAveraging._own_part_as_sent


@pytest.mark.timeout(120)
@pytest.mark.parametrize("modes", [("node", "node", "node"), ("node", "client", "client")], ids=["nodes", "clients"])
def test_identical_peers_stay_identical(modes):
    """Three peers with the same parameters (a trainer and two home volunteers that took the same rounds) end the
    round with the same bits, within float32 rounding of where they began."""
    state = _parameters(torch.Generator().manual_seed(0))
    results = _round(_AsSent, [state] * 3, modes)
    assert all(torch.equal(results[0], other) for other in results[1:])
    assert float((results[0] - state).abs().max()) <= 1e-6


@pytest.mark.timeout(120)
def test_with_the_exact_own_part_identical_peers_end_apart():
    """The control: hivemind's own-part average leaves identical peers apart by the 8-bit rounding of the values
    (what own_part_as_sent removes)."""
    state = _parameters(torch.Generator().manual_seed(0))
    results = _round(_Exact, [state] * 3)
    assert not torch.equal(results[0], results[1]) or not torch.equal(results[1], results[2])
    assert max(float((result - state).abs().max()) for result in results) > 1e-5


@pytest.mark.timeout(120)
def test_peers_that_differ_end_at_their_average():
    """Peers whose parameters differ end at their mean, give or take the 8-bit rounding of the values, as each
    sender does with hivemind's exact own part (measured: 0.04 of how far apart they were, on average, either way)."""
    generator = torch.Generator().manual_seed(1)
    state = _parameters(generator)
    inputs = [state + 0.01 * torch.randn(SIZE, generator=generator) for _ in range(3)]
    mean = torch.stack(inputs).mean(0)
    apart = float((inputs[0] - mean).abs().mean())
    for result in _round(_AsSent, inputs):
        assert float((result - mean).abs().mean()) < 0.1 * apart
