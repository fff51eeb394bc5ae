"""A peer that missed a gradient round takes that round's result from peers that took it (round_result.py): real
hivemind averagers, each in its own averager process with its own p2pd, on loopback, with hivemind's 8-bit
blockwise wire compression. One of the peers that took the round is a rogue: it averages honestly and then serves a
different result (well formed, plausible in size)."""

from __future__ import annotations

import threading
import time

import pytest
import torch
from hivemind.averaging import DecentralizedAverager
from hivemind.averaging.allreduce import AveragingMode
from hivemind.averaging.group_info import GroupInfo
from hivemind.compression import (
    BlockwiseQuantization,
    CompressionInfo,
    deserialize_torch_tensor,
    serialize_torch_tensor,
)
from hivemind.utils import MSGPackSerializer

from peer.swarm.hivemind_seam.averaging import _PolicyAveraging
from peer.swarm.hivemind_seam.round_result import GROUP_DIGEST, RoundResultSharing, exact_blockwise, group_label
from tests.support.averagers import average_once, shut_down, start_averagers, tensor_of

SIZE = 300_000
EPOCH = 7


class _Averager(RoundResultSharing, _PolicyAveraging, DecentralizedAverager):
    _same_result = True


class _Rogue(_Averager):
    """Takes part in the round like the others, then serves its result scaled by 1.5."""

    def _encode(self, index, tensor):
        return serialize_torch_tensor(tensor * 1.5)


_Rogue.__name__ = _Averager.__name__  # hivemind names its RPCs after the class


class _ProbeLiar(_Averager):
    """Answers every probe that it holds the round's result."""

    def _probe_status(self, epoch):
        return "ok"


_ProbeLiar.__name__ = _Averager.__name__


def _inputs(count: int):
    generator = torch.Generator().manual_seed(0)
    common = torch.randn(SIZE, generator=generator)
    return [common + 0.3 * torch.randn(SIZE, generator=generator) for _ in range(count)]


@pytest.fixture
def swarm():
    """Three peers (two honest, one rogue) that averaged round EPOCH, and five client-mode peers that did not take
    part (each asks once: a peer serves an asker one result per round). Built for each test: the suite kills a test's
    child processes when it ends (conftest.py)."""
    modes = ["node"] * 3 + ["client"] * 5
    kinds = [_Averager, _Averager, _Rogue] + [_Averager] * 5
    dhts, averagers = start_averagers(
        kinds, _inputs(8), modes, prefix="round_result", compression=BlockwiseQuantization()
    )
    try:
        for averager in averagers[:3]:
            averager.round_epoch.value = EPOCH
        average_once(averagers[:3])
        yield averagers
    finally:
        shut_down(averagers + dhts)


@pytest.mark.timeout(180)
def test_a_missed_round_is_taken_from_the_peers_that_took_it_and_a_rogue_is_outvoted(swarm):
    honest, other, rogue, asker, outvoted, lone, _, _ = swarm
    assert [averager.result_epoch.value for averager in (honest, other, rogue)] == [EPOCH] * 3
    result = tensor_of(honest)
    assert torch.equal(result, tensor_of(other)) and torch.equal(result, tensor_of(rogue))
    norm = float(result.norm())

    # a round nobody took: nothing is changed
    before = tensor_of(asker)
    peers = [honest.peer_id, other.peer_id, rogue.peer_id]
    assert asker.fetch_round_result(epoch=EPOCH + 1, candidates=peers, max_norm=10 * norm, timeout=5) is None
    assert torch.equal(tensor_of(asker), before)

    # the two honest answers agree bit for bit and outvote the rogue's
    used = outvoted.fetch_round_result(epoch=EPOCH, candidates=peers, max_norm=10 * norm, timeout=20)
    assert used is not None and rogue.peer_id not in used and len(used) == 2
    assert torch.equal(tensor_of(outvoted), result)
    assert outvoted.result_epoch.value == EPOCH  # it can serve the round in turn

    # one honest and one rogue answer: neither is taken
    before = tensor_of(asker)
    used = asker.fetch_round_result(
        epoch=EPOCH, candidates=[honest.peer_id, rogue.peer_id], max_norm=10 * norm, timeout=20
    )
    assert used is None and torch.equal(tensor_of(asker), before)

    # a lone answer is held to the norm bound: the rogue's 1.5x result is refused under a bound of 1.2x
    before = tensor_of(lone)
    assert lone.fetch_round_result(epoch=EPOCH, candidates=[rogue.peer_id], max_norm=1.2 * norm, timeout=20) is None
    assert torch.equal(tensor_of(lone), before)
    # ... and the honest peer's within it is taken
    used = lone.fetch_round_result(epoch=EPOCH, candidates=[other.peer_id], max_norm=1.2 * norm, timeout=20)
    assert used == [other.peer_id] and torch.equal(tensor_of(lone), result)

    # a peer serves an asker once per round
    again = lone.fetch_round_result(epoch=EPOCH, candidates=[other.peer_id], max_norm=10 * norm, timeout=5)
    assert again is None


