"""Build the model a trainer trains: config preset, deterministic init, memory options, device, precision."""
from __future__ import annotations

import contextlib
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

from model import LeanGPTForCausalLM, LeanTransformerConfig
from peer.arguments import TrainingArguments

logger = logging.getLogger(__name__)

MODEL_PRESET_DIR = Path(__file__).resolve().parent.parent / "configs" / "model"


def load_model_config(name_or_path: str) -> LeanTransformerConfig:
    """A preset name (configs/model/<name>.json) or a JSON path; ValueError says what is available."""
    try:
        from model.presets import load_config  # the model package's own preset loader, when present
    except ImportError:
        load_config = None
    if load_config is not None:
        return load_config(name_or_path)
    path = Path(name_or_path)
    if not path.suffix:
        path = MODEL_PRESET_DIR / f"{name_or_path}.json"
    if not path.is_file():
        available = sorted(p.stem for p in MODEL_PRESET_DIR.glob("*.json")) if MODEL_PRESET_DIR.is_dir() else []
        raise ValueError(f"model_config {name_or_path!r}: no such preset or JSON file; available presets: "
                         f"{', '.join(available) or 'none'} (or give a path to a config .json)")
    return LeanTransformerConfig(**json.loads(path.read_text()))


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
    options = {name: getattr(args, name) for name in ("checkpoint_layers", "custom_ffn", "custom_attention",
                                                      "loss_chunk_size") if getattr(args, name) is not None}
    apply = getattr(model, "apply_memory_options", None)
    if apply is not None:
        apply(**options)
    elif options:
        # the plain reference model reads these from its config; set them there until the lean model lands
        for name, value in options.items():
            setattr(model.config, name, value)
    if options:
        logger.info("Memory options: %s", ", ".join(f"{k}={v}" for k, v in options.items()))


def build_model(args: TrainingArguments, placement: Placement) -> LeanGPTForCausalLM:
    config = load_model_config(args.model_config)
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
