"""Is the swarm worth joining? Collaboration efficiency of real trainer swarms over emulated home links (issue 12).

Run from the repository root, as root (each peer gets its own network namespace)::

    python -m benchmarks.swarm                      # home, broadband x 4 modes (about 27 minutes on 2 cores)
    python -m benchmarks.swarm --quick              # tiny model, solo + sync on broadband: a minute or two
    python -m benchmarks.swarm --links home --modes solo,sync,sync+overlap --json rows.json --plot swarm.png

One invocation runs ``solo`` first (the compute reference, measured in the same run), then every mode on every
link, and prints a markdown table: useful samples/s of the swarm, efficiency = swarm samples/s / (N x solo
samples/s) and the same at equal compute speed (compute share / solo's, what carries over to peers that do not
share cores), bytes sent + received per peer per sample (from the namespace interfaces' counters) next to the
butterfly all-reduce lower bound of the gradients at the wire format, a per-epoch time breakdown and the
validation loss; then the validation loss at equal samples (a curve), each mode against ``sync`` and each row's
upload against its link (the mean and the peak over about a second). See
``benchmarks/swarm_lib.py`` for how each figure is measured.

Equal samples: every row trains ``--epochs x --target_batch_size`` samples. The ``local_x<k>`` modes
(``--sync_mode local``) all-reduce once per round of k x ``--target_batch_size`` samples, so they run k times fewer
global epochs, with the learning-rate schedule scaled to the same samples. Every row is measured over the same
samples: from the end of the largest round of the matrix (startup, joining and every mode's first round left out)
to the end, so ``--epochs`` must be a multiple of the largest k and at least twice it.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import math
import os
import platform
import re
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

from benchmarks.report import markdown_table
from benchmarks.swarm_lib import (
    BREAKDOWN,
    LINKS,
    MODES,
    SPARSE_ROUNDS,
    Row,
    RunSettings,
    final_params,
    loss_at,
    measure,
    params_every,
    run_swarm,
    validation_curve,
    validation_loss,
    wire_bytes_of,
)
from peer.swarm.config import CollaborationArguments

logger = logging.getLogger("benchmarks.swarm")

# lan (1 Gbit/s) is one flag away; the default matrix stays within 30 minutes on 2 cores
DEFAULT_LINKS = ("home", "broadband")
# sync+overlap+rare_state is what the internet run presets (configs/run/*_internet.yaml) use
DEFAULT_MODES = ("solo", "sync", "sync+overlap", "sync+overlap+rare_state")
# --quick: the tiny model, so that peers start, join, average and exit in well under a minute each. An epoch is a
# few seconds for two peers: with 64 samples (under a second) the peers' start-up skew under load (a state download
# each, ~1-2 s) let the first peer end two epochs alone and the second chase it to max_epochs and leave
QUICK = dict(
    links=("broadband",),
    # local_sparse_x1: one round per sync epoch, H = 512 / (2 x 8) = 32 local steps, sparse all-gather
    modes=("solo", "sync", "local_sparse_x1"),
    model_config="tiny",
    epochs=3,
    target_batch_size=512,
    per_device_batch_size=8,
    max_sequence_length=64,
    matchmaking_time=2.0,
    averaging_timeout=20.0,
    compression_threshold=4096,
)


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.swarm",
        description=__doc__.split("\n\n")[0] + " Needs root (network namespaces) and iproute2.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Links: "
        + "; ".join(f"{name} = {link.describe()}" for name, link in LINKS.items())
        + ". Modes: "
        + "; ".join(f"{name} = {' '.join(flags) or 'defaults'}" for name, flags in MODES.items())
        + " (local_x<k>: rounds of k x --target_batch_size samples, H = local steps per peer per round = round / "
        "(peers x per_device_batch_size x gradient_accumulation_steps)).\n\n"
        + next(part for part in __doc__.split("\n\n") if part.startswith("Equal samples")),
    )
    parser.add_argument("--quick", action="store_true", help="reduced matrix for tests: " + json.dumps(QUICK))
    parser.add_argument("--links", help=f"comma-separated link presets (default: {','.join(DEFAULT_LINKS)})")
    parser.add_argument(
        "--modes",
        help=f"comma-separated modes, solo (the efficiency reference) first (default: {','.join(DEFAULT_MODES)})",
    )
    parser.add_argument("--peers", type=int, choices=(2, 3), default=2, help="trainers per swarm (3: oversubscribed)")
    parser.add_argument("--model_config", help="model preset or JSON file for every peer (default: bench)")
    parser.add_argument(
        "--epochs",
        type=int,
        help="every row trains epochs x target_batch_size samples (local_x<k>: epochs / k rounds); the first largest "
        "round is not measured (default: 4)",
    )
    parser.add_argument("--target_batch_size", type=int, help="samples per global epoch of sync (default: 128)")
    parser.add_argument(
        "--per_device_batch_size",
        type=int,
        help="samples per micro-batch (default: 4)",
    )
    parser.add_argument(
        "--gradient_accumulation_steps",
        type=int,
        help="micro-batches per local step, every row (local mode's inner LAMB steps once per local step; default: 1)",
    )
    parser.add_argument("--max_sequence_length", type=int, help="tokens per sample (default: 128)")
    parser.add_argument("--matchmaking_time", type=float, help="seconds (default: 5)")
    parser.add_argument("--averaging_timeout", type=float, help="seconds (default: 60)")
    parser.add_argument("--compression_threshold", type=int, help="smaller tensors go in fp16 (default: 65536)")
    parser.add_argument("--run_timeout", type=float, default=900.0, help="seconds one run may take (default: 900)")
    parser.add_argument("--eval_batches", type=int, default=8, help="validation batches of 8 blocks (default: 8)")
    parser.add_argument("--json", type=Path, help="write the rows here (rewritten after every run)")
    parser.add_argument(
        "--plot",
        type=Path,
        default=Path("benchmarks/results/swarm.png"),
        help="PNG: loss vs samples and vs time, efficiency, bytes per sample (default: %(default)s)",
    )
    parser.add_argument("--from_json", type=Path, help="run nothing: print the table (and plot) of saved --json rows")
    parser.add_argument(
        "--from_record",
        type=record_list,
        default=[],
        help="run nothing: comma-separated recorded runs (benchmarks/measured/*.json) whose rows come first, read "
        "back from their tables (with --from_json: a new row next to recorded ones, e.g. in one --pareto); "
        "PATH@DENSITY gives the top-k density its local sparse rows ran at, which the figure labels "
        "(e.g. swarm_bench_model.json@0.02)",
    )
    parser.add_argument(
        "--measure_from",
        type=int,
        help="samples after which every row is measured (default: the largest round of --modes); give the whole "
        "matrix's largest round when its rows run in separate invocations, so that they share one window",
    )
    parser.add_argument(
        "--pareto",
        type=Path,
        help="PNG: validation loss against bytes per peer per trained sample, one point per row (with --from_json too)",
    )
    parser.add_argument("--folder", type=Path, help="where the peers' logs, events and timings go (default: temp)")
    args = parser.parse_args(argv)
    for key, value in (QUICK if args.quick else {}).items():
        if key in ("links", "modes"):
            value = ",".join(value)
        if getattr(args, key) is None:
            setattr(args, key, value)
    args.links = (args.links or ",".join(DEFAULT_LINKS)).split(",")
    args.modes = (args.modes or ",".join(DEFAULT_MODES)).split(",")
    for name in args.links:
        if name not in LINKS:
            parser.error(f"unknown link {name!r}; choose from {', '.join(LINKS)}")
    for name in args.modes:
        if name not in MODES:
            parser.error(f"unknown mode {name!r}; choose from {', '.join(MODES)}")
    replay = args.from_json or args.from_record
    if "solo" not in args.modes and not replay:
        logger.warning("No solo row in --modes: efficiency is not computed (compute share, bytes and loss are)")
    problem = settings_from(args).check(args.modes)
    if problem and not replay:
        parser.error(problem)
    if args.measure_from is not None and not replay:
        settings = settings_from(args)
        uneven = [m for m in args.modes if args.measure_from % settings.round_size(m)]
        if uneven or not 0 < args.measure_from < settings.total_samples:
            parser.error(
                f"--measure_from must be below the {settings.total_samples} samples of a row and a multiple of every "
                f"mode's round (not of {', '.join(uneven) or 'any'}); e.g. the largest round of the whole matrix"
            )
    return args


def settings_from(args: argparse.Namespace) -> RunSettings:
    settings = RunSettings(peers=args.peers)
    for key in (
        "model_config",
        "epochs",
        "target_batch_size",
        "per_device_batch_size",
        "gradient_accumulation_steps",
        "max_sequence_length",
        "matchmaking_time",
        "averaging_timeout",
        "compression_threshold",
    ):
        value = getattr(args, key, None)
        if value is not None:
            setattr(settings, key, value)
    return settings


def gradient_sizes(model_config: str) -> List[int]:
    """Element counts of the averaged gradients (every trainable parameter)."""
    import torch

    from model import LeanGPTForCausalLM, load_config

    with torch.device("meta"):
        model = LeanGPTForCausalLM(load_config(model_config))
    return [p.numel() for p in model.parameters() if p.requires_grad]


# ----------------------------------------------------------------------------------------------- table


BREAKDOWN_COLUMNS = ("compute", "blocked", "matchmaking", "grad all-reduce", "state avg", "opt step", "downloads")
"""The main table's column of each ``BREAKDOWN`` entry (in its order): printed by ``table``, read back from records."""


