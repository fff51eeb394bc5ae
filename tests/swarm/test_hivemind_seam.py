"""The contract of peer/swarm/hivemind_seam/ with the pinned hivemind: fails loudly when it no longer holds."""

from __future__ import annotations

import ast
import asyncio
import contextlib
import importlib
import inspect
import logging
import re
import textwrap
import time
from pathlib import Path
from typing import Optional, Tuple

import hivemind
import pytest
from hivemind.averaging.allreduce import AveragingMode
from hivemind.averaging.control import StepControl
from hivemind.averaging.group_info import GroupInfo
from hivemind.p2p import PeerID
from hivemind.utils import MPFuture, get_dht_time
from hivemind.utils.serializer import MSGPackSerializer

from peer.swarm import hivemind_seam
from peer.swarm.hivemind_seam import averaging, dht, matchmaking, progress, sparse_wire
from peer.swarm.round_wait import RoundWait

pytestmark = pytest.mark.deps  # scripts/test.sh --newest/--oldest run these

REPO_ROOT = Path(__file__).resolve().parents[2]


def test_installed_hivemind_is_the_pinned_version():
    pyproject = (REPO_ROOT / "pyproject.toml").read_text()
    pinned = re.search(r'"hivemind==([^"]+)"', pyproject).group(1)
    assert pinned == hivemind_seam.PINNED_HIVEMIND_VERSION, (
        f"pyproject.toml pins hivemind=={pinned} but peer/swarm/hivemind_seam/ was written against "
        f"{hivemind_seam.PINNED_HIVEMIND_VERSION}: review every override listed in its docstring, then update both"
    )
    assert hivemind.__version__ == hivemind_seam.PINNED_HIVEMIND_VERSION, (
        f"hivemind {hivemind.__version__} is installed, but LeanHive's overrides (peer/swarm/hivemind_seam/) were "
        f"written against {hivemind_seam.PINNED_HIVEMIND_VERSION}: reinstall with `bash scripts/setup_env.sh`"
    )


@pytest.mark.parametrize(
    "cls, name, expected",
    hivemind_seam.OVERRIDDEN_METHODS,
    ids=[f"{c.__name__}.{n}" for c, n, _ in hivemind_seam.OVERRIDDEN_METHODS],
)
def test_overridden_hivemind_method_keeps_its_signature(cls, name, expected):
    method = inspect.getattr_static(cls, name, None)
    assert method is not None, f"hivemind's {cls.__qualname__}.{name} is gone: peer/swarm/hivemind_seam/ overrides it"
    actual = "property" if isinstance(method, property) else str(inspect.signature(getattr(cls, name)))
    assert actual == expected, (
        f"hivemind's {cls.__qualname__}.{name} changed its signature; peer/swarm/hivemind_seam/ overrides it.\n"
        f"  written against: {expected}\n  installed:       {actual}"
    )


def _assigned_self_attributes(cls) -> set:
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    found = set()
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Attribute)
            and isinstance(node.ctx, ast.Store)
            and isinstance(node.value, ast.Name)
            and node.value.id == "self"
        ):
            found.add(node.attr)
    return found


@pytest.mark.parametrize(
    "module, class_name, attribute",
    hivemind_seam.PRIVATE_ATTRIBUTES,
    ids=[f"{c}.{a}" for _, c, a in hivemind_seam.PRIVATE_ATTRIBUTES],
)
def test_private_hivemind_attribute_still_exists(module, class_name, attribute):
    cls = getattr(importlib.import_module(module), class_name)
    assert hasattr(cls, attribute) or attribute in _assigned_self_attributes(cls), (
        f"hivemind's {class_name} no longer has {attribute!r}, which peer/swarm/hivemind_seam/ uses"
    )


