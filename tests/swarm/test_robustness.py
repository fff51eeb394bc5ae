"""Unit tests of the robustness parts: bounded averaging (peer.swarm.robust), the allowlist and its authorizer
(peer.swarm.auth), the record size limit (peer.swarm.hivemind_seam), backup checksums (peer.swarm.tensors).
No network; seconds."""

from __future__ import annotations

import asyncio

import pytest
import torch
from hivemind.proto import dht_pb2
from hivemind.utils.crypto import RSAPrivateKey

from peer.swarm.auth import Allowlist, AuthorizationError, allowlist_line
from peer.swarm.hivemind_seam import AllowlistAuthorizer, BoundedPartReducer, RecordSizeValidator
from peer.swarm.network import NetworkArguments
from peer.swarm.robust import bounded_mean, keep_local_where_not_finite
from peer.swarm.tensors import tensor_digest


def _weighted_mean(parts, weights):
    return sum(p * w for p, w in zip(parts, weights)) / sum(weights)


@pytest.mark.parametrize("count", [1, 2, 3, 5])
def test_honest_contributions_average_exactly(count):
    torch.manual_seed(count)
    parts = [torch.randn(300) for _ in range(count)]
    weights = [16.0 * (i + 1) for i in range(count)]
    assert torch.allclose(bounded_mean(parts, weights, 4.0), _weighted_mean(parts, weights), atol=1e-6)


def test_zero_weight_parts_change_nothing():
    """A peer that tags along with weight 0 (it just loaded the state) must not get honest parts clipped: left in
    the median, its zeros made the two honest parts look like one honest part and one outlier (42% off)."""
    torch.manual_seed(1)
    shared = torch.randn(300) * 0.1
    honest = [shared + torch.randn(300) * 0.03, shared * 0.2 + torch.randn(300) * 0.01]
    result = bounded_mean([*honest, torch.zeros(300)], [32.0, 64.0, 0.0], 4.0)
    assert torch.allclose(result, _weighted_mean(honest, [32.0, 64.0]), atol=1e-6)


def test_nonfinite_contributions_are_dropped():
    parts = [torch.randn(100), torch.randn(100), torch.full((100,), float("nan")), torch.full((100,), float("inf"))]
    weights = [1.0, 2.0, 1.0, 1.0]
    assert torch.allclose(bounded_mean(parts, weights, 4.0), _weighted_mean(parts[:2], weights[:2]), atol=1e-6)
    assert torch.allclose(bounded_mean(parts, weights, 0.0), _weighted_mean(parts[:2], weights[:2]), atol=1e-6)
    assert torch.isnan(bounded_mean(parts[2:], weights[2:], 4.0)).all(), "nothing usable: receivers refuse NaN"


@pytest.mark.parametrize("scale", [1e3, 1e6, -1e6])
def test_an_oversized_contribution_is_bounded(scale):
    torch.manual_seed(0)
    honest = [torch.randn(1000) for _ in range(3)]
    result = bounded_mean([*honest, honest[0] * scale], [1.0] * 4, 4.0)
    center = _weighted_mean(honest, [1.0] * 3)
    spread = max(float((h - center).norm()) for h in honest)
    assert torch.isfinite(result).all()
    assert float((result - center).norm()) <= 4.0 * spread, "one peer moved the average further than the bound"
    plain = _weighted_mean([*honest, honest[0] * scale], [1.0] * 4)
    assert float((plain - center).norm()) > 100 * spread  # what hivemind's plain mean would do


def test_reducer_returns_the_bounded_mean_to_every_sender():
    async def run():
        reducer = BoundedPartReducer([torch.Size([50])], num_senders=3, clip_factor=4.0)
        parts = [torch.randn(50), torch.randn(50), torch.full((50,), float("nan"))]
        results = await asyncio.gather(
            *(reducer.accumulate_part(i, 0, part, weight=1.0) for i, part in enumerate(parts))
        )
        return parts, results

    parts, results = asyncio.run(run())
    expected = _weighted_mean(parts[:2], [1.0, 1.0])
    assert all(torch.allclose(result, expected, atol=1e-6) for result in results)


def test_nonfinite_averaged_values_are_refused_on_receipt():
    update = torch.tensor([0.5, float("nan"), float("inf"), -1.0])
    assert keep_local_where_not_finite(update) == 2
    assert update.tolist() == [0.5, 0.0, 0.0, -1.0]


# ------------------------------------------------------------------------------------------ allowlist