@pytest.mark.timeout(120)
def test_a_round_is_named_by_its_group_where_the_asker_was_in_one(swarm):
    """Epoch labels can differ by one between peers (a client's lagged behind the round it was in); every member of
    a group knows the group's ID. A peer whose group formed asks for that group's result, whatever its label."""
    honest, other, *_, lagged, stranger = swarm
    digest = bytes(honest.formed_group.raw)
    assert honest.formed_epoch.value == EPOCH and bytes(other.formed_group.raw) == digest
    result = tensor_of(honest)
    norm = float(result.norm())
    peers = [honest.peer_id, other.peer_id]

    # in the group under a label one behind: it takes the group's result
    lagged.formed_group.raw, lagged.formed_epoch.value = digest, EPOCH - 1
    used = lagged.fetch_round_result(epoch=EPOCH - 1, candidates=peers, max_norm=10 * norm, timeout=20)
    assert used is not None and sorted(map(str, used)) == sorted(map(str, peers))
    assert torch.equal(tensor_of(lagged), result)

    # in another group under the same label (the others retried the epoch without it): the epoch's result
    stranger.formed_group.raw, stranger.formed_epoch.value = bytes(GROUP_DIGEST), EPOCH
    used = stranger.fetch_round_result(epoch=EPOCH, candidates=peers, max_norm=10 * norm, timeout=20)
    assert used is not None and torch.equal(tensor_of(stranger), result)


@pytest.mark.timeout(120)
def test_a_late_peer_takes_the_round_it_missed_after_the_server_began_its_next_round(swarm):
    """A server's next round overwrites its averaged tensors; the result they held is served on as its previous
    one (``retire_result``), by epoch and by group, so a peer that asks a second late takes the round it missed, not
    nothing and not the next round, also while the servers' next all-reduce runs (hivemind holds their averaged
    tensors' lock for its whole length). The round before that is gone."""
    honest, other, _, late, grouped, older, *_ = swarm
    result = tensor_of(honest)
    norm = float(result.norm())
    digest = bytes(honest.formed_group.raw)
    for server in (honest, other):  # both begin round EPOCH + 1: their own gradients replace the result
        server.retire_result()
        server.result_epoch.value, server.round_epoch.value, server.ended_epoch.value = -1, EPOCH + 1, EPOCH
        with server.get_tensors() as tensors:
            tensors[0].normal_()
    assert honest.previous_epoch.value == EPOCH and bytes(honest.previous_group.raw) == digest
    peers = [honest.peer_id, other.peer_id]

    for server in (honest, other):  # their all-reduce of round EPOCH + 1 runs while the late peers ask
        assert server.lock_averaged_tensors.acquire(timeout=10)
    try:
        used = late.fetch_round_result(
            epoch=EPOCH, candidates=peers, max_norm=10 * norm, timeout=20, outside_group=True
        )
        assert used is not None and len(used) == 2 and torch.equal(tensor_of(late), result)
        assert late.result_epoch.value == EPOCH  # the round it missed, not the next label's

        grouped.formed_group.raw, grouped.formed_epoch.value = digest, EPOCH - 1  # by its group, under a lagging label
        used = grouped.fetch_round_result(epoch=EPOCH - 1, candidates=peers, max_norm=10 * norm, timeout=20)
        assert used is not None and torch.equal(tensor_of(grouped), result)
    finally:
        for server in (honest, other):
            server.lock_averaged_tensors.release()

    # round EPOCH + 1 ends with a result; round EPOCH's is then two rounds old and no longer served
    for server in (honest, other):
        server.result_epoch.value = EPOCH + 1
        server.retire_result()
        server.result_epoch.value, server.round_epoch.value, server.ended_epoch.value = -1, EPOCH + 2, EPOCH + 1
    assert honest.previous_epoch.value == EPOCH + 1
    before = tensor_of(older)
    assert older.fetch_round_result(epoch=EPOCH, candidates=peers, max_norm=10 * norm, timeout=5) is None
    assert torch.equal(tensor_of(older), before)