def test_every_override_is_listed_in_the_seam():
    """Each method the seam's classes define over a hivemind base is in OVERRIDDEN_METHODS (so it is pinned)."""
    listed = {(cls, name) for cls, name, _ in hivemind_seam.OVERRIDDEN_METHODS}
    ours = [
        value
        for module in (dht, averaging, matchmaking, progress, sparse_wire)
        for value in vars(module).values()
        if inspect.isclass(value) and value.__module__ == module.__name__
    ]
    unlisted = []
    for cls in ours:
        hivemind_bases = [base for base in cls.__mro__ if base.__module__.startswith("hivemind.")]
        own_classes = [klass for klass in cls.__mro__ if klass.__module__.startswith(hivemind_seam.__name__)]
        for name in {name for klass in own_classes for name in vars(klass)}:
            if (name.startswith("__") and name != "__del__") or name.startswith("_abc"):
                continue
            overridden = [base for base in hivemind_bases if name in vars(base)]
            if overridden and not any(n == name and c in cls.__mro__ for c, n in listed):
                unlisted.append(f"{cls.__name__}.{name} (over {overridden[0].__qualname__})")
    assert not unlisted, f"overrides missing from OVERRIDDEN_METHODS: {', '.join(sorted(set(unlisted)))}"


def test_phase_observers_time_the_gradient_wait_and_tell_the_averagers_apart():
    """The public timing hook (``observe_phases``) over the private methods it wraps: the benchmark's timers."""
    from unittest import mock

    from hivemind.optim.state_averager import TrainingStateAverager

    from peer.swarm.hivemind_seam.timing import timed_allreduce

    seen = []
    stop = hivemind_seam.observe_phases(lambda phase, start, end: seen.append((phase, end - start)))
    try:
        # the optimizer's override reports the wait for the gradient all-reduce (no round: the local gradients)
        class Probe(averaging.LeanHiveOptimizer):
            def __init__(self):  # nothing built: only the override is called
                self.status_loglevel, self.round_wait, self.loaded = logging.DEBUG, RoundWait(1.0), []

            def _load_local_gradients_into_optimizer(self):
                self.loaded.append("local")

            def __del__(self):
                pass

        probe = Probe()
        probe._average_gradients_and_load_into_optimizer(None)
        assert probe.loaded == ["local"]
        assert [phase for phase, _ in seen] == ["grad_wait"]

        async def round_(self, *args):
            return args

        timed = timed_allreduce(round_)
        assert asyncio.run(timed(mock.Mock(spec=TrainingStateAverager), 1)) == (1,)
        assert asyncio.run(timed(mock.Mock(spec=averaging.LeanHiveGradientAverager), 2)) == (2,)
        assert [phase for phase, _ in seen[1:]] == ["state_allreduce", "grad_allreduce"]
        assert set(phase for phase, _ in seen) <= set(hivemind_seam.PHASES)

        def broken(phase, start, end):
            raise RuntimeError("an observer's bug")

        stop_broken = hivemind_seam.observe_phases(broken)  # logged, never fails the phase it observed
        assert asyncio.run(timed(mock.Mock(spec=TrainingStateAverager), 3)) == (3,)
        stop_broken()
    finally:
        stop()
    seen.clear()
    asyncio.run(timed(mock.Mock(spec=TrainingStateAverager), 4))
    assert not seen  # unregistered


@contextlib.contextmanager
def _two_gradient_averagers(prefix: str, averager_class=None, **kwargs):
    """Two real ``LeanHiveGradientAverager`` (or ``averager_class``; own DHTs and averager processes) holding the
    accumulated gradients 1 and 2 (nonzero: see bound_two_peer_update); shut down on exit."""
    import torch

    from benchmarks.testbed.processes import share_tensors_by_file_descriptor

    # hivemind's 'file_system' sharing needs a torch_shm_manager child, which the suite's fixture kills after each
    # test: the next test to start a DHT here then aborted the interpreter (hivemind's MPFuture thread)
    share_tensors_by_file_descriptor()
    dhts = [hivemind.DHT(start=True)]
    dhts.append(hivemind.DHT(initial_peers=dhts[0].get_visible_maddrs(), start=True))
    averagers = []
    try:
        for index, dht in enumerate(dhts):
            params = [torch.nn.Parameter(torch.zeros(4))]
            averager = (averager_class or averaging.LeanHiveGradientAverager)(
                params, dht=dht, prefix=prefix, reuse_grad_buffers=False, start=True, **kwargs
            )
            averagers.append(averager)
            averager.parameters[0].grad = torch.full((4,), float(index + 1))
            averager.accumulate_grads_(batch_size=1)
        yield averagers
    finally:
        for averager in averagers:
            averager.shutdown()
        for dht in dhts:
            dht.shutdown()


