"""Local mode's math without a network: N peers' inner steps and outer rounds in one process (issue 28).

Each peer trains its own copy of the model for H local steps with the real inner 8-bit LAMB on its own stream of
the shipped corpus; the round then averages the peers' pseudo-gradients, dense or through the real sparse codec
with each peer's error-feedback buffer (``peer/swarm/sparse.py``), and applies the outer SGD step the trainer
builds (``make_outer_sgd``), after which every peer continues from the shared parameters. The validation loss of the
shared parameters after every round, for each row, at equal samples:

    python -m benchmarks.outer_sim --model_config bench_small --local_steps 16 --rounds 8 --rows dense,sparse

This is the place to try sparse settings (``--sparse_*``) before a `benchmarks.swarm` run: no links, no hivemind,
no timing, so a row is a few minutes on one core, and its curve follows the swarm benchmark's rows of the same H
(docs/benchmarks.md, "Sparse against dense local mode without a network"). What it leaves out: rounds a peer misses,
peers of unequal speed, the wire.

Rows: ``dense`` is the swarm benchmark's ``local_x<k>`` (outer Nesterov SGD, the trainer's defaults), ``sparse`` its
``local_sparse_x<k>`` (the sparse codec at the trainer's defaults, outer learning rate 1 without momentum).
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Sequence

import torch

from benchmarks.report import markdown_table, path_list

logger = logging.getLogger("benchmarks.outer_sim")

ROWS = ("dense", "sparse")


@dataclass
class SimRow:
    name: str
    settings: Dict[str, float]
    losses: List[float] = field(default_factory=list)
    """Validation loss of the shared parameters after each round."""
    seconds: float = math.nan


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    from peer.swarm.config import CollaborationArguments

    defaults = CollaborationArguments()
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.outer_sim", description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1]
    )
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.add_argument("--rows", default="dense,sparse", help="comma-separated: dense, sparse (default: %(default)s)")
    parser.add_argument("--model_config", default="bench_small", help="model preset (default: %(default)s)")
    parser.add_argument("--peers", type=int, default=2, help="peers averaged per round (default: %(default)s)")
    parser.add_argument("--local_steps", type=int, default=16, help="H: inner steps per peer per round (default: 16)")
    parser.add_argument("--rounds", type=int, default=8, help="outer rounds (default: %(default)s)")
    parser.add_argument("--per_device_batch_size", type=int, default=16, help="samples per micro-batch (default: 16)")
    parser.add_argument(
        "--gradient_accumulation_steps", type=int, default=2, help="micro-batches per step (default: 2)"
    )
    parser.add_argument("--max_sequence_length", type=int, default=128, help="tokens per sample (default: 128)")
    parser.add_argument("--learning_rate", type=float, default=0.01, help="inner peak rate (default: %(default)s)")
    parser.add_argument(
        "--schedule_samples",
        type=int,
        default=256,
        help="samples per epoch of the inner schedule (2 epochs of warmup, decay over 100), as the swarm benchmark's "
        "--target_batch_size (default: %(default)s)",
    )
    outer = (
        ("dense_outer_learning_rate", float, defaults.outer_learning_rate, "the dense row's outer SGD rate"),
        ("dense_outer_momentum", float, defaults.outer_momentum, "the dense row's Nesterov momentum"),
        ("sparse_outer_learning_rate", float, 1.0, "the sparse row's outer SGD rate"),
        ("sparse_outer_momentum", float, 0.0, "the sparse row's momentum (0: the buffer takes its part)"),
        ("sparse_density", float, defaults.sparse_density, "values kept per chunk"),
        ("sparse_bits", int, defaults.sparse_bits, "bits per kept value"),
        ("sparse_chunk", int, defaults.sparse_chunk, "values per chunk"),
        ("sparse_feedback_decay", float, defaults.sparse_feedback_decay, "error-feedback decay per round"),
    )
    for name, kind, default, text in outer:
        parser.add_argument(f"--{name}", type=kind, default=default, help=f"{text} (default: {default})")
    parser.add_argument("--eval_batches", type=int, default=8, help="validation batches of 8 blocks (default: 8)")
    parser.add_argument("--seed", type=int, default=0, help="model initialisation (default: %(default)s)")
    parser.add_argument("--json", type=Path, help="write the rows here (rewritten after every row)")
    parser.add_argument(
        "--from_json",
        type=path_list,
        default=[],
        help="run nothing: print the table of the rows saved by earlier --json runs (comma-separated files, e.g. "
        "the dense and the sparse row run side by side on two cores)",
    )
    args = parser.parse_args(argv)
    args.rows = args.rows.split(",")
    unknown = [row for row in args.rows if row not in ROWS]
    if unknown:
        parser.error(f"unknown row {', '.join(unknown)}; choose from {', '.join(ROWS)}")
    for name in ("peers", "local_steps", "rounds", "per_device_batch_size", "gradient_accumulation_steps"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be at least 1, got {getattr(args, name)}")
    try:
        collaboration(args, "sparse")  # the trainer's own checks of the outer and sparse settings
    except ValueError as e:
        parser.error(str(e))
    return args


def collaboration(args: argparse.Namespace, row: str):
    from peer.swarm.config import CollaborationArguments

    sparse = row == "sparse"
    return CollaborationArguments(
        sync_mode="local",
        outer_compression="sparse" if sparse else "dense",
        outer_learning_rate=args.sparse_outer_learning_rate if sparse else args.dense_outer_learning_rate,
        outer_momentum=args.sparse_outer_momentum if sparse else args.dense_outer_momentum,
        sparse_density=args.sparse_density,
        sparse_bits=args.sparse_bits,
        sparse_chunk=args.sparse_chunk,
        sparse_feedback_decay=args.sparse_feedback_decay,
    )


def inner_schedule(args: argparse.Namespace):
    """The swarm benchmark's inner schedule (``RunSettings.schedule``) for this run's rounds."""
    from benchmarks.swarm_lib import RunSettings
    from peer.swarm.config import OptimizerArguments

    settings = RunSettings(target_batch_size=args.schedule_samples)
    round_samples = args.peers * args.local_steps * args.per_device_batch_size * args.gradient_accumulation_steps
    warmup, total = settings.schedule(round_samples)
    return OptimizerArguments(
        learning_rate=args.learning_rate,
        min_learning_rate=settings.min_learning_rate,
        warmup_steps=warmup,
        total_steps=total,
    )


def simulate(args: argparse.Namespace, name: str) -> SimRow:
    from aux_monitor.evaluation import evaluate
    from model import LeanGPTForCausalLM, load_config
    from peer.swarm.data import (
        DataArguments,
        build_train_dataset,
        build_validation_dataset,
        load_tokenizer,
        make_batches,
    )
    from peer.swarm.optimizer import make_inner_optimizer, make_outer_sgd, set_inner_learning_rate
    from peer.swarm.sparse import ErrorFeedback, SparseCodec, flatten

    collab, optim = collaboration(args, name), inner_schedule(args)
    row = SimRow(name, dict(outer_learning_rate=collab.outer_learning_rate, outer_momentum=collab.outer_momentum))
    if name == "sparse":
        row.settings.update(density=collab.sparse_density, bits=collab.sparse_bits)
        row.settings.update(feedback_decay=collab.sparse_feedback_decay)
    torch.manual_seed(args.seed)
    config = load_config(args.model_config)
    shared = LeanGPTForCausalLM(config)
    data = DataArguments(max_sequence_length=args.max_sequence_length, seq_warmup_start_length=0)
    tokenizer = load_tokenizer(data)
    validation = build_validation_dataset(data, tokenizer)
    peers = []
    for index in range(args.peers):
        model = LeanGPTForCausalLM(config)
        model.load_state_dict(shared.state_dict())
        stream = build_train_dataset(data, tokenizer, peer_seed=1000 + index)
        batches = make_batches(stream, args.per_device_batch_size, args.max_sequence_length)
        peers.append((model, make_inner_optimizer(model, optim), batches))
    outer = make_outer_sgd(list(shared.parameters()), collab)
    total = sum(p.numel() for p in shared.parameters())
    feedback = []
    if name == "sparse":
        codec = SparseCodec(
            total=total, density=collab.sparse_density, bits=collab.sparse_bits, chunk=collab.sparse_chunk
        )
        feedback = [ErrorFeedback(codec, collab.sparse_feedback_decay) for _ in peers]
    began = time.monotonic()
    for round_index in range(args.rounds):
        contributions = []
        for index, (model, inner, batches) in enumerate(peers):
            set_inner_learning_rate(inner, round_index, optim)
            for _ in range(args.local_steps):
                inner.zero_grad()
                for _ in range(args.gradient_accumulation_steps):
                    tokens = next(batches)["input_ids"]
                    (model(input_ids=tokens, labels=tokens).loss / args.gradient_accumulation_steps).backward()
                inner.step()
            pseudo = flatten([s.detach() - p.detach() for s, p in zip(shared.parameters(), model.parameters())])
            if feedback:
                _, pseudo, residual = feedback[index].compress(pseudo)
                feedback[index].commit(residual)
            contributions.append(pseudo)
        average = torch.stack(contributions).mean(0)
        offset = 0
        for param in shared.parameters():
            param.grad = average[offset : offset + param.numel()].view_as(param).clone()
            offset += param.numel()
        outer.step()
        with torch.no_grad():
            for model, _, _ in peers:
                for param, value in zip(model.parameters(), shared.parameters()):
                    param.copy_(value)
        loss = evaluate(shared, validation, epoch=round_index, batch_size=8, max_batches=args.eval_batches).loss
        row.losses.append(loss)
        logger.info(
            "%s: round %d of %d, validation loss %.3f (%.0f s)",
            name,
            round_index + 1,
            args.rounds,
            loss,
            time.monotonic() - began,
        )
    row.seconds = time.monotonic() - began
    return row


def loss_table(rows: Sequence[SimRow], samples_per_round: int) -> str:
    """Validation loss after each round; with a dense row, each other row's gap to it at equal samples."""
    dense = next((row for row in rows if row.name == "dense"), None)
    rounds = max(len(row.losses) for row in rows)
    lines = []
    for row in rows:
        cells = []
        for index in range(rounds):
            if index >= len(row.losses):
                cells.append("—")
                continue
            gap = ""
            if dense is not None and row is not dense and index < len(dense.losses):
                gap = f" ({100 * (row.losses[index] / dense.losses[index] - 1):+.1f} %)"
            cells.append(f"{row.losses[index]:.3f}{gap}")
        settings = ", ".join(f"{key} {value:g}" for key, value in row.settings.items())
        lines.append([row.name, settings, *cells])
    header = ["row", "outer settings", *(f"@ {samples_per_round * (i + 1)}" for i in range(rounds))]
    return markdown_table(header, lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    args = parse_args(argv)
    torch.set_num_threads(1)
    samples = args.peers * args.local_steps * args.per_device_batch_size * args.gradient_accumulation_steps
    if args.from_json:
        try:
            saved = [json.loads(path.read_text()) for path in args.from_json]
            rows = [SimRow(**row) for run in saved for row in run["rows"]]
        except (OSError, ValueError, KeyError, TypeError) as e:
            logger.error("%s: give files that --json of this benchmark wrote", e)
            return 2
        first = saved[0]["args"]
        samples = first["peers"] * first["local_steps"] * first["per_device_batch_size"]
        samples *= first["gradient_accumulation_steps"]
        print(loss_table(rows, samples))
        return 0
    rows = []
    for name in args.rows:
        rows.append(simulate(args, name))
        if args.json:
            args.json.write_text(json.dumps(dict(args=vars(args), rows=[vars(r) for r in rows]), indent=1, default=str))
    print(
        f"Command: `python -m benchmarks.outer_sim {' '.join(sys.argv[1:] if argv is None else argv)}` — model "
        f"{args.model_config}, {args.peers} peers, H = {args.local_steps}, {samples} samples per round, one torch "
        "thread; validation loss of the shared parameters after each round (vs dense at equal samples):\n"
    )
    print(loss_table(rows, samples))
    return 0


if __name__ == "__main__":
    sys.exit(main())
