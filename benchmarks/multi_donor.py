"""Join time over home uplinks: one joiner takes the state from 1, 2 and 3 donors at once (--max_donors).

    sudo .venv/bin/python -m benchmarks.multi_donor [--width 16384] [--uplink_mbit 10] [--json FILE]

A network-namespace testbed (benchmarks/testbed/netem): three donors (benchmarks/testbed/state_donor.py, real
LeanHive optimizers holding the same state) behind ``--uplink_mbit`` links (tbf, both directions) and a joiner
behind ``--downlink_mbit``. The joiner (this module with ``--joiner``, in its own namespace) downloads the state
once per donor count, with ``--max_donors`` 1, 2, 3, and reports the seconds of the download (from the request to
the verified state applied), the parts and bytes each donor sent, and whether it holds the donors' state bit for bit.
The table prints each time as a ratio to the single-donor time (the target: 3 donors <= 0.4x).

The state's size is set by ``--width`` (the donors' model: Linear(128, W), Linear(W, 128); W=16384 gives 25.6 MB).
A download over a link is its bytes over the link's rate, so the ratios carry over to any state size (the
``small`` preset's 747 MB takes ~29x as long at every donor count); the request overhead (manifests, a round trip
per 4 MiB part) is what a smaller state overstates, if anything. ``--preset small`` measures the ``small`` preset's own
state instead (LeanHive's model; about 20 minutes and 21 GB of RAM for the three donors and the joiner).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import List

from benchmarks.docs import parse_markdown_tables, run_json
from benchmarks.report import markdown_table

MEASURED = Path(__file__).resolve().parent / "measured" / "multi_donor.json"
SMALL_STATE_BYTES = 746.7e6
"""The ``small`` preset's state (fault scenario u)."""
SCALED_PART_BYTES = 146 << 10
"""Parts of the default width's 25.4 MB state when it is cut into as many parts as ``small``'s 747 MB is in the
default 4 MiB parts (178): the same granularity, so the last-part effects scale with the state."""


def _joiner(args) -> int:
    """In the joiner's namespace: download once, print one JSON line."""
    import logging

    import hivemind
    import torch
    from hivemind.utils.crypto import RSAPrivateKey

    from benchmarks.testbed.processes import share_tensors_by_file_descriptor
    from benchmarks.testbed.state_donor import make_model, make_optimizer
    from peer.swarm.network import make_validators

    share_tensors_by_file_descriptor()
    seam = logging.getLogger("peer.swarm.hivemind_seam.averaging")
    handler = logging.FileHandler(args.log)
    seam.addHandler(handler)
    seam.setLevel(logging.INFO)
    key = RSAPrivateKey()
    dht = hivemind.DHT(
        start=True,
        initial_peers=args.initial_peers,
        host_maddrs=[f"/ip4/{args.host}/tcp/0"],
        record_validators=make_validators(args.run_id, key)[0],
    )
    optimizer = make_optimizer(
        make_model(2, width=args.width, preset=args.preset),
        dht,
        args.run_id,
        key,
        max_donors=args.max_donors,
        load_state_attempts=1,
    )
    optimizer.state_averager.allow_state_sharing = False
    started = time.monotonic()
    ok = optimizer.load_state_checked()
    seconds = time.monotonic() - started
    _, tensors, _ = optimizer.state_averager.get_current_state()
    served = torch.load(args.reference, weights_only=True)
    same = len(served) == len(tensors) and all(torch.equal(a, b) for a, b in zip(served, tensors))
    print(json.dumps({"ok": ok, "seconds": seconds, "same_state": same}), flush=True)
    optimizer.shutdown()
    dht.shutdown()
    return 0


