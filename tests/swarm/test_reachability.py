"""Reachability (peer.swarm.reachability): the dial-back probe between real peers on 127.0.0.1, the decision and its
forced modes, the signed ``reachable`` records, the client trainer's wait for a reducer, and a rogue process that
floods probes and asks for third-party dials."""

from __future__ import annotations

import json
import logging
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import hivemind
import pytest
from hivemind.utils import get_dht_time

from peer.swarm.hivemind_seam.reachability import (
    DialBackLimits,
    DialBackRequest,
    DialBackServer,
    own_dialable_maddrs,
    relayed,
)
from peer.swarm.identity import load_or_create_signing_key
from peer.swarm.keys import reachable_key
from peer.swarm.network import NetworkArguments, connect
from peer.swarm.reachability import ReducerWatch, decide_without_probe
from peer.swarm.records import ReachablePeer, fetch_reachable, make_validators, publish_reachable

REPO_ROOT = Path(__file__).resolve().parents[2]
RUN_ID = "reach_run"
LOOPBACK = ["/ip4/127.0.0.1/tcp/0"]


def closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def maddrs_of(dht: hivemind.DHT) -> list:
    return [str(m) for m in dht.get_visible_maddrs()]


@pytest.fixture
def server():
    dht = hivemind.DHT(start=True, host_maddrs=LOOPBACK)
    dht.run_coroutine(DialBackServer(DialBackLimits(probes_per_minute=4)).register)
    yield dht
    dht.shutdown()


@pytest.mark.timeout(120)
def test_dial_back_tells_a_listening_peer_from_an_address_nobody_listens_on(server):
    client = hivemind.DHT(start=True, host_maddrs=LOOPBACK, initial_peers=maddrs_of(server), client_mode=True)
    try:
        own = client.run_coroutine(own_dialable_maddrs)
        answer = client.run_coroutine(DialBackRequest(server.peer_id.to_base58(), own))
        assert answer.reachable and answer.refused is None and answer.dialled.startswith("127.0.0.1:")

        # a fresh connection to a port nobody listens on fails: the existing libp2p connection is not reused
        answer = client.run_coroutine(
            DialBackRequest(server.peer_id.to_base58(), [f"/ip4/127.0.0.1/tcp/{closed_port()}"])
        )
        assert not answer.reachable and answer.refused is None

        # only the requester's own addresses are dialled: another IP, another peer's ID, a relayed address
        others = [
            "/ip4/10.1.2.3/tcp/4001",
            f"/ip4/127.0.0.1/tcp/4001/p2p/{server.peer_id.to_base58()}",
            f"/ip4/127.0.0.1/tcp/4001/p2p/{server.peer_id.to_base58()}/p2p-circuit",
        ]
        answer = client.run_coroutine(DialBackRequest(server.peer_id.to_base58(), others))
        assert not answer.reachable and "no address of yours" in answer.refused

        # at most probes_per_minute probes per peer: the next is refused without dialling
        answer = client.run_coroutine(DialBackRequest(server.peer_id.to_base58(), own))
        assert answer.reachable
        answer = client.run_coroutine(DialBackRequest(server.peer_id.to_base58(), own))
        assert not answer.reachable and answer.refused.startswith("rate limit")
        assert all(not relayed(m) for m in own) and relayed("/ip4/1.2.3.4/tcp/1/p2p/Qm/p2p-circuit")
    finally:
        client.shutdown()


@pytest.mark.timeout(60)
def test_an_address_with_a_peer_id_inside_is_dialled_in_the_form_p2pd_reads():
    """hivemind's multiaddr library writes ``/p2p/<id>`` as a CID, which p2pd refuses; ``connect_to`` writes the peer
    ID's multihash (go_multiaddr). The relay measurement's circuit addresses (``/p2p/<relay>/p2p-circuit/p2p/<peer>``)
    need it: with the library's form no circuit was ever dialled, and a relay looked as if it granted no
    reservation."""
    import asyncio

    from hivemind.p2p import P2P, PeerID
    from hivemind.utils.multiaddr import Multiaddr

    from peer.swarm.hivemind_seam.reachability import connect_to, go_multiaddr

    relay = "12D3KooWB4jJ3SDuQ33NNeJt1zrYRqQYc9GNkKZnVGnEMwYCsGbf"
    peer = "12D3KooWC8u6eorW4n9ffNuqL1UCL54ekF1tf3wkKSCMRUUKD6Aw"
    circuit = f"/ip4/10.214.80.1/tcp/31337/p2p/{relay}/p2p-circuit/p2p/{peer}"
    encoded = go_multiaddr(circuit)
    assert str(encoded) == circuit
    multihash = PeerID.from_base58(relay).to_bytes()
    assert b"\xa5\x03" + bytes([len(multihash)]) + multihash in encoded.to_bytes()
    assert str(go_multiaddr("/ip4/1.2.3.4/tcp/5")) == "/ip4/1.2.3.4/tcp/5"

    async def dial() -> list:
        target, caller = await P2P.create(host_maddrs=LOOPBACK), await P2P.create(host_maddrs=LOOPBACK)
        try:
            address = str((await target.get_visible_maddrs())[0])
            assert f"/p2p/{target.peer_id}" in address
            outcomes = []
            try:  # hivemind's own encoding: the daemon cannot read it (if this starts to pass, go_multiaddr can go)
                await caller._client.connect(target.peer_id, [Multiaddr(address)])
                outcomes.append("library form dialled")
            except Exception as e:  # noqa: BLE001
                outcomes.append(str(e))
            await connect_to(caller, target.peer_id, [address])
            outcomes.append([info.peer_id for info in await caller.list_peers()] == [target.peer_id])
            return outcomes
        finally:
            await caller.shutdown()
            await target.shutdown()

    refused, connected = asyncio.run(dial())
    assert "length greater than remaining number of bytes" in refused and connected


