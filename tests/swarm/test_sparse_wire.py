"""--outer_compression sparse over hivemind: a rogue process sending malformed payloads is refused, and at density 1
with 32-bit values two real optimizers take exactly the outer steps of today's dense local mode."""

from __future__ import annotations

import asyncio
import json
import sys

import pytest
import torch
from hivemind.averaging.allreduce import AveragingMode
from hivemind.p2p import P2P, PeerID
from hivemind.proto import averaging_pb2, runtime_pb2

from benchmarks.testbed.processes import REPO_ROOT
from benchmarks.testbed.rogue_sparse import RELAY_VARIANTS, StandaloneAllGather
from peer.swarm.hivemind_seam import SparsePseudoGradientAverager
from peer.swarm.hivemind_seam.sparse_wire import aggregate_contributions
from peer.swarm.sparse import SparseCodec

ROGUE_VARIANTS = [
    "position_out_of_range",
    "repeated_positions",
    "miscounted_positions",
    "nan_scale",
    "inf_scale",
    "other_settings",
    "truncated",
    "oversized",
    "honest",
    "honest_late_end",
]
HONEST = ("honest", "honest_late_end")


def test_the_wire_fields_the_payload_travels_in_exist():
    """The payload rides in hivemind's AveragingData messages (pinned: a renamed field would break the wire)."""
    message = averaging_pb2.AveragingData(
        code=averaging_pb2.PART_FOR_AVERAGING, group_id=b"g", tensor_part=runtime_pb2.Tensor(buffer=b"x"), weight=2.0
    )
    assert averaging_pb2.AveragingData.FromString(message.SerializeToString()).tensor_part.buffer == b"x"
    assert averaging_pb2.AVERAGED_PART != averaging_pb2.PART_FOR_AVERAGING


@pytest.mark.timeout(120)
def test_a_rogue_process_sending_malformed_payloads_is_refused(caplog):
    codec = SparseCodec(total=10_000, density=0.02, bits=2, chunk=1000)
    own = torch.randn(codec.total)
    own_payload = codec.encode(own)
    own_decoded = codec.decode(own_payload)

    async def run():
        p2p = await P2P.create()
        maddrs = [str(m) for m in await p2p.get_visible_maddrs()]
        spec = dict(
            maddrs=maddrs,
            peer_id=p2p.peer_id.to_base58(),
            group_id="ab" * 8,
            total=codec.total,
            density=codec.density,
            bits=codec.bits,
            chunk=codec.chunk,
            variants=ROGUE_VARIANTS,
        )
        rogue = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "benchmarks.testbed.rogue_sparse", json.dumps(spec),
            cwd=REPO_ROOT, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
        )  # fmt: skip
        try:
            rogue_id = PeerID.from_base58((await asyncio.wait_for(rogue.stdout.readline(), 60)).decode().strip())
            runners = []
            for index in range(len(ROGUE_VARIANTS)):
                runner = StandaloneAllGather(
                    p2p=p2p,
                    servicer_type=StandaloneAllGather,
                    prefix=f"rogue_sparse_{index}",
                    group_id=bytes.fromhex(spec["group_id"]),
                    ordered_peer_ids=[rogue_id, p2p.peer_id],  # the rogue dials
                    modes=[AveragingMode.NODE, AveragingMode.NODE],
                    weight=1.0,
                    payload=own_payload,
                    payload_bytes=codec.payload_bytes,
                    sender_timeout=10.0,
                )
                await runner.add_p2p_handlers(p2p, namespace=runner._prefix)
                runners.append(runner)
            rogue.stdin.write(b"go\n")
            await rogue.stdin.drain()
            results = []
            for runner in runners:
                gathered = await asyncio.wait_for(runner.run(), 60)
                results.append(aggregate_contributions(codec, gathered, p2p.peer_id, own_decoded, [codec.total], 4.0))
            lines = [json.loads(await asyncio.wait_for(rogue.stdout.readline(), 30)) for _ in ROGUE_VARIANTS]
            return results, lines
        finally:
            if rogue.returncode is None:
                rogue.kill()
            await rogue.wait()
            await p2p.shutdown()

    results, lines = asyncio.run(run())
    assert [line["variant"] for line in lines] == ROGUE_VARIANTS  # the rogue really sent each one
    for variant, (averaged, refused), line in zip(ROGUE_VARIANTS, results, lines):
        if variant in HONEST:  # the control: a well-formed payload from the same process is averaged in...
            assert not refused and not torch.equal(averaged, own_decoded), variant
            # ...and the dialer got this peer's payload, even when its end-of-stream came late (both average the same)
            assert line["bytes_back"] == codec.payload_bytes, variant
            continue
        # refused before decoding (or cut off at the run's payload size): only this peer's own part is averaged
        assert torch.equal(averaged, own_decoded), variant
    log = caplog.text
    for reason in (
        "out of range, unsorted or repeated",
        "does not hold exactly its number of positions",
        "NaN, inf or negative",
        "are not this run's",
        "its size is",
    ):
        assert reason in log
    assert "sent more than the" in log  # the oversized stream was cut off at this run's payload size


