"""Per-block gradient scaling for fp16 training (Ramesh et al., 2021, "per-resblock gradient scaling"): the
autograd part. The scale policy (when a scale grows or shrinks, unscaling parameter gradients, skipping a
block's update) is the trainer's: ``peer/grad_scaling.py``.

Every residual branch (one attention or FFN sub-layer, ``x -> x + f(x)``) is a block with its own factor. In
backward the gradient entering the branch is multiplied by the block's factor, so everything f computes in
fp16 sees its gradient in range; the branch's gradient to the residual stream is divided back, its non-finite
entries are zeroed (so an overflow in one block does not poison the blocks below it) and the block is
flagged. The residual stream's gradient itself stays unscaled (it is float32 under autocast).

Block 0 is everything outside the layer stack (embeddings, final norm, head; a tied embedding is in both
places, so both must share one scale): the caller multiplies the loss by its factor; the stack divides it
out of the gradient that enters the stack (filtering and flagging like a branch) and multiplies it back
into the gradient that leaves the stack for the embeddings.

Forward is unchanged, and with power-of-two factors backward is exact (the float64 tests prove both).
"""

from __future__ import annotations

from typing import List, Sequence

import torch
import torch.nn as nn

OUTSIDE = "outside"  # the name of block 0


class BlockGradScales:
    """The factors and overflow flags of one model's blocks (block 0: outside the stack)."""

    def __init__(self, names: Sequence[str], modules: Sequence[nn.Module]):
        if len(names) != len(modules) + 1 or names[0] != OUTSIDE:
            raise ValueError("names are 'outside' followed by one name per branch module")
        self.names: List[str] = list(names)
        self.modules: List[nn.Module] = list(modules)  # the branch of block i is modules[i - 1]
        # float64: any power of two a float64 model may use; a 0-d factor keeps each gradient's dtype
        self.factors = torch.ones(len(names), dtype=torch.float64)
        self.found_inf = torch.zeros(len(names), dtype=torch.bool)

    def __len__(self) -> int:
        return len(self.names)

    def set_factors(self, factors: torch.Tensor) -> None:
        """New factors (one per block, on the device the backward runs on); clears the flags."""
        if factors.shape != (len(self),):
            raise ValueError(f"expected {len(self)} factors, got shape {tuple(factors.shape)}")
        self.factors = factors.to(torch.float64)
        self.found_inf = torch.zeros(len(self), dtype=torch.bool, device=factors.device)

    def parameter_groups(self, model: nn.Module) -> List[List[nn.Parameter]]:
        """The parameters each block's gradients reach, in block order; block 0 gets all the others."""
        branches = [list(module.parameters()) for module in self.modules]
        inside = {id(p) for group in branches for p in group}
        return [[p for p in model.parameters() if id(p) not in inside], *branches]


class BranchGradScale:
    """What one branch module needs: the model's scales and its block index."""

    def __init__(self, scales: BlockGradScales, index: int):
        self.scales, self.index = scales, index

    def branch(self, hidden: torch.Tensor, compute) -> torch.Tensor:
        """``compute(x)`` (the branch f, without its residual add) with this block's factor in backward."""
        return multiply_grad(compute(divide_grad(hidden, self.scales, self.index)), self.scales, self.index)


class _IdentityForward(torch.autograd.Function):
    """Identity in forward (a view, no copy); subclasses act on the gradient of one block."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, scales: BlockGradScales, index: int):
        ctx.scales, ctx.index = scales, index
        return x.view_as(x)


class _MultiplyGrad(_IdentityForward):
    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad * ctx.scales.factors[ctx.index], None, None


class _DivideGrad(_IdentityForward):
    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        scales, index = ctx.scales, ctx.index
        grad = grad / scales.factors[index]
        bad = ~torch.isfinite(grad)
        scales.found_inf[index] |= bad.any()  # stays on the device: no synchronisation in backward
        return grad.masked_fill(bad, 0), None, None


def multiply_grad(x: torch.Tensor, scales: BlockGradScales, index: int) -> torch.Tensor:
    """Identity in forward; backward multiplies the gradient by block ``index``'s factor."""
    return _MultiplyGrad.apply(x, scales, index)


def divide_grad(x: torch.Tensor, scales: BlockGradScales, index: int) -> torch.Tensor:
    """Identity in forward; backward divides the gradient by block ``index``'s factor, zeroes its non-finite
    entries and flags the block if there were any."""
    return _DivideGrad.apply(x, scales, index)
