"""Seeded dropout: masks come from a private generator seeded from the global RNG.

Drawing one seed per call (instead of sampling the mask from the global generator) lets a custom
backward regenerate the exact mask instead of saving it, and makes the custom and the plain-autograd
paths draw identical masks, so their results can be compared exactly.
"""

from __future__ import annotations

from typing import Optional

import torch

_SEED_RANGE = 2**62


def draw_seed(p: float, training: bool) -> Optional[int]:
    """One seed from the global (CPU) generator, or None when dropout is inactive (no RNG consumed)."""
    if not training or p == 0.0:
        return None
    return int(torch.randint(_SEED_RANGE, (), dtype=torch.int64))


def keep_mask(shape, p: float, seed: int, device, dtype) -> torch.Tensor:
    """Scaled keep mask (values 0 or 1/(1-p)) determined only by (shape, p, seed, device)."""
    generator = torch.Generator(device=device)
    generator.manual_seed(seed)
    mask = torch.empty(shape, device=device, dtype=dtype)
    mask.bernoulli_(1.0 - p, generator=generator)
    return mask.div_(1.0 - p)


def seeded_dropout(x: torch.Tensor, p: float, seed: Optional[int]) -> torch.Tensor:
    """Plain-autograd dropout with a replayable mask (identity when seed is None)."""
    if seed is None:
        return x
    return x * keep_mask(x.shape, p, seed, x.device, x.dtype)


def seeded_dropout_(x: torch.Tensor, p: float, seed: Optional[int]) -> torch.Tensor:
    """In-place variant for custom forward/backward passes (no autograd)."""
    if seed is None:
        return x
    return x.mul_(keep_mask(x.shape, p, seed, x.device, x.dtype))
