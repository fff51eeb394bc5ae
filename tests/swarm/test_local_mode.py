"""--sync_mode local (DiLoCo-style local steps + outer averaging of pseudo-gradients): its options, its outer step
checked against a plain reference, and two real optimizers (each with its own DHT and averager processes) whose
round with H = 1, outer lr 1 and no momentum equals parameter averaging after each peer's local step."""

from __future__ import annotations

import contextlib
import threading
import time
from typing import Iterator

import pytest
import torch

from peer.strategies import LocalTraining, outer_momentum
from peer.swarm.config import CollaborationArguments, OptimizerArguments
from peer.swarm.hivemind_seam import PseudoGradientAverager, StateWithheld
from peer.swarm.keys import averager_prefixes, gradient_prefix_of_mode
from peer.swarm.optimizer import make_inner_optimizer, make_outer_sgd, set_inner_learning_rate
from tests.support.optimizers import loopback_optimizers

# ------------------------------------------------------------------------------------------------ options


def test_local_mode_options_are_validated_with_a_fix():
    assert CollaborationArguments(sync_mode="local").outer_learning_rate == 0.7
    with pytest.raises(ValueError, match="sync_mode must be one of sync, local"):
        CollaborationArguments(sync_mode="diloco")
    with pytest.raises(ValueError, match="outer_learning_rate must be a positive"):
        CollaborationArguments(sync_mode="local", outer_learning_rate=0)
    with pytest.raises(ValueError, match=r"outer_momentum must be in \[0, 1\)"):
        CollaborationArguments(sync_mode="local", outer_momentum=1.0)
    with pytest.raises(ValueError, match="takes no --delay_optimizer_step"):
        CollaborationArguments(sync_mode="local", delay_optimizer_step=True)


def test_each_mode_averages_under_its_own_prefix():
    sync, local = gradient_prefix_of_mode("run", "sync"), gradient_prefix_of_mode("run", "local")
    assert sync != local and {sync, local} <= set(averager_prefixes("run"))  # both covered by the key rules


# ---------------------------------------------------------------------------------------------- outer step


def _reference_nesterov(shared, pseudo_grads, lr, momentum):
    """DiLoCo's outer step written out: v <- mu v + g; theta <- theta - lr (g + mu v)."""
    velocity = [torch.zeros_like(p) for p in shared]
    for grads in pseudo_grads:
        for p, v, g in zip(shared, velocity, grads):
            v.mul_(momentum).add_(g)
            p.sub_(lr * (g + momentum * v))
    return shared


def test_outer_sgd_is_nesterov_sgd_in_float64():
    torch.manual_seed(0)
    start = [torch.randn(5, 3, dtype=torch.float64), torch.randn(3, dtype=torch.float64)]
    rounds = [[torch.randn_like(p) for p in start] for _ in range(4)]
    expected = _reference_nesterov([p.clone() for p in start], rounds, lr=0.7, momentum=0.9)
    params = [p.clone() for p in start]
    # the groups hivemind hands over carry the inner LAMB's weight decay: the outer step must not apply it
    groups = [dict(params=params[:1], weight_decay=0.1), dict(params=params[1:], weight_decay=0.0)]
    outer = make_outer_sgd(groups, CollaborationArguments(sync_mode="local"))
    for grads in rounds:
        for p, g in zip(params, grads):
            p.grad = g.clone()
        outer.step()
    for got, want in zip(params, expected):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


# ------------------------------------------------------------------------------------------- two optimizers


def _model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)  # the same initialization on both peers, as --init_seed gives
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.LayerNorm(32), torch.nn.Linear(32, 4))


def _local_step(model, inner, data_seed: int, epoch: int) -> None:
    generator = torch.Generator().manual_seed(data_seed)
    inputs, targets = torch.randn(8, 16, generator=generator), torch.randn(8, 4, generator=generator)
    torch.nn.functional.mse_loss(model(inputs), targets).backward()
    set_inner_learning_rate(inner, epoch, OPTIM)
    inner.step()
    model.zero_grad(set_to_none=False)


OPTIM = OptimizerArguments(learning_rate=1e-2, warmup_steps=0, total_steps=100, lr_schedule="constant")
BATCH = 8


@contextlib.contextmanager
def two_local_peers(collab: CollaborationArguments, run_id: str) -> Iterator[list]:
    """Two real local-mode optimizers, each with its own DHT (and hivemind's averager processes), on 127.0.0.1:
    ``[(model, optimizer, inner optimizer), ...]``; shut down on exit."""
    models = [_model(), _model()]
    with loopback_optimizers(
        models, collab=collab, optim=OPTIM, run_id=run_id, batch_size_per_step=BATCH
    ) as optimizers:
        yield [(model, optimizer, make_inner_optimizer(model, OPTIM)) for model, optimizer in zip(models, optimizers)]