@pytest.mark.timeout(120)
def test_an_asker_waits_for_the_round_a_server_has_not_begun_yet(swarm):
    """A client whose round failed as it began asks before the full peers' epoch ended: their round of that epoch
    is the next they run (``pending``), so it waits for it instead of stepping apart. A round of the next label that
    had not begun when asked is not taken by the next-label rule."""
    honest, _, _, _, _, _, asker, lagging = swarm
    result = tensor_of(honest)
    norm = float(result.norm())
    honest.result_epoch.value, honest.round_epoch.value, honest.ended_epoch.value = -1, EPOCH - 1, EPOCH - 1
    before = tensor_of(lagging)
    used = lagging.fetch_round_result(
        epoch=EPOCH - 1, candidates=[honest.peer_id], max_norm=10 * norm, timeout=3, outside_group=True
    )
    assert used is None and torch.equal(tensor_of(lagging), before)

    def begin_then_end():
        honest.round_epoch.value = EPOCH
        time.sleep(1.0)
        # the order a server keeps (``_took_whole_result`` before ``_allreduce_ended``): ended without a result is
        # a round that failed, answered ``none`` (a CI run asked between the two in the reverse order)
        honest.result_epoch.value = EPOCH
        honest.ended_epoch.value = EPOCH

    timer = threading.Timer(1.0, begin_then_end)
    timer.start()
    try:
        used = asker.fetch_round_result(epoch=EPOCH, candidates=[honest.peer_id], max_norm=10 * norm, timeout=20)
    finally:
        timer.join()
    assert used == [honest.peer_id] and torch.equal(tensor_of(asker), result)


@pytest.mark.timeout(120)
def test_a_peer_alone_in_its_group_takes_the_round_running_under_the_next_label(swarm):
    """A peer whose group had no other data sender (it came late; an assisting aux led a second group) asks outside
    its group. Under its own label the others hold nothing, and their round of the next label counts only while it
    runs when asked: then it was the round this peer's ran beside, and this peer's label lagged one behind. It holds
    the result as that round (``result_epoch``: the optimizer moves its epoch on by one)."""
    honest, *_, lagging, late = swarm
    result = tensor_of(honest)
    norm = float(result.norm())
    # honest's round EPOCH still runs: it answers "later" until its result is in
    honest.result_epoch.value, honest.round_epoch.value, honest.ended_epoch.value = -1, EPOCH, EPOCH - 1
    timer = threading.Timer(1.0, lambda: setattr(honest.result_epoch, "value", EPOCH))
    timer.start()
    try:
        used = lagging.fetch_round_result(
            epoch=EPOCH - 1, candidates=[honest.peer_id], max_norm=10 * norm, timeout=20, outside_group=True
        )
    finally:
        timer.join()
    assert used == [honest.peer_id] and torch.equal(tensor_of(lagging), result)
    assert lagging.result_epoch.value == EPOCH  # held and served on as round EPOCH, the next label

    # a round of the next label that was over when asked is another round than the one this peer missed
    honest.ended_epoch.value = EPOCH
    before = tensor_of(late)
    used = late.fetch_round_result(
        epoch=EPOCH - 1, candidates=[honest.peer_id], max_norm=10 * norm, timeout=5, outside_group=True
    )
    assert used is None and torch.equal(tensor_of(late), before) and late.result_epoch.value == -1