@pytest.mark.timeout(120)
@pytest.mark.parametrize("clients", [2, 1])
def test_client_peers_exchange_their_payloads_through_the_aux_relay(clients):
    """Client-mode peers cannot dial each other; the group's aux peer relays each one's payload to the others, so all
    gather the same contributions in the group's order (the aux itself contributes nothing). A client alone with an
    aux has nobody to exchange with and keeps its own contribution."""
    codec = SparseCodec(total=10_000, density=0.02, bits=2, chunk=1000)
    payloads = [codec.encode(torch.randn(codec.total)) for _ in range(clients)]

    async def run():
        relay = await P2P.create()
        maddrs = [str(m) for m in await relay.get_visible_maddrs()]
        peers = [await P2P.create(initial_peers=maddrs) for _ in range(clients)]
        ids = [*(p2p.peer_id for p2p in peers), relay.peer_id]
        modes = [*(AveragingMode.CLIENT for _ in peers), AveragingMode.AUX]
        try:
            runners = []
            for p2p, payload in [*zip(peers, payloads), (relay, b"")]:
                runner = StandaloneAllGather(
                    p2p=p2p, servicer_type=StandaloneAllGather, prefix="relay_test", group_id=bytes.fromhex("ab" * 8),
                    ordered_peer_ids=ids, modes=modes, weight=1.0 if payload else 0.0, payload=payload,
                    payload_bytes=codec.payload_bytes, sender_timeout=10.0,
                )  # fmt: skip
                await runner.add_p2p_handlers(p2p, namespace=runner._prefix)
                runners.append(runner)
            return ids, await asyncio.wait_for(asyncio.gather(*(runner.run() for runner in runners)), 60)
        finally:
            for p2p in [*peers, relay]:
                await p2p.shutdown()

    ids, gathered = asyncio.run(run())
    expected = [(peer, payload, 1.0) for peer, payload in zip(ids, payloads)]
    assert gathered[:-1] == [expected] * clients
    assert gathered[-1] == []


