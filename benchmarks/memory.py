"""Memory ablation benchmark: HF GPT-2 vs the lean model's memory modes, measured in one run.

Run from the repository root (so that this checkout's ``model/`` is imported):

    python -m benchmarks.memory                         # default size, fp32 on CPU
    python -m benchmarks.memory --size tiny --json out.json --plot out.png

Prints a markdown table, writes a PNG chart and, with ``--json``, the rows. See benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import logging
import os
import platform
import shlex
import sys
from pathlib import Path

import torch

from benchmarks.report import (
    Row,
    add_ratios,
    breakdown_text,
    depth_table,
    evaluate_targets,
    main_table,
    write_chart,
    write_json,
)
from benchmarks.variants import (
    SIZES,
    BenchSize,
    Variant,
    autocast_variants,
    base_variants,
    lean_builder,
    unavailable_reason,
)
from peer import memlib

logger = logging.getLogger(__name__)

DEPTH_CHECK_SIZE = "tiny"


@dataclasses.dataclass
class MemoryBenchConfig:
    """What one benchmark run measures and where it writes."""

    # size preset: one of SIZES
    size: str = "default"
    # full depth override (half depth is layers // 2); None keeps the preset's depth
    layers: int | None = None
    # timed steps per variant (the median is reported) and untimed warm-up steps before them
    # (the instrumented step already runs first, so it warms up too)
    steps: int = 3
    warmup: int = 0
    # torch intra-op threads
    threads: int = os.cpu_count() or 1
    # "cpu" or "cuda"; cuda adds torch.cuda.max_memory_allocated and bf16/fp16 autocast rows
    device: str = "cpu"
    # only these variants (None = all); references are needed for the ratio columns
    variants: tuple[str, ...] | None = None
    # depths of the reversible growth check, at the tiny size
    depth_layers: tuple[int, int] = (4, 48)
    # where the rows (JSON) and the chart (PNG) go
    json_path: Path | None = None
    plot_path: Path | None = None
    # also print what each variant saves for backward, grouped by shape
    breakdown: bool = False

    def __post_init__(self):
        if self.size not in SIZES:
            raise ValueError(f"unknown size {self.size!r}; valid sizes: {', '.join(SIZES)}")
        for name, minimum in (("steps", 1), ("warmup", 0), ("threads", 1)):
            if getattr(self, name) < minimum:
                raise ValueError(f"--{name} must be >= {minimum}, got {getattr(self, name)}")
        if self.layers is not None and self.layers < 2:
            raise ValueError(
                f"--layers must be >= 2 (per-layer figures compare full and half depth), got {self.layers}"
            )
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"--device must be 'cpu' or 'cuda', got {self.device!r}")
        shallow, deep = self.depth_layers
        if not 1 <= shallow < deep:
            raise ValueError(
                f"--depth-layers needs two depths SHALLOW,DEEP with 1 <= SHALLOW < DEEP, got {self.depth_layers}"
            )
        if self.variants is not None:
            known = {variant.name for variant in base_variants() + autocast_variants()}
            unknown = sorted(set(self.variants) - known)
            if unknown:
                raise ValueError(f"unknown variants {unknown}; valid: {', '.join(sorted(known))}")
        if self.plot_path is None:
            self.plot_path = Path("benchmarks/results") / f"memory_{self.size}.png"

    @property
    def bench_size(self) -> BenchSize:
        preset = SIZES[self.size]
        return preset if self.layers is None else dataclasses.replace(preset, layers=self.layers)


def make_inputs(size: BenchSize, device: torch.device) -> torch.Tensor:
    generator = torch.Generator().manual_seed(0)
    return torch.randint(0, size.vocab_size, (size.batch_size, size.seq_len), generator=generator).to(device)


def build(variant: Variant, size: BenchSize, layers: int, device: torch.device) -> torch.nn.Module:
    torch.manual_seed(0)
    return variant.build(size, layers).to(device)


def release(device: torch.device) -> None:
    """Free the previous model before building the next, so runs do not see each other's memory."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def measure_variant(variant: Variant, size: BenchSize, device: torch.device, *, steps: int, warmup: int) -> Row:
    """All figures of one variant: instrumented step, timed steps and the half-depth forward."""
    input_ids = make_inputs(size, device)
    model = build(variant, size, size.layers, device)
    memory = memlib.measured_step(model, input_ids, variant.autocast_dtype)

    def step():
        memlib.train_step(model, input_ids, variant.autocast_dtype)

    times = memlib.timed_steps(step, device, warmup=warmup, steps=steps)
    cuda_peak = memlib.cuda_peak_bytes(step, device) if device.type == "cuda" else None
    model = None  # freed before the next variant is built
    release(device)
    half = build(variant, size, size.half_layers, device)
    saved_half = memlib.forward_saved_bytes(half, input_ids, variant.autocast_dtype)
    del half
    release(device)
    per_layer = (memory.saved_bytes - saved_half) / (size.layers - size.half_layers) / size.tokens
    return Row(
        variant=variant.name,
        layers=size.layers,
        tokens=size.tokens,
        checkpointed=variant.checkpointed,
        autocast=variant.autocast,
        saved_bytes_per_layer_per_token=per_layer,
        saved_bytes_total=memory.saved_bytes,
        saved_breakdown=memory.saved_breakdown,
        activation_peak_bytes=memory.activation_peak_bytes,
        live_peak_bytes=memory.live_peak_bytes,
        step_seconds=memlib.median(times),
        step_seconds_all=times,
        cuda_peak_bytes=cuda_peak,
    )


