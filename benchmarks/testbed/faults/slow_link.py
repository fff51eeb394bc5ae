"""u. (``slow_link_state_download``) A joiner downloads a ``small``-preset state (~124M parameters in fp32 plus 8-bit
LAMB statistics) over a 20 Mbit/s, 100 ms RTT link with the default ``load_state_timeout``: the state's size must
not make the download time out, and the joiner must train on from the swarm's state, not from its own.

Registered in ``benchmarks.testbed.faults.scenarios.MATRIX`` (opt-in: root for the emulated link, minutes of transfer).
"""

from __future__ import annotations

import dataclasses
import re
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Dict, Optional, Tuple

from benchmarks.testbed.faults.injection import PARAMS_DIR_ENV
from benchmarks.testbed.faults.swarm import INTERNET, STARTUP, NetemSwarm, SwarmPeer, SwarmSettings
from configs import MODEL_PRESETS_DIR
from peer.swarm.config import CollaborationArguments
from peer.swarm.hivemind_seam.averaging import state_download_seconds

if TYPE_CHECKING:  # scenarios.py imports this module
    from benchmarks.testbed.faults.scenarios import ScenarioResult

DOWNLOADED_RE = re.compile(r"Downloaded the state \(([\d.]+) MB\) from \S+ in ([\d.]+) s")
MIN_DOWNLOAD_SECONDS = 3.0
"""A download faster than this did not cross the 20 Mbit/s link (hundreds of MB take minutes there)."""


def default_load_state_timeout() -> float:
    """The shipped default of --load_state_timeout (what a user who sets nothing gets)."""
    return next(f.default for f in dataclasses.fields(CollaborationArguments) if f.name == "load_state_timeout")


def _download(peer: SwarmPeer) -> Optional[Tuple[float, float]]:
    """(state MB, seconds) of the first state download the peer logged, or None."""
    match = DOWNLOADED_RE.search(peer.log())
    return (float(match.group(1)), float(match.group(2))) if match else None


def slow_link_state_download(folder: Path) -> "ScenarioResult":
    """u. Trainer a starts alone and trains an epoch; trainer b joins over the slow link and must download a's
    state within the default budget (``state_download_seconds``), then train on from it."""
    from benchmarks.testbed.faults.scenarios import ScenarioResult, _all_checks, _check, _stop_all

    started = time.monotonic()
    timeout = default_load_state_timeout()
    # small batches: a 124M-parameter model on a 2-core CPU; an epoch of 4 steps gives the state real statistics
    settings = SwarmSettings(
        run_id="slowlink",
        target_batch_size=8,
        extra=["--model_config", str(MODEL_PRESETS_DIR / "small.json"), "--load_state_timeout", str(timeout)],
    )
    extra = ["--per_device_batch_size", "2"]
    no_dumps = {PARAMS_DIR_ENV: ""}  # no per-epoch copies of 500 MB of parameters
    details: Dict[str, Any] = {"link": INTERNET.describe(), "load_state_timeout": timeout}
    seconds = None
    with NetemSwarm(folder, 2, settings, INTERNET) as swarm:
        a = swarm.start_trainer(0, "a", extra=extra, env=no_dumps)
        b = None
        try:
            join = a.initial_peers(STARTUP)
            a.events.wait("joined", timeout=600)
            a.events.wait("epoch_done", timeout=600)  # it trained: its state has LAMB statistics to send
            b = swarm.start_trainer(1, "b", initial_peers=join, extra=extra, env=no_dumps)
            b.events.wait("joined", timeout=STARTUP + state_download_seconds(10**9, timeout))
        except Exception as error:
            details["error"] = str(error)[-600:]
        peers = [p for p in (a, b) if p is not None]
        _check(
            details,
            "both peers ran until stopped (nothing crashed)",
            len(peers) == 2 and all(p.poll() is None for p in peers),
        )
        codes = _stop_all(peers, timeout=180)
        details["exit_codes"] = codes
        _check(details, "both peers stopped cleanly", codes == [0, 0])
        loaded = [] if b is None else b.events.all("state_loaded", where=lambda e: e["reason"] == "join")
        _check(details, "the joiner loaded the state from the swarm", [e["source"] for e in loaded] == ["swarm"])
        joined = None if b is None else b.events.last("joined")
        _check(
            details,
            "the joiner trained on from the swarm's state, not its own initial one",
            joined is not None
            and joined["state"] == "swarm"
            and "Could not download the swarm's state" not in b.log()
            and "Starting from freshly initialized parameters" not in b.log(),
        )
        download = None if b is None else _download(b)
        if download is not None:
            megabytes, seconds = download
            bound = state_download_seconds(int(megabytes * 1e6), timeout)
            details.update(
                state_mb=megabytes,
                download_seconds=seconds,
                mb_per_second=round(megabytes / seconds, 2) if seconds else None,
                bound_seconds=round(bound, 1),
            )
            _check(
                details,
                f"the download took over {MIN_DOWNLOAD_SECONDS:g} s (it crossed the slow link)",
                seconds > MIN_DOWNLOAD_SECONDS,
            )
            _check(
                details,
                "the download finished within state_download_seconds(state, load_state_timeout)",
                seconds <= bound,
            )
        else:
            _check(details, "the joiner logged its state download", False)
    return ScenarioResult(
        "u. small-preset state over 20 Mbit/s (default load_state_timeout)",
        survived=_all_checks(details),
        epochs_lost=0,
        recover_seconds=seconds,
        data_lost=False,
        details=details,
        seconds=time.monotonic() - started,
    )