def _fmt(value: float, digits: int = 2) -> str:
    return "—" if value is None or (isinstance(value, float) and not math.isfinite(value)) else f"{value:.{digits}f}"


def equal_speed_efficiency(row: Row, rows: Sequence[Row]) -> float:
    """The row's compute share ÷ the solo row's: its efficiency if every peer computed at the same speed alone and in
    the swarm, as peers on separate GPUs do (useful samples/s = compute speed x compute share). On this 2-core machine
    the measured efficiency does not say it: solo peers compute all the time and slow each other down, while a swarm
    peer that waits for the network lends its core to the other, whose steps get faster (efficiency > 1)."""
    solo = next((r for r in rows if r.mode == "solo"), None)
    return row.compute_share / solo.compute_share if solo is not None and solo.compute_share > 0 else math.nan


def table(rows: Sequence[Row]) -> str:
    header = ["link", "mode", "peers", "round", "H", "samples", "samples/s", "efficiency", "eff. equal speed"]
    header += ["compute share"]
    header += ["KB/sample/peer", "bound KB"]
    header += ["× bound", "s/epoch", *BREAKDOWN_COLUMNS, "val loss"]
    lines = [
        [
            row.link,
            row.mode + (" (oversubscribed)" if row.peers > 2 else ""),
            str(row.peers),
            str(row.round_samples or "—"),
            _fmt(row.local_steps, 0),
            _fmt(row.samples_trained, 0),
            _fmt(row.samples_per_second),
            _fmt(row.efficiency),
            _fmt(equal_speed_efficiency(row, rows)),
            _fmt(row.compute_share),
            _fmt(row.bytes_per_sample / 1e3, 1),
            _fmt(row.bound_bytes_per_sample / 1e3, 1),
            _fmt(row.bytes_over_bound),
            _fmt(row.seconds_per_epoch, 1),
            *(_fmt(row.breakdown.get(kind, math.nan), 1) for kind in BREAKDOWN),
            _fmt(row.validation_loss, 3) + (f" ({row.error})" if row.error else ""),
        ]
        for row in rows
    ]
    return markdown_table(header, lines)


