"""The fault matrix: crashes, partitions, bad files and hostile peers. Each scenario runs real peers, measures, and
returns a ``ScenarioResult``; it asserts nothing (tests assert the bounds, ``benchmarks/faults.py`` prints the table).

Columns: survived (the swarm kept training and every check of the scenario held), epochs lost (global
epochs of progress the swarm had to redo because of the fault), time to recover (seconds from the fault
to the swarm training normally again), data lost (a checkpoint, backup or the swarm's state gone or
replaced by a broken one: must be False).
"""

from __future__ import annotations

import dataclasses
import math
import re
import time
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

import torch

from benchmarks.testbed.aux import wait_for
from benchmarks.testbed.faults import broken_peer, donors, hostile_records, hostile_state, slow_link
from benchmarks.testbed.faults.swarm import (
    BROADBAND,
    INTERNET,
    STARTUP,
    NetemSwarm,
    SwarmPeer,
    SwarmSettings,
    _line_time,
    param_distance,
)
from benchmarks.testbed.processes import kill_all, wait_all
from benchmarks.testbed.trainers import (
    epoch_done_events,
    epoch_losses,
    final_epoch,
    max_param_difference,
    param_dump_env,
    round_param_differences,
    start_trainer,
)

AUX_HOST = 0


@dataclass
class ScenarioResult:
    scenario: str
    """Short name, e.g. 'a. 3 trainers + aux over 20 Mbit/s, 100 ms RTT'."""
    survived: bool
    epochs_lost: int
    recover_seconds: Optional[float]
    data_lost: bool
    details: Dict[str, Any] = field(default_factory=dict)
    """Measurements and the checks behind ``survived`` (name -> value), for the report and failing tests."""
    seconds: float = 0.0
    """Wall time the scenario took."""
    skipped: Optional[str] = None
    """Why the scenario did not run here (e.g. no network namespaces), or None."""

    def as_dict(self) -> Dict[str, Any]:
        return asdict(self)


def _check(details: Dict[str, Any], name: str, ok: bool) -> bool:
    details.setdefault("checks", {})[name] = bool(ok)
    return bool(ok)


def _all_checks(details: Dict[str, Any]) -> bool:
    return all(details.get("checks", {}).values())


def _start_trainers(
    swarm: NetemSwarm,
    names: Sequence[str],
    hosts: Sequence[int],
    initial_peers: Sequence[str],
    extra: Sequence[str] = (),
    env_by_name: Optional[Dict[str, Dict[str, str]]] = None,
) -> List[SwarmPeer]:
    """Start trainers at once (they load in parallel), then wait until every one has joined."""
    env_by_name = env_by_name or {}
    # all wait for each other: a trainer that trained alone for a while would pull the others to its state
    extra = ["--min_peers", str(len(names)), *extra]
    trainers = [
        swarm.start_trainer(host, name, initial_peers=initial_peers, extra=extra, env=env_by_name.get(name))
        for name, host in zip(names, hosts)
    ]
    for trainer in trainers:
        trainer.initial_peers(STARTUP)
    return trainers


def _final_epoch(trainer: SwarmPeer) -> int:
    """The epoch of the parameters a trainer that stopped at --max_epochs ended with (-1 if it wrote none)."""
    from benchmarks.testbed.trainers import final_epoch

    try:
        return final_epoch(trainer.folder)
    except FileNotFoundError:
        return -1


def _wait_epoch(trainer: SwarmPeer, epoch: int, timeout: float) -> None:
    """Wait until the trainer is at ``epoch`` or later (hivemind may skip epoch numbers when a peer catches up)."""
    wait_for(
        lambda: trainer.last_epoch() >= epoch or trainer.poll() is not None,
        timeout=timeout,
        what=f"{trainer.name} to reach epoch {epoch}",
    )
    if trainer.last_epoch() < epoch:
        raise RuntimeError(f"{trainer.name} exited at epoch {trainer.last_epoch()}:\n{trainer.tail()}")


def _checked_result(
    name: str,
    details: Dict[str, Any],
    started: float,
    *,
    epochs_lost: int = 0,
    recover_seconds: Optional[float] = None,
    data_lost: bool = False,
) -> ScenarioResult:
    """The result of a scenario whose verdict is its ``_check``s (``details["checks"]``)."""
    return ScenarioResult(
        name,
        survived=_all_checks(details),
        epochs_lost=epochs_lost,
        recover_seconds=recover_seconds,
        data_lost=data_lost,
        details=details,
        seconds=time.monotonic() - started,
    )


def _loss_fell(trainer: SwarmPeer, min_drop: float = 0.2) -> bool:
    """The loss fell by more than ``min_drop``: along the fitted trend from three epochs on (two end points alone
    wobble by about 0.05 each: a survivor of scenario b measured 0.195 between its end points, 0.213 on the trend)."""
    losses = epoch_losses(trainer)
    finite = {epoch: loss for epoch, loss in losses.items() if math.isfinite(loss)}
    if len(finite) >= 3:
        return _fitted_loss_drop(trainer) > min_drop
    return len(finite) >= 2 and finite[max(finite)] < finite[min(finite)] - min_drop


def _fitted_loss_drop(trainer: SwarmPeer) -> float:
    """How much a least-squares line through the per-epoch losses falls from the first epoch to the last: the
    trend, not two noisy end points (one epoch's loss wobbles by about 0.05 here)."""
    finite = {e: v for e, v in epoch_losses(trainer).items() if math.isfinite(v)}
    if len(finite) < 3:
        return math.nan
    epochs = sorted(finite)
    mean_e = sum(epochs) / len(epochs)
    mean_v = sum(finite.values()) / len(epochs)
    slope = sum((e - mean_e) * (finite[e] - mean_v) for e in epochs) / sum((e - mean_e) ** 2 for e in epochs)
    return -slope * (epochs[-1] - epochs[0])


def _mean_loss(trainers: Sequence[SwarmPeer], first: bool, epochs: int = 2) -> float:
    """Mean loss per micro-step over the first (or last) ``epochs`` epochs the trainers reported."""
    total = steps = 0.0
    for trainer in trainers:
        done = [
            (int(e["epoch"]), math.nan if e["loss"] is None else float(e["loss"]), int(e["mini_steps"]))
            for e in epoch_done_events(trainer)
        ]
        for _, loss, micro_steps in done[:epochs] if first else done[-epochs:]:
            total, steps = total + loss * micro_steps, steps + micro_steps
    return total / steps if steps else math.nan