@pytest.mark.timeout(180)
@pytest.mark.parametrize(
    "modes, unconfirmed",
    [(["aux", "client", "client"], [1, 1]), (["node", "client", "client"], [0, 0])],
    ids=["clients_and_an_aux", "with_a_serving_trainer"],
)
def test_a_round_without_a_serving_trainer_is_checked_against_the_serving_trainers(modes, unconfirmed):
    """A group of clients and an assisting aux holds no peer that serves its state: its whole result is the swarm's
    round only if no serving trainer took that round elsewhere, so its clients ask them (``unconfirmed``; volunteers
    that joined a second before their donor's round ended ran it among themselves while the donor stepped alone).
    With a serving trainer in the group its result is the swarm's."""
    inputs = [torch.zeros(SIZE) if mode == "aux" else tensor for tensor, mode in zip(_inputs(3), modes)]
    dhts, averagers = start_averagers(
        [_Averager] * 3, inputs, modes, prefix="unconfirmed", compression=BlockwiseQuantization()
    )
    try:
        for averager in averagers:
            averager.round_epoch.value = EPOCH
        average_once(averagers)
        assert [averager.result_epoch.value for averager in averagers] == [EPOCH] * 3
        clients = [averager for averager, mode in zip(averagers, modes) if mode == "client"]
        assert [averager.unconfirmed.value for averager in clients] == unconfirmed
    finally:
        shut_down(averagers + dhts)


@pytest.mark.timeout(180)
def test_an_assisting_aux_serves_a_round_it_took_with_clients_under_their_label():
    """A public trainer that missed the round an assisting aux took with two client trainers can be given it by
    nobody but the aux (clients cannot be dialled). The aux's own label lags one behind the trainers' here; it holds
    the round under the label its clients gathered in matchmaking, and the trainer takes exactly the clients' bits."""
    modes = ["aux", "client", "client", "node"]
    inputs = [torch.zeros(SIZE)] + _inputs(3)
    dhts, averagers = start_averagers(
        [_Averager] * 4, inputs, modes, prefix="aux_serves", compression=BlockwiseQuantization()
    )
    aux, first, second, trainer = averagers
    try:
        aux.round_epoch.value = EPOCH - 1
        for client in (first, second):
            client.round_epoch.value = EPOCH
        average_once([aux, first, second], gathers=[{"epoch": EPOCH - 1}, {"epoch": EPOCH}, {"epoch": EPOCH}])
        assert aux.result_epoch.value == EPOCH and first.result_epoch.value == EPOCH
        result = tensor_of(first)
        assert torch.equal(result, tensor_of(second)) and torch.equal(result, tensor_of(aux))

        bound = 10 * float(result.norm())
        used = trainer.fetch_round_result(epoch=EPOCH, candidates=[aux.peer_id], max_norm=bound, timeout=20)
        assert used == [aux.peer_id] and torch.equal(tensor_of(trainer), result)
    finally:
        shut_down(averagers + dhts)


def test_a_group_label_is_what_most_data_senders_gathered_and_a_hostile_one_counts_for_nothing():
    """``group_label`` reads untrusted matchmaking data: malformed entries, booleans, out-of-range labels and the aux's
    own label are left out, and a tie names no label (the aux then keeps its own)."""
    serializer = MSGPackSerializer

    def member(mode: AveragingMode, user) -> bytes:
        return serializer.dumps([0.0, mode.value, serializer.dumps(user)])

    def label(*gathered: bytes):
        return group_label(serializer, GroupInfo(b"group", tuple(range(len(gathered))), gathered))

    client, aux = AveragingMode.CLIENT, AveragingMode.AUX
    assert label(member(aux, {"epoch": 4}), member(client, {"epoch": 5}), member(client, {"epoch": 5})) == 5
    assert label(member(client, {"epoch": 5}), member(client, {"epoch": 6})) is None  # a liar ties
    assert label(member(aux, {"epoch": 4}), member(client, None)) is None  # an older peer gathers nothing
    hostile = [b"\xff", member(client, {"epoch": True}), member(client, {"epoch": 1 << 63}), member(client, [5])]
    assert label(*hostile, member(client, {"epoch": -1}), member(client, {"epoch": 3})) == 3


class _Accumulating(DecentralizedAverager):
    """Stands in for hivemind's GradientAverager, whose ``load_accumulators_into_averager_`` loads this peer's own
    gradients into the averaged tensors: here they are the tensors as they are."""

    def load_accumulators_into_averager_(self):
        pass


