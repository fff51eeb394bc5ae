"""Memory options, applied to a built model in one place.

They change how the model is computed, never what it computes (the tests prove it against the plain
reference in float64). ``reversible`` is not among them: it is an architecture (config.reversible).
"""

from __future__ import annotations

import logging
from typing import Optional

import torch.nn as nn

from model.grad_scaling import OUTSIDE, BlockGradScales, BranchGradScale
from model.layers import LeanFFN, LeanSelfAttention
from model.reversible import ReversibleChunks
from model.stack import CHUNKED_REVERSIBLE_SCALING_ERROR, LayerStack

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
    reversible_chunk_tokens: Optional[int] = None,
    reversible_chunk_heads: Optional[int] = None,
    per_block_grad_scaling: Optional[bool] = None,
) -> nn.Module:
    """Switch memory options on a built lean model (in place) and return it; None keeps the current value.

    custom_ffn / custom_attention: hand-written backward (True) or plain autograd (False).
    checkpoint_layers: keep one hidden state per layer and recompute the layer in backward;
        not allowed with a reversible stack (it already keeps nothing per layer).
    loss_chunk_size: tokens per chunk of the LM loss; 0 computes full logits with plain autograd.
    reversible_chunk_tokens / reversible_chunk_heads: a reversible stack computes its FFN backward this
        many tokens and its attention backward this many heads at a time (0 = all at once; both 0 keep
        revlib's whole-sub-layer backward); ignored by a non-reversible stack.
    per_block_grad_scaling: every attention/FFN branch gets its own gradient scale factor for fp16 training
        (model.grad_scaling; all factors start at 1, the trainer's scaler sets them); works with plain,
        checkpointed and revlib-reversible stacks, not with shared large matrices or a chunked reversible
        backward. Training state, so not recorded in the config.
    The model's config is updated too, so save_pretrained records the options.
    """
    for name, value in (
        ("custom_ffn", custom_ffn),
        ("custom_attention", custom_attention),
        ("checkpoint_layers", checkpoint_layers),
        ("per_block_grad_scaling", per_block_grad_scaling),
    ):
        _check_bool(name, value)
    for name, value, unit in (
        ("loss_chunk_size", loss_chunk_size, "tokens per chunk"),
        ("reversible_chunk_tokens", reversible_chunk_tokens, "tokens per chunk"),
        ("reversible_chunk_heads", reversible_chunk_heads, "heads per chunk"),
    ):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
            raise ValueError(f"{name} must be a non-negative integer ({unit}, 0 = unchunked), got {value!r}")
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
    if reversible_chunk_tokens is not None or reversible_chunk_heads is not None:
        current = stack.reversible_chunks
        stack.reversible_chunks = ReversibleChunks(
            current.tokens if reversible_chunk_tokens is None else reversible_chunk_tokens,
            current.heads if reversible_chunk_heads is None else reversible_chunk_heads,
        )
    if per_block_grad_scaling is not None:
        _set_block_grad_scaling(model, stack, per_block_grad_scaling)
    chunked = stack.reversible and (stack.reversible_chunks.tokens or stack.reversible_chunks.heads)
    if stack.grad_scales is not None and chunked:
        raise ValueError(CHUNKED_REVERSIBLE_SCALING_ERROR)
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
        ("reversible_chunk_tokens", reversible_chunk_tokens),
        ("reversible_chunk_heads", reversible_chunk_heads),
    ):
        if value is not None and config is not None:
            setattr(config, name, value)
    logger.info(
        "memory options: custom_ffn=%s custom_attention=%s checkpoint_layers=%s loss_chunk_size=%s "
        "reversible_chunk_tokens=%s reversible_chunk_heads=%s per_block_grad_scaling=%s (None = unchanged)",
        custom_ffn,
        custom_attention,
        checkpoint_layers,
        loss_chunk_size,
        reversible_chunk_tokens,
        reversible_chunk_heads,
        per_block_grad_scaling,
    )
    return model


def _set_block_grad_scaling(model: nn.Module, stack: LayerStack, enabled: bool) -> None:
    """One block per distinct sub-layer module (ALBERT-style groups reuse theirs, so their uses share a scale)."""
    branches = [sub for layer in stack.groups for sub in (layer.attention, layer.ffn)]
    if not enabled:
        stack.grad_scales = None
        for sub in branches:
            sub.grad_scale = None
        return
    config = getattr(model, "config", None)
    if getattr(config, "share_large_matrices", False):
        raise ValueError(
            "per-block gradient scaling needs every block to own its parameters, but share_large_matrices=True "
            "gives all layers the same projection matrices; use a config without shared matrices or turn "
            "per_block_grad_scaling off"
        )
    names = [OUTSIDE] + [
        f"groups.{group}.{kind}" for group in range(len(stack.groups)) for kind in ("attention", "ffn")
    ]
    scales = BlockGradScales(names, branches)
    stack.grad_scales = scales
    for index, sub in enumerate(branches, start=1):
        sub.grad_scale = BranchGradScale(scales, index)


def block_grad_scales(model: nn.Module) -> Optional[BlockGradScales]:
    """The model's per-block gradient scales, or None when per_block_grad_scaling is off."""
    return _find_stack(model).grad_scales


def use_plain_reference(model: nn.Module) -> nn.Module:
    """Every memory path off: plain autograd sub-layers, no checkpointing, unchunked loss, and a
    reversible stack run through revlib with plain autograd. The reference the tests compare against."""
    apply_memory_options(model, custom_ffn=False, custom_attention=False, checkpoint_layers=False, loss_chunk_size=0)
    _find_stack(model).reversible_memory_savings = False
    return model
