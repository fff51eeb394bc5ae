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

Streaming fragments (``--fragments P``, ``--fragment_overlap``, ``--fragment_mix``; ``FragmentSchedule``): the
shared parameters split into P ranges whose outer syncs are staggered through the round, each sent one
fragment-round before it is applied while the peers train on, so a peer's largest transfer is 1/P of the payload.

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
    largest_send: Optional[int] = None
    """Bytes a peer sends in its largest single sync: the sparse codec's exact payload of the largest fragment;
    dense rows one byte a value (hivemind's 8-bit wire format, its scales left out)."""


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
    parser.add_argument(
        "--fragments",
        type=int,
        default=1,
        help="P: split the shared parameters into P equal ranges synced at staggered steps of the round (Streaming "
        "DiLoCo; default: %(default)s, one sync per round)",
    )
    parser.add_argument(
        "--fragment_overlap",
        action="store_true",
        help="send each fragment one fragment-round (H / P inner steps) before it is applied, the peers training on "
        "meanwhile (default: sent and applied at once, the peers waiting)",
    )
    parser.add_argument(
        "--fragment_mix",
        type=float,
        default=0.0,
        help="on a fragment's landing each peer keeps this share of its own values and takes the rest from the new "
        "shared ones (default: %(default)s, the shared values)",
    )
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
    if not 0.0 <= args.fragment_mix < 1.0:
        parser.error(f"--fragment_mix must be in [0, 1), got {args.fragment_mix}; e.g. 0.5")
    try:
        collaboration(args, "sparse")  # the trainer's own checks of the outer and sparse settings
        FragmentSchedule(args.local_steps, args.fragments, args.fragment_overlap)
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


@dataclass(frozen=True)
class FragmentSchedule:
    """Streaming DiLoCo's staggered outer syncs (issue 28, req. 3): the flat shared parameters split into
    ``fragments`` equal ranges; fragment p's pseudo-gradient is sent at inner step ``send[p]`` of every round and its
    average applied (the outer step, then the peers merge it) at step ``apply[p]``. Without overlap both are the end
    of the fragment's share of the round, b_p = round((p + 1) H / P), and the peers wait for the transfer there;
    with overlap it is sent at b_(p-1) (0 for the first) and applied one fragment-round later at b_p, while the
    peers go on with their inner steps. Every fragment's last transfer of a round lands by its end, so the round's
    validation loss sees all of them; the first fragment's first send (step 0 of the run) carries nothing."""

    local_steps: int
    fragments: int = 1
    overlap: bool = False

    def __post_init__(self) -> None:
        if not 1 <= self.fragments <= self.local_steps:
            raise ValueError(
                f"--fragments must be between 1 and --local_steps ({self.local_steps}), got {self.fragments}"
            )
        if self.overlap and self.fragments < 2:
            raise ValueError("--fragment_overlap needs --fragments 2 or more (one fragment would be sent as it lands)")

    def boundary(self, index: int) -> int:
        return round((index + 1) * self.local_steps / self.fragments) if index >= 0 else 0

    @property
    def apply(self) -> List[int]:
        return [self.boundary(p) for p in range(self.fragments)]

    @property
    def send(self) -> List[int]:
        return [self.boundary(p - 1) for p in range(self.fragments)] if self.overlap else self.apply

    def ranges(self, total: int) -> List[range]:
        edges = [round(p * total / self.fragments) for p in range(self.fragments + 1)]
        return [range(edges[p], edges[p + 1]) for p in range(self.fragments)]


@dataclass
class Fragment:
    """One range of the flat shared parameters with its own outer optimizer, the peers' error-feedback buffers for
    it (sparse rows) and the averaged pseudo-gradient in flight."""

    span: range
    shared: torch.nn.Parameter
    outer: torch.optim.Optimizer
    feedback: List = field(default_factory=list)
    in_flight: Optional[torch.Tensor] = None


def build_fragments(args: argparse.Namespace, collab, shared_flat: torch.Tensor, schedule: FragmentSchedule):
    from peer.swarm.optimizer import make_outer_sgd
    from peer.swarm.sparse import ErrorFeedback, SparseCodec

    fragments = []
    for span in schedule.ranges(shared_flat.numel()):
        values = torch.nn.Parameter(shared_flat[span.start : span.stop].clone())
        fragment = Fragment(span, values, make_outer_sgd([values], collab))
        if collab.outer_compression == "sparse":
            codec = SparseCodec(
                total=len(span), density=collab.sparse_density, bits=collab.sparse_bits, chunk=collab.sparse_chunk
            )
            fragment.feedback = [ErrorFeedback(codec, collab.sparse_feedback_decay) for _ in range(args.peers)]
        fragments.append(fragment)
    return fragments