def finish_round(optimizer, batch_size: int = BATCH) -> None:
    """One more local step's samples, then no new samples until the round ends (waits for the other peer's report;
    at most 60 s)."""
    epoch, deadline = optimizer.local_epoch, time.monotonic() + 60
    optimizer.step(batch_size=batch_size)
    while optimizer.local_epoch == epoch and time.monotonic() < deadline:
        time.sleep(0.1)
        optimizer.step(batch_size=0)


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_round_with_one_local_step_outer_lr_1_no_momentum_is_parameter_averaging():
    collab = CollaborationArguments(
        sync_mode="local",
        outer_learning_rate=1.0,
        outer_momentum=0.0,
        target_batch_size=2 * BATCH,  # one local step per peer per round
        matchmaking_time=2.0,
        averaging_timeout=20.0,
        compression="none",
        contribution_clip=0.0,  # the plain mean: exactly what parameter averaging is
    )
    with two_local_peers(collab, "local_mode_unit") as peers:
        for _, optimizer, _ in peers:
            assert optimizer.local_updates and isinstance(optimizer.grad_averager, PseudoGradientAverager)

        for round_index in range(2):
            locals_after_step = []
            for seed, (model, optimizer, inner) in enumerate(peers):
                _local_step(model, inner, data_seed=100 * round_index + seed, epoch=optimizer.local_epoch)
                locals_after_step.append([p.detach().clone() for p in model.parameters()])
            expected = [torch.stack(pair).mean(0) for pair in zip(*locals_after_step)]

            threads = [threading.Thread(target=finish_round, args=(opt,)) for _, opt, _ in peers]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join(timeout=90)
            for model, optimizer, _ in peers:
                assert optimizer.local_epoch == round_index + 1
                for got, want in zip(model.parameters(), expected):
                    torch.testing.assert_close(got.detach(), want, rtol=0, atol=1e-6)
                # the outer optimizer's copy is the model's (in the order of the optimizer's parameter groups)
                want_of = {id(param): want for param, want in zip(model.parameters(), expected)}
                shared = optimizer.grad_averager.shared_parameters
                for got, param in zip(shared, optimizer.state_averager.main_parameters):
                    torch.testing.assert_close(got, want_of[id(param)], rtol=0, atol=1e-6)


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_round_whose_all_reduce_failed_is_dropped_not_stepped_alone(monkeypatch):
    """A trainer whose all-reduce failed while another peer was online (here the other reports its samples and
    never averages) takes no outer step with its own pseudo-gradient: its shared parameters and outer momentum stay
    where the round began, and its model goes back to them. So two peers that both miss a round still hold the same
    shared parameters, with no download (peer.swarm.hivemind_seam.LeanHiveOptimizer._missed). Nor does it wait out
    a state averaging round after it (average_state_every 1): the peers it found no group with would not be in that
    one either (LeanHiveStateAverager._without_state_round)."""
    from hivemind.optim.state_averager import TrainingStateAverager

    state_rounds = []  # hivemind's own step, as the drop calls it: whether it runs a state averaging round
    hivemind_step = TrainingStateAverager.step

    def recording_step(self, *args, **kwargs):
        if kwargs.get("increment_epoch"):
            state_rounds.append(bool(kwargs.get("averaging_round")))
        return hivemind_step(self, *args, **kwargs)

    monkeypatch.setattr(TrainingStateAverager, "step", recording_step)
    collab = CollaborationArguments(
        sync_mode="local",
        target_batch_size=2 * BATCH,
        matchmaking_time=1.0,
        averaging_timeout=3.0,
        compression="none",
    )
    with two_local_peers(collab, "local_mode_missed") as peers:
        (model, optimizer, inner), (_, silent, _) = peers
        assert optimizer.load_state_checked()  # as a joiner does: its state is labelled with the download's epoch
        start = [p.detach().clone() for p in model.parameters()]
        momentum = [m.clone() for m in outer_momentum(optimizer)]
        silent.step(batch_size=BATCH)  # reports its samples, then never steps again: it joins no group
        _local_step(model, inner, data_seed=0, epoch=0)
        assert any(not torch.equal(p, s) for p, s in zip(model.parameters(), start))
        finish_round(optimizer)
        assert optimizer.local_epoch == 1 and optimizer.missed_round
        for got, want in zip(model.parameters(), start):
            torch.testing.assert_close(got.detach(), want, rtol=0, atol=0)
        by_id = {id(param): want for param, want in zip(model.parameters(), start)}
        for shared, param in zip(optimizer.grad_averager.shared_parameters, optimizer.state_averager.main_parameters):
            torch.testing.assert_close(shared, by_id[id(param)], rtol=0, atol=0)
        after = outer_momentum(optimizer)
        assert len(after) == len(momentum) and all(torch.equal(a, b) for a, b in zip(after, momentum))
        assert state_rounds == [False]
        # had the other made the round, these shared parameters would be one outer step behind its state of the same
        # epoch: nothing is served until the round agreement was followed (LocalTraining.end_epoch), and a peer
        # asking over the wire is told so and gets nothing
        with pytest.raises(StateWithheld, match="dropped its last round"):
            optimizer.state_averager.get_current_state()
        donor = frozenset({optimizer.dht.peer_id.to_bytes()})
        assert not silent.load_state_checked(only_from=donor)
        optimizer.state_averager.serve_state_again()
        # then the shared parameters it serves are the next epoch's (the dropped round changed nothing): labelled with
        # the download's epoch, a joiner refuted this peer's epoch as a lie and ignored it for a minute
        assert optimizer.state_averager.get_current_state()[0]["epoch"] == 1
        assert silent.load_state_checked(only_from=donor) and silent.local_epoch == 1


