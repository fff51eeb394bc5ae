"""Every peer of a gradient round ends with the same bits (real hivemind averagers, each in its own averager process
with its own p2pd, on loopback, with hivemind's lossy 8-bit wire compression).

hivemind's reducer answers each sender with its own compressed delta, so peers that averaged together hold different
results (the average plus their own rounding). In a synchronous swarm that sets the trainers apart after every round;
``BoundedAllReduceRunner``'s ``same_result`` sends every peer the one encoded average instead. Peers of an older
LeanHive (hivemind's deltas) still average with it."""

from __future__ import annotations

import pytest
import torch
from hivemind.averaging import DecentralizedAverager
from hivemind.compression import Uniform8BitQuantization

from peer.swarm.hivemind_seam.averaging import _PolicyAveraging
from tests.support.averagers import average_once, shut_down, start_averagers, tensor_of

SIZE = 300_000  # several parts per reducer (hivemind cuts parts of 512 KiB after compression)


def _averager(same_result: bool) -> type:
    """The seam's averaging over hivemind's plain averager; without ``same_result`` it exchanges hivemind's deltas (an
    older LeanHive, or the state averager). One class name for both: hivemind names its RPCs after the class."""
    return type("_Averager", (_PolicyAveraging, DecentralizedAverager), {"_same_result": same_result})


_SameResult, _Deltas = _averager(True), _averager(False)


def _inputs():
    """Three peers' gradients: a common direction and their own noise (alike enough that the bounded mean is the
    mean: no contribution is an outlier)."""
    generator = torch.Generator().manual_seed(0)
    common = torch.randn(SIZE, generator=generator)
    return [common + 0.3 * torch.randn(SIZE, generator=generator) for _ in range(3)]


def _round(kinds, modes=("node", "node", "node")):
    """One round of three averagers of the given classes and modes (node; client: a home trainer, sends only; aux: an
    assisting aux peer, no data). Returns each peer's result, the exact mean of the data senders' inputs and each
    peer's count of rounds whose whole result it took (``whole_results``)."""
    inputs = [tensor if mode != "aux" else torch.zeros_like(tensor) for tensor, mode in zip(_inputs(), modes)]
    dhts, averagers = start_averagers(kinds, inputs, modes, prefix="same_result", compression=Uniform8BitQuantization())
    try:
        average_once(averagers)
        results = [tensor_of(averager) for averager in averagers]
        senders = torch.stack([tensor for tensor, mode in zip(inputs, modes) if mode != "aux"])
        return results, senders.mean(0), [averager.whole_results.value for averager in averagers]
    finally:
        shut_down(averagers + dhts)


def _close_to(result: torch.Tensor, mean: torch.Tensor) -> bool:
    """Within the 8-bit codes' rounding of the mean (256 levels over a few standard deviations)."""
    return float((result - mean).abs().mean()) < 0.02 * float(mean.std())  # measured: 0.003 to 0.007 of it


@pytest.mark.timeout(120)
def test_peers_of_a_round_end_with_the_same_bits():
    results, mean, _ = _round([_SameResult] * 3)
    assert all(torch.equal(results[0], other) for other in results[1:])
    assert all(_close_to(result, mean) for result in results)


@pytest.mark.timeout(120)
def test_with_deltas_the_peers_end_apart():
    """The control: hivemind's deltas leave each peer with its own rounding (what same_result removes)."""
    results, mean, _ = _round([_Deltas] * 3)
    assert not torch.equal(results[0], results[1]) and not torch.equal(results[1], results[2])
    assert all(_close_to(result, mean) for result in results)


@pytest.mark.timeout(120)
def test_a_peer_that_sends_deltas_still_averages_with_the_others():
    """An older peer gets its delta from the new reducers and answers the new senders with deltas, which they turn
    into results: every peer ends at the average."""
    results, mean, _ = _round([_Deltas, _SameResult, _SameResult])
    assert all(_close_to(result, mean) for result in results)


@pytest.mark.timeout(120)
def test_an_assisting_aux_takes_the_result_its_client_trainers_took():
    """hivemind 1.1.12 runs an auxiliary averager in the all-reduce as a zero-weight sender: it contributes nothing
    and receives the result like the others (here it is the only reducer of two client-mode senders). It ends with
    the clients' very bits and counts the round as whole, so an assisting aux can take their optimizer step and
    serve their state (``LeanHiveOptimizer._step_with_whole_result``)."""
    results, mean, whole = _round([_SameResult] * 3, modes=("aux", "client", "client"))
    assert all(torch.equal(results[0], other) for other in results[1:])
    assert _close_to(results[0], mean)  # its zeros did not count
    assert whole == [1, 1, 1]
