"""Generation speed: time per new token with the KV cache, without it, and HF GPT-2 with its cache, by prompt length.

Run from the repository root (so that this checkout's ``model/`` is imported):

    python -m benchmarks.generation                                  # hidden 256, 4 layers, prompts 128..2048
    python -m benchmarks.generation --prompts 16,64 --new_tokens 4   # seconds; for development

Per-token time is (time of prefill + 1 + N tokens - time of prefill + 1 token) / N, the median of ``--repeats``
runs of greedy ``generate()``, so the prompt's own forward pass is not counted. ``growth`` is the log-log slope of
per-token time against prompt length between the shortest and the longest prompt: without a cache every token
re-reads the whole prompt (slope towards 1 for the projections, 2 for attention); with it, a token costs a
constant plus one attention row over the cache (slope well below 1 at these sizes). Prints a markdown table;
``--json`` writes the rows and ``--plot`` a PNG. No assertion on timings anywhere (tests check behaviour only).
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import platform
import shlex
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Dict, List, Optional

import torch

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class GenerationBenchConfig:
    """What one run measures."""

    hidden_size: int = 256
    num_layers: int = 4
    num_heads: int = 4
    vocab_size: int = 4096
    # prompt lengths (tokens), shortest first
    prompts: tuple = (128, 512, 2048)
    # tokens generated per timed run (after the first one, which is timed with the prefill)
    new_tokens: int = 16
    # timed runs per row; the median is reported
    repeats: int = 3
    # torch threads; 0 keeps torch's default
    threads: int = 0

    def __post_init__(self):
        if not self.prompts or any(p < 1 for p in self.prompts) or list(self.prompts) != sorted(self.prompts):
            raise ValueError(f"prompts must be increasing positive lengths, e.g. 128,512,2048; got {self.prompts}")
        for name in ("hidden_size", "num_layers", "num_heads", "vocab_size", "new_tokens", "repeats"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")


@dataclass
class Row:
    variant: str  # lean_cache, lean_no_cache, hf_gpt2_cache
    prompt: int
    ms_per_token: float
    ratio_to_lean_cache: Optional[float] = None


def build_models(cfg: GenerationBenchConfig) -> Dict[str, torch.nn.Module]:
    from transformers import GPT2Config, GPT2LMHeadModel

    from model import LeanGPTForCausalLM, LeanTransformerConfig

    torch.manual_seed(0)
    lean = LeanGPTForCausalLM(
        LeanTransformerConfig(
            vocab_size=cfg.vocab_size,
            hidden_size=cfg.hidden_size,
            num_hidden_layers=cfg.num_layers,
            num_attention_heads=cfg.num_heads,
            intermediate_size=4 * cfg.hidden_size,
            max_position_embeddings=max(cfg.prompts) + cfg.new_tokens + 1,
        )
    ).eval()
    gpt2 = GPT2LMHeadModel(
        GPT2Config(
            vocab_size=cfg.vocab_size,
            n_embd=cfg.hidden_size,
            n_layer=cfg.num_layers,
            n_head=cfg.num_heads,
            n_positions=max(cfg.prompts) + cfg.new_tokens + 1,
            attn_implementation="sdpa",
        )
    ).eval()
    return {"lean_cache": lean, "lean_no_cache": lean, "hf_gpt2_cache": gpt2}


def _generate_seconds(model, prompt: torch.Tensor, new_tokens: int, use_cache: bool) -> float:
    kwargs = dict(do_sample=False, use_cache=use_cache, pad_token_id=0, eos_token_id=None)
    start = time.perf_counter()
    with torch.no_grad():
        out = model.generate(prompt, max_new_tokens=new_tokens, min_new_tokens=new_tokens, **kwargs)
    elapsed = time.perf_counter() - start
    assert out.shape[1] == prompt.shape[1] + new_tokens
    return elapsed


def per_token_ms(model, prompt: torch.Tensor, cfg: GenerationBenchConfig, use_cache: bool) -> float:
    samples = []
    for _ in range(cfg.repeats):
        first = _generate_seconds(model, prompt, 1, use_cache)
        full = _generate_seconds(model, prompt, 1 + cfg.new_tokens, use_cache)
        samples.append(max(full - first, 0.0) / cfg.new_tokens * 1e3)
    return statistics.median(samples)


def run(cfg: GenerationBenchConfig, progress: Callable[[str], None] = logger.info) -> List[Row]:
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    models = build_models(cfg)
    rows = []
    for length in cfg.prompts:
        prompt = torch.randint(4, cfg.vocab_size, (1, length), generator=torch.Generator().manual_seed(length))
        for variant, model in models.items():
            _generate_seconds(model, prompt[:, :8], 2, variant != "lean_no_cache")  # warm-up
            ms = per_token_ms(model, prompt, cfg, use_cache=variant != "lean_no_cache")
            rows.append(Row(variant=variant, prompt=length, ms_per_token=ms))
            progress(f"{variant} prompt {length}: {ms:.2f} ms/token")
    for row in rows:
        reference = next(r for r in rows if r.variant == "lean_cache" and r.prompt == row.prompt)
        row.ratio_to_lean_cache = row.ms_per_token / reference.ms_per_token if reference.ms_per_token else None
    return rows


def growth(rows: List[Row], variant: str) -> Optional[float]:
    """log-log slope of ms/token against prompt length, shortest to longest prompt."""
    mine = sorted((r for r in rows if r.variant == variant), key=lambda r: r.prompt)
    if len(mine) < 2 or mine[0].ms_per_token <= 0 or mine[-1].ms_per_token <= 0:
        return None
    return math.log(mine[-1].ms_per_token / mine[0].ms_per_token) / math.log(mine[-1].prompt / mine[0].prompt)


def table(rows: List[Row], cfg: GenerationBenchConfig) -> str:
    variants = list(dict.fromkeys(r.variant for r in rows))
    head = "| prompt tokens | " + " | ".join(f"{v} ms/token" for v in variants) + " | no_cache / cache |"
    lines = [head, "|" + "---|" * (len(variants) + 2)]
    for length in cfg.prompts:
        cells = {r.variant: r for r in rows if r.prompt == length}
        ratio = cells["lean_no_cache"].ratio_to_lean_cache
        ratio_text = "n/a" if ratio is None else f"{ratio:.1f}x"
        lines.append(
            f"| {length} | " + " | ".join(f"{cells[v].ms_per_token:.2f}" for v in variants) + f" | {ratio_text} |"
        )
    slopes = " | ".join(f"{growth(rows, v):.2f}" if growth(rows, v) is not None else "n/a" for v in variants)
    lines.append(f"| growth (log-log slope) | {slopes} | |")
    return "\n".join(lines)


def write_plot(rows: List[Row], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for variant in dict.fromkeys(r.variant for r in rows):
        mine = [r for r in rows if r.variant == variant]
        ax.plot([r.prompt for r in mine], [r.ms_per_token for r in mine], marker="o", label=variant)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("prompt length (tokens)")
    ax.set_ylabel("ms per generated token (median)")
    ax.set_title("greedy generation, time per new token")
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)


def parse_args(argv=None) -> tuple:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.generation", description=__doc__.split("\n\n")[0])
    defaults = GenerationBenchConfig()
    parser.add_argument("--hidden_size", type=int, default=defaults.hidden_size)
    parser.add_argument("--num_layers", type=int, default=defaults.num_layers)
    parser.add_argument("--num_heads", type=int, default=defaults.num_heads)
    parser.add_argument("--vocab_size", type=int, default=defaults.vocab_size)
    parser.add_argument("--prompts", default=",".join(map(str, defaults.prompts)), help="comma-separated lengths")
    parser.add_argument("--new_tokens", type=int, default=defaults.new_tokens)
    parser.add_argument("--repeats", type=int, default=defaults.repeats)
    parser.add_argument("--threads", type=int, default=defaults.threads)
    parser.add_argument("--json", type=Path, default=None, help="write the rows here")
    parser.add_argument("--plot", type=Path, default=None, help="write a PNG chart here")
    args = parser.parse_args(argv)
    try:
        prompts = tuple(int(p) for p in args.prompts.split(","))
        cfg = GenerationBenchConfig(
            hidden_size=args.hidden_size,
            num_layers=args.num_layers,
            num_heads=args.num_heads,
            vocab_size=args.vocab_size,
            prompts=prompts,
            new_tokens=args.new_tokens,
            repeats=args.repeats,
            threads=args.threads,
        )
    except ValueError as e:
        parser.error(str(e))
    return cfg, args.json, args.plot


def main(argv=None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    cfg, json_path, plot_path = parse_args(argv)
    rows = run(cfg)
    header = (
        f"`{shlex.join(['python', '-m', 'benchmarks.generation', *(sys.argv[1:] if argv is None else argv)])}`  \n"
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, {platform.processor() or platform.machine()}"
        f"; hidden {cfg.hidden_size}, {cfg.num_layers} layers, vocab {cfg.vocab_size}, {cfg.new_tokens} new tokens\n"
    )
    print(header)
    print(table(rows, cfg))
    if json_path is not None:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps(dict(config=asdict(cfg), rows=[asdict(r) for r in rows]), indent=2))
    if plot_path is not None:
        write_plot(rows, plot_path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