class _Vote:
    """The round agreement's verdict, given (``peer.swarm.agreement`` tests how it is reached): this peer's shared
    parameters lost the vote of ``epoch`` to ``winners`` (none: they agree)."""

    def __init__(self, epoch: int, winners=()):
        self.epoch, self.winners, self.ended = epoch, sorted(winners), []

    def round_ended(self, epoch: int, **kwargs) -> None:
        self.ended.append(epoch)

    def pending(self) -> bool:
        return False

    def check(self):
        return self.epoch, self.winners


def _local_training(optimizer, model, inner, agreement) -> LocalTraining:
    return LocalTraining(
        optimizer=optimizer,
        model=model,
        inner_optimizer=inner,
        agreement=agreement,
        optimizer_args=OPTIM,
        batch_size_per_step=BATCH,
        stop_requested=threading.Event(),
    )


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_sparse_round_that_lacked_a_groupmates_contribution_withholds_the_state_until_the_vote_was_read():
    """A sparse round taken without a groupmate's contribution (the averager counts it in ``partial_results``) may
    leave this peer apart from the others: its state is not served until its round agreement was followed."""
    collab = CollaborationArguments(
        sync_mode="local", outer_compression="sparse", sparse_chunk=256, target_batch_size=64 * BATCH
    )
    with two_local_peers(collab, "local_mode_partial") as peers:
        (model, optimizer, inner), _ = peers
        vote = _Vote(0)
        training = _local_training(optimizer, model, inner, vote)
        training.end_epoch()  # a whole round: served
        assert optimizer.state_averager.get_current_state()[0]["epoch"] == 0
        with optimizer.grad_averager.partial_results.get_lock():
            optimizer.grad_averager.partial_results.value += 1
        training.end_epoch()
        with pytest.raises(StateWithheld, match="lacked a groupmate's contribution"):
            optimizer.state_averager.get_current_state()
        training._follow_agreement()  # it agrees with the winner: its own state is the swarm's
        assert optimizer.state_averager.get_current_state()[0]["epoch"] == 0
        assert vote.ended == [0, 0]


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_trainer_that_lost_the_round_vote_serves_nothing_while_it_takes_the_winners_state():
    """Its shared parameters are known to differ from the swarm's of the same epoch: a joiner that counted it among
    its donors would find their states different and take one donor's, perhaps this one's. It withholds its state
    while it downloads the winners' (a real download from the other peer), and serves again after."""
    collab = CollaborationArguments(
        sync_mode="local", target_batch_size=64 * BATCH, matchmaking_time=1.0, averaging_timeout=5.0
    )
    with two_local_peers(collab, "local_mode_lost_vote") as peers:
        (model, optimizer, inner), (_, winner, _) = peers
        served = [p for group in winner.state_averager.optimizer.param_groups for p in group["params"]]
        with torch.no_grad():
            for param in served:
                param.add_(1.0)  # the winner's state (its shared parameters): another than this peer's
        seen_while_loading = []
        load = optimizer.load_state_checked

        def spying_load(**kwargs):
            with pytest.raises(StateWithheld, match="lost the round vote of epoch 0") as refused:
                optimizer.state_averager.get_current_state()
            seen_while_loading.append(refused.value)
            return load(**kwargs)

        optimizer.load_state_checked = spying_load
        training = _local_training(optimizer, model, inner, _Vote(0, [winner.dht.peer_id.to_bytes()]))
        training._follow_agreement()
        assert len(seen_while_loading) == 1 and optimizer.state_loads == 1
        taken = [p for group in optimizer.state_averager.optimizer.param_groups for p in group["params"]]
        for got, want in zip(taken, served):
            torch.testing.assert_close(got, want, rtol=0, atol=0)
        assert optimizer.state_averager.get_current_state()[0]["epoch"] == 0  # served again


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_trainer_one_epoch_behind_drops_the_round_the_others_ended_at_once():
    """hivemind lets a peer one epoch behind end its round anyway; in local mode that round is over (the others
    ended it), and its pseudo-gradient would wait out a matchmaking window for nobody or meet the others' next round.
    Here one peer ended the round (it missed it: no other peer averaged) while the other only reported its samples;
    the other's next step drops its round at once, without searching for a group, as one it missed
    (LeanHiveOptimizer._skip_round_already_over)."""
    collab = CollaborationArguments(
        sync_mode="local",
        target_batch_size=2 * BATCH,
        matchmaking_time=1.0,
        averaging_timeout=5.0,
        compression="none",
        average_state_every=1000,  # no state averaging round after the drop: the time below is the round's alone
    )
    with two_local_peers(collab, "local_mode_behind") as peers:
        (model, optimizer, inner), (behind_model, behind, behind_inner) = peers
        # its first step once it knows the swarm's progress: hivemind's once-per-epoch strict check (a peer on
        # another epoch than the swarm's downloads) passes here, as it had for the peer behind in the pair test
        assert behind.tracker.fetched_global_progress_this_epoch.wait(timeout=30)
        behind.step(batch_size=BATCH)
        _local_step(model, inner, data_seed=0, epoch=0)
        finish_round(optimizer)
        assert optimizer.local_epoch == 1
        deadline = time.monotonic() + 60
        while behind.tracker.global_epoch < 1 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert behind.tracker.global_epoch == 1 and behind.local_epoch == 0

        start = [p.detach().clone() for p in behind_model.parameters()]
        _local_step(behind_model, behind_inner, data_seed=1, epoch=0)
        began = time.monotonic()
        behind.step(batch_size=BATCH)
        assert behind.local_epoch == 1 and behind.missed_round and behind.state_loads == 0
        assert time.monotonic() - began < collab.averaging_timeout  # it waited out no matchmaking window
        for got, want in zip(behind_model.parameters(), start):  # dropped: back to the round's shared parameters
            torch.testing.assert_close(got.detach(), want, rtol=0, atol=0)


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_local_mode_trainer_publishes_its_progress_once_per_share_of_the_round():
    """hivemind stores a signed progress record at every local step; on a home uplink that was about half of sparse
    local mode's bytes. A local-mode trainer stores one per ``REPORT_SHARE`` of the round (peer.swarm.hivemind_seam.
    progress), and the other peer still sees its progress within a share; sync mode keeps a record per step."""
    from peer.swarm.hivemind_seam.progress import REPORT_SHARE, LeanHiveProgressTracker

    collab = CollaborationArguments(
        sync_mode="local", target_batch_size=64 * BATCH, matchmaking_time=1.0, averaging_timeout=5.0
    )
    with two_local_peers(collab, "local_mode_share") as peers:
        (_, optimizer, _), (_, other, _) = peers
        tracker = optimizer.tracker
        assert tracker.report_share == REPORT_SHARE and REPORT_SHARE * collab.target_batch_size == 4 * BATCH
        assert tracker.fetched_global_progress_this_epoch.wait(timeout=30)
        steps = 24  # 3/8 of the round: far from its end, where every step is published
        for _ in range(steps):
            optimizer.step(batch_size=BATCH)
            time.sleep(0.2)
        # one record per 4 steps (a share), not 24; a few more where the ETA was not known yet
        assert tracker.records_held >= steps // 2, tracker.records_held
        deadline = time.monotonic() + 20
        while other.tracker.global_progress.samples_accumulated < (steps - 4) * BATCH and time.monotonic() < deadline:
            time.sleep(0.2)
        assert other.tracker.global_progress.samples_accumulated >= (steps - 4) * BATCH

        sync = LeanHiveProgressTracker(optimizer.dht, "sync_share", 64, start=False)
        sync.report_local_progress(0, 8)
        sync.report_local_progress(0, 16)
        assert sync.records_held == 0 and sync.should_report_progress.is_set()
