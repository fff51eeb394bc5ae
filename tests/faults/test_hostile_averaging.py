"""Hostile or broken peers in the gradient all-reduce: a peer that claims an inf sample weight,
one that sends -1e3 x its gradient in a two-peer round, one that sends parts of the wrong shape.

The multi-peer tests run one honest trainer and one rogue trainer (``benchmarks/testbed/fault_trainer.py`` with a
``LEANHIVE_FAULT_*`` variable: a real separate peer on 127.0.0.1 that puts the bad values on the wire). The honest
peer records, for each gradient all-reduce, how the average it applied compares with what it sent
(``LEANHIVE_FAULT_RECORD_AVERAGING``, an observation only).
"""

from __future__ import annotations

import asyncio
import math

import pytest
import torch

from benchmarks.testbed.faults import hostile_state
from benchmarks.testbed.faults.injection import SEND_BAD_SHAPE_ENV, SEND_GRAD_SCALE_ENV, SEND_WEIGHT_ENV
from peer.swarm import robust
from peer.swarm.hivemind_seam import BoundedPartReducer

# ------------------------------------------------------------------------------------------------ units


@pytest.mark.parametrize("claimed", [math.inf, 1e300, math.nan, -5.0])
def test_a_claimed_weight_cannot_switch_averaging_off(claimed):
    honest = [torch.randn(100), torch.randn(100)]
    result = robust.bounded_mean([*honest, torch.randn(100)], [32.0, 32.0, claimed], 4.0)
    assert torch.isfinite(result).all()
    weights = robust.bounded_weights([32.0, 32.0, claimed])
    assert weights[:2] == [1.0, 1.0] and 0.0 <= weights[2] <= robust.MAX_WEIGHT_RATIO


def test_honest_weights_are_kept_in_proportion():
    assert robust.bounded_weights([16.0, 48.0, 32.0]) == [0.5, 1.5, 1.0]


def test_two_peer_update_never_points_against_the_receivers_own_part():
    own = torch.randn(1000)
    other = -1e3 * (own + 0.1 * torch.randn(1000))
    update = (own + other) / 2 - own
    assert robust.bound_two_peer_update(update, own)
    assert float(torch.dot(own + update, own)) >= -1e-3 * float(own.norm()) ** 2
    honest = own + 0.3 * torch.randn(1000)
    update = (own + honest) / 2 - own
    assert not robust.bound_two_peer_update(update.clone(), own), "an honest pair is not bounded"


def test_a_part_of_the_wrong_shape_is_dropped_and_the_others_are_averaged():
    async def run():
        reducer = BoundedPartReducer([torch.Size([50])], num_senders=3, clip_factor=4.0)
        parts = [torch.randn(50), torch.randn(50), torch.ones(1)]
        return parts, await asyncio.gather(
            *(reducer.accumulate_part(i, 0, part, weight=1.0) for i, part in enumerate(parts))
        )

    parts, results = asyncio.run(run())
    expected = (parts[0] + parts[1]) / 2
    assert all(torch.allclose(result, expected, atol=1e-6) for result in results)


# ------------------------------------------------------------------------------------------- real peers


def _rounds_with_rogue(tmp_path, run_id: str, rogue_env: dict):
    return hostile_state.rounds_with_rogue(tmp_path, run_id, rogue_env)


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_inf_weight_does_not_switch_averaging_off(tmp_path):
    rounds, log = _rounds_with_rogue(tmp_path, "inf_weight", {SEND_WEIGHT_ENV: "inf"})
    done = [r for r in rounds if r["ok"]]
    assert len(done) >= 2, rounds
    assert all(r["finite"] for r in done), rounds
    # the average really mixed in the other peer's gradient (before: every shard was NaN, refused, own kept)
    assert all(r["change"] > 1e-4 for r in done), rounds
    assert "NaN/inf averaged values" not in log
    assert "bounded 1 of 2 sample weights" in log


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_two_peer_sign_flip_cannot_reverse_the_update(tmp_path):
    rounds, log = _rounds_with_rogue(tmp_path, "sign_flip", {SEND_GRAD_SCALE_ENV: "-1000"})
    done = [r for r in rounds if r["ok"]]
    assert len(done) >= 2, rounds
    # before: the average was about -500 x the rogue's gradient, cosine with the honest gradient near -1
    assert min(r["cosine"] for r in done) > -1e-3, rounds
    assert "two-peer round" in log


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_a_part_of_the_wrong_shape_does_not_break_the_round(tmp_path):
    rounds, log = _rounds_with_rogue(tmp_path, "bad_shape", {SEND_BAD_SHAPE_ENV: "1"})
    assert len(rounds) >= 2, rounds
    assert all(r["ok"] and r["finite"] for r in rounds), rounds  # before: the honest peer's rounds failed
    assert "dropped a part of shape (1,)" in log