@pytest.mark.timeout(180)
def test_a_rogue_relay_cannot_slip_in_or_spoil_a_client_payload(caplog):
    """A rogue process as the group's aux relays two honest clients' payloads changed (RELAY_VARIANTS): a payload
    said to come from a peer that is not another client, too many bytes, a wrong message code, a spoiled payload of
    the right size, nothing at all. Each client refuses it (before decoding, or by the codec's check) and averages
    its own contribution only; the honest relay of the same process is the control."""
    codec = SparseCodec(total=10_000, density=0.02, bits=2, chunk=1000)
    payloads = [codec.encode(torch.randn(codec.total)) for _ in range(2)]
    decoded = [codec.decode(payload) for payload in payloads]
    spec = dict(
        total=codec.total, density=codec.density, bits=codec.bits, chunk=codec.chunk, group_id="cd" * 8,
        variants=RELAY_VARIANTS,
    )  # fmt: skip

    async def run():
        rogue = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "benchmarks.testbed.rogue_sparse", "--relay", json.dumps(spec),
            cwd=REPO_ROOT, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
        )  # fmt: skip
        clients = []
        try:
            hello = json.loads(await asyncio.wait_for(rogue.stdout.readline(), 60))
            relay_id = PeerID.from_base58(hello["peer_id"])
            clients = [await P2P.create(initial_peers=hello["maddrs"]) for _ in range(2)]
            rogue.stdin.write(" ".join(p2p.peer_id.to_base58() for p2p in clients).encode() + b"\n")
            await rogue.stdin.drain()
            assert (await asyncio.wait_for(rogue.stdout.readline(), 60)).strip() == b"ready"
            ids = [*(p2p.peer_id for p2p in clients), relay_id]
            results = []
            for index in range(len(RELAY_VARIANTS)):
                runners = []
                for p2p, payload in zip(clients, payloads):
                    runner = StandaloneAllGather(
                        p2p=p2p, servicer_type=StandaloneAllGather, prefix=f"rogue_relay_{index}",
                        group_id=bytes.fromhex(spec["group_id"]), ordered_peer_ids=ids,
                        modes=[AveragingMode.CLIENT, AveragingMode.CLIENT, AveragingMode.AUX], weight=1.0,
                        payload=payload, payload_bytes=codec.payload_bytes, sender_timeout=5.0,
                    )  # fmt: skip
                    runners.append(runner)
                gathered = await asyncio.wait_for(asyncio.gather(*(runner.run() for runner in runners)), 60)
                results.append(
                    [
                        aggregate_contributions(codec, each, p2p.peer_id, own, [codec.total], 4.0)
                        for each, p2p, own in zip(gathered, clients, decoded)
                    ]
                )
            return ids, results
        finally:
            if rogue.returncode is None:
                rogue.stdin.close()
                rogue.kill()
            await rogue.wait()
            for p2p in clients:
                await p2p.shutdown()

    ids, results = asyncio.run(run())
    both = aggregate_contributions(
        codec, [(ids[0], b"", 1.0), (ids[1], payloads[1], 1.0)], ids[0], decoded[0], [codec.total], 4.0
    )[0]
    for variant, per_client in zip(RELAY_VARIANTS, results):
        for index, (averaged, refused) in enumerate(per_client):
            other = ids[1 - index]
            if variant == "honest":  # the control: each client averages the other's contribution too
                assert not refused, variant
                if index == 0:
                    assert torch.equal(averaged, both), variant
                continue
            assert refused == ([other] if variant == "spoiled" else []), variant
            assert torch.equal(averaged, decoded[index]), variant  # its own contribution only
    log = caplog.text
    assert "not another client of the group" in log  # foreign_origin
    assert "bytes for" in log  # oversized: cut off at this run's payload size
    assert "PROTOCOL_VIOLATION" in log  # wrong_code
    assert "NaN, inf or negative" in log  # spoiled: refused by the codec's check
    assert "passed on nothing from" in log  # withheld


# ------------------------------------------------------------------------------------------- two optimizers


