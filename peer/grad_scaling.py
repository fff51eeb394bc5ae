"""Per-block gradient scaling for fp16 training: the scale policy (Ramesh et al., 2021).

The model's part (``model/grad_scaling.py``, switched on with ``apply_memory_options(per_block_grad_scaling=
True)``) runs every residual branch's backward at its block's factor and flags the blocks whose gradients
overflowed. This part owns the factors: after a local step's backward, each block's parameter gradients are
unscaled (or, if that block overflowed, zeroed: only that block skips the step) and the factors are updated
per block, like ``torch.amp.GradScaler`` does for its one global scale: halved on an overflow, doubled after
``growth_interval`` clean steps in a row -- unless the block's largest scaled gradient is already within
``growth_headroom`` of fp16's largest value, so that a block that found its range stops probing it with
overflows. Factors stay powers of two, so unscaling is exact.
Used instead of hivemind's GradScaler: the gradients handed to hivemind are already unscaled.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from typing import List

import torch

from model import block_grad_scales
from peer.swarm.validate import integer_at_least, require

logger = logging.getLogger(__name__)

FP16_MAX = torch.finfo(torch.float16).max


def _is_power_of_two(value: float) -> bool:
    return value > 0 and math.frexp(value)[0] == 0.5


@dataclass(frozen=True)
class BlockScalePolicy:
    """How the per-block factors start and change (the defaults are torch.amp.GradScaler's)."""

    init_scale: float = 2.0**16
    """Starting factor of every block (a power of two)."""
    growth_interval: int = 2000
    """A block's factor doubles after this many local steps in a row without an overflow in that block."""
    min_scale: float = 2.0**-24
    """Factors are not halved below this (a block that overflows even there keeps skipping its update)."""
    max_scale: float = 2.0**64
    """Factors are not doubled above this."""
    growth_headroom: float = 4.0
    """A factor doubles only while the block's largest scaled gradient times 2 x this stays below fp16's largest
    value (65504); 0 disables the check (torch's policy: grow and find out)."""

    def __post_init__(self):
        integer_at_least(self, 1, "growth_interval")
        for name in ("init_scale", "min_scale", "max_scale"):
            value = getattr(self, name)
            require(_is_power_of_two(value), f"{name} must be a power of two (unscaling stays exact), got {value!r}")
        require(
            self.min_scale <= self.init_scale <= self.max_scale,
            f"init_scale must lie in [min_scale, max_scale], got {self.init_scale} not in "
            f"[{self.min_scale}, {self.max_scale}]",
        )
        require(self.growth_headroom >= 0, f"growth_headroom must be >= 0, got {self.growth_headroom!r}")


@dataclass
class BlockScaleReport:
    """What one unscale_ did."""

    overflowed: List[str] = field(default_factory=list)
    """Blocks whose gradients overflowed: zeroed for this step, factor halved."""
    grown: List[str] = field(default_factory=list)
    """Blocks whose factor doubled after growth_interval clean steps."""


class PerBlockGradScaler:
    """Scale the loss by block 0's factor, then ``unscale_()`` once per local step, before the optimizer."""

    def __init__(self, model: torch.nn.Module, policy: BlockScalePolicy = BlockScalePolicy()):
        blocks = block_grad_scales(model)
        if blocks is None:
            raise ValueError(
                "the model has no per-block gradient scales: apply model.apply_memory_options(model, "
                "per_block_grad_scaling=True) before building the scaler"
            )
        self.policy = policy
        self._blocks = blocks
        self._groups = blocks.parameter_groups(model)
        self._device = next(model.parameters()).device
        self.scales: List[float] = [policy.init_scale] * len(blocks)
        self._clean_steps = [0] * len(blocks)
        self._push()

    @property
    def names(self) -> List[str]:
        return list(self._blocks.names)

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        """The loss times the factor of block 0 (everything outside the layer stack)."""
        return loss * self.scales[0]

    def unscale_(self) -> BlockScaleReport:
        """Unscale each block's gradients in place, zero those of the blocks that overflowed, update the factors."""
        amax = torch.stack([self._block_amax(index) for index in range(len(self._groups))]).tolist()
        report = BlockScaleReport()
        for index, (params, largest) in enumerate(zip(self._groups, amax)):
            grads = [p.grad for p in params if p.grad is not None]
            name = self._blocks.names[index]
            if not math.isfinite(largest):
                for grad in grads:
                    grad.zero_()
                report.overflowed.append(name)
                self.scales[index] = max(self.scales[index] / 2, self.policy.min_scale)
                self._clean_steps[index] = 0
                continue
            if grads:
                torch._foreach_mul_(grads, 1.0 / self.scales[index])
            self._clean_steps[index] += 1
            if self._clean_steps[index] >= self.policy.growth_interval:
                self._clean_steps[index] = 0
                if self.scales[index] < self.policy.max_scale and self._may_grow(largest):
                    self.scales[index] *= 2
                    report.grown.append(name)
        if report.overflowed:
            logger.info(
                "per-block gradient scaling: overflow in %s; their gradients skip this step, factors halved",
                ", ".join(report.overflowed),
            )
        self._push()
        return report

    def discard_step(self) -> None:
        """Forget this step's overflow flags (the trainer skipped the step for another reason, e.g. a NaN loss)."""
        self._push()

    def _may_grow(self, largest_scaled: float) -> bool:
        return largest_scaled * 2 * self.policy.growth_headroom < FP16_MAX

    def _block_amax(self, index: int) -> torch.Tensor:
        """The block's largest scaled gradient magnitude; inf if it overflowed (flag from backward or a
        non-finite parameter gradient)."""
        flag = self._blocks.found_inf[index]
        grads = [p.grad for p in self._groups[index] if p.grad is not None]
        largest = (
            torch.stack([grad.abs().max() for grad in grads]).max().float()
            if grads
            else flag.new_zeros((), dtype=torch.float32)
        )
        return torch.where(flag | ~torch.isfinite(largest), torch.inf, largest)

    def _push(self) -> None:
        """Hand the factors to the model (on its device) and clear its overflow flags."""
        self._blocks.set_factors(torch.tensor(self.scales, dtype=torch.float64, device=self._device))
