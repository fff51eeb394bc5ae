"""--sync_mode local's round agreement (peer.swarm.agreement): the vote every peer computes alike, the fingerprint,
and the fingerprint records as real DHT peers store them (untrusted input: bounded, validated)."""

from __future__ import annotations

import time

import hivemind
import pytest
import torch
from hivemind.dht.schema import RSASignatureValidator
from hivemind.utils import get_dht_time
from hivemind.utils.crypto import RSAPrivateKey

from peer.swarm import agreement
from peer.swarm.agreement import choose_reference, decode_sample, fingerprint, sources_to_follow
from peer.swarm.keys import fingerprints_key
from peer.swarm.records import (
    FINGERPRINT_SIZE,
    RoundFingerprint,
    RoundFingerprints,
    fetch_fingerprints,
    make_validators,
    publish_fingerprints,
)

TOL = agreement.LOSSLESS_TOLERANCE


def _sample(value: float) -> torch.Tensor:
    return torch.full((FINGERPRINT_SIZE,), value)


def test_the_most_supported_fingerprint_wins_and_ties_go_to_the_lowest_peer_id():
    a, b, c = _sample(1.0), _sample(1.0) + 1e-8, _sample(2.0)  # a and b agree within float rounding
    assert choose_reference({b"c": c, b"b": b, b"a": a}, TOL) in (b"a", b"b")
    assert choose_reference({b"c": c, b"b": b, b"a": a}, TOL) == b"a"  # 2 votes each for a and b: the lower ID
    assert choose_reference({b"z": a, b"y": c}, TOL) == b"y"  # one vote each: the lowest peer ID, whatever the values
    assert choose_reference({}, TOL) is None
    # the result depends on the set only, not on the order it was read in
    votes = {bytes([i]): _sample(float(i % 3)) for i in range(9)}
    shuffled = dict(reversed(list(votes.items())))
    assert choose_reference(votes, TOL) == choose_reference(shuffled, TOL) == bytes([0])


def test_only_the_peers_that_lost_the_vote_download_and_only_from_winners():
    same, other = _sample(0.5), _sample(0.25)
    # two survivors that differ: exactly one of them follows the other (both computing the same vote)
    assert sources_to_follow(same, b"a", {b"b": other}, TOL) == []
    assert sources_to_follow(other, b"b", {b"a": same}, TOL) == [b"a"]
    # a majority wins over a lower peer ID; the loser may download from any peer that agrees with the winner
    assert sources_to_follow(other, b"a", {b"b": same, b"c": same + 1e-9}, TOL) == [b"b", b"c"]
    assert sources_to_follow(same, b"b", {b"a": other, b"c": same}, TOL) == []
    # a peer that does not vote (a client, or its state was replaced during the round) only follows
    assert sources_to_follow(other, None, {b"b": same}, TOL) == [b"b"]
    assert sources_to_follow(same, None, {b"b": same}, TOL) == []
    assert sources_to_follow(same, None, {}, TOL) == []
    # lossy compression: a difference within its tolerance is no disagreement
    assert sources_to_follow(same, b"b", {b"a": same + 1e-3}, agreement.tolerance_for("8bit")) == []


def test_fingerprint_samples_every_tensor_at_fixed_positions():
    tensors = [torch.arange(1000.0).reshape(10, 100), torch.arange(1000.0, 1050.0), torch.tensor([7.0])]
    sample = fingerprint(tensors)
    assert sample.shape == (FINGERPRINT_SIZE,) and sample.dtype == torch.float32
    assert torch.equal(sample, fingerprint([t.clone() for t in tensors]))  # same values, same fingerprint
    flat = torch.cat([t.reshape(-1) for t in tensors])
    assert torch.equal(sample, flat[agreement.sample_positions(flat.numel())])
    assert sample.diff().gt(0).all() and sample[-1] >= 1000.0  # evenly spread, the later tensors sampled too
    # a change in any contiguous span of 1 % of the vector shows
    changed = [t.clone() for t in tensors]
    changed[0].view(-1)[500:511] += 1e-3
    assert not agreement.agree(fingerprint(changed), sample, TOL)


def test_malformed_samples_are_ignored():
    assert decode_sample(_sample(1.0).numpy().tobytes()) is not None
    assert decode_sample(_sample(float("nan")).numpy().tobytes()) is None
    assert decode_sample(b"\x00" * (4 * FINGERPRINT_SIZE - 4)) is None
    assert decode_sample("not bytes") is None