def measure_depth_check(depths: tuple[int, int], device: torch.device) -> list[Row]:
    """The reversible stack at two depths of the tiny size: saved bytes and peak must not grow.

    Step time is one step after the instrumented one (informative only: it grows with depth).
    """
    reason = unavailable_reason("lean_reversible")
    names = [f"lean_reversible_L{layers}" for layers in depths]
    if reason is not None:
        return [Row(variant=name, kind="depth", layers=layers, skipped=reason) for name, layers in zip(names, depths)]
    size = SIZES[DEPTH_CHECK_SIZE]
    variant = Variant("lean_reversible", lean_builder(reversible=True))
    input_ids = make_inputs(size, device)
    rows = []
    for name, layers in zip(names, depths):
        model = build(variant, size, layers, device)
        memory = memlib.measured_step(model, input_ids)
        times = memlib.timed_steps(lambda: memlib.train_step(model, input_ids), device, warmup=0, steps=1)
        rows.append(
            Row(
                variant=name,
                kind="depth",
                layers=layers,
                tokens=size.tokens,
                saved_bytes_total=memory.saved_bytes,
                saved_breakdown=memory.saved_breakdown,
                activation_peak_bytes=memory.activation_peak_bytes,
                live_peak_bytes=memory.live_peak_bytes,
                step_seconds=memlib.median(times),
                step_seconds_all=times,
            )
        )
        model = None  # freed before the next depth is built
        release(device)
    shallow, deep = rows
    growth = (deep.saved_bytes_total - shallow.saved_bytes_total) / (deep.layers - shallow.layers) / size.tokens
    for row in rows:
        row.saved_bytes_per_layer_per_token = growth
    return rows


def resolve_device(requested: str) -> torch.device:
    if requested == "cuda" and not torch.cuda.is_available():
        print("CUDA requested but not available: running on CPU.")
        return torch.device("cpu")
    return torch.device(requested)


def selected_variants(config: MemoryBenchConfig, device: torch.device) -> list[Variant]:
    variants = base_variants()
    if device.type == "cuda":
        variants += autocast_variants()
    else:
        print(
            "Skipped on CPU (CUDA only): the torch.cuda.max_memory_allocated column and the bf16/fp16 autocast "
            "rows; run with --device cuda on a GPU machine to get them."
        )
    if config.variants is not None:
        variants = [variant for variant in variants if variant.name in config.variants]
    return variants


def header_lines(config: MemoryBenchConfig, device: torch.device) -> list[str]:
    size = config.bench_size
    hardware = (
        torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or platform.machine()
    )
    return [
        f"command: {shlex.join([Path(sys.executable).name, '-m', 'benchmarks.memory', *sys.argv[1:]])}",
        f"torch {torch.__version__}, threads {torch.get_num_threads()}, device {device} ({hardware})",
        f"size {size.name}: hidden {size.hidden_size}, heads {size.num_heads}, FFN {size.intermediate_size}, "
        f"seq {size.seq_len}, batch {size.batch_size}, vocab {size.vocab_size}, layers {size.layers} "
        f"(per-layer figures: {size.layers} vs {size.half_layers} layers), fp32"
        f"; step time: median of {config.steps} after {config.warmup} warm-up + 1 instrumented step",
    ]


