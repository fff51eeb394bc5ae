"""Fault scenarios p (signed record poisoning) and q (key squatting): a rogue process
(benchmarks/testbed/rogue_records.py) writes properly signed but hostile progress and metrics records and squats the
state-sharing and matchmaking keys, while an aux peer and two trainers train and a third trainer joins.

One swarm produces both results. Bounds: the trainers reach max_epochs, at most one poisoned epoch closes with
under 3/4 of target_batch_size samples, no trainer re-downloads the state, the joiner downloads it, the aux peer's
dashboard shows the honest epoch and only honest trainers, and the aux re-downloads the state only for its
checkpoints.
"""

from __future__ import annotations

import time
from collections import defaultdict
from pathlib import Path
from typing import Any, Dict, List

from benchmarks.testbed.aux import RUN_ID, api_state, free_port, start_aux, swarm_processes
from benchmarks.testbed.processes import PeerProcess, wait_all
from benchmarks.testbed.trainers import epoch_done_events, events_path, start_trainer, wait_for_epoch

MAX_EPOCHS = 18
TARGET = 64  # the tiny preset's target_batch_size
STARTUP = 120


def start_rogue(folder: Path, initial_peers, *extra: str) -> PeerProcess:
    return PeerProcess(
        ["--initial_peers", *initial_peers, "--run_id", RUN_ID, *extra],
        name="rogue",
        log_path=Path(folder) / "rogue.log",
        module="benchmarks.testbed.rogue_records",
        events_path=events_path(Path(folder), "rogue"),
    ).start()


def swarm_samples_per_epoch(trainers) -> Dict[int, int]:
    """epoch -> samples all trainers contributed to it (from their epoch_done events)."""
    samples: Dict[int, int] = defaultdict(int)
    for peer in trainers:
        for event in epoch_done_events(peer):
            samples[int(event["epoch"])] += int(event["samples"])
    return dict(samples)


def hostile_records_swarm(folder: Path) -> Dict[str, Any]:
    """Run the swarm with the rogue; returns measurements and named checks (``details["checks"]``)."""
    folder = Path(folder)
    checks: Dict[str, bool] = {}
    details: Dict[str, Any] = {"checks": checks, "max_epochs": MAX_EPOCHS}
    with swarm_processes() as procs:
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        aux = start_aux("aux", folder, port)
        procs.append(aux)
        addrs = aux.initial_peers(timeout=STARTUP)
        epochs = ["--max_epochs", str(MAX_EPOCHS)]
        first, second = (start_trainer(folder, name, RUN_ID, initial_peers=addrs, extra=epochs) for name in "ab")
        procs += [first, second]
        # started now, it joins when told to: a CI run's rogue, started only after epoch 1, took until epoch 15 of 18
        go = folder / "rogue.go"
        rogue = start_rogue(folder, addrs, "--start_after", str(go))
        procs.append(rogue)
        wait_for_epoch(first, 1, timeout=STARTUP)
        wait_for_epoch(second, 1, timeout=60)

        go.touch()
        rogue.events.wait("rogue_ready", timeout=STARTUP)
        poisoned_from = max(int(e["epoch"]) for p in (first, second) for e in epoch_done_events(p)) + 1
        details["poisoned_from_epoch"] = poisoned_from
        checks["the rogue started before the swarm finished"] = poisoned_from < MAX_EPOCHS - 4
        joiner = start_trainer(folder, "c", RUN_ID, initial_peers=addrs, extra=epochs)
        procs.append(joiner)

        loaded = joiner.events.wait("state_loaded", timeout=STARTUP, where=lambda e: e["reason"] == "join")
        details["joiner_loaded"] = {k: loaded[k] for k in ("epoch", "source")}
        checks["a joiner downloads the state"] = loaded["source"] == "swarm" and 1 <= int(loaded["epoch"])

        dashboard = [api_state(url)["swarm"]]
        started = time.monotonic()
        exits = wait_all([first, second, joiner], timeout=150)
        details["seconds_to_finish"] = round(time.monotonic() - started, 1)
        details["exit_codes"] = exits
        checks["the trainers reached max_epochs"] = exits == [0, 0, 0]
        checks["the rogue kept misbehaving throughout"] = rogue.poll() is None
        dashboard.append(api_state(url)["swarm"])

        samples = swarm_samples_per_epoch([first, second, joiner])
        poisoned = {e: n for e, n in samples.items() if e >= poisoned_from}
        rushed = {e: n for e, n in poisoned.items() if n < 0.75 * TARGET}
        details["samples_per_poisoned_epoch"] = poisoned
        checks["no poisoned epoch was rushed"] = len(poisoned) >= 4 and len(rushed) <= 1
        # (their download when they joined, before the rogue, is not a re-download; nor is a re-sync after a gradient
        # round the peer missed, which answers its own failed all-reduce, not a record)
        reloads = [
            e
            for p in (first, second)
            for e in p.events.all("state_loaded", where=lambda e: e["reason"] not in ("join", "missed_round"))
        ]
        details["trainer_reloads"] = len(reloads)
        details["trainer_resyncs_after_missed_rounds"] = sum(
            len(p.events.all("state_loaded", where=lambda e: e["reason"] == "missed_round")) for p in (first, second)
        )
        checks["no trainer re-downloaded the state"] = not reloads

        details["dashboard_epochs"] = [s["global_epoch"] for s in dashboard]
        details["dashboard_peers"] = [len(s["peers"]) for s in dashboard]
        checks["the dashboard shows the honest epoch"] = all(
            s["global_epoch"] is not None and s["global_epoch"] <= MAX_EPOCHS for s in dashboard
        )
        checks["the dashboard shows only honest trainers"] = all(len(s["peers"]) <= 3 for s in dashboard)
        refreshes = aux.events.all("state_loaded", where=lambda e: e["reason"] == "refresh")
        details["aux_downloads"] = len(refreshes)
        checks["the aux downloads the state only for its checkpoints"] = len(refreshes) <= MAX_EPOCHS // 2 + 2
    return details


POISONING_CHECKS = (
    "the rogue started before the swarm finished",
    "the trainers reached max_epochs",
    "the rogue kept misbehaving throughout",
    "no poisoned epoch was rushed",
    "no trainer re-downloaded the state",
    "the dashboard shows the honest epoch",
    "the dashboard shows only honest trainers",
    "the aux downloads the state only for its checkpoints",
)
SQUATTING_CHECKS = ("a joiner downloads the state", "the trainers reached max_epochs")


def hostile_records(folder: Path) -> List[Any]:
    """p and q: one ScenarioResult each, from one swarm."""
    from benchmarks.testbed.faults.scenarios import ScenarioResult

    started = time.monotonic()
    details = hostile_records_swarm(folder)
    took = time.monotonic() - started
    results = []
    for name, keys in (
        ("p. signed record poisoning (epoch 1e12, 1e300 samples/s, future time)", POISONING_CHECKS),
        ("q. key squatting (plain values expiring in 10 years)", SQUATTING_CHECKS),
    ):
        ok = all(details["checks"].get(key, False) for key in keys)
        results.append(
            ScenarioResult(
                name,
                survived=ok,
                epochs_lost=0,
                recover_seconds=None,
                data_lost=not details["checks"].get("a joiner downloads the state", False),
                details={**details, "checks": {key: details["checks"].get(key, False) for key in keys}},
                seconds=took / 2,
            )
        )
    return results
