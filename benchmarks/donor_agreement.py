"""Do training peers hold the same state bit for bit? What a joiner needs to take parts from several donors.

Runs ``--trainers`` real trainers of the tiny preset (sync mode, default flags plus ``--trainer_args``) on
127.0.0.1 for ``--epochs`` global epochs, ``--runs`` times. Each trainer saves its parameters after every global
epoch; the table gives, per run, the first epoch from which every pair held equal parameters for the rest of the
run (if any), the epoch of the first difference, and the largest difference between any two trainers at the last
epoch they all saved. Only the parameters are compared (LAMB's statistics are not averaged, so parameters that
differ after a step are the first sign of statistics that differ).

    python -m benchmarks.donor_agreement [--runs 5] [--epochs 30] [--trainers 3] [--json out.json]
        [--trainer_args "--missed_round_resync_mb 64"]
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import tempfile
from pathlib import Path
from typing import Dict, List, Optional

from benchmarks.testbed.processes import kill_all, wait_all
from benchmarks.testbed.trainers import param_dump_env, round_param_differences, start_trainer

STARTUP = 120  # seconds for the first trainer to print its address on a loaded machine


def equal_from(differences: Dict[int, float]) -> Optional[int]:
    """The first epoch from which every later saved epoch was equal on all trainers; None if the last was not."""
    first = None
    for epoch in sorted(differences, reverse=True):
        if differences[epoch] != 0.0:
            break
        first = epoch
    return first


def run_once(folder: Path, trainers: int, epochs: int, trainer_args: List[str]) -> dict:
    names = [chr(ord("a") + index) for index in range(trainers)]
    peers = []
    try:
        extra = ["--max_epochs", str(epochs), *trainer_args]
        first = start_trainer(
            folder,
            names[0],
            "agreement",
            extra=[*extra, "--min_peers", str(trainers)],
            env=param_dump_env(folder, names[0]),
        )
        peers.append(first)
        initial_peers = first.initial_peers(STARTUP)
        for name in names[1:]:
            peers.append(
                start_trainer(
                    folder,
                    name,
                    "agreement",
                    initial_peers=initial_peers,
                    extra=extra,
                    env=param_dump_env(folder, name),
                )
            )
        codes = wait_all(peers, timeout=60 + 20 * epochs)
    finally:
        kill_all(peers)
    differences = round_param_differences(folder, names, all_pairs=True)
    unequal = [epoch for epoch, difference in differences.items() if difference != 0.0]
    last = max(differences) if differences else None
    return {
        "exit_codes": codes,
        "epochs_compared": len(differences),
        "first_difference": min(unequal) if unequal else None,
        "equal_from": equal_from(differences),
        "last_epoch": last,
        "difference_at_last": differences[last] if last is not None else None,
        "differences": {str(epoch): value for epoch, value in differences.items()},
    }


def table(results: List[dict]) -> str:
    lines = [
        "| run | exit codes | epochs compared | first difference | equal from epoch "
        "| largest difference at the last epoch |",
        "|---|---|---|---|---|---|",
    ]
    for index, result in enumerate(results, 1):
        last = result["difference_at_last"]
        at_last = "— (no epoch saved by all)" if last is None else f"{last:.3g} (epoch {result['last_epoch']})"
        equal_from = result["equal_from"] if result["equal_from"] is not None else "never"
        first = result["first_difference"] if result["first_difference"] is not None else "—"
        lines.append(
            f"| {index} | {result['exit_codes']} | {result['epochs_compared']} | {first} | {equal_from} | {at_last} |"
        )
    equal = sum(result["equal_from"] is not None for result in results)
    lines.append(f"\n{equal} of {len(results)} runs ended with every trainer's parameters equal bit for bit.")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=5, help="independent swarms, one after the other")
    parser.add_argument("--epochs", type=int, default=30, help="global epochs each swarm trains")
    parser.add_argument("--trainers", type=int, default=3, help="trainers per swarm (at least 2)")
    parser.add_argument("--trainer_args", default="", help="extra trainer flags, one shell-quoted string")
    parser.add_argument("--folder", type=Path, help="where the peers' logs and parameters go (default: a temp dir)")
    parser.add_argument("--json", type=Path, help="write the results here too")
    args = parser.parse_args(argv)
    if args.runs < 1 or args.epochs < 2 or args.trainers < 2:
        parser.error("--runs must be at least 1, --epochs at least 2 and --trainers at least 2")
    root = args.folder or Path(tempfile.mkdtemp(prefix="donor_agreement_"))
    results = []
    for index in range(args.runs):
        folder = root / f"run{index + 1}"
        folder.mkdir(parents=True, exist_ok=True)
        print(f"run {index + 1} of {args.runs}: {args.trainers} trainers, {args.epochs} epochs in {folder}", flush=True)
        result = run_once(folder, args.trainers, args.epochs, shlex.split(args.trainer_args))
        print(
            f"  exit codes {result['exit_codes']}, largest difference at the last epoch {result['difference_at_last']}",
            flush=True,
        )
        results.append(result)
    print(table(results))
    if args.json:
        args.json.write_text(
            json.dumps({"args": vars(args) | {"folder": str(root), "json": str(args.json)}, "runs": results}, indent=1)
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