def send(fragment: Fragment, locals_flat: Sequence[torch.Tensor]) -> None:
    """The peers' pseudo-gradients of this fragment (through each one's error feedback on sparse rows), averaged."""
    contributions = []
    for index, local in enumerate(locals_flat):
        pseudo = fragment.shared.detach() - local[fragment.span.start : fragment.span.stop]
        if fragment.feedback:
            _, pseudo, residual = fragment.feedback[index].compress(pseudo)
            fragment.feedback[index].commit(residual)
        contributions.append(pseudo)
    fragment.in_flight = torch.stack(contributions).mean(0)


def land(fragment: Fragment, models: Sequence[torch.nn.Module], mix: float) -> None:
    """The outer step with the averaged pseudo-gradient; each peer then takes (1 - mix) of the new shared values and
    keeps ``mix`` of its own (Streaming DiLoCo's merge; 0: the shared values, as without fragments)."""
    fragment.shared.grad = fragment.in_flight
    fragment.outer.step()
    fragment.in_flight = None
    with torch.no_grad():
        for model in models:
            local = flat_view(model)
            part = local[fragment.span.start : fragment.span.stop]
            part.copy_(fragment.shared if mix == 0 else mix * part + (1 - mix) * fragment.shared)
            unflatten_into(model, local)


def flat_view(model: torch.nn.Module) -> torch.Tensor:
    from peer.swarm.sparse import flatten

    return flatten(list(model.parameters()))


def unflatten_into(model: torch.nn.Module, flat: torch.Tensor) -> None:
    offset = 0
    with torch.no_grad():
        for param in model.parameters():
            param.copy_(flat[offset : offset + param.numel()].view_as(param))
            offset += param.numel()


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
    from peer.swarm.optimizer import make_inner_optimizer, set_inner_learning_rate

    collab, optim = collaboration(args, name), inner_schedule(args)
    schedule = FragmentSchedule(args.local_steps, args.fragments, args.fragment_overlap)
    row = SimRow(name, dict(outer_learning_rate=collab.outer_learning_rate, outer_momentum=collab.outer_momentum))
    if name == "sparse":
        row.settings.update(density=collab.sparse_density, bits=collab.sparse_bits)
        row.settings.update(feedback_decay=collab.sparse_feedback_decay)
    if schedule.fragments > 1:
        row.settings.update(fragments=schedule.fragments, overlap=int(schedule.overlap), mix=args.fragment_mix)
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
    models = [model for model, _, _ in peers]
    fragments = build_fragments(args, collab, flat_view(shared), schedule)
    row.largest_send = max(
        fragment.feedback[0].codec.payload_bytes if fragment.feedback else len(fragment.span) for fragment in fragments
    )
    began = time.monotonic()
    for round_index in range(args.rounds):
        for _, inner, _ in peers:
            set_inner_learning_rate(inner, round_index, optim)
        for step in range(args.local_steps + 1):
            # step t: the transfers due after t inner steps of the round, then the round's (t + 1)-th inner step
            for fragment, at in zip(fragments, schedule.send):
                if at == step:
                    send(fragment, [flat_view(model) for model in models])
            for fragment, at in zip(fragments, schedule.apply):
                if at == step and fragment.in_flight is not None:
                    land(fragment, models, args.fragment_mix)
            if step == args.local_steps:
                break
            for model, inner, batches in peers:
                inner.zero_grad()
                for _ in range(args.gradient_accumulation_steps):
                    tokens = next(batches)["input_ids"]
                    (model(input_ids=tokens, labels=tokens).loss / args.gradient_accumulation_steps).backward()
                inner.step()
        unflatten_into(shared, torch.cat([fragment.shared.detach() for fragment in fragments]))
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
        send = "—" if row.largest_send is None else f"{row.largest_send / 1e3:.0f}"
        lines.append([row.name, settings, send, *cells])
    header = ["row", "outer settings", "largest send (KB)"]
    header += [f"@ {samples_per_round * (i + 1)}" for i in range(rounds)]
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
