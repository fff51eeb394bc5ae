"""Transformer sub-layers (attention, FFN) and one pre-norm transformer layer.

Each sub-layer picks its implementation per call: the custom-backward Function (``custom=True``) or
the plain-autograd composition (the reference), both over the same parameters. Projections are built
by ``model.linear.make_linear`` so PixelFly and shared-matrix + adapter layers plug in.
"""

from __future__ import annotations

import dataclasses
from typing import Dict, Optional

import torch
import torch.nn as nn

from model.config import LeanTransformerConfig
from model.grad_scaling import BranchGradScale
from model.linear import make_linear
from model.ops.attention import AttentionSpec, CacheUpdate, attention_cached, attention_custom, attention_plain
from model.ops.dropout import draw_seed
from model.ops.ffn import FFNSpec, ffn_custom, ffn_plain
from model.ops.projection import ComputeContext
from model.ops.rotary import RotaryTables


def make_projection(
    config: LeanTransformerConfig, in_features: int, out_features: int, shared: Optional[nn.Module] = None
) -> nn.Module:
    """A dense, PixelFly or shared + adapter projection, as the config asks."""
    return make_linear(
        in_features,
        out_features,
        block_size=config.block_size,
        lowrank_dim=config.lowrank_dim,
        shared=shared,
        adapter_dim=config.adapter_dim,
    )


def _norm(config: LeanTransformerConfig) -> nn.LayerNorm:
    return nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)


def _norm_params(norm: Optional[nn.LayerNorm]):
    return (None, None) if norm is None else (norm.weight, norm.bias)


class _PreNormSublayer(nn.Module):
    """What attention and FFN share: pre-norm, optional sandwich norm, hidden dropout, residual flag
    and the choice between the custom-backward Function (``custom``) and plain autograd."""

    def __init__(self, config: LeanTransformerConfig, residual: bool, custom: bool):
        super().__init__()
        self.dropout_p = config.hidden_dropout_prob
        self.eps = config.layer_norm_eps
        self.residual = residual
        self.custom = custom
        self.norm = _norm(config)
        self.sandwich_norm = _norm(config) if config.norm_scheme == "sandwich" else None
        # per-block gradient scaling (model.grad_scaling), switched on by model.memory.apply_memory_options
        self.grad_scale: Optional[BranchGradScale] = None

    def _compute_context(self, hidden: torch.Tensor) -> ComputeContext:
        return ComputeContext.current(hidden.device, self.norm.weight.dtype)

    def _forward_with_spec(self, hidden: torch.Tensor, run) -> torch.Tensor:
        """``run(x, spec)``; with per-block gradient scaling the branch runs without its residual add,
        which is done here, outside the scaled branch (the residual stream's gradient stays unscaled)."""
        spec = self.spec(hidden)
        if self.grad_scale is None:
            return run(hidden, spec)
        branch = self.grad_scale.branch(hidden, lambda x: run(x, dataclasses.replace(spec, residual=False)))
        return hidden + branch if self.residual else branch