def test_forced_modes_and_the_first_peer():
    def decide(**kwargs):
        settings = dict(client_mode=False, reachability="auto", has_initial_peers=True, can_be_client=True)
        return decide_without_probe(**{**settings, **kwargs})

    assert decide() is None  # a joiner probes
    assert decide(has_initial_peers=False).label == "public"  # the first peer
    assert decide(reachability="public").label == "public" and decide(reachability="public").source == "forced"
    assert decide(reachability="private").label == "client"
    assert decide(client_mode=True).label == "client" and "--client_mode" in decide(client_mode=True).reason
    with pytest.raises(ValueError, match="aux peer cannot run in client mode"):
        decide(reachability="private", can_be_client=False)
    with pytest.raises(ValueError, match="contradict"):
        NetworkArguments(client_mode=True, reachability="public")
    assert NetworkArguments().reachability == "auto"


@pytest.mark.timeout(180)
def test_a_joiner_probes_and_becomes_a_full_peer_or_a_client(tmp_path):
    """connect() end to end: the first peer is public; a joiner that can be dialled becomes a full peer (DHT
    restarted on the same port); one whose announced address nobody can dial stays a client; flags force it."""
    first = connect(NetworkArguments(run_id=RUN_ID, host_maddrs=LOOPBACK, rejoin_period=0))
    joiners = []
    try:
        assert first.reachability.source == "first" and not first.client_mode
        initial = first.join_line.split()[1:-2]

        def join(**kwargs):
            joiners.append(connect(NetworkArguments(run_id=RUN_ID, initial_peers=initial, rejoin_period=0, **kwargs)))
            return joiners[-1]

        reachable = join(host_maddrs=LOOPBACK)
        assert reachable.reachability.source == "probe" and reachable.reachability.reachable
        assert not reachable.client_mode and not reachable.dht.client_mode

        fixed_port = closed_port()  # a forwarded port is fixed: the full peer listens on it again after its restart
        fixed = join(host_maddrs=[f"/ip4/127.0.0.1/tcp/{fixed_port}"])
        assert not fixed.client_mode and all(f"/tcp/{fixed_port}/" in m for m in maddrs_of(fixed.dht))

        port = closed_port()
        hidden = join(host_maddrs=LOOPBACK, announce_maddrs=[f"/ip4/127.0.0.1/tcp/{port}"])
        assert hidden.client_mode and hidden.dht.client_mode and not hidden.reachability.reachable
        assert hidden.reachability.label == "client"

        forced = join(host_maddrs=LOOPBACK, client_mode=True)
        assert forced.client_mode and forced.reachability.source == "forced"

        # the reachable ones announce themselves; the clients do not
        announced = {r.peer_id for r in fetch_reachable(first.dht, RUN_ID, timeout=10)}
        assert first.dht.peer_id.to_bytes() in announced
        assert hidden.dht.peer_id.to_bytes() not in announced and forced.dht.peer_id.to_bytes() not in announced
    finally:
        for swarm in [*joiners, first]:
            swarm.shutdown_service()
            if swarm.watchdog is not None:
                swarm.watchdog.shutdown()
            swarm.dht.shutdown()


@pytest.mark.timeout(120)
def test_reachable_records_are_validated(tmp_path):
    key = load_or_create_signing_key(tmp_path / "key")
    validators, public_key = make_validators(RUN_ID, key)
    dht = hivemind.DHT(start=True, host_maddrs=LOOPBACK, record_validators=validators)
    try:
        good = ReachablePeer(peer_id=dht.peer_id.to_bytes(), role="assist", time=get_dht_time())
        assert publish_reachable(dht, RUN_ID, public_key, good).result(timeout=10)
        assert [r.role for r in fetch_reachable(dht, RUN_ID, timeout=10)] == ["assist"]

        expiration = get_dht_time() + 30
        for bad in (
            dict(good.dict(), role="boss"),  # roles are bounded
            dict(good.dict(), extra=1),
            dict(good.dict(), peer_id=b"x" * 1000),
        ):
            stored = dht.store(reachable_key(RUN_ID), bad, expiration, subkey=public_key, return_future=True)
            assert not stored.result(timeout=10)
        # unsigned entries (a subkey without this peer's key) are refused too
        assert not dht.store(reachable_key(RUN_ID), good.dict(), expiration, subkey=b"someone")
        with pytest.raises(Exception):
            ReachablePeer(peer_id=b"abc", role="trainer", time=float("inf"))
    finally:
        dht.shutdown()