def curve_table(rows: Sequence[Row]) -> str:
    """Validation loss at the nominal sample counts (epochs x round size; the points every row has in common are
    the ends of the largest round), with the samples actually trained by then (k = 1000)."""
    points = sorted({int(p["samples"]) for row in rows for p in row.val_curve})
    if not points:
        return ""
    lines = []
    for row in rows:
        trained = dict(zip((int(p["samples"]) for p in row.val_curve), row.validation_points()))
        cells = [f"{_fmt(trained[n][1], 3)} ({trained[n][0] / 1e3:.1f}k)" if n in trained else "—" for n in points]
        lines.append([row.link, row.mode, *cells])
    return markdown_table(["link", "mode", *(f"@ {n}" for n in points)], lines)


def against_sync(rows: Sequence[Row]) -> str:
    """Each mode against ``sync`` on the same link: the issue-13 targets (bytes ≥ 20x lower, validation loss within
    3 % at equal samples, efficiency ≥ 0.9; see ``equal_speed_efficiency``). The sync loss is read off its
    validation curve at the samples the row actually trained (epochs overshoot their target by the steps in flight,
    sync's short ones the most); "sync's end" is the sync run's final loss (the same nominal samples: epochs x
    target)."""
    syncs = {row.link: row for row in rows if row.mode == "sync"}
    lines = []
    for row in rows:
        if row.link not in syncs or row.mode in ("solo", "sync"):
            continue
        sync = syncs[row.link]
        reference = loss_at(sync.validation_points(), row.samples_trained)
        lines.append(
            [
                row.link,
                row.mode,
                _fmt(row.local_steps, 0),
                _fmt(sync.bytes_per_sample / row.bytes_per_sample, 1),
                f"{row.samples_trained:.0f}",
                _fmt(row.validation_loss, 3),
                _fmt(reference, 3),
                _fmt(100.0 * (row.validation_loss / reference - 1.0), 1),
                _fmt(100.0 * (row.validation_loss / sync.validation_loss - 1.0), 1),
                _fmt(row.efficiency),
                _fmt(equal_speed_efficiency(row, rows)),
                _fmt(row.compute_share),
            ]
        )
    header = ["link", "mode", "H", "sync bytes ÷ bytes", "samples trained", "val loss", "sync val loss there"]
    header += ["vs sync there (%)", "vs sync's end (%)", "efficiency", "eff. equal speed", "compute share"]
    return markdown_table(header, lines) if lines else ""