def measure(args) -> List[dict]:
    from benchmarks.testbed.netem.hosts import Testbed
    from benchmarks.testbed.state_donor import download_shares

    if args.preset:
        # glibc keeps the freed copies a peer makes of a large state (the host process's answer, the flattened
        # snapshot) mapped; three `small` donors and a joiner then overrun 24 GiB. Returned at once, they fit.
        os.environ.setdefault("MALLOC_ARENA_MAX", "2")
        os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", str(1 << 20))
    folder = Path(args.folder or tempfile.mkdtemp(prefix="multi_donor_"))
    folder.mkdir(parents=True, exist_ok=True)
    rows = []
    with Testbed(4) as testbed:
        joiner_host, *donor_hosts = testbed.hosts
        testbed.set_bandwidth(joiner_host, args.downlink_mbit)
        for host in donor_hosts:
            testbed.set_bandwidth(host, args.uplink_mbit)
        donors, join = [], []
        for index, host in enumerate(donor_hosts):
            ready = folder / f"d{index}.ready"
            extra = ["--initial_peers", *join] if join else []
            log = open(folder / f"d{index}.log", "wb")
            donors.append(
                host.python(
                    "-m",
                    "benchmarks.testbed.state_donor",
                    "--run_id",
                    "multi_donor",
                    "--ready",
                    str(ready),
                    "--width",
                    str(args.width),
                    *(["--preset", args.preset] if args.preset else []),
                    "--host",
                    host.ip,
                    # the reference the joiner compares with (one copy: they all hold the same state)
                    *(["--state_out", str(folder / "d0.pt")] if index == 0 else []),
                    "--max_joiners",
                    "2",
                    "--part_bytes",
                    str(args.part_bytes),
                    *extra,
                    stdout=log,
                    stderr=log,
                )  # fmt: skip
            )
            deadline = time.monotonic() + 300
            while not ready.exists():
                if time.monotonic() > deadline or donors[-1].poll() is not None:
                    raise RuntimeError(f"donor {index} did not start: see {folder / f'd{index}.log'}")
                time.sleep(0.5)
            join = join or json.loads(ready.read_text())["initial_peers"]
        for count in (1, 2, 3):
            log_path = folder / f"joiner_{count}.log"
            process = joiner_host.python(
                "-m", "benchmarks.multi_donor", "--joiner", "--max_donors", str(count), "--width", str(args.width),
                *(["--preset", args.preset] if args.preset else []),
                "--host", joiner_host.ip, "--run_id", "multi_donor", "--log", str(log_path),
                "--reference", str(folder / "d0.pt"), "--initial_peers", *join,
                stdout=__import__("subprocess").PIPE, text=True,
            )  # fmt: skip
            out, _ = process.communicate(timeout=args.timeout)
            result = json.loads([line for line in out.splitlines() if line.startswith("{")][-1])
            parts = download_shares(log_path.read_text())
            rows.append(
                dict(
                    donors=count,
                    seconds=round(result["seconds"], 1),
                    ok=result["ok"] and result["same_state"],
                    megabytes=round(sum(mb for _, mb in parts.values()), 1),
                    parts_per_donor=sorted((n for n, _ in parts.values()), reverse=True),
                )
            )
            print(f"{count} donor(s): {rows[-1]}", flush=True)
            time.sleep(JOINER_IDLE_PAUSE)  # the donors forget this joiner before the next one asks
        for process in donors:
            process.kill()
    return rows


JOINER_IDLE_PAUSE = 2.0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--width", type=int, default=16384)
    parser.add_argument(
        "--preset",
        default=None,
        help="donors hold LeanHive's model of this preset (e.g. small; --width is then unused). Give --part_bytes "
        "4194304 for the default partition and a --timeout of the single-donor download (small: ~700 s at 10 Mbit/s)",
    )
    parser.add_argument("--uplink_mbit", type=float, default=10.0)
    parser.add_argument(
        "--part_bytes",
        type=int,
        default=SCALED_PART_BYTES,
        help="the donors' part size (default: as many parts as the small preset's state has in 4 MiB parts)",
    )
    parser.add_argument("--downlink_mbit", type=float, default=50.0)
    parser.add_argument("--timeout", type=float, default=300.0)
    parser.add_argument("--folder", default=None)
    parser.add_argument(
        "--json", default=None, help="where the run is recorded (default: measured/multi_donor[_<preset>].json)"
    )
    # the joiner's own process (started by measure() in its namespace)
    parser.add_argument("--joiner", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--max_donors", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--host", default="127.0.0.1", help=argparse.SUPPRESS)
    parser.add_argument("--run_id", default="multi_donor", help=argparse.SUPPRESS)
    parser.add_argument("--log", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--reference", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--initial_peers", nargs="*", default=[], help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.joiner:
        return _joiner(args)
    rows = measure(args)
    single = rows[0]["seconds"]
    table_rows = []
    for r in rows:
        per_donor = " / ".join(map(str, r["parts_per_donor"]))
        ratio = r["seconds"] / single
        table_rows.append(
            [
                str(r["donors"]),
                f"{r['seconds']:.1f}",
                f"{ratio:.2f}",
                f"{r['megabytes']:.1f}",
                per_donor,
                "yes" if r["ok"] else "NO",
            ]
        )
    columns = ["donors", "join s", "x 1 donor", "MB received", "parts per donor", "identical state"]
    table = markdown_table(columns, table_rows)
    print(table)
    command = "sudo .venv/bin/python -m benchmarks.multi_donor " + " ".join(sys.argv[1:] if argv is None else argv)
    state_mb = rows[0]["megabytes"]
    record = {
        "command": command.strip(),
        "date": time.strftime("%Y-%m-%d"),
        "machine": "2 shared CPU cores, network namespaces, tbf",
        "setup": dict(
            width=args.width,
            preset=args.preset,
            part_bytes=args.part_bytes,
            state_mb=state_mb,
            uplink_mbit=args.uplink_mbit,
            downlink_mbit=args.downlink_mbit,
        ),
        # as ``python -m benchmarks.docs --record`` stores a printed table (numbers as numbers, with their format)
        "tables": {"main": parse_markdown_tables(table)[0]},
        "rows": rows,
    }
    default = MEASURED.with_name(f"multi_donor_{args.preset}.json") if args.preset else MEASURED
    Path(args.json or default).write_text(run_json(record))
    return 0


if __name__ == "__main__":
    sys.exit(main())