@pytest.mark.timeout(60)
def test_fingerprint_records_are_validated_and_a_peer_id_claimed_twice_counts_for_neither():
    """Real DHT peers (each its own process): the honest one with the swarm's validators, a rogue that only signs its
    records. A record with an oversized sample, too long a history or a huge peer ID is never read; a second
    identity claiming the honest peer's ID voids that ID's vote (its sample cannot be trusted to be the peer's)."""
    run_id = "agree"
    honest_key, rogue_key = RSAPrivateKey(), RSAPrivateKey()
    honest_validators, honest_public = make_validators(run_id, honest_key)
    honest = hivemind.DHT(start=True, record_validators=honest_validators)
    signer = RSASignatureValidator(rogue_key)  # the rogue skips the schema: only the honest peers check it
    rogue_public = signer.local_public_key
    rogue = hivemind.DHT(
        start=True, record_validators=[signer], initial_peers=[str(a) for a in honest.get_visible_maddrs()]
    )
    try:
        peer_id = honest.peer_id.to_bytes()
        mine = RoundFingerprints(
            peer_id=peer_id, rounds=[RoundFingerprint(epoch=3, ended=1.0, sample=_sample(1.0).numpy().tobytes())]
        )
        assert publish_fingerprints(honest, run_id, honest_public, mine).result(timeout=10)
        assert fetch_fingerprints(rogue, run_id, 3, timeout=10) == {peer_id: mine.rounds[0]}
        assert fetch_fingerprints(rogue, run_id, 4, timeout=10) == {}  # another round's records are not mixed in

        too_big = dict(
            peer_id=rogue.peer_id.to_bytes(), rounds=[dict(epoch=3, ended=1.0, sample=b"\x00" * 8 * FINGERPRINT_SIZE)]
        )
        too_long = dict(
            peer_id=rogue.peer_id.to_bytes(),
            rounds=[dict(epoch=e, ended=1.0, sample=_sample(0.0).numpy().tobytes()) for e in range(9)],
        )
        for value in (too_big, too_long, {"peer_id": b"x" * 10_000, "rounds": []}):
            rogue.store(fingerprints_key(run_id), value, get_dht_time() + 60, subkey=rogue_public)
            assert fetch_fingerprints(honest, run_id, 3, timeout=10) == {peer_id: mine.rounds[0]}

        spoof = RoundFingerprints(
            peer_id=peer_id, rounds=[RoundFingerprint(epoch=3, ended=1.0, sample=_sample(0.0).numpy().tobytes())]
        )
        assert publish_fingerprints(rogue, run_id, rogue_public, spoof).result(timeout=10)
        deadline = time.monotonic() + 10
        while fetch_fingerprints(honest, run_id, 3, timeout=10) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert fetch_fingerprints(honest, run_id, 3, timeout=10) == {}
    finally:
        rogue.shutdown()
        honest.shutdown()


def _start_agreements(dhts: list, agreements: list, run_id: str, values, **kwargs) -> None:
    """One DHT (the first the others' bootstrap) and one voting ``RoundAgreement`` over 100 shared values equal to
    each of ``values``, appended to ``dhts`` and ``agreements`` as they start (the caller shuts the DHTs down)."""
    for value in values:
        validators, public = make_validators(run_id, RSAPrivateKey())
        initial = [str(a) for a in dhts[0].get_visible_maddrs()] if dhts else []
        dht = hivemind.DHT(start=True, record_validators=validators, initial_peers=initial)
        dhts.append(dht)
        shared = [torch.full((100,), value)]
        agreements.append(agreement.RoundAgreement(dht, run_id, public, shared, votes=True, tolerance=TOL, **kwargs))