def _epoch_seconds(trainer: SwarmPeer) -> Optional[float]:
    """Median seconds between consecutive epochs this trainer finished."""
    times = sorted(trainer.epochs_done().values())
    gaps = sorted(b - a for a, b in zip(times, times[1:]))
    return gaps[len(gaps) // 2] if gaps else None


# ------------------------------------------------------------------------------------------------ a


def baseline_over_internet(folder: Path, *, epochs: int = 6) -> ScenarioResult:
    """a. Three trainers and an aux peer, every link 20 Mbit/s with 100 ms RTT, train ``epochs`` epochs."""
    started = time.monotonic()
    details: Dict[str, Any] = {"link": INTERNET.describe()}
    settings = SwarmSettings(run_id="baseline")
    with NetemSwarm(folder, 4, settings, INTERNET) as swarm:
        aux = swarm.start_aux(
            AUX_HOST,
            "aux",
            checkpoint_dir=folder / "checkpoints",
            extra=["--checkpoint_every", "2", "--keep_checkpoints", "5"],
        )
        join = aux.initial_peers(STARTUP)
        trainers = _start_trainers(swarm, ["t1", "t2", "t3"], [1, 2, 3], join, extra=["--max_epochs", str(epochs)])
        try:
            codes = wait_all(trainers, timeout=120 + 40 * epochs)
        except TimeoutError as e:
            codes = [trainer.poll() for trainer in trainers]
            details["error"] = str(e)[:300]
        details["exit_codes"] = codes
        _check(details, "trainers exited cleanly", codes == [0, 0, 0])
        final = [_final_epoch(trainer) for trainer in trainers]
        details["final_epochs"] = final
        _check(details, f"every trainer reached epoch {epochs}", min(final) >= epochs)
        _check(details, "loss fell on every trainer", all(_loss_fell(t) for t in trainers))
        participated = [len(epoch_losses(t)) for t in trainers]
        details["epochs_trained_per_trainer"] = participated
        _check(details, "every trainer took part in most epochs", min(participated) >= epochs - 2)
        params = [t.params_at(epochs) for t in trainers]
        if all(p is not None for p in params):
            details["max_param_difference"] = max(param_distance(params[0], p) for p in params[1:])
        details["seconds_per_epoch"] = _epoch_seconds(trainers[0])
        saved = swarm_checkpoints(folder / "checkpoints")
        details["checkpoints"] = saved
        _check(details, "the aux peer wrote checkpoints", len(saved) >= 1)
    return _checked_result("a. 3 trainers + aux, 20 Mbit/s, 100 ms RTT", details, started)


def swarm_checkpoints(directory: Path) -> List[str]:
    return sorted(p.name for p in directory.iterdir() if p.name.startswith("epoch_")) if directory.exists() else []


def _median(values: Sequence[float]) -> Optional[float]:
    values = sorted(v for v in values if v is not None and math.isfinite(v))
    return values[len(values) // 2] if values else None


def _epoch_gaps(trainer: SwarmPeer, after: float = -math.inf, before: float = math.inf) -> List[float]:
    times = sorted(t for t in trainer.epochs_done().values() if after <= t <= before)
    return [b - a for a, b in zip(times, times[1:])]


def _log_time(peer: SwarmPeer, pattern: str) -> Optional[float]:
    """Time of the first log line of ``peer`` matching ``pattern`` (for what only the log tells: injected faults)."""
    return next(iter(_log_times(peer, pattern)), None)


def _log_times(peer: SwarmPeer, pattern: str) -> List[float]:
    """Times of every log line of ``peer`` matching ``pattern``."""
    log = peer.log()
    return [_line_time(log, match.start()) for match in re.finditer(pattern, log)]


def _stop_all(peers: Sequence[SwarmPeer], timeout: float = 60) -> List[Optional[int]]:
    """SIGTERM every running peer at once (they write final parameters), then collect the exit codes."""
    import signal

    for peer in peers:
        peer.send_signal(signal.SIGTERM)
    codes = []
    deadline = time.monotonic() + timeout
    for peer in peers:
        try:
            codes.append(peer.wait(max(1.0, deadline - time.monotonic())))
        except TimeoutError:
            codes.append(None)
    return codes


# ------------------------------------------------------------------------------------------------ b


def kill_during_allreduce(
    folder: Path, *, epochs_before: int = 2, epochs_after: int = 3, sync_mode: str = "sync"
) -> ScenarioResult:
    """b. Once all three trainers trained ``epochs_before`` epochs together, one is SIGKILLed in the middle of its
    next gradient all-reduce; the others must finish the next epoch within averaging_timeout + one epoch.

    All three are armed with the same trigger file and the first to receive an averaged tensor after it appears
    dies (benchmarks.testbed.faults.injection), so the fault fires in the first all-reduce after the trigger, whoever
    takes part in it."""
    from benchmarks.testbed.faults.injection import DIE_IN_ALLREDUCE_ENV

    started = time.monotonic()
    # local mode: lossless, so that the survivors' shared parameters can be checked for equality round by round
    exact = dict(compression="none") if sync_mode == "local" else {}
    settings = SwarmSettings(run_id="killar", extra=_mode_flags(sync_mode), **exact)
    details: Dict[str, Any] = {"link": INTERNET.describe(), "averaging_timeout": settings.averaging_timeout}
    recover = None
    trigger = folder / "kill-now"
    names = ["t1", "t2", "t3"]
    with NetemSwarm(folder, 4, settings, INTERNET) as swarm:
        aux = swarm.start_aux(AUX_HOST, "aux", checkpoint_dir=folder / "checkpoints")
        join = aux.initial_peers(STARTUP)
        trainers = _start_trainers(
            swarm, names, [1, 2, 3], join, env_by_name={name: {DIE_IN_ALLREDUCE_ENV: str(trigger)} for name in names}
        )
        try:
            for trainer in trainers:
                trainer.events.wait("epoch_done", timeout=180, count=epochs_before)
        except (TimeoutError, RuntimeError) as error:
            details["error"] = str(error)[-300:]
        trigger.touch()
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and all(t.process.poll() is None for t in trainers):
            time.sleep(0.2)
        exited = [t for t in trainers if t.process.poll() is not None]
        victim = exited[0] if exited else trainers[-1]
        survivors = [t for t in trainers if t is not victim]
        details["victim"] = victim.name
        killed_at = _log_time(victim, r"FAULT INJECTION: SIGKILL in the middle of gradient all-reduce")
        _check(details, "a trainer was killed inside an all-reduce", killed_at is not None)
        if killed_at is None:
            victim.kill_tree()
        _check(details, "nothing of the victim is left running", not victim.wait_until_gone(timeout=15))
        killed_epoch = victim.last_epoch()
        details["killed_in_epoch"] = killed_epoch
        try:
            for survivor in survivors:
                _wait_epoch(survivor, killed_epoch + epochs_after + 1, timeout=60 + 30 * epochs_after)
        except (TimeoutError, RuntimeError) as e:
            details["error"] = str(e)[-400:]
        codes = _stop_all(survivors)
        _check(details, "survivors stopped cleanly", codes == [0, 0])
        _check(
            details,
            "all three trained together before the kill",
            killed_at is not None
            and all(
                sum(t < killed_at for t in trainer.epochs_done().values()) >= epochs_before for trainer in trainers
            ),
        )
        if killed_at is not None:
            next_done = []
            for survivor in survivors:
                after = [t for e, t in survivor.epochs_done().items() if t > killed_at]
                next_done.append(min(after) - killed_at if after else None)
            details["seconds_to_next_epoch"] = next_done
            if all(v is not None for v in next_done):
                recover = max(next_done)
            epoch_after = _median([g for s in survivors for g in _epoch_gaps(s, after=killed_at)[1:]])
            epoch_before = _median([g for s in survivors for g in _epoch_gaps(s, before=killed_at)])
            details["epoch_seconds_before"], details["epoch_seconds_after"] = epoch_before, epoch_after
            bound = settings.averaging_timeout + max(filter(None, [epoch_before, epoch_after, 0.0]))
            details["bound_seconds"] = bound
            _check(
                details,
                "survivors finished the next epoch within averaging_timeout + one epoch",
                recover is not None and recover <= bound,
            )
        reached = [s.last_epoch() for s in survivors]
        details["survivor_epochs"] = reached
        _check(details, f"survivors trained {epochs_after} more epochs", min(reached) >= killed_epoch + epochs_after)
        _check(details, "loss fell on the survivors", all(_loss_fell(s) for s in survivors))
        rollback = any(_went_back(s) for s in survivors)
        _check(details, "no survivor went back an epoch", not rollback)
        if sync_mode == "local":
            # The round the victim died in ends at killed_epoch + 1: a reducer that dies leaves each survivor its
            # own pseudo-gradient in that shard (hivemind calls the round a success), so the survivors' dumps of
            # that epoch may differ (recorded). The round agreement (peer.swarm.agreement) repairs it: the loser
            # of the vote downloads the winner's state SETTLE_SECONDS into the next round (or at its end, before
            # that round's dump), so every round from killed_epoch + 2 on must be equal (lossless: <= 1e-6).
            rounds = round_param_differences(folder, [s.name for s in survivors])
            details["param_difference_of_kill_round"] = rounds.get(killed_epoch + 1)
            repaired = {epoch: d for epoch, d in rounds.items() if epoch >= killed_epoch + 2}
            details["max_param_difference_after_repair"] = max(repaired.values(), default=None)
            details["repair_downloads"] = [
                len([e for e in s.events.all("state_loaded") if e.get("reason") == "disagreement"]) for s in survivors
            ]
            _check(
                details,
                f"survivors hold the same shared parameters after every round from {killed_epoch + 2} on",
                len(repaired) >= epochs_after - 1 and max(repaired.values()) <= 1e-6,
            )
    return _checked_result(
        "b. SIGKILL a trainer during all-reduce" + _mode_label(sync_mode),
        details,
        started,
        epochs_lost=0 if not rollback else 1,
        recover_seconds=recover,
    )


# ------------------------------------------------------------------------------------------------ c


def partition_and_heal(
    folder: Path,
    *,
    partition_seconds: float = 30.0,
    match_within: int = 3,
    tolerance: float = 1e-4,
    sync_mode: str = "sync",
) -> ScenarioResult:
    """c. One trainer is cut off for ``partition_seconds``, then the partition heals: within ``match_within``
    epochs it must re-join and hold the others' parameters (exact averaging: equal within ``tolerance``, or at
    least as close to them as they are to each other)."""
    # Broadband links: with this tiny model an epoch lasts ~5 s, and at 100 ms RTT a state download plus an
    # averaging round take most of that, so a re-joined peer would trail the swarm by one epoch (hivemind
    # tolerates a peer one epoch behind); the partition itself is what this scenario is about.
    started = time.monotonic()
    settings = SwarmSettings(run_id="partition", compression="none", extra=_mode_flags(sync_mode))
    details: Dict[str, Any] = {"link": BROADBAND.describe(), "partition_seconds": partition_seconds}
    epochs_lost, recover = 0, None
    with NetemSwarm(folder, 4, settings, BROADBAND) as swarm:
        aux = swarm.start_aux(AUX_HOST, "aux", checkpoint_dir=folder / "checkpoints")
        join = aux.initial_peers(STARTUP)
        trainers = _start_trainers(swarm, ["t1", "t2", "cut"], [1, 2, 3], join)
        t1, t2, cut = trainers
        cut.events.wait("epoch_done", timeout=120, count=2)  # it trains along with the others
        swarm.partition(3)
        cut_at = time.time()
        epoch_at_cut = max(t1.last_epoch(), t2.last_epoch())
        time.sleep(partition_seconds)
        swarm.heal(3)
        healed_at = time.time()
        epoch_at_heal = max(t1.last_epoch(), t2.last_epoch())
        details.update(epoch_at_cut=epoch_at_cut, epoch_at_heal=epoch_at_heal)
        try:
            cut.events.wait("reconnected", timeout=60)
            target = epoch_at_heal + match_within + 2
            for trainer in trainers:
                _wait_epoch(trainer, target, timeout=60 + 30 * (target - epoch_at_heal))
        except (TimeoutError, RuntimeError) as e:
            details["error"] = str(e)[-400:]
        codes = _stop_all(trainers)
        _check(details, "trainers stopped cleanly", codes == [0, 0, 0])
        # paused: no local step from the moment its watchdog saw the partition until the heal. It may spend that
        # time blocked in a state download it had begun (a missed round, a lost vote) instead of in the watchdog's
        # pause; either way it computes nothing alone.
        noticed = [t for t in _log_times(cut, r"No peer of the swarm is reachable") if cut_at <= t <= healed_at]
        steps = _log_times(cut, r"\] step \d+ \|")
        # the loop checks before each step: the one step in flight when the watchdog noticed may still end
        computed_alone = [t for t in steps if noticed and noticed[0] < t < healed_at][1:]
        details["local_steps_while_cut_off"] = len(computed_alone)
        _check(details, "the cut-off trainer noticed and paused", bool(noticed) and not computed_alone)
        reconnected = _event_time(cut, "reconnected")
        details["seconds_to_reconnect"] = None if reconnected is None else reconnected - healed_at
        alone = [e for e, t in cut.epochs_done().items() if cut_at < t < healed_at]
        details["epochs_the_cut_trainer_finished_alone"] = alone
        # epoch by epoch after the heal: is the re-joined trainer as close to the others as they are to each
        # other? (under load hivemind peers drift apart between state averaging rounds, even without faults)
        distances, in_family = {}, []
        for path in sorted((cut.folder / "params").glob("epoch_*.pt")):
            epoch = int(path.stem.split("_")[1])
            # an other trainer that skipped this epoch (it downloaded a newer state) is left out of the comparison
            others = [p for p in (t1.params_at(epoch), t2.params_at(epoch)) if p is not None]
            if path.stat().st_mtime > healed_at and others:
                mine = cut.params_at(epoch)
                to_others = min(param_distance(mine, other) for other in others)
                between_others = param_distance(*others) if len(others) == 2 else 0.0
                distances[epoch] = dict(to_others=round(to_others, 6), between_others=round(between_others, 6))
                if to_others <= max(tolerance, between_others):
                    in_family.append(epoch)
        details["param_distance_by_epoch"] = distances
        details["matched_at_epoch"] = in_family[0] if in_family else None
        details["epochs_matched_after_heal"] = f"{len(in_family)} of {len(distances)}"
        _check(
            details,
            f"re-joined trainer matches the others within {match_within} epochs",
            bool(in_family) and in_family[0] <= epoch_at_heal + match_within,
        )
        if in_family:
            recover = _param_file_time(cut, in_family[0]) - healed_at
        rolled_back = any(_went_back(t) for t in (t1, t2))
        _check(details, "the others never went back an epoch", not rolled_back)
        _check(details, "the others kept training during the partition", epoch_at_heal >= epoch_at_cut + 2)
        epochs_lost = 1 if rolled_back else 0
        _check(details, "loss fell", all(_loss_fell(t) for t in (t1, t2)))
    return _checked_result(
        f"c. partition a trainer for {partition_seconds:g} s, heal" + _mode_label(sync_mode),
        details,
        started,
        epochs_lost=epochs_lost,
        recover_seconds=recover,
    )


def _param_file_time(trainer: SwarmPeer, epoch: int) -> float:
    """When the trainer reached ``epoch`` (it writes its parameters then)."""
    return (trainer.folder / "params" / f"epoch_{epoch:06d}.pt").stat().st_mtime


def _event_time(peer: SwarmPeer, name: str) -> Optional[float]:
    """Time (unix seconds) of the first event ``name`` of ``peer``, or None."""
    found = peer.events.all(name)
    return float(found[0]["time"]) if found else None


def _went_back(trainer: SwarmPeer) -> bool:
    """True if the trainer ever finished an epoch that was not after the previous one (its progress was undone)."""
    done = [int(e["epoch"]) for e in epoch_done_events(trainer)]
    return any(b <= a for a, b in zip(done, done[1:]))


# ------------------------------------------------------------------------------------------------ f


def poisoned_gradients(folder: Path, *, epochs: int = 10, scale: float = 1e6) -> ScenarioResult:
    """f. Two honest trainers with one peer that sends NaN/inf gradients and one that sends them ``scale`` x too
    large: the honest peers' parameters stay finite and their loss keeps falling (peer.swarm.robust)."""
    from benchmarks.testbed.faults.injection import SEND_GRAD_SCALE_ENV, SEND_NONFINITE_GRADS_ENV

    started = time.monotonic()
    settings = SwarmSettings(run_id="poison")
    details: Dict[str, Any] = {"link": INTERNET.describe(), "scale": scale}
    with NetemSwarm(folder, 4, settings, INTERNET) as swarm:
        first = swarm.start_trainer(0, "h1", extra=["--min_peers", "4", "--max_epochs", str(epochs)])
        join = first.initial_peers(STARTUP)
        others = _start_trainers(
            swarm,
            ["h2", "nan", "big"],
            [1, 2, 3],
            join,
            extra=["--max_epochs", str(epochs)],
            env_by_name={"nan": {SEND_NONFINITE_GRADS_ENV: "1"}, "big": {SEND_GRAD_SCALE_ENV: f"{scale:g}"}},
        )
        honest = [first, others[0]]
        try:
            codes = wait_all(honest, timeout=120 + 40 * epochs)
        except TimeoutError as e:
            codes, details["error"] = [t.poll() for t in honest], str(e)[-300:]
        _stop_all(others[1:])
        _check(details, "honest trainers finished cleanly", codes == [0, 0])
        reached = [_final_epoch(t) for t in honest]
        details["honest_epochs"] = reached
        _check(details, f"honest trainers reached epoch {epochs}", min(reached) >= epochs)
        finite = True
        for trainer in honest:
            for path in sorted((trainer.folder / "params").glob("epoch_*.pt")):
                params = trainer.params_at(int(path.stem.split("_")[1]))
                finite &= all(bool(torch.isfinite(t).all()) for t in params.values())
        _check(details, "honest parameters stayed finite at every epoch", finite)
        losses = [epoch_losses(t) for t in honest]
        details["honest_losses"] = [{e: round(v, 4) for e, v in sorted(loss.items())} for loss in losses]
        # the clean tiny swarm learns about 0.03 per epoch at this point; ask for two thirds of that pace
        drops = [_fitted_loss_drop(t) for t in honest]
        details["honest_fitted_loss_drop"] = [round(d, 3) for d in drops]
        _check(details, "honest loss kept falling", all(d >= 0.2 for d in drops))
        logs = "".join(t.log() for t in honest)
        details["nonfinite_contributions_dropped"] = logs.count("contributions with NaN/inf values")
        details["oversized_contributions_bounded"] = logs.count("Averaging: bounded")
        _check(
            details,
            "faulty peers took part (their contributions were dropped or bounded)",
            details["nonfinite_contributions_dropped"] > 0 and details["oversized_contributions_bounded"] > 0,
        )
    return _checked_result(f"f. NaN/inf gradients + {scale:g}x gradients", details, started, data_lost=not finite)


# ------------------------------------------------------------------------------------------------ g


def bad_dht_records(folder: Path) -> ScenarioResult:
    """g. A hostile node sends honest peers malformed, unsigned, forged and oversized records (raw store RPCs
    with exactly the bytes it wants); every one must be refused, a valid record accepted, and the honest peers'
    view (metrics, training progress) unchanged. Real DHT peers on 127.0.0.1, in this process."""
    import hivemind
    from hivemind.optim.progress_tracker import ProgressTracker
    from hivemind.utils import get_dht_time
    from hivemind.utils.crypto import RSAPrivateKey

    from benchmarks.testbed.faults.dht_records import craft, owner_marker, raw_store, signed
    from benchmarks.testbed.processes import share_tensors_by_file_descriptor
    from peer.swarm.hivemind_seam import MAX_RECORD_BYTES
    from peer.swarm.network import NetworkArguments, create_dht, make_validators
    from peer.swarm.records import LocalMetrics, fetch_metrics, metrics_key

    started = time.monotonic()
    share_tensors_by_file_descriptor()
    run_id, local = "records", ["/ip4/127.0.0.1/tcp/0"]
    details: Dict[str, Any] = {}
    honest_key, other_key = RSAPrivateKey(), RSAPrivateKey()
    dhts, trackers = [], []
    try:
        for index in range(2):
            validators, _ = make_validators(run_id, honest_key if index == 0 else other_key)
            peers = [str(a) for a in dhts[0].get_visible_maddrs()] if dhts else []
            dhts.append(
                create_dht(
                    NetworkArguments(run_id=run_id, host_maddrs=local, initial_peers=peers, rejoin_period=0), validators
                )
            )
        first, second = dhts
        # the training progress records, validated as every trainer's hivemind.Optimizer does
        for dht, key in ((first, honest_key), (second, other_key)):
            trackers.append(ProgressTracker(dht, run_id, target_batch_size=64, private_key=key, start=True))
        rogue = hivemind.DHT(start=True, host_maddrs=local, initial_peers=[str(a) for a in first.get_visible_maddrs()])
        dhts.append(rogue)

        metrics = LocalMetrics(
            epoch=3,
            samples_per_second=10.0,
            samples_accumulated=64,
            loss=33.0,
            mini_steps=4,
            samples_total=640,
            time=float(get_dht_time()),
        ).dict()
        owner = owner_marker(honest_key)
        mkey = metrics_key(run_id)
        fake_progress = dict(
            peer_id=rogue.peer_id.to_bytes(),
            epoch=10**6,
            samples_accumulated=10**6,
            samples_per_second=1e6,
            time=float(get_dht_time()),
            client_mode=False,
        )
        genuine = signed(craft(mkey, owner, metrics), honest_key)
        tampered = signed(craft(mkey, owner, metrics), honest_key)
        tampered.value = tampered.value.replace(
            MSGPackSerializer_dumps(metrics), MSGPackSerializer_dumps({**metrics, "epoch": 10**6})
        )
        cases = {
            "malformed (signed, loss is a string)": signed(craft(mkey, owner, {**metrics, "loss": "high"}), honest_key),
            "malformed (signed, extra field)": signed(craft(mkey, owner, {**metrics, "admin": True}), honest_key),
            "malformed (not msgpack)": signed(craft(mkey, owner, b"\xc1\xff garbage"), honest_key),
            "unsigned (claims the honest peer's key)": craft(mkey, owner, metrics),
            "unsigned (no owner key at all)": craft(mkey, b"rogue", metrics),
            "forged (signed by another key)": signed(craft(mkey, owner, metrics), RSAPrivateKey()),
            "forged (genuine signature, value changed)": tampered,
            "forged progress (epoch 10^6, unsigned)": craft(f"{run_id}_progress", owner, fake_progress),
            "forged progress (epoch 10^6, no owner)": craft(f"{run_id}_progress", b"rogue", fake_progress),
            "oversized (1 MiB under a free key)": dataclasses.replace(
                craft(f"{run_id}_junk", None, b"x"), repeat=2**20
            ),
            "oversized (20 KiB under the metrics key)": dataclasses.replace(
                craft(mkey, b"rogue", b"x"), repeat=20 * 1024
            ),
        }
        verdicts = {}
        for name, record in cases.items():
            verdicts[name] = [raw_store(rogue, receiver, record) for receiver in (first, second)]
        details["accepted_by_honest_peers"] = {name: v for name, v in verdicts.items()}
        details["record_size_limit"] = MAX_RECORD_BYTES
        _check(
            details,
            "every bad record was refused by both honest peers",
            all(v == [False, False] for v in verdicts.values()),
        )
        control = [raw_store(rogue, receiver, genuine) for receiver in (first, second)]
        details["valid record accepted"] = control
        _check(details, "a valid signed record sent the same way is accepted", control == [True, True])
        time.sleep(2.0)  # let the trackers fetch progress once more
        seen = fetch_metrics(second, run_id, timeout=10)
        details["metrics_seen"] = {str(k)[:24]: v.epoch for k, v in seen.items()}
        _check(details, "honest peers see only the genuine metrics", [m.epoch for m in seen.values()] == [3])
        epochs = [tracker.global_epoch for tracker in trackers]
        details["trackers_global_epoch"] = epochs
        _check(details, "the swarm's epoch was not inflated", max(epochs) < 10**6)
    finally:
        for tracker in trackers:
            tracker.shutdown()
        for dht in dhts:
            dht.shutdown()
    return _checked_result("g. malformed/unsigned/forged/oversized DHT records", details, started)


def MSGPackSerializer_dumps(value) -> bytes:
    from hivemind.utils import MSGPackSerializer

    return MSGPackSerializer.dumps(value)


# ------------------------------------------------------------------------------------------------ h


def authorization(folder: Path) -> ScenarioResult:
    """h. Authorization on (--authorized_keys): a peer without credentials can neither store metrics nor read
    them, nor download the model state or join averaging; listed peers can. A real trainer process on
    127.0.0.1, unauthorized trainers that try to join it, and DHT peers in this process."""
    import hivemind
    from hivemind.utils import get_dht_time

    from benchmarks.testbed.faults.averaging_probe import probe_averaging
    from benchmarks.testbed.faults.dht_records import craft, owner_marker, raw_store, signed
    from benchmarks.testbed.processes import share_tensors_by_file_descriptor
    from benchmarks.testbed.trainers import start_trainer, wait_for_epoch
    from peer.swarm.auth import identity_line
    from peer.swarm.identity import load_or_create_signing_key, signing_key_path
    from peer.swarm.network import NetworkArguments, create_dht, make_validators
    from peer.swarm.records import LocalMetrics, fetch_metrics, metrics_key, publish_metrics

    started = time.monotonic()
    share_tensors_by_file_descriptor()
    run_id, local = "private", ["/ip4/127.0.0.1/tcp/0"]
    folder.mkdir(parents=True, exist_ok=True)
    details: Dict[str, Any] = {}
    identity = {name: folder / name / "identity.key" for name in ("a", "b", "u", "unlisted")}
    lines = {name: identity_line(str(path), name) for name, path in identity.items()}
    allowlist = folder / "authorized_keys"
    allowlist.write_text(f"# the run owner's list\n{lines['a']}\n{lines['b']}\n")
    peer_id = {name: line.split()[0] for name, line in lines.items()}
    trainers, dhts = [], []
    try:
        owner = start_trainer(folder, "a", run_id, extra=["--authorized_keys", allowlist])
        trainers.append(owner)
        join = owner.initial_peers(STARTUP)
        # an intruder without credentials, and a peer whose key the owner never listed
        intruder = start_trainer(folder, "intruder", run_id, initial_peers=join)
        unlisted = start_trainer(folder, "unlisted", run_id, initial_peers=join, extra=["--authorized_keys", allowlist])
        trainers += [intruder, unlisted]

        def network(name: str, **kwargs) -> NetworkArguments:
            return NetworkArguments(
                run_id=run_id,
                host_maddrs=local,
                initial_peers=join,
                rejoin_period=0,
                identity_path=str(identity[name]),
                **kwargs,
            )

        key_b = load_or_create_signing_key(signing_key_path(network("b").identity_path))
        member = create_dht(network("b", authorized_keys=str(allowlist)), make_validators(run_id, key_b)[0])
        dhts.append(member)
        key_u = load_or_create_signing_key(signing_key_path(network("u").identity_path))
        validators_u, public_u = make_validators(run_id, key_u)
        stranger = hivemind.DHT(
            start=True,
            host_maddrs=local,
            initial_peers=join,
            record_validators=validators_u,
            identity_path=str(identity["u"]),
            ensure_bootstrap_success=False,
        )
        dhts.append(stranger)

        wait_for_epoch(owner, 1, timeout=120)
        metrics = LocalMetrics(
            epoch=1,
            samples_per_second=1.0,
            samples_accumulated=16,
            loss=8.0,
            mini_steps=1,
            samples_total=16,
            time=float(get_dht_time()),
        )
        publish_metrics(stranger, run_id, public_u, metrics).result(timeout=30)
        stored = raw_store(
            stranger, member, signed(craft(metrics_key(run_id), owner_marker(key_u), metrics.dict()), key_u)
        )
        details["stranger_raw_store_answer"] = stored
        time.sleep(2.0)
        seen_by_member = fetch_metrics(member, run_id, timeout=15)
        details["metrics_seen_by_member"] = len(seen_by_member)
        _check(details, "a listed peer reads the owner's metrics", len(seen_by_member) >= 1)
        _check(details, "the stranger's metrics were stored nowhere", public_u not in seen_by_member)
        _check(details, "the stranger's store request got no answer", stored is None)
        seen_by_stranger = fetch_metrics(stranger, run_id, timeout=15)
        _check(details, "the stranger cannot read the swarm's metrics", set(seen_by_stranger) <= {public_u})

        as_member = probe_averaging(member, peer_id["a"], run_id)
        as_stranger = probe_averaging(stranger, peer_id["a"], run_id)
        details["averaging_rpcs_of_a_listed_peer"], details["averaging_rpcs_of_the_stranger"] = as_member, as_stranger
        _check(
            details,
            "a listed peer may download the state and ask to join averaging",
            all(answer.startswith("answered") for answer in as_member.values()),
        )
        _check(details, "the stranger may not", all(answer.startswith("refused") for answer in as_stranger.values()))

        codes = [intruder.wait(60), unlisted.wait(60)]
        details["intruder_and_unlisted_exit_codes"] = codes
        _check(
            details,
            "a trainer without credentials cannot join (clear error)",
            codes[0] != 0 and "could not reach any of the initial peers" in intruder.log(),
        )
        _check(
            details,
            "an unlisted trainer is told to get listed",
            codes[1] != 0
            and f"is not in --authorized_keys {allowlist}" in unlisted.log()
            and lines["unlisted"].split()[0] in unlisted.log(),
        )
        _check(details, "the owner logs refused averaging calls", "Refused rpc_download_state" in owner.log())
        _check(details, "the owner kept training", _loss_fell(owner, min_drop=0.0) or owner.poll() is None)
        details["owner_exit_code"] = _stop_all([owner])[0]
        _check(details, "the owner stopped cleanly", details["owner_exit_code"] == 0)
    finally:
        for dht in dhts:
            dht.shutdown()
        from benchmarks.testbed.processes import kill_all

        kill_all(trainers)
    return _checked_result("h. authorization: peer without credentials", details, started)


# ------------------------------------------------------------------------------------------------ i


class _LogCapture:
    """Collects the log lines of some loggers while a ``with`` block runs."""

    def __init__(self, *names: str):
        import logging

        self.names, self.lines = names, []
        self.handler = logging.Handler(level=logging.INFO)
        self.handler.emit = lambda record: self.lines.append(record.getMessage())

    def __enter__(self) -> "_LogCapture":
        import logging

        for name in self.names:
            logging.getLogger(name).addHandler(self.handler)
            logging.getLogger(name).setLevel(logging.INFO)
        return self

    def __exit__(self, *exc_info) -> None:
        import logging

        for name in self.names:
            logging.getLogger(name).removeHandler(self.handler)

    def take(self) -> List[str]:
        lines, self.lines = self.lines, []
        return lines


def _damage(path: Path, how: str) -> None:
    data = path.read_bytes()
    if how == "truncated":
        path.write_bytes(data[: len(data) // 2])
    elif how == "bytes changed":
        middle = len(data) // 2
        path.write_bytes(data[:middle] + bytes(b ^ 0xFF for b in data[middle : middle + 16]) + data[middle + 16 :])
    elif how == "empty":
        path.write_bytes(b"")
    elif how == "garbage":
        path.write_bytes(b"\x00not a checkpoint\xff" * 64)
    elif how == "deleted":
        path.unlink()
    else:
        raise ValueError(how)


DAMAGES = ("truncated", "bytes changed", "empty", "garbage")


def _backup_cases(folder: Path, details: Dict[str, Any], logs: _LogCapture) -> bool:
    """Trainer backups (peer.backup) with a real hivemind optimizer: damage the newest, the previous is used."""
    import shutil

    import hivemind

    from peer import backup
    from peer.swarm.config import CollaborationArguments, OptimizerArguments
    from peer.swarm.network import make_validators
    from peer.swarm.optimizer import build_optimizer

    key = hivemind.utils.crypto.RSAPrivateKey()
    dht = hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"], record_validators=make_validators("i", key)[0])
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.LayerNorm(8))
    opt = build_optimizer(
        model=model,
        dht=dht,
        run_id="i",
        signing_key=key,
        batch_size_per_step=4,
        collab=CollaborationArguments(target_batch_size=4, matchmaking_time=1.0),
        optim=OptimizerArguments(),
        client_mode=False,
    )
    ok = True
    try:
        written = {}
        for _ in range(2):  # two global epochs, a backup after each: backup.pt (epoch 2), backup.prev.pt (epoch 1)
            model(torch.randn(4, 8)).sum().backward()
            opt.step()
            backup.save_backup(str(folder / "pristine"), model, opt)
            written[opt.local_epoch] = {k: v.clone() for k, v in model.state_dict().items()}
        results = {}
        for how in DAMAGES + ("both damaged",):
            case = folder / how.replace(" ", "_")
            shutil.copytree(folder / "pristine", case)
            _damage(case / backup.BACKUP_NAME, "truncated" if how == "both damaged" else how)
            if how == "both damaged":
                _damage(case / backup.PREVIOUS_BACKUP_NAME, "bytes changed")
            with torch.no_grad():
                model[0].weight.add_(1.0)  # the live state moved on; the backup must bring back epoch 1
            logs.take()
            restored = backup.load_backup(str(case), model, opt) is not None  # the restored file, or None
            lines = logs.take()
            results[how] = dict(restored=restored, epoch=opt.local_epoch if restored else None, log=lines)
            if how == "both damaged":
                ok &= not restored and sum("Ignoring" in line for line in lines) == 2
            else:
                ok &= (
                    restored
                    and opt.local_epoch == 1
                    and all(torch.equal(v, model.state_dict()[k]) for k, v in written[1].items())
                    and any(backup.BACKUP_NAME in line and "Ignoring" in line for line in lines)
                    and any(backup.PREVIOUS_BACKUP_NAME in line and "Restored" in line for line in lines)
                )
        details["backups"] = results
    finally:
        opt.shutdown()
        dht.shutdown()
    return ok


def _checkpoint_cases(folder: Path, details: Dict[str, Any], logs: _LogCapture) -> bool:
    """Aux checkpoints (aux_monitor.checkpoints): damage the newest, the previous one loads; nothing is deleted."""
    import shutil

    from aux_monitor.checkpoints import MANIFEST, OPTIMIZER_FILE, CheckpointManager, TrainingState
    from benchmarks.testbed.trainers import tiny_model_config
    from model import LeanGPTForCausalLM, load_config

    model = LeanGPTForCausalLM(load_config(str(tiny_model_config(folder))))
    sgd = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    pristine = folder / "checkpoints"
    manager = CheckpointManager(pristine, keep=3, model_class=LeanGPTForCausalLM)
    for epoch in (2, 4, 6):
        with torch.no_grad():
            next(model.parameters()).add_(0.01)
        manager.save(
            TrainingState(
                model=model,
                optimizer_state=sgd.state_dict(),
                scheduler_state=None,
                epoch=epoch,
                loss=1.0,
                time=time.time(),
            )
        )
    newest = "epoch_000006"
    weights = next(p.name for p in (pristine / newest).iterdir() if p.suffix == ".safetensors")
    cases = [(f"optimizer.pt {how}", OPTIMIZER_FILE, how) for how in DAMAGES]
    cases += [(f"model weights {how}", weights, how) for how in ("truncated", "bytes changed")]
    cases += [(f"manifest {how}", MANIFEST, how) for how in ("truncated", "garbage", "deleted")]
    ok, results = True, {}
    for name, file, how in cases:
        case = folder / ("ckpt_" + name.replace(" ", "_"))
        shutil.copytree(pristine, case)
        _damage(case / newest / file, how)
        logs.take()
        loaded = CheckpointManager(case, keep=3, model_class=LeanGPTForCausalLM).load_newest_valid()
        lines = logs.take()
        epoch = None if loaded is None else loaded.state.epoch
        results[name] = dict(loaded_epoch=epoch, log=[line[:200] for line in lines])
        ok &= epoch == 4 and any(newest in line and "corrupt" in line for line in lines)
    # with a damaged newest checkpoint in place, new checkpoints rotate old ones but never the damaged one
    case = folder / "ckpt_optimizer.pt_truncated"
    manager = CheckpointManager(case, keep=3, model_class=LeanGPTForCausalLM)
    for epoch in (8, 10, 12):
        manager.save(
            TrainingState(
                model=model,
                optimizer_state=sgd.state_dict(),
                scheduler_state=None,
                epoch=epoch,
                loss=1.0,
                time=time.time(),
            )
        )
    remaining = sorted(p.name for p in manager.list_checkpoints())
    results["after three more checkpoints"] = remaining
    ok &= newest in remaining and manager.load_newest_valid().state.epoch == 12
    details["checkpoints"] = results
    return ok


def corrupt_files(folder: Path) -> ScenarioResult:
    """i. Corrupt and truncated trainer backups and aux checkpoints: a clear log line, the last good one used,
    nothing deleted. In this process: a real hivemind optimizer for backups, the aux's CheckpointManager."""
    from benchmarks.testbed.processes import share_tensors_by_file_descriptor

    started = time.monotonic()
    share_tensors_by_file_descriptor()
    folder.mkdir(parents=True, exist_ok=True)
    details: Dict[str, Any] = {}
    with _LogCapture("peer.backup", "aux_monitor.checkpoints") as logs:
        _check(
            details,
            "damaged newest backup: logged, the previous backup restored",
            _backup_cases(folder / "backups", details, logs),
        )
        _check(
            details,
            "damaged newest checkpoint: logged, the previous checkpoint loaded, nothing deleted",
            _checkpoint_cases(folder, details, logs),
        )
    return _checked_result(
        "i. corrupt/truncated checkpoints and backups", details, started, data_lost=not _all_checks(details)
    )


# ------------------------------------------------------------------------------------------------ d, e


def _metric(page: Optional[str], name: str) -> Optional[float]:
    match = re.search(rf"^leanhive_{name} ([0-9.eE+-]+)$", page or "", re.M)
    return float(match.group(1)) if match else None


def _verified_checkpoints(directory: Path) -> Dict[str, bool]:
    """Checkpoint directory name -> whether every file matches its manifest (without loading the model)."""
    from aux_monitor.checkpoints import CheckpointError, CheckpointManager

    manager = CheckpointManager.__new__(CheckpointManager)  # verify_files needs no state; no cleanup on create
    result = {}
    for path in sorted(directory.glob("epoch_*")):
        try:
            manager.verify_files(path)
            result[path.name] = True
        except CheckpointError:
            result[path.name] = False
    return result


def _refreshed(event: dict) -> bool:
    """An aux peer downloaded the swarm's state (to checkpoint or evaluate it)."""
    return event["source"] == "swarm" and event["reason"] == "refresh"


def _resumed(event: dict) -> bool:
    """An aux peer started with --resume loaded its newest valid checkpoint."""
    return event["source"] == "checkpoint" and event["reason"] == "resume"


def _joined_from_swarm(event: dict) -> bool:
    """A trainer joining the swarm loaded the swarm's state."""
    return event["source"] == "swarm" and event["reason"] == "join"


def aux_restart_and_trainer_replacement(folder: Path) -> List[ScenarioResult]:
    """d. The aux peer is SIGKILLed (right after it downloaded a state to checkpoint) and restarted with
    --resume: no checkpoint is lost and its metrics resume.
    e. Then every trainer is SIGKILLed and new ones (fresh disks) start: they continue from the aux peer's
    checkpoint epoch, not from scratch. One swarm for both, on broadband links: the aux peer checkpoints a
    state only after two identical downloads, which at 100 ms RTT take longer than this tiny model's epoch."""
    started = time.monotonic()
    settings = SwarmSettings(run_id="auxrestart")
    checkpoints = folder / "checkpoints"
    aux_flags = ["--checkpoint_every", "2", "--keep_checkpoints", "50"]
    d: Dict[str, Any] = {"link": BROADBAND.describe()}
    e: Dict[str, Any] = {"link": BROADBAND.describe()}
    d_recover = e_recover = None
    e_lost, d_lost, e_data_lost = 0, False, False
    with NetemSwarm(folder, 5, settings, BROADBAND) as swarm:
        aux = swarm.start_aux(AUX_HOST, "aux", checkpoint_dir=checkpoints, extra=aux_flags)
        join = aux.initial_peers(STARTUP)
        old = _start_trainers(swarm, ["t1", "t2"], [1, 2], join)
        trainer_join = old[0].initial_peers(STARTUP)
        try:
            aux.events.wait("checkpoint_saved", timeout=150)
            aux.events.wait(
                "state_loaded",
                timeout=120,
                where=_refreshed,
                count=len(aux.events.all("state_loaded", where=_refreshed)) + 1,
            )
        except (TimeoutError, RuntimeError) as error:
            d["error"] = str(error)[-300:]
        before_page = swarm.scrape_metrics(aux)
        aux.kill()  # SIGKILL, most likely while it writes the checkpoint of the state it just downloaded
        killed_at = time.time()
        aux.wait_until_gone(timeout=15)
        epoch_at_kill = max(t.last_epoch() for t in old)
        before = _verified_checkpoints(checkpoints)
        d.update(
            checkpoints_before_kill=before,
            unfinished_write_at_kill=bool(list(checkpoints.glob(".tmp-*"))),
            metrics_epoch_before_kill=_metric(before_page, "global_epoch"),
            swarm_epoch_at_kill=epoch_at_kill,
        )
        time.sleep(5.0)
        restarted = swarm.start_aux(
            AUX_HOST,
            "aux-restarted",
            checkpoint_dir=checkpoints,
            initial_peers=trainer_join,
            extra=[*aux_flags, "--resume"],
        )
        restarted.folder = aux.folder  # same identity (peer ID) as before the crash
        try:
            restarted.events.wait("state_loaded", timeout=STARTUP, where=_resumed)
            page = wait_for(
                lambda: (lambda p: p if (_metric(p, "global_epoch") or -1) > epoch_at_kill else None)(
                    swarm.scrape_metrics(restarted)
                ),
                timeout=120,
                interval=1.0,
                what="metrics past the crash epoch",
            )
            d_recover = time.time() - killed_at
            d["metrics_epoch_after_restart"] = _metric(page, "global_epoch")
            restarted.events.wait("checkpoint_saved", timeout=120)
        except (TimeoutError, RuntimeError) as error:
            d["error"] = str(error)[-300:]
        after = _verified_checkpoints(checkpoints)
        d["checkpoints_after_restart"] = after
        lost = [name for name, ok in before.items() if ok and not after.get(name)]
        d_lost = bool(lost)
        _check(d, "every checkpoint written before the crash is still there and intact", not lost)
        _check(d, "no unfinished checkpoint write is left", not list(checkpoints.glob(".tmp-*")))
        _check(
            d,
            "the restarted aux peer resumed from its newest checkpoint",
            bool(restarted.events.all("state_loaded", where=_resumed)),
        )
        _check(d, "metrics resumed past the crash epoch", d_recover is not None)
        _check(
            d,
            "a new checkpoint was written after the restart",
            len(after) > len(before) or any(ok and name not in before for name, ok in after.items()),
        )
        _check(d, "the trainers kept training", all(t.last_epoch() > epoch_at_kill for t in old))

        # e. every trainer dies at once; new ones with empty disks join through the aux peer
        last_epoch = max(t.last_epoch() for t in old)
        e["first_loss"], e["last_loss_before"] = _mean_loss(old, first=True), _mean_loss(old, first=False)
        for trainer in old:
            trainer.kill()
        wiped_at = time.time()
        newest_checkpoint = max(
            (int(n.split("_")[1].split(".")[0]) for n, ok in _verified_checkpoints(checkpoints).items() if ok),
            default=0,
        )
        e.update(swarm_epoch_at_wipeout=last_epoch, newest_checkpoint_epoch=newest_checkpoint)
        time.sleep(5.0)
        fresh = _start_trainers(swarm, ["n1", "n2"], [3, 4], [*restarted.initial_peers(10), *join])
        try:
            joined = [
                int(t.events.wait("state_loaded", timeout=STARTUP, where=_joined_from_swarm)["epoch"]) for t in fresh
            ]
            e["joined_at_epochs"] = joined
            for trainer in fresh:
                trainer.events.wait("epoch_done", timeout=120)
            first_done = min(min(t.epochs_done().values()) for t in fresh)
            e_recover = first_done - wiped_at
            e_lost = max(0, last_epoch - min(joined))
            e_data_lost = min(joined) < newest_checkpoint
            _check(e, "new trainers continued from the aux checkpoint's epoch (or later)", not e_data_lost)
            e["first_loss_after"] = _mean_loss(fresh, first=True)
            halfway = (e["first_loss"] + e["last_loss_before"]) / 2
            _check(
                e,
                "training did not start over (loss nearer where it stopped than where it began)",
                e["first_loss_after"] < halfway,
            )
        except (TimeoutError, RuntimeError) as error:
            e["error"] = str(error)[-300:]
            _check(e, "new trainers joined and trained", False)
        codes = _stop_all([*fresh, restarted])
        e["exit_codes"] = codes
        _check(e, "new trainers and the aux peer stopped cleanly", codes == [0, 0, 0])
    took = time.monotonic() - started
    return [
        ScenarioResult(
            "d. kill the aux peer, restart it",
            survived=_all_checks(d),
            epochs_lost=0,
            recover_seconds=d_recover,
            data_lost=d_lost,
            details=d,
            seconds=took / 2,
        ),
        ScenarioResult(
            "e. every trainer dies, new ones start",
            survived=_all_checks(e),
            epochs_lost=e_lost,
            recover_seconds=e_recover,
            data_lost=e_data_lost,
            details=e,
            seconds=took / 2,
        ),
    ]


# ----------------------------------------------------------------------------------- --sync_mode local


def _mode_flags(sync_mode: str) -> List[str]:
    # local: rounds of 2 x 8 local steps of 32 samples per peer (longer than a sync epoch: that is the point)
    return [] if sync_mode == "sync" else ["--sync_mode", sync_mode, "--average_state_every", "4"]


def _mode_label(sync_mode: str) -> str:
    return "" if sync_mode == "sync" else f" (--sync_mode {sync_mode})"


def join_mid_round_local(folder: Path, *, epochs: int = 12) -> ScenarioResult:
    """y. --sync_mode local on loopback: two trainers train, a third joins in the middle of a round. It must
    download the shared parameters and the outer optimizer's state, train along, and all three must end every
    round they finished together after the joiner's first with the same shared parameters (exact averaging: within
    1e-6)."""
    started = time.monotonic()
    details: Dict[str, Any] = {}
    flags = ["--max_epochs", str(epochs), "--sync_mode", "local", "--target_batch_size", "128", "--compression", "none"]
    peers = []
    joined_at = None
    dumps = {name: param_dump_env(folder, name) for name in "abc"}  # parameters after each round
    try:
        first = start_trainer(folder, "a", "midround", extra=[*flags, "--min_peers", "2"], env=dumps["a"])
        peers.append(first)
        join = first.initial_peers(STARTUP)
        second = start_trainer(folder, "b", "midround", initial_peers=join, extra=flags, env=dumps["b"])
        peers.append(second)
        second.events.wait("epoch_done", timeout=240, count=2)
        late = start_trainer(folder, "c", "midround", initial_peers=join, extra=flags, env=dumps["c"])
        peers.append(late)
        event = late.events.wait(
            "state_loaded", timeout=STARTUP, where=lambda e: e["source"] == "swarm" and e["reason"] == "join"
        )
        joined_at = int(event["epoch"])
        codes = wait_all(peers, timeout=400)
    except (TimeoutError, RuntimeError) as e:
        details["error"] = str(e)[-400:]
        codes = [peer.process.poll() for peer in peers]
    finally:
        kill_all(peers)
    details["joined_at_epoch"] = joined_at
    _check(details, "all trainers stopped cleanly at max_epochs", codes == [0, 0, 0])
    _check(details, "the joiner loaded the swarm's state mid-run", joined_at is not None and joined_at >= 2)
    if codes == [0, 0, 0]:
        folders = [folder / name for name in "abc"]
        details["final_epochs"] = [final_epoch(f) for f in folders]
        details["max_param_difference"] = max_param_difference(folders)
        _check(details, "all reached max_epochs", details["final_epochs"] == [epochs] * 3)
        _check(details, "all hold the same shared parameters", details["max_param_difference"] <= 1e-6)
        rounds = round_param_differences(folder, "abc")
        details["rounds_all_three_finished"] = sorted(rounds)
        details["param_difference_per_round"] = {epoch: float(f"{d:.3g}") for epoch, d in rounds.items()}
        # the joiner's first round is recorded, not checked: a joiner that downloads the state while the others
        # finish a round enters their next all-reduce one epoch behind, so its first dump (its epoch e, the swarm
        # at e + 1) differs from theirs at e; hivemind then has it download the fresh state ("Peer is out of
        # sync") and it is equal from the next round on (seen once: 1.1 at its first round, <= 1e-8 after)
        later = [difference for epoch, difference in rounds.items() if epoch > min(rounds, default=0)]
        _check(details, "all three finished rounds together", len(later) >= 2)
        _check(details, "same shared parameters after every later round", max(later, default=1.0) <= 1e-6)
        contributed = [e for e in epoch_losses(peers[2]) if joined_at is not None and e >= joined_at]
        details["joiner_rounds"] = len(contributed)
        _check(details, "the joiner trained along", len(contributed) >= 2)
    return _checked_result("y. join mid-round (--sync_mode local)", details, started)


# ------------------------------------------------------------------------------------------------ matrix


@dataclass(frozen=True)
class Scenario:
    keys: str
    """The letters (short ids) of the results this entry produces (d and e share one swarm), e.g. for ``--only``."""
    name: str
    """What it does, e.g. ``kill_during_allreduce``; ``--only`` takes it as well as the letters."""
    run: Any
    """folder -> ScenarioResult or list of them."""
    fast: bool
    """Part of the fast subset (CI): loopback only, well under a minute."""
    needs_netns: bool
    """Runs peers on emulated links (network namespaces: root and iproute2)."""


MATRIX = [
    Scenario("a", "internet_baseline", baseline_over_internet, fast=False, needs_netns=True),
    Scenario("b", "kill_during_allreduce", kill_during_allreduce, fast=False, needs_netns=True),
    Scenario("c", "partition_and_heal", partition_and_heal, fast=False, needs_netns=True),
    Scenario(
        "de", "aux_restart_and_trainer_replacement", aux_restart_and_trainer_replacement, fast=False, needs_netns=True
    ),
    Scenario("f", "poisoned_gradients", poisoned_gradients, fast=False, needs_netns=True),
    Scenario("g", "bad_dht_records", bad_dht_records, fast=True, needs_netns=False),
    Scenario("h", "authorization", authorization, fast=True, needs_netns=False),
    Scenario("i", "corrupt_files", corrupt_files, fast=True, needs_netns=False),
    Scenario("s", "hostile_state_servers", hostile_state.hostile_states, fast=False, needs_netns=False),
    Scenario("t", "hostile_averaging", hostile_state.hostile_averaging, fast=False, needs_netns=False),
    Scenario("pq", "hostile_records", hostile_records.hostile_records, fast=False, needs_netns=False),
    Scenario("u", "slow_link_state_download", slow_link.slow_link_state_download, fast=False, needs_netns=True),
    Scenario("v", "dead_p2pd", broken_peer.dead_p2pd, fast=False, needs_netns=False),
    # --sync_mode local: b and c in that mode, and a join in the middle of a round
    Scenario(
        "w",
        "kill_during_allreduce_local",
        partial(kill_during_allreduce, sync_mode="local"),
        fast=False,
        needs_netns=True,
    ),
    Scenario(
        "x", "partition_and_heal_local", partial(partition_and_heal, sync_mode="local"), fast=False, needs_netns=True
    ),
    Scenario("y", "join_mid_round_local", join_mid_round_local, fast=False, needs_netns=False),
    # the state from several donors at once (benchmarks/testbed/faults/donors.py)
    Scenario("jk", "multi_donor_state_download", donors.donor_faults, fast=False, needs_netns=False),
]
