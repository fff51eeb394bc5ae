"""Build the model a trainer trains: config preset, deterministic init, memory options, device, precision."""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass
from typing import Optional

import torch

from model import LeanGPTForCausalLM, load_config
from model import apply_memory_options as model_memory_options
from peer.swarm.config import TrainingArguments

logger = logging.getLogger(__name__)

# TrainingArguments fields that are model memory options (model.apply_memory_options keywords)
MEMORY_OPTION_FIELDS = (
    "checkpoint_layers",
    "custom_ffn",
    "custom_attention",
    "loss_chunk_size",
    "reversible_chunk_tokens",
    "reversible_chunk_heads",
)


@dataclass
class Placement:
    """Where and in what precision the model runs."""

    device: torch.device
    autocast_dtype: Optional[torch.dtype]  # None: no autocast (fp32)

    @property
    def uses_grad_scaler(self) -> bool:
        return self.autocast_dtype == torch.float16

    def autocast(self):
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=self.autocast_dtype)


def choose_placement(args: TrainingArguments) -> Placement:
    """Resolve device and precision; CUDA-only choices on a machine without CUDA are an error, not a crash."""
    cuda = torch.cuda.is_available()
    if args.device == "cuda" and not cuda:
        raise ValueError("device=cuda but no CUDA device is available; use --device cpu (or auto)")
    device = torch.device("cuda" if args.device == "cuda" or (args.device == "auto" and cuda) else "cpu")
    precision = args.precision
    if precision == "auto":
        precision = "fp16" if device.type == "cuda" else "fp32"
    if precision in ("fp16", "bf16") and device.type != "cuda":
        raise ValueError(f"precision={precision} needs a CUDA device; on CPU use --precision fp32 (or auto)")
    if precision == "bf16" and not torch.cuda.is_bf16_supported():
        raise ValueError("this GPU does not support bf16; use --precision fp16")
    dtype = {"fp32": None, "fp16": torch.float16, "bf16": torch.bfloat16}[precision]
    return Placement(device=device, autocast_dtype=dtype)


def apply_memory_options(model: torch.nn.Module, args: TrainingArguments) -> None:
    """The one place where memory options are applied to a built model (model/ owns how)."""
    options = {name: getattr(args, name) for name in MEMORY_OPTION_FIELDS if getattr(args, name) is not None}
    if args.per_block_grad_scaling:  # off is the model's default: only passed when asked for
        options["per_block_grad_scaling"] = True
    if options:
        model_memory_options(model, **options)
        logger.info("Memory options: %s", ", ".join(f"{k}={v}" for k, v in options.items()))


def check_memory_options(args: TrainingArguments) -> None:
    """Apply the memory options to a parameter-less (meta) copy of the model, so a combination the model
    refuses (e.g. per-block gradient scaling with shared matrices) is reported before joining."""
    apply_memory_options(LeanGPTForCausalLM.build(load_config(args.model_config), device="meta"), args)


def build_model(args: TrainingArguments, placement: Placement) -> LeanGPTForCausalLM:
    config = load_config(args.model_config)
    # every peer draws the same initial parameters, so a swarm that starts together agrees from step 0
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(args.init_seed)
        model = LeanGPTForCausalLM(config)
    apply_memory_options(model, args)
    model.to(placement.device)
    model.train()
    num_params = sum(p.numel() for p in model.parameters())
    logger.info("Model %s: %.2fM parameters on %s", args.model_config, num_params / 1e6, placement.device)
    return model
