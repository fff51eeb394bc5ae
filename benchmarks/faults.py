"""The fault matrix as a table: every scenario in benchmarks/testbed/faults/scenarios.py, real peers.

Run from the repository root (the test-bed ``benchmarks.testbed`` is imported as a package from there):

    sudo .venv/bin/python -m benchmarks.faults                 # the whole matrix (needs root for emulated links)
    .venv/bin/python -m benchmarks.faults --only g,h,i         # the fast subset (loopback, no root)
    .venv/bin/python -m benchmarks.faults --json results.json  # also write the records

Prints a markdown table: scenario, survived, epochs lost, time to recover, data lost, wall time.
Scenarios on emulated links are listed as skipped where network namespaces are unavailable.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import signal
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.testbed.faults.scenarios import MATRIX, ScenarioResult
from benchmarks.testbed.netem.hosts import netns_unavailable_reason


@contextlib.contextmanager
def stderr_to(path: Path):
    """The in-process scenarios log the damage they were built to cause (corrupt files, refused records):
    that goes to a file next to the peers' logs, so the console shows only progress and the table."""
    path.parent.mkdir(parents=True, exist_ok=True)
    sys.stderr.flush()
    saved = os.dup(2)
    with open(path, "ab") as log:
        os.dup2(log.fileno(), 2)
    try:
        yield
    finally:
        sys.stderr.flush()
        os.dup2(saved, 2)
        os.close(saved)


def run(only: set, folder: Path, progress) -> list:
    netns_problem = None
    results = []
    for scenario in MATRIX:
        if only and not (set(scenario.keys) & only or scenario.name in only):
            continue
        if scenario.needs_netns:
            netns_problem = netns_problem or netns_unavailable_reason() or ""
            if netns_problem:
                results.append(
                    ScenarioResult(
                        f"{scenario.keys}. {scenario.name}",
                        survived=False,
                        epochs_lost=0,
                        recover_seconds=None,
                        data_lost=False,
                        skipped=netns_problem,
                    )
                )
                continue
        started = time.monotonic()
        try:
            with stderr_to(folder / scenario.keys / "scenario.log"):
                produced = scenario.run(folder / scenario.keys)
        except Exception as e:  # a scenario that crashes is a row that did not survive, not a lost table
            logging.exception("scenario %s crashed", scenario.keys)
            produced = ScenarioResult(
                f"{scenario.keys}. crashed: {e!r}"[:120],
                survived=False,
                epochs_lost=0,
                recover_seconds=None,
                data_lost=False,
                seconds=time.monotonic() - started,
            )
        results += produced if isinstance(produced, list) else [produced]
        print(
            f"  {results[-1].scenario}: {'survived' if results[-1].survived else 'FAILED'} "
            f"({time.monotonic() - started:.0f} s)",
            file=progress,
            flush=True,
        )
    return results


def table(results: list) -> str:
    rows = [
        "| scenario | survived | epochs lost | time to recover | data lost | wall time |",
        "|---|---|---|---|---|---|",
    ]
    for r in results:
        if r.skipped:
            rows.append(f"| {r.scenario} | skipped: {r.skipped} | | | | |")
            continue
        recover = "—" if r.recover_seconds is None else f"{r.recover_seconds:.1f} s"
        rows.append(
            f"| {r.scenario} | {'yes' if r.survived else '**no**'} | {r.epochs_lost} | {recover} | "
            f"{'**yes**' if r.data_lost else 'none'} | {r.seconds:.0f} s |"
        )
    return "\n".join(rows)


def _interrupt(_signum, _frame):
    raise KeyboardInterrupt


def main() -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.faults", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--only",
        default="",
        help="comma-separated scenario letters or names, e.g. g,h,i or bad_dht_records (default: all)",
    )
    parser.add_argument("--json", metavar="PATH", help="also write every result record (with details) here")
    parser.add_argument("--keep", metavar="DIR", help="keep peers' logs and files in this folder")
    args = parser.parse_args()
    # SIGTERM unwinds like Ctrl-C, so the scenarios' cleanup removes their peers and network namespaces
    signal.signal(signal.SIGTERM, _interrupt)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s [%(name)s] %(message)s")
    only = {letter.strip() for letter in args.only.split(",") if letter.strip()}
    folder = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="leanhive-faults-"))
    started = time.monotonic()
    progress = os.fdopen(os.dup(2), "w")  # the real console, while stderr goes to the scenario's log
    try:
        results = run(only, folder, progress)
    except KeyboardInterrupt:
        print(f"interrupted; peers stopped, test hosts removed; logs in {folder}", file=progress)
        return 130
    print(table(results))
    print(f"\nwhole run: {time.monotonic() - started:.0f} s; peers' logs in {folder}")
    if args.json:
        Path(args.json).write_text(json.dumps([r.as_dict() for r in results], indent=1, default=str))
    return 0 if all((r.survived and not r.data_lost) or r.skipped for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