@pytest.mark.timeout(120)
def test_phase_observers_see_each_all_reduce_round_in_the_averager_process(tmp_path):
    """A real all-reduce round is reported from the averager process each gradient averager forks, to an observer
    registered before (as the swarm benchmark's peer relies on; the state averager's phase name is checked above)."""
    import json
    import os

    import torch

    log = tmp_path / "phases.jsonl"

    def record(phase, start, end):
        with open(log, "a") as out:
            out.write(json.dumps({"phase": phase, "seconds": end - start, "pid": os.getpid()}) + "\n")

    stop = hivemind_seam.observe_phases(record)
    try:
        with _two_gradient_averagers("phases", target_group_size=2) as averagers:
            controls = [averager.schedule_step(get_dht_time() + 5) for averager in averagers]
            for averager, control in zip(averagers, controls):
                averager.step(control=control, wait=False)
            for control in controls:
                control.result(timeout=60)
            with averagers[0].use_averaged_gradients() as grads:
                assert torch.allclose(grads[0], torch.full((4,), 1.5))  # the round happened
    finally:
        stop()
    rounds = [json.loads(line) for line in log.read_text().splitlines()]
    assert [r["phase"] for r in rounds] == ["grad_allreduce", "grad_allreduce"]
    assert all(r["pid"] != os.getpid() and r["seconds"] >= 0 for r in rounds)


@pytest.mark.timeout(120)
def test_a_leader_that_waited_its_whole_window_assembles_a_follower_that_came_in_its_last_second():
    """Two averagers whose steps began 3 s apart, with windows of 4 s: the first waits alone as leader, the second
    joins it a second before its deadline. hivemind 1.1.12 gave up at that deadline with the follower in hand
    (both "could not find a group"); our leader ends its search a margin earlier and assembles the two
    (peer.swarm.hivemind_seam.matchmaking)."""
    import torch

    window = 4.0
    with _two_gradient_averagers("late_follower", min_matchmaking_time=1.0) as averagers:
        leader = averagers[0].schedule_step(get_dht_time() + 0.5, timeout=window)
        averagers[0].step(control=leader, wait=False)
        time.sleep(leader.deadline - get_dht_time() - 1.0)
        follower = averagers[1].schedule_step(get_dht_time() + 1.0, timeout=window)
        averagers[1].step(control=follower, wait=False)
        assert len(leader.result(timeout=30)) == 2 and len(follower.result(timeout=30)) == 2
        with averagers[0].use_averaged_gradients() as grads:
            assert torch.allclose(grads[0], torch.full((4,), 1.5))  # the round happened


@pytest.mark.timeout(120)
def test_local_mode_peers_of_two_rounds_never_average_together():
    """--sync_mode local: a pseudo-gradient is the change from its round's shared parameters, so the group key
    names the round's epoch (peer.swarm.hivemind_seam.matchmaking). Two real averagers of epochs 3 and 4 search
    together and find no group; at the same epoch they average (hivemind's keys named no round, and a peer one epoch
    behind met the others' next round)."""
    import torch

    with _two_gradient_averagers(
        "round_keys", averager_class=averaging.PseudoGradientAverager, run_id="round_keys", min_matchmaking_time=1.0
    ) as averagers:
        for averager, epoch in zip(averagers, (3, 4)):
            averager.shared_parameters = (torch.zeros(4),)  # as the optimizer links them
            averager.key_epoch.value = epoch
        apart = [averager.step(timeout=3.0, wait=False) for averager in averagers]
        for control in apart:
            with pytest.raises(Exception, match="could not find a group"):
                control.result(timeout=30)
        averagers[1].key_epoch.value = 3
        together = [averager.step(timeout=6.0, wait=False) for averager in averagers]
        assert [len(control.result(timeout=30)) for control in together] == [2, 2]


