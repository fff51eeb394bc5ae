"""Rotary position embeddings (GPT-NeoX half-split layout).

cos/sin tables are computed once per forward pass and shared by every layer (never stored per layer).
"""

from __future__ import annotations

from typing import Tuple

import torch

RotaryTables = Tuple[torch.Tensor, torch.Tensor]


def rotary_tables(seq_len: int, head_dim: int, base: float, device, dtype) -> RotaryTables:
    """cos and sin of shape [seq_len, 1, head_dim // 2], broadcastable over [batch, seq, heads, half]."""
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float64) / head_dim))
    angles = torch.outer(torch.arange(seq_len, device=device, dtype=torch.float64), inv_freq)
    return angles.cos().to(dtype)[:, None, :], angles.sin().to(dtype)[:, None, :]


def rotary_tables_at(positions: torch.Tensor, head_dim: int, base: float, dtype) -> RotaryTables:
    """cos and sin at explicit positions ([batch, seq] ints, e.g. after left padding or past a KV cache):
    shape [batch, seq, 1, head_dim // 2]; the same values rotary_tables gives at those positions."""
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.float64) / head_dim))
    angles = positions.to(torch.float64)[..., None] * inv_freq
    return angles.cos().to(dtype)[:, :, None, :], angles.sin().to(dtype)[:, :, None, :]


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """Rotate pairs (x[..., i], x[..., i + d/2]) by +angle (or -angle when inverse); autograd-friendly.

    x: [batch, seq, heads, head_dim]. The inverse rotation is the transpose, which is exactly what a
    backward pass needs.
    """
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    if inverse:
        sin = -sin
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def rotate_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """In-place rotate(x) for custom forward passes (x may be a strided view); one temporary half."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    x1_sin = x1 * sin
    x1.mul_(cos).addcmul_(x2, sin, value=-1.0)
    x2.mul_(cos).add_(x1_sin)
    return x


def rotate_inverse_into(grad: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """out = rotate(grad, inverse=True) without temporaries (out must not overlap grad)."""
    half = grad.shape[-1] // 2
    g1, g2 = grad[..., :half], grad[..., half:]
    o1, o2 = out[..., :half], out[..., half:]
    torch.mul(g1, cos, out=o1).addcmul_(g2, sin)
    torch.mul(g2, cos, out=o2).addcmul_(g1, sin, value=-1.0)
    return out