@pytest.mark.timeout(60)
def test_a_peer_that_ended_a_round_one_epoch_label_behind_downloads_from_the_peers_ahead():
    """A joiner that loaded the state while the other peer was ending a round averages the next round with it under
    an epoch label one lower, from an older base: their fingerprints of that all-reduce never share an epoch. The
    peer behind finds the record one epoch ahead that ended with its round and downloads from it; the peer ahead
    does nothing (hivemind would refuse the older state anyway). A peer ahead that agrees is no reason to download."""
    run_id = "late"
    dhts, agreements = [], []
    try:
        _start_agreements(dhts, agreements, run_id, (1.0, 2.0))
        ahead, behind = agreements
        ahead.round_ended(epoch=5, state_replaced=False)
        behind.round_ended(epoch=4, state_replaced=True)  # it joined during that round: it publishes nothing
        assert not behind.due() and 0 < behind.seconds_until_due() <= agreement.SETTLE_SECONDS
        time.sleep(agreement.SETTLE_SECONDS)
        assert behind.due() and behind.seconds_until_due() == 0
        assert behind.check() == (4, [dhts[0].peer_id.to_bytes()])
        assert not behind.pending() and behind.seconds_until_due() == 0
        assert ahead.check() == (5, [])

        behind.shared[0].fill_(1.0)  # now the same parameters: nothing to repair
        ahead.round_ended(epoch=6, state_replaced=False)
        behind.round_ended(epoch=5, state_replaced=False)
        time.sleep(agreement.SETTLE_SECONDS)
        assert behind.check() == (5, [])
    finally:
        for dht in dhts:
            dht.shutdown()


@pytest.mark.timeout(60)
def test_a_peer_that_missed_a_round_follows_the_one_peer_that_made_it_whatever_their_ids():
    """Two peers; one made the round (it stepped), the other dropped it. The one that dropped it counts no vote of
    its own: were its fingerprint counted, the tie (one against one) went to the lower peer ID, and when that was
    its own it kept its parameters while the other had stepped. Each of the two takes the dropping part once."""
    run_id = "missed_pair"
    dhts, agreements = [], []
    try:
        _start_agreements(dhts, agreements, run_id, (0.0, 0.0), missed_round_seconds=10.0)
        for epoch, (maker, dropper) in enumerate([(0, 1), (1, 0)], start=3):
            agreements[maker].shared[0].fill_(float(epoch))  # it stepped; the other's parameters stay
            agreements[maker].round_ended(epoch=epoch, state_replaced=False)
            agreements[dropper].round_ended(epoch=epoch, state_replaced=False, missed=True)
            time.sleep(agreement.SETTLE_SECONDS)
            assert agreements[dropper].check() == (epoch, [dhts[maker].peer_id.to_bytes()])
            assert agreements[maker].check() == (epoch, [])
            agreements[dropper].shared[0].fill_(float(epoch))  # the download
    finally:
        for dht in dhts:
            dht.shutdown()


@pytest.mark.timeout(60)
def test_a_peer_that_missed_a_round_follows_the_peers_that_made_it_and_publishes_nothing():
    """A trainer whose all-reduce failed drops the round (its shared parameters stay where the round began) and gives
    up only when its wait is over, seconds after the others' all-reduce ended: it compares with their records over
    that longer window, and downloads from them where they moved. It publishes no record of the round, so it never
    outvotes them. Where no peer published a record of the round there is nothing to compare with (the trainer then
    takes the swarm's state, peer.strategies)."""
    run_id = "missed"
    dhts, agreements = [], []
    try:
        _start_agreements(dhts, agreements, run_id, (2.0, 2.0, 1.0), missed_round_seconds=10.0)
        first, second, missed = agreements
        first.round_ended(epoch=3, state_replaced=False)
        second.round_ended(epoch=3, state_replaced=False)
        time.sleep(2 * agreement.SAME_ROUND_SECONDS)  # its failed attempt gave up later than their round ended
        missed.round_ended(epoch=3, state_replaced=False, missed=True)
        time.sleep(agreement.SETTLE_SECONDS)
        assert sorted(missed.check()[1]) == sorted(dht.peer_id.to_bytes() for dht in dhts[:2])
        assert missed.records_compared == 2
        assert first.check() == (3, []) and second.check() == (3, [])
        assert set(fetch_fingerprints(dhts[0], run_id, 3, timeout=5)) == {d.peer_id.to_bytes() for d in dhts[:2]}

        # a round nobody made: the peers that missed it publish nothing and follow nobody
        for peer in agreements:
            peer.round_ended(epoch=4, state_replaced=False, missed=True)
        time.sleep(agreement.SETTLE_SECONDS)
        assert [peer.check() for peer in agreements] == [(4, [])] * 3
        assert [peer.records_compared for peer in agreements] == [0, 0, 0]  # the trainer takes the swarm's state
        assert fetch_fingerprints(dhts[0], run_id, 4, timeout=5) == {}
    finally:
        for dht in dhts:
            dht.shutdown()