class LeanSelfAttention(_PreNormSublayer):
    """Pre-norm self-attention; returns x + attn(x), or attn(x) alone when ``residual`` is False."""

    def __init__(
        self, config: LeanTransformerConfig, shared: Optional[Dict[str, nn.Module]] = None, residual: bool = True
    ):
        super().__init__(config, residual, config.custom_attention)
        shared = shared or {}
        hidden = config.hidden_size
        self.num_heads = config.num_attention_heads
        self.causal = config.attention_type == "causal"
        self.attn_dropout_p = config.attention_probs_dropout_prob
        self.qkv = make_projection(config, hidden, 3 * hidden, shared.get("qkv"))
        self.out = make_projection(config, hidden, hidden, shared.get("out"))

    def spec(self, hidden: torch.Tensor) -> AttentionSpec:
        """The non-tensor part of one call; draws the dropout seeds (global RNG), as forward does."""
        return AttentionSpec(
            qkv=self.qkv,
            out=self.out,
            num_heads=self.num_heads,
            causal=self.causal,
            eps=self.eps,
            attn_dropout_p=self.attn_dropout_p,
            attn_dropout_seed=draw_seed(self.attn_dropout_p, self.training),
            dropout_p=self.dropout_p,
            dropout_seed=draw_seed(self.dropout_p, self.training),
            residual=self.residual,
            compute=self._compute_context(hidden),
        )

    def forward(
        self,
        hidden: torch.Tensor,
        rotary: Optional[RotaryTables] = None,
        key_padding_mask: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        return self._forward_with_spec(hidden, lambda x, spec: self.run(x, spec, rotary, key_padding_mask))

    def run(
        self,
        hidden: torch.Tensor,
        spec: AttentionSpec,
        rotary: Optional[RotaryTables] = None,
        key_padding_mask: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        cos, sin = rotary if rotary is not None else (None, None)
        run = attention_custom if self.custom else attention_plain
        return run(
            hidden,
            self.norm.weight,
            self.norm.bias,
            *_norm_params(self.sandwich_norm),
            cos,
            sin,
            key_padding_mask,
            spec,
        )

    def forward_cached(
        self,
        hidden: torch.Tensor,
        rotary: Optional[RotaryTables],
        key_padding_mask: Optional[torch.Tensor],
        update: CacheUpdate,
    ) -> torch.Tensor:
        """Inference on new tokens only: ``update`` appends their keys/values to this layer's KV cache."""
        cos, sin = rotary if rotary is not None else (None, None)
        norms = (self.norm.weight, self.norm.bias, *_norm_params(self.sandwich_norm))
        return attention_cached(hidden, *norms, cos, sin, key_padding_mask, self.spec(hidden), update)


class LeanFFN(_PreNormSublayer):
    """Pre-norm FFN (GELU or gated); returns x + ffn(x), or ffn(x) alone when ``residual`` is False."""

    def __init__(
        self, config: LeanTransformerConfig, shared: Optional[Dict[str, nn.Module]] = None, residual: bool = True
    ):
        super().__init__(config, residual, config.custom_ffn)
        shared = shared or {}
        up_features = config.intermediate_size * (2 if config.gated_ffn else 1)
        self.activation = config.hidden_act
        self.gated = config.gated_ffn
        self.up = make_projection(config, config.hidden_size, up_features, shared.get("up"))
        self.down = make_projection(config, config.intermediate_size, config.hidden_size, shared.get("down"))

    def forward(
        self,
        hidden: torch.Tensor,
        rotary: Optional[RotaryTables] = None,
        key_padding_mask: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        del rotary, key_padding_mask  # same signature as attention, so stacks can treat sub-layers alike
        return self._forward_with_spec(hidden, self.run)

    def spec(self, hidden: torch.Tensor) -> FFNSpec:
        """The non-tensor part of one call; draws the dropout seed (global RNG), as forward does."""
        return FFNSpec(
            up=self.up,
            down=self.down,
            activation=self.activation,
            gated=self.gated,
            eps=self.eps,
            dropout_p=self.dropout_p,
            dropout_seed=draw_seed(self.dropout_p, self.training),
            residual=self.residual,
            compute=self._compute_context(hidden),
        )

    def run(self, hidden: torch.Tensor, spec: FFNSpec) -> torch.Tensor:
        run = ffn_custom if self.custom else ffn_plain
        return run(hidden, self.norm.weight, self.norm.bias, *_norm_params(self.sandwich_norm), spec)


class LeanLayer(nn.Module):
    """One transformer layer: attention then FFN, each a residual sub-layer (or a reversible half)."""

    def __init__(
        self, config: LeanTransformerConfig, shared: Optional[Dict[str, nn.Module]] = None, residual: bool = True
    ):
        super().__init__()
        self.attention = LeanSelfAttention(config, shared, residual)
        self.ffn = LeanFFN(config, shared, residual)

    def forward(
        self,
        hidden: torch.Tensor,
        rotary: Optional[RotaryTables] = None,
        key_padding_mask: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        return self.ffn(self.attention(hidden, rotary, key_padding_mask))
