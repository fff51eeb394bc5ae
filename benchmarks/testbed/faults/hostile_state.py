"""Fault scenarios with hostile peers that hold valid credentials, loopback only (127.0.0.1, no root):

- "s" (``hostile_state_servers``): a hostile state server (benchmarks/testbed/hostile_state_server.py, a real
  hivemind peer) offers a broken state with a huge state-sharing priority while an honest trainer offers the real
  one; a joining trainer must skip the broken state and take the honest one. ``tests/faults/test_hostile_state.py``
  runs two modes by default.
- "t" (``hostile_averaging``): an honest trainer averages gradients with a rogue trainer
  (benchmarks/testbed/fault_trainer.py) that claims an inf sample weight, sends -1e3 x its gradient, or sends parts
  of the wrong shape; averaging must go on and the honest update must never be reversed.
  ``tests/faults/test_hostile_averaging.py`` runs the same cases.

Both are registered in ``benchmarks.testbed.faults.scenarios.MATRIX``.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

import torch

from benchmarks.testbed.aux import wait_for
from benchmarks.testbed.faults.injection import (
    PARAMS_DIR_ENV,
    RECORD_AVERAGING_ENV,
    SEND_BAD_SHAPE_ENV,
    SEND_GRAD_SCALE_ENV,
    SEND_WEIGHT_ENV,
)
from benchmarks.testbed.processes import PeerProcess, kill_all, wait_for_file
from benchmarks.testbed.trainers import start_trainer, wait_for_epoch

STARTUP = 120
EXACT = ["--compression", "none"]
FAST_MODES = ("huge_epoch", "wrong_shape")
SLOW_MODES = ("foreign_hparams", "bad_absmax", "trickle")


def _params(folder: Path, epoch: int) -> Optional[Dict[str, torch.Tensor]]:
    path = folder / "params" / f"epoch_{epoch:06d}.pt"
    return torch.load(path, map_location="cpu", weights_only=True) if path.exists() else None


SAME_STATE = 0.25
"""Largest relative difference (per tensor, ||a - b|| / ||a||) of two peers that hold the same state. Not exact
equality: a joiner that loads the state while the other peer finishes that epoch may step once with its own
gradients (hivemind lets a peer one epoch behind do so), which moves each tensor by about the learning rate
(LAMB: ~3% here); a broken state applied (a tensor broadcast from one value, foreign shapes) differs by ~100%."""


def _relative_difference(a: Dict[str, torch.Tensor], b: Dict[str, torch.Tensor]) -> float:
    return max(
        float((a[name].float() - b[name].float()).norm() / a[name].float().norm().clamp_min(1e-12)) for name in a
    )


def hostile_state_server(folder: Path, mode: str, *, epochs_after_join: int = 3) -> Dict[str, Any]:
    """Honest trainer a; hostile server h (``mode``, priority 1e9); joiner b. Returns the measurements:
    ``loaded_epoch`` (b's state_loaded event, None if none), ``a_epoch_at_join``, ``equal_epochs`` (epochs after the
    join at which a and b hold the same parameters, each tensor within ``SAME_STATE`` relative difference),
    ``differences`` (epoch -> that largest relative difference), ``named_hostile`` (b's log says why it skipped h),
    ``error``."""
    folder = Path(folder)
    run_id = f"hostile_{mode}"
    details: Dict[str, Any] = {"mode": mode, "loaded_epoch": None, "equal_epochs": [], "differences": {}, "error": None}
    peers: List[PeerProcess] = []
    extra = ["--max_epochs", "200", *EXACT]
    try:
        a = start_trainer(folder, "a", run_id, extra=extra, env={PARAMS_DIR_ENV: str(folder / "a" / "params")})
        peers.append(a)
        join = a.initial_peers(STARTUP)
        wait_for_epoch(a, 2, timeout=180)
        ready = folder / "hostile.ready"
        hostile = PeerProcess(
            ["--initial_peers", *join, "--run_id", run_id, "--mode", mode, "--ready", ready],
            name="hostile",
            log_path=folder / "hostile.log",
            module="benchmarks.testbed.hostile_state_server",
        ).start()
        peers.append(hostile)
        hostile_id = wait_for_file(ready, hostile, timeout=120).strip()
        details["hostile_peer"] = hostile_id
        b = start_trainer(
            folder, "b", run_id, initial_peers=join, extra=extra, env={PARAMS_DIR_ENV: str(folder / "b" / "params")}
        )
        peers.append(b)
        loaded = b.events.wait("state_loaded", timeout=STARTUP + 240)
        details["loaded_epoch"] = int(loaded["epoch"])
        done = a.events.last("epoch_done")
        details["a_epoch_at_join"] = int(done["epoch"]) if done else None
        if details["loaded_epoch"] < 10**6:
            wait_for_epoch(b, details["loaded_epoch"] + epochs_after_join, timeout=180)
        log = b.log()
        details["named_hostile"] = hostile_id in log and (
            "Not applying the state from" in log or "Could not download the state from" in log
        )
        for epoch in range(details["loaded_epoch"] + 1, details["loaded_epoch"] + epochs_after_join + 1):
            params_a, params_b = _params(folder / "a", epoch), _params(folder / "b", epoch)
            if params_a is not None and params_b is not None:
                difference = _relative_difference(params_a, params_b)
                details["differences"][epoch] = round(difference, 4)
                if difference <= SAME_STATE:
                    details["equal_epochs"].append(epoch)
    except Exception as e:  # measured, not raised: the table shows it
        details["error"] = f"{type(e).__name__}: {str(e)[-600:]}"
    finally:
        kill_all(peers)
    return details


def survived(details: Dict[str, Any]) -> bool:
    """The joiner took the honest state (a sane epoch, parameters equal to the honest trainer's afterwards)."""
    loaded = details.get("loaded_epoch")
    return (
        details.get("error") is None
        and loaded is not None
        and details.get("a_epoch_at_join") is not None
        and loaded <= details["a_epoch_at_join"] + 1
        and bool(details.get("equal_epochs"))
    )


def hostile_states(folder: Path, modes=FAST_MODES + SLOW_MODES) -> list:
    """s. One ScenarioResult per bad state: the joiner must skip it and load the honest state."""
    from benchmarks.testbed.faults.scenarios import ScenarioResult

    results = []
    for mode in modes:
        started = time.monotonic()
        details = hostile_state_server(Path(folder) / mode, mode)
        ok = survived(details)
        results.append(
            ScenarioResult(
                f"s. hostile state server: {mode.replace('_', ' ')}",
                survived=ok,
                epochs_lost=0,
                recover_seconds=None,
                data_lost=not ok,
                details=details,
                seconds=time.monotonic() - started,
            )
        )
    return results


# ------------------------------------------------------------------------------------------------ t


ROGUE_AVERAGING = {
    "inf_weight": {SEND_WEIGHT_ENV: "inf"},
    "sign_flip": {SEND_GRAD_SCALE_ENV: "-1000"},
    "bad_shape": {SEND_BAD_SHAPE_ENV: "1"},
}


def _recorded_rounds(record: Path) -> int:
    return len(record.read_text().splitlines()) if record.exists() else 0


def rounds_with_rogue(folder: Path, run_id: str, rogue_env: Dict[str, str], epochs: int = 4, min_rounds: int = 3):
    """An honest and a rogue trainer until the honest one finished ``epochs`` epochs and took part in ``min_rounds``
    gradient all-reduce rounds (tiny epochs take a fraction of a second: the honest peer may finish a few alone
    before the rogue trains): the honest peer's records of its rounds (ok, error, cosine, change, finite) and its
    log."""
    folder = Path(folder)
    record = folder / "honest_rounds.jsonl"
    extra = ["--max_epochs", "50", *EXACT]
    peers: List[PeerProcess] = []
    try:
        honest = start_trainer(
            folder, "honest", run_id, extra=[*extra, "--min_peers", "2"], env={RECORD_AVERAGING_ENV: str(record)}
        )
        peers.append(honest)
        join = honest.initial_peers(STARTUP)
        peers.append(start_trainer(folder, "rogue", run_id, initial_peers=join, extra=extra, env=rogue_env))
        wait_for_epoch(honest, epochs, timeout=240)
        try:
            wait_for(lambda: _recorded_rounds(record) >= min_rounds or honest.poll() is not None, timeout=240)
        except TimeoutError:
            pass  # the callers' checks say what is missing, with the rounds recorded so far
    finally:
        kill_all(peers)
    lines = record.read_text().splitlines() if record.exists() else []
    return [json.loads(line) for line in lines], honest.log()


def averaging_checks(case: str, rounds: list, log: str) -> Dict[str, bool]:
    """The bounds each rogue must respect (the same as tests/faults/test_hostile_averaging.py asserts)."""
    done = [r for r in rounds if r["ok"]]
    checks = {"at least two rounds averaged": len(done) >= 2, "all results finite": all(r["finite"] for r in done)}
    if case == "inf_weight":
        checks["the other peer's gradient was mixed in"] = bool(done) and all(r["change"] > 1e-4 for r in done)
        checks["no shard refused as NaN"] = "NaN/inf averaged values" not in log
    elif case == "sign_flip":
        checks["the update never points against the honest gradient"] = (
            bool(done) and min(r["cosine"] for r in done) > -1e-3
        )
    elif case == "bad_shape":
        checks["no honest round failed"] = all(r["ok"] for r in rounds)
        checks["the malformed part was dropped"] = "dropped a part of shape (1,)" in log
    return checks


def hostile_averaging(folder: Path) -> list:
    """t. One ScenarioResult per rogue averaging peer (inf weight, -1e3 x gradient, wrong-shape parts)."""
    from benchmarks.testbed.faults.scenarios import ScenarioResult

    results = []
    for case, env in ROGUE_AVERAGING.items():
        started = time.monotonic()
        details: Dict[str, Any] = {"case": case}
        try:
            rounds, log = rounds_with_rogue(Path(folder) / case, f"rogue_{case}", env)
            details["rounds"] = len(rounds)
            details["min_cosine"] = min((r["cosine"] for r in rounds if r["ok"]), default=None)
            details["checks"] = averaging_checks(case, rounds, log)
        except Exception as e:
            details["error"], details["checks"] = f"{type(e).__name__}: {str(e)[-400:]}", {}
        ok = bool(details["checks"]) and all(details["checks"].values())
        results.append(
            ScenarioResult(
                f"t. rogue averaging peer: {case.replace('_', ' ')}",
                survived=ok,
                epochs_lost=0,
                recover_seconds=None,
                data_lost=False,
                details=details,
                seconds=time.monotonic() - started,
            )
        )
    return results
