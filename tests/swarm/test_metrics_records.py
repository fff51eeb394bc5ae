"""Metrics records in a real DHT: valid signed records are accepted, malformed or forged ones rejected."""

from __future__ import annotations

import time

import hivemind
import pytest
from hivemind.utils import get_dht_time

from benchmarks.testbed.processes import share_tensors_by_file_descriptor
from peer.swarm.identity import load_or_create_signing_key
from peer.swarm.network import NetworkArguments, create_dht, make_validators
from peer.swarm.records import LocalMetrics, fetch_metrics, metrics_key, publish_metrics

RUN_ID = "metrics_test"
LOCAL = ["/ip4/127.0.0.1/tcp/0"]


def _good_metrics(epoch: int = 3) -> LocalMetrics:
    return LocalMetrics(
        epoch=epoch,
        samples_per_second=12.5,
        samples_accumulated=64,
        loss=33.2,
        mini_steps=4,
        samples_total=640,
        time=float(get_dht_time()),
    )


@pytest.fixture
def swarm(tmp_path):
    """An honest peer, a second honest peer, and a rogue DHT node that installs no validators."""
    share_tensors_by_file_descriptor()
    dhts = []
    try:
        keys = [load_or_create_signing_key(str(tmp_path / f"peer{i}.rsa")) for i in range(2)]
        honest = []
        for key in keys:
            validators, public_key = make_validators(RUN_ID, key)
            args = NetworkArguments(
                run_id=RUN_ID,
                host_maddrs=LOCAL,
                initial_peers=[str(a) for a in dhts[0].get_visible_maddrs()] if dhts else [],
            )
            dhts.append(create_dht(args, validators))
            honest.append((dhts[-1], public_key))
        rogue = hivemind.DHT(
            start=True, host_maddrs=LOCAL, initial_peers=[str(a) for a in dhts[0].get_visible_maddrs()]
        )
        dhts.append(rogue)
        yield honest, rogue
    finally:
        for dht in dhts:
            dht.shutdown()


def _visible(dht, timeout=10.0):
    return fetch_metrics(dht, RUN_ID, timeout=timeout)


def _raw_subkeys(dht) -> set:
    """Subkeys an honest peer accepts from the DHT (before fetch_metrics' own parsing)."""
    found = dht.get(metrics_key(RUN_ID), latest=True)
    return set(found.value) if found is not None and isinstance(found.value, dict) else set()


@pytest.mark.timeout(120)
def test_signed_valid_record_is_accepted(swarm):
    (first, first_key), (second, _) = swarm[0]
    assert publish_metrics(first, RUN_ID, first_key, _good_metrics()).result(timeout=10)
    seen = _visible(second)
    assert first_key in seen and seen[first_key].epoch == 3 and seen[first_key].mini_steps == 4


MALFORMED = [
    dict(loss="high"),  # wrong type
    dict(epoch=-1),  # out of range
    dict(epoch=3.0),  # number type conversion is not allowed
    dict(samples_per_second=float("nan")),
    dict(unexpected_field=1),  # extra fields are forbidden
    dict(mini_steps=None),
]


@pytest.mark.timeout(120)
def test_malformed_records_are_rejected(swarm):
    (first, first_key), (second, _) = swarm[0]
    for change in MALFORMED:  # one swarm for all cases: starting DHTs is the slow part
        value = {**_good_metrics().dict(), **change}
        # the rogue node (no validators) may keep a copy, but honest peers validate what they receive
        first.store(metrics_key(RUN_ID), subkey=first_key, value=value, expiration_time=get_dht_time() + 60)
        for dht in (first, second):
            assert first_key not in _raw_subkeys(dht), f"accepted a record with {change}"


@pytest.mark.timeout(120)
def test_forged_records_are_rejected(swarm):
    (first, first_key), (second, second_key) = swarm[0]
    rogue = swarm[1]
    good = _good_metrics().dict()
    # an honest peer cannot write under another peer's key: it has nothing to sign it with (its store()
    # may still report success: the rogue node keeps anything; what matters is what honest peers accept)
    second.store(metrics_key(RUN_ID), subkey=first_key, value=good, expiration_time=get_dht_time() + 60)
    # a rogue node without validators stores an unsigned record claiming the first peer's identity,
    # and one under a made-up subkey without any public key
    rogue.store(metrics_key(RUN_ID), subkey=first_key, value=good, expiration_time=get_dht_time() + 60)
    rogue.store(metrics_key(RUN_ID), subkey=b"not-a-key", value=good, expiration_time=get_dht_time() + 60)
    time.sleep(1.0)
    for dht in (first, second):
        assert not {first_key, b"not-a-key"} & _raw_subkeys(dht)
    # honest records still go through afterwards
    assert publish_metrics(second, RUN_ID, second_key, _good_metrics(epoch=4)).result(timeout=10)
    assert _visible(first)[second_key].epoch == 4
