"""LAMB with 8-bit statistics for the CPU: the optimizer that hivemind.Optimizer offloads to host memory.

bitsandbytes 0.50.2's ``LAMB8bit`` has no trust ratio in its 8-bit path (it is AdamW there) and cannot
clip by the global gradient norm, so this optimizer does the LAMB math itself and uses bitsandbytes only
for what it is good at: blockwise 8-bit quantization of the two moment estimates (about 2 bytes per
parameter instead of 8). Steps:

1. the global norm of all gradients (which hivemind has already averaged across the swarm) is computed;
   if it is NaN/inf the whole step is skipped and counted, otherwise it is clipped to ``max_grad_norm``;
2. per tensor: Adam moments (optionally bias-corrected), plus decoupled weight decay for decaying groups;
3. the update is scaled by the trust ratio min(|p|, clamp_value) / |update| (LAMB, You et al. 2019).
"""

from __future__ import annotations

import logging
import math
from typing import Iterable, Optional

import torch

logger = logging.getLogger(__name__)

BLOCK_SIZE = 256  # elements per quantization block; one fp32 absmax per block
_QUANTIZED_KEYS = ("exp_avg_q", "exp_avg_sq_q")


def _bnb_functional():
    # imported lazily: importing bitsandbytes prints a warning about optional CPU kernels
    import bitsandbytes.functional as bnb_functional

    return bnb_functional


