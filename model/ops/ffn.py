"""Transformer FFN sub-layer: LN -> up projection -> activation (GELU / gated GeGLU) -> down projection
-> [sandwich LN] -> dropout -> [+ residual].

``LeanFFNFunction`` saves only the layer input and the pre-activation. Layer norm and activation are
recomputed in backward and the hidden-dropout mask is regenerated from its seed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn as nn

from model.ops.activations import activate, activate_backward
from model.ops.norm import layer_norm, layer_norm_with_stats
from model.ops.projection import ComputeContext, project, project_backward, projection_params
from model.ops.sublayer import no_autocast, norm_input_backward, tail_backward, tail_forward, tail_plain


@dataclass(frozen=True, eq=False)
class FFNSpec:
    """Everything about one FFN call that is not a tensor."""

    up: nn.Module
    down: nn.Module
    activation: str
    gated: bool
    eps: float
    dropout_p: float
    dropout_seed: Optional[int]
    residual: bool
    compute: ComputeContext


def ffn_plain(x, norm_w, norm_b, sandwich_w, sandwich_b, spec: FFNSpec) -> torch.Tensor:
    """Plain-autograd reference (keeps every intermediate for backward)."""
    normed = layer_norm(x, norm_w, norm_b, spec.eps).to(spec.compute.dtype)
    hidden = activate(spec.up(normed), spec.activation, spec.gated)
    y = spec.down(hidden)
    return tail_plain(y, x, sandwich_w, sandwich_b, spec.eps, spec.dropout_p, spec.dropout_seed, spec.residual)


def ffn_custom(x, norm_w, norm_b, sandwich_w, sandwich_b, spec: FFNSpec) -> torch.Tensor:
    params = projection_params(spec.up) + projection_params(spec.down)
    return LeanFFNFunction.apply(x, norm_w, norm_b, sandwich_w, sandwich_b, spec, *params)


class LeanFFNFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, norm_w, norm_b, sandwich_w, sandwich_b, spec: FFNSpec, *params):
        compute = spec.compute
        with no_autocast(compute.device_type):
            normed = layer_norm(x, norm_w, norm_b, spec.eps).to(compute.dtype)
            pre_activation = project(spec.up, normed, compute)
            del normed
            y = project(spec.down, activate(pre_activation, spec.activation, spec.gated), compute)
            out, pre_sandwich = tail_forward(
                y, x, sandwich_w, sandwich_b, spec.eps, spec.dropout_p, spec.dropout_seed, spec.residual
            )
        ctx.spec = spec
        ctx.norm = (norm_w, norm_b)
        ctx.sandwich = (sandwich_w, sandwich_b)
        ctx.save_for_backward(x, pre_activation, pre_sandwich)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        spec: FFNSpec = ctx.spec
        compute = spec.compute
        x, pre_activation, pre_sandwich = ctx.saved_tensors
        norm_w, norm_b = ctx.norm
        with no_autocast(compute.device_type):
            grad_y, grad_sw, grad_sb = tail_backward(
                grad_out, pre_sandwich, *ctx.sandwich, spec.eps, spec.dropout_p, spec.dropout_seed, compute.dtype
            )
            hidden = activate(pre_activation, spec.activation, spec.gated)
            grad_hidden, down_grads = project_backward(spec.down, hidden, grad_y, compute)
            del hidden, grad_y
            grad_pre = activate_backward(grad_hidden, pre_activation, spec.activation, spec.gated)
            del grad_hidden
            normed, mean, rstd = layer_norm_with_stats(x, norm_w, norm_b, spec.eps)
            grad_normed, up_grads = project_backward(spec.up, normed.to(compute.dtype), grad_pre, compute)
            del normed, grad_pre
            grad_x, grad_nw, grad_nb = norm_input_backward(
                grad_normed, x, mean, rstd, norm_w, norm_b, grad_out, spec.residual
            )
        return (grad_x, grad_nw, grad_nb, grad_sw, grad_sb, None, *up_grads, *down_grads)
