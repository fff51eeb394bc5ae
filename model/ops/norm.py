"""Layer norm pieces for custom backward passes: recompute statistics instead of saving outputs."""

from __future__ import annotations

from typing import Optional, Tuple

import torch
import torch.nn.functional as F


def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float) -> torch.Tensor:
    """Layer norm computed in x's dtype (the residual dtype), whatever the parameters' dtype."""
    return F.layer_norm(x, x.shape[-1:], weight.to(x.dtype), bias.to(x.dtype), eps)


def layer_norm_with_stats(x, weight, bias, eps) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(output, mean, rstd): the forward recomputed inside a backward pass."""
    return torch.ops.aten.native_layer_norm(x, list(x.shape[-1:]), weight.to(x.dtype), bias.to(x.dtype), eps)


def layer_norm_backward(
    grad_out: torch.Tensor,
    x: torch.Tensor,
    mean: torch.Tensor,
    rstd: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor,
) -> Tuple[torch.Tensor, Optional[torch.Tensor], Optional[torch.Tensor]]:
    """Gradients w.r.t. (x, weight, bias); parameter grads are returned in the parameters' dtype."""
    output_mask = [True, weight.requires_grad, bias.requires_grad]
    grad_x, grad_w, grad_b = torch.ops.aten.native_layer_norm_backward(
        grad_out.to(x.dtype), x, list(x.shape[-1:]), mean, rstd, weight.to(x.dtype), bias.to(x.dtype), output_mask
    )
    return (
        grad_x,
        None if grad_w is None else grad_w.to(weight.dtype),
        None if grad_b is None else grad_b.to(bias.dtype),
    )