@pytest.mark.timeout(120)
def test_reducer_watch_pauses_a_client_until_a_reachable_peer_appears(tmp_path, caplog):
    key = load_or_create_signing_key(tmp_path / "key")
    validators, public_key = make_validators(RUN_ID, key)
    reducer = hivemind.DHT(start=True, host_maddrs=LOOPBACK, record_validators=validators)
    client = hivemind.DHT(
        start=True,
        host_maddrs=LOOPBACK,
        initial_peers=maddrs_of(reducer),
        client_mode=True,
        record_validators=validators,
    )
    watch = ReducerWatch(client, RUN_ID, check_period=0.5, repeat_every=2.0)
    caplog.set_level(logging.WARNING, logger="peer.swarm.reachability")
    try:
        # an aux that does not assist is no reducer
        aux = ReachablePeer(peer_id=reducer.peer_id.to_bytes(), role="aux", time=get_dht_time())
        assert publish_reachable(reducer, RUN_ID, public_key, aux).result(timeout=10)
        started = time.monotonic()
        watch.start()
        stop, paused = threading.Event(), []
        while not watch.missing and time.monotonic() - started < 30:
            time.sleep(0.1)
        assert watch.missing
        trainer = threading.Thread(target=lambda: paused.append(watch.wait_while_missing(stop)), daemon=True)
        trainer.start()
        time.sleep(3.0)
        assert trainer.is_alive()  # paused: no gradient computed while nobody can reduce
        messages = [r.getMessage() for r in caplog.records if r.getMessage().startswith("no reachable peer")]
        assert len(messages) >= 2  # said at once, then repeated
        assert "training is paused" in messages[0] and "--announce_maddrs" in messages[0]
        assert time.monotonic() - started < 60

        trainer_record = ReachablePeer(peer_id=reducer.peer_id.to_bytes(), role="trainer", time=get_dht_time())
        assert publish_reachable(reducer, RUN_ID, public_key, trainer_record).result(timeout=10)
        trainer.join(timeout=30)
        assert not trainer.is_alive() and paused == [True] and not watch.missing
    finally:
        watch.shutdown()
        client.shutdown()
        reducer.shutdown()


@pytest.mark.timeout(180)
def test_a_rogue_flooding_probes_is_bounded_and_never_gets_a_third_party_dialled():
    """A real rogue process floods a reachable peer with probes that name another host's address: the server dials
    at most its per-minute budget, only the rogue's own address, and never the third party."""
    third_party = socket.socket()
    third_party.bind(("127.0.0.2", 0))  # another host: the rogue's requests come from 127.0.0.1
    third_party.listen(16)
    third_party.settimeout(0.2)
    limits = DialBackLimits(probes_per_minute=5)
    server = hivemind.DHT(start=True, host_maddrs=LOOPBACK)
    server.run_coroutine(DialBackServer(limits).register)
    try:
        target = f"/ip4/127.0.0.2/tcp/{third_party.getsockname()[1]}"
        rogue = subprocess.run(
            [
                sys.executable,
                "-m",
                "benchmarks.testbed.rogue_probe",
                "--initial_peers",
                *maddrs_of(server),
                "--server",
                server.peer_id.to_base58(),
                "--count",
                "30",
                "--target",
                target,
            ],
            cwd=REPO_ROOT,
            capture_output=True,
            text=True,
            timeout=150,
        )
        assert rogue.returncode == 0, rogue.stderr[-3000:]
        report = json.loads(rogue.stdout.strip().splitlines()[-1])
        outcomes = report["outcomes"]
        assert sum(outcomes.values()) == 30
        dialled = outcomes.get("reachable", 0) + outcomes.get("unreachable", 0)
        admitted = dialled + outcomes.get("refused: no address of yours at 127.0.0.1 to dial", 0)
        assert admitted <= limits.probes_per_minute, outcomes
        assert outcomes.get("refused: rate limit", 0) >= 30 - limits.probes_per_minute, outcomes
        with pytest.raises(socket.timeout):
            third_party.accept()  # nobody knocked on the third party
        # an honest peer still gets its answer: the budget is per peer
        honest = hivemind.DHT(start=True, host_maddrs=LOOPBACK, initial_peers=maddrs_of(server), client_mode=True)
        try:
            own = honest.run_coroutine(own_dialable_maddrs)
            assert honest.run_coroutine(DialBackRequest(server.peer_id.to_base58(), own)).reachable
        finally:
            honest.shutdown()
    finally:
        server.shutdown()
        third_party.close()
