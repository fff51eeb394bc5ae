"""Memory ablation report: what each memory option of the lean model saves, one option at a time.

Run from the repository root:

    python -m benchmarks.ablation                      # default size (hidden 1024, seq 512, batch 2), CPU
    python -m benchmarks.ablation --size tiny          # seconds

Every row is the plain reference (plain-autograd sub-layers, full logits, no checkpointing) with ONE
option switched on, measured with the same machinery as ``benchmarks/memory.py`` (exact saved and live
tensor bytes of one step, ``peer.memlib``): activation peak and parameter bytes against the reference,
and step time. A second table gives the optimizer's bytes per parameter on the device and on the host:
fp32 Adam on the device vs LeanHive's 8-bit LAMB kept in CPU RAM (measured from the optimizers' state
after one step). Prints both tables (markdown) and writes a PNG chart.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
from pathlib import Path

import torch

from benchmarks.memory import make_inputs, measure_variant, release, resolve_device
from benchmarks.report import MIB, Row
from benchmarks.variants import REV_CHUNK_HEADS, REV_CHUNK_TOKENS, SIZES, Variant, lean_builder

logger = logging.getLogger(__name__)

PLAIN = dict(custom_ffn=False, custom_attention=False, loss_chunk_size=0)


def ablation_variants(size) -> list[tuple[Variant, str, int]]:
    """(variant, what it switches on, micro-batch divisor) per row; the first row is the reference."""
    chunks = dict(reversible_chunk_tokens=REV_CHUNK_TOKENS, reversible_chunk_heads=REV_CHUNK_HEADS)
    pixelfly_block = 32 if size.hidden_size >= 256 else 8
    rows = [
        ("plain", "reference: plain autograd, full logits", {}, {}, 1),
        ("custom_autograd", "hand-written FFN/attention backward", dict(custom_ffn=True, custom_attention=True), {}, 1),
        ("checkpointing", "checkpoint_layers=True", dict(checkpoint_layers=True), {}, 1),
        ("reversible", "reversible=True (revlib backward)", {}, dict(reversible=True), 1),
        (
            "reversible_chunked",
            f"reversible, chunks {REV_CHUNK_TOKENS} tokens / {REV_CHUNK_HEADS} heads",
            chunks,
            dict(reversible=True),
            1,
        ),
        ("chunked_loss", "loss_chunk_size=256", dict(loss_chunk_size=256), {}, 1),
        ("sharing", "num_hidden_groups=1 (one layer's parameters for all)", {}, dict(num_hidden_groups=1), 1),
        ("pixelfly", f"PixelFly block_size={pixelfly_block}", {}, dict(block_size=pixelfly_block), 1),
        ("grad_accumulation_x2", "half the micro-batch, 2 accumulation steps", {}, {}, 2),
    ]
    variants = []
    for name, what, options, architecture, divisor in rows:
        reversible = architecture.pop("reversible", False)
        build = lean_builder(reversible=reversible, architecture=architecture, **{**PLAIN, **options})
        variants.append((Variant(name, build), what, divisor))
    return variants


def parameter_bytes(variant: Variant, size) -> int:
    torch.manual_seed(0)
    model = variant.build(size, size.layers)
    return sum(p.numel() * p.element_size() for p in model.parameters())


def optimizer_bytes_per_parameter() -> list[tuple[str, float, float]]:
    """(optimizer, device bytes/param, host bytes/param) from the state after one step on a 1M-parameter tensor."""
    from peer.swarm.lamb import CPULamb8Bit

    results = []
    for name, make, on_device in (
        ("fp32 Adam (on the device)", lambda p: torch.optim.Adam([p]), True),
        ("8-bit LAMB in CPU RAM (LeanHive)", lambda p: CPULamb8Bit([p]), False),
    ):
        param = torch.nn.Parameter(torch.randn(1024, 1024))
        optimizer = make(param)
        param.grad = torch.randn_like(param)
        optimizer.step()
        state = sum(t.numel() * t.element_size() for t in optimizer.state[param].values() if torch.is_tensor(t))
        per_param = state / param.numel()
        results.append((name, per_param if on_device else 0.0, 0.0 if on_device else per_param))
    return results


def run(size_name: str, device: torch.device, steps: int, plot: Path) -> list[dict]:
    size = SIZES[size_name]
    rows = []
    for variant, what, divisor in ablation_variants(size):
        row_size = dataclasses.replace(size, batch_size=max(1, size.batch_size // divisor))
        logger.info("measuring %s", variant.name)
        row: Row = measure_variant(variant, row_size, device, steps=steps, warmup=0)
        rows.append(
            dict(
                option=variant.name,
                what=what,
                activation_peak_bytes=row.activation_peak_bytes,
                saved_bytes_per_layer_per_token=row.saved_bytes_per_layer_per_token,
                parameter_bytes=parameter_bytes(variant, size),
                step_seconds=row.step_seconds * divisor,
            )
        )
        release(device)
    plain = rows[0]
    for row in rows:
        row["peak_ratio"] = row["activation_peak_bytes"] / plain["activation_peak_bytes"]
        row["parameter_ratio"] = row["parameter_bytes"] / plain["parameter_bytes"]
        row["time_ratio"] = row["step_seconds"] / plain["step_seconds"]
    print(table(rows))
    print()
    print("| optimizer | device bytes/param | host bytes/param |\n|---|---|---|")
    for name, on_device, on_host in optimizer_bytes_per_parameter():
        print(f"| {name} | {on_device:.2f} | {on_host:.2f} |")
    print(
        "\nMixed precision (bf16/fp16 autocast) is measured on CUDA by `python -m benchmarks.memory --device cuda`; "
        "on CPU it is not measured here."
    )
    write_chart(rows, plot, f"memory ablation, size {size_name}, {device}")
    print(f"chart written to {plot}")
    return rows


def table(rows: list[dict]) -> str:
    lines = [
        "| option | switched on | act. peak MiB | x plain | saved KiB/layer/token | params MiB | x plain | step s "
        "(whole batch) | x plain |",
        "|" + "---|" * 9,
    ]
    for row in rows:
        lines.append(
            f"| {row['option']} | {row['what']} | {row['activation_peak_bytes'] / MIB:.1f} | {row['peak_ratio']:.2f} | "
            f"{row['saved_bytes_per_layer_per_token'] / 1024:.1f} | {row['parameter_bytes'] / MIB:.1f} | "
            f"{row['parameter_ratio']:.2f} | {row['step_seconds']:.3f} | {row['time_ratio']:.2f} |"
        )
    return "\n".join(lines)


def write_chart(rows: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(11, 4.5))
    positions = range(len(rows))
    for offset, (key, label) in zip((-0.2, 0.2), (("peak_ratio", "activation peak"), ("parameter_ratio", "params"))):
        ax.bar([p + offset for p in positions], [row[key] for row in rows], 0.4, label=label)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks(list(positions), [row["option"] for row in rows], rotation=30, ha="right")
    ax.set_ylabel("x plain reference (lower is better)")
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size", default="default", choices=list(SIZES))
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--steps", type=int, default=1, help="timed steps per row (median)")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--plot", type=Path, help="PNG path (default benchmarks/results/ablation_<size>.png)")
    args = parser.parse_args(argv)
    if args.steps < 1 or args.threads < 1:
        parser.error("--steps and --threads must be >= 1")
    logging.basicConfig(level=os.environ.get("LEANHIVE_LOG_LEVEL", "WARNING"))
    torch.set_num_threads(args.threads)
    device = resolve_device(args.device)
    size = SIZES[args.size]
    print(
        f"command: python -m benchmarks.ablation --size {args.size}; torch {torch.__version__}, threads "
        f"{torch.get_num_threads()}, device {device}; size: hidden {size.hidden_size}, heads {size.num_heads}, "
        f"FFN {size.intermediate_size}, seq {size.seq_len}, batch {size.batch_size}, vocab {size.vocab_size}, "
        f"layers {size.layers}, fp32"
    )
    make_inputs(size, device)  # fail early on a bad size/device
    return run(args.size, device, args.steps, args.plot or Path("benchmarks/results") / f"ablation_{args.size}.png")


if __name__ == "__main__":
    main()