def _two_peer_rounds(collab, rounds: int = 2, after=None):
    """Two real optimizers (own DHTs and averager processes), ``rounds`` rounds of one local step each; the model
    parameters of both peers after each round, their error-feedback buffers; ``after(peers)`` runs before they
    shut down."""
    import threading

    from tests.swarm.test_local_mode import _local_step, finish_round, two_local_peers

    history = []
    with two_local_peers(collab, f"sparse_wire_{collab.outer_compression}") as peers:
        for round_index in range(rounds):
            for seed, (model, optimizer, inner) in enumerate(peers):
                _local_step(model, inner, data_seed=100 * round_index + seed, epoch=optimizer.local_epoch)
            threads = [threading.Thread(target=finish_round, args=(opt,)) for _, opt, _ in peers]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join(timeout=90)
            assert all(opt.local_epoch == round_index + 1 for _, opt, _ in peers), "a round did not finish"
            # a peer that ended a round alone (no group in time on a loaded machine) stepped on its own pseudo-gradient
            assert not any(opt.missed_round for _, opt, _ in peers), "a round was not averaged by both peers"
            history.append([[p.detach().clone() for p in model.parameters()] for model, _, _ in peers])
        sparse = collab.outer_compression == "sparse"
        assert all(isinstance(opt.grad_averager, SparsePseudoGradientAverager) == sparse for _, opt, _ in peers)
        feedback = [getattr(opt.grad_averager, "feedback", None) for _, opt, _ in peers]
        buffers = [None if f is None else f.buffer.clone() for f in feedback]
        if after is not None:
            after(peers)
        return history, buffers


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_density_one_and_32_bits_take_exactly_the_outer_steps_of_dense_local_mode():
    from peer.swarm.config import CollaborationArguments

    common = dict(
        sync_mode="local",
        target_batch_size=16,  # one local step of 8 samples per peer per round
        matchmaking_time=5.0,  # slack for a loaded machine: a peer that finds no group steps alone
        averaging_timeout=30.0,
        compression="none",  # today's lossless wire format (the default 8-bit one is lossy by design)
    )
    dense, _ = _two_peer_rounds(CollaborationArguments(**common))
    sparse, buffers = _two_peer_rounds(
        CollaborationArguments(**common, outer_compression="sparse", sparse_density=1.0, sparse_bits=32)
    )
    for round_dense, round_sparse in zip(dense, sparse):
        for peer_dense, peer_sparse in zip(round_dense, round_sparse):
            for a, b in zip(peer_dense, peer_sparse):  # Nesterov outer steps with momentum: identical bits
                assert torch.equal(a.double(), b.double())
        assert all(torch.equal(a, b) for a, b in zip(*round_sparse)), "both peers hold the same parameters"
    assert all(not buffer.any() for buffer in buffers), "nothing was left out, nothing is owed"


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_sparse_rounds_at_the_defaults_keep_peers_equal_and_the_buffer_in_backups(tmp_path):
    """The default settings (2 % density, 2 bits): both peers apply the same average, owe something afterwards; a
    backup keeps the buffer and restores it; a state download resets it (the module docstring of sparse_wire)."""
    from peer.backup import load_backup, save_backup
    from peer.swarm.config import CollaborationArguments

    collab = CollaborationArguments(
        sync_mode="local",
        outer_compression="sparse",
        sparse_chunk=256,  # the toy model has ~1000 parameters: a few chunks of 5 values each
        # every peer applies the same sparse average: no parameter averaging needed (its 8-bit wire format would
        # itself set the peers' parameters apart by rounding)
        average_state_every=1000,
        target_batch_size=16,
        matchmaking_time=5.0,
        averaging_timeout=20.0,
    )
    seen = {}

    def backup_then_download(peers):
        (model, optimizer, _), (other_model, other, _) = peers
        # every round heard both contributions: none counts as partial (a partial one withholds the state)
        seen["partial"] = [peer.grad_averager.partial_results.value for peer in (optimizer, other)]
        feedback = optimizer.grad_averager.feedback
        owed = feedback.buffer.clone()
        assert save_backup(str(tmp_path), model, optimizer) is not None
        feedback.reset()
        assert load_backup(str(tmp_path), model, optimizer) is not None
        seen["restored"] = torch.equal(feedback.buffer, owed)
        other_feedback = other.grad_averager.feedback
        seen["owed_before_download"] = bool(other_feedback.buffer.any())
        other.state_averager.allow_state_sharing = True
        seen["downloaded"] = other.load_state_checked()
        seen["reset"] = not other_feedback.buffer.any()

    history, buffers = _two_peer_rounds(collab, rounds=3, after=backup_then_download)
    for round_params in history:
        assert all(torch.equal(a, b) for a, b in zip(*round_params)), "both peers hold the same parameters"
    assert all(buffer.any() for buffer in buffers), "top-k left values out: they are owed"
    assert seen == dict(partial=[0, 0], restored=True, owed_before_download=True, downloaded=True, reset=True), seen


def test_every_peer_takes_the_group_average_bit_for_bit_and_keeps_its_own_values_where_it_is_not_finite():
    """Two peers whose own pseudo-gradients differ take the same averaged bits (``take_average``): hivemind's
    own + (average - own) rounds differently on each, which left training donors' states 5e-7 apart (issue 30)."""
    from peer.swarm.hivemind_seam.sparse_wire import take_average

    generator = torch.Generator().manual_seed(0)
    shapes = [(64, 32), (1000,)]
    own = [[torch.randn(shape, generator=generator) * scale for shape in shapes] for scale in (1e-3, 10.0)]
    averaged = torch.randn(sum(torch.Size(shape).numel() for shape in shapes), generator=generator)
    averaged[5] = float("nan")
    kept0 = own[0][0].reshape(-1)[5].item()
    hivemind_way = [torch.cat([t.reshape(-1) for t in tensors]) for tensors in own]
    hivemind_way = [mine + (averaged - mine) for mine in hivemind_way]
    finite = torch.isfinite(averaged)
    assert not torch.equal(hivemind_way[0][finite], hivemind_way[1][finite])  # the rounding this test is about
    lossless = [t.clone() for t in own[0]]  # density 1 with 32 bits: dense local mode's own + delta, bit for bit
    assert take_average(lossless, averaged, exact=False) == 1
    assert torch.equal(torch.cat([t.reshape(-1) for t in lossless]), torch.nan_to_num(hivemind_way[0], nan=kept0))
    for tensors in own:
        kept = tensors[0].reshape(-1)[5].item()
        assert take_average(tensors, averaged) == 1
        flat = torch.cat([t.reshape(-1) for t in tensors])
        assert torch.equal(flat[finite], averaged[finite]) and flat[5].item() == kept
