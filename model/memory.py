"""Memory options, applied to a built model in one place.

They change how the model is computed, never what it computes (the tests prove it against the plain
reference in float64). ``reversible`` is not among them: it is an architecture (config.reversible).
"""

from __future__ import annotations

import logging
from typing import Optional

import torch.nn as nn

from model.layers import LeanFFN, LeanSelfAttention
from model.stack import LayerStack

logger = logging.getLogger(__name__)


def _find_stack(model: nn.Module) -> LayerStack:
    stacks = [module for module in model.modules() if isinstance(module, LayerStack)]
    if len(stacks) != 1:
        raise ValueError(
            f"expected a lean model with exactly one LayerStack, found {len(stacks)} in "
            f"{type(model).__name__}; pass a LeanGPTForCausalLM, LeanAlbertForPreTraining or LeanModel"
        )
    return stacks[0]


def _check_bool(name: str, value) -> None:
    if value is not None and not isinstance(value, bool):
        raise ValueError(f"{name} must be True, False or None (keep), got {value!r}")


def apply_memory_options(
    model: nn.Module,
    *,
    custom_ffn: Optional[bool] = None,
    custom_attention: Optional[bool] = None,
    checkpoint_layers: Optional[bool] = None,
    loss_chunk_size: Optional[int] = None,
) -> nn.Module:
    """Switch memory options on a built lean model (in place) and return it; None keeps the current value.

    custom_ffn / custom_attention: hand-written backward (True) or plain autograd (False).
    checkpoint_layers: keep one hidden state per layer and recompute the layer in backward;
        not allowed with a reversible stack (it already keeps nothing per layer).
    loss_chunk_size: tokens per chunk of the LM loss; 0 computes full logits with plain autograd.
    The model's config is updated too, so save_pretrained records the options.
    """
    for name, value in (
        ("custom_ffn", custom_ffn),
        ("custom_attention", custom_attention),
        ("checkpoint_layers", checkpoint_layers),
    ):
        _check_bool(name, value)
    if loss_chunk_size is not None and (
        isinstance(loss_chunk_size, bool) or not isinstance(loss_chunk_size, int) or loss_chunk_size < 0
    ):
        raise ValueError(
            f"loss_chunk_size must be a non-negative integer (tokens per chunk, 0 = unchunked), got {loss_chunk_size!r}"
        )
    stack = _find_stack(model)
    if checkpoint_layers and stack.reversible:
        raise ValueError(
            "checkpoint_layers=True cannot be used with a reversible stack (config.reversible=True): "
            "reversible layers already keep no activations per layer; leave checkpoint_layers off"
        )
    for module in stack.modules():
        if isinstance(module, LeanFFN) and custom_ffn is not None:
            module.custom = custom_ffn
        if isinstance(module, LeanSelfAttention) and custom_attention is not None:
            module.custom = custom_attention
    if checkpoint_layers is not None:
        stack.checkpoint_layers = checkpoint_layers
    if loss_chunk_size is not None:
        for module in model.modules():
            if hasattr(module, "loss_chunk_size"):
                module.loss_chunk_size = loss_chunk_size
    config = getattr(model, "config", None)
    for name, value in (
        ("custom_ffn", custom_ffn),
        ("custom_attention", custom_attention),
        ("checkpoint_layers", checkpoint_layers),
        ("loss_chunk_size", loss_chunk_size),
    ):
        if value is not None and config is not None:
            setattr(config, name, value)
    logger.info(
        "memory options: custom_ffn=%s custom_attention=%s checkpoint_layers=%s loss_chunk_size=%s (None = unchanged)",
        custom_ffn,
        custom_attention,
        checkpoint_layers,
        loss_chunk_size,
    )
    return model


def use_plain_reference(model: nn.Module) -> nn.Module:
    """Every memory path off: plain autograd sub-layers, no checkpointing, unchunked loss, and a
    reversible stack run through revlib with plain autograd. The reference the tests compare against."""
    apply_memory_options(model, custom_ffn=False, custom_attention=False, checkpoint_layers=False, loss_chunk_size=0)
    _find_stack(model).reversible_memory_savings = False
    return model
