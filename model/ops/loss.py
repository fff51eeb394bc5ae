"""Token-level cross-entropy over a (tied) output embedding, computed in chunks of tokens.

``ChunkedLMLossFunction`` never materialises (tokens x vocab) logits for the whole batch. Each chunk's
logits are turned into the softmax gradient right away, in forward, and folded into the gradients of
the hidden states and of the output embedding; backward only scales them by the incoming gradient.
So the logits are computed once (no recomputation: the head costs what plain autograd costs) and at
most one chunk of them is alive. The price: the weight gradient (vocab x dim, the gradient backward
would produce anyway) is held from forward until backward, and a forward with labels under
grad mode does the backward's matmuls too (without grad mode it computes the loss only).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from model.ops.sublayer import no_autocast

IGNORE_INDEX = -100


def _logits_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)  # softmax in at least fp32


def _compute_dtype(hidden: torch.Tensor, weight: torch.Tensor) -> torch.dtype:
    device_type = hidden.device.type
    return torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else weight.dtype


def lm_loss(
    hidden: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], labels: torch.Tensor, chunk_size: int
) -> torch.Tensor:
    """Mean cross-entropy of ``hidden @ weight.T + bias`` over labels != -100.

    hidden: [tokens, dim], weight: [vocab, dim], labels: [tokens]. chunk_size=0 computes full logits
    with plain autograd (the reference). The mean is over at least one token (0 when all are ignored).
    """
    if chunk_size == 0:
        return _lm_loss_plain(hidden, weight, bias, labels)
    grad_enabled = torch.is_grad_enabled()
    needs = [grad_enabled and tensor is not None and tensor.requires_grad for tensor in (hidden, weight, bias)]
    return ChunkedLMLossFunction.apply(
        hidden, weight, bias, labels, chunk_size, _compute_dtype(hidden, weight), tuple(needs)
    )


def _lm_loss_plain(hidden, weight, bias, labels):
    dtype = _compute_dtype(hidden, weight)
    logits = F.linear(hidden.to(dtype), weight.to(dtype), None if bias is None else bias.to(dtype))
    total = F.cross_entropy(logits.to(_logits_dtype(logits.dtype)), labels, ignore_index=IGNORE_INDEX, reduction="sum")
    return total / (labels != IGNORE_INDEX).sum().clamp(min=1)


class ChunkedLMLossFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, labels, chunk_size: int, dtype: torch.dtype, needs: tuple):
        need_hidden, need_weight, need_bias = needs
        float_dtype = _logits_dtype(dtype)
        valid = labels != IGNORE_INDEX
        count = valid.sum().clamp(min=1)
        total = torch.zeros((), dtype=float_dtype, device=hidden.device)
        grad_hidden = torch.empty_like(hidden) if need_hidden else None
        grad_weight = torch.zeros_like(weight, dtype=float_dtype) if need_weight else None
        grad_bias = torch.zeros_like(bias, dtype=float_dtype) if need_bias else None
        weight_c = weight.to(dtype)
        bias_c = None if bias is None else bias.to(dtype)
        with no_autocast(hidden.device.type):
            for start in range(0, hidden.shape[0], chunk_size):
                end = start + chunk_size
                hidden_chunk = hidden[start:end].to(dtype)
                logits = F.linear(hidden_chunk, weight_c, bias_c).to(float_dtype)
                targets = labels[start:end].clamp(min=0)[:, None]
                chunk_valid = valid[start:end, None]
                target_logits = logits.gather(1, targets)
                row_max = logits.amax(dim=-1, keepdim=True)
                unnormalized = logits.sub_(row_max).exp_()  # in place: one [chunk, vocab] buffer
                sum_exp = unnormalized.sum(dim=-1, keepdim=True)
                total += ((row_max + sum_exp.log() - target_logits) * chunk_valid).sum()
                if not any(needs):
                    continue
                # d loss / d logits = (softmax - onehot) * valid / count, built in place
                weight_per_row = chunk_valid.to(float_dtype) / count
                grad_logits = unnormalized.mul_(weight_per_row / sum_exp)
                grad_logits.scatter_add_(1, targets, -weight_per_row.to(grad_logits.dtype))
                if grad_bias is not None:
                    grad_bias += grad_logits.sum(0)
                grad_logits_c = grad_logits.to(dtype)
                if grad_hidden is not None:
                    grad_hidden[start:end] = grad_logits_c @ weight_c
                if grad_weight is not None:
                    grad_weight.addmm_(grad_logits.t(), hidden_chunk.to(float_dtype))
                del logits, unnormalized, grad_logits, grad_logits_c
        ctx.param_grads = (grad_weight, grad_bias)  # parameter gradients (not activations), handed over in backward
        ctx.save_for_backward(grad_hidden)
        ctx.dtypes = (weight.dtype, None if bias is None else bias.dtype)
        return total / count

    @staticmethod
    def backward(ctx, grad_loss):
        (grad_hidden,) = ctx.saved_tensors
        grad_weight, grad_bias = ctx.param_grads
        weight_dtype, bias_dtype = ctx.dtypes
        # the usual loss.backward() passes exactly 1: hand over the precomputed gradients without a copy
        # (ctx keeps a reference, so autograd never adds into them in place and backward can run again)
        scale = None if bool(grad_loss == 1) else grad_loss

        def scaled(grad, dtype):
            if grad is None:
                return None
            return (grad if scale is None else grad * scale.to(grad.dtype)).to(dtype)

        return (
            scaled(grad_hidden, grad_hidden.dtype if grad_hidden is not None else None),
            scaled(grad_weight, weight_dtype),
            scaled(grad_bias, bias_dtype),
            None,
            None,
            None,
            None,
        )