def test_round_outcome_says_how_a_round_ended():
    """What the round observers hear, from the future hivemind's optimizer waited on."""
    from concurrent.futures import Future

    from hivemind.averaging.allreduce import AllreduceException

    from peer.swarm.hivemind_seam.timing import round_outcome

    def ended(result=None, error=None) -> Future:
        future = Future()
        future.set_exception(error) if error is not None else future.set_result(result)
        return future

    assert round_outcome(ended(result={"a": 1, "b": 2, "c": 3})) == ("ok", 3)
    assert round_outcome(ended(error=AllreduceException("Averaging step failed: could not find a group"))) == (
        "no_group",
        0,
    )
    assert round_outcome(ended(error=TimeoutError())) == ("timeout", 0)
    assert round_outcome(ended(error=RuntimeError("peer vanished"))) == ("failed", 0)
    assert round_outcome(Future()) == ("timeout", 0)  # still running when the optimizer gave up waiting


# ------------------------------------------------------------------------------- reachability (dial-back probe)

from peer.swarm.hivemind_seam import reachability as reachability_seam  # noqa: E402 - this block's own import


@pytest.mark.parametrize(
    "cls, name, expected",
    reachability_seam.USED_METHODS,
    ids=[f"{c.__name__}.{n}" for c, n, _ in reachability_seam.USED_METHODS],
)
def test_p2p_api_of_the_dial_back_probe_keeps_its_signature(cls, name, expected):
    actual = str(inspect.signature(getattr(cls, name)))
    assert actual == expected, (
        f"hivemind's {cls.__qualname__}.{name} changed its signature; peer/swarm/hivemind_seam/reachability.py calls "
        f"it.\n  written against: {expected}\n  installed:       {actual}"
    )


def test_dial_back_probe_runs_in_the_dht_process_through_its_p2p():
    """The probe over the pinned hivemind: a handler registered on a DHT's p2pd (``DHTNode.p2p``, in the DHT's
    process) answers a stream opened by another DHT, and the server sees the requester's address."""
    from hivemind.dht.node import DHTNode

    assert "p2p" in _assigned_self_attributes(DHTNode)
    server = hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    client = hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"], initial_peers=server.get_visible_maddrs())
    try:
        server.run_coroutine(reachability_seam.DialBackServer().register)
        own = client.run_coroutine(reachability_seam.own_dialable_maddrs)
        assert own and all(m.startswith("/ip4/127.0.0.1/tcp/") for m in own)
        answer = client.run_coroutine(reachability_seam.DialBackRequest(server.peer_id.to_base58(), own))
        assert answer.reachable, answer
    finally:
        client.shutdown()
        server.shutdown()


# ---- issue 30: the state from several donors (peer/swarm/hivemind_seam/state_transfer.py)


def test_the_part_rpc_uses_hiveminds_download_message_both_ways():
    """rpc_download_state_part carries its msgpack request/answer in DownloadData.metadata and the part's bytes in
    DownloadData.tensor_part.buffer; hivemind registers it (a streaming RPC) from the type hints."""
    from hivemind.proto import averaging_pb2, runtime_pb2

    fields = averaging_pb2.DownloadData.DESCRIPTOR.fields_by_name
    assert fields["metadata"].type == fields["metadata"].TYPE_BYTES
    assert fields["tensor_part"].message_type.name == "Tensor"
    assert "buffer" in runtime_pb2.Tensor.DESCRIPTOR.fields_by_name
    averaging.LeanHiveStateAverager._rpc_handlers = None  # collected afresh from the class
    averaging.LeanHiveStateAverager._collect_rpc_handlers()
    handlers = {h.method_name: h for h in averaging.LeanHiveStateAverager._rpc_handlers}
    part = handlers["rpc_download_state_part"]
    assert part.request_type is averaging_pb2.DownloadData and part.response_type is averaging_pb2.DownloadData
    assert part.stream_output and not part.stream_input
    assert handlers["rpc_download_state"].stream_output


def test_a_client_asks_to_join_with_the_latest_expiration_its_deadline_allows():
    """hivemind asks leaders with ``now + min_matchmaking_time``; a leader that scheduled later refuses that
    (BAD_EXPIRATION_TIME). A client asks with its deadline minus a margin, always before the deadline."""
    assert averaging.client_join_expiration(100.0, 3.0) == pytest.approx(102.75)
    assert averaging.client_join_expiration(100.0, 300.0) == pytest.approx(399.75)
    assert averaging.client_join_expiration(100.0, 1.0) == pytest.approx(100.9)  # still before the deadline
    for timeout in (0.5, 1.0, 3.0, 60.0):
        assert 100.0 < averaging.client_join_expiration(100.0, timeout) < 100.0 + timeout