class _Trainer(RoundResultSharing, _PolicyAveraging, _Accumulating):
    _same_result = True


@pytest.mark.timeout(120)
def test_a_trainer_that_stepped_alone_serves_its_own_gradients_as_the_round():
    """hivemind steps a trainer that sees no other peer with its own gradients (``own_round``, set by the optimizer):
    that is the swarm's step of the epoch, and a peer that missed the round takes it (a volunteer that joined a
    second before the lone public trainer's round) instead of stepping with its own gradients."""
    dhts, (lone, joiner) = start_averagers(
        [_Trainer, _Trainer], _inputs(2), ["node", "client"], prefix="own_round", compression=BlockwiseQuantization()
    )
    try:
        lone.round_epoch.value = EPOCH
        lone.stepping_alone()
        lone.load_accumulators_into_averager_()
        assert lone.result_epoch.value == EPOCH and not lone.own_round
        own = tensor_of(lone)
        bound = 10 * float(own.norm())
        used = joiner.fetch_round_result(epoch=EPOCH, candidates=[lone.peer_id], max_norm=bound, timeout=20)
        assert used == [lone.peer_id] and torch.equal(tensor_of(joiner), own)

        # its next round's gradients replace them: no longer served
        lone.load_accumulators_into_averager_()
        assert lone.result_epoch.value == -1
    finally:
        shut_down([lone, joiner, *dhts])


@pytest.mark.parametrize("size", [524_288, 65_536, 12_293])
def test_a_result_of_8_bit_parts_travels_in_its_own_codes_bit_for_bit(size):
    """hivemind's blockwise codec does not give back the same bits when its decoding is quantized again;
    ``exact_blockwise`` recovers the scales and codes instead: about one byte per value, decoded exactly."""
    codec = BlockwiseQuantization()
    generator = torch.Generator().manual_seed(size)
    values = 0.01 * torch.randn(size, generator=generator)
    parts = [codec.compress(part, CompressionInfo.from_tensor(part, key=0)) for part in values.split(524_288)]
    decoded = torch.cat([deserialize_torch_tensor(part) for part in parts])
    assert not torch.equal(
        deserialize_torch_tensor(codec.compress(decoded, CompressionInfo.from_tensor(decoded))), decoded
    )
    encoded = exact_blockwise(decoded)
    assert torch.equal(deserialize_torch_tensor(encoded), decoded)
    assert len(encoded.buffer) < 1.1 * size


@pytest.mark.timeout(120)
def test_a_late_trainer_learns_whether_the_round_ended_without_it_and_a_lying_probe_is_outweighed():
    """A trainer still looking for a group when its epoch ends asks whether the others took the round without it
    (``round_ended_without_this_peer``): they did only where a peer holds its result. A peer that began the round
    and has no result yet (no group, or an all-reduce that runs and may still break off and look for a group again),
    or begins it next, means the late one may still join; a peer that claims the result while an honest one begins
    the round next does not make it leave."""
    modes = ["node"] * 3 + ["client"]
    dhts, averagers = start_averagers(
        [_Averager, _Averager, _ProbeLiar, _Averager], _inputs(4), modes, prefix="probe", compression=None
    )
    honest, other, liar, late = averagers

    def ended(*peers) -> bool:
        ids = [peer.peer_id for peer in peers]
        return late.round_ended_without_this_peer(epoch=EPOCH, candidates=ids, timeout=10)

    try:
        for peer in (honest, other):  # both began round EPOCH (their epoch ended), no group yet
            peer.round_epoch.value, peer.ended_epoch.value = EPOCH, EPOCH - 1
        assert not ended(honest, other)
        honest.formed_epoch.value = EPOCH  # its all-reduce of the round began: it may still break off
        assert not ended(honest, other)
        honest.ended_epoch.value = EPOCH  # the round over, its result held
        honest.result_epoch.value = EPOCH
        assert ended(honest)
        honest.result_epoch.value = -1
        honest.round_epoch.value, honest.ended_epoch.value = EPOCH - 1, EPOCH - 1  # EPOCH is the round it begins next
        assert not ended(honest, liar)
        assert not ended(other, honest)
    finally:
        shut_down(averagers + dhts)
