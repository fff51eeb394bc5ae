"""Activations with explicit derivatives, so custom backward passes never keep activation outputs."""

from __future__ import annotations

from typing import Callable, Dict, Tuple

import torch
import torch.nn.functional as F

Forward = Callable[[torch.Tensor], torch.Tensor]
Backward = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (grad_out, pre_activation) -> grad_pre


def _relu_backward(grad: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
    return torch.ops.aten.threshold_backward(grad, pre, 0)


ACTIVATIONS: Dict[str, Tuple[Forward, Backward]] = {
    "gelu": (F.gelu, lambda grad, pre: torch.ops.aten.gelu_backward(grad, pre)),
    "gelu_tanh": (
        lambda x: F.gelu(x, approximate="tanh"),
        lambda grad, pre: torch.ops.aten.gelu_backward(grad, pre, approximate="tanh"),
    ),
    "relu": (F.relu, _relu_backward),
    "silu": (F.silu, lambda grad, pre: torch.ops.aten.silu_backward(grad, pre)),
}


def activate(pre: torch.Tensor, name: str, gated: bool) -> torch.Tensor:
    """act(pre), or act(gate) * linear for gated FFNs where pre = [gate | linear] on the last dim."""
    forward = ACTIVATIONS[name][0]
    if not gated:
        return forward(pre)
    gate, linear = pre.chunk(2, dim=-1)
    return forward(gate) * linear


def activate_backward(grad_hidden: torch.Tensor, pre: torch.Tensor, name: str, gated: bool) -> torch.Tensor:
    """d activate(pre) / d pre, contracted with grad_hidden."""
    forward, backward = ACTIVATIONS[name]
    if not gated:
        return backward(grad_hidden, pre)
    gate, linear = pre.chunk(2, dim=-1)
    return torch.cat([backward(grad_hidden * linear, gate), grad_hidden * forward(gate)], dim=-1)