def test_the_gradient_wait_grows_to_the_rounds_this_link_carries_and_no_further():
    """A round that completed late (after the wait) lengthens the next wait to SLACK x its duration, bounded by
    CAP x averaging_timeout; failed or cancelled rounds change nothing. Real hivemind StepControl-like MPFutures."""
    import time

    from hivemind.utils import MPFuture

    from peer.swarm import round_wait

    wait = RoundWait(averaging_timeout=0.2)
    assert wait.seconds() == 0.2
    failed, cancelled, late = MPFuture(), MPFuture(), MPFuture()
    for future in (failed, cancelled, late):
        wait.watch(future)
    failed.set_exception(RuntimeError("could not find a group"))
    cancelled.cancel()
    assert wait.seconds() == 0.2
    time.sleep(0.3)
    late.set_result("group")
    deadline = time.monotonic() + 5
    while wait.seconds() == 0.2 and time.monotonic() < deadline:  # the callback runs in hivemind's future thread
        time.sleep(0.01)
    assert round_wait.SLACK * 0.3 <= wait.seconds() < round_wait.SLACK * 1.0
    wait.completed(60.0)
    assert wait.seconds() == round_wait.CAP * 0.2
    for _ in range(round_wait.HISTORY):  # only the last rounds count: a link that got faster shortens the wait again
        wait.completed(0.01)
    assert wait.seconds() == 0.2


def test_each_group_member_declares_its_mode_in_what_matchmaking_gathers():
    """The sparse all-gather reads every member's mode from matchmaking's gathered data (``declared_modes``): hivemind
    gathers ``[bandwidth, mode, user data]`` and hands its own runner only fractions, where an aux looks like a node."""
    step = inspect.getsource(hivemind.averaging.DecentralizedAverager.step)
    assert "self.serializer.dumps([self.bandwidth, self.mode.value, user_data_for_gather])" in step
    aggregate = inspect.getsource(hivemind.averaging.DecentralizedAverager._aggregate_with_group)
    assert "_run_allreduce_inplace_(local_tensors, group_info, peer_fractions=peer_fractions, **kwargs)" in aggregate

    gathered = [MSGPackSerializer.dumps([1.0, mode.value, b""]) for mode in AveragingMode]
    group = GroupInfo(group_id=b"g", peer_ids=tuple(PeerID(bytes([i]) * 8) for i in range(3)), gathered=gathered)
    assert sparse_wire.declared_modes(MSGPackSerializer, group) == tuple(AveragingMode)


class _Notice(MPFuture):
    """The averager process's cancel notice (StepControl's ``_cancel``); records whether the step read cancelled when
    the notice was set (the averager reads the step when the notice wakes it)."""

    step_cancelled_when_set: Optional[bool] = None

    def set_result(self, result):
        self.step_cancelled_when_set = self._step.cancelled()
        super().set_result(result)


def _step_with_notice() -> Tuple[StepControl, MPFuture, _Notice]:
    trigger, notice = MPFuture(), _Notice()  # first: hivemind sets up its futures' backend on the first one's class
    now = get_dht_time()
    step = StepControl(scheduled_time=now + 60, deadline=now + 120, allow_retries=True, weight=1.0, data_for_gather=b"")
    notice._step = step
    step.attach(trigger, notice)
    return step, trigger, notice


def test_cancel_step_marks_the_step_cancelled_before_the_averager_is_told():
    """``averaging.cancel_step``: the averager process, woken by the notice, must find the step cancelled (else its
    matchmaking goes on and runs the all-reduce with stale tensors)."""
    step, trigger, notice = _step_with_notice()
    averaging.cancel_step(step)
    assert notice.step_cancelled_when_set is True
    assert step.cancelled() and trigger.cancelled()


def test_hivemind_step_control_still_tells_the_averager_before_it_marks_the_step():
    """The order ``cancel_step`` exists for; when hivemind marks the step first, ``cancel_step`` can go."""
    step, _, notice = _step_with_notice()
    step.cancel()
    assert notice.step_cancelled_when_set is False and step.cancelled()
