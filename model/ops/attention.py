"""Self-attention sub-layer: LN -> QKV projection -> rotary -> attention core -> out projection
-> [sandwich LN] -> dropout -> [+ residual].

``LeanAttentionFunction`` saves the layer input, q/k/v (rotary applied in place, one [.., 3*hidden]
buffer), the attention output and the per-row logsumexp: about 5 x hidden values per token and
nothing of size (seq x seq). Layer norm is recomputed in backward, the rotary rotation is undone on
the gradients (it is orthogonal), the padding mask is rebuilt from the [batch, seq] boolean mask and
both dropout masks are regenerated from seeds.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Tuple

import torch
import torch.nn as nn

from model.ops.attention_core import (
    attention_backward,
    attention_forward,
    attention_over_cache,
    attention_reference,
)
from model.ops.norm import layer_norm, layer_norm_with_stats
from model.ops.projection import ComputeContext, project, project_backward, projection_params
from model.ops.rotary import rotate, rotate_, rotate_inverse_into
from model.ops.sublayer import no_autocast, norm_input_backward, tail_backward, tail_forward, tail_plain


@dataclass(frozen=True, eq=False)
class AttentionSpec:
    """Everything about one attention call that is not a tensor."""

    qkv: nn.Module
    out: nn.Module
    num_heads: int
    causal: bool
    eps: float
    attn_dropout_p: float
    attn_dropout_seed: Optional[int]
    dropout_p: float
    dropout_seed: Optional[int]
    residual: bool
    compute: ComputeContext


def _split_heads(qkv: torch.Tensor, num_heads: int) -> torch.Tensor:
    """[batch, seq, 3 * hidden] -> view [batch, seq, 3, heads, head_dim]."""
    b, s, three_hidden = qkv.shape
    return qkv.view(b, s, 3, num_heads, three_hidden // (3 * num_heads))


def _heads_first(heads: torch.Tensor):
    """[batch, seq, 3, heads, head_dim] -> q, k, v views of shape [batch, heads, seq, head_dim]."""
    return tuple(heads[:, :, index].transpose(1, 2) for index in range(3))


def _unflatten_heads(flat: torch.Tensor, num_heads: int) -> torch.Tensor:
    """[batch, seq, hidden] -> view [batch, heads, seq, head_dim]."""
    b, s, hidden = flat.shape
    return flat.reshape(b, s, num_heads, hidden // num_heads).transpose(1, 2)


def attention_plain(
    x, norm_w, norm_b, sandwich_w, sandwich_b, cos, sin, key_padding_mask, spec: AttentionSpec
) -> torch.Tensor:
    """Plain-autograd reference: materialises the attention probabilities."""
    normed = layer_norm(x, norm_w, norm_b, spec.eps).to(spec.compute.dtype)
    q, k, v = _split_heads(spec.qkv(normed), spec.num_heads).unbind(2)
    if cos is not None:
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
    attn = attention_reference(
        q.transpose(1, 2),
        k.transpose(1, 2),
        v.transpose(1, 2),
        spec.causal,
        key_padding_mask,
        spec.attn_dropout_p,
        spec.attn_dropout_seed,
    )
    y = spec.out(attn.transpose(1, 2).flatten(2))
    return tail_plain(y, x, sandwich_w, sandwich_b, spec.eps, spec.dropout_p, spec.dropout_seed, spec.residual)


# appends the new keys and values ([batch, heads, new, head_dim]) to a layer's cache and returns all of them
CacheUpdate = Callable[[torch.Tensor, torch.Tensor], Tuple[torch.Tensor, torch.Tensor]]


def attention_cached(
    x, norm_w, norm_b, sandwich_w, sandwich_b, cos, sin, key_padding_mask, spec: AttentionSpec, update: CacheUpdate
) -> torch.Tensor:
    """Inference with a KV cache (no dropout): attention_plain for the new tokens only; ``cos``/``sin`` are the
    new tokens' rotary tables and ``key_padding_mask`` covers every key, cached ones included."""
    normed = layer_norm(x, norm_w, norm_b, spec.eps).to(spec.compute.dtype)
    q, k, v = _split_heads(spec.qkv(normed), spec.num_heads).unbind(2)
    if cos is not None:
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
    keys, values = update(k.transpose(1, 2), v.transpose(1, 2))
    attn = attention_over_cache(q.transpose(1, 2), keys, values, key_padding_mask)
    y = spec.out(attn.transpose(1, 2).flatten(2))
    return tail_plain(y, x, sandwich_w, sandwich_b, spec.eps, 0.0, None, spec.residual)


