"""Linear projections inside custom autograd Functions.

Dense ``nn.Linear`` layers use closed-form gradients. Any other projection module (PixelFly
block-sparse, shared matrix + adapter) is handled generically: its forward is recomputed from the
saved input under ``torch.enable_grad`` inside the backward pass and differentiated with autograd.
That costs one extra forward of that projection but keeps the memory savings of the surrounding
Function, and needs nothing from the module except its registered parameters.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass(frozen=True)
class ComputeContext:
    """Dtype and autocast state a sub-layer computes in (captured in forward, replayed in backward)."""

    device_type: str
    dtype: torch.dtype
    autocast: bool

    @classmethod
    def current(cls, device: torch.device, param_dtype: torch.dtype) -> "ComputeContext":
        device_type = device.type
        if torch.is_autocast_enabled(device_type):
            return cls(device_type, torch.get_autocast_dtype(device_type), True)
        return cls(device_type, param_dtype, False)

    def autocast_context(self):
        """The autocast state of the forward pass; used around generic (non-dense) projections."""
        return torch.autocast(self.device_type, dtype=self.dtype, enabled=self.autocast)


def projection_params(module: nn.Module) -> List[torch.Tensor]:
    return list(module.parameters())


def is_dense(module: nn.Module) -> bool:
    return type(module) is nn.Linear


def project(module: nn.Module, x: torch.Tensor, ctx: ComputeContext) -> torch.Tensor:
    """module(x) in the compute dtype, called from a Function's forward (grad mode off)."""
    if is_dense(module):
        bias = None if module.bias is None else module.bias.to(ctx.dtype)
        return F.linear(x, module.weight.to(ctx.dtype), bias)
    with ctx.autocast_context():
        return module(x).to(ctx.dtype)


def project_backward(
    module: nn.Module, x: torch.Tensor, grad_y: torch.Tensor, ctx: ComputeContext, need_input_grad: bool = True
) -> Tuple[Optional[torch.Tensor], List[Optional[torch.Tensor]]]:
    """(grad_x, grads of projection_params(module)) given the forward input x and grad of the output."""
    params = projection_params(module)
    if is_dense(module):
        weight = module.weight
        grad_x = torch.matmul(grad_y, weight.to(ctx.dtype)) if need_input_grad else None
        grad_2d = grad_y.reshape(-1, grad_y.shape[-1])
        grads: List[Optional[torch.Tensor]] = []
        for param in params:
            if not param.requires_grad:
                grads.append(None)
            elif param is weight:
                grads.append(torch.matmul(grad_2d.t(), x.reshape(-1, x.shape[-1])).to(param.dtype))
            else:  # bias
                grads.append(grad_2d.sum(0).to(param.dtype))
        return grad_x, grads

    with torch.enable_grad():
        x_leaf = x.detach().requires_grad_(need_input_grad)
        with ctx.autocast_context():
            y = module(x_leaf)
        inputs = ([x_leaf] if need_input_grad else []) + [p for p in params if p.requires_grad]
        computed = iter(torch.autograd.grad(y, inputs, grad_y.to(y.dtype), allow_unused=True))
    grad_x = next(computed) if need_input_grad else None
    grads = [next(computed) if p.requires_grad else None for p in params]
    return grad_x, grads
