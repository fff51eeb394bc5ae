"""Fault scenarios of the state download from several donors at once, loopback only (127.0.0.1, no root):

- "j" (``donor_killed``): three donors (benchmarks/testbed/state_donor.py, real LeanHive optimizers holding the same
  state) serve a joiner at 0.5 MB/s each; one is killed (its whole process tree) 1.5 s into the download. Its
  unfinished parts must move to the other two and the joiner must end with the donors' state bit for bit.
- "k" (``donor_wrong_part``): two honest donors and a rogue one that serves the first part it is asked for with
  every byte flipped (well formed: the right size) while announcing the honest digests. The joiner must name the
  rogue, exclude it, fetch the part again and end with the honest state.

``tests/swarm/test_state_parts_download.py`` runs both (and the variants) in the default suite.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any, Dict, List

from benchmarks.testbed.processes import PeerProcess, kill_all
from benchmarks.testbed.state_donor import Joiner, parts_from, same_state, start_donors

PARTS = 25  # the donors' ~6.4 MB state in parts of 256 KiB


def _run(folder: Path, run_id: str, specs, during=None) -> Dict[str, Any]:
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    details: Dict[str, Any] = {"error": None}
    peers: List[PeerProcess] = []
    joiner = None
    try:
        peers = start_donors(folder, run_id, specs)
        details["donors"] = {peer.name: peer.peer_id for peer in peers}
        joiner = Joiner(run_id, peers[0].join, folder / "joiner.log")
        timer = threading.Timer(1.5, during, args=(peers,)) if during else None
        if timer:
            timer.start()
        started = time.monotonic()
        details["loaded"] = joiner.optimizer.load_state_checked()
        details["seconds"] = round(time.monotonic() - started, 1)
        if timer:
            timer.join()
        details["same_state"] = same_state(joiner, folder / f"{peers[0].name}.pt")
        details["log"] = joiner.log()[-3000:]
        details["parts"] = parts_from(joiner.log()) if details["loaded"] else {}
    except Exception as e:  # measured, not raised: the table shows it
        details["error"] = f"{type(e).__name__}: {str(e)[-600:]}"
    finally:
        if joiner is not None:
            joiner.close()
        kill_all(peers)
    return details


def donor_killed(folder: Path):
    """j. A donor killed mid-download: its parts move to the others."""
    started = time.monotonic()
    slow = ["--serve_rate", "500000"]
    details = _run(folder, "fault_j", [(name, slow) for name in ("d1", "d2", "d3")], lambda p: p[2].kill_tree())
    killed = details.get("donors", {}).get("d3")
    parts = dict(details.get("parts", {}))
    from_killed = parts.pop(killed, 0)
    moved = bool(parts) and all(n > from_killed for n in parts.values())
    named = killed is not None and f"of the state from {killed}" in details.get("log", "")
    ok = details["error"] is None and details.get("loaded") and details.get("same_state") and moved and named
    details.update(moved=moved, named_killed=named, parts_from_killed=from_killed)
    return _result("j. a donor killed mid-download (3 donors)", ok, details, started)


def donor_wrong_part(folder: Path):
    """k. A donor serving one wrong but well-formed part: found, excluded, the honest state in the end."""
    started = time.monotonic()
    specs = [("d1", []), ("rogue", ["--mode", "wrong_part", "--wrong_part", "-1"]), ("d2", [])]
    details = _run(folder, "fault_k", specs)
    rogue = details.get("donors", {}).get("rogue")
    log = details.get("log", "")
    found = rogue is not None and f"Donor {rogue} served part" in log and "digest differs" in log
    ok = details["error"] is None and details.get("loaded") and details.get("same_state") and found
    details.update(rogue_found=found)
    return _result("k. a donor serving one wrong part (2 honest + 1 rogue)", ok, details, started)


def _result(title: str, ok, details: dict, started: float):
    """A download scenario's row: nothing is lost when the joiner ends with the honest state, in its run time."""
    from benchmarks.testbed.faults.scenarios import ScenarioResult

    return ScenarioResult(
        title,
        survived=bool(ok),
        epochs_lost=0,
        recover_seconds=details.get("seconds"),
        data_lost=not ok,
        details={k: v for k, v in details.items() if k != "log"},
        seconds=time.monotonic() - started,
    )


def donor_faults(folder: Path) -> list:
    return [donor_killed(Path(folder) / "j"), donor_wrong_part(Path(folder) / "k")]
