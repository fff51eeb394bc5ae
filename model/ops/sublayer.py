"""Pieces shared by the FFN and attention sub-layers: the pre-norm input and the output tail
(optional sandwich norm -> hidden dropout -> residual add), in plain and custom-backward forms."""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from model.ops.dropout import keep_mask, seeded_dropout, seeded_dropout_
from model.ops.norm import layer_norm, layer_norm_backward, layer_norm_with_stats


def no_autocast(device_type: str):
    """Custom Functions cast explicitly (see ComputeContext), so autocast must not re-cast inside them."""
    return torch.autocast(device_type, enabled=False)


def tail_plain(
    y: torch.Tensor,
    x: torch.Tensor,
    sandwich_w: Optional[torch.Tensor],
    sandwich_b: Optional[torch.Tensor],
    eps: float,
    dropout_p: float,
    seed: Optional[int],
    residual: bool,
) -> torch.Tensor:
    """Plain-autograd output tail; the result has the residual (input) dtype."""
    if sandwich_w is not None:
        y = layer_norm(y, sandwich_w, sandwich_b, eps)
    y = seeded_dropout(y, dropout_p, seed).to(x.dtype)
    return x + y if residual else y


def tail_forward(
    y: torch.Tensor,
    x: torch.Tensor,
    sandwich_w,
    sandwich_b,
    eps: float,
    dropout_p: float,
    seed: Optional[int],
    residual: bool,
) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Output tail without autograd; returns (output, pre-sandwich tensor to save or None)."""
    pre_sandwich = None
    if sandwich_w is not None:
        pre_sandwich, y = y, layer_norm(y, sandwich_w, sandwich_b, eps)
    y = seeded_dropout_(y, dropout_p, seed).to(x.dtype)
    return (y.add_(x) if residual else y), pre_sandwich


def tail_backward(
    grad_out: torch.Tensor,
    pre_sandwich: Optional[torch.Tensor],
    sandwich_w,
    sandwich_b,
    eps: float,
    dropout_p: float,
    seed: Optional[int],
    dtype: torch.dtype,
):
    """Gradient w.r.t. the projection output y (in ``dtype``) and the sandwich norm's parameters."""
    grad_y = grad_out.to(dtype)
    if seed is not None:  # replay the dropout mask instead of having saved it
        grad_y = grad_y * keep_mask(grad_y.shape, dropout_p, seed, grad_y.device, grad_y.dtype)
    grad_sw = grad_sb = None
    if pre_sandwich is not None:
        _, mean, rstd = layer_norm_with_stats(pre_sandwich, sandwich_w, sandwich_b, eps)
        grad_y, grad_sw, grad_sb = layer_norm_backward(grad_y, pre_sandwich, mean, rstd, sandwich_w, sandwich_b)
    return grad_y, grad_sw, grad_sb


def norm_input_backward(
    grad_normed: torch.Tensor,
    x: torch.Tensor,
    mean: torch.Tensor,
    rstd: torch.Tensor,
    norm_w,
    norm_b,
    grad_out: torch.Tensor,
    residual: bool,
):
    """Backward of the pre-norm plus the residual branch: (grad_x, grad_norm_w, grad_norm_b)."""
    grad_x, grad_w, grad_b = layer_norm_backward(grad_normed, x, mean, rstd, norm_w, norm_b)
    if residual:
        grad_x = grad_x.add_(grad_out.to(grad_x.dtype))
    return grad_x, grad_w, grad_b