def _line(name: str, key: RSAPrivateKey, peer_id: str = "QmWW4sfqXLirY6pqhDybpeJLvxG3ZqKvHWHejdrrWcetoe") -> str:
    return allowlist_line(peer_id, key.get_public_key(), name)


def test_allowlist_file_is_parsed_and_bad_lines_are_explained(tmp_path):
    alice = RSAPrivateKey()
    path = tmp_path / "authorized_keys"
    path.write_text(f"# run owner's list\n\n{_line('alice', alice)}  # a comment\n")
    allowlist = Allowlist.load(path)
    assert allowlist.public_keys == {alice.get_public_key().to_bytes()}
    assert allowlist.peer_ids == {"QmWW4sfqXLirY6pqhDybpeJLvxG3ZqKvHWHejdrrWcetoe"}

    for text, message in [
        ("", "lists no peer"),
        ("Qm123 ssh-rsa\n", "line 1: expected"),
        ("notapeer ssh-rsa AAAA\n", "line 1: not a valid peer ID"),
        (f"{_line('a', alice)}\nQmX dsa-key AAAA\n", "line 2: expected"),
    ]:
        path.write_text(text)
        with pytest.raises(AuthorizationError, match=message):
            Allowlist.load(path)
    with pytest.raises(AuthorizationError, match="cannot read it"):
        Allowlist.load(tmp_path / "missing")


def test_authorization_needs_a_stable_identity():
    with pytest.raises(ValueError, match="identity_path"):
        NetworkArguments(authorized_keys="keys.txt")


def test_authorizer_accepts_listed_signed_requests_only(tmp_path):
    alice, bob, mallory = RSAPrivateKey(), RSAPrivateKey(), RSAPrivateKey()
    path = tmp_path / "authorized_keys"
    path.write_text(f"{_line('alice', alice)}\n{_line('bob', bob)}\n")
    allowlist = Allowlist.load(path)
    as_alice, as_bob = AllowlistAuthorizer(alice, allowlist), AllowlistAuthorizer(bob, allowlist)
    as_mallory = AllowlistAuthorizer(
        mallory, Allowlist(allowlist.peer_ids, allowlist.public_keys | {mallory.get_public_key().to_bytes()})
    )  # mallory lists herself, bob does not

    async def run():
        request = dht_pb2.PingRequest()
        await as_alice.sign_request(request, None)
        accepted = await as_bob.validate_request(request)
        replayed = await as_bob.validate_request(request)  # the same nonce again
        forged = dht_pb2.PingRequest()
        await as_mallory.sign_request(forged, None)
        from_mallory = await as_bob.validate_request(forged)
        tampered = dht_pb2.PingRequest()
        await as_alice.sign_request(tampered, None)
        tampered.validate = True  # changed after signing
        unsigned = await as_bob.validate_request(dht_pb2.PingRequest())
        return accepted, replayed, from_mallory, await as_bob.validate_request(tampered), unsigned

    assert asyncio.run(run()) == (True, False, False, False, False)


# ------------------------------------------------------------------------------------------ records, backups


def test_record_size_limit():
    from hivemind.dht.validation import DHTRecord

    validator = RecordSizeValidator(max_bytes=1000)
    assert validator.validate(DHTRecord(b"k" * 20, b"s", b"v" * 900, 0.0))
    assert not validator.validate(DHTRecord(b"k" * 20, b"s", b"v" * 1000, 0.0))
    other = RecordSizeValidator(max_bytes=500)
    assert validator.merge_with(other) and validator.max_bytes == 500


def test_backup_digest_notices_any_changed_value():
    state = {"model": {"w": torch.randn(10, 10), "b": torch.zeros(10)}, "epoch": 3, "groups": [{"lr": 0.1}]}
    digest = tensor_digest(state)
    assert digest == tensor_digest({k: v for k, v in reversed(list(state.items()))})  # order-independent
    state["model"]["w"][3, 3] += 1e-6
    assert tensor_digest(state) != digest
    state["model"]["w"][3, 3] -= 1e-6
    state["groups"][0]["lr"] = 0.2
    assert tensor_digest(state) != digest


def test_a_shared_kill_trigger_fires_for_exactly_one_peer(tmp_path):
    from benchmarks.testbed.faults.injection import _claim

    trigger = tmp_path / "kill-now"
    assert not _claim(trigger)  # not there yet: nobody fires
    trigger.touch()
    assert [_claim(trigger) for _ in range(3)] == [True, False, False]
    assert (tmp_path / "kill-now.fired").exists()
