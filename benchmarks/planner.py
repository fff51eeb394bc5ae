"""Memory planner benchmark: predicted vs measured peak, budget kept, throughput vs a grid search.

Run from the repository root:

    python -m benchmarks.planner                     # the default matrix (CPU: under 20 minutes on 2 cores)
    python -m benchmarks.planner --quick             # one small row per model (seconds)
    python -m benchmarks.planner --device cuda       # on a GPU: torch.cuda.max_memory_allocated

For every (model, sequence length, budget) row the planner makes its plan (one calibration step),
then the chosen configuration is measured (one instrumented step: ``peer.memlib`` live tensors on
CPU, ``torch.cuda.max_memory_allocated`` on CUDA, parameters and gradients included) and timed, and
so is every configuration of the grid (the planner's candidates) whose measured peak fits the budget.
Targets (issue 14): predicted within +-10% of measured, measured <= budget, chosen samples/s >= 0.9x
the best fitting grid configuration.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import sys
import time
from pathlib import Path

import torch

from model import load_config
from peer import memlib
from peer.memory_plan import Candidate, build_for, candidates, make_plan, measure_peak_bytes

logger = logging.getLogger(__name__)
MIB = 2**20

# (model preset, config overrides, label); each runs at its sequence lengths and budgets (x the plan's minimum)
MODELS = {
    "tiny": ("tiny", {}),
    "tiny_reversible": ("tiny", {"reversible": True}),
    "small": ("small", {}),
}
MATRIX = [
    ("tiny", 64, (1.2, 2.0, 6.0)),
    ("tiny", 256, (1.2, 2.0, 6.0)),
    ("tiny_reversible", 256, (1.1, 1.5, 3.0)),
    ("small", 64, (1.05, 1.3)),
]
QUICK_MATRIX = [("tiny", 64, (1.5,)), ("tiny_reversible", 64, (1.5,))]


@dataclasses.dataclass
class PlannerRow:
    model: str
    seq_len: int
    budget_bytes: int
    chosen: dict | None = None
    predicted_bytes: int | None = None
    measured_bytes: int | None = None
    chosen_samples_per_s: float | None = None
    best_grid: dict | None = None
    best_grid_samples_per_s: float | None = None
    grid_size: int = 0
    grid_fitting: int = 0
    seconds: float = 0.0

    @property
    def prediction_error(self) -> float | None:
        if self.predicted_bytes is None or not self.measured_bytes:
            return None
        return self.predicted_bytes / self.measured_bytes - 1

    @property
    def throughput_ratio(self) -> float | None:
        if not self.chosen_samples_per_s or not self.best_grid_samples_per_s:
            return None
        return self.chosen_samples_per_s / self.best_grid_samples_per_s

    def verdict(self) -> str:
        if self.chosen is None:
            return "nothing fits"
        failed = []
        if abs(self.prediction_error) > 0.10:
            failed.append(f"prediction {self.prediction_error:+.1%}")
        if self.measured_bytes > self.budget_bytes:
            failed.append("over budget")
        if self.throughput_ratio is not None and self.throughput_ratio < 0.9:
            failed.append(f"throughput {self.throughput_ratio:.2f}x")
        return "PASS" if not failed else "FAIL: " + ", ".join(failed)


def _inputs(config, batch: int, seq_len: int, device) -> torch.Tensor:
    generator = torch.Generator().manual_seed(0)
    return torch.randint(0, config.vocab_size, (batch, seq_len), generator=generator).to(device)


def measure(config, candidate: Candidate, seq_len: int, device, steps: int) -> tuple[int, float]:
    """(measured peak bytes, samples per second) of one configuration."""
    torch.manual_seed(0)
    model = build_for(config, candidate, device)
    input_ids = _inputs(config, candidate.per_device_batch_size, seq_len, device)
    peak = measure_peak_bytes(model, input_ids, candidate.autocast_dtype)
    times = memlib.timed_steps(
        lambda: memlib.train_step(model, input_ids, candidate.autocast_dtype), device, warmup=0, steps=steps
    )
    return peak, candidate.per_device_batch_size / memlib.median(times)


def run_model(name: str, seq_len: int, factors, args, device) -> list[PlannerRow]:
    """Measure the whole grid once, then plan and check one row per budget factor."""
    preset, overrides = MODELS[name]
    config = load_config(preset)
    for key, value in overrides.items():
        setattr(config, key, value)
    config.hidden_dropout_prob = config.attention_probs_dropout_prob = 0.0
    precisions = ["fp16", "fp32"] if device.type == "cuda" else ["fp32"]
    plan_args = dict(seq_len=seq_len, samples_per_step=args.samples_per_step, device=device, precisions=precisions)
    started = time.perf_counter()
    grid = candidates(config, args.samples_per_step, precisions)
    results = {candidate: measure(config, candidate, seq_len, device, args.steps) for candidate in grid}
    grid_seconds = time.perf_counter() - started
    # budgets are set relative to the smallest predicted need, so every row has something to choose from
    needed = make_plan(config, budget_bytes=2**62, **plan_args).needed_bytes
    rows = []
    for factor in factors:
        started = time.perf_counter()
        budget = int(needed * factor)
        plan = make_plan(config, budget_bytes=budget, **plan_args)
        row = PlannerRow(model=name, seq_len=seq_len, budget_bytes=budget, grid_size=len(grid))
        fitting = {c: result for c, result in results.items() if result[0] <= budget}
        row.grid_fitting = len(fitting)
        if fitting:
            best = max(fitting, key=lambda c: fitting[c][1])
            row.best_grid, row.best_grid_samples_per_s = dataclasses.asdict(best), fitting[best][1]
        if plan.chosen is not None:
            chosen = plan.chosen.candidate
            row.chosen = dataclasses.asdict(chosen)
            row.predicted_bytes = plan.chosen.predicted_bytes
            row.measured_bytes, row.chosen_samples_per_s = results[chosen]
        row.seconds = time.perf_counter() - started + grid_seconds / len(factors)
        rows.append(row)
        logger.info("row done: %s", row)
    return rows


def _fmt_candidate(values: dict | None, reversible: bool) -> str:
    if values is None:
        return "-"
    layers = "ckpt" if values["checkpoint_layers"] else "plain"
    if reversible:
        chunks = values["reversible_chunk_tokens"], values["reversible_chunk_heads"]
        layers = f"rev {chunks[0]}t/{chunks[1]}h" if any(chunks) else "revlib"
    return (
        f"b{values['per_device_batch_size']}x{values['gradient_accumulation_steps']} {layers} "
        f"loss{values['loss_chunk_size']} {values['precision']}"
    )


def table(rows: list[PlannerRow]) -> str:
    header = (
        "| model | seq | budget MiB | chosen | predicted MiB | measured MiB | error | chosen samples/s "
        "| best grid | grid samples/s | x best | fitting/grid | s | verdict |"
    )
    lines = [header, "|" + "---|" * 14]
    for row in rows:
        reversible = MODELS[row.model][1].get("reversible", False)
        error = "-" if row.prediction_error is None else f"{row.prediction_error:+.1%}"
        ratio = "-" if row.throughput_ratio is None else f"{row.throughput_ratio:.2f}"
        lines.append(
            f"| {row.model} | {row.seq_len} | {row.budget_bytes / MIB:.1f} | "
            f"{_fmt_candidate(row.chosen, reversible)} | "
            f"{(row.predicted_bytes or 0) / MIB:.1f} | {(row.measured_bytes or 0) / MIB:.1f} | {error} | "
            f"{row.chosen_samples_per_s or 0:.2f} | {_fmt_candidate(row.best_grid, reversible)} | "
            f"{row.best_grid_samples_per_s or 0:.2f} | {ratio} | {row.grid_fitting}/{row.grid_size} | "
            f"{row.seconds:.0f} | {row.verdict()} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> list[PlannerRow]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--quick", action="store_true", help="one tiny row per model kind (a smoke run)")
    parser.add_argument("--samples_per_step", type=int, default=8, help="samples per local step (kept by the plan)")
    parser.add_argument("--steps", type=int, default=2, help="timed steps per configuration (median)")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--json", type=Path, help="write the rows here")
    args = parser.parse_args(argv)
    if args.samples_per_step < 1 or args.steps < 1 or args.threads < 1:
        parser.error("--samples_per_step, --steps and --threads must be >= 1")
    logging.basicConfig(level=os.environ.get("LEANHIVE_LOG_LEVEL", "WARNING"))
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: CUDA is not available on this machine")
    print(f"command: python -m benchmarks.planner {' '.join(sys.argv[1:] if argv is None else argv)}")
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}, device {device}")
    rows = []
    for name, seq_len, factors in QUICK_MATRIX if args.quick else MATRIX:
        rows += run_model(name, seq_len, factors, args, device)
    print(table(rows))
    if args.json is not None:
        args.json.write_text(json.dumps([dataclasses.asdict(row) | {"verdict": row.verdict()} for row in rows]))
    return rows


if __name__ == "__main__":
    main()