def run(config: MemoryBenchConfig) -> list[Row]:
    """Measure every selected variant and the depth check; print the tables; write JSON and PNG."""
    torch.set_num_threads(config.threads)
    device = resolve_device(config.device)
    print("\n".join(header_lines(config, device)))
    size = config.bench_size
    rows = []
    for variant in selected_variants(config, device):
        reason = unavailable_reason(variant.name)
        if reason is not None:
            logger.info("skipping %s: %s", variant.name, reason)
            rows.append(Row(variant=variant.name, checkpointed=variant.checkpointed, skipped=reason))
            continue
        logger.info("measuring %s", variant.name)
        rows.append(measure_variant(variant, size, device, steps=config.steps, warmup=config.warmup))
    logger.info("measuring the reversible depth check %s", config.depth_layers)
    rows += measure_depth_check(config.depth_layers, device)
    add_ratios(rows)
    evaluate_targets(rows)
    print()
    print(main_table(rows, with_cuda=device.type == "cuda"))
    print()
    print(f"Reversible depth check (size {DEPTH_CHECK_SIZE}, target: deepest <= 1.1x shallowest):")
    print(depth_table(rows))
    if config.breakdown:
        print("\nSaved for backward, largest groups by shape (whole model, full depth):")
        print(breakdown_text(rows))
    if size.name != "default":
        print(f"\nNote: the targets are set for --size default; at size {size.name} PASS/FAIL is indicative only.")
    meta = {"size": size.name, "device": str(device), "torch": torch.__version__, "threads": torch.get_num_threads()}
    if config.json_path is not None:
        write_json(rows, config.json_path, meta)
        print(f"\nrows written to {config.json_path}")
    write_chart(rows, config.plot_path, title=f"memory benchmark, size {size.name}, {device}")
    print(f"chart written to {config.plot_path}")
    return rows


def _depths(text: str) -> tuple[int, int]:
    try:
        shallow, deep = (int(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected two depths SHALLOW,DEEP such as 4,48, got {text!r}") from None
    return shallow, deep


def parse_args(argv: list[str] | None = None) -> MemoryBenchConfig:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size", default="default", choices=list(SIZES), help="model/batch size preset")
    parser.add_argument("--layers", type=int, help="full depth (half depth = layers // 2); default: the preset's")
    parser.add_argument("--steps", type=int, default=3, help="timed steps per variant (median reported)")
    parser.add_argument(
        "--warmup",
        type=int,
        default=0,
        help="extra untimed steps before the timed ones (the instrumented step always runs first)",
    )
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="torch threads (default: all cores)")
    parser.add_argument(
        "--device",
        default="cpu",
        choices=["cpu", "cuda"],
        help="cuda adds max_memory_allocated and bf16/fp16 autocast rows",
    )
    parser.add_argument("--variants", help="comma-separated subset of variants to run (default: all)")
    parser.add_argument(
        "--depth-layers",
        type=_depths,
        default=(4, 48),
        help="depths of the reversible growth check at the tiny size (default 4,48)",
    )
    parser.add_argument("--json", type=Path, help="write the rows as JSON here")
    parser.add_argument("--plot", type=Path, help="PNG chart path (default benchmarks/results/memory_<size>.png)")
    parser.add_argument(
        "--breakdown",
        action="store_true",
        help="also print the largest saved-for-backward tensors of each variant, by shape",
    )
    args = parser.parse_args(argv)
    try:
        return MemoryBenchConfig(
            size=args.size,
            layers=args.layers,
            steps=args.steps,
            warmup=args.warmup,
            threads=args.threads,
            device=args.device,
            variants=tuple(args.variants.split(",")) if args.variants else None,
            depth_layers=args.depth_layers,
            json_path=args.json,
            plot_path=args.plot,
            breakdown=args.breakdown,
        )
    except ValueError as error:
        parser.error(str(error))


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(
        level=os.environ.get("LEANHIVE_LOG_LEVEL", "INFO"), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    run(parse_args(argv))


if __name__ == "__main__":
    main()