def attention_custom(
    x, norm_w, norm_b, sandwich_w, sandwich_b, cos, sin, key_padding_mask, spec: AttentionSpec
) -> torch.Tensor:
    params = projection_params(spec.qkv) + projection_params(spec.out)
    return LeanAttentionFunction.apply(
        x, norm_w, norm_b, sandwich_w, sandwich_b, cos, sin, key_padding_mask, spec, *params
    )


class LeanAttentionFunction(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx, x, norm_w, norm_b, sandwich_w, sandwich_b, cos, sin, key_padding_mask, spec: AttentionSpec, *params
    ):
        compute = spec.compute
        with no_autocast(compute.device_type):
            normed = layer_norm(x, norm_w, norm_b, spec.eps).to(compute.dtype)
            qkv = project(spec.qkv, normed, compute)
            del normed
            heads = _split_heads(qkv, spec.num_heads)
            if cos is not None:  # rotate q and k in place: the saved buffer holds rotated q, k
                rotate_(heads[:, :, 0], cos, sin)
                rotate_(heads[:, :, 1], cos, sin)
            q, k, v = _heads_first(heads)
            attn, lse = attention_forward(
                q, k, v, spec.causal, key_padding_mask, spec.attn_dropout_p, spec.attn_dropout_seed
            )
            attn_flat = attn.transpose(1, 2).reshape(x.shape[0], x.shape[1], -1)  # a view, no copy
            y = project(spec.out, attn_flat, compute)
            out, pre_sandwich = tail_forward(
                y, x, sandwich_w, sandwich_b, spec.eps, spec.dropout_p, spec.dropout_seed, spec.residual
            )
        ctx.spec = spec
        ctx.norm = (norm_w, norm_b)
        ctx.sandwich = (sandwich_w, sandwich_b)
        ctx.save_for_backward(x, qkv, attn_flat, lse, cos, sin, key_padding_mask, pre_sandwich)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        spec: AttentionSpec = ctx.spec
        compute = spec.compute
        x, qkv, attn_flat, lse, cos, sin, key_padding_mask, pre_sandwich = ctx.saved_tensors
        norm_w, norm_b = ctx.norm
        with no_autocast(compute.device_type):
            grad_y, grad_sw, grad_sb = tail_backward(
                grad_out, pre_sandwich, *ctx.sandwich, spec.eps, spec.dropout_p, spec.dropout_seed, compute.dtype
            )
            grad_attn_flat, out_grads = project_backward(spec.out, attn_flat, grad_y, compute)
            del grad_y
            q, k, v = _heads_first(_split_heads(qkv, spec.num_heads))
            grads_qkv = attention_backward(
                _unflatten_heads(grad_attn_flat, spec.num_heads),
                q,
                k,
                v,
                _unflatten_heads(attn_flat, spec.num_heads),
                lse,
                spec.causal,
                key_padding_mask,
                spec.attn_dropout_p,
                spec.attn_dropout_seed,
            )
            del grad_attn_flat
            grad_qkv = torch.empty_like(qkv)
            grad_heads = _split_heads(grad_qkv, spec.num_heads)
            for index, grad in enumerate(grads_qkv):  # back to [batch, seq, heads, dim], un-rotating q and k
                target = grad_heads[:, :, index]
                if cos is not None and index < 2:
                    rotate_inverse_into(grad.transpose(1, 2), cos, sin, out=target)
                else:
                    target.copy_(grad.transpose(1, 2))
            del grads_qkv
            normed, mean, rstd = layer_norm_with_stats(x, norm_w, norm_b, spec.eps)
            grad_normed, qkv_grads = project_backward(spec.qkv, normed.to(compute.dtype), grad_qkv, compute)
            del normed, grad_qkv, grad_heads
            grad_x, grad_nw, grad_nb = norm_input_backward(
                grad_normed, x, mean, rstd, norm_w, norm_b, grad_out, spec.residual
            )
        return (grad_x, grad_nw, grad_nb, grad_sw, grad_sb, None, None, None, None, *qkv_grads, *out_grads)
