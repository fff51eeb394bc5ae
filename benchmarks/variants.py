"""The models the memory benchmark compares: Hugging Face GPT-2 and the lean model's memory modes.

Each variant knows how to build its model at a given size and depth. Lean modes that the checked
out ``model/`` cannot run yet (the lean internals are built on a separate branch) are reported as
unavailable with the reason, instead of silently measuring something else.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Callable

import torch

import model as lean_model
from model import LeanGPTForCausalLM, LeanTransformerConfig

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class BenchSize:
    """Model and batch dimensions shared by every variant in one run."""

    name: str
    hidden_size: int
    num_heads: int
    intermediate_size: int
    seq_len: int
    batch_size: int
    vocab_size: int
    # full depth; saved bytes per layer = (saved at full depth - saved at half depth) / (layers - half)
    layers: int

    def __post_init__(self):
        for name in ("hidden_size", "num_heads", "intermediate_size", "seq_len", "batch_size", "vocab_size", "layers"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.hidden_size % self.num_heads or (self.hidden_size // self.num_heads) % 2:
            raise ValueError(
                f"hidden_size ({self.hidden_size}) must split into {self.num_heads} heads of even size "
                "(rotary embeddings); e.g. hidden_size=64 * num_heads"
            )
        if self.layers < 2:
            raise ValueError(
                f"layers must be at least 2 (per-layer figures compare full and half depth), got {self.layers}"
            )

    @property
    def half_layers(self) -> int:
        return self.layers // 2

    @property
    def tokens(self) -> int:
        return self.batch_size * self.seq_len


SIZES = {
    "tiny": BenchSize(
        "tiny", hidden_size=64, num_heads=4, intermediate_size=256, seq_len=64, batch_size=2, vocab_size=512, layers=4
    ),
    "small": BenchSize(
        "small",
        hidden_size=256,
        num_heads=4,
        intermediate_size=1024,
        seq_len=256,
        batch_size=2,
        vocab_size=8000,
        layers=4,
    ),
    "default": BenchSize(
        "default",
        hidden_size=1024,
        num_heads=16,
        intermediate_size=4096,
        seq_len=512,
        batch_size=2,
        vocab_size=32000,
        layers=4,
    ),
}


AUTOCAST_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


@dataclasses.dataclass(frozen=True)
class Variant:
    """One row of the benchmark: a named way to build a model."""

    name: str
    # builds the model (train mode, on CPU) at the given size and depth
    build: Callable[[BenchSize, int], torch.nn.Module]
    # uses activation checkpointing: memory is compared with HF GPT-2 checkpointed
    checkpointed: bool = False
    # autocast dtype name for forward + loss, a key of AUTOCAST_DTYPES (CUDA rows only); None = full precision
    autocast: str | None = None

    @property
    def autocast_dtype(self) -> torch.dtype | None:
        return None if self.autocast is None else AUTOCAST_DTYPES[self.autocast]


def hf_gpt2_builder(attention: str, checkpointing: bool) -> Callable[[BenchSize, int], torch.nn.Module]:
    """GPT2LMHeadModel at the benchmark size, dropout off (the lean model runs with dropout 0)."""

    def build(size: BenchSize, layers: int) -> torch.nn.Module:
        from transformers import GPT2Config, GPT2LMHeadModel

        config = GPT2Config(
            vocab_size=size.vocab_size,
            n_positions=size.seq_len,
            n_embd=size.hidden_size,
            n_layer=layers,
            n_head=size.num_heads,
            n_inner=size.intermediate_size,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
            use_cache=False,
            bos_token_id=0,
            eos_token_id=0,
            attn_implementation=attention,
        )
        model = GPT2LMHeadModel(config)
        model.loss_type = "ForCausalLM"  # the default, named to silence transformers' "unrecognized" warning
        if checkpointing:
            # transformers 5 renamed gradient_checkpointing_enable (non-reentrant checkpoint in both)
            enable = getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable
            enable()
        return model.train()

    return build


def lean_config(size: BenchSize, layers: int, **overrides) -> LeanTransformerConfig:
    return LeanTransformerConfig(
        vocab_size=size.vocab_size,
        hidden_size=size.hidden_size,
        num_hidden_layers=layers,
        num_attention_heads=size.num_heads,
        intermediate_size=size.intermediate_size,
        max_position_embeddings=size.seq_len,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        **overrides,
    )


def lean_builder(
    *, reversible: bool = False, architecture: dict | None = None, **memory_options
) -> Callable[[BenchSize, int], torch.nn.Module]:
    """LeanGPTForCausalLM with rotary positions; ``architecture`` holds more config fields (sharing,
    PixelFly), ``memory_options`` go to ``apply_memory_options``."""

    def build(size: BenchSize, layers: int) -> torch.nn.Module:
        model = LeanGPTForCausalLM(lean_config(size, layers, reversible=reversible, **(architecture or {})))
        if memory_options:
            model = lean_model.apply_memory_options(model, **memory_options)
        return model.train()

    return build


# chunks of the reversible backward in the lean_reversible_chunked row: FFN tokens, attention heads
REV_CHUNK_TOKENS, REV_CHUNK_HEADS = 256, 4
# with the default 256-token loss chunk the LM head's logits (31.25 MiB at the default size) set that row's peak
REV_LOSS_CHUNK = 128


def base_variants() -> list[Variant]:
    """The full-precision rows, references first."""
    return [
        Variant("hf_gpt2_eager", hf_gpt2_builder("eager", False)),
        Variant("hf_gpt2_sdpa", hf_gpt2_builder("sdpa", False)),
        Variant("hf_gpt2_eager_ckpt", hf_gpt2_builder("eager", True), checkpointed=True),
        Variant("hf_gpt2_sdpa_ckpt", hf_gpt2_builder("sdpa", True), checkpointed=True),
        Variant("lean_default", lean_builder()),
        Variant("lean_no_custom", lean_builder(custom_ffn=False, custom_attention=False)),
        Variant("lean_ckpt", lean_builder(checkpoint_layers=True), checkpointed=True),
        Variant("lean_reversible", lean_builder(reversible=True)),
        Variant(
            "lean_reversible_chunked",
            lean_builder(
                reversible=True,
                reversible_chunk_tokens=REV_CHUNK_TOKENS,
                reversible_chunk_heads=REV_CHUNK_HEADS,
                loss_chunk_size=REV_LOSS_CHUNK,
            ),
        ),
    ]


AUTOCAST_BASES = ("hf_gpt2_eager", "hf_gpt2_sdpa", "lean_default")


def autocast_variants() -> list[Variant]:
    """bf16/fp16 autocast rows (run on CUDA only)."""
    by_name = {variant.name: variant for variant in base_variants()}
    return [
        dataclasses.replace(by_name[base], name=f"{base}_{suffix}", autocast=suffix)
        for suffix in AUTOCAST_DTYPES
        for base in AUTOCAST_BASES
    ]


@functools.cache
def _reversible_is_implemented() -> bool:
    """True when ``reversible=True`` changes the model's output (the plain model ignores the flag)."""
    size = SIZES["tiny"]
    input_ids = torch.randint(0, size.vocab_size, (1, 8), generator=torch.Generator().manual_seed(0))
    losses = []
    for reversible in (False, True):
        torch.manual_seed(0)
        model = LeanGPTForCausalLM(lean_config(size, 2, reversible=reversible)).eval()
        with torch.no_grad():
            losses.append(model(input_ids=input_ids, labels=input_ids).loss)
    return not torch.equal(*losses)


def unavailable_reason(name: str) -> str | None:
    """Why a lean mode cannot be measured with the checked-out ``model/``; None if it can."""
    if name not in ("lean_no_custom", "lean_ckpt", "lean_reversible", "lean_reversible_chunked"):
        return None
    if not hasattr(lean_model, "apply_memory_options"):
        return "model.apply_memory_options does not exist yet (lean internals not merged)"
    if name.startswith("lean_reversible") and not _reversible_is_implemented():
        return "LeanTransformerConfig(reversible=True) is accepted but not implemented (output unchanged)"
    return None
