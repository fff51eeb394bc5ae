"""Rotary position embeddings (GPT-NeoX half-split layout).

cos/sin tables are computed once per forward pass and shared by every layer (never stored per layer).
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch

RotaryTables = Tuple[torch.Tensor, torch.Tensor]


def rotary_tables(seq_len: int, head_dim: int, base: float, device, dtype) -> RotaryTables:
    """cos and sin of shape [seq_len, 1, head_dim // 2], broadcastable over [batch, seq, heads, half]."""
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float64) / head_dim))
    angles = torch.outer(torch.arange(seq_len, device=device, dtype=torch.float64), inv_freq)
    return angles.cos().to(dtype)[:, None, :], angles.sin().to(dtype)[:, None, :]


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool = False,
           out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Rotate pairs (x[..., i], x[..., i + d/2]) by +angle (or -angle when inverse).

    x: [batch, seq, heads, head_dim]. The inverse rotation is the transpose, which is exactly what the
    backward pass needs. ``out`` may alias x's storage only if it is x itself (handled via temporaries).
    """
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    if inverse:
        sin = -sin
    first = x1 * cos - x2 * sin
    second = x2 * cos + x1 * sin
    if out is None:
        return torch.cat([first, second], dim=-1)
    out[..., :half].copy_(first)
    out[..., half:].copy_(second)
    return out