class CPULamb8Bit(torch.optim.Optimizer):
    """LAMB whose moment estimates are stored blockwise-quantized to 8 bits with bitsandbytes.

    State is created eagerly at construction, so ``state_dict()`` always has the same structure: hivemind
    relies on that to ship optimizer state to joining peers (and then skips its zero-gradient warm-up step).

    The state sits on each parameter's device: the host for the CPU copies hivemind.Optimizer hands it (sync mode),
    a GPU for the model's own parameters there (the inner optimizer of --sync_mode local, which steps after every
    local step: on the host that would cost about 40 ns per parameter each time, more than a GPU's compute).
    """

    def __init__(
        self,
        params: Iterable,
        *,
        lr: float = 1e-3,
        betas=(0.9, 0.999),
        eps: float = 1e-6,
        weight_decay: float = 0.0,
        clamp_value: float = 10.0,
        bias_correction: bool = True,
        max_grad_norm: Optional[float] = None,
        min_8bit_size: int = 4096,
    ):
        if lr < 0 or eps <= 0 or weight_decay < 0 or clamp_value <= 0:
            raise ValueError(
                f"invalid LAMB hyperparameters: lr={lr}, eps={eps}, weight_decay={weight_decay}, "
                f"clamp_value={clamp_value} (need lr >= 0, eps > 0, weight_decay >= 0, clamp_value > 0)"
            )
        if not all(0.0 <= beta < 1.0 for beta in betas):
            raise ValueError(f"betas must be in [0, 1), got {betas}")
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay)
        super().__init__(params, defaults)
        self.clamp_value, self.bias_correction = clamp_value, bias_correction
        self.max_grad_norm, self.min_8bit_size = max_grad_norm, min_8bit_size
        functional = _bnb_functional()
        self._signed_code = functional.create_dynamic_map(signed=True)
        self._unsigned_code = functional.create_dynamic_map(signed=False)
        self.skipped_steps = 0  # steps skipped because the averaged gradients were NaN/inf
        self.last_grad_norm: Optional[float] = None
        for group in self.param_groups:
            for param in group["params"]:
                self._init_state(param)

    @torch.no_grad()
    def _init_state(self, param: torch.Tensor) -> None:
        state = self.state[param]
        state["step"] = 0
        if self._is_quantized(param):
            blocks = (param.numel() + BLOCK_SIZE - 1) // BLOCK_SIZE
            for name in ("exp_avg", "exp_avg_sq"):
                # zeros quantize to code index of 0.0 with any absmax; start from a real quantization of zeros
                state[f"{name}_q"], state[f"{name}_absmax"] = self._quantize(
                    torch.zeros_like(param, dtype=torch.float32),
                    signed=name == "exp_avg",
                    out=torch.empty(param.shape, dtype=torch.uint8, device=param.device),
                    absmax=torch.empty(blocks, dtype=torch.float32, device=param.device),
                )
        else:
            state["exp_avg"] = torch.zeros_like(param, dtype=torch.float32)
            state["exp_avg_sq"] = torch.zeros_like(param, dtype=torch.float32)

    def _is_quantized(self, param: torch.Tensor) -> bool:
        return param.numel() >= self.min_8bit_size

    def _quantize(self, values: torch.Tensor, *, signed: bool, out: torch.Tensor, absmax: torch.Tensor):
        code = self._signed_code if signed else self._unsigned_code
        _bnb_functional().quantize_blockwise(
            values.contiguous(), code=code, absmax=absmax, out=out, blocksize=BLOCK_SIZE
        )
        return out, absmax

    def _dequantize(self, quantized: torch.Tensor, absmax: torch.Tensor, *, signed: bool) -> torch.Tensor:
        code = self._signed_code if signed else self._unsigned_code
        return _bnb_functional().dequantize_blockwise(quantized, absmax=absmax, code=code, blocksize=BLOCK_SIZE)

    def load_state_dict(self, state_dict: dict) -> None:
        super().load_state_dict(state_dict)
        # torch casts every state tensor to the parameter's device and dtype; the 8-bit codes must stay uint8
        for state in self.state.values():
            for key in _QUANTIZED_KEYS:
                if key in state and state[key].dtype != torch.uint8:
                    state[key] = state[key].round().clamp_(0, 255).to(torch.uint8)

    @torch.no_grad()
    def global_grad_norm(self) -> torch.Tensor:
        norms = [
            p.grad.detach().float().norm() for group in self.param_groups for p in group["params"] if p.grad is not None
        ]
        return torch.stack(norms).norm() if norms else torch.zeros(())

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        grad_norm = self.global_grad_norm()
        self.last_grad_norm = float(grad_norm)
        if not math.isfinite(self.last_grad_norm):
            self.skipped_steps += 1
            logger.warning(
                "Skipping the optimizer step: the averaged gradients contain NaN/inf (%d such steps so far)",
                self.skipped_steps,
            )
            return loss
        clip_coef = 1.0
        if self.max_grad_norm and self.last_grad_norm > self.max_grad_norm:
            clip_coef = self.max_grad_norm / (self.last_grad_norm + 1e-6)
        for group in self.param_groups:
            for param in group["params"]:
                if param.grad is not None:
                    self._update_param(param, group, clip_coef)
        return loss

    def _update_param(self, param: torch.Tensor, group: dict, clip_coef: float) -> None:
        state = self.state[param]
        beta1, beta2 = group["betas"]
        grad = param.grad.detach().float().to(param.device)
        if clip_coef != 1.0:
            grad = grad * clip_coef
        state["step"] += 1
        step = state["step"]

        quantized = "exp_avg_q" in state
        if quantized:
            exp_avg = self._dequantize(state["exp_avg_q"], state["exp_avg_absmax"], signed=True)
            exp_avg_sq = self._dequantize(state["exp_avg_sq_q"], state["exp_avg_sq_absmax"], signed=False)
        else:
            exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
        exp_avg.mul_(beta1).add_(grad, alpha=1.0 - beta1)
        exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1.0 - beta2)
        if quantized:
            self._quantize(exp_avg, signed=True, out=state["exp_avg_q"], absmax=state["exp_avg_absmax"])
            self._quantize(exp_avg_sq, signed=False, out=state["exp_avg_sq_q"], absmax=state["exp_avg_sq_absmax"])

        if self.bias_correction:
            first, second = 1.0 - beta1**step, 1.0 - beta2**step
        else:
            first = second = 1.0
        update = (exp_avg / first) / ((exp_avg_sq / second).sqrt_().add_(group["eps"]))
        param_fp32 = param.detach().float()
        if group["weight_decay"]:
            update.add_(param_fp32, alpha=group["weight_decay"])

        weight_norm = float(param_fp32.norm().clamp(0.0, self.clamp_value))
        update_norm = float(update.norm())
        trust_ratio = weight_norm / update_norm if weight_norm > 0 and update_norm > 0 else 1.0
        param.add_(update.to(param.dtype), alpha=-group["lr"] * trust_ratio)
