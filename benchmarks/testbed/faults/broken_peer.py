"""Fault scenario "v" (``dead_p2pd``), loopback only (127.0.0.1, no root): a trainer's ``p2pd`` daemon dies.

hivemind does not notice a dead daemon: the trainer trained alone forever and the Docker healthcheck said healthy.
Now the trainer reports ``swarm_lost`` and exits with status 1; a restart policy (here: the scenario) starts it
again from its output folder, and it must be back in the swarm at the swarm's epoch without the other trainer
losing anything. ``tests/faults/test_honest_peer_failures.py`` checks the exit itself in the default suite.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Dict, List, Optional

import psutil

from benchmarks.testbed.processes import PeerProcess, kill_all
from benchmarks.testbed.trainers import start_trainer, wait_for_epoch

STARTUP = 120
EXIT_BOUND = 60.0  # seconds from the daemon's death to the trainer's exit (the watchdog checks every few seconds)


def _kill_p2pd(trainer: PeerProcess) -> int:
    daemons = [p for p in psutil.Process(trainer.pid).children(recursive=True) if p.name() == "p2pd"]
    for daemon in daemons:
        daemon.kill()
    return len(daemons)


def dead_p2pd(folder: Path, *, epochs_before: int = 2, epochs_after: int = 2):
    """v. Trainers a and b train together; b's p2pd is killed; b must exit 1 promptly, a must train on, and b,
    restarted on the same folder, must rejoin at the swarm's epoch (its state from the swarm, not epoch 0)."""
    from benchmarks.testbed.faults.scenarios import ScenarioResult, _all_checks, _check

    started = time.monotonic()
    folder = Path(folder)
    run_id = "p2pd_dies"
    extra = ["--max_epochs", "200", "--backup_every_epochs", "1", "--rejoin_period", "1"]
    details: Dict[str, Any] = {}
    peers: List[PeerProcess] = []
    recover: Optional[float] = None
    try:
        a = start_trainer(folder, "a", run_id, extra=[*extra, "--min_peers", "2"])
        peers.append(a)
        join = a.initial_peers(STARTUP)
        b = start_trainer(folder, "b", run_id, initial_peers=join, extra=extra)
        peers.append(b)
        wait_for_epoch(b, epochs_before, timeout=240)
        _check(details, "b's p2pd found and killed", _kill_p2pd(b) > 0)
        killed = time.monotonic()
        lost = b.events.wait("swarm_lost", timeout=EXIT_BOUND)
        details["reason"] = lost.get("reason")
        code = b.wait(timeout=EXIT_BOUND)
        details["exit_seconds"] = round(time.monotonic() - killed, 1)
        _check(details, f"b exited with status 1 within {EXIT_BOUND:.0f} s", code == 1)
        _check(details, "nothing of b is left running", not b.wait_until_gone(timeout=15))
        a_epoch = a.events.last("epoch_done")
        a_epoch = int(a_epoch["epoch"]) if a_epoch else -1
        details["a_epoch_at_exit"] = a_epoch

        # the restart policy: same output folder and identity, the same join address
        restarted = start_trainer(
            folder,
            "b_restarted",
            run_id,
            initial_peers=join,
            extra=[*extra, "--output_dir", folder / "b", "--identity_path", folder / "b" / "identity.key"],
        )
        peers.append(restarted)
        loaded = restarted.events.wait("state_loaded", timeout=STARTUP + 60)
        details["restarted_loaded"] = {"epoch": int(loaded["epoch"]), "source": loaded.get("source")}
        _check(details, "the restarted b continued from the swarm or its backup", int(loaded["epoch"]) >= a_epoch)
        reached = wait_for_epoch(restarted, int(loaded["epoch"]) + epochs_after, timeout=240)
        recover = time.monotonic() - killed
        details["restarted_reached"] = reached
        a_now = wait_for_epoch(a, a_epoch + epochs_after, timeout=120)
        details["a_reached"] = a_now
        _check(details, "a trained on", a_now >= a_epoch + epochs_after)
        _check(details, "a never exited", a.poll() is None)
    except Exception as e:  # measured, not raised: the table shows it
        details["error"] = f"{type(e).__name__}: {str(e)[-600:]}"
        _check(details, "no error", False)
    finally:
        kill_all(peers)
    return ScenarioResult(
        "v. a trainer's p2pd daemon dies (exit 1, restart)",
        survived=_all_checks(details),
        epochs_lost=0,
        recover_seconds=recover,
        data_lost="restarted_loaded" not in details,
        details=details,
        seconds=time.monotonic() - started,
    )