def uplink_table(rows: Sequence[Row]) -> str:
    """Each row's upload against its link: the mean over the window and the peak over about a second. A round sent
    at once runs at the link's rate however few bytes it has; fragments streamed through the round (Streaming
    DiLoCo, issue 28) would lower the peak toward the mean. Rows measured before the counters split tx from rx
    have no entry."""
    lines = [
        [
            row.link,
            row.mode,
            _fmt(row.local_steps, 0),
            _fmt(row.mean_upload_mbit, 2),
            _fmt(row.peak_upload_mbit, 2),
            _fmt(row.peak_upload_mbit / row.mean_upload_mbit, 1) if row.mean_upload_mbit > 0 else "—",
            _fmt(row.breakdown.get("blocked", math.nan), 1),
            _fmt(row.seconds_per_epoch, 1),
        ]
        for row in rows
        if math.isfinite(row.peak_upload_mbit)
    ]
    header = ["link", "mode", "H", "mean up (Mbit/s)", "peak up (Mbit/s, ~1 s)", "peak ÷ mean", "blocked"]
    header += ["s/epoch"]
    return markdown_table(header, lines) if lines else ""


def write_plot(rows: Sequence[Row], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(13, 9))
    for row in rows:
        if not row.curve:
            continue
        label = f"{row.link}/{row.mode}"
        (line,) = axes[0][0].plot(
            [c["samples"] for c in row.curve], [c["loss"] for c in row.curve], marker=".", lw=0.8, label=label
        )
        if row.val_curve:
            axes[0][0].plot(
                [x for x, _ in row.validation_points()],
                [y for _, y in row.validation_points()],
                marker="s",
                ls="--",
                color=line.get_color(),
                label=f"{label} (validation)",
            )
        axes[0][1].plot([c["seconds"] for c in row.curve], [c["loss"] for c in row.curve], marker="o", label=label)
    axes[0][0].set(xlabel="samples (swarm)", ylabel="loss", title="training (dots) and validation (squares) loss")
    axes[0][1].set(xlabel="seconds since start", ylabel="training loss", title="loss vs wall time")
    measured = [r for r in rows if r.mode != "solo" and math.isfinite(r.efficiency)]
    names = [f"{r.link}\n{r.mode}" for r in measured]
    positions = range(len(measured))
    bars = [
        ("efficiency", [r.efficiency for r in measured]),
        ("efficiency at equal compute speed", [equal_speed_efficiency(r, rows) for r in measured]),
        ("compute share", [r.compute_share for r in measured]),
    ]
    for offset, (label, values) in zip((-0.27, 0.0, 0.27), bars):
        axes[1][0].bar([p + offset for p in positions], values, width=0.27, label=label)
    axes[1][0].set_xticks(list(positions), names)
    axes[1][0].axhline(1.0, color="grey", lw=0.8)
    axes[1][0].axhline(0.85, color="tab:red", lw=0.8, ls="--", label="target at broadband (0.85)")
    axes[1][0].axhline(0.9, color="tab:green", lw=0.8, ls=":", label="local-mode target at home (0.9)")
    axes[1][0].set(ylabel="fraction", title="efficiency (swarm ÷ N × solo), at equal compute speed, compute share")
    axes[1][1].bar(names, [r.bytes_per_sample / 1e3 for r in measured], color="tab:orange", label="measured")
    axes[1][1].scatter(names, [r.bound_bytes_per_sample / 1e3 for r in measured], color="k", zorder=3, label="bound")
    axes[1][1].set(ylabel="KB per sample per peer", title="bytes on the wire vs all-reduce lower bound")
    for ax in axes.flat:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    for ax in axes[1]:
        ax.tick_params(axis="x", labelsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_pareto(rows: Sequence[Row], path: Path) -> None:
    """The communication frontier: validation loss against bytes per peer per trained sample (log scale), one point
    per row at equal samples; lower left is better."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def final_loss(row: Row) -> Tuple[float, str]:
        """The final validation loss, else (a run cut short) its last validation point, marked with its samples."""
        if math.isfinite(row.validation_loss):
            return row.validation_loss, ""
        points = row.validation_points()
        return (points[-1][1], f" (cut at {points[-1][0] / 1e3:.1f}k samples)") if points else (math.nan, "")

    fig, ax = plt.subplots(figsize=(11, 5.5))
    points = [r for r in rows if r.mode != "solo" and r.bytes_per_sample > 0 and math.isfinite(final_loss(r)[0])]
    colors = plt.get_cmap("tab20").colors  # a color per row: the default cycle repeats after 10
    for index, row in enumerate(points):
        loss, note = final_loss(row)
        sparse = row.mode.startswith("local_sparse")
        kind = "sync" if not row.mode.startswith("local") else ("local sparse" if sparse else "local dense")
        marker = {"sync": "o", "local dense": "s", "local sparse": "^"}[kind]
        label = row.mode if not math.isfinite(row.local_steps) else f"{row.mode} H={row.local_steps:.0f}"
        if math.isfinite(row.sparse_density):
            label += f", {100 * row.sparse_density:g} %"
        ax.scatter(
            row.bytes_per_sample,
            loss,
            marker=marker,
            s=60,
            color=colors[index % len(colors)],
            label=f"{row.link}/{label}{note}",
        )
        # every other label below its point: neighbours of similar bytes and loss do not print over each other
        offset = (4, 4) if index % 2 == 0 else (4, -10)
        ax.annotate(label, (row.bytes_per_sample, loss), fontsize=7, xytext=offset, textcoords="offset points")
    syncs = [r for r in points if r.mode == "sync"]
    for sync in syncs:
        ax.axhline(final_loss(sync)[0] * 1.03, color="tab:red", lw=0.8, ls="--", label="sync val loss + 3 %")
        ax.axvline(sync.bytes_per_sample / 200, color="tab:green", lw=0.8, ls=":", label="sync bytes ÷ 200")
    ax.set_xscale("log")
    ax.set(
        xlabel="bytes on the wire per peer per trained sample (log)",
        ylabel="validation loss at equal samples",
        title="communication frontier (lower left is better)",
    )
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))  # beside the axes: off the points' labels
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def rows_from_json(path: Path) -> List[Row]:
    known = {f.name for f in dataclasses.fields(Row)}
    return [Row(**{k: v for k, v in item.items() if k in known}) for item in json.loads(path.read_text())]


_CURVE_CELL = re.compile(r"(?P<loss>[\d.]+) \((?P<samples>[\d.]+)k\)")


def _recorded_number(value) -> float:
    return float(value) if isinstance(value, (int, float)) else math.nan


def record_list(text: str) -> List[Tuple[Path, float]]:
    """An argparse type: comma-separated recorded runs, each ``PATH`` or ``PATH@DENSITY`` (its sparse rows' top-k
    density, a fraction in (0, 1]; NaN when not given)."""
    records = []
    for part in filter(None, text.split(",")):
        path, _, density = part.rpartition("@") if "@" in part else (part, "", "")
        try:
            value = float(density) if density else math.nan
        except ValueError:
            value = math.nan  # refused below, with the fraction it must be
        if density and not 0.0 < value <= 1.0:
            raise argparse.ArgumentTypeError(
                f"{part!r}: the density after '@' must be a fraction in (0, 1], e.g. {path}@0.05 for 5 %"
            )
        records.append((Path(path), value))
    return records


def rows_from_record(path: Path, sparse_density: float = math.nan) -> List[Row]:
    """The rows of a recorded run (``benchmarks/measured/*.json``: its ``main`` table, and ``curve`` and ``uplink``
    where recorded), read back at the precision the tables print, so that a figure can hold rows whose ``--json``
    is gone next to new ones. Validation points carry the samples trained by then to 0.1k, as the curve table.
    ``sparse_density``: the density its local sparse rows ran at (the tables do not say)."""
    try:
        rows = _rows_of_tables(json.loads(path.read_text())["tables"])
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(
            f"{path} is not a recorded run of this benchmark ({type(e).__name__}: {e}): give a "
            "benchmarks/measured/swarm_*.json whose 'main' table benchmarks.docs --record stored"
        ) from e
    for row in rows:
        if row.mode in SPARSE_ROUNDS:
            row.sparse_density = sparse_density
    return rows


def _rows_of_tables(tables: dict) -> List[Row]:
    columns = [c["name"] for c in tables["main"]["columns"]]
    rows: Dict[Tuple[str, str], Row] = {}
    for cells in tables["main"]["rows"]:
        item = dict(zip(columns, cells))
        number = {name: _recorded_number(value) for name, value in item.items()}
        mode = str(item["mode"]).replace(" (oversubscribed)", "")
        row = Row(link=item["link"], mode=mode, peers=int(item["peers"]))
        row.round_samples = int(number["round"]) if math.isfinite(number["round"]) else 0
        row.local_steps, row.samples_per_second = number["H"], number["samples/s"]
        row.efficiency, row.compute_share = number["efficiency"], number["compute share"]
        row.bytes_per_sample, row.bound_bytes_per_sample = 1e3 * number["KB/sample/peer"], 1e3 * number["bound KB"]
        row.seconds_per_epoch, row.validation_loss = number["s/epoch"], number["val loss"]
        row.breakdown = {key: number[name] for name, key in zip(BREAKDOWN_COLUMNS, BREAKDOWN) if name in number}
        row.curve = [dict(epoch=-1, samples=number["samples"], seconds=math.nan, loss=math.nan)]
        rows[row.link, row.mode] = row
    curve = tables.get("curve")
    for cells in curve["rows"] if curve else []:
        row = rows[cells[0], cells[1]]
        nominal = [int(c["name"].removeprefix("@ ")) for c in curve["columns"][2:]]
        points = [(n, m) for n, m in zip(nominal, (_CURVE_CELL.fullmatch(str(c)) for c in cells[2:])) if m]
        # an epoch entry per point, so that validation_points() gives the samples trained (not the nominal ones)
        trained = [
            dict(epoch=i, samples=1e3 * float(m["samples"]), seconds=math.nan, loss=math.nan)
            for i, (_, m) in enumerate(points)
        ]
        row.curve = trained + row.curve
        row.val_curve = [dict(epoch=i, samples=n, loss=float(m["loss"])) for i, (n, m) in enumerate(points)]
    uplink = tables.get("uplink")
    for cells in uplink["rows"] if uplink else []:
        item = dict(zip((c["name"] for c in uplink["columns"]), cells))
        row = rows[item["link"], item["mode"]]
        row.mean_upload_mbit = _recorded_number(item["mean up (Mbit/s)"])
        row.peak_upload_mbit = _recorded_number(item["peak up (Mbit/s, ~1 s)"])
    return list(rows.values())


# ------------------------------------------------------------------------------------------------ main


def run_matrix(args: argparse.Namespace, folder: Path) -> List[Row]:
    settings = settings_from(args)
    wire = wire_bytes_of(gradient_sizes(settings.model_config), settings.compression_threshold)
    window_start = args.measure_from or max(settings.round_size(mode) for mode in args.modes)
    logger.info(
        "Model %s: gradients %.1f MB on the wire per copy; %d peers, %d samples per row, measured from sample %d",
        settings.model_config,
        wire / 1e6,
        settings.peers,
        settings.total_samples,
        window_start,
    )
    plan = [("any", "solo")] if "solo" in args.modes else []
    plan += [(link, mode) for link in args.links for mode in args.modes if mode != "solo"]
    rows: List[Row] = []
    solo_rate: Optional[float] = None
    for link, mode in plan:
        began = time.monotonic()
        run_folder = folder / f"{link}_{mode.replace('+', '_')}"
        logger.info("Running %s on %s (%s)", mode, link, run_folder)
        row = Row(link=link, mode=mode, peers=1 if mode == "solo" else settings.peers)
        row.round_samples, row.local_steps = settings.round_size(mode), settings.local_steps(mode)
        if mode in SPARSE_ROUNDS:
            row.sparse_density = CollaborationArguments.sparse_density
        try:
            peers, sampler, started = run_swarm(
                run_folder,
                link_name=args.links[0] if link == "any" else link,
                mode=mode,
                settings=settings,
                timeout=args.run_timeout,
                params_every=params_every(window_start, row.round_samples),
            )
            measure(row, peers, sampler, started, wire_bytes=wire, solo_rate=solo_rate, window_start=window_start)
        except Exception as e:  # one broken run must not cost the rest of a 30-minute matrix
            logger.exception("Run %s/%s failed", link, mode)
            row.error = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:200]
            peers = []
        if mode == "solo":
            solo_rate = row.samples_per_second if math.isfinite(row.samples_per_second) else None
            row.efficiency = 1.0 if solo_rate else math.nan
        try:
            if peers:
                row.validation_loss = validation_loss(
                    final_params(peers),
                    settings.model_config,
                    settings.max_sequence_length,
                    max_batches=args.eval_batches,
                )
                row.val_curve = validation_curve(
                    peers[0],
                    row.round_samples,
                    settings.model_config,
                    settings.max_sequence_length,
                    max_batches=args.eval_batches,
                )
        except (OSError, ValueError, RuntimeError, KeyError) as e:
            logger.warning("Validation loss of %s/%s not measured: %s", link, mode, e)
        row.wall_seconds = time.monotonic() - began
        rows.append(row)
        logger.info(
            "%s/%s: %.2f samples/s, efficiency %s, %.1f KB/sample (bound %.1f), val loss %s, %.0f s",
            link,
            mode,
            row.samples_per_second,
            _fmt(row.efficiency),
            row.bytes_per_sample / 1e3,
            row.bound_bytes_per_sample / 1e3,
            _fmt(row.validation_loss, 3),
            row.wall_seconds,
        )
        if args.json:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps([r.as_dict() for r in rows], indent=1, default=str))
    return rows


def print_tables(rows: Sequence[Row]) -> None:
    print(table(rows))
    for title, text in (
        ("Validation loss at equal samples", curve_table(rows)),
        ("Against sync on the same link", against_sync(rows)),
        ("Upload against the link", uplink_table(rows)),
    ):
        if text:
            print(f"\n{title}:\n\n{text}")


def main(argv: Optional[Sequence[str]] = None) -> int:
    logging.basicConfig(
        level=os.environ.get("LEANHIVE_LOG_LEVEL", "INFO"), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    args = parse_args(argv)
    if args.from_json or args.from_record:
        try:
            rows = [row for path, density in args.from_record for row in rows_from_record(path, density)]
            rows += rows_from_json(args.from_json) if args.from_json else []
        except (OSError, ValueError) as e:
            logger.error("%s", e)
            return 2
        print_tables(rows)
        write_plot(rows, args.plot)
        if args.pareto:
            write_pareto(rows, args.pareto)
        return 0
    from benchmarks.testbed.netem.hosts import netns_unavailable_reason

    reason = netns_unavailable_reason()
    if reason:
        logger.error("Cannot emulate links here: %s", reason)
        return 2
    began = time.monotonic()
    folder = args.folder or Path(tempfile.mkdtemp(prefix="leanhive-swarm-bench-"))
    rows = run_matrix(args, folder)
    settings = settings_from(args)
    window_start = args.measure_from or max(settings.round_size(mode) for mode in args.modes)
    print(
        f"Command: `python -m benchmarks.swarm {' '.join(sys.argv[1:] if argv is None else argv)}` — "
        f"model {settings.model_config}, {settings.peers} peers, {settings.total_samples} samples per row "
        f"({settings.epochs} global epochs of {settings.target_batch_size}, or fewer larger rounds), measured from "
        f"sample {window_start} on; {settings.per_device_batch_size} × {settings.max_sequence_length} tokens per "
        f"micro-batch, {settings.gradient_accumulation_steps} per local step, one torch thread per peer, "
        f"{os.cpu_count()} cores, {platform.machine()}; "
        f"wall {time.monotonic() - began:.0f} s; logs in {folder}\n"
    )
    print_tables(rows)
    if args.plot:
        write_plot(rows, args.plot)
        logger.info("Wrote %s", args.plot)
    if args.pareto:
        write_pareto(rows, args.pareto)
    failed = [r for r in rows if r.error]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
